"""Several conversations' first-turn prefills in one forward (`session/prefill_pool.py`): turns that start together
with prompts of one length and layout share the shared prefill's forward, and every method's answer, kept entries
and the importance charts are what the same turn makes alone; what cannot share runs alone; a failed shared
forward falls back to each alone; nothing stays in the pool."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.report.events import PrefillInfo
from prefixkv_core.session import prefill_pool, step_pool
from prefixkv_core.session.prefill_pool import PrefillTicket, joint_request
from prefixkv_core.policies import make_policy
from prefixkv_core.testing import wait_until

METHODS = ["full", "snapkv", "h2o", "pyramidkv", "adakv", "vlcache", "zipvl", "lookm", "prefixkv", "random", "fastv"]


def _picture(seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(48, 64, 3) * 255).astype("uint8"))


def _settings() -> GenerationSettings:
    return GenerationSettings(max_new_tokens=6, ignore_eos=True)


def _outcome(session, prefill: PrefillInfo | None) -> dict:
    """What a turn made: each method's text and kept entries, and the prefill's importance."""
    kept = {name: [layer.positions.tolist() for layer in state.cache.layers] if state.cache is not None else None
            for name, state in session.states.items()}
    return {"texts": {m: row["text"] for m, row in session.results().items()}, "kept": kept,
            "importance": prefill.importance if prefill is not None else None}


def _run(session) -> dict:
    prefill = None
    for event in session.run():
        if isinstance(event, PrefillInfo):
            prefill = event
    # the rows that left the batch take their entries back on the model's thread just after the turn: wait for it
    # (the session's own readers do; these tests read the caches directly)
    session._settled()
    return _outcome(session, prefill)


def _together(engine: Engine, sessions: list) -> list[dict]:
    """Start every session's first turn while the model is held, so that all their prefills wait at once; then let
    the model go."""
    out: list[dict | None] = [None] * len(sessions)

    def go(k: int) -> None:
        out[k] = _run(sessions[k])

    threads = [threading.Thread(target=go, args=(k,)) for k in range(len(sessions))]
    with engine.lock:
        for t in threads:
            t.start()
        assert wait_until(lambda: engine.prefills.waiting_count() == len(sessions), timeout=60)
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    return out


def _same(alone: dict, together: dict) -> None:
    assert together["texts"] == alone["texts"]
    assert together["kept"] == alone["kept"]
    np.testing.assert_allclose(together["importance"], alone["importance"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("query_agnostic", [False, True], ids=["query-aware", "query-agnostic"])
def test_turns_started_together_share_one_prefill_and_answer_as_alone(tiny_llama, query_agnostic, monkeypatch):
    engine = Engine(tiny_llama)
    # query-aware: one prompt on two pictures; query-agnostic: the questions differ, the image block does not
    prompts = (["describe the picture", "describe the picture", "describe the picture"] if not query_agnostic else
               ["describe the picture", "what colour is the sky over the hills", "name it"])
    make = [lambda k=k: engine.new_session(_picture(k), prompts[k], METHODS, 0.4, _settings(),
                                           query_agnostic=query_agnostic) for k in range(3)]
    alone = [_run(m()) for m in make]
    assert dict(engine.prefills.forwards) == {1: 3}
    sizes = []  # rows of each batched step
    real_advance = step_pool.advance_rows
    monkeypatch.setattr(step_pool, "advance_rows", lambda loaded, buffers, states, *rest: (
        sizes.append(len(states)), real_advance(loaded, buffers, states, *rest))[1])
    together = _together(engine, [m() for m in make])
    assert engine.prefills.forwards[3] == 1  # the three shared one forward
    # ... and each turn's rows, its own prefill's included, decode from its first step, the three turns' in one batch
    assert sizes[0] >= len(METHODS) and 3 * len(METHODS) in sizes
    for a, b in zip(alone, together):
        _same(a, b)
    assert engine.prefills.waiting_count() == 0


def test_every_family_shares_a_prefill(lm, picture):
    engine = Engine(lm)
    methods = ["full", "snapkv", "prefixkv", "vlcache"]
    alone = [_run(engine.new_session(picture, "describe the picture", methods, 0.4, _settings()))
             for _ in range(2)]
    together = _together(engine, [engine.new_session(picture.rotate(180), "describe the picture", methods, 0.4,
                                                     _settings()),
                                  engine.new_session(picture, "describe the picture", methods, 0.4, _settings())])
    assert engine.prefills.forwards[2] == 1
    _same(alone[1], together[1])


def test_prompts_of_other_lengths_prefill_alone(tiny_llama):
    engine = Engine(tiny_llama)
    sessions = [engine.new_session(_picture(0), "describe the picture", ["full", "snapkv"], 0.4, _settings()),
                engine.new_session(_picture(1), "what colour is the sky over the hills", ["full", "snapkv"], 0.4,
                                   _settings())]
    _together(engine, sessions)
    assert dict(engine.prefills.forwards) == {1: 2}


def test_a_shared_forward_that_fails_falls_back_to_each_alone(tiny_llama, monkeypatch):
    engine = Engine(tiny_llama)
    make = [lambda k=k: engine.new_session(_picture(k), "describe the picture", ["full", "h2o"], 0.4, _settings())
            for k in range(2)]
    alone = [_run(m()) for m in make]
    real = prefill_pool.runner.prefill

    def refuse_batches(model, ids, *args, **kwargs):
        if ids.shape[0] > 1:
            raise RuntimeError("out of memory")
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(prefill_pool.runner, "prefill", refuse_batches)
    together = _together(engine, [m() for m in make])
    assert dict(engine.prefills.forwards) == {1: 4}
    for a, b in zip(alone, together):
        _same(a, b)


def test_a_turn_alone_waits_for_nobody(tiny_llama):
    engine = Engine(tiny_llama)
    engine.prefills.gather_s = 60.0
    _run(engine.new_session(_picture(0), "describe the picture", ["full", "snapkv"], 0.4, _settings()))
    assert engine.prefills.gathers == 0 and dict(engine.prefills.forwards) == {1: 1}


def test_a_turn_waits_for_one_still_encoding_its_prompt(tiny_llama, monkeypatch):
    """A turn about to queue its prefill waits (bounded) for a turn encoding meanwhile, and they share a forward."""
    engine = Engine(tiny_llama)
    first = engine.new_session(_picture(0), "describe the picture", ["full"], 0.4, _settings())
    second = engine.new_session(_picture(1), "describe the picture", ["full"], 0.4, _settings())
    from prefixkv_core.session import session as session_module

    real_encode = session_module.encode_prompt
    entered, release = threading.Event(), threading.Event()

    def slow_encode(*args, **kwargs):
        if threading.current_thread().name == "second":
            entered.set()
            release.wait(30)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(session_module, "encode_prompt", slow_encode)
    t = threading.Thread(target=lambda: _run(second), name="second")
    t.start()
    assert entered.wait(30)
    engine.prefills.gather_s = 30.0
    done = threading.Thread(target=lambda: _run(first))
    done.start()
    assert wait_until(lambda: engine.prefills.gathers == 1, timeout=30)
    release.set()
    done.join(60)
    t.join(60)
    assert not done.is_alive() and not t.is_alive()
    assert engine.prefills.forwards[2] == 1


def test_tickets_share_only_what_one_forward_can_run(tiny_llama):
    ids = torch.arange(200)[None]
    flags = torch.zeros(1, 200, dtype=torch.bool)
    flags[0, 2:60] = True

    def ticket(ids=ids, flags=flags, policies=()):
        return PrefillTicket(ids, flags, None, None, list(policies))

    assert ticket().shares_with(ticket(ids + 1))  # other tokens, same length and layout
    assert not ticket().shares_with(ticket(torch.arange(201)[None], torch.zeros(1, 201, dtype=torch.bool)))
    moved = flags.roll(1, dims=1)
    assert not ticket().shares_with(ticket(flags=moved))  # the image elsewhere
    zip_a, zip_b = make_policy("zipvl", 0.4), dataclasses.replace(make_policy("zipvl", 0.4), seed=1)
    # another probe-query subset: one forward cannot record both
    assert not ticket(policies=[zip_a]).shares_with(ticket(policies=[zip_b]))
    snap = ticket(policies=[make_policy("snapkv", 0.4)])
    assert ticket(policies=[zip_a]).shares_with(snap)
    # a group is checked against what its forward records already: snapkv's ticket with zip_a's in it refuses zip_b
    joint = joint_request(snap.request, ticket(policies=[zip_a]).request)
    assert snap.shares_with(ticket(policies=[zip_b])) and not snap.shares_with(ticket(policies=[zip_b]), joint)


def test_a_session_just_made_is_waited_for_briefly(tiny_llama):
    """A session made but not started yet (the app makes it, then runs it on another thread) is on its way: a turn
    starting meanwhile waits for it, at most `gather_s`; once older than `expect_s` it counts no more."""
    engine = Engine(tiny_llama)
    engine.prefills.gather_s = 0.05
    made = engine.new_session(_picture(1), "describe the picture", ["full"], 0.4, _settings())
    _run(engine.new_session(_picture(0), "describe the picture", ["full"], 0.4, _settings()))
    assert engine.prefills.gathers == 1
    engine.prefills.expect_s = 0.0
    _run(engine.new_session(_picture(0), "describe the picture", ["full"], 0.4, _settings()))
    assert engine.prefills.gathers == 1
    _run(made)  # its own turn removes it from those on their way
    assert engine.prefills.gathers == 1


def test_turns_about_to_decode_hold_the_steps_until_they_join_or_fail(tiny_llama):
    """StepPool.arriving: a turn whose prefill runs (served by a shared forward) holds the steps for ARRIVING_S at
    most, one whose prefill ended for `gather_s` at most; joining, or failing, lets them go at once."""
    import time

    from prefixkv_core.session.model_worker import ModelLock, ModelWorker
    from prefixkv_core.session.step_pool import ARRIVING_S, StepPool

    pool = StepPool(tiny_llama, ModelWorker(ModelLock()))
    a, b = object(), object()
    t0 = time.monotonic()
    pool.arriving(a)
    assert t0 < pool._arrivals_until() <= time.monotonic() + ARRIVING_S
    pool.not_arriving(a)  # its prefill failed
    assert pool._arrivals_until() == 0
    pool.arriving(b)
    pool.arriving(b, ready=True)
    assert pool._arrivals_until() <= time.monotonic() + pool.gather_s
    with pool.member(b):  # it joined
        assert pool._arrivals_until() == 0
