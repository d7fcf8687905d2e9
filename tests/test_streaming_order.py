"""The methods that share the prefill stream first; the methods with a prefill of their own are prefilled one after
another, each streaming once its prefill is done, and join the batch with exactly the answer each gives decoded
alone; Stop before one joined ends it cleanly."""
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
    assert joins == sorted(joins)  # one after another, in the methods' order
    # each streams its first token as soon as its prefill is done, before the next one prefills
    for method, later in zip([m for m in METHODS if m in OWN_PREFILL], joins[1:]):
        assert order.index((method, "token")) < later, method
    # they prefill back to back: no step of the shared methods waits between two of them, and the batch is
    # whole from the shared methods' second token on (each shared method's second token comes after every join)
    for method in set(METHODS) - OWN_PREFILL:
        tokens = [i for i, item in enumerate(order) if item == (method, "token")]
        assert tokens[0] < joins[0] and tokens[1] > joins[-1], method
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


def test_stop_between_two_own_prefills_ends_the_rest_and_keeps_the_joined(tiny_llama, noise_image):
    """The own prefills run back to back, but a stop between two of them is heard: the rows already joined keep
    their tokens, the ones not yet prefilled end with the message."""
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, METHODS, 0.5, _settings(8))
    cancel = threading.Event()
    for ev in session.run(cancel):
        if isinstance(ev, MethodEvent) and ev.method == "fastv" and ev.kind == "token":
            cancel.set()  # fastv joined; visionzip, downsample and dart still wait for their prefills
    assert session.states["fastv"].cache is not None and session.states["fastv"].text
    for method in ("visionzip", "downsample", "dart"):
        assert session.states[method].cache is None, method
        assert "stopped before its own prefill ran" in session.states[method].error
    assert not engine.lock.locked()
