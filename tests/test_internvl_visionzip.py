"""VisionZip and Downsample's grid pooling on InternVL's tower (the tiny random InternVL, CPU): the feature layer's
scores pooled over each pixel-shuffle group against a naive eager reference, the dominant and contextual tokens and
the fed features against a naive merge, the budget's token count, the reduced prefill against the model's own
forward, batched against alone in both budget and query modes, the overlay's kept cells on the tiles."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.decoding.internvl_vision import shuffle_groups
from prefixkv_core.decoding.vision_tokens import reduce_image
from prefixkv_core.decoding.vision_tower import vision_features
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.crop_ranking import per_crop_counts
from prefixkv_core.testing import save_tiny_family, wide_noise_picture

PROMPT = "describe the pictures in detail"
TWO_IMAGES = "first <image> then <image> " + PROMPT


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return M.load_model(save_tiny_family(tmp_path_factory.mktemp("internvl"), "internvl"), device="cpu")


def square():
    """Large enough for 2x2 tiles and a thumbnail (5 tiles of 16 tokens)."""
    rng = np.random.RandomState(5)
    return Image.fromarray(rng.randint(0, 256, (96, 96, 3), dtype=np.uint8))


def pictures():
    return [square(), wide_noise_picture().resize((40, 40))]  # 5 tiles, then 1


def prompt(lm, images=None, text=TWO_IMAGES):
    images = images or pictures()
    inputs = M.encode(lm, images, M.format_prompt(lm, text, len(images)))
    ids = inputs["input_ids"]
    return inputs, ids, ids == lm.image_token_id


def geometry(lm):
    vc = lm.model.config.vision_config
    side = int(np.ravel(vc.image_size)[0]) // int(np.ravel(vc.patch_size)[0])
    return side, side // 2  # patches, merged tokens a side


# -- a naive reference: the tower run alone with eager attention ------------------------------------------------------

def blocks(side: int) -> list[list[int]]:
    """Image token (i, j) of the merged grid, row-major -> its 2x2 block of patches (raster indices), as the pixel
    shuffle concatenates them: row 2i's two patches, then row 2i+1's."""
    half = side // 2
    return [[(2 * i + a) * side + 2 * j + b for a in (0, 1) for b in (0, 1)] for i in range(half) for j in range(half)]


@torch.inference_mode()
def eager_reference(lm, pixels):
    """Per tile, from an eager run of the tower alone at its feature layer (the last layer): the CLS token's
    attention to each image token's 2x2 block (heads averaged, block averaged) [C, T'], the blocks' keys (the key
    projection of the layer's normed input, heads averaged, block averaged) [C, T', D] and the projector's inputs
    (each block's four feature vectors concatenated) [C, T', 4 Hv]."""
    model = lm.model
    tower = model.model.vision_tower
    cfg = model.config
    previous = {"text_config": cfg.get_text_config()._attn_implementation or "sdpa",
                "vision_config": cfg.vision_config._attn_implementation or "sdpa"}
    try:
        model.set_attn_implementation({"text_config": previous["text_config"], "vision_config": "eager"})
        out = tower(pixel_values=pixels, output_attentions=True, output_hidden_states=True, return_dict=True)
    finally:
        model.set_attn_implementation(previous)
    layer = cfg.vision_config.num_hidden_layers - 1
    side, _ = geometry(lm)
    groups = blocks(side)
    probs = out.attentions[layer].float().mean(dim=1)  # [C, T, T]
    cls = torch.stack([torch.stack([probs[c, 0, 1:][g].mean() for g in groups]) for c in range(probs.shape[0])])
    block = tower.encoder.layer[layer]
    keys = block.attention.k_norm(block.attention.k_proj(block.layernorm_before(out.hidden_states[layer])))
    heads = cfg.vision_config.num_attention_heads
    keys = keys.reshape(*keys.shape[:2], heads, -1).float().mean(dim=2)[:, 1:]  # [C, side², D]
    keys = torch.stack([torch.stack([keys[c][g].mean(dim=0) for g in groups]) for c in range(keys.shape[0])])
    feats = out.last_hidden_state[:, 1:]
    shuffled = torch.stack([torch.stack([torch.cat([feats[c, p] for p in g]) for g in groups])
                            for c in range(feats.shape[0])])
    return cls, keys, shuffled


def naive_tile(cls: torch.Tensor, keys: torch.Tensor, k: int, gamma: float):
    """One tile's VisionZip by hand: the d tokens the CLS attends to most (ties to the earlier), then c anchors taken
    every max(1, |rest| // c)-th of the rest, each other token joined to the anchor of most cosine-similar key.
    -> (dominant tokens ascending, {anchor: tokens joined})."""
    c = int(round(gamma * k)) if k > 1 else 0
    d = max(1, k - c)
    c = k - d
    order = sorted(range(len(cls)), key=lambda t: (-float(cls[t]), t))
    dominant = sorted(order[:d])
    rest = [t for t in range(len(cls)) if t not in dominant]
    groups: dict[int, list[int]] = {}
    if c and rest:
        c = min(c, len(rest))
        step = max(1, len(rest) // c)
        anchors = rest[::step][:c]
        groups = {a: [] for a in anchors}
        for t in rest:
            if t in groups:
                continue
            sims = [float(torch.nn.functional.cosine_similarity(keys[t], keys[a], dim=0)) for a in anchors]
            groups[anchors[int(np.argmax(sims))]].append(t)
    return dominant, groups


def test_the_shuffle_groups_are_the_2x2_blocks(lm):
    side, half = geometry(lm)
    assert shuffle_groups(lm.model, side).tolist() == blocks(side)
    assert half * half == 16


def test_the_recorded_pass_equals_the_eager_reference(lm):
    """The pass the reductions read (the model's own path with its feature layer recorded): the model's own
    features, the CLS scores and keys pooled over each block, and the projector's input, as the naive eager run
    gives them, for every tile of two images."""
    inputs, _, _ = prompt(lm)
    vision = M.vision_inputs(inputs)
    found = vision_features(lm.model, vision)
    tower = found.internvl
    assert tower is not None and found.recorded
    cls, keys, shuffled = eager_reference(lm, vision["pixel_values"])
    assert tower.cls.shape == (6, 16) and tower.attention.shape == (6, 16, 16)
    torch.testing.assert_close(tower.cls, cls, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tower.keys, keys, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tower.shuffled.float(), shuffled, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        own = lm.model.get_image_features(**vision, return_dict=True).pooler_output
    torch.testing.assert_close(found.image, own.reshape(-1, own.shape[-1]))


# -- the plan against the naive reference --------------------------------------------------------------------------

@pytest.mark.parametrize("budget_of,budget,gamma", [("image", 0.5, 10 / 64), ("image", 0.3, 0.4),
                                                    ("cache", 0.7, 10 / 64)])
def test_dominant_and_contextual_tokens_equal_the_naive_reference(lm, budget_of, budget, gamma):
    """Per tile of two images, the dominant tokens are the top-d blocks of the CLS attention pooled over each block,
    the contextual tokens the naive merge of the rest by pooled keys, and each fed token is the projector's output
    for its block's pixel-shuffled vector (a contextual token: the anchor's plus the mean of those joined to it)."""
    inputs, ids, is_image = prompt(lm)
    vision = M.vision_inputs(inputs)
    policy = make_policy("visionzip", budget, budget_of=budget_of, contextual=gamma)
    with torch.inference_mode():
        reduced = reduce_image(lm.model, policy, ids, is_image, vision, lm.image_token_id)
    cls, keys, shuffled = eager_reference(lm, vision["pixel_values"])
    n, total = ids.shape[1], int(is_image.sum())
    wanted = policy.kept_image_tokens(n, total)
    expected_kinds, expected_cells, expected_feats = [], [], []
    tile, offset = 0, 0
    projector = lm.model.model.multi_modal_projector
    for tokens in (80, 16):
        tiles = tokens // 16
        part = int(round(wanted * tokens / total))
        for c, k in enumerate(per_crop_counts(max(part, tiles), tiles, 16)):
            dominant, groups = naive_tile(cls[tile], keys[tile], k, gamma)
            for t in dominant:
                expected_kinds.append("dominant")
                expected_cells.append([offset + c * 16 + t])
                expected_feats.append(shuffled[tile, t])
            for anchor, joined in groups.items():
                expected_kinds.append("contextual")
                expected_cells.append(sorted(offset + c * 16 + t for t in [anchor] + joined))
                mean = shuffled[tile, joined].mean(dim=0) if joined else torch.zeros_like(shuffled[tile, anchor])
                expected_feats.append(shuffled[tile, anchor] + mean)
            tile += 1
        offset += tokens
    record = reduced.record
    assert record.kinds == expected_kinds
    assert [c.tolist() for c in record.cells] == expected_cells
    with torch.inference_mode():
        expected = projector(torch.stack(expected_feats)[None])[0]
    fed = reduced.inputs_embeds[0, record.positions]
    torch.testing.assert_close(fed.float(), expected.float(), atol=1e-5, rtol=1e-5)
    # the text around the image blocks is the prompt's own
    assert torch.equal(reduced.ids[0, ~reduced.is_image[0]], ids[0, ~is_image[0]])


@pytest.mark.parametrize("budget_of,budget", [("image", 0.5), ("image", 0.25), ("cache", 0.6), ("image", 0.01)])
def test_the_kept_count_is_the_budgets(lm, budget_of, budget):
    """Each image keeps its share of the budget (in proportion to its tokens), at least one token per tile, split
    evenly over its tiles; round(γ k) of each tile's k are contextual."""
    inputs, ids, is_image = prompt(lm)
    n, total = ids.shape[1], int(is_image.sum())
    policy = make_policy("visionzip", budget, budget_of=budget_of)
    wanted = policy.kept_image_tokens(n, total)
    with torch.inference_mode():
        reduced = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id)
    per_tile = [per_crop_counts(max(int(round(wanted * tokens / total)), tokens // 16), tokens // 16, 16)
                for tokens in (80, 16)]
    assert reduced.record.tokens == sum(map(sum, per_tile)) < total
    assert reduced.ids.shape[1] == n - total + reduced.record.tokens
    assert np.bincount(reduced.record.images, minlength=2).tolist() == [sum(t) for t in per_tile]
    contextual = sum(int(round(policy.contextual * k)) if k > 1 else 0 for tiles in per_tile for k in tiles)
    assert reduced.record.counts["contextual"] == contextual
    if budget == 0.01:
        assert reduced.record.tokens == 6  # one a tile


def test_the_reduced_prefill_is_the_models_own_forward(lm):
    """The engine's prefill of the reduced prompt equals the model's own forward fed the reduced embeddings at
    contiguous positions; r = 1 of the image reproduces Full."""
    inputs, ids, is_image = prompt(lm)
    vision = M.vision_inputs(inputs)
    policy = make_policy("visionzip", 0.5, budget_of="image")
    with torch.inference_mode():
        reduced = reduce_image(lm.model, policy, ids, is_image, vision, lm.image_token_id)
    with tracked_attention_enabled(lm.model):
        own = runner.prefill_for(lm.model, policy, ids, is_image, vision, lm.num_layers, lm.device,
                                 lm.image_token_id)
        full = runner.prefill_for(lm.model, make_policy("full", 1.0), ids, is_image, vision, lm.num_layers,
                                  lm.device, lm.image_token_id)
        whole = runner.prefill_for(lm.model, make_policy("visionzip", 1.0, budget_of="image"), ids, is_image,
                                   vision, lm.num_layers, lm.device, lm.image_token_id)
    assert own.prompt_len == reduced.ids.shape[1] < ids.shape[1]
    with torch.inference_mode():
        reference = lm.model(inputs_embeds=reduced.inputs_embeds).logits[0, -1]
    torch.testing.assert_close(own.logits[0], reference, atol=1e-4, rtol=1e-4)
    assert whole.reduction is None
    torch.testing.assert_close(whole.logits, full.logits, atol=1e-5, rtol=1e-5)


# -- Downsample's grid pooling on the tiles' merged grids ------------------------------------------------------------

@pytest.mark.parametrize("where", ["projector_out", "projector_in"])
def test_grid_pooling_pools_each_tiles_image_tokens(lm, where):
    """Each tile's 4x4 grid of image tokens average-pooled (adaptive average pooling's bins): after the projector,
    the model's own features pooled; before it, the projector's output for the pooled pixel-shuffled vectors. The
    prefill equals the model's own forward over those embeddings."""
    inputs, ids, is_image = prompt(lm, [square()], PROMPT)
    vision = M.vision_inputs(inputs)
    policy = make_policy("downsample", 0.3, budget_of="image", where=where)
    with torch.inference_mode():
        reduced = reduce_image(lm.model, policy, ids, is_image, vision, lm.image_token_id)
        own = lm.model.get_image_features(**vision, return_dict=True).pooler_output  # [5, 16, H]
    _, _, shuffled = eager_reference(lm, vision["pixel_values"])
    out = 2  # round(sqrt(0.3 * 80 / 5))
    assert reduced.record.tokens == 5 * out * out and reduced.record.counts["pooled"] == 20
    projector = lm.model.model.multi_modal_projector
    with torch.inference_mode():
        if where == "projector_out":
            grid = own.reshape(5, 4, 4, -1).permute(0, 3, 1, 2).float()
            expected = torch.nn.functional.adaptive_avg_pool2d(grid, out).flatten(2).transpose(1, 2)
        else:
            grid = shuffled.reshape(5, 4, 4, -1).permute(0, 3, 1, 2)
            pooled = torch.nn.functional.adaptive_avg_pool2d(grid, out).flatten(2).transpose(1, 2)
            expected = projector(pooled)
    fed = reduced.inputs_embeds[0, reduced.record.positions]
    torch.testing.assert_close(fed.float(), expected.reshape(-1, expected.shape[-1]).float(), atol=1e-5, rtol=1e-5)
    # each pooled token covers its 2x2 block of its own tile's tokens
    cells = [c.tolist() for c in reduced.record.cells]
    assert cells[:4] == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert cells[-1] == [64 + 10, 64 + 11, 64 + 14, 64 + 15]
    with tracked_attention_enabled(lm.model):
        prefill = runner.prefill_for(lm.model, policy, ids, is_image, vision, lm.num_layers, lm.device,
                                     lm.image_token_id)
    with torch.inference_mode():
        reference = lm.model(inputs_embeds=reduced.inputs_embeds).logits[0, -1]
    torch.testing.assert_close(prefill.logits[0], reference, atol=1e-4, rtol=1e-4)


# -- sessions: batched, both modes, the overlay -----------------------------------------------------------------------

@pytest.mark.parametrize("budget_of", ["cache", "image"])
def test_batched_equals_alone(lm, budget_of):
    """VisionZip and Downsample's pooling, decoded in one batch with the others (one pass of the tower for all),
    give the answers they give alone."""
    settings = GenerationSettings(max_new_tokens=4)
    methods = ["full", "h2o", "fastv", "dart", "visionzip", "downsample"]
    knobs = {"visionzip": {"budget_of": budget_of}, "downsample": {"budget_of": budget_of, "where": "projector_out"}}
    batched = Engine(lm).new_session(pictures(), TWO_IMAGES, methods, 0.5, settings, knobs)
    list(batched.run())
    for method in ("visionzip", "downsample"):
        alone = Engine(lm).new_session(pictures(), TWO_IMAGES, [method], 0.5, settings, knobs)
        list(alone.run())
        assert batched.states[method].error is None, batched.states[method].error
        state = batched.states[method]
        assert state.policy.image_token_sources(state.policy_state) is not None
        assert batched.states[method].turn_ids == alone.states[method].turn_ids, method


@pytest.mark.parametrize("budget_mode,query_agnostic", [("published", False), ("equal_memory", True),
                                                        ("equal_memory", False), ("published", True)])
@pytest.mark.parametrize("budget_of", ["cache", "image"])
def test_two_turns_in_both_modes(lm, budget_mode, query_agnostic, budget_of):
    session = Engine(lm).new_session(pictures(), TWO_IMAGES, ["full", "visionzip"], 0.5,
                                     GenerationSettings(max_new_tokens=3), {"visionzip": {"budget_of": budget_of}},
                                     budget_mode=budget_mode, query_agnostic=query_agnostic)
    list(session.run())
    list(session.follow_up("what else?"))
    state = session.states["visionzip"]
    assert state.error is None and len(state.answers) == 1 and state.finished
    sources = state.policy.image_token_sources(state.policy_state)
    assert sources is not None and sources.tokens < 96


def test_the_overlay_lights_the_kept_cells_of_each_tile(lm):
    """The kept map lights exactly the dominant tokens, each on its tile's view at the cell the naive reference
    picks, and draws the contextual tokens' cells as merged."""
    from ui.overlay import overlay

    picture = square()
    inputs, _, _ = prompt(lm, [picture], PROMPT)
    cls, keys, _ = eager_reference(lm, M.vision_inputs(inputs)["pixel_values"])
    session = Engine(lm).new_session(picture, PROMPT, ["full", "visionzip"], 0.5,
                                     GenerationSettings(max_new_tokens=2), {"visionzip": {"budget_of": "image"}})
    list(session.run())
    state = session.states["visionzip"]
    shown = session.kept_image_map("visionzip", lm.num_layers - 1)
    layout = session.image_layout
    assert len(layout.views) == 5 and layout.views[-1].name == "thumbnail" and shown.n_tokens == 80
    policy = state.policy
    merged_cells = set()
    for tile, k in enumerate(per_crop_counts(40, 5, 16)):
        dominant, groups = naive_tile(cls[tile], keys[tile], k, policy.contextual)
        share = shown.view_share(tile)
        assert share.shape == (4, 4)
        assert sorted(r * 4 + c for r, c in zip(*np.nonzero(share > 0))) == dominant, tile
        merged_cells |= {tile * 16 + t for a, joined in groups.items() for t in [a] + joined}
    assert set(np.flatnonzero(shown.merged_share > 0).tolist()) == merged_cells
    facts = {f.key: f.value for f in policy.facts(state.policy_state)}
    assert facts["image_fed"] == 40 and facts["dominant"] + facts["contextual"] == 40
    assert overlay(picture, shown, "visionzip").width > 5 * 300


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa-tower", "eager-tower"])
def test_one_tower_pass_feeds_every_own_prefill(lm, eager):
    """In a comparison the tower runs once for the shared prefill and every own prefill (FastV, VisionZip,
    Downsample's pooling; an eager tower: once more, recorded), and each method answers as it does run alone."""
    cfg = lm.model.config
    previous = {"text_config": cfg.get_text_config()._attn_implementation or "sdpa",
                "vision_config": cfg.vision_config._attn_implementation or "sdpa"}
    methods = ["full", "fastv", "visionzip", "downsample"]
    knobs = {"downsample": {"where": "projector_out"}}
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    calls = []
    handle = lm.model.model.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    try:
        if eager:
            lm.model.set_attn_implementation({"text_config": previous["text_config"], "vision_config": "eager"})
        batched = Engine(lm).new_session(square(), PROMPT, methods, 0.5, settings, knobs)
        list(batched.run())
        passes = len(calls)
        alone = Engine(lm).new_session(square(), PROMPT, methods, 0.5, settings, knobs, batched=False)
        list(alone.run())
    finally:
        handle.remove()
        lm.model.set_attn_implementation(previous)
    assert passes == 1 + int(eager)
    for name in methods:
        mine, ref = batched.states[name], alone.states[name]
        assert mine.error is None and ref.error is None, (name, mine.error, ref.error)
        assert mine.turn_ids == ref.turn_ids and mine.prompt_len == ref.prompt_len, name
        torch.testing.assert_close(mine.first_logits, ref.first_logits, atol=1e-5, rtol=1e-5)
    assert batched.states["visionzip"].prompt_len < batched.states["full"].prompt_len
