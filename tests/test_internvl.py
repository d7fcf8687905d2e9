"""InternVL (transformers' `internvl`: InternVL2.5, InternVL3) on a tiny random model of its structure, saved as a
checkpoint and loaded through `load_model` like a released one (CPU, no network): its tiles and thumbnail, every
method on it, Downsample resizing the image before the tower by default (VisionZip and Downsample's grid pooling on
its tower: `test_internvl_visionzip.py`)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.models.families import FAMILY_INFO, hooks
from prefixkv_core.policies import METHODS, make_policy
from prefixkv_core.testing import (kept_entry_masks, layered_reference_cache, prefill_and_compress, save_tiny_family,
                                   wide_noise_picture)

PROMPT = "describe the picture in detail"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_tiny_family(tmp_path_factory.mktemp("internvl"), "internvl")
    return path, M.load_model(path, device="cpu")


@pytest.fixture(scope="module")
def lm(checkpoint):
    return checkpoint[1]


@pytest.fixture(scope="module")
def picture():
    return wide_noise_picture()


@pytest.fixture(scope="module")
def square():
    """Large enough for 2x2 tiles and a thumbnail (a square image's grids tie: more tiles while it is large)."""
    rng = np.random.RandomState(5)
    return Image.fromarray(rng.randint(0, 256, (96, 96, 3), dtype=np.uint8))


def _generate(lm, **kw):
    with torch.inference_mode():
        return lm.model.generate(**kw, max_new_tokens=6, do_sample=False)


def _context_id(lm):
    return lm.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")


# -- loading, prompt, layout ---------------------------------------------------------------------------------------

def test_the_registry_holds_internvl():
    info = FAMILY_INFO["internvl"]
    assert info.model_type == "internvl" and info.model_type in M.ACCEPTED_MODEL_TYPES
    assert hooks("internvl").__name__.endswith("family.internvl")
    assert not info.mrope and info.anyres and info.token_count_follows_image_size
    assert "tiny-internvl" in M.tiny.TINY_FAMILY_SPECS


def test_loads_as_its_family(lm):
    assert type(lm.model).__name__ == "InternVLForConditionalGeneration" and lm.family == "internvl"
    assert M.family_of(lm.model.config) == "internvl" and lm.anyres
    assert lm.notes and "tiny random model" in lm.notes[0] and lm.vision_trained is False
    assert lm.image_token_id == _context_id(lm) == lm.processor.image_token_id
    assert type(lm.processor).__name__ in ("InternVLProcessor", "ImageOnlyInternVLProcessor")
    assert type(lm.processor.image_processor).__name__ == "GotOcr2ImageProcessorPil"
    cfg = lm.model.config
    assert (cfg.downsample_ratio, cfg.vision_config.model_type, cfg.text_config.model_type) == (
        0.5, "internvl_vision", "qwen2")
    assert lm.num_kv_heads < lm.num_heads  # GQA, as Qwen2.5's
    assert lm.image_grid == (4, 4) and lm.image_seq_length == 5 * 16  # up to 4 tiles and a thumbnail
    assert lm.video_token_id is None  # a video is read as images


def test_tiny_spec_loads_through_a_checkpoint(tmp_path):
    loaded = M.load_model("tiny-internvl", device="cpu", cache_dir=str(tmp_path))
    assert loaded.name == "tiny-internvl" and loaded.family == "internvl"
    assert (tmp_path / "tiny" / "internvl" / "config.json").is_file()
    saved = json.loads((tmp_path / "tiny" / "internvl" / "processor_config.json").read_text())
    assert saved["processor_class"] == "InternVLProcessor"


def test_prompt_formats_are_the_released_ones(lm):
    assert M.format_prompt(lm, "What is it?", True) == (
        "<|im_start|>user\n<IMG_CONTEXT>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n")
    assert M.format_followup(lm, "And?") == "<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("size", [(80, 48), (48, 80), (32, 32), (96, 96), (300, 40), (17, 90), (333, 257)])
def test_layout_is_the_tiles_then_the_thumbnail(lm, size):
    """As many views as tiles the tower encodes (one, or the grid's and the thumbnail), 16 tokens each, one
    contiguous run of <IMG_CONTEXT> tokens between <img> and </img>."""
    image = Image.new("RGB", size, (90, 30, 200))
    inputs = M.encode(lm, image, M.format_prompt(lm, "Hi", True))
    ids = inputs["input_ids"][0]
    flags = ids == lm.image_token_id
    layout = lm.image_layout(*size)
    assert int(flags.sum()) == layout.n_tokens == lm.image_tokens(*size) <= lm.image_seq_length
    assert len(layout.views) == inputs["pixel_values"].shape[0]
    assert all((v.rows, v.cols, v.newline) == (4, 4, False) for v in layout.views)
    where = flags.nonzero().flatten()
    first, last = int(where[0]), int(where[-1])
    assert last - first + 1 == layout.n_tokens
    tok = lm.tokenizer
    assert int(ids[first - 1]) == tok.convert_tokens_to_ids("<img>")
    assert int(ids[last + 1]) == tok.convert_tokens_to_ids("</img>")
    if len(layout.views) > 1:
        assert layout.views[-1].name == "thumbnail" and layout.views[-1].box == (0.0, 0.0, 1.0, 1.0)
        boxes = [v.box for v in layout.views[:-1]]
        assert sum((r - l) * (b - t) for l, t, r, b in boxes) == pytest.approx(1.0)  # the tiles cover the image


def test_token_count_follows_the_image_size(lm, square):
    """A large square image gets 2x2 tiles and a thumbnail, a small one a single tile."""
    assert lm.image_tokens(*square.size) == 5 * 16
    assert lm.image_tokens(40, 40) == 16


def test_run_limit_counts_the_image_at_its_size(lm, square):
    from prefixkv_core.limits import prompt_tokens

    fed = M.encode(lm, square, M.format_prompt(lm, "Hi", True))["input_ids"].shape[1]
    assert prompt_tokens(lm, "Hi", True, square.size) == fed
    assert prompt_tokens(lm, "Hi", True) >= fed


def test_random_weights_in_the_released_internvl3_1b_shape():
    """`build_random_model("internvl3-1b")`: InternVL3-1B's shapes (0.94 B parameters: InternViT-300M, 24 Qwen2.5
    layers of 2 KV heads, 256 tokens a 448 px tile, up to 12 tiles and a thumbnail), built on the meta device."""
    from prefixkv_core.models import RANDOM_KINDS, build_random_model

    assert "internvl3-1b" in RANDOM_KINDS
    sm = build_random_model("internvl3-1b", device="meta", dtype=torch.float16)
    assert sm.random_weights and sm.family == "internvl"
    assert (sm.num_layers, sm.num_kv_heads, sm.head_dim, sm.vocab_size) == (24, 2, 64, 151674)
    assert sum(p.numel() for p in sm.model.parameters()) == pytest.approx(0.938e9, rel=0.01)
    assert sm.image_grid == (16, 16) and sm.image_seq_length == 13 * 256
    assert sm.image_tokens(448, 448) == 256 and sm.image_tokens(896, 448) == 3 * 256


# -- the engine ----------------------------------------------------------------------------------------------------

def test_full_equals_generate_over_two_turns(lm, picture):
    engine = Engine(lm)
    session = engine.new_session(picture, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=6))
    list(session.run())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    out = _generate(lm, **inputs)
    first = out[0, ids.shape[1]:].tolist()
    assert session.states["full"].turn_ids == first
    list(session.follow_up("and the colours?"))
    answer = first[:-1] if first[-1] in engine.eos_ids else first
    follow = M.encode(lm, None, M.format_followup(lm, "and the colours?"), add_special_tokens=False)["input_ids"]
    ids2 = torch.cat([ids, torch.tensor([answer], dtype=torch.long), follow], dim=1)
    out = _generate(lm, input_ids=ids2, attention_mask=torch.ones_like(ids2), **M.vision_inputs(inputs))
    assert session.states["full"].turn_ids == out[0, ids2.shape[1]:].tolist()


@pytest.mark.parametrize("method,budget", [("h2o", 0.3), ("snapkv", 0.3), ("adakv", 0.3), ("pyramidkv", 0.3),
                                           ("vlcache", 0.3), ("prefixkv", 0.3), ("random", 0.3)])
def test_eviction_equals_masking(lm, square, method, budget):
    """A compressed cache gives the logits of its prefill's cache with the evicted entries masked, per layer and
    head."""
    inputs = M.encode(lm, square, M.format_prompt(lm, PROMPT, with_image=True))
    policy = make_policy(method, budget, **({"window": 8} if method == "adakv" else {}))
    shared, compressed, n = prefill_and_compress(lm, policy, inputs, budget)
    engine = Engine(lm)
    token = torch.tensor([[7]])
    with tracked_attention_enabled(lm.model):
        evicted = engine.forward(compressed, token, n, AttentionProbe())
        masked = engine.forward(shared.cache.clone(), token, n,
                                AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    assert min(layer.length for layer in compressed.layers) < n  # something was evicted
    torch.testing.assert_close(evicted, masked, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,layer", [("fastv", None), ("dart", None), ("fastv", 1), ("dart", 1),
                                          ("pyramiddrop", None), ("sparsevlm", None)])
def test_token_drop_equals_the_masked_forward(lm, square, method, layer):
    """FastV's and DART's own prefill, whose layers from K on never compute the dropped image tokens, gives the
    logits of a plain forward with those tokens masked out of layers K and later, and so does the next token."""
    inputs = M.encode(lm, square, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == lm.image_token_id
    policy = make_policy(method, 0.8, **({"layer": layer} if layer is not None else {}),
                         **({"recycle": False} if method == "sparsevlm" else {}))  # recycled: test_sparsevlm
    with tracked_attention_enabled(lm.model):
        own = runner.prefill_for(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.num_layers, lm.device,
                                 lm.image_token_id)
        n = own.prompt_len
        drops = policy.prefill_token_drops(n, is_image, lm.num_layers)
        assert layer is None or [d.layer for d in drops] == [layer]
        kept = own.cache.layers[-1].positions[0, 0]
        assert len(kept) < n
        logits, reference = layered_reference_cache(lm, ids, is_image, M.vision_inputs(inputs), own.cache)
        torch.testing.assert_close(own.logits, logits, atol=1e-4, rtol=1e-4)
        token = torch.tensor([[7]])
        engine = Engine(lm)
        dropped = engine.forward(own.cache, token, n, AttentionProbe())
        masked = engine.forward(reference, token, n, AttentionProbe(key_masks=kept_entry_masks(own.cache, n)))
    torch.testing.assert_close(dropped, masked, atol=1e-4, rtol=1e-4)


def test_batched_equals_alone(lm, picture):
    """Every method that runs on InternVL gives, decoded in one batch with the others, the answer it gives decoded
    alone."""
    settings = GenerationSettings(max_new_tokens=5)
    methods = list(METHODS)
    batched = Engine(lm).new_session(picture, PROMPT, methods, 0.3, settings)
    list(batched.run())
    for method in methods:
        alone = Engine(lm).new_session(picture, PROMPT, [method], 0.3, settings)
        list(alone.run())
        assert batched.states[method].error is None, (method, batched.states[method].error)
        assert batched.states[method].turn_ids == alone.states[method].turn_ids, method


def test_query_agnostic_full_answers_as_generate(lm, picture):
    session = Engine(lm).new_session(picture, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=5),
                                     query_agnostic=True)
    list(session.run())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    out = _generate(lm, **inputs)
    assert session.states["full"].turn_ids == out[0, inputs["input_ids"].shape[1]:].tolist()[:5]


@pytest.mark.parametrize("budget_mode,query_agnostic", [("published", False), ("equal_memory", True),
                                                        ("equal_memory", False), ("published", True)])
def test_every_method_runs(lm, picture, budget_mode, query_agnostic):
    """Every registered method (VisionZip included) runs a two-turn conversation, in both budget modes and both
    query modes."""
    session = Engine(lm).new_session(picture, PROMPT, "all", 0.3, GenerationSettings(max_new_tokens=3),
                                     budget_mode=budget_mode, query_agnostic=query_agnostic)
    list(session.run())
    list(session.follow_up("what else?"))
    assert set(session.states) == set(METHODS)
    for name, state in session.states.items():
        assert state.error is None, (name, state.error)
        assert len(state.answers) == 1 and state.finished, name


def test_image_markers_place_the_images(lm, picture):
    text = M.format_prompt(lm, "first <image> then <image> which differs?", 2)
    assert "<image>" not in text and text.count("<IMG_CONTEXT>") == 2
    inputs = M.encode(lm, [picture, picture.resize((48, 48))], text)
    assert int((inputs["input_ids"] == lm.image_token_id).sum()) == sum(
        lm.image_tokens(*size) for size in (picture.size, (48, 48)))


def test_several_images_and_a_video(lm, picture):
    """Two images and a video's frames (read as a run of images) in one prompt: the methods run, Full answers as
    the model's own generate over the same prompt."""
    frames = [picture.resize((40, 40)).rotate(10 * k) for k in range(3)]
    session = Engine(lm).new_session([picture, picture.resize((32, 64))],
                                     "compare <image> with <image> and the video <video> what moves?",
                                     ["full", "h2o", "fastv", "snapkv"], 0.4, GenerationSettings(max_new_tokens=3),
                                     video=frames, frames=3)
    pre = list(session.run())[0]
    for name, state in session.states.items():
        assert state.error is None, (name, state.error)
    assert not session.visuals.native_video and session.image_layout.n_images == 5
    assert pre.image_tokens == session.image_layout.n_tokens
    inputs = M.encode(lm, session.visuals.images, M.format_prompt(lm, session.visuals.prompt, with_image=5))
    ids = inputs["input_ids"]
    assert torch.equal(ids, session.encoded.ids)
    out = _generate(lm, **inputs)
    assert session.states["full"].turn_ids == out[0, ids.shape[1]:ids.shape[1] + 3].tolist()


def test_a_follow_up_with_an_image(lm, picture):
    engine = Engine(lm)
    session = engine.new_session(picture, PROMPT, ["full", "h2o"], 0.5, GenerationSettings(max_new_tokens=4))
    list(session.run())
    second = Image.new("RGB", (96, 96), (10, 200, 30))
    list(session.follow_up("and this one?", image=second))
    assert all(s.error is None for s in session.states.values())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    out = _generate(lm, **inputs)
    answer = out[0, ids.shape[1]:ids.shape[1] + 4].tolist()
    answer = answer[:-1] if answer[-1] in engine.eos_ids else answer
    follow = M.encode(lm, second, M.format_followup(lm, "and this one?", images=1), add_special_tokens=False)
    ids2 = torch.cat([ids, torch.tensor([answer]), follow["input_ids"]], dim=1)
    both = torch.cat([inputs["pixel_values"], follow["pixel_values"]])
    out = _generate(lm, input_ids=ids2, attention_mask=torch.ones_like(ids2), pixel_values=both)
    assert session.states["full"].turn_ids == out[0, ids2.shape[1]:ids2.shape[1] + 4].tolist()


# -- the vision-side controls --------------------------------------------------------------------------------------

def test_downsample_resizes_the_image_before_the_tower(lm, square):
    """Downsample's default on InternVL resizes the image (fewer tiles), and its prefill is the model's own forward
    of the resized prompt."""
    session = Engine(lm).new_session(square, PROMPT, ["full", "downsample"], 0.5,
                                     GenerationSettings(max_new_tokens=2), {"downsample": {"budget_of": "image"}})
    pre = list(session.run())[0]
    state = session.states["downsample"]
    assert state.error is None, state.error
    assert state.policy.where == "image"
    (size,) = state.policy_state.resized
    count = lm.image_tokens(*size)
    assert count <= round(0.5 * pre.image_tokens) and count == 16 and pre.image_tokens == 80
    assert state.prompt_len == pre.prompt_tokens - pre.image_tokens + count
    # the one tile the resized image takes stands for the original thumbnail's cells (both see the whole image)
    sources = state.policy_state.sources
    assert [c.tolist() for c in sources.cells] == [[64 + k] for k in range(16)]
    text = M.format_prompt(lm, PROMPT, with_image=True)
    inputs = M.encode(lm, square.resize(size, Image.BICUBIC), text)
    with torch.inference_mode():
        own = lm.model(**inputs).logits[0, -1]
    torch.testing.assert_close(state.first_logits, own, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,knobs", [("visionzip", {}), ("vispruner", {}), ("prumerge_plus", {}),
                                          ("downsample", {"where": "projector_out"}),
                                          ("downsample", {"where": "projector_in"})])
def test_vision_side_reductions_run_on_the_tower(lm, picture, method, knobs):
    """VisionZip and Downsample's grid pooling read InternVL's tower per pixel-shuffled image token and feed the
    language model fewer image tokens, beside the others."""
    session = Engine(lm).new_session(picture, PROMPT, ["full", method, "h2o"], 0.4,
                                     GenerationSettings(max_new_tokens=2), {method: knobs} if knobs else None)
    pre = list(session.run())[0]
    assert all(s.error is None and s.finished for s in session.states.values())
    state = session.states[method]
    sources = state.policy.image_token_sources(state.policy_state)
    assert sources is not None and sources.tokens < pre.image_tokens
    assert state.prompt_len == pre.prompt_tokens - pre.image_tokens + sources.tokens


# -- the overlay, the CLI, the app ---------------------------------------------------------------------------------

def test_overlay_draws_each_tile_and_the_thumbnail(lm, square):
    from ui.overlay import caption, overlay

    session = Engine(lm).new_session(square, PROMPT, ["full", "h2o"], 0.2, GenerationSettings(max_new_tokens=2))
    pre = list(session.run())[0]
    layout = session.image_layout
    assert len(layout.views) == 5 and layout.views[-1].name == "thumbnail"
    full, h2o = (session.kept_image_map(m, lm.num_layers - 1) for m in ("full", "h2o"))
    assert np.all(full.token_share == 1.0) and full.n_tokens == pre.image_tokens == 80
    assert all(full.view_share(i).shape == (4, 4) for i in range(5))
    assert h2o.kept_tokens() < h2o.n_tokens
    assert overlay(square, h2o, "h2o").width > 5 * 300
    assert "thumbnail" in caption("H2O", h2o, lm.num_layers - 1)


def test_cli_compare_runs(checkpoint, picture, tmp_path):
    from prefixkv_core.__main__ import main

    path, lm = checkpoint
    image, out = tmp_path / "img.png", tmp_path / "out.json"
    picture.save(image)
    code = main(["compare", "--model", path, "--image", str(image), "--prompt", "What is it?", "--methods", "all",
                 "--max-new-tokens", "3", "--device", "cpu", "--json", str(out), "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["methods"]) == set(METHODS)
    assert all(len(r["kept_per_layer"]) == lm.num_layers for r in data["methods"].values())


def test_app_compares_and_follows_up(lm, picture):
    from ui.app_builder import build_app
    from ui.controller import SessionBox

    ctl = build_app(Engine(lm), max_new_tokens_limit=8).controller
    box = SessionBox()
    outs = list(ctl.compare(picture, "Describe the picture.", ["full", "h2o", "fastv"], 0.3, 3, box=box))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "Done" in final["status"]
    statuses = {m: r["status"] for m, r in final["results"]["methods"].items()}
    assert statuses == {m: "done" for m in ("full", "h2o", "fastv")}
    assert len(final["gallery"]) == 3 and all("kept" in cap for _, cap in final["gallery"])
    outs = list(ctl.follow_up("And the colours?", box))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert final["results"]["prompts"] == ["Describe the picture.", "And the colours?"]
    assert len(ctl.set_overlay_layer(1, box)) == 3


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_a_compressed_method_decodes_at_the_true_length(lm, picture, method, decodes_at_the_true_length):
    """A session's compressed method feeds each new token at its true position, not at the number of entries its
    cache holds: its answer is the runner's at the true positions."""
    decodes_at_the_true_length(lm, picture, PROMPT, method)
