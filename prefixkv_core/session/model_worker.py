"""The one thread that runs the model: every prefill and every batched step of every session is a job on it.

Why one thread, when each session already runs on its own: the model is used by one call at a time anyway, and a
process whose large tensors are allocated and freed on many threads keeps a heap (an allocator arena) per thread,
each as large as the biggest call it saw, so memory grows with the number of users. Jobs also get an order: a step
of the sessions decoding now goes before a waiting prefill, so between two new users' prefills the users already
decoding get a token.

While a job runs the engine's lock is held (tests hold it to keep the model busy; `locked()` says a call runs).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

STOP, STEP, PREFILL, CHORE = -1, 0, 1, 2  # job priorities: lower goes first
IDLE_S = 30.0  # the thread ends after this long without a job (a new one starts it again)


class ModelLock:
    """The engine's lock: held while the model runs a call. It knows the thread that holds it, so that a caller
    who holds it already (to keep others off the model while it drives the engine's parts itself) runs its calls
    at once instead of waiting for itself."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._owner = threading.get_ident()
        return got

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> "ModelLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class _Job:
    fn: Callable[[], Any]
    wait: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    started: bool = False  # run already (a job run early by another job is skipped when its turn comes)

    def run(self) -> None:
        """(On the model's thread, the lock held.)"""
        self.started = True
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.error = exc
            if not self.wait:
                log.exception("a model job failed")
        self.done.set()


class ModelWorker:
    """Runs jobs on its thread, one at a time, steps first (see the module docstring)."""

    def __init__(self, lock: ModelLock, idle_s: float = IDLE_S):
        self.lock = lock
        self.idle_s = idle_s
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # first come first served within a priority
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()
        # seconds the model's thread spent in jobs, and jobs run, by priority (STEP, PREFILL, CHORE): for benchmarks
        self.busy_s: dict[int, float] = {}
        self.jobs_run: dict[int, int] = {}

    def call(self, fn: Callable[[], Any], priority: int = PREFILL) -> Any:
        """fn() on the model's thread; returns its result or raises its exception. On that thread already (a job
        that needs another model call), or holding the engine's lock: runs it at once, here."""
        return self.wait_for(self.submit(fn, priority))

    def submit(self, fn: Callable[[], Any], priority: int = PREFILL) -> _Job:
        """fn() queued for the model's thread (see `call`); `wait_for` its outcome."""
        return self.enqueue(self.prepare(fn), priority)

    @staticmethod
    def prepare(fn: Callable[[], Any]) -> _Job:
        """A job not queued yet: another job may run it early (`run_early`) once it is, or even before."""
        return _Job(fn, wait=True)

    def enqueue(self, job: _Job, priority: int = PREFILL) -> _Job:
        """Queue a prepared job for the model's thread. On that thread already, or holding the engine's lock: run at
        once, here."""
        if job.started:
            return job
        if self.here():
            job.run()
            return job
        self._put(priority, job)
        return job

    def here(self) -> bool:
        """Whether this thread runs the model's calls now (the model's thread, or one holding the engine's lock)."""
        return threading.current_thread() is self._thread or self.lock.held_here()

    @staticmethod
    def wait_for(job: _Job) -> Any:
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def run_early(self, job: _Job) -> None:
        """From a job on the model's thread: run `job` now if it has not run (it is then skipped when its turn
        comes). The shared prefill's forward runs the turns it served at once, so that they decode together."""
        if not job.started:
            job.run()

    def post(self, fn: Callable[[], Any]) -> None:
        """fn() on the model's thread after the waiting steps and prefills; nobody waits for it (errors logged)."""
        self._put(CHORE, _Job(fn, wait=False))

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread after the job it runs; the jobs still waiting are dropped (a caller waiting for one gets an
        error). A later call starts the thread again."""
        with self._starting:
            thread = self._thread
            if thread is None:
                return
            while not self._jobs.empty():
                _, _, job = self._jobs.get_nowait()
                job.error = RuntimeError("the model's thread stopped before this call ran")
                job.done.set()
            self._jobs.put((STOP, next(self._order), _Job(None, wait=False)))
        thread.join(timeout)

    def _put(self, priority: int, job: _Job) -> None:
        with self._starting:
            self._jobs.put((priority, next(self._order), job))
            if self._thread is None:
                self._start()

    def _start(self) -> None:
        """(With `_starting` held.)"""
        self._thread = threading.Thread(target=self._loop, name="prefixkv-model", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def _loop(self) -> None:
        while True:
            try:
                priority, _, job = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                job = None
            if job is None or job.fn is None:  # idle, or stopped
                with self._starting:
                    if job is None and not self._jobs.empty():
                        continue
                    self._thread = None
                    if not self._jobs.empty():  # put while this thread was stopping: a new one takes them
                        self._start()
                    return
            if job.started:  # run early by another job
                continue
            with self.lock:
                t0 = time.perf_counter()
                job.run()
                self.busy_s[priority] = self.busy_s.get(priority, 0.0) + time.perf_counter() - t0
                self.jobs_run[priority] = self.jobs_run.get(priority, 0) + 1


_RUNNING: "weakref.WeakSet[ModelWorker]" = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    """At exit, let each model thread finish the job it runs: a thread cut off inside the model's native code while
    the interpreter shuts down aborts the process."""
    for worker in list(_RUNNING):
        worker.stop()
