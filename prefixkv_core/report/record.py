"""The one result record of a comparison: fed with the engine's events, read by everyone.

Plain Python (no torch, no gradio): per-method answers per turn, the latest telemetry, the per-token series
behind the charts, ROUGE-L against Full, and one JSON contract, `to_dict()`, used by the CLI's `--json`, the
app's API output and export, and the benchmarks (`Session.results()`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .events import MethodEvent, PrefillInfo
from . import summary as summaries
from .metrics import rouge_l
from .summary import MB, jsonable  # noqa: F401 - part of this module's vocabulary (charts, exports)

# How a comparison ran, in words for titles and captions: the budget mode (policies.BUDGET_MODES) and whether
# the prompt was compressed with the question in view (query-aware) or before it (query-agnostic)
BUDGET_MODE_TITLES = {"published": "published budgets", "equal_memory": "equal memory"}
QUERY_MODE_TITLES = {False: "query-aware", True: "query-agnostic"}


def mode_title(budget_mode: str = "published", query_agnostic: bool = False) -> str:
    """'published budgets, query-aware', 'equal memory, query-agnostic', ...: which mode produced a result."""
    return f"{BUDGET_MODE_TITLES.get(budget_mode, budget_mode)}, {QUERY_MODE_TITLES[bool(query_agnostic)]}"

def mean_kept_ratio(kept_per_layer: list[int], full_len: int | None) -> float | None:
    """Mean over layers of the entries kept over the full length N_t (None before any telemetry)."""
    return sum(kept_per_layer) / len(kept_per_layer) / full_len if kept_per_layer and full_len else None


STATUS_OF_KIND = {"start": "streaming", "token": "streaming", "done": "done", "cancelled": "stopped",
                  "error": "error"}
ENDED_STATUSES = ("done", "stopped", "error")  # a turn's status once its answer is complete


@dataclass
class Series:
    """One method's per-token telemetry over every turn of a conversation."""

    label: str
    steps: list[int] = field(default_factory=list)  # running token index over all turns (1, 2, ...)
    kv_bytes: list[int] = field(default_factory=list)
    full_kv_bytes: list[int] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)  # model forward of that step (0 when not timed)
    policy_s: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)


@dataclass
class BatchSteps:
    """The batched run's shared forward, once per decode step (not once per method): what the batch paid."""

    steps: list[int] = field(default_factory=list)  # running step index over all turns (1, 2, ...)
    forward_s: list[float] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=list)  # methods decoded together in that step
    turn: list[int] = field(default_factory=list)
    _last_point: tuple[int, int] | None = None

    def add(self, turn: int, step: int, forward_s: float, batch_size: int) -> None:
        if (turn, step) != self._last_point:  # every method of the step reports the same forward
            self._last_point = (turn, step)
            self.steps.append(len(self.steps) + 1)
            self.forward_s.append(float(forward_s))
            self.batch_size.append(int(batch_size))
            self.turn.append(turn + 1)

    def summary(self, turn: int) -> dict[str, Any] | None:
        """The shared forward of one turn's batched steps (turn counted from 1), or None if it had none."""
        mine = [(f, b) for f, b, t in zip(self.forward_s, self.batch_size, self.turn) if t == turn]
        if not mine:
            return None
        return {"methods": max(b for _, b in mine), "steps": len(mine),
                "forward_ms_per_step": round(1000 * sum(f for f, _ in mine) / len(mine), 3)}


@dataclass
class Turn:
    user: str
    answer: str = ""
    status: str = "waiting"  # waiting | streaming | done | stopped | error
    error: str | None = None
    last: MethodEvent | None = None  # latest event of this turn
    policy_s: float = 0.0  # the method's own policy time over this turn's decode steps
    decode_steps: int = 0
    latency_s: list[float] = field(default_factory=list)  # forward + own policy of each decode step
    alone: "Turn | None" = None  # the same turn decoded on its own (the time-alone pass), if it ran


@dataclass
class Track:
    method: str
    label: str
    turns: list[Turn] = field(default_factory=list)
    series: Series | None = None
    last: MethodEvent | None = None  # latest event with telemetry (any turn)
    alone_series: Series | None = None  # the per-token telemetry of the method decoded on its own
    _last_point: tuple[int, int] | None = None  # (turn, step) last appended to the series
    _last_alone_point: tuple[int, int] | None = None

    def __post_init__(self):
        if self.series is None:
            self.series = Series(label=self.label)
        if self.alone_series is None:
            self.alone_series = Series(label=self.label)

    @property
    def turn(self) -> Turn | None:
        return self.turns[-1] if self.turns else None


class ComparisonRecord:
    """Every method's conversation and figures in one comparison, built from `PrefillInfo` / `MethodEvent`s."""

    def __init__(self, methods: list[str], labels: dict[str, str], prompt: str, budget: float,
                 settings: dict[str, Any] | None = None, knobs: dict[str, dict[str, Any]] | None = None,
                 model: dict[str, Any] | None = None, budget_mode: str = "published", query_agnostic: bool = False,
                 batched: bool = True, alone: bool = False, roles: dict[str, str] | None = None):
        self.methods = list(methods)
        roles = roles or {}  # role -> method: the registry's (`policies.role_methods()`), as the session passes them
        # the methods that play a part beyond their own panel (policies.ROLES): the reference the answers are
        # scored and the speed-ups measured against, and the method whose allocation the Lorenz chart draws
        self.reference: str | None = roles.get("reference")
        self.lorenz_method: str | None = roles.get("lorenz")
        self.budget = float(budget)
        self.budget_mode = budget_mode  # "published" or "equal_memory" (prompt-only methods held at r·N_t)
        self.query_agnostic = bool(query_agnostic)  # compressed before the question was fed
        self.batched = batched  # the methods decode as one batch (sharing each step's forward)
        self.alone = alone or not batched  # every method is (also) decoded and timed on its own
        self.batch = BatchSteps()
        self.settings = dict(settings or {})
        self.knobs = {m: dict(k) for m, k in (knobs or {}).items()}
        self.model = dict(model or {})
        self.visuals: dict[str, Any] = {}  # the first turn's images and video (sizes, frames sampled), as described
        self.tracks = {m: Track(m, labels.get(m, m)) for m in self.methods}
        self.prompts: list[str] = []
        self.prefill: PrefillInfo | None = None
        self.active = False  # a turn is being generated
        # the engine feeds the record on the thread that runs the session while the app reads it on another:
        # feeding holds this lock, and so does a reader that needs a consistent view (the app's redraws)
        self.lock = threading.RLock()
        self.error: str | None = None  # a failure of the whole request (bad input found during prefill, crash)
        self.begin_turn(prompt)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its lock (a record crosses to another process whole: `engine_process.py`)."""
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    # what a client side writes itself and keeps when it takes another process's record (`take_final`)
    CLIENT_FIELDS = ("model", "active", "error")

    def take_final(self, final: "ComparisonRecord") -> None:
        """Become `final` (the same comparison's record from the process that ran the turn) at the end of a turn.
        What this side wrote stays: the model's facts (merged over the other side's), the error of the whole
        request, whether a turn is active, and the earlier turns (final here already, with this side's marks, such
        as a turn it marked stopped or failed)."""
        with self.lock:
            model, earlier = self.model, {m: list(t.turns) for m, t in self.tracks.items()}
            for name, value in final.__getstate__().items():
                if name not in self.CLIENT_FIELDS:
                    setattr(self, name, value)
            self.model = {**final.model, **model}
            for method, track in self.tracks.items():
                kept = earlier.get(method, [])
                for i in range(min(len(track.turns) - 1, len(kept))):
                    track.turns[i] = kept[i]

    # -- feeding ---------------------------------------------------------------------------------------------
    def begin_turn(self, prompt: str) -> None:
        with self.lock:
            self.prompts.append(prompt)
            for track in self.tracks.values():
                track.turns.append(Turn(user=prompt))

    def rollback_turn(self) -> None:
        """Undo begin_turn() when the engine refused the turn before it started (nothing was generated)."""
        if len(self.prompts) > 1:
            self.prompts.pop()
            for track in self.tracks.values():
                if len(track.turns) > 1 and track.turns[-1].status == "waiting":
                    track.turns.pop()

    def apply(self, item: Any) -> None:
        with self.lock:
            if isinstance(item, PrefillInfo):
                self.prefill = item
            elif isinstance(item, MethodEvent):
                self._apply_event(item)

    def _apply_event(self, ev: MethodEvent) -> None:
        track = self.tracks.get(ev.method)
        if track is None or not track.turns:
            return
        turn = track.turns[min(ev.turn, len(track.turns) - 1)]
        if ev.alone:  # the method on its own: its timings; also its answer when nothing ran batched
            if turn.alone is None:
                turn.alone = Turn(user=turn.user)
            self._update_turn(turn.alone, ev)
            if self._new_point(track, ev, alone=True):
                self._append(track.alone_series, turn.alone, ev)
            if self.batched:
                return
        self._update_turn(turn, ev)
        if ev.kept_per_layer:
            track.last = ev
        if self._new_point(track, ev, alone=False):
            self._append(track.series, turn, ev)
            if not ev.alone and ev.step_latency_s > 0:
                self.batch.add(ev.turn, ev.step, ev.step_latency_s, ev.batch_size)

    @staticmethod
    def _update_turn(turn: Turn, ev: MethodEvent) -> None:
        status = STATUS_OF_KIND.get(ev.kind, turn.status)
        if ev.kind == "error" or ev.error:  # a method that failed in the prefill still gets a "start" event
            status = "error"
            turn.error = ev.error or "failed"
        if ev.kind != "error" or ev.text:
            turn.answer = ev.text
        turn.status = status
        if ev.kept_per_layer:
            turn.last = ev

    @staticmethod
    def _new_point(track: Track, ev: MethodEvent, alone: bool) -> bool:
        """Is this event a step not yet in the (main or alone) series? Each step is appended once."""
        if ev.kind not in ("start", "token", "done") or ev.step <= 0 or not ev.kept_per_layer:
            return False
        point = (ev.turn, ev.step)
        if point == (track._last_alone_point if alone else track._last_point):
            return False
        if alone:
            track._last_alone_point = point
        else:
            track._last_point = point
        return True

    @staticmethod
    def _append(s: Series, turn: Turn, ev: MethodEvent) -> None:
        s.steps.append(len(s.steps) + 1)
        s.kv_bytes.append(int(ev.kv_bytes))
        s.full_kv_bytes.append(int(ev.full_kv_bytes))
        s.latency_s.append(float(ev.step_latency_s))
        s.policy_s.append(float(ev.policy_s))
        s.turn.append(ev.turn + 1)
        if ev.step_latency_s > 0:  # a decode step (the turn's first token comes from the prefill)
            turn.policy_s += float(ev.policy_s)
            turn.decode_steps += 1
            turn.latency_s.append(float(ev.step_latency_s) + float(ev.policy_s))

    def stop_all(self, status: str = "stopped") -> None:
        """Mark every unfinished answer of the current turn (after a stop, a crash or a request error)."""
        for track in self.tracks.values():
            t = track.turn
            if t is not None and t.status in ("waiting", "streaming"):
                t.status = status

    # -- reading ---------------------------------------------------------------------------------------------
    def mode_title(self) -> str:
        return mode_title(self.budget_mode, self.query_agnostic)

    @property
    def turn_index(self) -> int:
        return len(self.prompts) - 1

    @property
    def finished(self) -> bool:
        return all(t.turn is None or t.turn.status in ENDED_STATUSES for t in self.tracks.values())

    def rouge(self, method: str, turn: int = -1) -> float | None:
        """ROUGE-L F1 of this method's answer against the reference's (Full) for one turn, once both are done."""
        if self.reference not in self.tracks or method not in self.tracks:
            return None
        try:
            mine, ref = self.tracks[method].turns[turn], self.tracks[self.reference].turns[turn]
        except IndexError:
            return None
        if mine.status != "done" or ref.status != "done":
            return None
        return rouge_l(mine.answer, ref.answer)

    def series(self) -> dict[str, Series]:
        return {m: t.series for m, t in self.tracks.items()}

    def alone_series(self) -> dict[str, Series]:
        """Per method, the per-token telemetry of its decoding on its own (empty series when not timed alone)."""
        return {m: t.alone_series for m, t in self.tracks.items()}

    def alone_turn(self, method: str, turn: int = -1) -> Turn | None:
        """This method's run of one turn on its own (None when it was not timed alone)."""
        try:
            return self.tracks[method].turns[turn].alone
        except (KeyError, IndexError):
            return None

    def alone_tokens_per_s(self, method: str, turn: int = -1) -> float | None:
        run = self.alone_turn(method, turn)
        ev = run.last if run is not None else None
        return ev.tokens_per_s if ev is not None and run.status == "done" else None

    def speedup(self, method: str, turn: int = -1) -> float | None:
        """Decode throughput of this method alone over the reference's (Full) alone (the papers' speed-up), once
        both finished."""
        if self.reference is None:
            return None
        mine, full = self.alone_tokens_per_s(method, turn), self.alone_tokens_per_s(self.reference, turn)
        return mine / full if mine and full else None

    def batch_summary(self, turn: int | None = None) -> dict[str, Any] | None:
        """The batched run's shared forward in one turn (default the current one): methods, steps, mean ms."""
        return self.batch.summary((self.turn_index if turn is None else turn) + 1)

    def latest(self) -> dict[str, MethodEvent | None]:
        return {m: t.last for m, t in self.tracks.items()}

    def quality_points(self) -> dict[str, tuple[str, float, float | None]]:
        out = {}
        for m, t in self.tracks.items():
            if t.last is not None and m != self.reference:
                out[m] = (t.label, t.last.kv_ratio, self.rouge(m))
        return out

    def threshold(self) -> float | None:
        """The retention threshold the Lorenz method (PrefixKV, online mode) chose in this run, if it ran."""
        t = self.tracks.get(self.lorenz_method) if self.lorenz_method is not None else None
        if t is None or t.last is None:
            return None
        return t.last.extras.get("threshold")

    def curve_importance(self, method: str | None = None) -> np.ndarray | None:
        """[L, N'] the importance whose Lorenz curves `method` used in this run (online PrefixKV: by its
        scorer, without the sink when it leaves it out), or the prefill's column sums when it reported none."""
        if self.prefill is None:
            return None
        method = self.lorenz_method if method is None else method
        used = self.prefill.curves.get(method) if self.prefill.curves else None
        return used if used is not None else self.prefill.importance

    def mean_kept_ratio(self, method: str) -> float | None:
        """This method's latest mean kept share of the full length over the layers (its `kept_per_layer` / N_t)."""
        ev = self.tracks[method].last
        return mean_kept_ratio(ev.kept_per_layer, ev.full_len) if ev is not None else None

    def method_summary(self, method: str) -> dict[str, Any]:
        """One method's figures of the current turn, JSON-ready (`summary.method_summary`)."""
        return summaries.method_summary(self, method)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready results: the CLI's --json, the app's `results` output and exported results.json."""
        return summaries.record_dict(self)
