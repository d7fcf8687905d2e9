"""The UI's stream worker hands the engine's events over in paced batches: the first event at once, the rest at
the pace, every event once the engine is done (before the final snapshot, which may be slow), then the end."""
import threading
import time

from ui.streaming import StreamWorker


def test_the_last_events_come_before_the_final_snapshot_and_the_end():
    snapshot_started = threading.Event()
    release_snapshot = threading.Event()
    calls = []

    def snapshot():
        calls.append("snapshot")
        snapshot_started.set()
        release_snapshot.wait(10)  # a slow final sample (the overlay's maps)
        return "maps"

    worker = StreamWorker(lambda cancel: iter(["first", "second", "last"]), threading.Event(), snapshot=snapshot,
                          snapshot_every=60.0).start()
    batches = worker.batches(interval=30.0)  # a pace far longer than the test
    first = next(batches)
    assert first.items == ["first"] and not first.settled and not first.ended
    t0 = time.monotonic()
    done = next(batches)  # not after the 30 s pace: the engine is done
    assert time.monotonic() - t0 < 10
    assert done.items == ["second", "last"] and done.settled and not done.ended
    assert snapshot_started.wait(10)
    release_snapshot.set()
    end = next(batches)
    assert end.items == ["maps"] and end.ended and calls == ["snapshot"]


def test_a_failed_run_is_settled_with_its_error():
    def failing(cancel):
        yield "token"
        raise RuntimeError("boom")

    worker = StreamWorker(failing, threading.Event()).start()
    batches = list(worker.batches(interval=0.01))
    settled = [b for b in batches if b.settled]
    assert len(settled) == 1 and "RuntimeError: boom" in settled[0].error and not settled[0].engine_error
    assert batches[-1].ended and sum(b.items.count("token") for b in batches) == 1
