"""Every LLaVA family (LLaVA-1.5, Interleave, NeXT, OneVision) on a tiny random model of exactly its structure,
saved as a checkpoint and loaded through `load_model` like a released one (CPU, no network)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine

from prefixkv_core import GenerationSettings

from prefixkv_core.decoding import runner
from prefixkv_core import models as M
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.policies import METHODS, make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.policies.zipvl import probe_queries
from prefixkv_core.testing import LLAVA_FAMILIES, kept_entry_masks, layered_reference_cache, save_tiny_family

PROMPT = "describe the picture in detail"


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> (checkpoint directory, LoadedModel loaded from it): here each family's tiny model goes through
    `save_pretrained` and `load_model`, unlike the in-memory models of the shared fixture this replaces."""
    out = {}
    for family in LLAVA_FAMILIES:
        path = save_tiny_family(tmp_path_factory.mktemp(family), family)
        out[family] = (path, M.load_model(path, device="cpu"))
    return out


@pytest.fixture(params=LLAVA_FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def lm(family, family_models):
    return family_models[family][1]


# -- loading and structure ---------------------------------------------------------------------------------------

CLASSES = {"llava-1.5": "LlavaForConditionalGeneration", "llava-interleave": "LlavaForConditionalGeneration",
           "llava-next": "LlavaNextForConditionalGeneration",
           "llava-onevision": "LlavaOnevisionForConditionalGeneration"}


def test_loads_as_its_family_with_the_released_structure(family, lm):
    cfg, released = lm.model.config, M.family_config(family)
    assert type(lm.model).__name__ == CLASSES[family] and lm.family == family and M.family_of(cfg) == family
    assert lm.notes and "tiny random model" in lm.notes[0] and lm.vision_trained is False
    # the structure of the released checkpoint, scaled down
    assert cfg.model_type == released.model_type
    assert cfg.vision_config.model_type == released.vision_config.model_type
    assert cfg.text_config.model_type == released.text_config.model_type
    assert (cfg.vision_feature_layer, cfg.vision_feature_select_strategy) == (
        released.vision_feature_layer, released.vision_feature_select_strategy)
    assert cfg.projector_hidden_act == released.projector_hidden_act
    gqa = released.text_config.num_key_value_heads < released.text_config.num_attention_heads
    assert (lm.num_kv_heads < lm.num_heads) == gqa
    if released.model_type == "llava":
        assert not hasattr(lm.model.model, "image_newline")
    else:  # anyres: the same grids of tiles, an image-newline parameter
        tile, tiny_tile = released.vision_config.image_size, cfg.vision_config.image_size
        assert cfg.image_grid_pinpoints == M.configs.scale_pinpoints(released.image_grid_pinpoints, tile, tiny_tile)
        assert lm.model.model.image_newline.shape == (cfg.text_config.hidden_size,)
    if family == "llava-onevision":
        assert cfg.vision_aspect_ratio == released.vision_aspect_ratio == "anyres_max_9"
        assert type(lm.processor).__name__ == "ImageOnlyOnevisionProcessor" and lm.processor.num_image_tokens == 16


def test_released_configs_are_the_published_shapes():
    interleave, nxt, ov = (M.family_config(f) for f in ("llava-interleave", "llava-next", "llava-onevision"))
    assert (interleave.vision_config.image_size, interleave.vision_config.patch_size) == (384, 14)
    assert interleave.vision_feature_select_strategy == "full" and interleave.image_token_id == 151646
    assert (nxt.text_config.num_key_value_heads, nxt.image_token_id) == (8, 32000)
    assert nxt.image_grid_pinpoints == [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    assert len(ov.image_grid_pinpoints) == 36 and ov.image_grid_pinpoints[-1] == [2304, 2304]
    assert (ov.text_config.hidden_size, ov.text_config.num_key_value_heads) == (896, 2)


def test_prompt_formats_are_the_released_ones(lm, family):
    first = M.format_prompt(lm, "What is it?", True)
    follow = M.format_followup(lm, "And?")
    expected = {
        "llava-1.5": ("USER: <image>\nWhat is it? ASSISTANT:", " USER: And? ASSISTANT:"),
        "llava-next": ("[INST] <image>\nWhat is it? [/INST]", "</s> [INST] And? [/INST]"),
        "llava-interleave": ("<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n",
                             "<|im_end|>\n<|im_start|>user\n\nAnd?<|im_end|>\n<|im_start|>assistant\n"),
        "llava-onevision": ("<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n",
                            "<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n"),
    }
    assert (first, follow) == expected[family]


@pytest.mark.parametrize("size", [(80, 48), (48, 80), (32, 32), (300, 40), (17, 90), (333, 257)])
def test_layout_counts_the_processors_image_tokens(lm, size):
    """The layout the overlay draws has exactly the tokens the processor puts in the prompt, for any image."""
    image = Image.new("RGB", size, (90, 30, 200))
    ids = M.encode(lm, image, M.format_prompt(lm, "Hi", True))["input_ids"][0]
    flags = ids == lm.image_token_id
    layout = lm.image_layout(*size)
    assert int(flags.sum()) == layout.n_tokens == lm.image_tokens(*size) <= lm.image_seq_length
    first = int(flags.nonzero()[0])
    assert bool(flags[first:first + layout.n_tokens].all())  # one contiguous run: every crop and newline token
    views, rows, cols = layout.token_cells()
    assert len(views) == layout.n_tokens
    if lm.anyres:
        base, tiles = layout.views
        assert (base.rows, base.cols, base.newline, tiles.newline) == (4, 4, False, True)
    else:
        assert len(layout.views) == 1 and layout.n_tokens == 16


@pytest.mark.parametrize("size", [(80, 48), (333, 257)])
def test_run_limit_counts_the_image_at_its_size(lm, size):
    """The app's token limit counts what the processor will really feed for this image (anyres: by size)."""
    from prefixkv_core.limits import prompt_tokens

    image = Image.new("RGB", size, (90, 30, 200))
    fed = M.encode(lm, image, M.format_prompt(lm, "Hi", True))["input_ids"].shape[1]
    assert prompt_tokens(lm, "Hi", True, image.size) == fed
    assert prompt_tokens(lm, "Hi", True) >= fed  # without a size: the most an image can take


def test_unsupported_model_type_names_the_families(tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
               intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(M.ModelLoadError) as err:
        M.load_model(str(tmp_path), device="cpu")
    for family in M.FAMILY_INFO.values():
        assert family.example in str(err.value) and family.model_type in str(err.value)


def test_tiny_family_spec_loads_through_a_checkpoint(tmp_path):
    lm = M.load_model("tiny-llava-next", device="cpu", cache_dir=str(tmp_path))
    assert lm.name == "tiny-llava-next" and lm.slug == "tiny-llava-next" and lm.family == "llava-next"
    assert (tmp_path / "tiny" / "llava-next" / "config.json").is_file()


# -- the engine on every family ------------------------------------------------------------------------------------

def test_attention_registered_for_the_text_model_only(lm):
    vision_before = lm.model.config.vision_config._attn_implementation
    with tracked_attention_enabled(lm.model):
        assert lm.model.config.get_text_config()._attn_implementation == "prefixkv_tracked"
        assert lm.model.config.vision_config._attn_implementation == vision_before
    assert lm.model.config.get_text_config()._attn_implementation == "sdpa"


def test_full_equals_generate_over_two_turns(lm, picture):
    engine = Engine(lm)
    session = engine.new_session(picture, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=6))
    list(session.run())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    with torch.inference_mode():
        out = lm.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    first = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert session.states["full"].turn_ids == first
    # second turn on the conversation's ids: the answer (a closing EOS is not fed) and the follow-up's text
    list(session.follow_up("and the colours?"))
    answer = first[:-1] if first[-1] in engine.eos_ids else first
    follow = M.encode(lm, None, M.format_followup(lm, "and the colours?"), add_special_tokens=False)["input_ids"]
    if lm.tokenizer.bos_token_id is not None:
        assert int(follow[0, 0]) != lm.tokenizer.bos_token_id  # a continuation starts no new sequence
    ids = torch.cat([inputs["input_ids"], torch.tensor([answer], dtype=torch.long), follow], dim=1)
    with torch.inference_mode():
        out = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                **M.vision_inputs(inputs))
    assert session.states["full"].turn_ids == out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("method,budget", [("h2o", 0.3), ("snapkv", 0.3), ("adakv", 0.3), ("pyramidkv", 0.3),
                                           ("prefixkv", 0.3), ("fastv", 0.8), ("random", 0.3),
                                           ("dart", 0.8), ("vlcache", 0.3), ("pyramiddrop", 0.8),
                                           ("sparsevlm", 0.8)])
def test_eviction_equals_masking(lm, picture, method, budget):
    """A compressed cache gives the logits of its prefill's cache with the evicted entries masked. FastV and DART:
    their own prefill, whose layers from K on never computed the dropped image tokens, gives the logits of a plain
    forward with those tokens masked out of layers K and later, and so does the next token."""
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == lm.image_token_id
    policy = make_policy(method, budget, **({"window": 8} if method == "adakv" else
                                            {"recycle": False} if method == "sparsevlm" else {}))
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
        drops = policy.prefill_token_drops(n, is_image, lm.num_layers)
        if drops:  # the reference: every token through every layer, the dropped ones masked where they left
            logits, uncompressed = layered_reference_cache(lm, ids, is_image, M.vision_inputs(inputs), shared.cache)
            torch.testing.assert_close(shared.logits, logits, atol=1e-4, rtol=1e-4)
            stages = [drop.layer for drop in drops] + [lm.num_layers]
            for start, end in zip(stages, stages[1:]):  # a stage's layers computed the same tokens
                assert len({tuple(layer.positions[0, 0].tolist()) for layer in shared.cache.layers[start:end]}) == 1
            assert shared.cache.layers[-1].length < n
        evicted = engine.forward(compressed, token, n, AttentionProbe())
        masks = kept_entry_masks(compressed, n)
        masked = engine.forward(uncompressed, token, n, AttentionProbe(key_masks=masks))
    assert min(layer.length for layer in compressed.layers) < n  # something was evicted
    torch.testing.assert_close(evicted, masked, atol=1e-4, rtol=1e-4)


def test_every_method_runs_a_two_turn_conversation(lm, picture):
    session = Engine(lm).new_session(picture, PROMPT, "all", 0.3, GenerationSettings(max_new_tokens=4))
    events = list(session.run())
    follow = list(session.follow_up("what else?"))
    assert set(session.states) == set(METHODS)
    for name, state in session.states.items():
        assert state.error is None, (name, state.error)
        assert len(state.answers) == 1 and state.finished
    assert {e.method for e in follow if getattr(e, "kind", None) == "done"} == set(METHODS)
    pre = events[0]
    assert pre.image_tokens == session.image_layout.n_tokens == lm.image_tokens(*picture.size)
    assert int(pre.is_image.sum()) == pre.image_tokens


def test_lookm_splits_text_and_every_image_token(lm, picture):
    """LOOK-M with text_prior = keep_all keeps every text token; the image tokens it ranks are all crops and
    newline tokens."""
    session = Engine(lm).new_session(picture, PROMPT, ["lookm"], 0.2, GenerationSettings(max_new_tokens=1),
                                     {"lookm": {"text_prior": "keep_all"}})
    pre = list(session.run())[0]
    cache = session.states["lookm"].cache
    text_positions = set(np.flatnonzero(~pre.is_image).tolist())
    image_positions = set(np.flatnonzero(pre.is_image).tolist())
    assert len(image_positions) == lm.image_tokens(*picture.size)
    for layer in cache.layers:
        for head in range(layer.n_kv):
            kept = set(layer.positions[0, head].tolist())
            assert text_positions <= kept
            assert kept & image_positions != image_positions  # some image tokens were merged away
        flags = layer.is_image[0]
        assert torch.equal(flags, torch.isin(layer.positions[0], torch.tensor(sorted(image_positions))))


def test_zipvl_probes_the_whole_prompt(lm, picture):
    session = Engine(lm).new_session(picture, PROMPT, ["zipvl"], 0.3, GenerationSettings(max_new_tokens=1))
    events = list(session.run())
    pre = events[0]
    state = session.states["zipvl"].policy_state
    n = pre.prompt_tokens
    assert torch.equal(state.probe_queries, probe_queries(n))
    assert int(state.probe_queries.max()) == n - 1 and state.probe_queries.numel() >= 2
    assert len(state.important_ratios) == lm.num_layers and all(0 < r <= 1 for r in state.important_ratios)
    assert events[-1].kept_per_layer == [n] * lm.num_layers  # ZipVL keeps every token, crops and newlines included


# -- the overlay --------------------------------------------------------------------------------------------------

def test_overlay_covers_exactly_the_image_tokens(lm, picture):
    from ui.overlay import caption, overlay

    session = Engine(lm).new_session(picture, PROMPT, ["full", "h2o"], 0.2, GenerationSettings(max_new_tokens=3))
    pre = list(session.run())[0]
    layer = lm.num_layers - 1
    full, h2o = session.kept_image_map("full", layer), session.kept_image_map("h2o", layer)
    cells = sum(full.view_share(i).size + (v.rows if v.newline else 0) for i, v in enumerate(full.layout.views))
    assert cells == full.n_tokens == pre.image_tokens
    assert np.all(full.token_share == 1.0)  # Full keeps every image token in every head
    cache = session.states["h2o"].cache.layers[layer]
    rel = cache.positions[0] - pre.image_offset
    in_image = (rel >= 0) & (rel < pre.image_tokens)
    held = np.bincount(rel[in_image].numpy(), minlength=pre.image_tokens) / cache.n_kv
    np.testing.assert_allclose(h2o.token_share, held)
    assert h2o.kept_tokens() < h2o.n_tokens  # H2O evicted image tokens at this budget
    placed = sum(float(h2o.view_share(i).sum()) + float(np.sum(h2o.newline_share(i) if v.newline else 0.0))
                 for i, v in enumerate(h2o.layout.views))
    assert placed == pytest.approx(float(h2o.token_share.sum()))
    picture_out = overlay(picture, h2o, "h2o")
    assert picture_out.height == 336 and picture_out.width > 336 * len(h2o.layout.views) * 0.9
    text = caption("H2O", h2o, layer)
    assert f"{h2o.kept_tokens()} of {pre.image_tokens}" in text
    if lm.anyres:
        assert "base" in text and "tiles" in text and "newline" in text


# -- the CLI and the app ------------------------------------------------------------------------------------------

def test_cli_compare_runs(family, family_models, picture, tmp_path):
    from prefixkv_core.__main__ import main

    path, lm = family_models[family]
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
    outs = list(ctl.compare(picture, "Describe the picture.", ["full", "h2o", "lookm"], 0.3, 3, box=box))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "Done" in final["status"]
    statuses = {m: r["status"] for m, r in final["results"]["methods"].items()}
    assert statuses == {m: "done" for m in ("full", "h2o", "lookm")}
    assert len(final["gallery"]) == 3 and all("kept" in cap for _, cap in final["gallery"])
    outs = list(ctl.follow_up("And the colours?", box))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert final["results"]["prompts"] == ["Describe the picture.", "And the colours?"]
    assert len(ctl.set_overlay_layer(1, box)) == 3
