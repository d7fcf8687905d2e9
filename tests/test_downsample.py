"""Downsample's grid pooling (`where = projector_out`) on every LLaVA family (anyres included): the language model
gets exactly the naive adaptive average pooling of each crop's projected patch grid, in raster order, in a shorter prompt at contiguous positions; the
overlay places every pooled token on the patches it averages; the budget mapping and the facts say what was fed."""
import math

import numpy as np
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding.vision_tokens import reduce_image
from prefixkv_core.decoding.vision_tower import feature_layer
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models.layout import crop_patches
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.downsample import EMBEDDED_NOTE, pool_bins
from prefixkv_core.testing import WIDE_PICTURE_SIZE

PROMPT = "describe the picture in detail"


def _inputs(lm, picture):
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    return inputs, inputs["input_ids"], inputs["input_ids"] == lm.image_token_id


def _naive_pooled(lm, inputs, crops: int, out: int) -> tuple[torch.Tensor, int, bool]:
    """The tower run on its own, its feature layer projected, the CLS token dropped, and each crop's grid pooled
    by torch's adaptive_avg_pool2d -> ([crops, out², H] row-major, side, has_cls)."""
    model = lm.model
    vfl, _ = feature_layer(model.config)
    pixels = inputs["pixel_values"].reshape(-1, *inputs["pixel_values"].shape[-3:])[:crops]
    with torch.inference_mode():
        hidden = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[vfl]
        projected = model.model.multi_modal_projector(hidden).float()
    vc = model.config.vision_config
    side = vc.image_size // vc.patch_size
    has_cls = hidden.shape[1] == side * side + 1
    grid = projected[:, int(has_cls):].reshape(crops, side, side, -1).permute(0, 3, 1, 2)
    pooled = torch.nn.functional.adaptive_avg_pool2d(grid, out)  # [C, H, out, out]
    return pooled.permute(0, 2, 3, 1).reshape(crops, out * out, -1), side, has_cls


def _expected_order(patches, side: int, out: int) -> list[tuple[int, int]]:
    """(crop, pooled token) in the order the language model sees them: the base view row-major, then the tiles'
    pooled tokens in raster order over the whole tile grid by the first patch each averages."""
    bins = pool_bins(side, out)
    firsts = [bins[a][0] * side + bins[b][0] for a in range(out) for b in range(out)]
    order = []
    for view in dict.fromkeys(patches.views):
        crops = [c for c, v in enumerate(patches.views) if v == view]
        order += sorted(((c, k) for c in crops for k in range(out * out)),
                        key=lambda ck: int(patches.raster[ck[0]][firsts[ck[1]]]))
    return order


def test_the_language_model_gets_the_naive_pooled_grid(lm, picture):
    inputs, ids, is_image = _inputs(lm, picture)
    policy = make_policy("downsample", 0.5, budget_of="image")
    with tracked_attention_enabled(lm.model):
        reduced = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id)
    patches = crop_patches(lm.model.config, *WIDE_PICTURE_SIZE)
    crops, n_img = len(patches.tokens), int(is_image.sum())
    out = max(1, round(math.sqrt(round(0.5 * n_img) / crops)))
    pooled, side, _ = _naive_pooled(lm, inputs, crops, out)
    assert out < side
    order = _expected_order(patches, side, out)
    record = reduced.record
    assert record.kinds == ["pooled"] * len(order) and record.tokens == crops * out * out < n_img
    assert record.original_tokens == n_img and record.crops == crops and record.counts["pooled"] == len(order)
    fed = reduced.inputs_embeds[0][reduced.is_image[0]]
    torch.testing.assert_close(fed, torch.stack([pooled[c, k] for c, k in order]), atol=1e-4, rtol=1e-4)
    text = lm.model.get_input_embeddings()(ids[~is_image])  # the text around the image block is the prompt's own
    torch.testing.assert_close(reduced.inputs_embeds[0][~reduced.is_image[0]], text)
    # the overlay: every pooled token covers the prompt image tokens of its bin; together, every shown patch
    bins = pool_bins(side, out)
    for (c, k), cells in zip(order, record.cells):
        (r0, r1), (c0, c1) = bins[k // out], bins[k % out]
        block = patches.tokens[c][[r * side + col for r in range(r0, r1) for col in range(c0, c1)]]
        assert cells.tolist() == sorted(set(block[block >= 0].tolist()))
    shown = np.unique(np.concatenate([t[t >= 0] for t in patches.tokens]))
    kept, merged = record.project(np.ones(record.tokens))
    assert not kept.any() and np.array_equal(np.nonzero(merged)[0], shown)


def test_a_shorter_prompt_at_contiguous_positions_batched_equals_alone(lm, picture):
    engine = Engine(lm)
    settings = GenerationSettings(max_new_tokens=4)
    knobs = {"downsample": {"budget_of": "image", "where": "projector_out"}}
    session = engine.new_session(picture, PROMPT, ["full", "downsample", "random"], 0.5, settings, knobs)
    pre = list(session.run())[0]
    n, n_img = pre.prompt_tokens, pre.image_tokens
    state = session.states["downsample"]
    fed = state.policy_state.sources.tokens
    assert state.prompt_len == n - n_img + fed and state.reduced_by == n_img - fed
    facts = state.policy.facts(state.policy_state)
    values = {f.key: f.value for f in facts}
    assert values["image_fed"] == fed and values["image_kept_share"] == pytest.approx(fed / n_img)  # the share kept
    assert any("grid pooling" in f.text() for f in facts)  # the panel says how it was reduced
    assert EMBEDDED_NOTE not in state.policy_state.notes  # the embedded model's note only
    for layer in state.cache.layers:
        pos = layer.positions[0, 0]
        assert pos.tolist() == list(range(state.true_len))
    overlay = session.kept_image_map("downsample", lm.num_layers - 1)
    assert overlay.n_tokens == n_img and overlay.kept_tokens() == 0 and overlay.merged_tokens() > 0
    list(session.follow_up("and the colours?"))
    alone = engine.new_session(picture, PROMPT, ["downsample"], 0.5, settings, knobs)
    list(alone.run())
    list(alone.follow_up("and the colours?"))
    assert alone.states["downsample"].turn_ids == state.turn_ids
    assert alone.states["downsample"].answers == state.answers


@pytest.mark.parametrize("budget", [0.6, 0.8])
def test_the_cache_budget_asks_for_r_n_minus_the_text(family_models, picture, budget):
    lm = family_models["llava-next"]
    session = Engine(lm).new_session(picture, PROMPT, ["downsample"], budget, GenerationSettings(max_new_tokens=1),
                                     {"downsample": {"where": "projector_out"}})
    pre = list(session.run())[0]
    n, n_img = pre.prompt_tokens, pre.image_tokens
    wanted = round(budget * n) - (n - n_img)
    out = max(1, round(math.sqrt(wanted / 5)))  # the base view and a 2 x 2 grid of tiles
    state = session.states["downsample"]
    assert state.policy_state.sources.tokens == 5 * out * out and state.policy_state.pooled == out


def test_without_anything_to_pool_the_image_is_the_models_own(family_models, picture):
    lm = family_models["llava-onevision"]
    session = Engine(lm).new_session(picture, PROMPT, ["full", "downsample"], 1.0, GenerationSettings(max_new_tokens=5))
    list(session.run())
    state = session.states["downsample"]
    assert state.turn_ids == session.states["full"].turn_ids and state.reduced_by == 0
    assert state.policy_state.sources is None and "every image token is kept" in state.policy_state.notes[0]
    text_only = Engine(lm).new_session(None, PROMPT, ["downsample"], 0.3, GenerationSettings(max_new_tokens=2))
    list(text_only.run())
    assert "no image" in text_only.states["downsample"].policy_state.notes[0]
