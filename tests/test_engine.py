"""Engine correctness on tiny models (CPU, no network)."""
import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch

from prefixkv_core import Engine, EngineError, GenerationSettings
from prefixkv_core.kv.attention import ATTN_NAME, AttentionProbe, StatRequest, tracked_attention_enabled
from prefixkv_core.kv.cache import TrackedCache
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.models.compat import cache_kwarg
from prefixkv_core.decoding import runner
from prefixkv_core.policies import METHODS, REGISTRY, make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.testing import kept_entry_masks, layered_reference_cache

PROMPT = "describe the picture in detail and name every object you can see in it"
BUDGETS = (0.1, 0.3, 0.5, 0.9)


def _prefill(loaded, image, prompt=PROMPT, window=8):
    """Shared prefill through the engine's forward; returns (cache, probe, ids, is_image)."""
    engine = Engine(loaded)
    inputs = encode(loaded, image, format_prompt(loaded, prompt, with_image=image is not None))
    ids = inputs["input_ids"]
    is_image = ids == loaded.image_token_id
    probe = AttentionProbe(StatRequest(colsum=True, window=window))
    cache = TrackedCache(loaded.num_layers)
    with tracked_attention_enabled(loaded.model):
        logits = engine.forward(cache, ids, 0, probe, is_image, inputs.get("pixel_values"))
    cache.add_scores({l: s["colsum"] for l, s in probe.stats.items()})
    return engine, cache, probe, ids, is_image, logits


# -- attention ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stats", [False, True])
def test_attention_function_equals_stock_sdpa(tiny, noise_image, stats):
    inputs = encode(tiny, noise_image, format_prompt(tiny, PROMPT, with_image=True))
    with torch.inference_mode():
        ref = tiny.model(**inputs).logits
    probe = AttentionProbe(StatRequest(colsum=stats, window=4 if stats else 0))
    cache = TrackedCache(tiny.num_layers)
    n = inputs["input_ids"].shape[1]
    cache.set_pending(torch.arange(n)[None], inputs["input_ids"] == tiny.image_token_id)
    with tracked_attention_enabled(tiny.model), torch.inference_mode():
        ours = tiny.model(**inputs, **cache_kwarg(cache), position_ids=torch.arange(n)[None], kv_probe=probe).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    if stats:
        colsum = probe.stats[0]["colsum"]
        # every query's row sums to one, so the column sums add up to the number of queries
        torch.testing.assert_close(colsum.sum(-1), torch.full_like(colsum.sum(-1), float(n)), atol=1e-3, rtol=1e-4)


def test_registration_removed_on_exit(tiny_llama):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    before = tiny_llama.model.config.get_text_config()._attn_implementation
    with tracked_attention_enabled(tiny_llama.model):
        assert tiny_llama.model.config.get_text_config()._attn_implementation == ATTN_NAME
        assert ATTN_NAME in AttentionInterface._global_mapping
    assert ATTN_NAME not in AttentionInterface._global_mapping
    assert ATTN_NAME not in AttentionMaskInterface._global_mapping
    assert tiny_llama.model.config.get_text_config()._attn_implementation == before


# -- full == generate ---------------------------------------------------------------------------------------
def test_full_equals_plain_generate(tiny, noise_image):
    engine = Engine(tiny)
    session = engine.new_session(noise_image, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=16))
    list(session.run())
    ours = session.states["full"].turn_ids
    inputs = encode(tiny, noise_image, format_prompt(tiny, PROMPT, with_image=True))
    with torch.inference_mode():
        out = tiny.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    theirs = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ours[: len(theirs)] == theirs[: len(ours)]
    assert len(ours) >= 1


def test_budget_one_reproduces_full(tiny_qwen2, noise_image):
    engine = Engine(tiny_qwen2)
    methods = ["full"] + [m for m in METHODS if REGISTRY[m].uses_budget]  # r = 1 is the full cache
    session = engine.new_session(noise_image, PROMPT, methods, 1.0, GenerationSettings(max_new_tokens=10))
    list(session.run())
    ref = session.states["full"].turn_ids
    for name, state in session.states.items():
        assert state.turn_ids == ref, name


# -- eviction == masking ------------------------------------------------------------------------------------
def _planned(loaded, image, method, budget, knobs=None):
    """The uncompressed prefill cache (every token through every layer), and `method`'s plans for a copy of the
    cache it compresses (with the statistics it asked for). A prefill token reduction compresses its own prefill;
    for a token drop (FastV, DART: the later layers never computed the dropped tokens) the uncompressed cache is a
    plain forward's with the dropped tokens masked from layer K on. Also returns the drop's stages (none without one)."""
    inputs = encode(loaded, image, format_prompt(loaded, PROMPT, with_image=image is not None))
    ids = inputs["input_ids"]
    is_image = ids == loaded.image_token_id
    policy = make_policy(method, budget, **(knobs or {}))
    with tracked_attention_enabled(loaded.model):
        shared = runner.prefill_for(loaded.model, policy, ids, is_image, inputs.get("pixel_values"),
                                    loaded.num_layers, loaded.device, loaded.image_token_id)
        drops = policy.prefill_token_drops(ids.shape[1], is_image, loaded.num_layers)
        full = shared.cache
        if drops:
            _, full = layered_reference_cache(loaded, ids, is_image, inputs.get("pixel_values"), shared.cache)
    n = shared.prompt_len
    compressed = shared.cache.clone()
    view = PrefillView(compressed, runner.policy_stats(policy, shared.stats, n), n, budget,
                       policy.prefill_stats(n).window, shared.reduction)
    plans, state = policy.prefill(view)
    only_evicts = all(p is None or (p.merge is None and p.quantise is None) for p in plans) and \
        not any(drop.recycles for drop in drops)
    return full, compressed, plans, only_evicts, n, state, drops


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_eviction_equals_masking(tiny, noise_image, method, budget):
    engine = Engine(tiny)
    cache, compressed, plans, only_evicts, n, _, _ = _planned(tiny, noise_image, method, budget)
    if not only_evicts:
        pytest.skip(f"{method} merges or quantises entries: its cache is not a subset of the full one")
    apply_plans(compressed, plans)
    token = torch.tensor([[5]])
    with tracked_attention_enabled(tiny.model):
        logits_compressed = engine.forward(compressed, token, n, AttentionProbe())
        masks = kept_entry_masks(compressed, n)
        logits_masked = engine.forward(cache.clone(), token, n, AttentionProbe(key_masks=masks))
    torch.testing.assert_close(logits_compressed, logits_masked, atol=1e-4, rtol=1e-4)


# -- budgets, plans and protected tokens at every step -------------------------------------------------------
def _run_steps(loaded, image, methods, budget, max_new=12):
    engine = Engine(loaded)
    session = engine.new_session(image, PROMPT, methods, budget, GenerationSettings(max_new_tokens=max_new))
    events = [e for e in session.run() if getattr(e, "kind", None) in ("token", "done")]
    # the rows that left the batch take their entries back on the model's thread just after the turn: wait for it
    # (the session's own readers do; these tests read the caches directly)
    session._settled()
    return session, events


@pytest.mark.parametrize("budget", BUDGETS)
def test_every_step_methods_hold_budget(tiny, noise_image, budget):
    methods = [m for m in METHODS if REGISTRY[m].schedule == "every step"]
    session, events = _run_steps(tiny, noise_image, methods, budget)
    n = session.prefill.prompt_tokens
    for ev in events:
        target = budget * ev.full_len
        mean = sum(ev.kept_per_layer) / len(ev.kept_per_layer)
        assert abs(mean - target) <= 1.0, (ev.method, ev.step, mean, target)
        if ev.method in ("local", "h2o", "elastic"):
            assert len(set(ev.kept_per_layer)) == 1, ev.method  # uniform over layers
    for name in methods:
        cache = session.states[name].cache
        for layer in cache.layers:
            pos = layer.positions[0]
            assert (pos == 0).any(dim=-1).all(), f"{name}: sink evicted"
            assert (pos == session.states[name].true_len - 1).any(dim=-1).all(), f"{name}: newest token evicted"
    assert n > 0


@pytest.mark.parametrize("budget", BUDGETS)
def test_prompt_only_methods_match_their_plan(tiny, noise_image, budget):
    cases = [(m, {}) for m in METHODS if REGISTRY[m].schedule == "prompt only"] + [("lookm", {"text_prior": "keep_all"})]
    for method, knobs in cases:  # each on the prefill it asks for (a prefill token reduction: its own)
        full, c, plans, _, n, state, _ = _planned(tiny, noise_image, method, budget, knobs)
        is_image = full.layers[0].is_image[0, 0]
        prefilled = c.lengths()  # a token drop's later layers hold the kept tokens already
        apply_plans(c, plans)
        lengths = c.lengths()
        # entries kept per KV head on average (a head-wise count pads the shorter heads with empty slots)
        assert lengths == [held if p is None else round(float((p.keep[0] >= 0).sum(-1).float().mean()))
                           for held, p in zip(prefilled, plans)], method
        for layer in c.layers:  # protected: sink and last prompt token
            assert (layer.positions[0] == 0).any(-1).all() and (layer.positions[0] == n - 1).any(-1).all(), method
        if method == "snapkv":  # the window is fitted to the budget: never more than round(r·N)
            assert set(lengths) == {max(2, round(budget * n))}
        if method == "pyramidkv":
            assert all(a >= b for a, b in zip(lengths, lengths[1:])), lengths
            if not state.uniform:  # a real pyramid: mean is the budget
                assert abs(sum(lengths) / len(lengths) - budget * n) <= 1.0
        if method == "lookm" and knobs:  # keep_all: every text token survives, in every head
            n_text = int((~is_image).sum())
            for layer in c.layers:
                assert int((~layer.is_image[0]).sum(-1).min()) == n_text
        elif method == "lookm":  # the paper's text prior: the budget exactly, text ranked before image tokens
            assert set(lengths) == {max(1, round(budget * n))}
            recent = max(1, round(0.5 * budget * n))
            text_outside = set(torch.nonzero(~is_image[: n - recent]).flatten().tolist())
            for layer in c.layers:
                for head in layer.positions[0]:
                    kept = set(head.tolist())
                    if any(bool(is_image[j]) for j in kept if j < n - recent):  # an image token got in:
                        assert text_outside <= kept  # then no text token was left out


def test_pyramid_decreases_with_depth_at_low_budget(tiny_llama, noise_image):
    engine, cache, probe, ids, _, _ = _prefill(tiny_llama, noise_image)
    policy = make_policy("pyramidkv", 0.3, window=2)
    c = cache.clone()
    plans, state = policy.prefill(PrefillView(c, probe.stats, ids.shape[1], 0.3, 8))
    apply_plans(c, plans)
    lengths = c.lengths()
    assert lengths[0] > lengths[-1] and not state.uniform and not state.notes


def test_prefixkv_layers_differ_and_average_to_budget(tiny, noise_image):
    engine, cache, probe, ids, _, _ = _prefill(tiny, noise_image)
    n = ids.shape[1]
    for budget in (0.2, 0.4):
        policy = make_policy("prefixkv", budget)
        c = cache.clone()
        plans, state = policy.prefill(PrefillView(c, probe.stats, n, budget, 8))
        apply_plans(c, plans)
        lengths = c.lengths()
        assert len(set(lengths)) > 1, lengths
        assert abs(sum(lengths) / len(lengths) - budget * n) <= 0.5
        assert state.converged and 0 < state.threshold < 1


def test_offline_prefixkv_uses_given_ratios(tiny_llama, noise_image):
    engine, cache, probe, ids, _, _ = _prefill(tiny_llama, noise_image)
    n = ids.shape[1]
    ratios = [0.5, 0.3, 0.2, 0.2]
    policy = make_policy("prefixkv", 0.3, mode="offline", ratios=ratios)
    c = cache.clone()
    apply_plans(c, policy.prefill(PrefillView(c, probe.stats, n, 0.3, 8)))
    lengths = c.lengths()
    assert sum(lengths) == round(0.3 * n * 4)
    assert lengths[0] > lengths[1] >= lengths[3]


@pytest.mark.parametrize("method", list(METHODS))
def test_metadata_stays_aligned_after_gathers(tiny_qwen2, noise_image, method):
    """Keys of an entry must be the keys computed for its position: compare to the full prefill cache."""
    cache, c, plans, only_evicts, n, _, drops = _planned(tiny_qwen2, noise_image, method, 0.4)
    if not only_evicts:
        pytest.skip(f"{method} merges or quantises entries: they are not copies of prefill entries")
    apply_plans(c, plans)
    for i, (full_layer, layer) in enumerate(zip(cache.layers, c.layers)):
        held = layer.positions >= 0  # empty slots (heads keeping fewer entries) hold nothing
        idx = layer.positions.clamp_min(0)  # position == index in the full prefill cache
        expect = full_layer.keys.gather(2, idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1]))
        torch.testing.assert_close(layer.keys[held], expect[held], atol=1e-5, rtol=1e-5)
        assert torch.equal(layer.is_image[held], full_layer.is_image.gather(2, idx)[held])
        if not drops or i < drops[0].layer:  # after a token drop only the kept tokens' queries add to the scores
            assert torch.equal(layer.scores[held], full_layer.scores.gather(2, idx)[held])


def test_decode_positions_are_true_positions(tiny_llama, noise_image):
    session, _ = _run_steps(tiny_llama, noise_image, ["full", "prefixkv", "local"], 0.3, max_new=10)
    n = session.prefill.prompt_tokens
    for name, state in session.states.items():
        for layer in state.cache.layers:
            pos = layer.positions[0, 0]
            assert int(pos[-1]) == state.true_len - 1
            assert bool((pos[1:] > pos[:-1]).all())  # strictly increasing, never re-based
        assert state.true_len == n + len(state.turn_ids) - 1


def test_follow_up_keeps_per_layer_lengths(tiny, noise_image):
    engine = Engine(tiny)
    session = engine.new_session(noise_image, PROMPT, ["full", "prefixkv", "snapkv", "zipvl"], 0.3,
                                 GenerationSettings(max_new_tokens=6))
    list(session.run())
    before = session.states["prefixkv"].cache.lengths()
    events = list(session.follow_up("and what colour is it?"))
    assert not [e for e in events if e.kind == "error"], [e.error for e in events if e.kind == "error"]
    p = session.states["prefixkv"]
    after = p.cache.lengths()
    assert len(set(after)) > 1 and after != before
    assert abs(sum(after) / len(after) - 0.3 * p.true_len) <= 1.0
    full = session.states["full"]
    assert full.cache.lengths() == [full.true_len] * tiny.num_layers
    assert session.states["snapkv"].cache.lengths()[0] > before[0]  # prompt only: grows again
    assert session.turn == 1 and session.user_turns[-1] == "and what colour is it?"


def test_zipvl_bytes_match_packed_tensors(tiny_llama, noise_image):
    session, events = _run_steps(tiny_llama, noise_image, ["full", "zipvl"], 0.3, max_new=4)
    z = session.states["zipvl"].cache
    expected = 0
    for layer in z.layers:
        for seg in layer.segments:
            for q in (seg.keys, seg.values):
                expected += sum(t.numel() * t.element_size() for t in (q.packed, q.scale, q.zero))
        expected += layer.keys.numel() * layer.keys.element_size() * 2
    assert z.nbytes() == expected
    done = {e.method: e for e in events if e.kind == "done"}
    assert done["zipvl"].kv_bytes < 0.4 * done["full"].kv_bytes
    assert done["zipvl"].kept_per_layer == done["full"].kept_per_layer  # keeps every token


def test_cancel_stops_every_method(tiny_llama, noise_image):
    import threading

    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, ["full", "local", "h2o"], 0.5,
                                 GenerationSettings(max_new_tokens=50))
    cancel = threading.Event()
    kinds = []
    for ev in session.run(cancel):
        if getattr(ev, "kind", None) == "token" and ev.step >= 3:
            cancel.set()
        kinds.append(getattr(ev, "kind", "prefill"))
    assert kinds.count("cancelled") >= 1
    assert max(len(s.turn_ids) for s in session.states.values()) <= 5
    # the engine is free again
    assert not engine.lock.locked()


# -- bad input ----------------------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors_and_model_stays_usable(tiny_llama, noise_image, tmp_path):
    engine = Engine(tiny_llama)
    with pytest.raises(EngineError, match=r"\(0, 1\]"):
        engine.new_session(noise_image, PROMPT, "all", 0.0)
    with pytest.raises(EngineError, match=r"\(0, 1\]"):
        engine.new_session(noise_image, PROMPT, "all", 1.5)
    with pytest.raises(EngineError, match="accepted: full"):
        engine.new_session(noise_image, PROMPT, ["full", "magic"], 0.3)
    with pytest.raises(EngineError, match="empty"):
        engine.new_session(noise_image, "   ", "all", 0.3)
    with pytest.raises(EngineError, match=r"1 <image> marker\(s\) for 2 image"):
        engine.new_session([noise_image, noise_image], "<image> " + PROMPT, "all", 0.3)
    with pytest.raises(EngineError, match="image 2 of 2 is empty"):
        engine.new_session([noise_image, None], PROMPT, "all", 0.3)
    with pytest.raises(EngineError, match="batch size 1"):
        engine.new_session(noise_image, [PROMPT, PROMPT], "all", 0.3)
    bogus = tmp_path / "notes.png"
    bogus.write_text("this is not an image")
    with pytest.raises(EngineError, match="not a readable image"):
        engine.new_session(str(bogus), PROMPT, "all", 0.3)
    with pytest.raises(EngineError, match="knob"):
        engine.new_session(noise_image, PROMPT, ["lookm"], 0.3, knobs={"lookm": {"bogus": 1}})
    with pytest.raises(EngineError, match="pivotal"):
        engine.new_session(noise_image, PROMPT, ["lookm"], 0.3, knobs={"lookm": {"merge": "median"}})
    long_prompt = " ".join(["word"] * (tiny_llama.max_context + 10))
    session = engine.new_session(noise_image, long_prompt, ["full"], 0.3)
    with pytest.raises(EngineError, match="context"):
        list(session.run())
    # still usable
    session = engine.new_session(noise_image, PROMPT, ["full", "prefixkv"], 0.3, GenerationSettings(max_new_tokens=3))
    events = list(session.run())
    assert any(getattr(e, "kind", None) == "done" for e in events)
    assert not engine.lock.locked()


def test_one_failing_method_does_not_stop_the_others(tiny_llama, noise_image, monkeypatch):
    from prefixkv_core.policies.h2o import H2OPolicy

    def boom(self, view, state):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(H2OPolicy, "decode", boom)
    session, _ = _run_steps(tiny_llama, noise_image, ["full", "h2o", "local"], 0.5, max_new=5)
    assert "synthetic failure" in session.states["h2o"].error
    assert session.states["full"].error is None and len(session.states["full"].turn_ids) == 5


def test_score_answer_teacher_forcing(tiny_llama, noise_image):
    from prefixkv_core.report.metrics import perplexity

    engine = Engine(tiny_llama)
    scores = engine.new_session(noise_image, PROMPT, ["full", "local", "prefixkv"], 0.3).score_answer(
        "a red square and a blue circle")
    assert set(scores) == {"full", "local", "prefixkv"}
    for nll, count in scores.values():
        assert count > 3 and nll > 0
    assert perplexity(scores.values()) > 1.0
    # budget 1.0: every method's teacher-forced NLL equals Full's
    same = engine.new_session(noise_image, PROMPT, ["full", "local"], 1.0).score_answer("a red square")
    assert abs(same["full"][0] - same["local"][0]) < 1e-4


# -- CLI contract -------------------------------------------------------------------------------------------
def test_cli_compare_writes_contract(tmp_path, noise_image):
    from prefixkv_core.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", "qwen2")
    image = tmp_path / "img.png"
    noise_image.save(image)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "prefixkv_core", "compare", "--model", str(model_dir), "--image", str(image),
         "--prompt", "Describe the image.", "--methods", "all", "--budget", "0.3", "--max-new-tokens", "4",
         "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["budget"] == 0.3 and data["model"] == str(model_dir)
    assert set(data["methods"]) == set(METHODS)
    for name, r in data["methods"].items():
        for key in ("text", "kept_per_layer", "kept_image_per_layer", "full_len", "kv_bytes", "full_kv_bytes",
                    "ttft_s", "tokens_per_s", "rouge_l_vs_full"):
            assert key in r, (name, key)
        assert len(r["kept_per_layer"]) == 4
    assert data["methods"]["full"]["rouge_l_vs_full"] == 1.0
    from prefixkv_core.__main__ import main  # the same command in this process: no second interpreter to start

    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["compare", "--model", str(model_dir), "--prompt", "x", "--budget", "2"])
    assert code == 2 and "(0, 1]" in err.getvalue()


def test_nested_and_overlapping_tracked_attention_blocks_keep_the_outer_choice(tiny_llama):
    """An inner block's exit leaves the outer block on our attention (it used to put the model back on sdpa and
    drop the registration); overlapping blocks from two threads restore the model's own only when the last ends."""
    import threading

    from transformers import AttentionInterface

    from prefixkv_core.kv.attention import is_registered

    model = tiny_llama.model
    text = model.config.get_text_config()
    before = text._attn_implementation
    with tracked_attention_enabled(model):
        with tracked_attention_enabled(model):
            assert text._attn_implementation == ATTN_NAME
        assert text._attn_implementation == ATTN_NAME and is_registered()
        assert ATTN_NAME in AttentionInterface._global_mapping
    assert text._attn_implementation == before and not is_registered()

    entered, release = threading.Event(), threading.Event()

    def other_turn():
        with tracked_attention_enabled(model):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other_turn)
    with tracked_attention_enabled(model):
        thread.start()
        assert entered.wait(10)
    assert text._attn_implementation == ATTN_NAME and is_registered()  # the other turn still runs
    release.set()
    thread.join(10)
    assert text._attn_implementation == before and not is_registered()
