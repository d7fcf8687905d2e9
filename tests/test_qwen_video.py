"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL read a video on their own path (tiny random models, CPU): the chat template's
video span expanded to t·h·w/merge² `<|video_pad|>` tokens (Qwen3-VL's as one segment per temporal group, each
after its timestamp, as its processor writes it), the frames preprocessed as the family's video processor does (here
on transformers' PIL backend), the temporal groups' 3-D positions from the model's own rope index, and every method
on it as on images."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine, EngineError, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.models.families import hooks
from prefixkv_core.models.video import video_inputs, video_token_count
from prefixkv_core.policies import METHODS, make_policy
from prefixkv_core.session.video_input import write_video
from prefixkv_core.testing import kept_entry_masks, layered_reference_cache, moving_dot_frames, prefill_and_compress

VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
PROMPT = "what moves in the clip?"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("models"))
    return {family: M.load_model(f"tiny-{family}", device="cpu", cache_dir=cache)
            for family in VIDEO_FAMILIES}


@pytest.fixture(params=VIDEO_FAMILIES)
def lm(request, models):
    return models[request.param]


frames = moving_dot_frames  # a clip of a moving dot


def types_of(lm, ids):
    """mm_token_type_ids as the processor makes them: 1 image, 2 video."""
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == lm.image_token_id] = 1
    types[ids == lm.video_token_id] = 2
    return types


def encoded(lm, n_frames: int = 4, prompt: str = "<video> " + PROMPT, fps: float | None = 2.0):
    text = M.format_prompt(lm, prompt, with_image=0)
    return M.encode(lm, None, text, video=frames(n_frames), video_fps=fps)


# -- the prompt, the pixels, the grid --------------------------------------------------------------------------------

def test_the_video_span_is_expanded_to_the_grids_tokens(lm):
    inputs = encoded(lm, 4)
    ids = inputs["input_ids"][0]
    text = M.format_prompt(lm, "<video> " + PROMPT, with_image=0)
    assert "<|vision_start|><video><|vision_end|>" in text
    t, h, w = inputs["video_grid_thw"][0].tolist()
    merge = lm.model.config.vision_config.spatial_merge_size
    assert t == 2 and inputs["pixel_values_videos"].shape == (t * h * w, 3 * 2 * 8 * 8)
    video = (ids == lm.video_token_id).nonzero().flatten()
    assert len(video) == t * h * w // merge ** 2 == video_token_count(lm.model.config, 4, (64, 48), lm.processor)
    start = lm.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    end = lm.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    runs = [run for run in np.split(video.numpy(), np.flatnonzero(np.diff(video.numpy()) > 1) + 1)]
    if lm.family == "qwen3-vl":  # one segment per temporal group: "<t seconds>" then its vision span
        assert [len(run) for run in runs] == [h * w // merge ** 2] * t
        text_of = lm.tokenizer.decode(ids.tolist())
        assert "<|vision_start|><0.2 seconds><|vision_start|>" in text_of  # frames at 0 and 0.5 s
        assert "<|vision_end|><1.2 seconds><|vision_start|>" in text_of  # frames at 1 and 1.5 s
        assert text_of.count("<|vision_end|><|vision_end|>") == 1  # the template's own span closes the video
    else:
        assert len(runs) == 1  # one block
    for run in runs:
        assert int(ids[run[0] - 1]) == start and int(ids[run[-1] + 1]) == end
    assert int(lm.visual_mask(inputs["input_ids"]).sum()) == len(video)
    if lm.family == "qwen2.5-vl":  # two frames a group at 2 fps: one second
        assert inputs["second_per_grid_ts"].tolist() == [1.0]
    else:
        assert "second_per_grid_ts" not in inputs


def test_tokens_and_grid_match_the_models_own_video_features(lm):
    inputs = encoded(lm, 4)
    with torch.inference_mode():
        out = lm.model.model.get_video_features(pixel_values_videos=inputs["pixel_values_videos"],
                                                video_grid_thw=inputs["video_grid_thw"], return_dict=True)
    features = torch.cat(list(out.pooler_output))
    assert features.shape[0] == int((inputs["input_ids"] == lm.video_token_id).sum())


@pytest.mark.parametrize("n_frames", [1, 2])
def test_a_group_of_one_frame_is_that_frames_image_patches(lm, n_frames):
    """One frame padded with itself, or two equal frames, make the patches the image processor makes of that frame
    (it repeats an image over the temporal patch): the same resize, rescale, normalise and patch order."""
    picture = frames(1, (64, 48))[0]
    video = video_inputs(lm.processor, lm.model.config, [picture] * n_frames)
    image = M.encode(lm, picture, M.format_prompt(lm, "<image> hi", with_image=1))
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    torch.testing.assert_close(video["pixel_values_videos"], image["pixel_values"], atol=1e-5, rtol=1e-5)


def test_an_odd_number_of_frames_repeats_the_last(lm):
    """Three frames: two temporal groups, the second the third frame twice; the layout names them."""
    three = frames(3)
    padded = video_inputs(lm.processor, lm.model.config, three)
    four = video_inputs(lm.processor, lm.model.config, three + [three[-1]])
    assert padded["video_grid_thw"][0, 0] == 2
    torch.testing.assert_close(padded["pixel_values_videos"], four["pixel_values_videos"])
    session = Engine(lm).new_session(None, PROMPT, ["full", "h2o"], 0.5, GenerationSettings(max_new_tokens=2),
                                     video=three, frames=3)
    list(session.run())
    layout = session.image_layout
    assert [v.name for v in layout.views] == ["frames 1-2", "frame 3"]
    assert layout.n_images == 2 and layout.n_tokens == session.prefill.image_tokens
    record = session.record.to_dict()
    assert len(record["prefill"]["image_ranges"]) == 2
    assert len(record["methods"]["h2o"]["kept_per_image"]) == 2
    assert session.visuals.describe()["video"]["read_as"] == "video"
    # the overlay shows one frame per temporal group: the layout's images and the pictures drawn agree
    from ui.visual_request import shown

    assert [(k, f) for k, _, f in session.visuals.layout_order()] == [("frame", 0), ("frame", 2)]
    display = shown(session, session.visuals.video)
    assert display.kinds == ["frame", "frame"] and len(display.images) == layout.n_images


def test_the_video_processors_own_output_is_used_where_it_exists(lm):
    """Where transformers builds the video processor (torchvision present) its output is what the model reads."""
    made = video_inputs(lm.processor, lm.model.config, frames(2))

    class Own:
        size = {"shortest_edge": 256, "longest_edge": 4096}
        patch_size, merge_size, temporal_patch_size = 8, 2, 2
        calls, options = [], []

        def __call__(self, videos, return_tensors, **kwargs):
            self.calls.append(len(videos[0]))
            self.options.append(kwargs)
            return {"pixel_values_videos": made["pixel_values_videos"] + 1, "video_grid_thw": made["video_grid_thw"]}

    proc = lm.processor
    own = Own()
    try:
        proc.video_processor = own
        got = video_inputs(proc, lm.model.config, frames(2))
    finally:
        proc.video_processor = None
    assert own.calls == [2]
    if lm.family == "qwen3-vl":  # the frames are sampled already
        assert own.options == [{"do_sample_frames": False, "cap_pixels_per_frame": False}]
    torch.testing.assert_close(got["pixel_values_videos"], made["pixel_values_videos"] + 1)


# -- the engine against the model's own path -------------------------------------------------------------------------

def test_full_equals_the_models_own_generate(lm):
    session = Engine(lm).new_session(None, "<video> " + PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=6),
                                     video=frames(4), frames=4)
    list(session.run())
    inputs = session.encoded.inputs
    ids = inputs["input_ids"]
    assert set(inputs) >= {"pixel_values_videos", "video_grid_thw"}
    with torch.inference_mode():
        own = lm.model(**inputs, mm_token_type_ids=types_of(lm, ids)).logits[0, -1]
        out = lm.model.generate(**inputs, mm_token_type_ids=types_of(lm, ids), max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(session.states["full"].first_logits, own, atol=1e-4, rtol=1e-4)
    assert session.states["full"].turn_ids == out[0, ids.shape[1]:].tolist()


def test_positions_are_the_models_rope_index_over_the_video(lm):
    """The video's tokens get (t, h, w) positions, one temporal step per group (Qwen2.5-VL: spaced by the
    seconds a group spans; Qwen3-VL: each group a grid of its own after its timestamp's text), and the next text
    follows the grid. At 1 fps a group of two frames spans two seconds (at 2 fps its one second is also the
    rope index's default, so a lost `second_per_grid_ts` would not show)."""
    inputs = encoded(lm, 4, fps=1.0)
    ids = inputs["input_ids"]
    if lm.family == "qwen2.5-vl":
        assert inputs["second_per_grid_ts"].tolist() == [2.0]
    positions, _ = hooks(lm.family).rope_index(lm.model, ids, M.vision_inputs(inputs))
    video = (ids[0] == lm.video_token_id).nonzero().flatten()
    temporal = positions[0, 0, video]
    per_group = len(video) // 2
    first, second = temporal[:per_group], temporal[per_group:]
    assert bool((first == first[0]).all()) and bool((second == second[0]).all())
    step = int(second[0] - first[0])
    if lm.family == "qwen3-vl":  # the first grid's extent, then the text between the groups (one position each)
        _, h, w = inputs["video_grid_thw"][0].tolist()
        merge = lm.model.config.vision_config.spatial_merge_size
        between = int(video[per_group] - video[per_group - 1]) - 1
        assert step == max(h, w) // merge + between
        assert int(positions[0, 0, video[0] - 1]) + 1 == int(first[0])  # the group starts after its text
        rows = positions[1, 0, video[per_group:]] - positions[1, 0, video[per_group]]
        torch.testing.assert_close(rows, positions[1, 0, video[:per_group]] - positions[1, 0, video[0]])
    else:
        seconds_a_group = 2.0  # temporal_patch_size frames at 1 fps
        assert step == (int(lm.model.config.vision_config.tokens_per_second * seconds_a_group)
                        if lm.family == "qwen2.5-vl" else 1)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "vlcache"])
def test_eviction_equals_masking_with_a_video(lm, method):
    inputs = encoded(lm, 4, "<video> " + PROMPT + " describe every frame in detail")
    ids = inputs["input_ids"]
    shared, compressed, n = prefill_and_compress(lm, make_policy(method, 0.3), inputs, 0.3)
    assert shared.cache.rope_deltas is not None
    assert min(layer.length for layer in compressed.layers) < n
    video = set((ids[0] == lm.video_token_id).nonzero().flatten().tolist())
    assert video - set(compressed.layers[-1].positions[0, 0].tolist())  # some video entries evicted
    engine = Engine(lm)
    token = torch.tensor([[7]])
    with tracked_attention_enabled(lm.model):
        evicted = engine.forward(compressed, token, n, AttentionProbe())
        masked = engine.forward(shared.cache.clone(), token, n,
                                AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    torch.testing.assert_close(evicted, masked, atol=1e-4, rtol=1e-4)


def test_vlcaches_post_vision_queries_follow_the_video(lm):
    """VL-Cache's post-vision queries are the ones after the last video token (its flags are the visual mask)."""
    from prefixkv_core.kv.attention import post_vision_queries

    ids = encoded(lm, 2)["input_ids"]
    after = post_vision_queries(lm.visual_mask(ids))[0]
    last = int((ids[0] == lm.video_token_id).nonzero().max())
    assert after.nonzero().flatten().tolist() == list(range(last + 1, ids.shape[1]))


@pytest.mark.parametrize("method", ["fastv", "dart", "pyramiddrop", "sparsevlm"])
def test_token_drop_equals_the_masked_forward_with_a_video(lm, method):
    inputs = encoded(lm, 4)
    ids = inputs["input_ids"]
    is_image = lm.visual_mask(ids)
    policy = make_policy(method, 0.7, **({"recycle": False} if method == "sparsevlm" else {}))
    with tracked_attention_enabled(lm.model):
        own = runner.prefill_for(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.num_layers, lm.device,
                                 lm.image_token_id)
        n = own.prompt_len
        kept = own.cache.layers[-1].positions[0, 0]
        video = set((ids[0] == lm.video_token_id).nonzero().flatten().tolist())
        assert video - set(kept.tolist())  # the drop reached the video's tokens
        logits, reference = layered_reference_cache(lm, ids, is_image, M.vision_inputs(inputs), own.cache)
        torch.testing.assert_close(own.logits, logits, atol=1e-4, rtol=1e-4)
        engine = Engine(lm)
        token = torch.tensor([[7]])
        dropped = engine.forward(own.cache, token, n, AttentionProbe())
        masked = engine.forward(reference, token, n, AttentionProbe(key_masks=kept_entry_masks(own.cache, n)))
    torch.testing.assert_close(dropped, masked, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("query_agnostic", [False, True], ids=["query-aware", "query-agnostic"])
def test_batched_equals_alone_with_a_video(lm, query_agnostic):
    """Every method with an image and a video (VisionZip reducing each temporal group), batched == alone."""
    picture = frames(1, (48, 40))[0]
    settings = GenerationSettings(max_new_tokens=3)
    answers = []
    for batched in (True, False):
        session = Engine(lm).new_session(picture, "<image> photo, <video> clip: " + PROMPT, "all", 0.3, settings,
                                         video=frames(3), frames=3, query_agnostic=query_agnostic, batched=batched)
        list(session.run())
        assert set(session.states) == set(METHODS)
        for name, state in session.states.items():
            assert state.error is None, (name, state.error)
        answers.append({n: list(s.turn_ids) for n, s in session.states.items()})
        record = session.record.to_dict()
        assert len(record["prefill"]["image_ranges"]) == 3  # the image, then two temporal groups
        assert all(len(r["kept_per_image"]) == 3 for r in record["methods"].values())
    assert answers[0] == answers[1]


def test_query_agnostic_full_answers_as_the_models_own_generate(lm):
    session = Engine(lm).new_session(None, "<video> " + PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=5),
                                     video=frames(4), frames=4, query_agnostic=True)
    list(session.run())
    encoded_prompt = session.encoded
    ids = encoded_prompt.ids
    assert encoded_prompt.split < ids.shape[1]
    assert not bool(encoded_prompt.is_image[0, encoded_prompt.split:].any())
    with torch.inference_mode():
        out = lm.model.generate(**encoded_prompt.inputs, mm_token_type_ids=types_of(lm, ids), max_new_tokens=5,
                                do_sample=False)
    assert session.states["full"].turn_ids == out[0, ids.shape[1]:].tolist()


def test_visionzip_reduces_a_native_video(lm):
    session = Engine(lm).new_session(None, PROMPT, ["full", "visionzip"], 0.3, GenerationSettings(max_new_tokens=2),
                                     video=frames(2), frames=2)
    list(session.run())
    assert all(state.error is None for state in session.states.values())
    sources = session.states["visionzip"].policy.image_token_sources(session.states["visionzip"].policy_state)
    assert sources is not None and sources.tokens < sources.original_tokens


def test_downsample_resizes_a_native_videos_frames_before_the_tower(lm):
    """Downsample on Qwen's own video path scales every frame alike (the video's share of the budget), next to an
    image scaled on its own; its prefill is the model's own forward over the re-encoded prompt, and each fed token
    counts for its own temporal group."""
    picture = frames(1, (80, 64))[0]
    clip = frames(3, (96, 64))
    prompt = "<image> photo, <video> clip: " + PROMPT
    session = Engine(lm).new_session(picture, prompt, ["full", "downsample"], 0.4,
                                     GenerationSettings(max_new_tokens=2), video=clip, frames=3,
                                     knobs={"downsample": {"budget_of": "image"}})
    list(session.run())
    state = session.states["downsample"]
    assert state.error is None, state.error
    sources = state.policy.image_token_sources(state.policy_state)
    image_size, frame_size = sources.resized
    assert frame_size[0] < 96 and frame_size[1] < 64
    assert sources.original_tokens == session.prefill.image_tokens and sources.tokens < sources.original_tokens
    assert np.bincount(sources.images).tolist() == [
        lm.image_tokens(*image_size), *[video_token_count(lm.model.config, 2, frame_size, lm.processor)] * 2]
    kept = session.record.to_dict()["methods"]["downsample"]["kept_per_image"]
    assert len(kept) == 3 and all(0 < k < 1 for k in kept)
    text = M.format_prompt(lm, session.visuals.prompt, with_image=1)
    inputs = M.encode(lm, picture.resize(image_size, Image.BICUBIC), text,
                      video=[f.resize(frame_size, Image.BICUBIC) for f in clip], video_fps=session.visuals.video_fps)
    with torch.inference_mode():
        own = lm.model(**inputs, mm_token_type_ids=types_of(lm, inputs["input_ids"])).logits[0, -1]
    torch.testing.assert_close(state.first_logits, own, atol=1e-4, rtol=1e-4)


# -- refusals, Qwen3-VL's timestamps, the CLI ---------------------------------------------------------------------

def test_too_many_frames_for_the_context_are_refused_before_encoding(lm, monkeypatch):
    """Counted before encoding: the video's tokens, and the text around them (Qwen3-VL's timestamps, frames given as
    a list stamped at 1 fps), which the context here holds on top of 120 tokens."""
    from prefixkv_core.models.video import video_text_tokens
    from prefixkv_core.session import prefill

    context = 120 + video_text_tokens(lm.model.config, 16, lm.processor, list(range(16)))
    small = dataclasses.replace(lm, max_context=context)
    per_group = video_token_count(lm.model.config, 2, (64, 48), lm.processor)

    def never(*args, **kwargs):
        raise AssertionError("encoded")

    monkeypatch.setattr(prefill, "encode", never)
    with pytest.raises(EngineError) as err:
        Engine(small).new_session(None, PROMPT, ["full"], 0.3, GenerationSettings(max_new_tokens=4),
                                  video=frames(16), frames=16)
    message = str(err.value)
    assert f"16 frames take {8 * per_group} tokens" in message and f"context of {context}" in message
    fit = int(message.split("at most ")[1].split(" ")[0])
    assert 0 < fit < 16


@pytest.mark.parametrize("indices", [[0, 7, 14], [0, 5, 10, 15]], ids=["odd", "even"])
def test_qwen3_vls_span_is_its_processors_own(models, indices):
    """Qwen3-VL's video span is what its processor's own `replace_video_token` writes for the same grid and frame
    times (frame indices over the stream's rate; an odd count's last group stamped with its one frame)."""
    from types import SimpleNamespace

    from transformers.video_utils import VideoMetadata

    from prefixkv_core.models.video import video_span

    lm = models["qwen3-vl"]
    proc, config = lm.processor, lm.model.config
    grid = video_inputs(proc, config, frames(len(indices)))["video_grid_thw"]
    meta = VideoMetadata(total_num_frames=16, fps=6.0, frames_indices=list(indices))
    try:
        proc.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
        own = proc.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    finally:
        proc.video_processor = None
    ours = video_span(config, proc, grid[0].tolist(), len(indices), [k / 6.0 for k in indices])
    assert ours == own and own.count("seconds>") == int(grid[0, 0])
    # the context check counts the span's text around its pads exactly
    from prefixkv_core.models.video import video_text_tokens

    span_ids = lm.tokenizer(ours, add_special_tokens=False)["input_ids"]
    pads = sum(1 for i in span_ids if i == lm.video_token_id)
    assert video_text_tokens(config, len(indices), proc, [k / 6.0 for k in indices]) == len(span_ids) - pads


def test_qwen3_vl_stamps_each_group_with_the_clips_own_times(models):
    """A decoded clip's frames keep their seconds in the stream: each group's timestamp is its frames' mean."""
    from prefixkv_core.session.video_input import VideoClip

    lm = models["qwen3-vl"]
    picked = frames(4)
    clip = VideoClip(tuple(picked), (0.0, 0.75, 1.5, 2.25), 4.0, 3.0, 12, picked[0].size, "clip")
    session = Engine(lm).new_session(None, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=1),
                                     video=clip, frames=4)
    list(session.run())
    text = lm.tokenizer.decode(session.encoded.ids[0].tolist())
    assert "<0.4 seconds>" in text and "<1.9 seconds>" in text
    assert session.visuals.describe()["video"]["read_as"] == "video" and session.visuals.native_video


def test_the_pil_backends_patches_are_qwen3_vls_own_patchify(models):
    """The PIL backend cuts a clip (an odd number of frames: the last repeated) into the patches Qwen3-VL's video
    processor cuts (its `patchify` is plain torch), and resizes it as its `smart_resize` does."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

    from prefixkv_core.models.family import qwen_vl_video

    lm = models["qwen3-vl"]
    video = torch.randn(3, 3, 32, 48)
    ours, grid = qwen_vl_video._patchify(torch.cat([video, video[-1:]]), 8, 2, 2)
    own, t, h, w = Qwen3VLVideoProcessor.patchify(None, video[None], patch_size=8, merge_size=2,
                                                  temporal_patch_size=2)
    assert grid == (t, h, w) and torch.equal(ours, own[0])
    s = qwen_vl_video.video_settings(None, lm.model.config, tiny=True)
    for n, size in ((3, (64, 48)), (16, (640, 480)), (1, (20, 30))):
        want = smart_resize(max(n, 2), size[1], size[0], temporal_factor=2, factor=16, min_pixels=s["min_pixels"],
                            max_pixels=s["max_pixels"])
        assert qwen_vl_video.frame_size(lm.model.config, lm.processor, n, *size) == want


def test_a_released_qwen3_vl_video_config_sets_the_clips_resize(models, tmp_path):
    """Without torchvision a Qwen3-VL checkpoint's video_preprocessor_config.json gives the PIL backend its steps:
    the clip's pixel limits, mean and std, and the per-frame cap where it asks for one."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from prefixkv_core.models.family import qwen_vl_video

    config = models["qwen3-vl"].model.config
    released = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "video_processor_type": "Qwen3VLVideoProcessor"}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(released))
    settings = qwen_vl_video.video_settings(str(tmp_path), config)
    assert (settings["min_pixels"], settings["max_pixels"], settings["patch_size"]) == (4096, 25165824, 16)
    assert settings["image_mean"] == [0.5] * 3 and settings["cap_pixels_per_frame"] is False

    class Processor:
        prefixkv_video_settings = settings

    size = qwen_vl_video.frame_size(config, Processor, 8, 1280, 720)
    assert size == smart_resize(8, 720, 1280, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=25165824)
    Processor.prefixkv_video_settings = dict(settings, cap_pixels_per_frame=True)  # 768 tokens a frame at most
    capped = qwen_vl_video.frame_size(config, Processor, 8, 1280, 720)
    assert capped[0] * capped[1] <= 768 * 32 * 32 < size[0] * size[1]


def test_cli_compare_takes_a_video_on_a_qwen_model(tmp_path):
    from prefixkv_core.__main__ import main

    video = write_video(frames(6), tmp_path / "dot.mp4", fps=6)
    out = tmp_path / "out.json"
    code = main(["compare", "--model", "tiny-qwen2.5-vl", "--video", str(video), "--frames", "3",
                 "--prompt", "what moves?", "--methods", "full,h2o,fastv", "--max-new-tokens", "2",
                 "--json", str(out), "--quiet"])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["visuals"]["video"]["frames"] == 3 and payload["visuals"]["video"]["read_as"] == "video"
    assert len(payload["prefill"]["image_ranges"]) == 2
    assert all(len(m["kept_per_image"]) == 2 for m in payload["methods"].values())


def test_a_follow_up_after_a_video_runs_at_its_logical_positions(lm):
    """Full over two turns with a video in the first: the follow-up's tokens at their true positions plus the
    video prompt's rope delta, as the model's own generate over the whole conversation."""
    engine = Engine(lm)
    session = engine.new_session(None, "<video> " + PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=4),
                                 video=frames(3), frames=3)
    list(session.run())
    first = list(session.states["full"].turn_ids)
    list(session.follow_up("and then?"))
    inputs = session.encoded.inputs
    answer = first[:-1] if first[-1] in engine.eos_ids else first
    follow = M.encode(lm, None, M.format_followup(lm, "and then?"), add_special_tokens=False)["input_ids"]
    ids = torch.cat([inputs["input_ids"], torch.tensor([answer]), follow], dim=1)
    with torch.inference_mode():
        out = lm.model.generate(**{**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                mm_token_type_ids=types_of(lm, ids), max_new_tokens=4, do_sample=False)
    assert session.states["full"].turn_ids == out[0, ids.shape[1]:].tolist()
