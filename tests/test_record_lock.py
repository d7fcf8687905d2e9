"""One record per run, fed by the engine on the thread that runs the session while the app redraws from it on
others: a reader holding `record.lock` always sees a consistent record."""
import sys
import threading

import pytest

from prefixkv_core import Engine, GenerationSettings

METHODS = ["full", "h2o", "snapkv", "prefixkv"]


def consistent(record) -> list[str]:
    """What a redraw would find wrong: series whose parallel lists differ in length, turn figures that disagree
    with their own latencies, a summary that cannot be built."""
    problems = []
    for name, track in record.tracks.items():
        for series in (track.series, track.alone_series):
            if series is None:
                continue
            lengths = {len(series.steps), len(series.kv_bytes), len(series.full_kv_bytes), len(series.latency_s),
                       len(series.policy_s), len(series.turn)}
            if len(lengths) != 1:
                problems.append(f"{name}: series lists of lengths {sorted(lengths)}")
        for turn in track.turns:
            if turn.decode_steps != len(turn.latency_s):
                problems.append(f"{name}: {turn.decode_steps} decode steps, {len(turn.latency_s)} latencies")
    record.to_dict()  # raises if the record changes under it
    return problems


@pytest.fixture
def fast_switching():
    """Threads switch as often as the interpreter allows, so a reader lands inside a write if it can."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def test_readers_holding_the_lock_see_a_consistent_record_during_a_run(tiny_llama, noise_image, fast_switching):
    session = Engine(tiny_llama).new_session(noise_image, "Describe the image.", METHODS, budget=0.3,
                                             generation=GenerationSettings(max_new_tokens=16, ignore_eos=True),
                                             time_alone=True)
    record = session.record
    done = threading.Event()
    found: list[str] = []
    reads = [0]

    def redraw():
        while not done.is_set():
            with record.lock:
                try:
                    found.extend(consistent(record))
                except RuntimeError as exc:  # e.g. a dict changed size while it was read
                    found.append(repr(exc))
            reads[0] += 1

    readers = [threading.Thread(target=redraw) for _ in range(4)]
    for t in readers:
        t.start()
    try:
        for follow_up in (None, "And the colours?"):
            events = session.run() if follow_up is None else session.follow_up(follow_up)
            for _ in events:
                pass
    finally:
        done.set()
        for t in readers:
            t.join()
    assert not found, found[:5]
    assert reads[0] > 50  # the readers really ran alongside the engine
    summary = record.to_dict()
    assert summary["turn"] == 2 and summary["finished"]
    for name in METHODS:  # every token of both turns, batched and alone, reached the one record
        track = record.tracks[name]
        assert len(track.series.steps) == 32 and len(track.alone_series.steps) == 32
        assert summary["methods"][name]["alone"]["same_answer"] is True
