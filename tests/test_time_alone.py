"""Timing each method alone: a method's own policy time is charged to that method only, in the batched run and
alone; decoding every method on its own (after the batched run, or instead of it) gives the batched answers."""
import time
from dataclasses import dataclass

import pytest

from prefixkv_core import Engine, EngineError, GenerationSettings
from prefixkv_core.policies import role_methods
from prefixkv_core.policies import METHODS, register, unregister
from prefixkv_core.policies.base import Policy, PolicyState, Prefilled
from prefixkv_core.report.record import ComparisonRecord

PROMPT = "describe the picture in detail and name every object you can see in it"
FOLLOW_UP = "and what colour is the largest one"
KNOBS = {"zipvl": {"decode_block": 3}}  # ZipVL re-quantises while decoding within a few tokens
NAP_S = 0.03


@dataclass(frozen=True)
class NappingPolicy(Policy):
    """Keeps everything and sleeps in every decode call: a policy whose cost is all its own."""

    name = "napping"
    label = "Napping"
    summary = "Keeps every entry; sleeps in every decode call (a test method)."
    colour = "#0a0b0c"
    schedule = "none"
    uses_budget = False

    def prefill(self, view):
        return Prefilled([None] * len(view.cache.layers), PolicyState())

    def decode(self, view, state):
        time.sleep(NAP_S)
        return None


@pytest.fixture
def napping():
    register(NappingPolicy)
    try:
        yield NappingPolicy
    finally:
        unregister("napping")


def _answers(events, alone: bool):
    """Per method: every turn's (answer ids as text, kept per layer, KV bytes) from its done events."""
    out = {}
    for ev in events:
        if getattr(ev, "kind", None) == "done" and ev.alone == alone:
            out.setdefault(ev.method, []).append((ev.text, ev.kept_per_layer, ev.kv_bytes, ev.step))
    return out


def test_policy_time_is_charged_to_its_own_method(tiny_llama, noise_image, napping, one_torch_thread):
    engine = Engine(tiny_llama)
    methods = ["full", "napping", "local"]
    session = engine.new_session(noise_image, PROMPT, methods, 0.3, GenerationSettings(max_new_tokens=4),
                                 time_alone=True)
    events = list(session.run())
    batched = [ev for ev in events if getattr(ev, "kind", None) == "token" and not ev.alone and ev.step > 1]
    alone = [ev for ev in events if getattr(ev, "kind", None) in ("token", "done") and ev.alone and ev.step > 1]
    # the batched run: only the napping method's own policy time holds the nap; the shared forward does not
    for ev in batched:
        assert (ev.policy_s >= NAP_S) == (ev.method == "napping"), ev
        assert ev.batch_size == 3 and ev.step_latency_s < NAP_S
    # alone: every step the napping method took holds its nap, and no other method's does
    assert {ev.method for ev in alone} == set(methods)
    for ev in alone:
        assert ev.batch_size == 1
        assert (ev.step_latency_s + ev.policy_s >= NAP_S) == (ev.method == "napping"), ev

    results = session.results()
    policy = {m: results[m]["policy_ms_per_token"] for m in methods}
    assert max(policy, key=policy.get) == "napping" and policy["napping"] >= 1000 * NAP_S
    speed = {m: results[m]["alone"]["tokens_per_s"] for m in methods}
    assert min(speed, key=speed.get) == "napping"
    assert results["napping"]["speedup_vs_full"] < 1 and results["full"]["speedup_vs_full"] == 1.0
    curves = session.record.alone_series()
    assert all(lat + pol >= NAP_S for lat, pol in zip(curves["napping"].latency_s[1:], curves["napping"].policy_s[1:]))
    assert all(lat + pol < NAP_S for lat, pol in zip(curves["full"].latency_s[1:], curves["full"].policy_s[1:]))
    timing = session.record.to_dict()["timing"]
    assert timing["batched"] and timing["alone"]
    assert timing["batch"]["methods"] == 3 and timing["batch"]["steps"] == 3  # once per step, not per method
    assert timing["batch"]["forward_ms_per_step"] < 1000 * NAP_S


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_alone_answers_equal_batched_answers(fixture, request, noise_image, one_torch_thread):
    """Greedy: every method decoded on its own after the batched run gives the batched tokens, kept counts and
    bytes, over a first turn and a follow-up (decoded from a copy of its cache)."""
    engine = Engine(request.getfixturevalue(fixture))
    session = engine.new_session(noise_image, PROMPT, "all", 0.3, GenerationSettings(max_new_tokens=6), KNOBS,
                                 time_alone=True)
    events = list(session.run()) + list(session.follow_up(FOLLOW_UP))
    batched, alone = _answers(events, alone=False), _answers(events, alone=True)
    assert set(batched) == set(METHODS)
    for method in METHODS:
        assert len(batched[method]) == 2, method
        assert alone[method] == batched[method], method
    for method, r in session.results().items():
        assert r["error"] is None and r["alone"]["same_answer"] is True, method
        assert r["alone"]["tokens"] == r["tokens"] and len(r["alone"]["latency_ms"]) == r["tokens"] - 1
    # the copies timed alone are gone after the turn; the follow-up's batched caches are the session's own
    assert session.timing == []


def test_each_method_alone_instead_of_batched(tiny_qwen2, noise_image, one_torch_thread):
    """batched=False: each method is decoded on its own, one after another, with the batched answers; every
    timing is then its own, and there is no batch step."""
    engine = Engine(tiny_qwen2)
    settings = dict(max_new_tokens=5, do_sample=True, temperature=0.9, seed=3)  # samplers copied per method
    reference = engine.new_session(noise_image, PROMPT, "all", 0.3, GenerationSettings(**settings), KNOBS)
    ref = _answers(list(reference.run()) + list(reference.follow_up(FOLLOW_UP)), alone=False)
    session = engine.new_session(noise_image, PROMPT, "all", 0.3, GenerationSettings(**settings), KNOBS,
                                 batched=False)
    events = list(session.run()) + list(session.follow_up(FOLLOW_UP))
    assert all(ev.alone for ev in events if hasattr(ev, "alone"))
    assert all(ev.batch_size == 1 for ev in events if hasattr(ev, "batch_size"))
    assert _answers(events, alone=True) == ref
    # one method at a time: each finishes its turn before the next one starts decoding
    order = [ev.method for ev in events if getattr(ev, "kind", None) == "token" and ev.turn == 0 and ev.step > 1]
    assert order == sorted(order, key=list(METHODS).index)
    out = session.record.to_dict()
    assert out["timing"] == {"batched": False, "alone": True, "batch": None}
    for method, r in out["methods"].items():
        assert r["timing"] == "alone" and r["tokens_per_s"] == r["alone"]["tokens_per_s"], method
        assert r["alone"]["same_answer"] is None  # nothing batched to compare with
    assert out["prefill"]["prompt_tokens"] == reference.prefill.prompt_tokens


def test_alone_in_the_query_agnostic_mode_and_with_own_prefills(tiny_llama, noise_image, one_torch_thread):
    """Query-agnostic: each method alone compresses its own prefill, then is fed the question on its own; the
    methods with a prefill of their own (FastV, VisionZip) and AdaKV's head-wise cache give the batched answers
    too, after the batched run and instead of it."""
    engine = Engine(tiny_llama)
    methods = ["full", "snapkv", "fastv", "visionzip", "adakv"]
    knobs = {"fastv": {"budget_of": "image"}, "visionzip": {"budget_of": "image"}}
    settings = GenerationSettings(max_new_tokens=5)
    session = engine.new_session(noise_image, PROMPT, methods, 0.3, settings, knobs, query_agnostic=True,
                                 time_alone=True)
    events = list(session.run()) + list(session.follow_up(FOLLOW_UP))
    batched = _answers(events, alone=False)
    assert set(batched) == set(methods) and _answers(events, alone=True) == batched
    only = engine.new_session(noise_image, PROMPT, methods, 0.3, settings, knobs, query_agnostic=True,
                              batched=False)
    assert _answers(list(only.run()) + list(only.follow_up(FOLLOW_UP)), alone=True) == batched
    for method, r in only.results().items():
        assert r["error"] is None and r["alone"]["ttft_s"] > 0, method


def test_time_alone_with_sampling_follow_up_equals_batched(tiny_llama, noise_image, one_torch_thread):
    """The copy a follow-up is timed on carries the method's sampler state: sampled answers match too."""
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, ["full", "h2o", "prefixkv"], 0.3,
                                 GenerationSettings(max_new_tokens=5, do_sample=True, temperature=1.0, seed=1),
                                 time_alone=True)
    events = list(session.run()) + list(session.follow_up(FOLLOW_UP))
    assert _answers(events, alone=True) == _answers(events, alone=False)


def test_stop_during_the_alone_pass(tiny_llama, noise_image, one_torch_thread):
    """Stop while the methods are timed alone: the batched answers stay done, no further method is timed."""
    import threading

    engine = Engine(tiny_llama)
    cancel = threading.Event()
    session = engine.new_session(noise_image, PROMPT, ["full", "local", "h2o"], 0.3,
                                 GenerationSettings(max_new_tokens=5), time_alone=True)
    seen = []
    for ev in session.run(cancel):
        if getattr(ev, "alone", False):
            seen.append((ev.method, ev.kind))
            if ev.kind == "token" and ev.step == 2:
                assert session.cache_bytes() > sum(s.cache.nbytes() for s in session.states.values())
                cancel.set()
    assert {m for m, _ in seen} == {"full"} and seen[-1] == ("full", "cancelled")
    results = session.results()
    assert all(r["status"] == "done" for r in results.values())
    assert results["full"]["alone"]["status"] == "stopped" and results["full"]["speedup_vs_full"] is None
    assert results["local"]["alone"] is None
    assert session.cache_bytes() == sum(s.cache.nbytes() for s in session.states.values())


def test_timing_switches_are_checked(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    for bad in ({"time_alone": "yes"}, {"batched": 0}):
        with pytest.raises(EngineError, match="must be True or False"):
            engine.new_session(noise_image, PROMPT, ["full"], 0.3, **bad)
    session = engine.new_session(noise_image, PROMPT, ["full"], 0.3, batched=False)
    assert session.time_alone and not session.batched


def test_record_keeps_the_shared_forward_once_per_step():
    """Nine events of one batched step are one point of the batch series, not nine."""
    from prefixkv_core.report.events import MethodEvent

    methods = ["full", "h2o", "snapkv"]
    record = ComparisonRecord(methods, {m: m for m in methods}, "q", 0.3, roles=role_methods())
    for step in (1, 2, 3):
        for m in methods:
            record.apply(MethodEvent(m, m, "token", step=step, kept_per_layer=[4], full_len=10, kv_bytes=40,
                                     full_kv_bytes=100, step_latency_s=0.0 if step == 1 else 0.02,
                                     policy_s=0.001 * (methods.index(m) + 1), batch_size=3))
    assert record.batch.steps == [1, 2] and record.batch.forward_s == [0.02, 0.02]
    assert record.batch_summary() == {"methods": 3, "steps": 2, "forward_ms_per_step": 20.0}
    out = record.to_dict()["methods"]
    assert [out[m]["policy_ms_per_token"] for m in methods] == [1.0, 2.0, 3.0]
    assert all(out[m]["alone"] is None and out[m]["speedup_vs_full"] is None for m in methods)


def test_cli_time_alone(tmp_path, noise_image, capsys, one_torch_thread):
    import json

    from prefixkv_core.__main__ import main

    image = tmp_path / "img.png"
    noise_image.save(image)
    out = tmp_path / "out.json"
    args = ["compare", "--model", "tiny-llama", "--image", str(image), "--prompt", "Describe the image.",
            "--methods", "full,h2o", "--budget", "0.3", "--max-new-tokens", "4", "--json", str(out)]
    assert main(args + ["--time-alone"]) == 0
    printed = capsys.readouterr().out
    assert "share one forward" in printed and "alone" in printed and "x Full" in printed
    data = json.loads(out.read_text())
    assert data["timing"]["batched"] and data["timing"]["alone"]
    assert data["methods"]["full"]["speedup_vs_full"] == 1.0 and data["methods"]["h2o"]["alone"]["same_answer"]
    assert main(args + ["--time-alone", "only"]) == 0
    data = json.loads(out.read_text())
    assert data["timing"] == {"batched": False, "alone": True, "batch": None}
    assert data["methods"]["h2o"]["timing"] == "alone"
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert not data["timing"]["alone"] and data["methods"]["h2o"]["alone"] is None
    assert data["methods"]["h2o"]["policy_ms_per_token"] is not None
