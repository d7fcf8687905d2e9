"""Several images and a video's frames in one conversation, on a tiny model of every LLaVA family: where the
prompt places them, eviction == masking and batched == alone with every method in both query modes, the
vision-side reductions per image, each image's kept share, the overlay's map, the video path, the checks made
before any prefill, the CLI and the lmms-eval samples."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from prefixkv_core import Engine, EngineError, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.policies import METHODS, make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.session.video_input import write_video
from prefixkv_core.testing import (LLAVA_FAMILIES, build_tiny_family, kept_entry_masks, layered_reference_cache,
                                   prefill_and_compress)

PROMPT = "describe the pictures in detail"


@pytest.fixture(scope="module")
def families():
    return {family: build_tiny_family(family) for family in LLAVA_FAMILIES}


@pytest.fixture(params=LLAVA_FAMILIES)
def lm(request, families):
    return families[request.param]


def pictures(n: int = 3) -> list[Image.Image]:
    """Noise pictures of different sizes (the anyres families tile each differently)."""
    rng = np.random.default_rng(5)
    sizes = [(80, 48), (48, 64), (64, 64), (96, 40)]
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:n]]


def image_runs(is_image: torch.Tensor) -> list[int]:
    runs, length = [], 0
    for flag in is_image.tolist() + [False]:
        if flag:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


def clip(path, n: int = 12, size=(64, 48)):
    """A clip whose frame i shows a dot at x = 4 i."""
    frames = []
    for i in range(n):
        im = Image.new("RGB", size, (30, 30, 30))
        ImageDraw.Draw(im).ellipse((4 * i, 16, 4 * i + 12, 28), fill=(230, 40, 40))
        frames.append(im)
    return write_video(frames, path, fps=6)


# -- where the images go -------------------------------------------------------------------------------------------

def test_images_come_first_or_where_the_markers_put_them(lm):
    images = pictures()
    first = M.encode(lm, images, M.format_prompt(lm, PROMPT, with_image=3))
    marked = "Image 1: <image> then image 2: <image> and last <image>. " + PROMPT
    placed = M.encode(lm, images, M.format_prompt(lm, marked, with_image=3))
    sizes = [lm.image_tokens(*im.size) for im in images]
    for batch in (first, placed):
        assert int((batch["input_ids"] == lm.image_token_id).sum()) == sum(sizes)
    assert image_runs(placed["input_ids"][0] == lm.image_token_id) == sizes  # text between every two images
    text = lm.processor.tokenizer.decode(placed["input_ids"][0][placed["input_ids"][0] != lm.image_token_id])
    assert "then image 2:" in text and "and last" in text


def test_marker_counts_are_checked_before_anything_runs(families):
    engine = Engine(families["llava-1.5"])
    images = pictures(2)
    with pytest.raises(EngineError, match=r"3 <image> marker\(s\) for 2 image"):
        engine.new_session(images, "<image><image><image> what?", ["full"], 0.3)
    with pytest.raises(EngineError, match="<video> marker but no video"):
        engine.new_session(images, "<video> what?", ["full"], 0.3)
    with pytest.raises(EngineError, match="image 2 of 2"):
        engine.new_session([images[0], 42], PROMPT, ["full"], 0.3)
    with pytest.raises(EngineError, match="the limit is 64"):
        engine.new_session(images * 33, PROMPT, ["full"], 0.3)


def test_more_images_than_the_context_holds_are_refused_before_the_prefill(families):
    lm = families["llava-onevision"]
    big = Image.new("RGB", (333, 257), (90, 90, 90))
    each = lm.image_tokens(*big.size)
    count = lm.max_context // each + 2
    with pytest.raises(EngineError) as err:
        Engine(lm).new_session([big] * count, PROMPT, ["full"], 0.3)
    message = str(err.value)
    assert f"{count} images take {count * each} tokens" in message and f"context of {lm.max_context}" in message
    fit = int(message.split("at most ")[1].split(" ")[0])
    assert 0 < fit < count


# -- every method sees every image -----------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["h2o", "snapkv", "pyramidkv", "vlcache", "prefixkv", "random", "fastv", "dart",
                                    "pyramiddrop", "sparsevlm"])
def test_eviction_equals_masking_with_several_images(lm, method):
    """As test_families' single-image check, with three images (text between them): a compressed cache gives the
    logits of its prefill's cache with the evicted entries masked; FastV's and DART's own prefill gives those of
    a plain forward with the dropped image tokens (from every image) masked from layer K on."""
    images = pictures()
    inputs = M.encode(lm, images, M.format_prompt(lm, "<image> one, <image> two, <image> three: " + PROMPT, 3))
    ids = inputs["input_ids"]
    is_image = ids == lm.image_token_id
    budget = 0.3
    # a token drop's budget as a share of the image tokens, so it keeps some of every image and drops the rest
    policy = make_policy(method, budget, **({"budget_of": "image"} if method in ("fastv", "dart") else
                                            {"budget_of": "image", "stages": 2} if method == "pyramiddrop" else
                                            {"budget_of": "image", "recycle": False} if method == "sparsevlm" else {}))
    with tracked_attention_enabled(lm.model):
        shared = runner.prefill_for(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.num_layers,
                                    lm.device, lm.image_token_id)
    n = shared.prompt_len
    compressed = shared.cache.clone()
    plans, _ = policy.prefill(PrefillView(compressed, runner.policy_stats(policy, shared.stats, n), n, budget,
                                          policy.prefill_stats(n).window))
    apply_plans(compressed, plans)
    engine = Engine(lm)
    token = torch.tensor([[7]])
    uncompressed = shared.cache.clone()
    with tracked_attention_enabled(lm.model):
        if policy.prefill_token_drops(n, is_image, lm.num_layers):
            kept = compressed.layers[-1].positions[0, 0]
            dropped = set(np.flatnonzero(is_image[0].numpy()).tolist()) - set(kept.tolist())
            runs = image_runs(is_image[0])
            starts = np.cumsum([0] + runs[:-1])
            image_at = np.flatnonzero(is_image[0].numpy())
            touched = {int(np.searchsorted(starts, np.flatnonzero(image_at == p)[0], side="right")) for p in dropped}
            assert len(touched) >= 2  # the drop reached more than one image
            assert set(kept.tolist()) & set(image_at.tolist())  # and kept some image tokens, whose positions count
            logits, uncompressed = layered_reference_cache(lm, ids, is_image, M.vision_inputs(inputs), shared.cache)
            torch.testing.assert_close(shared.logits, logits, atol=1e-4, rtol=1e-4)
        evicted = engine.forward(compressed, token, n, AttentionProbe())
        masked = engine.forward(uncompressed, token, n, AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    assert min(layer.length for layer in compressed.layers) < n
    torch.testing.assert_close(evicted, masked, atol=1e-4, rtol=1e-4)


def test_query_agnostic_holds_back_the_text_after_the_last_marker(families):
    lm = families["llava-interleave"]
    engine = Engine(lm)
    session = engine.new_session(pictures(2), "first <image> second <image> which is brighter?", ["full", "snapkv"],
                                 0.3, GenerationSettings(max_new_tokens=2), query_agnostic=True)
    list(session.run())
    pre = session.prefill
    assert pre.compressed_tokens < pre.prompt_tokens and int(pre.is_image.sum()) == pre.image_tokens
    with pytest.raises(EngineError, match="no text after its last <image> or <video> marker"):
        list(engine.new_session(pictures(2), "which is brighter? <image> <image>", ["full"], 0.3,
                                GenerationSettings(max_new_tokens=2), query_agnostic=True).run())


# -- the vision-side reductions, per image --------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["visionzip", "downsample", "vispruner", "prumerge_plus"])
def test_vision_reductions_reduce_each_image_with_its_share(lm, method):
    images = pictures()
    session = Engine(lm).new_session(images, PROMPT, [method], 0.4, GenerationSettings(max_new_tokens=2),
                                     knobs={method: {"budget_of": "image"}})
    list(session.run())
    state = session.states[method]
    assert state.error is None, state.error
    sources = session.states[method].policy.image_token_sources(state.policy_state)
    sizes = [lm.image_tokens(*im.size) for im in images]
    assert sources is not None and sources.original_tokens == sum(sizes)
    fed = np.bincount(sources.images, minlength=3)
    assert all(f > 0 for f in fed) and fed.sum() == sources.tokens < sum(sizes)
    for i, (start, stop) in enumerate(session.image_layout.image_ranges()):  # cells stay inside their image
        cells = np.concatenate([c for c, im in zip(sources.cells, sources.images) if im == i] or [np.zeros(0, int)])
        assert np.all((cells >= start) & (cells < stop))
    # the reduced prompt keeps the text between the images: its image tokens sit where the record says
    cache = state.cache.layers[0]
    image_positions = sorted(set(cache.positions[0][cache.is_image[0]].tolist()))
    assert set(image_positions) <= set(np.asarray(sources.positions).tolist())


# -- what the record and the overlay say ------------------------------------------------------------------------

def test_each_images_kept_share_and_the_overlay_map(lm):
    images = pictures()
    session = Engine(lm).new_session(images, PROMPT, ["full", "h2o", "fastv"], 0.25,
                                     GenerationSettings(max_new_tokens=3))
    list(session.run())
    record = session.record.to_dict()
    ranges = record["prefill"]["image_ranges"]
    assert [b - a for a, b in ranges] == [lm.image_tokens(*im.size) for im in images]
    assert record["visuals"]["images"] == [list(im.size) for im in images]
    assert record["methods"]["full"]["kept_per_image"] == [1.0, 1.0, 1.0]
    # H2O's per-image shares from its cache, counted naively
    cache = session.states["h2o"].cache
    positions = np.flatnonzero(session.encoded.is_image[0].numpy())
    held = np.zeros(3)
    for layer in cache.layers:
        for head in range(layer.n_kv):
            for p in layer.positions[0, head].tolist():
                if p in positions:
                    rank = int(np.searchsorted(positions, p))
                    held[next(i for i, (a, b) in enumerate(ranges) if a <= rank < b)] += 1
    expected = held / (len(cache.layers) * cache.layers[0].n_kv) / np.array([b - a for a, b in ranges])
    np.testing.assert_allclose(record["methods"]["h2o"]["kept_per_image"], expected, atol=1e-4)
    assert min(record["methods"]["h2o"]["kept_per_image"]) < 1.0
    layer = lm.num_layers - 1
    full, h2o = session.kept_image_map("full", layer), session.kept_image_map("h2o", layer)
    assert full.n_tokens == h2o.n_tokens == ranges[-1][1] and np.all(full.token_share == 1.0)
    assert full.layout.n_images == 3 and {v.image for v in full.layout.views} == {0, 1, 2}
    last = cache.layers[layer]
    naive = np.zeros(h2o.n_tokens)
    for p in last.positions[0].flatten().tolist():
        if p in positions:
            naive[int(np.searchsorted(positions, p))] += 1 / last.n_kv
    np.testing.assert_allclose(h2o.token_share, naive, atol=1e-6)


# -- video ----------------------------------------------------------------------------------------------------------

def test_a_videos_frames_are_read_as_images_after_the_images(families, tmp_path):
    lm = families["llava-interleave"]
    path = clip(tmp_path / "dot.mp4")
    engine = Engine(lm)
    session = engine.new_session(pictures(1), "<image> is the photo, <video> is the clip: what moves?",
                                 ["full", "snapkv", "visionzip"], 0.3, GenerationSettings(max_new_tokens=2),
                                 video=str(path), frames=4)
    list(session.run())
    assert session.visuals.kinds() == ["image", "frame", "frame", "frame", "frame"]
    record = session.record.to_dict()
    assert record["visuals"]["video"]["frames"] == 4 and record["visuals"]["video"]["total_frames"] == 12
    assert len(record["prefill"]["image_ranges"]) == 5
    assert all(len(r["kept_per_image"]) == 5 for r in record["methods"].values())
    # the sampled frames are the clip's frames 0, 3, 7, 11 (the dot moves right)
    dots = [int(np.argmax(np.asarray(f)[:, :, 0].astype(int).sum(axis=0))) for f in session.images[1:]]
    assert dots == sorted(dots) and dots[0] < 12 and dots[-1] > 40
    for bad, message in (({"frames": 0}, "1"), ({"frames": 65}, "64")):
        with pytest.raises(EngineError, match=message):
            engine.new_session(None, "what moves?", ["full"], 0.3, video=str(path), **bad)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(300))
    with pytest.raises(EngineError, match="not a readable video"):
        engine.new_session(None, "what moves?", ["full"], 0.3, video=str(broken))


# -- the CLI and lmms-eval's samples -----------------------------------------------------------------------------

def test_cli_compare_takes_several_images_and_a_video(tmp_path):
    from prefixkv_core.__main__ import main

    paths = []
    for k, im in enumerate(pictures(2)):
        paths += ["--image", str(tmp_path / f"{k}.png")]
        im.save(tmp_path / f"{k}.png")
    video = clip(tmp_path / "dot.mp4")
    out = tmp_path / "out.json"
    code = main(["compare", "--model", "tiny-llava-onevision", *paths, "--video", str(video), "--frames", "3",
                 "--prompt", "what is shown?", "--methods", "full,h2o,fastv", "--max-new-tokens", "2",
                 "--json", str(out), "--quiet"])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["image"] == [str(tmp_path / "0.png"), str(tmp_path / "1.png")]
    assert payload["visuals"]["video"]["frames"] == 3 and len(payload["prefill"]["image_ranges"]) == 5
    assert main(["compare", "--model", "tiny-llava-1.5", "--image", paths[1], "--prompt", "<image><image> what?",
                 "--methods", "full", "--quiet"]) == 2


def test_lmms_samples_with_several_images_and_a_video(families, tmp_path):
    from prefixkv_core.evaluation.answers import AnswerBank, Sample
    from prefixkv_core.evaluation.model_args import parse_model_args
    from prefixkv_core.method_args import MethodArgError

    lm = families["llava-1.5"]
    bank = AnswerBank(Engine(lm), parse_model_args({"pretrained": "tiny", "methods": "snapkv", "budget": 0.5,
                                                    "frames": 3}))
    images = tuple(pictures(2))
    several = Sample("t/test/1", "which is brighter?", images, (), GenerationSettings(max_new_tokens=2))
    answer = bank.answer(several, ("snapkv", 0.5))
    alone = Engine(lm).new_session(list(images), "which is brighter?", ["snapkv"], 0.5,
                                   GenerationSettings(max_new_tokens=2))
    list(alone.run())
    assert answer == alone.states["snapkv"].text and not bank.skipped  # the engine's own answer to the same turn
    assert several.key() != Sample("t/test/1", "which is brighter?", images[:1], ()).key()
    video = Sample("t/test/2", "what moves?", None, (), GenerationSettings(max_new_tokens=2),
                   str(clip(tmp_path / "dot.mp4")), 3)
    assert isinstance(bank.answer(video, ("snapkv", 0.5)), str) and not bank.skipped
    with pytest.raises(MethodArgError, match="frames"):
        parse_model_args({"pretrained": "tiny", "frames": 0})


# -- follow-ups that add images ---------------------------------------------------------------------------------------

# each family in one of the four query and budget modes, so that every family and every mode is run once: the modes
# are the policies' (the same code on every family), the families' image paths the models' (the same in every mode)
MODES = [(False, "published"), (True, "published"), (False, "equal_memory"), (True, "equal_memory")]
FOLLOW_UP_MODES = [(family, *MODES[i % len(MODES)]) for i, family in enumerate(LLAVA_FAMILIES)]
assert len(LLAVA_FAMILIES) >= len(MODES)  # every mode gets a family


@pytest.mark.parametrize("family,query_agnostic,budget_mode", FOLLOW_UP_MODES,
                         ids=[f"{f}-{'query-agnostic' if q else 'query-aware'}-{b}" for f, q, b in FOLLOW_UP_MODES])
def test_a_follow_up_adds_an_image(families, family, query_agnostic, budget_mode):
    """Every method, two images and a question after them, then a follow-up that adds a third, in both budget modes
    and both query modes: each turn's batched answers are each method's answers decoded alone; Full's follow-up
    gives the logits of the model's own forward over the whole conversation (every turn's images through the
    model's own path)."""
    lm = families[family]
    *first, second = pictures(3)
    engine = Engine(lm)
    answers = []
    for batched in (True, False):
        session = engine.new_session(first, PROMPT, "all", 0.3, GenerationSettings(max_new_tokens=3),
                                     query_agnostic=query_agnostic, batched=batched, budget_mode=budget_mode)
        list(session.run())
        assert all(s.error is None for s in session.states.values()), \
            {n: s.error for n, s in session.states.items() if s.error}
        turns = [{name: list(s.turn_ids) for name, s in session.states.items()}]
        events = list(session.follow_up("and this one? <image> compare them", image=second))
        assert all(s.error is None for s in session.states.values()), \
            {n: s.error for n, s in session.states.items() if s.error}
        assert {e.method for e in events if e.kind == "done"} == set(METHODS)
        turns.append({name: list(s.turn_ids) for name, s in session.states.items()})
        answers.append(turns)
    assert answers[0] == answers[1]
    # the reference: the model's own forward over the conversation's ids and every image
    session = engine.new_session(first, PROMPT, ["full"], 0.3, GenerationSettings(max_new_tokens=3),
                                 query_agnostic=query_agnostic)
    list(session.run())
    answer = [t for t in session.states["full"].turn_ids if t not in engine.eos_ids]
    list(session.follow_up("and this one? <image> compare them", image=second))
    one = M.encode(lm, first, M.format_prompt(lm, PROMPT, with_image=len(first)))
    two = M.encode(lm, second, M.format_followup(lm, "and this one? <image> compare them", images=1),
                   add_special_tokens=False)
    ids = torch.cat([one["input_ids"], torch.tensor([answer]), two["input_ids"]], dim=1)
    with torch.inference_mode():  # each turn's image through the model's own image path, scattered as its forward does
        features = [torch.cat(list(lm.model.get_image_features(**M.vision_inputs(enc), return_dict=True).pooler_output))
                    for enc in (one, two)]
        embeds = lm.model.get_input_embeddings()(ids)
        embeds = embeds.masked_scatter((ids == lm.image_token_id)[..., None], torch.cat(features).to(embeds.dtype))
        logits = lm.model(inputs_embeds=embeds).logits[0, -1]
    assert int(logits.argmax()) == session.states["full"].turn_ids[0]
    assert session.states["full"].true_len == ids.shape[1] + len(session.states["full"].turn_ids) - 1


def test_a_follow_ups_images_are_checked(families):
    lm = families["llava-onevision"]
    engine = Engine(lm)
    session = engine.new_session(pictures(1), PROMPT, ["full"], 0.3, GenerationSettings(max_new_tokens=2))
    list(session.run())
    with pytest.raises(EngineError, match=r"1 <image> marker\(s\) for 2 image"):
        list(session.follow_up("<image> and?", image=pictures(2)))
    with pytest.raises(EngineError, match="not a readable image|cannot open"):
        list(session.follow_up("and?", image="/nonexistent/picture.png"))
    big = [Image.new("RGB", (333, 257))] * (lm.max_context // lm.image_tokens(333, 257) + 1)
    with pytest.raises(EngineError, match="context"):
        list(session.follow_up("and all these?", image=big))
    assert session.turn == 0  # nothing was fed: the conversation goes on
    list(session.follow_up("and now?"))
    assert session.turn == 1 and session.states["full"].error is None


# -- LLaVA-OneVision's own video path ---------------------------------------------------------------------------------

def test_onevision_reads_a_video_on_its_own_path(families, tmp_path):
    """OneVision: one <video> block of F pooled grids + a newline, the frames preprocessed as its video processor
    does (here on the PIL backend), the prefill's logits those of the model's own forward with
    pixel_values_videos, the overlay's layout one pooled grid per frame."""
    from prefixkv_core.models.video import pooled_side, video_pixels, video_token_count

    lm = families["llava-onevision"]
    config = lm.model.config
    path = clip(tmp_path / "dot.mp4")
    session = Engine(lm).new_session(pictures(1), "<image> the photo, <video> the clip: what moves?", ["full"], 0.3,
                                     GenerationSettings(max_new_tokens=1), video=str(path), frames=4)
    list(session.run())
    ids = session.encoded.ids[0]
    assert int((ids == lm.video_token_id).sum()) == video_token_count(config, 4) == 4 * pooled_side(config) ** 2 + 1
    assert session.visuals.kinds() == ["image", "frame", "frame", "frame", "frame"]
    layout = session.image_layout
    assert [v.name for v in layout.views][-5:] == ["frame 1", "frame 2", "frame 3", "frame 4", "video newline"]
    assert layout.n_images == 5 and layout.n_tokens == session.prefill.image_tokens
    # the frames' pixels: resized to the square (bicubic), rescaled, normalised with the video processor's mean/std
    settings = lm.processor.prefixkv_video_settings
    frames = session.images[1:]
    side = settings["size"]
    expected = np.stack([((np.asarray(f.resize((side, side), Image.BICUBIC), dtype=np.float32) / 255
                           - settings["image_mean"]) / settings["image_std"]).transpose(2, 0, 1) for f in frames])
    np.testing.assert_allclose(video_pixels(lm.processor, frames)[0].numpy(), expected, atol=2e-2)
    with torch.inference_mode():
        own = lm.model(**session.encoded.inputs).logits[0, -1]
    torch.testing.assert_close(session.states["full"].first_logits, own, atol=1e-4, rtol=1e-4)


def test_a_checkpoints_video_settings_are_read(tmp_path):
    from prefixkv_core.testing import save_tiny_family

    path = save_tiny_family(tmp_path / "ov", "llava-onevision")
    (tmp_path / "ov" / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": 32, "width": 32}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    lm = M.load_model(path, device="cpu")
    assert lm.processor.prefixkv_video_settings == {"size": 32, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.mark.parametrize("method", ["h2o", "snapkv", "vlcache", "prefixkv", "fastv", "dart", "pyramiddrop",
                                    "sparsevlm"])
def test_eviction_equals_masking_with_a_native_video(families, tmp_path, method):
    from prefixkv_core.session.video_input import load_video

    lm = families["llava-onevision"]
    frames = list(load_video(str(clip(tmp_path / "dot.mp4")), 4).frames)
    text = M.format_prompt(lm, "<image> photo <video> clip: " + PROMPT, with_image=1)
    inputs = M.encode(lm, pictures(1), text, video=frames)
    ids = inputs["input_ids"]
    is_image = lm.visual_mask(ids)
    # SparseVLM's last stage keeps 6 % of the image tokens at r = 0.3, all of them the photo's here
    policy = make_policy(method, 0.6 if method == "sparsevlm" else 0.3,
                         **({"budget_of": "image"} if method in ("fastv", "dart", "pyramiddrop") else
                            {"budget_of": "image", "recycle": False} if method == "sparsevlm" else {}))
    shared, compressed, n = prefill_and_compress(lm, policy, inputs, 0.3)
    uncompressed = shared.cache.clone()
    with tracked_attention_enabled(lm.model):
        if policy.prefill_token_drops(n, is_image, lm.num_layers):
            kept = compressed.layers[-1].positions[0, 0]
            video_dropped = set(np.flatnonzero((ids[0] == lm.video_token_id).numpy()).tolist()) - set(kept.tolist())
            assert video_dropped  # the drop reached the video's tokens
            visual_kept = set(np.flatnonzero(is_image[0].numpy()).tolist()) & set(kept.tolist())
            video_kept = set(np.flatnonzero((ids[0] == lm.video_token_id).numpy()).tolist()) & visual_kept
            assert visual_kept and (video_kept or method == "dart")  # kept tokens whose positions count (DART
            # drops the static clip's tokens as duplicates of its pivots)
            logits, uncompressed = layered_reference_cache(lm, ids, is_image, M.vision_inputs(inputs), shared.cache)
            torch.testing.assert_close(shared.logits, logits, atol=1e-4, rtol=1e-4)
        engine = Engine(lm)
        evicted = engine.forward(compressed, torch.tensor([[7]]), n, AttentionProbe())
        masked = engine.forward(uncompressed, torch.tensor([[7]]), n,
                                AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    torch.testing.assert_close(evicted, masked, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget_mode", ["published", "equal_memory"])
@pytest.mark.parametrize("query_agnostic", [False, True], ids=["query-aware", "query-agnostic"])
def test_a_native_video_batched_equals_alone(families, tmp_path, query_agnostic, budget_mode):
    """Every method on OneVision with an image and a video: batched == alone."""
    lm = families["llava-onevision"]
    path = str(clip(tmp_path / "dot.mp4"))
    answers = []
    for batched in (True, False):
        session = Engine(lm).new_session(pictures(1), "what moves?", "all", 0.3,
                                         GenerationSettings(max_new_tokens=3), video=path, frames=3,
                                         query_agnostic=query_agnostic, batched=batched, budget_mode=budget_mode)
        list(session.run())
        assert not {n: s.error for n, s in session.states.items() if s.error}
        answers.append({n: list(s.turn_ids) for n, s in session.states.items()})
        assert all(len(r["kept_per_image"]) == 4 for r in session.record.to_dict()["methods"].values())
    assert answers[0] == answers[1]


@pytest.mark.parametrize("method", ["visionzip", "downsample", "vispruner", "prumerge_plus"])
def test_vision_reductions_reduce_every_frame_of_a_native_video(families, tmp_path, method):
    """On OneVision's own video path VisionZip and Downsample plan each frame from the tower's feature layer (their
    tokens replace the frame's pooled grid), keep the video's newline token, and leave the image alone but for
    its own share."""
    lm = families["llava-onevision"]
    session = Engine(lm).new_session(pictures(1), "<image> photo <video> clip: what moves?", [method], 0.3,
                                     GenerationSettings(max_new_tokens=2), video=str(clip(tmp_path / "dot.mp4")),
                                     frames=4, knobs={method: {"budget_of": "image"}})
    list(session.run())
    state = session.states[method]
    assert state.error is None, state.error
    sources = state.policy.image_token_sources(state.policy_state)
    ranges = session.image_layout.image_ranges()
    assert sources.original_tokens == ranges[-1][1] == session.prefill.image_tokens
    fed = np.bincount(sources.images, minlength=5)
    assert all(f > 0 for f in fed) and sources.tokens < sources.original_tokens
    for i, (start, stop) in enumerate(ranges):  # every LM token stands for tokens of its own image or frame
        for cells, image in zip(sources.cells, sources.images):
            if image == i:
                assert np.all((cells >= start) & (cells < stop))
    cache = state.cache.layers[0]
    video_fed = int((cache.positions[0, 0][cache.is_image[0, 0]] >= int(sources.positions[fed[0]])).sum())
    assert video_fed == fed[1:].sum()  # the frames' tokens and the newline token reached the language model
    assert session.record.to_dict()["methods"][method]["kept_per_image"][1:] != [1.0] * 4


def test_a_video_between_two_images_is_read_where_its_marker_is(families, tmp_path):
    """A family that reads a video as images: `<image> <video> <image>` reads the first image, the frames, then the
    second image, in that order (each image's tokens from its own pixels)."""
    lm = families["llava-next"]
    first, second = pictures(2)
    session = Engine(lm).new_session([first, second], "<image> then <video> then <image>: what changed?", ["full"],
                                     0.3, GenerationSettings(max_new_tokens=1), video=str(clip(tmp_path / "d.mp4")),
                                     frames=2)
    list(session.run())
    assert session.visuals.kinds() == ["image", "frame", "frame", "image"]
    assert session.images[0].tobytes() == first.tobytes() and session.images[-1].tobytes() == second.tobytes()
    sizes = [list(im.size) for im in (first, second)]
    assert session.record.to_dict()["visuals"]["images"] == sizes
    ranges = session.image_layout.image_ranges()
    assert [b - a for a, b in ranges] == [lm.image_tokens(*im.size) for im in session.images]
