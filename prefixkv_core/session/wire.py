"""What the app's process and the engine's process (`engine_process.py`) say to each other: one dataclass per kind
of message, and the calls the engine's process answers, listed once (`CALLS`).

This process sends `Call` (a named call, answered by one `Reply`), `Run` (a turn of a session, answered by its
`Event`s and one `End`), `Cancel` (stop a turn within a token) and `Stop` (end the process). The engine's process
first says `Ready` (the model's description) or `Failed` (why it did not load). Everything crosses the socket
pickled; ids are this process's, unique for the life of an `EngineProcess`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The calls the engine's process answers: name -> what it does (the child's handlers are exactly these).
CALLS: dict[str, str] = {
    "new_session": "Engine.new_session(*args, **kwargs): the new session's id, its visuals and its record",
    "analyse": "Engine.analyse(image, prompt)",
    "stats": "the engine's batching counters, its model thread's time and the sessions it holds",
    "memory": "the engine process's resident bytes",
    "forget": "let go of a session (its stand-in here was collected)",
    "cache_bytes": "a session's cache bytes",
    "results": "a session's results",
    "release": "drop a session's caches",
    "kept_image_map": "a session's kept-patch map of one method and layer, between two events of a running turn",
    "kept_image_maps": "the maps of several methods; None while a running turn waits for the model",
}
TURNS = ("run", "follow_up")  # the kinds of `Run`: a session's first turn, a follow-up


# -- this process to the engine's ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    cid: int
    name: str  # one of CALLS
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in CALLS:
            raise ValueError(f"the engine process has no call {self.name!r}")


@dataclass(frozen=True)
class Run:
    sid: int
    rid: int
    kind: str  # one of TURNS
    prompt: str | None = None  # a follow-up's text
    image: Any = None  # a follow-up's images

    def __post_init__(self):
        if self.kind not in TURNS:
            raise ValueError(f"a turn is one of {TURNS}, not {self.kind!r}")


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class Stop:
    pass


# -- the engine's process to this one -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    loaded: Any  # the LoadedModel with an outline of the model (no weights)


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class Reply:
    cid: int
    ok: bool
    value: Any  # the call's value, or the exception to raise


@dataclass(frozen=True)
class Event:
    rid: int
    item: Any  # one of the session's events


@dataclass(frozen=True)
class End:
    rid: int
    error: BaseException | None
    record: Any  # the session's record at the end of the turn (None if it could not be sent)
