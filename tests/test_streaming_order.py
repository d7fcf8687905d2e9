"""The methods that share the prefill stream first; a method with a prefill of its own joins the running batch
once its prefill is done, with exactly the answer it gives decoded alone; Stop before it joined ends it cleanly."""
from __future__ import annotations

import threading

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.report.events import MethodEvent

PROMPT = "describe the picture in detail and name every object you can see in it"
METHODS = ["full", "snapkv", "fastv", "visionzip", "downsample", "dart"]
OWN_PREFILL = {"fastv", "visionzip", "downsample", "dart"}


def _settings(n: int = 6) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, ignore_eos=True)


def test_own_prefills_join_after_the_shared_methods_started_and_answer_as_alone(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, METHODS, 0.5, _settings())
    order = [(ev.method, ev.kind) for ev in session.run() if isinstance(ev, MethodEvent)]
    first_shared_token = order.index(("full", "token"))
    for method in OWN_PREFILL:
        assert order.index((method, "start")) > first_shared_token, method  # it did not hold the others up
    joins = [order.index((m, "start")) for m in METHODS if m in OWN_PREFILL]
    assert joins == sorted(joins)  # one at a time, in the methods' order
    # between two joins the shared methods went on: a token of theirs comes between every two starts
    for a, b in zip(joins, joins[1:]):
        assert any(kind == "token" and m not in OWN_PREFILL for m, kind in order[a:b])
    results = session.results()
    alone = engine.new_session(noise_image, PROMPT, METHODS, 0.5, _settings(), batched=False)
    for _ in alone.run():
        pass
    for method, row in alone.results().items():
        assert results[method]["text"] == row["text"], method
        assert results[method]["kept_per_layer"] == row["kept_per_layer"], method
    # a follow-up goes on from every method's own cache, the joined ones included
    texts = {ev.method for ev in session.follow_up("and the colours?") if isinstance(ev, MethodEvent)
             and ev.kind == "done"}
    assert texts == set(METHODS)


def test_stop_before_an_own_prefill_ran_ends_it_with_a_message_and_keeps_the_others(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, METHODS, 0.5, _settings(8))
    cancel = threading.Event()
    events = []
    for ev in session.run(cancel):
        if isinstance(ev, MethodEvent):
            events.append(ev)
            if ev.method == "full" and ev.kind == "token":
                cancel.set()  # before the first own prefill could run
    cancelled = {ev.method for ev in events if ev.kind == "cancelled"}
    assert cancelled >= OWN_PREFILL
    for method in OWN_PREFILL:
        state = session.states[method]
        assert state.cache is None and "stopped before its own prefill ran" in state.error
    assert not engine.lock.locked()
    # the methods that started keep their partial answers and can follow up; the stopped ones report their error
    kinds = {}
    for ev in session.follow_up("and the colours?"):
        if isinstance(ev, MethodEvent):
            kinds.setdefault(ev.method, set()).add(ev.kind)
    assert "done" in kinds["full"] and "done" in kinds["snapkv"]
    for method in OWN_PREFILL:
        assert kinds[method] == {"error"}, method
