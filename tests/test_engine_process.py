"""The engine in a process of its own (`EngineProcess`): its sessions answer as the engine in this process does, their
records are fed while they stream, a stop and a closed stream reach the child, bad input keeps its message, and a
child that dies or cannot load its model fails every call with a message instead of hanging."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from PIL import Image

from prefixkv_core import Engine, EngineError, EngineProcess, EngineProcessError, GenerationSettings, load_model
from prefixkv_core.models import ModelLoadError
from prefixkv_core.report.events import KeptImageMap, MethodEvent, PrefillInfo
from prefixkv_core.testing import wait_until

METHODS = ["full", "snapkv", "h2o", "fastv"]
PROMPT = "describe the picture in detail"


@pytest.fixture(scope="module")
def remote():
    engine = EngineProcess("tiny-llama", threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def local():
    return Engine(load_model("tiny-llama"))


@pytest.fixture(scope="module")
def second_image():
    rng = np.random.RandomState(3)
    return Image.fromarray((rng.rand(40, 40, 3) * 255).astype("uint8"))


def _settings(n: int = 5) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, ignore_eos=True)


def _conversation(engine, image, extra_image, **kwargs) -> tuple[list, list, object]:
    session = engine.new_session(image, PROMPT, METHODS, 0.4, _settings(), **kwargs)
    first = list(session.run())
    second = list(session.follow_up("and the colours?", image=extra_image))
    return first, second, session


def _kept(session) -> dict:
    return {m: [list(t.last.kept_per_layer) if t.last is not None else None for t in track.turns]
            for m, track in session.record.tracks.items()}


@pytest.mark.parametrize("query_agnostic", [False, True])
def test_a_remote_conversation_answers_as_the_engine_here(remote, local, noise_image, second_image, query_agnostic):
    """Both turns (the follow-up adds an image): every event, answer, kept entry and the importance chart equal the
    same conversation with the engine in this process."""
    there = _conversation(remote, noise_image, second_image, query_agnostic=query_agnostic)
    here = _conversation(local, noise_image, second_image, query_agnostic=query_agnostic)
    for turn in (0, 1):
        kinds_there = [(e.method, e.kind, e.step) for e in there[turn] if isinstance(e, MethodEvent)]
        kinds_here = [(e.method, e.kind, e.step) for e in here[turn] if isinstance(e, MethodEvent)]
        assert kinds_there == kinds_here
    assert there[2].results().keys() == here[2].results().keys()
    assert {m: r["text"] for m, r in there[2].results().items()} == {m: r["text"] for m, r in here[2].results().items()}
    assert _kept(there[2]) == _kept(here[2])
    prefill_there = next(e for e in there[0] if isinstance(e, PrefillInfo))
    prefill_here = next(e for e in here[0] if isinstance(e, PrefillInfo))
    np.testing.assert_allclose(prefill_there.importance, prefill_here.importance, rtol=1e-5, atol=1e-6)
    assert there[2].record.prompts == here[2].record.prompts == [PROMPT, "and the colours?"]
    assert there[2].visuals.describe() == here[2].visuals.describe()


def test_the_record_is_fed_while_the_turn_streams(remote, noise_image):
    session = remote.new_session(noise_image, PROMPT, ["full", "h2o"], 0.4, _settings(6))
    seen = []
    for event in session.run():
        if isinstance(event, MethodEvent) and event.kind == "token":
            track = session.record.tracks[event.method]
            seen.append(track.turns[-1].answer == event.text)
            assert session.record.active
    assert seen and all(seen)
    assert not session.record.active


def test_a_stop_reaches_the_child_within_a_token(remote, noise_image):
    session = remote.new_session(noise_image, PROMPT, ["full", "h2o"], 0.4, _settings(400))
    cancel = threading.Event()
    tokens = 0
    for event in session.run(cancel):
        if isinstance(event, MethodEvent) and event.kind == "token":
            tokens += 1
            cancel.set()
    # far fewer than the 800 asked: the child stopped (the tokens it streamed while the stop crossed the pipe are
    # a handful on an idle machine, a few dozen when every core is busy)
    assert tokens < 120
    assert {r["status"] for r in session.results().values()} == {"stopped"}
    assert len(list(session.follow_up("and then?", ))) > 0  # the conversation goes on


def test_a_stream_closed_early_stops_the_childs_turn(remote, noise_image):
    session = remote.new_session(noise_image, PROMPT, ["full", "h2o"], 0.4, _settings(400))
    events = session.run()
    next(events)
    events.close()  # a tab closed mid-run
    maps, follow = [], []
    for event in session.follow_up("and then?"):  # waits for the child's turn to stop, not for 400 tokens
        follow.append(event)
        if len(follow) == 3:  # the overlay reads the caches of the turn that took over: served, never left waiting
            worker = threading.Thread(target=lambda: maps.append(session.kept_image_map("h2o", 0)))
            worker.start()
            worker.join(30)
    assert any(isinstance(e, MethodEvent) and e.kind == "done" for e in follow)
    assert maps and isinstance(maps[0], KeptImageMap)


@pytest.mark.parametrize("call,message", [
    (lambda e, im: e.new_session(im, "  ", ["full"], 0.4), "the prompt is empty"),
    (lambda e, im: e.new_session(im, PROMPT, ["full", "nope"], 0.4), "nope"),
    (lambda e, im: e.new_session(im, PROMPT, ["full"], 1.5), "budget"),
    (lambda e, im: list(e.new_session(im, PROMPT, ["full"], 0.4).follow_up("and?")), r"run\(\) the first turn"),
])
def test_bad_input_raises_the_engines_message_here(remote, noise_image, call, message):
    with pytest.raises(EngineError, match=message):
        call(remote, noise_image)
    assert remote.alive


def test_bytes_held_the_overlay_during_a_run_and_release(remote, noise_image):
    session = remote.new_session(noise_image, PROMPT, ["full", "snapkv"], 0.4, _settings(8))
    maps = []
    for event in session.run():
        if isinstance(event, MethodEvent) and event.kind == "token" and not maps:
            # the overlay samples from another thread while the turn runs: served between two of its events
            worker = threading.Thread(target=lambda: maps.append(session.kept_image_map("snapkv", 0)))
            worker.start()
            worker.join(30)
    assert maps and isinstance(maps[0], KeptImageMap)
    both = session.kept_image_maps(["full", "snapkv"], 0)  # the overlay's sample: every method in one call
    assert set(both) == {"full", "snapkv"} and all(isinstance(m, KeptImageMap) for m in both.values())
    assert session.cache_bytes() > 0
    session.release()
    assert session.released and session.cache_bytes() == 0
    with pytest.raises(EngineError, match="released"):
        list(session.follow_up("and the colours?"))


def test_memory_counts_both_processes(remote):
    from prefixkv_core.limits import process_memory_bytes

    assert remote.memory_bytes() > process_memory_bytes()
    assert remote.loaded.num_layers == load_model("tiny-llama").num_layers
    assert remote.loaded.param_count() == load_model("tiny-llama").param_count()


def test_a_dead_engine_process_fails_its_calls_and_runs_with_a_message(noise_image):
    """Its running turn and calls fail with a message, never hang; it is started again (the old sessions say they
    are gone, new ones answer), or with restarts off stays down and says so."""
    def killed_mid_turn():  # a turn under way when the child is killed fails with a message
        session = engine.new_session(noise_image, PROMPT, ["full"], 0.4, _settings(2000))
        events = session.run()
        next(events)
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match="engine process stopped"):
            for _ in events:
                pass
        return session

    engine = EngineProcess("tiny-llama", threads=1, restart=True)
    try:
        session = killed_mid_turn()
        wait_until(lambda: engine.alive and engine.generation == 1, timeout=120)
        assert engine.restarts == 1
        with pytest.raises(EngineProcessError, match="started again"):
            list(session.follow_up("and then?"))
        assert session.cache_bytes() == 0
        fresh = engine.new_session(noise_image, PROMPT, ["full"], 0.4, _settings(3))
        assert any(isinstance(e, MethodEvent) and e.kind == "done" for e in fresh.run())
        assert fresh.results()["full"]["status"] == "done" and fresh.cache_bytes() > 0

        engine.restart = False  # restarts off: the next death is final
        killed_mid_turn()
        with pytest.raises(EngineProcessError, match="engine process stopped"):
            engine.new_session(noise_image, PROMPT, ["full"], 0.4)
        assert engine.restarts == 1 and not engine.alive
    finally:
        engine.close()


def test_a_model_that_does_not_load_says_why():
    with pytest.raises(ModelLoadError, match="no-such"):
        EngineProcess("/no-such/model-dir")


def test_the_app_served_over_an_engine_process(remote, noise_image, serve_app, api_client, tmp_path):
    """The app takes an EngineProcess as it takes an Engine: a comparison through its API answers as the engine."""
    path = tmp_path / "noise.png"
    noise_image.save(path)
    from gradio_client import handle_file

    url = serve_app(remote, methods="full,h2o")
    final = api_client(url).predict(handle_file(str(path)), PROMPT, ["full", "h2o"], 0.4, 4, api_name="/compare")
    results = final[-1]
    session = remote.new_session(Engine.load_image(str(path)), PROMPT, ["full", "h2o"], 0.4,
                                 GenerationSettings(max_new_tokens=4))
    list(session.run())
    assert results["finished"]
    assert {m: r["text"] for m, r in results["methods"].items()} == {m: r["text"] for m, r in session.results().items()}


def test_the_clients_marks_on_earlier_turns_stay_and_gone_stand_ins_free_their_sessions(remote, noise_image):
    """The record taken from the child at a turn's end keeps what the client wrote: the request's error and an
    earlier turn it marked (the app marks a stopped or failed turn itself). A stand-in garbage-collected here lets
    the child drop its session."""
    import gc

    held = remote.stats()["sessions"]
    session = remote.new_session(noise_image, PROMPT, ["full", "h2o"], 0.4, _settings(3))
    list(session.run())
    assert remote.stats()["sessions"] == held + 1
    session.record.tracks["h2o"].turns[0].status = "stopped"
    session.record.error = "the client's own note"
    list(session.follow_up("and then?"))
    assert session.record.tracks["h2o"].turns[0].status == "stopped"
    assert session.record.tracks["h2o"].turns[1].status == "done"
    assert session.record.error == "the client's own note"
    del session
    gc.collect()
    assert wait_until(lambda: remote.stats()["sessions"] == held, timeout=30)


def test_a_ctrl_c_at_the_server_does_not_reach_the_engine_process(remote):
    """The child has a session of its own: the terminal's signals go to the server, which then stops the child
    (a child that died of the server's Ctrl-C would be started again while the server exits)."""
    assert os.getsid(remote.process.pid) != os.getsid(0)


def test_the_calls_the_child_answers_are_the_wire_s_list(remote, local):
    """The engine process answers exactly `wire.CALLS` (one place lists them), and a call outside it fails here
    with a message before anything is sent."""
    from prefixkv_core.session import wire
    from prefixkv_core.session.engine_process import _Child

    assert set(_Child(None, local).handlers()) == set(wire.CALLS)
    with pytest.raises(ValueError, match="no call 'unheard_of'"):
        remote._call("unheard_of", (), {})
    with pytest.raises(ValueError, match="a turn is one of"):
        wire.Run(1, 2, "rerun")
    assert remote.stats()["sessions"] >= 0  # the wire still answers
