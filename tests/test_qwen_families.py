"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL on tiny random models of their structure, saved as checkpoints and loaded
through `load_model` like released ones (CPU, no network): their 3-D M-RoPE positions kept through eviction."""
import numpy as np
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.models.families import FAMILY_INFO, hooks
from prefixkv_core.policies import METHODS, make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.testing import QWEN_FAMILIES, kept_entry_masks, save_tiny_family, wide_noise_picture

PROMPT = "describe the picture in detail"
CLASSES = {"qwen2-vl": "Qwen2VLForConditionalGeneration", "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3-vl": "Qwen3VLForConditionalGeneration"}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    out = {}
    for family in QWEN_FAMILIES:
        path = save_tiny_family(tmp_path_factory.mktemp(family), family)
        out[family] = (path, M.load_model(path, device="cpu"))
    return out


@pytest.fixture(params=QWEN_FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def lm(family, family_models):
    return family_models[family][1]


@pytest.fixture(scope="module")
def picture():
    return wide_noise_picture()


def test_the_registry_holds_the_qwen_families():
    assert set(QWEN_FAMILIES) == {"qwen2-vl", "qwen2.5-vl", "qwen3-vl"}
    for key in QWEN_FAMILIES:
        assert FAMILY_INFO[key].mrope and FAMILY_INFO[key].model_type in M.ACCEPTED_MODEL_TYPES
        assert hooks(key).__name__.endswith("family.qwen_vl")
    assert not any(FAMILY_INFO[key].mrope for key in M.LLAVA_FAMILIES)


def test_loads_as_its_family(family, lm, family_models):
    assert type(lm.model).__name__ == CLASSES[family] and lm.family == family
    assert M.family_of(lm.model.config) == family and lm.anyres
    assert lm.notes and "tiny random model" in lm.notes[0]
    assert lm.image_token_id == lm.tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_tiny_spec_loads_through_a_checkpoint(tmp_path):
    lm = M.load_model("tiny-qwen2.5-vl", device="cpu", cache_dir=str(tmp_path))
    assert lm.name == "tiny-qwen2.5-vl" and lm.family == "qwen2.5-vl"
    assert (tmp_path / "tiny" / "qwen2.5-vl" / "config.json").is_file()


@pytest.mark.parametrize("size", [(80, 48), (33, 70), (200, 120)])
def test_layout_is_the_merged_grid(lm, size):
    image = wide_noise_picture().resize(size)
    inputs = M.encode(lm, image, M.format_prompt(lm, "Hi", True))
    t, h, w = inputs["image_grid_thw"][0].tolist()
    merge = lm.model.config.vision_config.spatial_merge_size
    layout = lm.image_layout(*size)
    assert (layout.views[0].rows, layout.views[0].cols) == (h // merge, w // merge) and t == 1
    assert layout.n_tokens == int((inputs["input_ids"] == lm.image_token_id).sum())


def test_prompt_positions_advance_by_the_grid_side(lm, picture):
    """Text (p, p, p); the image's (t, h, w) on its merged grid; after it the position has grown by max(h, w)."""
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, True))
    ids = inputs["input_ids"]
    positions, deltas = hooks(lm.family).rope_index(lm.model, ids, M.vision_inputs(inputs))
    rows, cols = lm.image_layout(*picture.size).views[0].rows, lm.image_layout(*picture.size).views[0].cols
    start = int((ids[0] == lm.image_token_id).nonzero()[0])
    assert positions[:, 0, start + rows * cols].tolist() == [start + max(rows, cols)] * 3
    assert int(deltas[0]) == max(rows, cols) - rows * cols
    assert positions[1, 0, start:start + rows * cols].tolist() == [start + r for r in range(rows) for _ in range(cols)]


def _generate(lm, **kw):
    with torch.inference_mode():
        return lm.model.generate(**kw, max_new_tokens=6, do_sample=False)


def test_full_equals_generate_over_two_turns(lm, picture):
    engine = Engine(lm)
    session = engine.new_session(picture, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=6))
    list(session.run())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    types = (ids == lm.image_token_id).int()
    out = _generate(lm, **inputs, mm_token_type_ids=types)
    first = out[0, ids.shape[1]:].tolist()
    assert session.states["full"].turn_ids == first
    list(session.follow_up("and the colours?"))
    answer = first[:-1] if first[-1] in engine.eos_ids else first
    follow = M.encode(lm, None, M.format_followup(lm, "and the colours?"), add_special_tokens=False)["input_ids"]
    ids2 = torch.cat([ids, torch.tensor([answer], dtype=torch.long), follow], dim=1)
    types2 = (ids2 == lm.image_token_id).int()
    out = _generate(lm, input_ids=ids2, attention_mask=torch.ones_like(ids2), mm_token_type_ids=types2,
                    **M.vision_inputs(inputs))
    assert session.states["full"].turn_ids == out[0, ids2.shape[1]:].tolist()


@pytest.mark.parametrize("method,budget", [("h2o", 0.3), ("snapkv", 0.3), ("adakv", 0.3), ("pyramidkv", 0.3), ("vlcache", 0.3),
                                           ("prefixkv", 0.3), ("random", 0.3)])
def test_eviction_equals_masking(lm, picture, method, budget):
    """A compressed cache gives the logits of its prefill's cache with the evicted entries masked, per layer and
    head: the kept entries keep their 3-D rotation and the next token runs at its logical position."""
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == lm.image_token_id
    policy = make_policy(method, budget, **({"window": 8} if method == "adakv" else {}))
    with tracked_attention_enabled(lm.model):
        shared = runner.prefill_for(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.num_layers,
                                    lm.device, lm.image_token_id)
    n = shared.prompt_len
    assert shared.cache.rope_deltas is not None and int(shared.cache.rope_deltas[0]) < 0
    compressed = shared.cache.clone()
    plans, _ = policy.prefill(PrefillView(compressed, runner.policy_stats(policy, shared.stats, n), n, budget,
                                          policy.prefill_stats(n).window))
    apply_plans(compressed, plans)
    engine = Engine(lm)
    token = torch.tensor([[7]])
    with tracked_attention_enabled(lm.model):
        evicted = engine.forward(compressed, token, n, AttentionProbe())
        masked = engine.forward(shared.cache.clone(), token, n, AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    assert min(layer.length for layer in compressed.layers) < n  # something was evicted
    torch.testing.assert_close(evicted, masked, atol=1e-4, rtol=1e-4)


def test_an_uncompressed_step_is_the_models_own(lm, picture):
    """The next token after the prompt, through the engine's cache at its logical position, is what the model's
    own forward over the prompt and that token computes."""
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    policy = make_policy("full", 1.0)
    with tracked_attention_enabled(lm.model):
        shared = runner.prefill_for(lm.model, policy, ids, ids == lm.image_token_id, M.vision_inputs(inputs),
                                    lm.num_layers, lm.device, lm.image_token_id)
        logits = Engine(lm).forward(shared.cache, torch.tensor([[7]]), ids.shape[1], AttentionProbe())
    ids2 = torch.cat([ids, torch.tensor([[7]])], dim=1)
    with torch.inference_mode():
        own = lm.model(input_ids=ids2, attention_mask=torch.ones_like(ids2),
                       mm_token_type_ids=(ids2 == lm.image_token_id).int(), **M.vision_inputs(inputs)).logits[0, -1]
    torch.testing.assert_close(logits, own, atol=1e-4, rtol=1e-4)


def test_batched_equals_alone(lm, picture):
    """Every method gives, decoded in one batch with the others (rows of different lengths, the own prefills' rows
    shorter still, each at its own logical positions), the answer it gives decoded alone."""
    settings = GenerationSettings(max_new_tokens=5)
    methods = list(METHODS)
    batched = Engine(lm).new_session(picture, PROMPT, methods, 0.3, settings)
    list(batched.run())
    for method in methods:
        alone = Engine(lm).new_session(picture, PROMPT, [method], 0.3, settings)
        list(alone.run())
        assert batched.states[method].turn_ids == alone.states[method].turn_ids, method


def test_query_agnostic_feeds_the_question_at_its_logical_positions(lm, picture):
    """Query-agnostic Full (the question fed after the compressed prefix) answers as the model's own generate."""
    session = Engine(lm).new_session(picture, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=5),
                                     query_agnostic=True)
    list(session.run())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    out = _generate(lm, **inputs, mm_token_type_ids=(inputs["input_ids"] == lm.image_token_id).int())
    assert session.states["full"].turn_ids == out[0, inputs["input_ids"].shape[1]:].tolist()[:5]


@pytest.mark.parametrize("budget_mode,query_agnostic", [("published", False), ("equal_memory", True)])
def test_every_method_runs(lm, picture, budget_mode, query_agnostic):
    """Every registered method runs a two-turn conversation, in both budget modes and both query modes (VisionZip
    and Downsample on Qwen's tower included)."""
    session = Engine(lm).new_session(picture, PROMPT, "all", 0.3, GenerationSettings(max_new_tokens=3),
                                     budget_mode=budget_mode, query_agnostic=query_agnostic)
    list(session.run())
    list(session.follow_up("what else?"))
    assert set(session.states) == set(METHODS)
    for name, state in session.states.items():
        assert state.error is None, (name, state.error)
        assert len(state.answers) == 1 and state.finished, name


def test_image_markers_place_the_images(lm, picture):
    """A user's `<image>` markers become the family's vision spans where they stand."""
    text = M.format_prompt(lm, "first <image> then <image> which differs?", 2)
    assert "<image>" not in text and text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    inputs = M.encode(lm, [picture, picture.resize((48, 48))], text)
    assert int((inputs["input_ids"] == lm.image_token_id).sum()) == sum(
        lm.image_tokens(*size) for size in (picture.size, (48, 48)))


@pytest.mark.parametrize("method,layer", [("fastv", None), ("dart", None), ("fastv", 1), ("dart", 1),
                                          ("pyramiddrop", None), ("sparsevlm", None)])
def test_token_drop_equals_the_masked_forward(lm, picture, method, layer):
    """FastV's and DART's own prefill, whose layers from K on never compute the dropped image tokens (their 3-D
    rotary embeddings cut with them), gives the logits of a plain forward with those tokens masked out of layers K
    and later, and so does the next token at its logical position. Dropping after layer 1 on Qwen3-VL cuts the
    DeepStack features of layer 1's output in step."""
    from prefixkv_core.testing import layered_reference_cache

    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == lm.image_token_id
    # the budget as a share of the image tokens: half of them are kept, so their 3-D positions are tested too
    policy = make_policy(method, 0.5, budget_of="image", **({"layer": layer} if layer is not None else {}),
                         **({"recycle": False} if method == "sparsevlm" else {}))  # recycled: test_sparsevlm
    with tracked_attention_enabled(lm.model):
        own = runner.prefill_for(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.num_layers, lm.device,
                                 lm.image_token_id)
        n = own.prompt_len
        drops = policy.prefill_token_drops(n, is_image, lm.num_layers)
        assert layer is None or [d.layer for d in drops] == [layer]
        kept = own.cache.layers[-1].positions[0, 0]
        image_at = set(is_image[0].nonzero().flatten().tolist())
        kept_image = image_at & set(kept.tolist())
        assert 0 < len(kept_image) < len(image_at), (len(kept_image), len(image_at))
        logits, reference = layered_reference_cache(lm, ids, is_image, M.vision_inputs(inputs), own.cache)
        torch.testing.assert_close(own.logits, logits, atol=1e-4, rtol=1e-4)
        token = torch.tensor([[7]])
        engine = Engine(lm)
        dropped = engine.forward(own.cache, token, n, AttentionProbe())
        masked = engine.forward(reference, token, n, AttentionProbe(key_masks=kept_entry_masks(own.cache, n)))
    torch.testing.assert_close(dropped, masked, atol=1e-4, rtol=1e-4)


def test_a_follow_up_with_an_image_continues_at_its_grid_positions(lm, picture):
    """A second turn with an image: its tokens get the 3-D positions of the whole conversation (the model's own
    generate over both turns); on Qwen3-VL each row reads the image's pixels, so its DeepStack features are added
    as in the model's own forward."""
    engine = Engine(lm)
    session = engine.new_session(picture, PROMPT, ["full", "h2o"], 0.5, GenerationSettings(max_new_tokens=4))
    list(session.run())
    second = picture.resize((48, 48))
    list(session.follow_up("and this one?", image=second))
    assert all(s.error is None for s in session.states.values())
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    out = _generate(lm, **inputs, mm_token_type_ids=(ids == lm.image_token_id).int())
    answer = out[0, ids.shape[1]:ids.shape[1] + 4].tolist()
    answer = answer[:-1] if answer[-1] in engine.eos_ids else answer
    follow = M.encode(lm, second, M.format_followup(lm, "and this one?", images=1), add_special_tokens=False)
    ids2 = torch.cat([ids, torch.tensor([answer]), follow["input_ids"]], dim=1)
    both = dict(pixel_values=torch.cat([inputs["pixel_values"], follow["pixel_values"]]),
                image_grid_thw=torch.cat([inputs["image_grid_thw"], follow["image_grid_thw"]]))
    out = _generate(lm, input_ids=ids2, attention_mask=torch.ones_like(ids2),
                    mm_token_type_ids=(ids2 == lm.image_token_id).int(), **both)
    assert session.states["full"].turn_ids == out[0, ids2.shape[1]:ids2.shape[1] + 4].tolist()


def test_overlay_draws_the_merged_grid(lm, picture):
    from ui.overlay import overlay

    session = Engine(lm).new_session(picture, PROMPT, ["full", "h2o"], 0.2, GenerationSettings(max_new_tokens=2))
    pre = list(session.run())[0]
    view = session.image_layout.views[0]
    assert pre.image_grid == (view.rows, view.cols) and view.n_tokens == pre.image_tokens
    full, h2o = (session.kept_image_map(m, lm.num_layers - 1) for m in ("full", "h2o"))
    assert np.all(full.token_share == 1.0) and full.view_share(0).shape == (view.rows, view.cols)
    assert h2o.kept_tokens() < h2o.n_tokens
    # the cells H2O dropped are drawn dark: about their share of the picture changes, and only darker
    drawn_full = np.asarray(overlay(picture, full, "full").convert("L"), dtype=np.float32)
    drawn_h2o = np.asarray(overlay(picture, h2o, "h2o").convert("L"), dtype=np.float32)
    assert drawn_full.shape == drawn_h2o.shape
    dropped = 1 - h2o.kept_tokens() / h2o.n_tokens
    changed = np.abs(drawn_full - drawn_h2o) > 20
    assert 0.3 * dropped < changed.mean() < dropped + 0.1, (changed.mean(), dropped)
    assert drawn_h2o.mean() < drawn_full.mean()


def test_cli_compare_runs(family, family_models, picture, tmp_path):
    import json

    from prefixkv_core.__main__ import main

    path, lm = family_models[family]
    image, out = tmp_path / "img.png", tmp_path / "out.json"
    picture.save(image)
    code = main(["compare", "--model", path, "--image", str(image), "--prompt", "What is it?", "--methods",
                 "full,h2o,fastv", "--max-new-tokens", "3", "--device", "cpu", "--json", str(out), "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"full", "h2o", "fastv"}
    assert all(len(r["kept_per_layer"]) == lm.num_layers for r in data["methods"].values())


def test_two_users_with_different_rope_deltas_share_the_batched_steps(family_models, picture):
    """Two users' comparisons on Qwen2.5-VL decoded in one batch, each prompt with an image of its own size (so
    each row its own rope delta): every answer is the one it gives with nobody else on the engine."""
    import threading

    from prefixkv_core.report.events import MethodEvent
    from prefixkv_core.testing import wait_until

    lm = family_models["qwen2.5-vl"][1]
    other = picture.resize((40, 72))
    first = ("describe the picture in detail and name every object", ["full", "snapkv", "fastv"])
    second = ("what colour is the sky", ["h2o", "full"])
    settings = lambda n: GenerationSettings(max_new_tokens=n, ignore_eos=True)  # noqa: E731
    engine = Engine(lm)

    def alone(image, request, n):
        session = engine.new_session(image, request[0], request[1], 0.4, settings(n))
        list(session.run())
        return {m: row["text"] for m, row in session.results().items()}

    first_alone, second_alone = alone(picture, first, 12), alone(other, second, 8)
    a = engine.new_session(picture, *first, 0.4, settings(12))
    b = engine.new_session(other, *second, 0.4, settings(8))
    events_a = a.run()
    for ev in events_a:
        if isinstance(ev, MethodEvent) and ev.kind == "token":
            break
    b_done = threading.Thread(target=lambda: [None for _ in b.run()])
    b_done.start()
    assert wait_until(lambda: engine.pool.decoding() == 2, timeout=60)
    for _ in events_a:
        pass
    b_done.join(120)
    assert engine.pool.shared_steps > 0
    deltas = {int(s.cache.rope_deltas[0]) for s in (a.states["full"], b.states["full"])}
    assert len(deltas) == 2  # the two rows ran at different offsets
    assert {m: row["text"] for m, row in a.results().items()} == first_alone
    assert {m: row["text"] for m, row in b.results().items()} == second_alone


def test_several_images_and_a_video(lm, picture):
    """Two images and a video's frames in one prompt: every image at its own grid positions, the methods run, Full
    answers as the model's own generate over the same prompt. Every Qwen family reads the video on its own path
    (one grid per two frames, Qwen3-VL's each after its timestamp: tests/test_qwen_video.py)."""
    frames = [picture.resize((40, 40)).rotate(10 * k) for k in range(3)]
    engine = Engine(lm)
    session = engine.new_session([picture, picture.resize((32, 64))], "compare <image> with <image> and the video <video> what moves?",
                                 ["full", "h2o", "fastv"], 0.4, GenerationSettings(max_new_tokens=3), video=frames,
                                 frames=3)
    pre = list(session.run())[0]
    for name, state in session.states.items():
        assert state.error is None, (name, state.error)
    assert lm.video_token_id is not None and session.visuals.native_video
    assert session.image_layout.n_images == 4  # two images, two temporal groups
    assert pre.image_tokens == session.image_layout.n_tokens
    inputs = session.encoded.inputs
    ids = inputs["input_ids"]
    types = (ids == lm.image_token_id).int() + 2 * (ids == lm.video_token_id).int()
    out = _generate(lm, **inputs, mm_token_type_ids=types)
    assert session.states["full"].turn_ids == out[0, ids.shape[1]:ids.shape[1] + 3].tolist()


def test_random_weights_in_the_released_qwen2_5_vl_3b_shape():
    """`build_random_model("qwen2.5-vl-3b")`: Qwen2.5-VL-3B-Instruct's shapes (3.75 B parameters, 36 GQA layers of
    2 KV heads, the 32-block window-attention tower) with a processor at the released resize, built without
    allocating (meta device)."""
    from prefixkv_core.models import RANDOM_KINDS, build_random_model

    assert "qwen2.5-vl-3b" in RANDOM_KINDS
    lm = build_random_model("qwen2.5-vl-3b", device="meta", dtype=torch.float16)
    assert lm.random_weights and lm.family == "qwen2.5-vl" and type(lm.model).__name__ == CLASSES["qwen2.5-vl"]
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.vocab_size) == (36, 2, 128, 151936)
    assert sum(p.numel() for p in lm.model.parameters()) == pytest.approx(3.75e9, rel=0.01)
    assert lm.model.config.vision_config.fullatt_block_indexes == [7, 15, 23, 31]
    assert lm.image_tokens(640, 480) == (476 // 28) * (644 // 28)  # the processor's 28-px resize


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
