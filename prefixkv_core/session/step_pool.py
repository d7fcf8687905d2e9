"""Several conversations decoded in one batch: the rows of every turn that decodes now (each a method of some
user's comparison) go through the model in one batched forward per step, as the methods of one comparison do.

Each turn runs on its own thread (the app runs every request on one) and asks the pool for its steps
(`advance`). The first turn to ask waits, briefly, for the other decoding turns to ask too, then runs one
forward for all of them (a job on the model's thread, `model_worker.py`, ahead of any waiting prefill) and hands
each turn its rows' logits. A turn that starts while others decode prefills between two of their steps and
joins at the next one; a turn that ends or is cancelled simply stops asking, and its rows leave the batch.

Why a short wait and not a strict barrier: a turn may be slow to ask again (its consumer busy, its own prefill
running for a method that joins later); the others then step without it after `gather_s`, and it joins the
step after. Which rows share a forward never changes an answer: every row attends to its own entries only.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..decoding import runner
from ..decoding.stopwatch import Elapsed, Stopwatch
from ..kv.cache import KeptImageCounts, unread_image_counts
from ..limits import return_free_memory
from ..models import LoadedModel
from .method_state import MethodState
from .model_worker import STEP, ModelWorker

GATHER_S = 0.05  # how long a step waits for decoding turns that have not asked yet
ARRIVING_S = 1.0  # a turn whose prefill ended this recently and has not started decoding counts as coming


@dataclass
class StepResult:
    """A step's logits and times. The times are read when first asked for (`float`), after the step's tokens
    were read back: timing them waits for nothing (`decoding/stopwatch.py`)."""

    logits: torch.Tensor  # [rows, V]
    forward_s: Elapsed  # the shared forward's seconds
    policy_s: list[Elapsed]  # each row's own policy seconds
    # the image entries the step's evictions kept, still on the device: read with the tokens (`read_with_counts`)
    image_counts: list[KeptImageCounts] = field(default_factory=list)


@dataclass
class _Request:
    member: int | None
    states: list[MethodState]
    chunks: list[list[int]]
    steps: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    result: StepResult | None = None
    error: BaseException | None = None


def advance_rows(loaded: LoadedModel, buffers: runner.StepBuffers, states: list[MethodState],
                 chunks: list[list[int]], steps: list[int]) -> StepResult:
    """Feed chunks[r] to states[r] in one batched forward, then let each policy compress its own cache (the caller
    holds the model). A failing forward fails every row in it; a failing policy fails its own row only."""
    device = loaded.device
    watch = Stopwatch(device)
    start = watch.mark()
    try:
        out = runner.forward_rows(loaded.model, [s.cache for s in states], chunks, [s.true_len for s in states],
                                  [runner.attention_wanted(s.policy, s.policy_state) for s in states], device,
                                  buffers,
                                  [s.policy.step_subset(s.policy_state, s.cache) for s in states])
    except Exception as exc:
        for state in states:
            state.fail(exc)
        return StepResult(torch.zeros(len(states), 1), Elapsed(), [Elapsed() for _ in states])
    forward_s = Elapsed(watch)
    forward_s.add(start, watch.mark())
    rows = []
    for r, (state, chunk) in enumerate(zip(states, chunks)):
        state.true_len += len(chunk)
        rows.append(runner.DecodeRow(state.policy, state.policy_state, state.cache, state.true_len,
                                     state.prompt_len, steps[r], out.attention[r], state.reduced_by))
    policy_s = []
    for state, (seconds, error) in zip(states, runner.compress_decode_rows(rows, device)):
        if error is not None:  # one method failing must not stop the others
            state.fail(error)
        policy_s.append(seconds)
    counts = unread_image_counts([s.cache for s in states if s.cache is not None])
    return StepResult(out.logits, forward_s, policy_s, counts)


def form_rows(states: list[MethodState], buffers: runner.StepBuffers) -> bool:
    """Move the rows about to decode together into `buffers`' shared stores; False when that failed (the first
    step then meets the same problem and fails its rows with it)."""
    if len(states) < 2:
        return True
    try:
        runner.form_batch([s.cache for s in states], [s.policy.decode_needs_attention() for s in states], buffers)
    except Exception:  # noqa: BLE001 - see the docstring
        return False
    return True


class StepPool:
    """The steps of every turn decoding on one model, batched together (see the module docstring). Each step runs
    on the engine's `worker`, as the prefills do."""

    def __init__(self, loaded: LoadedModel, worker: ModelWorker, gather_s: float = GATHER_S):
        self.loaded = loaded
        self.worker = worker
        self.gather_s = gather_s
        self._cond = threading.Condition()
        self._members: dict[int, bool] = {}  # decoding turns -> whether one is expected to ask (not in a prefill)
        # turns about to decode -> (announced at, until when the steps wait once its prefill ended, or None while it
        # still runs: the model is busy with it then, so waiting costs nothing)
        self._arriving: dict[int, tuple[float, float | None]] = {}
        self._rows_of: dict[int, dict[int, MethodState]] = {}  # member -> the rows it fed (by id)
        self._leaving: list[MethodState] = []  # rows of members that left, still in the shared stores
        self._moving: list[MethodState] = []  # those the model's thread is moving into stores of their own now
        self._pending: list[_Request] = []
        self._stepping = False
        self._next_id = 0
        self._buffers: runner.StepBuffers | None = None
        self._formed: list[int] = []  # ids of the caches the shared stores were formed for, in order
        self.steps = 0  # batched forwards run (for tests and benchmarks)
        self.largest_batch = 0  # the most rows one of them held
        self.shared_steps = 0  # those that held the rows of more than one turn
        self.waited_out = 0  # steps that started without a decoding turn that was slow to ask
        self.formed = 0  # steps that formed the shared stores anew (rows joined or left)

    # -- who decodes -----------------------------------------------------------------------------------------
    def arriving(self, turn: object, ready: bool = False) -> None:
        """A turn is about to decode (its prefill shared a forward and runs now on the model's thread; `ready`: it
        ended): the steps wait for it to join, as for a member, while its prefill runs and then `gather_s` at most
        (ARRIVING_S in all), so several turns whose prefills shared a forward decode together from the start."""
        now = time.monotonic()
        with self._cond:
            since = self._arriving.get(id(turn), (now, None))[0]
            self._arriving[id(turn)] = (since, now + self.gather_s if ready else None)
            self._cond.notify_all()

    def not_arriving(self, turn: object) -> None:
        """The turn announced by `arriving` will not decode (its prefill failed)."""
        with self._cond:
            self._arriving.pop(id(turn), None)
            self._cond.notify_all()

    def _arrivals_until(self) -> float:
        """(With the lock held.) Until when a step waits for the turns about to decode (0: none)."""
        now, until = time.monotonic(), 0.0
        for turn, (since, ready_until) in list(self._arriving.items()):
            end = min(since + ARRIVING_S, ready_until if ready_until is not None else since + ARRIVING_S)
            if end < now:  # never came (it failed or was stopped before decoding)
                del self._arriving[turn]
            else:
                until = max(until, end)
        return until

    @contextlib.contextmanager
    def member(self, turn: object = None) -> Iterator[int]:
        """A turn's decode loop: its steps are waited for until it leaves. On leaving, the rows it fed take their
        entries out of the shared stores (so those can go when nobody decodes)."""
        with self._cond:
            self._arriving.pop(id(turn), None)
            member = self._next_id
            self._next_id += 1
            self._members[member] = True
            self._rows_of[member] = {}
        try:
            yield member
        finally:
            with self._cond:
                self._members.pop(member, None)
                fed = self._rows_of.pop(member, {})
                self._cond.notify_all()
            self._take_out(list(fed.values()))

    @contextlib.contextmanager
    def away(self, member: int) -> Iterator[None]:
        """The member does something else with the model (a prefill): the others step without waiting for it."""
        with self._cond:
            self._members[member] = False
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                if member in self._members:
                    self._members[member] = True

    def decoding(self) -> int:
        """Turns decoding now."""
        with self._cond:
            return len(self._members)

    def nbytes(self) -> int:
        """Bytes of the shared stores and padded tensors the batched steps keep now."""
        buffers = self._buffers
        return buffers.nbytes() if buffers is not None else 0

    # -- a step ------------------------------------------------------------------------------------------------
    def advance(self, states: list[MethodState], chunks: list[list[int]], steps: list[int],
                member: int | None = None) -> StepResult:
        """Feed chunks[r] to states[r] in a batched forward shared with the other turns' rows asking now; returns
        these rows' logits and times."""
        request = _Request(member, list(states), [list(c) for c in chunks], list(steps))
        with self._cond:
            self._pending.append(request)
            if member in self._rows_of:
                self._rows_of[member].update((id(s), s) for s in states)
            self._cond.notify_all()
            deadline = time.monotonic() + self.gather_s
            while not request.done.is_set():
                if not self._stepping and request in self._pending:
                    everyone = self._all_asked()
                    if everyone or time.monotonic() >= max(deadline, self._arrivals_until()):
                        self.waited_out += not everyone
                        batch, self._pending, self._stepping = self._pending, [], True
                        break
                was_stepping = self._stepping
                wait_until = max(deadline, self._arrivals_until())
                self._cond.wait(max(0.001, wait_until - time.monotonic()) if not was_stepping else None)
                if was_stepping and not self._stepping:  # a step just ended: give its rows time to ask again
                    deadline = max(deadline, time.monotonic() + self.gather_s)
            else:
                return self._outcome(request)
        try:  # this thread leads the step for everyone who asked
            self._run(batch)
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()
                idle = not self._members and not self._pending and self._buffers is not None
            if idle:  # a step nobody decodes after (a follow-up's input): its stores go
                self.worker.post(self._settle)
        return self._outcome(request)

    def _all_asked(self) -> bool:
        asking = {r.member for r in self._pending}
        return not self._arrivals_until() and all(m in asking for m, expected in self._members.items() if expected)

    def _run(self, batch: list[_Request]) -> None:
        # Requests arrive in whatever order their threads wake; in a fixed order (by member, then row) the same
        # rows make the same batch, and the shared stores are formed anew only when rows join or leave.
        batch.sort(key=lambda r: (-1 if r.member is None else r.member, id(r.states[0]) if r.states else 0))
        try:
            result = self.worker.call(lambda: self._step(batch), STEP)
        except BaseException as exc:  # noqa: BLE001 - handed to every turn of the step
            for r in batch:
                r.error = exc
                r.done.set()
            return
        start = 0
        for r in batch:
            n = len(r.states)
            r.result = StepResult(result.logits[start:start + n], result.forward_s, result.policy_s[start:start + n],
                                  result.image_counts)
            start += n
            r.done.set()

    @torch.inference_mode()
    def _step(self, batch: list[_Request]) -> StepResult:
        """On the model's thread: one batched forward of every request's rows."""
        states = [s for r in batch for s in r.states]
        with self._cond:  # a row that left and is fed again (its session's follow-up) stays where the steps read it
            fed = {id(s) for s in states}
            self._leaving = [s for s in self._leaving if id(s) not in fed]
        if self._buffers is None:
            self._buffers = runner.StepBuffers()
        ids = [id(s.cache) for s in states]
        if ids != self._formed:  # rows joined or left: the shared stores are formed anew
            self._formed = ids if form_rows(states, self._buffers) else []
            self.formed += 1
            return_free_memory()  # the stores the rows moved out of: give their pages back now
        result = advance_rows(self.loaded, self._buffers, states, [c for r in batch for c in r.chunks],
                              [k for r in batch for k in r.steps])
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(states))
        self.shared_steps += len({id(r.states[0]) if r.member is None else r.member for r in batch}) > 1
        self._settle()  # rows that left while the step ran
        return result

    @staticmethod
    def _outcome(request: _Request) -> StepResult:
        if request.error is not None:
            raise request.error
        return request.result

    def _take_out(self, states: list[MethodState]) -> None:
        """A member left: its rows take their entries into stores of their own, and with nobody left the shared
        stores go; on the model's thread, after the steps and prefills waiting (nobody waits for it)."""
        with self._cond:
            self._leaving.extend(states)
        self.worker.post(self._settle)

    def _settle(self) -> None:
        """On the model's thread: the rows that left own their entries; no member left, no shared stores."""
        with self._cond:
            leaving, self._leaving = self._leaving, []
            self._moving = leaving
            if any(s.cache is not None and id(s.cache) in self._formed for s in leaving):
                self._formed = []  # its entries move out of the shared stores: the next step forms them anew
            idle = not self._members and not self._pending
        try:
            for state in leaving:
                if state.cache is not None:
                    for layer in state.cache.layers:
                        layer.own_storage()
        finally:
            with self._cond:
                self._moving = []
                self._cond.notify_all()
        if leaving:
            return_free_memory()
        if idle:
            with self._cond:
                if not self._members and not self._pending and not self._stepping:
                    self._buffers = None

    def settled(self, states: list[MethodState]) -> None:
        """Wait until none of `states` is still leaving the shared stores: a turn that ended hands its rows' moves to
        the model's thread, and whoever reads their caches next (their bytes, the overlay) must not meet them half
        moved. On the model's thread itself nothing waits (the move runs there, after the job at hand)."""
        if self.worker.here():
            return
        ids = {id(s) for s in states}
        with self._cond:
            self._cond.wait_for(lambda: not any(id(s) in ids for s in (*self._leaving, *self._moving)))
