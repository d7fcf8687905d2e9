"""How a turn's method rows are scheduled: all in one batch (the default), each alone one after another, or in
one batch and then each again alone to time it on its own. The answers are the same under every schedule; only
whose timings are whose differs."""
from __future__ import annotations

import threading
from typing import Iterator, Protocol

from ..errors import EngineError
from ..report.events import MethodEvent, PrefillInfo
from .method_state import MethodState
from .stepping import RowStepper, TurnInput

Events = Iterator[PrefillInfo | MethodEvent]


class Session(Protocol):
    """What a schedule needs of the session that drives it."""

    states: dict[str, MethodState]
    stepper: RowStepper
    timing: list[MethodState]  # copies being decoded alone (their caches count in the session's memory)

    def prefill_first_turn(self, alone: bool, states: list[MethodState] | None = None) -> PrefillInfo: ...

    def prefill_more(self, states: list[MethodState], alone: bool) -> None: ...

    def event(self, state: MethodState, kind: str, **how) -> MethodEvent: ...


class OwnPrefills:
    """The methods with a prefill of their own, waiting to join a running first turn (`RowStepper.decode`'s
    `joining`): prefilled one after another when the decode asks, once the others' first tokens went out."""

    def __init__(self, session: Session, states: list[MethodState]):
        self.session = session
        self.waiting = list(states)

    def next(self) -> MethodState:
        state = self.waiting.pop(0)
        self.session.prefill_more([state], alone=False)
        return state

    def stop(self) -> list[MethodState]:
        stopped, self.waiting = self.waiting, []
        for state in stopped:  # never prefilled: it has no cache to follow up on
            state.fail(EngineError("stopped before its own prefill ran; run Compare again to see it"))
        return stopped


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


class OneBatch:
    """Every method is a row of one batched forward per step; a method's own time is its policy's. The methods that
    share the prefill stream first; the methods with a prefill of their own (prefill token reduction) are then
    prefilled one after another, each streaming its first token when ready, and every row decodes in one batch."""

    alone = False  # the events say the rows were decoded on their own

    def first_turn(self, session: Session, cancel: threading.Event | None) -> Events:
        states = list(session.states.values())
        # the methods that share the prefill go first (when none does, every method prefills before any streams)
        first = [s for s in states if not s.policy.own_prefill()] or states
        later = OwnPrefills(session, [s for s in states if s not in first])
        yield session.prefill_first_turn(alone=False, states=first)
        session.stepper.form_batch(first)
        for state in first:
            yield session.event(state, "start")
        yield from session.stepper.decode(first, session.event, cancel, joining=later)

    def next_turn(self, session: Session, live: list[MethodState], turn: TurnInput,
                  cancel: threading.Event | None) -> Iterator[MethodEvent]:
        session.stepper.feed_turn(live, turn)
        session.stepper.form_batch(live)
        for state in live:
            yield session.event(state, "error" if state.error is not None else "start")
        yield from session.stepper.decode(list(session.states.values()), session.event, cancel)


class BatchThenEachAlone(OneBatch):
    """One batch, then every method again on its own (its own prefill, or a copy of its cache as the turn
    started), so that its time to first token, tokens/s and latency are measured alone."""

    def first_turn(self, session: Session, cancel: threading.Event | None) -> Events:
        yield from super().first_turn(session, cancel)
        for name, done in session.states.items():
            if done.error is not None or _cancelled(cancel):
                continue
            twin = MethodState(name, done.policy)
            session.timing = [twin]
            session.prefill_more([twin], alone=True)
            yield session.event(twin, "start", alone=True)
            yield from session.stepper.decode([twin], session.event, cancel, alone=True)
            session.timing = []

    def next_turn(self, session: Session, live: list[MethodState], turn: TurnInput,
                  cancel: threading.Event | None) -> Iterator[MethodEvent]:
        copies = [s.twin() for s in live]  # every cache as the turn starts, decoded alone after the batch
        session.timing = copies
        yield from super().next_turn(session, live, turn, cancel)
        while copies:
            twin = copies.pop(0)
            session.timing = [twin, *copies]
            if session.states[twin.name].error is not None or _cancelled(cancel):
                continue
            session.stepper.feed_turn([twin], turn, alone=True)
            yield session.event(twin, "error" if twin.error is not None else "start", alone=True)
            yield from session.stepper.decode([twin], session.event, cancel, alone=True)
        session.timing = []


class EachAlone:
    """Every method on its own, one after another (its own prefill): all its timings are its own."""

    alone = True

    def first_turn(self, session: Session, cancel: threading.Event | None) -> Events:
        yield session.prefill_first_turn(alone=True)
        states = list(session.states.values())
        for state in states:
            yield session.event(state, "start", alone=True)
        for state in states:
            yield from session.stepper.decode([state], session.event, cancel, alone=True)

    def next_turn(self, session: Session, live: list[MethodState], turn: TurnInput,
                  cancel: threading.Event | None) -> Iterator[MethodEvent]:
        for state in live:
            session.stepper.feed_turn([state], turn, alone=True)
            yield session.event(state, "error" if state.error is not None else "start", alone=True)
            yield from session.stepper.decode([state], session.event, cancel, alone=True)


Schedule = OneBatch | EachAlone


def schedule_for(batched: bool, time_alone: bool) -> Schedule:
    """The schedule of `Engine.new_session(batched=..., time_alone=...)`."""
    if not batched:
        return EachAlone()
    return BatchThenEachAlone() if time_alone else OneBatch()
