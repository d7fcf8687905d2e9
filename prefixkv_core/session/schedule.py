"""How a turn's method rows are scheduled: all in one batch (the default), each alone one after another, or in
one batch and then each again alone to time it on its own. The answers are the same under every schedule; only
whose timings are whose differs."""
from __future__ import annotations

import threading
from typing import Iterator, Protocol

from ..report.events import MethodEvent, PrefillInfo
from .method_state import MethodState
from .stepping import RowStepper

Events = Iterator[PrefillInfo | MethodEvent]


class Session(Protocol):
    """What a schedule needs of the session that drives it."""

    states: dict[str, MethodState]
    stepper: RowStepper
    timing: list[MethodState]  # copies being decoded alone (their caches count in the session's memory)

    def prefill_first_turn(self, alone: bool) -> PrefillInfo: ...

    def prefill_alone_again(self, twin: MethodState) -> None: ...

    def event(self, state: MethodState, kind: str, **how) -> MethodEvent: ...


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


class OneBatch:
    """Every method is a row of one batched forward per step; a method's own time is its policy's."""

    alone = False  # the events say the rows were decoded on their own

    def first_turn(self, session: Session, cancel: threading.Event | None) -> Events:
        yield session.prefill_first_turn(alone=False)
        states = list(session.states.values())
        session.stepper.form_batch(states)
        for state in states:
            yield session.event(state, "start")
        yield from session.stepper.decode(states, session.event, cancel)

    def next_turn(self, session: Session, live: list[MethodState], new_ids: list[int],
                  cancel: threading.Event | None) -> Iterator[MethodEvent]:
        session.stepper.feed_turn(live, new_ids)
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
            session.prefill_alone_again(twin)
            yield session.event(twin, "start", alone=True)
            yield from session.stepper.decode([twin], session.event, cancel, alone=True)
            session.timing = []

    def next_turn(self, session: Session, live: list[MethodState], new_ids: list[int],
                  cancel: threading.Event | None) -> Iterator[MethodEvent]:
        copies = [s.twin() for s in live]  # every cache as the turn starts, decoded alone after the batch
        session.timing = copies
        yield from super().next_turn(session, live, new_ids, cancel)
        while copies:
            twin = copies.pop(0)
            session.timing = [twin, *copies]
            if session.states[twin.name].error is not None or _cancelled(cancel):
                continue
            session.stepper.feed_turn([twin], new_ids)
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

    def next_turn(self, session: Session, live: list[MethodState], new_ids: list[int],
                  cancel: threading.Event | None) -> Iterator[MethodEvent]:
        for state in live:
            session.stepper.feed_turn([state], new_ids)
            yield session.event(state, "error" if state.error is not None else "start", alone=True)
            yield from session.stepper.decode([state], session.event, cancel, alone=True)


Schedule = OneBatch | EachAlone


def schedule_for(batched: bool, time_alone: bool) -> Schedule:
    """The schedule of `Engine.new_session(batched=..., time_alone=...)`."""
    if not batched:
        return EachAlone()
    return BatchThenEachAlone() if time_alone else OneBatch()
