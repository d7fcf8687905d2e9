"""Several users' comparisons decoded in one batch: a turn that starts while another decodes prefills between
its steps and joins its batched forwards (`session/step_pool.py`). No answer changes because of another user's
rows, a cancelled user's rows leave at the next step, and nothing of the batch stays once nobody decodes."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from PIL import Image

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.report.events import MethodEvent
from prefixkv_core.kv.cache import TrackedLayer
from prefixkv_core.session.model_worker import CHORE
from prefixkv_core.session.step_pool import StepPool
from prefixkv_core.testing import wait_until

FIRST = ("describe the picture in detail and name every object you can see in it", ["full", "snapkv", "fastv"])
SECOND = ("what colour is the sky", ["h2o", "full", "visionzip"])


def _settings(n: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def other_image():
    rng = np.random.RandomState(7)
    return Image.fromarray((rng.rand(40, 40, 3) * 255).astype("uint8"))


def _texts(session) -> dict[str, str]:
    return {m: row["text"] for m, row in session.results().items()}


def _alone(engine, image, request, n, follow_up=None):
    """The same request with nobody else on the engine: (first turn's texts, follow-up's texts)."""
    session = engine.new_session(image, request[0], request[1], 0.4, _settings(n))
    for _ in session.run():
        pass
    first = _texts(session)
    if follow_up is None:
        return first, None
    for _ in session.follow_up(follow_up):
        pass
    return first, _texts(session)



def test_two_users_share_the_batched_steps_and_answer_as_alone(tiny_llama, noise_image, other_image, monkeypatch):
    from prefixkv_core.session import step_pool

    formed_for = []  # the rows (their caches) each time the shared stores were formed
    real_form = step_pool.form_rows
    monkeypatch.setattr(step_pool, "form_rows", lambda states, buffers: (
        formed_for.append(frozenset(id(s.cache) for s in states)), real_form(states, buffers))[1])
    engine = Engine(tiny_llama)
    first_alone, first_follow = _alone(engine, noise_image, FIRST, 14, follow_up="and the colours?")
    second_alone, _ = _alone(engine, other_image, SECOND, 10)
    assert engine.pool.shared_steps == 0

    alone_formed = len(formed_for)
    a = engine.new_session(noise_image, *FIRST, 0.4, _settings(14))
    b = engine.new_session(other_image, *SECOND, 0.4, _settings(10))
    events_a = a.run()
    for ev in events_a:  # A decodes (paused at its first token) ...
        if isinstance(ev, MethodEvent) and ev.kind == "token":
            break
    # ... when B arrives: B prefills and joins A's batch
    b_done = threading.Thread(target=lambda: [None for _ in b.run()])
    b_done.start()
    assert wait_until(lambda: engine.pool.decoding() == 2, timeout=60)
    for _ in events_a:
        pass
    b_done.join(120)
    assert not b_done.is_alive()
    assert engine.pool.shared_steps > 0  # some steps held rows of both users
    # formed anew only when rows joined or left, never for the same rows asking in another order
    assert engine.pool.formed == len(formed_for) < engine.pool.steps
    together = formed_for[alone_formed:]  # (a turn's end lets its rows go: its follow-up may form them anew)
    assert all(x != y for x, y in zip(together, together[1:]))
    assert _texts(a) == first_alone
    assert _texts(b) == second_alone
    # the follow-up goes on from A's own caches, unchanged by B's rows
    for _ in a.follow_up("and the colours?"):
        pass
    assert _texts(a) == first_follow
    assert engine.pool.decoding() == 0
    # nothing of the batch stays (let go on the model's thread)
    assert wait_until(lambda: engine.pool.nbytes() == 0, timeout=60)


def test_a_cancelled_user_leaves_the_batch_and_the_other_is_unchanged(tiny_llama, noise_image, other_image):
    engine = Engine(tiny_llama)
    second_alone, _ = _alone(engine, other_image, SECOND, 12)
    a = engine.new_session(noise_image, *FIRST, 0.4, _settings(40))
    b = engine.new_session(other_image, *SECOND, 0.4, _settings(12))
    cancel_a = threading.Event()
    a_events: list[MethodEvent] = []

    def run_a():
        for ev in a.run(cancel_a):
            if isinstance(ev, MethodEvent):
                a_events.append(ev)

    thread_a = threading.Thread(target=run_a)
    thread_a.start()
    assert wait_until(lambda: engine.pool.decoding() == 1, timeout=60)
    b_events = b.run()
    for ev in b_events:  # B joined A's batch; then A's user presses Stop
        if isinstance(ev, MethodEvent) and ev.kind == "token":
            cancel_a.set()
            break
    for _ in b_events:
        pass
    thread_a.join(120)
    assert not thread_a.is_alive()
    assert {ev.method for ev in a_events if ev.kind == "cancelled"} >= {"full", "snapkv"}
    assert _texts(b) == second_alone
    assert engine.pool.decoding() == 0 and wait_until(lambda: engine.pool.nbytes() == 0, timeout=60)


def test_a_user_alone_never_waits_for_anyone(tiny_llama, noise_image):
    """The pool waits only for turns that decode: one user's steps (own prefills joining between them, a
    follow-up's input included) all start at once."""
    engine = Engine(tiny_llama)
    _alone(engine, noise_image, FIRST, 6, follow_up="and the colours?")
    assert engine.pool.steps > 6 and engine.pool.waited_out == 0


def test_the_caches_a_turn_leaves_are_read_only_once_moved_out_of_the_batch(tiny_llama, noise_image, monkeypatch):
    """A turn ends without waiting for its rows to move out of the batch's shared stores (the model's thread does
    that after it); its session's readers (bytes held, the overlay's map) wait for the move, so they never meet a
    cache half moved. The move is slowed here so that a reader that did not wait would come first."""
    moved, settling = [], threading.local()
    own_settle, own_storage = StepPool._settle, TrackedLayer.own_storage

    def slow_settle(pool):
        with pool._cond:
            leaving = bool(pool._leaving)
        if leaving:
            time.sleep(0.3)
        settling.on = True
        try:
            own_settle(pool)
        finally:
            settling.on = False

    def counted_own_storage(layer):
        own_storage(layer)
        if getattr(settling, "on", False):  # a move of a row that left (not one within a step)
            moved.append(layer)

    monkeypatch.setattr(StepPool, "_settle", slow_settle)
    monkeypatch.setattr(TrackedLayer, "own_storage", counted_own_storage)
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, FIRST[0], FIRST[1], 0.4, _settings(4))
    for _ in session.run():
        pass
    assert not moved  # the turn did not wait for the move
    assert session.cache_bytes() > 0
    after_read = len(moved)
    engine.worker.call(lambda: None, CHORE)  # everything the model's thread had to do
    assert after_read == len(moved) > 0
    moved.clear()
    for _ in session.follow_up("and the colours?"):
        pass
    assert session.kept_image_map("snapkv", 0) is not None
    after_read = len(moved)
    engine.worker.call(lambda: None, CHORE)
    assert after_read == len(moved) > 0


# -- through the app: several clients at once --------------------------------------------------------------

def test_clients_at_once_are_decoded_together_and_answer_as_alone(tiny_llama, serve_app, api_client,
                                                                   one_torch_thread):
    from prefixkv_core.limits import Limits

    url = serve_app(Engine(tiny_llama), max_new_tokens_limit=32,
                    limits=Limits(max_batch_users=2, cache_limit_bytes=None, memory_limit_bytes=None))
    ctl = serve_app.demos[-1].controller
    requests = [(None, f"user {i}: describe the picture", ["full", "snapkv", "h2o"][: 1 + i % 3], 0.3, 24)
                for i in range(3)]
    clients = [api_client(url) for _ in requests]
    alone = [clients[0].predict(*r, api_name="/compare")[-1]["methods"] for r in requests]
    assert ctl.engine.pool.shared_steps == 0
    ctl.engine.lock.acquire()  # the runs wait for the model until two of them are going: they overlap
    try:
        jobs = [client.submit(*r, api_name="/compare") for client, r in zip(clients, requests)]
        assert wait_until(lambda: ctl.registry.running() == 2, timeout=60)
    finally:
        ctl.engine.lock.release()
    together = [job.result(timeout=300)[-1]["methods"] for job in jobs]
    for got, want in zip(together, alone):
        assert {m: r["answers"] for m, r in got.items()} == {m: r["answers"] for m, r in want.items()}
        assert {r["status"] for r in got.values()} == {"done"}
    # two users at most went at once (the third waited in the queue), and their rows shared steps
    assert ctl.engine.pool.shared_steps > 0 and ctl.engine.pool.largest_batch <= 2 + 3
    assert wait_until(lambda: ctl.registry.running() == 0 and ctl.engine.pool.decoding() == 0, timeout=60)
    for client in clients:
        client.close()


def test_visitors_behind_others_are_told_their_place_and_then_see_their_own_run(tiny_llama, serve_app, api_client,
                                                                                 one_torch_thread):
    """Through the real server with one run at a time: while a visitor's run holds the model, the others wait in
    the queue and each is told its true place in line; once started, each one's stream reports its own run, and
    every answer is the one it gets alone."""
    from gradio_client.utils import Status

    from prefixkv_core.limits import Limits

    url = serve_app(Engine(tiny_llama), max_new_tokens_limit=32,
                    limits=Limits(max_batch_users=1, cache_limit_bytes=None, memory_limit_bytes=None))
    ctl = serve_app.demos[-1].controller
    requests = [(None, f"visitor {i}: describe the picture", ["full", "h2o"], 0.3, 8) for i in range(3)]
    clients = [api_client(url) for _ in requests]
    alone = [clients[0].predict(*r, api_name="/compare")[-1]["methods"] for r in requests]
    ctl.engine.lock.acquire()  # the first run starts and waits for the model: the others queue behind it
    try:
        jobs = [clients[0].submit(*requests[0], api_name="/compare")]
        assert wait_until(lambda: ctl.registry.running() == 1, timeout=60)
        for client, request in zip(clients[1:], requests[1:]):
            jobs.append(client.submit(*request, api_name="/compare"))
            assert wait_until(lambda: jobs[-1].status().code == Status.IN_QUEUE, timeout=60)
        places = [job.status() for job in jobs[1:]]
        assert [p.rank for p in places] == [0, 1]  # first and second in line
        assert ctl.registry.running() == 1  # nobody started beside the first run
    finally:
        ctl.engine.lock.release()
    for job, want in zip(jobs, alone):
        final = job.result(timeout=300)
        assert final[0].startswith("✓ Done")
        assert {m: r["answers"] for m, r in final[-1]["methods"].items()} == \
            {m: r["answers"] for m, r in want.items()}
        # every update of the stream is this visitor's own run: its prompt, never another visitor's
        prompts = {tuple(update[-1].get("prompts", ())) for update in job.outputs() if isinstance(update[-1], dict)}
        assert prompts <= {(), (final[-1]["prompts"][0],)}
    for client in clients:
        client.close()
