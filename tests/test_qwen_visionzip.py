"""VisionZip on Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers (tiny random models, CPU): the scores from the
last full-attention block (un-permuted from Qwen2.5-VL's windows, pooled over each 2x2 merge group) against a naive
eager reference, the budget's token count, the reduced prompt against the model's own forward fed the same
features and 3-D positions (Qwen3-VL's DeepStack features pruned in step), several images, every Qwen family's native
video, batched against alone, the overlay on the merged grid."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AttentionInterface

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.decoding.qwen_vision import score_block, tower_pass
from prefixkv_core.decoding.vision_tokens import reduce_image
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.models.families import hooks
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.reduction import CropMerge, VisionPlan
from prefixkv_core.policies.crop_ranking import dominant_scores
from prefixkv_core.policies.visionzip import VisionZipPolicy
from prefixkv_core.testing import QWEN_FAMILIES, moving_dot_frames, wide_noise_picture

PROMPT = "describe the pictures in detail"
TWO_IMAGES = "first <image> then <image> " + PROMPT
VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("models"))
    return {family: M.load_model(f"tiny-{family}", device="cpu", cache_dir=cache) for family in QWEN_FAMILIES}


@pytest.fixture(params=QWEN_FAMILIES)
def lm(request, models):
    return models[request.param]


@pytest.fixture(params=VIDEO_FAMILIES)
def video_lm(request, models):
    return models[request.param]


frames = moving_dot_frames  # a clip of a moving dot


def pictures():
    picture = wide_noise_picture()
    return [picture, picture.resize((48, 40))]


def two_image_prompt(lm):
    inputs = M.encode(lm, pictures(), M.format_prompt(lm, TWO_IMAGES, 2))
    return inputs, inputs["input_ids"], lm.visual_mask(inputs["input_ids"])


def video_prompt(lm):
    picture = frames(1, (48, 40))[0]
    text = M.format_prompt(lm, "<image> photo, <video> clip: " + PROMPT, 1)
    inputs = M.encode(lm, [picture], text, video=frames(4), video_fps=2.0)
    return inputs, inputs["input_ids"], lm.visual_mask(inputs["input_ids"])


# -- the scores against a naive eager reference --------------------------------------------------------------------

def eager_block_attention(lm, vision: dict) -> list[torch.Tensor]:
    """Per crop (each image, each temporal group of a video; images first), the attention probabilities [heads, T, T]
    the chosen block computes in an eager run of the tower, in the images' own patch order: the probabilities the
    eager attention function returns, chunk by chunk, put back from Qwen2.5-VL's window order."""
    from transformers.vision_utils import get_vision_window_index

    model = lm.model
    visual = model.model.visual
    chosen = score_block(model.config)
    module = sys.modules[type(visual.blocks[0].attn).__module__]
    state = {"block": None}
    found: list[torch.Tensor] = []

    def recording(mod, query, key, value, attention_mask, **kwargs):
        out, weights = module.eager_attention_forward(mod, query, key, value, attention_mask, **kwargs)
        if state["block"] == chosen:
            found.append(weights[0].float())
        return out, weights

    def entering(k):
        def hook(mod, args, kwargs):
            state["block"] = k
        return hook

    name = "test_eager_recording"
    AttentionInterface.register(name, recording)
    previous = {"text_config": model.config.get_text_config()._attn_implementation or "sdpa",
                "vision_config": model.config.vision_config._attn_implementation or "sdpa"}
    handles = [blk.register_forward_pre_hook(entering(k), with_kwargs=True) for k, blk in enumerate(visual.blocks)]
    crops = []
    try:
        model.set_attn_implementation({"text_config": previous["text_config"], "vision_config": name})
        for pixels, grid, call in ((vision.get("pixel_values"), vision.get("image_grid_thw"), "image"),
                                   (vision.get("pixel_values_videos"), vision.get("video_grid_thw"), "video")):
            if pixels is None:
                continue
            found.clear()
            with torch.inference_mode():
                if call == "image":
                    model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
                else:
                    model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grid)
            order = torch.arange(int(grid.prod(-1).sum()))
            if hasattr(visual, "fullatt_block_indexes"):
                window, _ = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size,
                                                    visual.patch_size)
                unit = visual.spatial_merge_unit
                order = (window[:, None] * unit + torch.arange(unit)).flatten()  # tower slot i holds patch order[i]
            at = 0
            for weights in found:  # one chunk per crop at a full-attention block
                t = weights.shape[-1]
                local = order[at:at + t] - at
                assert int(local.min()) == 0 and int(local.max()) == t - 1  # the crop's own patches
                back = torch.argsort(local)
                crops.append(weights[:, back][:, :, back])
                at += t
            assert at == int(grid.prod(-1).sum())
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(name, None)
        for handle in handles:
            handle.remove()
    return crops


def naive_scores(probs: torch.Tensor, unit: int) -> torch.Tensor:
    """[heads, T, T] -> [T / unit]: the attention each patch receives, averaged over queries and heads, then over
    its merge group's patches."""
    received = probs.mean(dim=0).mean(dim=0)
    return received.reshape(-1, unit).mean(dim=1)


def test_the_scoring_block_is_the_last_full_attention_one(models):
    assert score_block(models["qwen2-vl"].model.config) == models["qwen2-vl"].model.config.vision_config.depth - 1
    assert score_block(models["qwen2.5-vl"].model.config) == max(
        models["qwen2.5-vl"].model.config.vision_config.fullatt_block_indexes)
    assert score_block(models["qwen3-vl"].model.config) == models["qwen3-vl"].model.config.vision_config.depth - 1


def _check_scores(lm, vision):
    unit = int(lm.model.config.vision_config.spatial_merge_size) ** 2
    tower = tower_pass(lm.model, vision)
    reference = eager_block_attention(lm, vision)
    assert len(reference) == len(tower.attention)
    for probs, attention, keys in zip(reference, tower.attention, tower.keys):
        assert attention.shape == (probs.shape[-1] // unit,) * 2 and keys.shape[0] == attention.shape[0]
        torch.testing.assert_close(dominant_scores(attention, False), naive_scores(probs, unit), atol=1e-5, rtol=1e-4)
    return tower, reference


@pytest.mark.parametrize("query_block", [1024, 8], ids=["whole", "in-blocks-of-queries"])
def test_scores_equal_the_eager_reference_over_two_images(lm, query_block, monkeypatch):
    from prefixkv_core.decoding import qwen_vision

    monkeypatch.setattr(qwen_vision, "_QUERY_BLOCK", query_block)
    inputs, _, _ = two_image_prompt(lm)
    tower, reference = _check_scores(lm, M.vision_inputs(inputs))
    assert len(reference) == 2
    # the features are the model's own (the hook only reads the block's inputs)
    with torch.inference_mode():
        own = torch.cat(list(lm.model.get_image_features(**{k: v for k, v in M.vision_inputs(inputs).items()},
                                                          return_dict=True).pooler_output))
    torch.testing.assert_close(tower.image, own)


def test_scores_equal_the_eager_reference_over_a_video(video_lm):
    inputs, _, _ = video_prompt(video_lm)
    vision = M.vision_inputs(inputs)
    _, reference = _check_scores(video_lm, vision)
    assert len(reference) == 1 + int(vision["video_grid_thw"][0, 0])  # the image, then each temporal group


# -- the budget --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget_of,budget", [("image", 0.5), ("image", 0.25), ("cache", 0.6)])
def test_the_kept_count_is_the_budgets(lm, budget_of, budget):
    inputs, ids, is_image = two_image_prompt(lm)
    n, total = ids.shape[1], int(is_image.sum())
    per_image = [int(g.prod()) // 4 for g in inputs["image_grid_thw"]]
    policy = make_policy("visionzip", budget, budget_of=budget_of)
    wanted = policy.kept_image_tokens(n, total)
    with torch.inference_mode():
        reduced = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id)
    expected = [max(1, int(round(wanted * k / total))) for k in per_image]
    assert reduced.record.tokens == sum(expected) < total
    assert reduced.ids.shape[1] == n - total + sum(expected)
    assert np.bincount(reduced.record.images).tolist() == expected  # each image its share
    contextual = reduced.record.counts["contextual"]
    assert contextual == sum(int(round(policy.contextual * k)) if k > 1 else 0 for k in expected)


# -- the reduced prompt against the model's own forward --------------------------------------------------------------

def naive_reduced_inputs(lm, ids, is_image, vision, reduced):
    """From the model's own features (and DeepStack features) and the record: every fed visual token's embedding
    (a dominant one its cell's feature, a contextual one (anchor + mean of the rest) / 2 for the anchor among its
    cells whose position it has), its DeepStack features alike, and every fed token's expected 3-D position."""
    model = lm.model
    with torch.inference_mode():
        outs = []
        if vision.get("pixel_values") is not None:
            outs.append(("image", model.get_image_features(pixel_values=vision["pixel_values"],
                                                           image_grid_thw=vision["image_grid_thw"], return_dict=True)))
        if vision.get("pixel_values_videos") is not None:
            outs.append(("video", model.get_video_features(pixel_values_videos=vision["pixel_values_videos"],
                                                           video_grid_thw=vision["video_grid_thw"], return_dict=True)))
    feats = {kind: torch.cat(list(o.pooler_output)).float() for kind, o in outs}
    stacks = {kind: [torch.cat(list(d)).float() for d in o.deepstack_features]
              for kind, o in outs if getattr(o, "deepstack_features", None)}
    positions, _ = hooks(lm.family).rope_index(model, ids, vision)
    # the original visual tokens in prompt order: which features row each is
    kinds = np.where((ids[0] == lm.image_token_id).numpy(), "image", "video")
    where = is_image[0].nonzero().flatten().numpy()
    rows, counters = [], {"image": 0, "video": 0}
    for p in where:
        rows.append((kinds[p], counters[kinds[p]]))
        counters[kinds[p]] += 1
    rec = reduced.record
    fed = rec.positions
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(reduced.ids)[0].float().clone()
    expected_pos = torch.zeros(3, reduced.ids.shape[1], dtype=torch.long)
    text_fed = np.setdiff1d(np.arange(reduced.ids.shape[1]), fed)
    text_orig = np.setdiff1d(np.arange(ids.shape[1]), where)
    assert len(text_fed) == len(text_orig)
    expected_pos[:, text_fed] = positions[:, 0, text_orig]
    layers = len(next(iter(stacks.values()))) if stacks else 0
    deep = torch.zeros(layers, len(fed), embeds.shape[-1])
    return _naive_fill(rec, rows, feats, stacks, positions, reduced, fed, where, embeds, expected_pos, deep, layers)


@torch.inference_mode()
def _naive_fill(rec, rows, feats, stacks, positions, reduced, fed, where, embeds, expected_pos, deep, layers):
    for k, (kind, cells) in enumerate(zip(rec.kinds, rec.cells)):
        srcs = [rows[c] for c in cells]
        assert len({s[0] for s in srcs}) == 1
        kind_of = srcs[0][0]
        idx = [s[1] for s in srcs]
        f = feats[kind_of][idx]
        ds = [d[idx] for d in stacks.get(kind_of, [])]
        if kind == "dominant":
            assert len(cells) == 1
            anchors = [0]
        else:
            anchors = [a for a in range(len(cells))
                       if torch.allclose(positions[:, 0, where[cells[a]]], reduced.positions[:, 0, fed[k]])]
            assert anchors, "a contextual token stands at one of its cells"
        a = anchors[0]
        others = [i for i in range(len(cells)) if i != a]
        combine = (lambda x: x[a]) if not others else (lambda x: (x[a] + x[others].mean(dim=0)) / 2)
        embeds[fed[k]] = combine(f)
        for layer in range(layers):
            deep[layer, k] = combine(ds[layer])
        expected_pos[:, fed[k]] = positions[:, 0, where[cells[a]]]
    return embeds, expected_pos, deep


def model_logits(lm, embeds, positions, visual_mask, deep):
    """The model's own forward over input embeddings at explicit 3-D positions; Qwen3-VL's language model also
    given the DeepStack features at the visual positions."""
    model = lm.model
    with torch.inference_mode():
        if deep.shape[0] == 0:
            return model(inputs_embeds=embeds[None].to(model.dtype), position_ids=positions[:, None]).logits[0, -1]
        text = model.model.language_model
        out = text(inputs_embeds=embeds[None].to(model.dtype), position_ids=positions[:, None],
                   visual_pos_masks=visual_mask, deepstack_visual_embeds=list(deep.to(model.dtype)))
        return model.lm_head(out.last_hidden_state[:, -1])[0]


def _check_reduced_prefill(lm, inputs, ids, is_image, policy):
    vision = M.vision_inputs(inputs)
    with torch.inference_mode():
        reduced = reduce_image(lm.model, policy, ids, is_image, vision, lm.image_token_id)
    embeds, expected_pos, deep = naive_reduced_inputs(lm, ids, is_image, vision, reduced)
    torch.testing.assert_close(reduced.positions[:, 0], expected_pos)
    if reduced.inputs_embeds is not None:
        torch.testing.assert_close(reduced.inputs_embeds[0].float(), embeds, atol=1e-5, rtol=1e-5)
    else:  # Qwen3-VL: the features and DeepStack features the forward reads, one row per fed visual token, the
        # images' and the video's apart (each kind onto its own tokens)
        fed = torch.as_tensor(reduced.record.positions)
        fed_ids = reduced.ids[0, fed]
        assert set(reduced.encoder_outputs) == {kind for kind, token in (("image", lm.image_token_id),
                                                                         ("video", lm.video_token_id))
                                                if bool((fed_ids == token).any())}
        for kind, out in reduced.encoder_outputs.items():
            mine = (fed_ids == (lm.video_token_id if kind == "video" else lm.image_token_id)).nonzero().flatten()
            torch.testing.assert_close(torch.cat(list(out.pooler_output)).float(), embeds[fed[mine]], atol=1e-5,
                                       rtol=1e-5)
            assert len(out.deepstack_features) == deep.shape[0] > 0
            for layer, d in enumerate(out.deepstack_features):
                torch.testing.assert_close(torch.cat(list(d)).float(), deep[layer][mine], atol=1e-5, rtol=1e-5)
    with tracked_attention_enabled(lm.model):
        own = runner.prefill_for(lm.model, policy, ids, is_image, vision, lm.num_layers, lm.device,
                                 lm.image_token_id)
    assert own.prompt_len == reduced.ids.shape[1] < ids.shape[1]
    reference = model_logits(lm, embeds, expected_pos, reduced.is_image, deep)
    torch.testing.assert_close(own.logits[0], reference, atol=1e-4, rtol=1e-4)
    # what follows the prompt runs where it runs after the unreduced prompt
    _, deltas = hooks(lm.family).rope_index(lm.model, ids, vision)
    nxt = int(deltas[0]) + ids.shape[1]
    assert int(own.cache.rope_deltas[0]) + own.prompt_len == nxt
    token = torch.tensor([[7]])
    with tracked_attention_enabled(lm.model):
        after = Engine(lm).forward(own.cache, token, own.prompt_len, AttentionProbe())
    with torch.inference_mode():
        token_embed = lm.model.get_input_embeddings()(token)[0].float()
    longer = torch.cat([embeds, token_embed])
    at = torch.cat([expected_pos, torch.full((3, 1), nxt, dtype=torch.long)], dim=1)
    mask = torch.cat([reduced.is_image, torch.zeros(1, 1, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(after, model_logits(lm, longer, at, mask, deep), atol=1e-4, rtol=1e-4)
    return reduced, own


@pytest.mark.parametrize("contextual", [10 / 64, 0.4])
def test_the_reduced_prefill_is_the_models_own_forward(lm, contextual):
    """Two images at half their tokens: the engine's prefill equals the model's own forward fed the reduced
    features (built naively from the model's own features) at the kept tokens' 3-D positions; on Qwen3-VL with each
    fed token's DeepStack features (the dropped tokens' pruned, a contextual token's merged alike); and the next token
    runs at the position it has after the unreduced prompt."""
    inputs, ids, is_image = two_image_prompt(lm)
    policy = make_policy("visionzip", 0.5, budget_of="image", contextual=contextual)
    reduced, _ = _check_reduced_prefill(lm, inputs, ids, is_image, policy)
    assert reduced.record.counts["contextual"] > 0 and reduced.record.counts["dominant"] > 0


def test_a_video_is_reduced_per_temporal_group(video_lm):
    """A Qwen family's native video: each two-frame group is a crop with its share of the budget, its tokens keep
    their (t, h, w); the prefill is the model's own forward over the reduced features."""
    inputs, ids, is_image = video_prompt(video_lm)
    policy = make_policy("visionzip", 0.5, budget_of="image")
    reduced, _ = _check_reduced_prefill(video_lm, inputs, ids, is_image, policy)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    per_group = h * w // 4
    image_tokens = int((ids == video_lm.image_token_id).sum())
    total = image_tokens + t * per_group
    wanted = policy.kept_image_tokens(ids.shape[1], total)
    counts = np.bincount(reduced.record.images, minlength=1 + t).tolist()
    video_share = int(round(wanted * t * per_group / total))
    assert counts[0] == max(1, int(round(wanted * image_tokens / total)))
    assert sum(counts[1:]) == max(video_share, t) and all(c >= 1 for c in counts[1:])
    assert int((reduced.ids == video_lm.video_token_id).sum()) == sum(counts[1:])


@dataclass(frozen=True)
class KeepEverything(VisionZipPolicy):
    """A plan that feeds every token as it is (the reduction's machinery with nothing reduced)."""

    def vision_plan(self, crops):
        t = crops.tokens_per_crop
        return VisionPlan([CropMerge(torch.eye(t), ["dominant"] * t, list(range(t))) for _ in range(crops.num_crops)],
                          projected=crops.merged)


def test_keeping_everything_equals_full(lm):
    """r = 1 of the image: no plan, Full's prefill; a plan that keeps every token through the reduced path (fed
    features, given 3-D positions, DeepStack features): the same logits as Full's."""
    inputs, ids, is_image = two_image_prompt(lm)
    vision = M.vision_inputs(inputs)
    with tracked_attention_enabled(lm.model):
        full = runner.prefill_for(lm.model, make_policy("full", 1.0), ids, is_image, vision, lm.num_layers,
                                  lm.device, lm.image_token_id)
        whole = runner.prefill_for(lm.model, make_policy("visionzip", 1.0, budget_of="image"), ids, is_image,
                                   vision, lm.num_layers, lm.device, lm.image_token_id)
        kept = runner.prefill_for(lm.model, KeepEverything(budget=0.5, budget_of="image"), ids, is_image, vision,
                                  lm.num_layers, lm.device, lm.image_token_id)
    assert whole.reduction is None and whole.prompt_len == ids.shape[1]
    torch.testing.assert_close(whole.logits, full.logits, atol=1e-5, rtol=1e-5)
    assert kept.reduction is not None and kept.reduction.tokens == int(is_image.sum())
    torch.testing.assert_close(kept.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(kept.cache.rope_deltas, full.cache.rope_deltas)


# -- sessions: batched, both modes, the record and the overlay -------------------------------------------------------

@pytest.mark.parametrize("budget_of", ["cache", "image"])
def test_batched_equals_alone(lm, budget_of):
    settings = GenerationSettings(max_new_tokens=4)
    methods = ["full", "h2o", "fastv", "dart", "visionzip"]
    knobs = {"visionzip": {"budget_of": budget_of}}
    batched = Engine(lm).new_session(pictures(), TWO_IMAGES, methods, 0.5, settings, knobs)
    list(batched.run())
    alone = Engine(lm).new_session(pictures(), TWO_IMAGES, ["visionzip"], 0.5, settings, knobs)
    list(alone.run())
    assert batched.states["visionzip"].error is None
    assert batched.states["visionzip"].turn_ids == alone.states["visionzip"].turn_ids


@pytest.mark.parametrize("budget_mode,query_agnostic", [("published", False), ("equal_memory", True)])
def test_two_turns_in_both_modes(lm, budget_mode, query_agnostic):
    session = Engine(lm).new_session(pictures(), TWO_IMAGES, ["full", "visionzip"], 0.5,
                                     GenerationSettings(max_new_tokens=3), {"visionzip": {"budget_of": "image"}},
                                     budget_mode=budget_mode, query_agnostic=query_agnostic)
    list(session.run())
    list(session.follow_up("what else?"))
    state = session.states["visionzip"]
    assert state.error is None and len(state.answers) == 1 and state.finished


def test_the_record_and_the_overlay_show_the_kept_tokens(lm):
    from ui.overlay import overlay

    session = Engine(lm).new_session(pictures(), TWO_IMAGES, ["full", "visionzip"], 0.5,
                                     GenerationSettings(max_new_tokens=2), {"visionzip": {"budget_of": "image"}})
    list(session.run())
    layout = session.image_layout
    sizes = [v.n_tokens for v in layout.views]
    state = session.states["visionzip"]
    sources = state.policy.image_token_sources(state.policy_state)
    fed = np.bincount(sources.images, minlength=2)
    record = session.record.to_dict()["methods"]["visionzip"]
    assert record["kept_per_image"] == [round(float(f / s), 4) for f, s in zip(fed, sizes)]
    facts = {f.key: f.value for f in state.policy.facts(state.policy_state)}
    assert facts["image_kept_share"] == pytest.approx(sources.tokens / sum(sizes))
    shown = session.kept_image_map("visionzip", lm.num_layers - 1)
    assert shown.n_tokens == sum(sizes)
    kept_cells = {int(c[0]) for k, c in zip(sources.kinds, sources.cells) if k == "dominant"}
    assert set(np.flatnonzero(shown.token_share > 0).tolist()) == kept_cells
    view = layout.views[0]
    assert shown.view_share(0).shape == (view.rows, view.cols)
    assert overlay(pictures()[0], shown, "visionzip").width > 0


def test_a_native_video_session_runs(video_lm):
    session = Engine(video_lm).new_session(frames(1, (48, 40))[0], "<image> photo, <video> clip: " + PROMPT,
                                           ["full", "h2o", "visionzip"], 0.5, GenerationSettings(max_new_tokens=3),
                                           {"visionzip": {"budget_of": "image"}}, video=frames(4), frames=4)
    list(session.run())
    assert all(s.error is None for s in session.states.values())
    kept = session.record.to_dict()["methods"]["visionzip"]["kept_per_image"]
    assert len(kept) == 3 and all(0 < k < 1 for k in kept)  # the image, then each temporal group


@pytest.mark.parametrize("where", ["projector_in", "projector_out"])
def test_grid_pooling_is_refused_on_qwen(lm, where):
    """Downsample's grid pooling needs the LLaVA towers' square crops; on Qwen it resizes the image instead."""
    inputs = M.encode(lm, wide_noise_picture().resize((64, 64)), M.format_prompt(lm, PROMPT, 1))
    ids = inputs["input_ids"]
    policy = make_policy("downsample", 0.3, budget_of="image", where=where)
    with pytest.raises(ValueError, match="not on Qwen-VL"):
        reduce_image(lm.model, policy, ids, lm.visual_mask(ids), M.vision_inputs(inputs), lm.image_token_id)
