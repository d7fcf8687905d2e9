"""The model's one thread: jobs run there one at a time with the engine's lock held, steps before waiting
prefills, errors handed back to the caller, a job's own model calls run at once, and an idle thread ends."""
from __future__ import annotations

import threading
import time

import pytest

from prefixkv_core.session.model_worker import CHORE, PREFILL, STEP, ModelLock, ModelWorker
from prefixkv_core.testing import wait_until


def test_jobs_run_on_one_thread_with_the_lock_held_and_steps_go_first():
    lock = ModelLock()
    worker = ModelWorker(lock)
    threads, order = set(), []
    gate = threading.Event()

    def job(name):
        def run():
            assert lock.locked()
            threads.add(threading.current_thread().name)
            order.append(name)
            return name
        return run

    # the first job holds the thread while the others queue up
    first = threading.Thread(target=lambda: worker.call(lambda: gate.wait(10) and order.append("first"), PREFILL))
    first.start()
    assert wait_until(lambda: lock.locked(), timeout=10)
    waiting = [threading.Thread(target=worker.call, args=(job(name), priority))
               for name, priority in (("prefill-1", PREFILL), ("prefill-2", PREFILL), ("step", STEP))]
    for t in waiting:
        t.start()
        time.sleep(0.05)  # queued in this order
    worker.post(job("chore"))
    gate.set()
    for t in [first, *waiting]:
        t.join(10)
    assert wait_until(lambda: len(order) == 5, timeout=10)
    assert order == ["first", "step", "prefill-1", "prefill-2", "chore"]
    assert threads == {"prefixkv-model"} and not lock.locked()


def test_errors_reach_the_caller_and_a_job_may_call_the_model_again():
    worker = ModelWorker(ModelLock())
    with pytest.raises(ValueError, match="bad input"):
        worker.call(lambda: (_ for _ in ()).throw(ValueError("bad input")))
    assert worker.call(lambda: worker.call(lambda: 41) + 1) == 42  # nested: runs at once, no self-wait
    worker.post(lambda: 1 / 0)  # a failing chore is logged, the thread goes on
    assert worker.call(lambda: "still here", CHORE) == "still here"


def test_an_idle_thread_ends_and_the_next_job_starts_another():
    worker = ModelWorker(ModelLock(), idle_s=0.05)
    assert worker.call(threading.current_thread) is not threading.current_thread()
    assert wait_until(lambda: worker._thread is None, timeout=10)
    assert worker.call(lambda: 7) == 7


def test_a_caller_holding_the_engines_lock_runs_its_calls_itself():
    """Whoever holds the lock (to keep others off the model while it drives the engine's parts) is not made to wait
    for itself; others still wait for it."""
    lock = ModelLock()
    worker = ModelWorker(lock)
    with lock:
        assert worker.call(threading.current_thread) is threading.current_thread()
        other = threading.Thread(target=worker.call, args=(lambda: None,))
        other.start()
        other.join(0.2)
        assert other.is_alive()  # the model's thread waits for the lock
    other.join(10)
    assert not other.is_alive() and not lock.locked()


def test_stop_lets_the_running_job_finish_and_a_later_call_starts_again():
    worker = ModelWorker(ModelLock())
    gate, ran = threading.Event(), []
    running = threading.Thread(target=worker.call, args=(lambda: gate.wait(10) and ran.append("long"),))
    running.start()
    assert wait_until(lambda: worker.lock.locked(), timeout=10)
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    gate.set()
    stopper.join(10)
    running.join(10)
    assert ran == ["long"] and worker._thread is None
    assert worker.call(lambda: "again") == "again"


def test_a_job_run_early_by_another_runs_once_and_its_caller_gets_its_outcome():
    """`run_early`: a job on the model's thread runs a queued job at once (the shared prefill serving other turns);
    its caller wakes with that outcome, and the job is skipped when its own turn comes."""
    lock = ModelLock()
    worker = ModelWorker(lock)
    runs, later = [], []
    gate = threading.Event()
    # the first job holds the thread until the gate opens, then runs the queued one early
    first = worker.submit(lambda: (gate.wait(10), worker.run_early(later[0]), runs.append("first")), PREFILL)
    assert wait_until(lambda: lock.locked(), timeout=10)
    later.append(worker.submit(lambda: runs.append("queued") or "its result", PREFILL))
    queued = later[0]
    failing = worker.submit(lambda: 1 / 0, PREFILL)
    gate.set()
    assert worker.wait_for(queued) == "its result"
    worker.wait_for(first)
    with pytest.raises(ZeroDivisionError):
        worker.wait_for(failing)
    assert worker.call(lambda: "after", STEP) == "after"
    assert runs == ["queued", "first"]  # the queued job ran once, inside the first, before it ended
    worker.stop()
