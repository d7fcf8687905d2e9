"""The engine in a process of its own: the model, its thread and every session live in a child process, and this
process holds stand-ins that stream the same events.

Why: a server streams several visitors' runs from Python threads (redraws, serialising updates) that share one
interpreter with the model's thread. Every operator the model runs must take the interpreter back between its
kernels, so the server's work stretches each decode step (measured: four visitors' one-word answers 1.75x slower
with a thread burning half of the interpreter's time, 1.12x with the same work in another process at a lower
priority). In a process of its own the model's thread competes for cores only, and the server can step aside.

    engine = EngineProcess("embedded")          # loads the model in the child; `engine.loaded` describes it here
    session = engine.new_session(image, "Describe the image.", ["full", "prefixkv"], budget=0.3)
    for event in session.run():                 # the child's PrefillInfo and MethodEvents, as they come
        ...

`RemoteSession` answers what a `Session` answers that a client reads: its record (fed here from the streamed
events, and made equal to the child's at the end of every turn), its visuals, `run`, `follow_up`, `cache_bytes`,
`kept_image_map`, `results`, `release`. A stop (`cancel` set) reaches the child within one poll (50 ms), the child's
engine stops within a token. Bad input raises EngineError here with the child's message. A child that dies (the
system's out-of-memory killer, a crash in native code) ends every waiting call and run with EngineProcessError and is
started again (at most MAX_RESTARTS times); the sessions it held are lost and say so. `loaded` here holds the
processor and the config, not the weights (`ModelOutline`), so limits, token counts and descriptions work as with the
model in this process.

The child's memory counts in `memory_bytes()`: both processes' resident sizes. What the two processes say to each
other, and the calls the child answers: `wire.py`.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from ..errors import EngineError
from ..limits import peak_memory_bytes, return_free_memory
from . import wire

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a run's consumer looks at its Stop flag while it waits for the child's next event
START_TIMEOUT_S = 600.0  # loading a model from disk may take minutes; longer means the child hangs
CALL_WORKERS = 8  # the child's threads for calls (bytes held, the overlay's map, new sessions)
# an overlay sample waits this long for a running turn's next event (its caches are consistent between two), then is
# skipped: the page keeps the previous sample, and the client's stream is not held up by a turn waiting for the model
SAMPLE_WAIT_S = 0.05


class EngineProcessError(EngineError):
    """The engine's process failed (it died, or its model did not load)."""


@dataclasses.dataclass
class ModelOutline:
    """What a client reads of the model without holding its weights: the config, the generation config and the
    parameter count (as `parameters()` of meta tensors, which hold no memory)."""

    config: Any
    generation_config: Any
    n_parameters: int

    def parameters(self):
        import torch

        return iter([torch.empty(self.n_parameters, device="meta")])


# -- the child ------------------------------------------------------------------------------------------------
class _Child:
    """The child's side: the engine, its sessions by id, and the threads that run their turns and answer calls."""

    def __init__(self, conn, engine):
        self.conn = conn
        self.engine = engine
        self.sessions: dict[int, Any] = {}
        self.ids = itertools.count(1)
        self.send_lock = threading.Lock()
        self.calls = ThreadPoolExecutor(CALL_WORKERS, thread_name_prefix="prefixkv-engine-call")
        self.cancels: dict[int, threading.Event] = {}  # run id -> its Stop flag
        # a session whose turn runs: calls that read its caches run on the turn's thread between two events
        # (the caches are consistent there, as in a single process), queued here with the run that serves them
        self.between: dict[int, tuple[int, queue.SimpleQueue]] = {}
        self.between_lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self.send_lock:
            self.conn.send(message)

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            if isinstance(message, wire.Stop):
                return
            if isinstance(message, wire.Call):
                self.calls.submit(self._call, message)
            elif isinstance(message, wire.Run):
                self.cancels[message.rid] = threading.Event()  # before its thread starts: a stop may come next
                threading.Thread(target=self._turn, args=(message,), name="prefixkv-engine-turn",
                                 daemon=True).start()
            elif isinstance(message, wire.Cancel):
                event = self.cancels.get(message.rid)
                if event is not None:
                    event.set()

    # calls
    def _call(self, call: wire.Call) -> None:
        try:
            value = self.handlers()[call.name](*call.args, **call.kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.send(wire.Reply(call.cid, False, _portable(exc)))
            return
        try:
            self.send(wire.Reply(call.cid, True, value))
        except Exception as exc:  # noqa: BLE001 - an answer that cannot be sent: the caller must not wait for it
            log.exception("an answer of the engine process could not be sent")
            self.send(wire.Reply(call.cid, False, _portable(exc)))

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """What answers each of `wire.CALLS`."""
        return {"new_session": self._new_session, "analyse": self.engine.analyse, "stats": self._stats,
                "memory": self._memory, "forget": self._forget, "release": self._release,
                "cache_bytes": lambda sid: self._held(sid).cache_bytes(),
                "results": lambda sid: self._held(sid).results(),
                "kept_image_map": self._kept_image_map, "kept_image_maps": self._kept_image_maps}

    def _new_session(self, *args, **kwargs):
        session = self.engine.new_session(*args, **kwargs)
        sid = next(self.ids)
        self.sessions[sid] = session
        return sid, session.visuals, session.record

    def _stats(self) -> dict[str, Any]:
        return {**_engine_stats(self.engine), "sessions": len(self.sessions)}

    @staticmethod
    def _memory() -> int | None:
        from ..limits import process_memory_bytes

        return process_memory_bytes()

    def _held(self, sid: int):
        session = self.sessions.get(sid)
        if session is None:
            raise EngineError("this comparison is no longer held by the engine; run Compare again")
        return session

    def _forget(self, sid: int) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.release()
            return_free_memory()  # the memory ceiling reads this process's resident size

    def _release(self, sid: int) -> None:
        self._held(sid).release()
        return_free_memory()  # as the app does after a release in one process

    def _kept_image_map(self, sid: int, *args):
        session = self._held(sid)
        return self._between_events(sid, lambda: session.kept_image_map(*args))

    def _kept_image_maps(self, sid: int, *args):
        """The overlay's sample: skipped (None) while the turn waits for the model."""
        session = self._held(sid)
        return self._between_events(sid, lambda: session.kept_image_maps(*args), wait_s=SAMPLE_WAIT_S)

    def _between_events(self, sid: int, fn, wait_s: float | None = None):
        """fn() on the thread of the session's running turn, between two of its events; at once when none runs.
        `wait_s`: give up (return None) when the turn brings no event that soon (it waits for the model)."""
        with self.between_lock:
            running = self.between.get(sid)
            if running is None:
                return fn()
            job = _Between(fn)
            running[1].put(job)
        if not job.done.wait(wait_s) and job.withdraw():
            return None
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value

    def _run_waiting(self, sid: int, rid: int, last: bool = False) -> None:
        with self.between_lock:
            running = self.between.get(sid)
            if running is None or running[0] != rid:  # a later turn of the session took over (this one was left)
                return
            waiting = running[1]
            if last:
                self.between.pop(sid, None)
        while True:
            try:
                job = waiting.get_nowait()
            except queue.Empty:
                return
            job.run()

    # turns
    def _turn(self, turn: wire.Run) -> None:
        sid, rid = turn.sid, turn.rid
        cancel = self.cancels.setdefault(rid, threading.Event())
        session = self.sessions.get(sid)
        error = None
        with self.between_lock:  # this turn serves the session's calls from now (a turn left early hands them on)
            earlier = self.between.get(sid)
            self.between[sid] = (rid, earlier[1] if earlier is not None else queue.SimpleQueue())
        try:
            if session is None:
                raise EngineError("this comparison is no longer held by the engine; run Compare again")
            events = session.run(cancel) if turn.kind == "run" else \
                session.follow_up(turn.prompt, cancel, image=turn.image)
            for item in events:
                self.send(wire.Event(rid, item))
                self._run_waiting(sid, rid)
        except BaseException as exc:  # noqa: BLE001 - handed to the run's consumer
            if not isinstance(exc, EngineError):
                log.exception("a turn failed in the engine process")
            error = _portable(exc)
        finally:
            self._run_waiting(sid, rid, last=True)
            self.cancels.pop(rid, None)
        record = session.record if session is not None else None
        try:
            self.send(wire.End(rid, error, record))
        except Exception as exc:  # noqa: BLE001 - the consumer must still learn that the turn ended
            log.exception("the end of a turn could not be sent whole")
            self.send(wire.End(rid, error or _portable(exc), None))


class _Between:
    """A call queued for the thread of a running turn; withdrawn if it waits too long."""

    def __init__(self, fn):
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self._state = "waiting"
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:
            if self._state != "waiting":
                return
            self._state = "running"
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self.error = exc
        self.done.set()

    def withdraw(self) -> bool:
        with self._lock:
            if self._state == "waiting":
                self._state = "withdrawn"
                return True
            return False


def _portable(exc: BaseException) -> BaseException:
    """The exception as the parent can raise it: EngineError keeps its message; anything else becomes one line."""
    if isinstance(exc, EngineError):
        return EngineError(str(exc))
    return RuntimeError(f"{exc.__class__.__name__}: {str(exc)[:300]}")


def _engine_stats(engine) -> dict[str, Any]:
    pool, worker = engine.pool, engine.worker
    return {"steps": pool.steps, "shared_steps": pool.shared_steps, "formed": pool.formed,
            "waited_out": pool.waited_out, "largest_batch": pool.largest_batch,
            "prefill_forwards": dict(engine.prefills.forwards), "model_busy_s": dict(worker.busy_s),
            "model_jobs": dict(worker.jobs_run), "peak_resident_bytes": peak_memory_bytes()}


def child_main(conn, model: str, device: str, dtype: str, threads: int | None, loader: str | None = None) -> None:
    """The child process: load the model, say what it is, then serve until the parent stops it or goes."""
    try:
        import importlib

        import torch

        if threads:
            torch.set_num_threads(int(threads))
        from ..models import load_model
        from .engine import Engine

        if loader:
            module, _, name = loader.partition(":")
            load_model = getattr(importlib.import_module(module), name)
        loaded = load_model(model, device=device, dtype=dtype)
        engine = Engine(loaded)
        outline = ModelOutline(loaded.model.config, getattr(loaded.model, "generation_config", None),
                               loaded.param_count())
        conn.send(wire.Ready(dataclasses.replace(loaded, model=outline)))
    except BaseException as exc:  # noqa: BLE001 - told to the parent, which raises it
        from ..models import ModelLoadError

        conn.send(wire.Failed(str(exc) if isinstance(exc, ModelLoadError) else f"{exc.__class__.__name__}: {exc}"))
        return
    _Child(conn, engine).serve()
    engine.worker.stop()


# -- this process -----------------------------------------------------------------------------------------------
MAX_RESTARTS = 3  # a child that keeps dying is not started again after this many times


def _launch(model: str, device: str, dtype: str, threads: int | None, loader: str | None, start_timeout_s: float):
    """Start the child and wait for its model: (process, connection, the model's outline). Raises ModelLoadError
    with the child's reason, or EngineProcessError if it stops or hangs while loading."""
    # a fresh interpreter (no copy of this process's threads or locks), started as a module so that no script's
    # main is imported again; the two talk over a socket pair
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    spec = json.dumps({"model": model, "device": device, "dtype": dtype, "threads": threads, "loader": loader})
    command = [sys.executable, "-m", f"{__package__}.engine_child", str(theirs.fileno()), spec]
    # its own session: a Ctrl-C meant for the server reaches the server only, which then stops the child itself
    process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env, start_new_session=True)
    theirs.close()
    conn = Connection(ours.detach())
    if not conn.poll(start_timeout_s):
        process.kill()
        raise EngineProcessError(f"the engine process did not load {model!r} within {start_timeout_s:.0f} s")
    try:
        message = conn.recv()
    except (EOFError, OSError):
        raise EngineProcessError(f"the engine process stopped while loading {model!r}") from None
    if isinstance(message, wire.Failed):
        process.wait(10)
        from ..models import ModelLoadError

        raise ModelLoadError(message.reason)
    return process, conn, message.loaded


class EngineProcess:
    """The engine of `model` (as `load_model` takes it) in a child process. Holds `loaded` (the model's description
    without its weights) and makes `RemoteSession`s. `threads`: the child's torch threads (default torch's).
    `loader`: "module:function" called as `function(model, device=..., dtype=...)` in the child instead of
    `load_model` (a model built in code, e.g. random weights in a released shape for benchmarks)."""

    def __init__(self, model: str = "embedded", *, device: str = "auto", dtype: str = "auto",
                 threads: int | None = None, loader: str | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 restart: bool = True):
        self._spec = (model, device, dtype, threads, loader, start_timeout_s)
        self.restart = restart  # a child that dies is started again (its sessions are lost), up to MAX_RESTARTS
        self.restarts = 0
        self._closing = False
        self._send_lock = threading.Lock()
        self._forgotten: collections.deque[int] = collections.deque()  # sessions to let go of in the child
        self._ids = itertools.count(1)
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._runs: dict[int, queue.SimpleQueue] = {}  # run id -> the turn's events, then its end, as they come
        self._state_lock = threading.Lock()
        self._dead: str | None = None
        self.generation = 0  # which child this is: a session belongs to the child that made it
        self.process, self._conn, self.loaded = _launch(*self._spec)
        self._start_reader()
        atexit.register(self.close)

    def _start_reader(self) -> None:
        threading.Thread(target=self._read, args=(self._conn, self.generation), name="prefixkv-engine-reader",
                         daemon=True).start()

    # -- what an Engine answers ------------------------------------------------------------------------------
    @staticmethod
    def load_image(image: Any, **kwargs):
        from .image_input import load_image

        return load_image(image, **kwargs)

    def new_session(self, image: Any, prompt: str, *args, **kwargs) -> "RemoteSession":
        """As `Engine.new_session` (the same arguments); the session lives in the child."""
        sid, visuals, record = self._call("new_session", (image, prompt, *args), kwargs)
        return RemoteSession(self, sid, visuals, record)

    def analyse(self, image: Any, prompt: str):
        return self._call("analyse", (image, prompt), {})

    def stats(self) -> dict[str, Any]:
        """The child engine's batching counters (steps, shared steps, prefill forwards by rows), its model thread's
        busy seconds and jobs by priority, the sessions it holds and the child's peak resident memory: for benchmarks
        and tests."""
        return self._call("stats", (), {})

    def memory_bytes(self) -> int | None:
        """Resident memory of this process and the engine's together."""
        from ..limits import process_memory_bytes

        here = process_memory_bytes()
        try:
            there = self._call("memory", (), {})
        except EngineError:
            there = None
        return None if here is None else here + (there or 0)

    @property
    def alive(self) -> bool:
        return self._dead is None and self.process.poll() is None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (its sessions go with it)."""
        self._closing = True
        if self.process.poll() is None:
            try:
                with self._send_lock:
                    self._conn.send(wire.Stop())
            except (OSError, ValueError):
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self._fail_all("the engine process was closed")

    # -- the wire --------------------------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        try:
            with self._send_lock:
                while self._forgotten:  # sessions whose stand-ins went: nobody waits for these replies
                    self._conn.send(wire.Call(0, "forget", (self._forgotten.popleft(),)))
                self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise EngineProcessError(f"the engine process cannot be reached ({exc.__class__.__name__})") from None

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        cid = next(self._ids)
        call = wire.Call(cid, name, args, kwargs)  # an unknown name fails here, before anything is sent
        done, box = threading.Event(), []
        with self._state_lock:
            self._replies[cid] = (done, box)
        try:
            self._send(call)
            while not done.wait(1.0):
                if self._dead is not None:
                    raise EngineProcessError(self._dead)
        finally:
            with self._state_lock:
                self._replies.pop(cid, None)
        ok, value = box
        if not ok:
            raise value
        return value

    def _start_run(self, sid: int, kind: str, prompt: str | None, image: Any) -> tuple[int, queue.SimpleQueue]:
        rid = next(self._ids)
        run = queue.SimpleQueue()
        with self._state_lock:
            self._runs[rid] = run
        try:
            self._send(wire.Run(sid, rid, kind, prompt, image))
        except EngineError:
            with self._state_lock:
                self._runs.pop(rid, None)
            raise
        return rid, run

    def _end_run(self, rid: int) -> None:
        with self._state_lock:
            self._runs.pop(rid, None)

    def _cancel(self, rid: int) -> None:
        try:
            self._send(wire.Cancel(rid))
        except EngineError:
            pass

    def _forget(self, sid: int, generation: int) -> None:
        """(A stand-in's finalizer: it may run on any thread, even one inside `_send`, so it takes no lock.) The
        child lets go of the session with the next message sent."""
        if generation == self.generation:
            self._forgotten.append(sid)

    def _read(self, conn: Connection, generation: int) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                code = self.process.poll()
                self._lost(generation, "the engine process stopped" + (f" (exit code {code})" if code else ""))
                return
            except Exception as exc:  # noqa: BLE001 - a message this side cannot read: say so, go on
                log.exception("a message from the engine process could not be read")
                self._lost(generation, f"the engine process sent what this side cannot read "
                                       f"({exc.__class__.__name__})")
                return
            with self._state_lock:
                if isinstance(message, wire.Reply):
                    waiter = self._replies.get(message.cid)
                    if waiter is not None:
                        waiter[1].extend([message.ok, message.value])
                        waiter[0].set()
                elif isinstance(message, (wire.Event, wire.End)):
                    run = self._runs.get(message.rid)
                    if run is not None:
                        run.put(message)

    def _lost(self, generation: int, reason: str) -> None:
        """The child stopped: every waiting call and run fails with `reason`; a new child is started unless this
        engine is closing, restarts are off or used up (its sessions are gone with the old one)."""
        if generation != self.generation:  # a child replaced already
            return
        self._fail_all(reason)
        if self._closing or sys.is_finalizing():
            return
        old = self.process
        if old.poll() is None:  # it sent what this side cannot read, but runs: it must not hold the model on
            old.kill()
            old.wait(10)
        try:
            self._conn.close()
        except OSError:
            pass
        if not self.restart or self.restarts >= MAX_RESTARTS:
            return
        log.warning("%s; starting it again (its comparisons are lost)", reason)
        try:
            process, conn, _ = _launch(*self._spec)
        except Exception as exc:  # noqa: BLE001 - it stays down, and says why
            log.error("the engine process could not be started again: %s", exc)
            with self._state_lock:
                self._dead = f"{reason}; starting it again failed ({exc})"
            return
        with self._state_lock:
            if self._closing:
                process.kill()
                return
            self.process, self._conn = process, conn
            self._forgotten.clear()  # the old child's sessions went with it
            self.generation += 1
            self.restarts += 1
            self._dead = None
        self._start_reader()

    def _fail_all(self, reason: str) -> None:
        with self._state_lock:
            if self._dead is None:
                self._dead = reason
            for done, box in self._replies.values():
                if not box:
                    box.extend([False, EngineProcessError(reason)])
                done.set()
            for rid, run in self._runs.items():
                run.put(wire.End(rid, EngineProcessError(reason), None))


class RemoteSession:
    """A session of the child's engine, read and run from this process (see the module docstring)."""

    def __init__(self, engine: EngineProcess, sid: int, visuals: Any, record: Any):
        self.engine = engine
        self.sid = sid
        self.visuals = visuals
        self.record = record  # fed here from the streamed events; the child's at the end of every turn
        self.released = False
        self._turn_lock = threading.Lock()
        self.generation = engine.generation  # the child that holds it (a child started again holds none of these)
        weakref.finalize(self, engine._forget, sid, self.generation)  # the child lets go of it with its stand-in

    @property
    def prefill(self):
        return self.record.prefill

    def run(self, cancel: threading.Event | None = None) -> Iterator[Any]:
        """First turn (see `Session.run`)."""
        return self._turn("run", None, None, cancel)

    def follow_up(self, prompt: str, cancel: threading.Event | None = None, *, image: Any = None) -> Iterator[Any]:
        """Next user turn (see `Session.follow_up`)."""
        return self._turn("follow_up", prompt, image, cancel)

    def cache_bytes(self) -> int:
        if self.released or self._gone():
            return 0
        return int(self.engine._call("cache_bytes", (self.sid,), {}))

    def _gone(self) -> bool:
        """Its child stopped and another was started: nothing of this session is held any more."""
        return self.generation != self.engine.generation

    def _check_held(self) -> None:
        if self._gone():
            raise EngineProcessError("the engine process stopped and was started again; this comparison's caches "
                                     "went with it: run Compare again")

    def results(self) -> dict[str, dict[str, Any]]:
        return self.record.to_dict()["methods"]

    def kept_image_map(self, method: str, layer: int):
        self._check_held()
        return self.engine._call("kept_image_map", (self.sid, method, layer), {})

    def kept_image_maps(self, methods: list[str], layer: int) -> dict[str, Any] | None:
        """`Session.kept_image_maps` in one call; None while a running turn waits for the model (no sample now)."""
        self._check_held()
        return self.engine._call("kept_image_maps", (self.sid, list(methods), layer), {})

    def release(self) -> None:
        """Drop every method's cache in the child (answers and figures stay readable here)."""
        self.released = True
        from .visuals import TurnVisuals

        self.visuals = TurnVisuals([], self.visuals.prompt)  # the images go here too, as `Session.release` drops them
        if self._gone():
            return
        try:
            self.engine._call("release", (self.sid,), {})
        except EngineError:  # gone already: nothing is held
            pass

    def _turn(self, kind: str, prompt: str | None, image: Any, cancel: threading.Event | None) -> Iterator[Any]:
        with self._turn_lock:  # one turn of this conversation at a time, as in the child
            self._check_held()
            rid, run = self.engine._start_run(self.sid, kind, prompt, image)
            record, began, stopped, ended = self.record, kind == "run", False, False
            record.active = True
            try:
                while True:
                    if cancel is not None and cancel.is_set() and not stopped:
                        stopped = True
                        self.engine._cancel(rid)
                    try:
                        message = run.get(timeout=POLL_S)
                    except queue.Empty:
                        continue
                    if isinstance(message, wire.End):
                        ended = True
                        if message.record is not None:
                            record.take_final(message.record)
                        if message.error is not None:
                            raise message.error
                        return
                    if not began:  # the child began the turn's record before its first event
                        record.begin_turn(prompt)
                        began = True
                    record.apply(message.item)
                    yield message.item
            finally:
                record.active = False
                self.engine._end_run(rid)
                if not ended and not stopped:  # the consumer left early: the child's turn stops within a token
                    self.engine._cancel(rid)
