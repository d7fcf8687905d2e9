"""Run an engine generator on its own thread and hand its events to the UI in throttled batches.

Why a thread: the Gradio handler must stay responsive to being closed (Stop, Clear, a closed tab) while a
decoding step runs, and it should render at a steady pace however fast tokens come. The worker owns the
engine session while it runs; the UI only reads the events it queues. Whatever ends the UI side (closing,
an exception, the consumer going silent), the cancel event is set and the engine stops within one token,
releasing the model lock.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prefixkv_core import EngineError

log = logging.getLogger(__name__)


@dataclass
class Batch:
    items: list[Any]
    ended: bool = False
    error: str | None = None  # a user-facing message when the run failed as a whole
    engine_error: bool = False  # the failure was bad input (EngineError), not a crash
    settled: bool = False  # the engine's events are all in; only the final snapshot and the end are to come


class StreamWorker:
    """`factory(cancel)` returns the engine iterator; `snapshot()` (optional) runs on the worker thread
    every `snapshot_every` seconds and once at the end, and its result is queued like an event."""

    def __init__(self, factory: Callable[[threading.Event], Iterator[Any]], cancel: threading.Event,
                 snapshot: Callable[[], Any] | None = None, snapshot_every: float = 1.5,
                 stale_after: float = 30.0):
        self.factory = factory
        self.cancel = cancel
        self.snapshot = snapshot
        self.snapshot_every = snapshot_every
        self.stale_after = stale_after
        self.queue: queue.Queue = queue.Queue()
        self.last_pull = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="prefixkv-run", daemon=True)

    def start(self) -> "StreamWorker":
        self.thread.start()
        return self

    def _snap(self) -> None:
        if self.snapshot is None:
            return
        try:
            item = self.snapshot()
        except Exception:  # a snapshot is a nicety; never let it stop the run
            log.exception("overlay snapshot failed")
            return
        if item is not None:
            self.queue.put(("item", item))

    def _run(self) -> None:
        gen = None
        try:
            gen = self.factory(self.cancel)
            next_snap = time.monotonic() + self.snapshot_every
            for item in gen:
                self.queue.put(("item", item))
                now = time.monotonic()
                if now >= next_snap:
                    self._snap()
                    next_snap = now + self.snapshot_every
                if now - self.last_pull > self.stale_after and not self.cancel.is_set():
                    log.warning("nobody reads this run any more (tab closed?): cancelling it")
                    self.cancel.set()
        except EngineError as exc:
            self.queue.put(("engine_error", str(exc)))
        except Exception as exc:  # unexpected: log the traceback, tell the user one line
            log.exception("run failed")
            self.queue.put(("crash", f"{exc.__class__.__name__}: {str(exc)[:300]}"))
        finally:
            if gen is not None:
                try:
                    gen.close()
                except Exception:
                    log.exception("closing the engine generator failed")
            self.queue.put(("settled", None))  # the answers can be shown before the final snapshot is taken
            self._snap()
            self.queue.put(("end", None))

    def batches(self, interval: float | Callable[[], float] = 0.2) -> Iterator[Batch]:
        """Everything queued so far, at most every `interval` seconds (a number, or a function asked before each
        batch: the pace may change with the load); sooner only for the first event, once the engine's events are
        all in (settled=True: the final snapshot is still to come) and the end. The last batch has ended=True."""
        first = True
        while True:
            self.last_pull = time.monotonic()
            deadline = self.last_pull + (interval() if callable(interval) else interval)
            items, ended, error, engine_error, settled = [], False, None, False, False
            while True:
                timeout = deadline - time.monotonic()
                try:
                    kind, payload = self.queue.get(timeout=max(0.0, timeout)) if timeout > 0 else \
                        self.queue.get_nowait()
                except queue.Empty:
                    break
                if kind == "item":
                    items.append(payload)
                    if first:
                        break
                elif kind == "end":
                    ended = True
                    break
                elif kind == "settled":
                    settled = True
                    break
                else:
                    error, engine_error = payload, kind == "engine_error"
            if items:
                first = False
            yield Batch(items, ended, error, engine_error, settled)
            if ended:
                return

    def stop(self, wait: float = 0.0) -> None:
        self.cancel.set()
        if wait:
            self.thread.join(wait)
