"""DyCoke (policies/dycoke.py) against the rule of its paper and reference, written out naively: which frames temporal
merging compares with which, the patches each keeps, the tokens its own prefill lets reach the first layer on
every way a video is read (OneVision's pooled frames, Qwen's temporal groups, frames read as images), and the
per-step subset dynamic pruning attends to, alone and batched with another method."""
from __future__ import annotations

import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, StatRequest, tracked_attention_enabled
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.dycoke import compared_frames, dp_keep, ttm_keep
from prefixkv_core.testing import (build_tiny_family, layered_reference_cache, moving_dot_frames, save_tiny_family,
                                   wide_noise_picture)

PROMPT = "what moves in the clip?"


def naive_partner(frame: int, num_frames: int) -> int | None:
    """The frame a window's frame is compared with: in window (a, a+1, a+2, a+3), a+1 and a+3 with the frame just
    before, a+2 with a; a stays whole (so does an odd last frame with no pair)."""
    a = frame - frame % 4
    offset = frame - a
    if offset == 0:
        return None
    if offset == 2:
        return a
    return frame - 1


@pytest.mark.parametrize("num_frames", range(1, 14))
def test_the_compared_frames_follow_the_windows_of_four(num_frames):
    expected = {(f, naive_partner(f, num_frames)) for f in range(num_frames) if naive_partner(f, num_frames) is not None}
    got = compared_frames(num_frames)
    assert len(got) == len(set(got)) and set(got) == expected


def naive_ttm(features: torch.Tensor, keep: int) -> list[list[bool]]:
    num_frames, patches, _ = features.shape
    out = []
    for f in range(num_frames):
        other = naive_partner(f, num_frames)
        if other is None:
            out.append([True] * patches)
            continue
        sims = []
        for j in range(patches):
            a, b = features[f, j].tolist(), features[other, j].tolist()
            dot = sum(x * y for x, y in zip(a, b))
            sims.append(dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))))
        chosen = sorted(range(patches), key=lambda j: (sims[j], j))[:keep]
        out.append([j in chosen for j in range(patches)])
    return out


@pytest.mark.parametrize("num_frames,keep", [(4, 2), (7, 3), (9, 0), (2, 5)])
def test_temporal_merging_keeps_the_patches_least_like_the_compared_frame(num_frames, keep):
    gen = torch.Generator().manual_seed(num_frames)
    features = torch.randn(num_frames, 5, 6, generator=gen)
    features[1:, :2] = features[:1, :2] + 0.01 * torch.randn(num_frames - 1, 2, 6, generator=gen)  # static patches
    got = ttm_keep(features, keep)
    assert got.tolist() == naive_ttm(features, keep)
    if num_frames > 1 and keep < 5:
        assert not bool(got[1, :2].any()) or keep > 3  # the static patches are the first to go


def test_dynamic_pruning_keeps_the_most_attended_image_entries_and_every_other():
    gen = torch.Generator().manual_seed(0)
    attention = torch.rand(2, 2, 14, generator=gen)  # two rows of one cache, 2 KV heads, 12 entries + 2 of padding
    slots = [1, 2, 3, 5, 6, 8, 9]
    is_image = torch.tensor([[s in slots for s in range(12)]] * 2)
    got = dp_keep(attention, is_image, 3)
    for r in range(2):
        mean = attention[r, :, :12].mean(dim=0).tolist()
        best = sorted(slots, key=lambda s: -mean[s])[:3]
        assert got[r].tolist() == [s not in slots or s in best for s in range(12)]
    assert dp_keep(attention, is_image, 0).tolist() == [[s not in slots for s in range(12)]] * 2
    assert dp_keep(attention, is_image, 20).all()  # more than there are: every entry


# -- its own prefill on every way a video is read -----------------------------------------------------------------

@pytest.fixture(scope="module")
def onevision():
    return build_tiny_family("llava-onevision")


@pytest.fixture(scope="module", params=["llava-onevision", "llava-1.5", "llava-next", "qwen2-vl", "qwen3-vl",
                                        "internvl"])
def lm(request, tmp_path_factory, onevision):
    if request.param == "llava-onevision":
        return onevision
    if request.param.startswith("qwen"):
        return M.load_model(f"tiny-{request.param}", device="cpu", cache_dir=str(tmp_path_factory.mktemp("m")))
    if request.param == "internvl":
        return M.load_model(save_tiny_family(tmp_path_factory.mktemp("internvl"), "internvl"), device="cpu")
    return build_tiny_family(request.param)


def input_embeddings(lm, inputs) -> torch.Tensor:
    """The prompt as the language model's first layer reads it (the model's own path)."""
    seen = {}

    def grab(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach().float()

    inputs = dict(inputs)
    if "video_grid_thw" in inputs and "mm_token_type_ids" not in inputs:  # Qwen's 3-D positions need the types
        ids = inputs["input_ids"]
        inputs["mm_token_type_ids"] = (ids == lm.image_token_id).int() + 2 * (ids == lm.video_token_id).int()
    handle = lm.model.get_decoder().layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            lm.model(**inputs)
    finally:
        handle.remove()
    return seen["hidden"][0]


def test_its_own_prefill_lets_through_what_the_naive_rule_keeps(lm):
    session = Engine(lm).new_session(None, PROMPT, ["dycoke"], 0.3, GenerationSettings(max_new_tokens=1),
                                     video=moving_dot_frames(8), frames=8)
    list(session.run())
    encoded = session.encoded
    frames = torch.as_tensor(encoded.frame_tokens)
    assert frames.shape[0] >= 4  # OneVision and frames read as images: 8; Qwen: 4 temporal groups
    image_at = encoded.is_image[0].nonzero().flatten()
    positions = image_at[frames]  # [F, P] prompt positions
    hidden = input_embeddings(lm, encoded.inputs)
    keep = naive_ttm(hidden[positions], int(0.3 * frames.shape[1]))
    dropped = {int(positions[f, j]) for f in range(frames.shape[0]) for j in range(frames.shape[1]) if not keep[f][j]}
    assert dropped
    expected = [p for p in range(encoded.n) if p not in dropped]
    state = session.states["dycoke"]
    n = encoded.n
    for layer in state.cache.layers:  # no layer holds what temporal merging dropped
        assert layer.positions[0, 0].tolist() == expected
    facts = {f.key: f.value for f in state.policy.facts(state.policy_state)}
    assert facts["ttm_kept"] == encoded.n_image - len(dropped)
    with tracked_attention_enabled(lm.model):
        own = runner.own_prefill(lm.model, state.policy, encoded.ids, encoded.is_image, M.vision_inputs(encoded.inputs),
                                 lm.num_layers, lm.device, lm.image_token_id, frames=encoded.frame_tokens)
        logits, _ = layered_reference_cache(lm, encoded.ids, encoded.is_image, M.vision_inputs(encoded.inputs),
                                            own.cache)
    assert own.prompt_len == n
    torch.testing.assert_close(own.logits, logits, atol=1e-4, rtol=1e-4)


def test_onevisions_frames_are_its_pooled_grids_without_the_newline(onevision):
    session = Engine(onevision).new_session(None, PROMPT, ["full"], 0.3, GenerationSettings(max_new_tokens=1),
                                            video=moving_dot_frames(6), frames=6)
    list(session.run())
    frames = session.encoded.frame_tokens
    per_frame = frames.shape[1]
    assert frames.tolist() == [list(range(f * per_frame, (f + 1) * per_frame)) for f in range(6)]
    assert session.encoded.n_image == 6 * per_frame + 1  # the video's newline token closes it


def test_still_images_are_not_merged_and_dynamic_pruning_still_runs(onevision):
    session = Engine(onevision).new_session([wide_noise_picture(1), wide_noise_picture(2)], PROMPT, ["full", "dycoke"], 0.3,
                                            GenerationSettings(max_new_tokens=3))
    list(session.run())
    state = session.states["dycoke"]
    assert session.encoded.frame_tokens is None
    assert "no two video frames" in " ".join(state.policy_state.notes)
    facts = {f.key: f.value for f in state.policy.facts(state.policy_state)}
    assert facts["ttm_kept"] == session.encoded.n_image and facts["dp_subset"] < facts["ttm_kept"]


def test_at_r_1_without_pruning_it_answers_as_full(onevision):
    session = Engine(onevision).new_session(None, PROMPT, ["full", "dycoke"], 1.0,
                                            GenerationSettings(max_new_tokens=6),
                                            {"dycoke": {"prune": 0.0}}, video=moving_dot_frames(8), frames=8)
    list(session.run())
    assert session.states["dycoke"].turn_ids == session.states["full"].turn_ids


# -- dynamic pruning, step by step --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decoded(onevision):
    session = Engine(onevision).new_session(None, PROMPT, ["full", "dycoke"], 0.3, GenerationSettings(max_new_tokens=3),
                                            video=moving_dot_frames(8), frames=8)
    list(session.run())
    return session


def masked_step(lm, cache, start: int, token: int, first: int, prune: float) -> torch.Tensor:
    """The naive step: a plain step's layer first - 1 attention ranks the image entries; the same step again with
    layers first.. masked to the best int(I·(1 - p)) and every other entry."""
    ids = torch.tensor([[token]])
    _, stats = runner.forward_group(lm.model, cache.clone(), ids, start, StatRequest(last_query=True))
    layer = cache.layers[first - 1]
    n = layer.length + 1
    mean = stats[first - 1]["last_query"][0, :, :n].mean(dim=0).tolist()
    slots = [s for s, flag in enumerate(layer.is_image[0, 0].tolist()) if flag]
    best = set(sorted(slots, key=lambda s: -mean[s])[:int(len(slots) * (1 - prune))])
    mask = torch.tensor([[[s not in slots or s in best for s in range(n)]]])
    probe = AttentionProbe(StatRequest(), key_masks={l: mask for l in range(first, len(cache.layers))})
    logits, _ = runner.forward_group(lm.model, cache.clone(), ids, start, probe)
    return logits[0]


def test_a_decode_step_attends_to_the_subset_the_naive_rule_picks(onevision, decoded):
    state = decoded.states["dycoke"]
    policy, first = state.policy, state.policy_state.pruning_layer
    assert first == min(3, onevision.num_layers - 1)
    with tracked_attention_enabled(onevision.model):
        cache = state.cache.clone()
        wanted = runner.attention_wanted(state.policy, state.policy_state)
        assert wanted == (first - 1,)  # the step records the one layer DP rates with
        out = runner.forward_rows(onevision.model, [cache], [[7]], [state.true_len], [wanted], onevision.device,
                                  subsets=[policy.step_subset(state.policy_state, cache)])
        assert set(out.attention[0]) == {first - 1}
        expected = masked_step(onevision, state.cache, state.true_len, 7, first, policy.prune)
        plain, _ = runner.forward_group(onevision.model, state.cache.clone(), torch.tensor([[7]]), state.true_len,
                                        StatRequest())
    torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out.logits[0], plain[0], atol=1e-4)  # the subset changed the step
    assert cache.layers[0].length == state.cache.layers[0].length + 1  # nothing evicted: the step only appended


def test_a_batched_step_prunes_only_the_dycoke_row(onevision, decoded):
    dy, full = decoded.states["dycoke"], decoded.states["full"]
    with tracked_attention_enabled(onevision.model):
        alone_full, _ = runner.forward_group(onevision.model, full.cache.clone(), torch.tensor([[9]]), full.true_len,
                                             StatRequest())
        expected = masked_step(onevision, dy.cache, dy.true_len, 7, dy.policy_state.pruning_layer, dy.policy.prune)
        rows = [full.cache.clone(), dy.cache.clone()]
        out = runner.forward_rows(onevision.model, rows, [[9], [7]], [full.true_len, dy.true_len],
                                  [False, runner.attention_wanted(dy.policy, dy.policy_state)],
                                  onevision.device, runner.StepBuffers(),
                                  [None, dy.policy.step_subset(dy.policy_state, rows[1])])
    torch.testing.assert_close(out.logits[0], alone_full[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1], expected, atol=1e-4, rtol=1e-4)


def test_a_row_with_a_subset_must_want_its_attention(onevision, decoded):
    state = decoded.states["dycoke"]
    cache = state.cache.clone()
    with pytest.raises(ValueError, match="want its attention"):
        runner.forward_rows(onevision.model, [cache], [[7]], [state.true_len], [False], onevision.device,
                            subsets=[state.policy.step_subset(state.policy_state, cache)])


def test_with_equal_memory_the_hold_evicts_and_dynamic_pruning_follows(onevision):
    """The equal-memory hold evicts the prompt every step; DP then ranks the image entries that are left."""
    session = Engine(onevision).new_session(None, PROMPT, ["full", "dycoke"], 0.3, GenerationSettings(max_new_tokens=5),
                                            video=moving_dot_frames(8), frames=8, budget_mode="equal_memory")
    list(session.run())
    state = session.states["dycoke"]
    assert state.error is None and len(state.turn_ids) == 5
    assert state.cache.layers[0].length <= round(0.3 * state.true_len) + 1


def test_query_agnostic_merges_the_frames_before_the_question(onevision):
    """The video is compressed before the question is known: the same frames merged, the question fed after."""
    aware, agnostic = (Engine(onevision).new_session(None, PROMPT, ["dycoke"], 0.3,
                                                     GenerationSettings(max_new_tokens=2), video=moving_dot_frames(8),
                                                     frames=8, query_agnostic=mode) for mode in (False, True))
    list(aware.run())
    list(agnostic.run())
    assert agnostic.encoded.split < agnostic.encoded.n
    dropped = [set(range(s.encoded.n)) - set(s.states["dycoke"].cache.layers[0].positions[0, 0].tolist())
               for s in (aware, agnostic)]
    assert dropped[0] and dropped[0] == dropped[1]  # the input embeddings of the frames do not see the question
