"""The Leaderboard tab's handlers: the stored results (`prefixkv_core.report.leaderboard_store`) filtered by task,
model, query mode and budget mode, drawn against the KV budget in the chosen metric (`leaderboard_chart.py`),
listed as a table and written for download: CSV, JSON and the figure for papers (PNG, PDF).

The results are read once, by the server, from the repository's own folder; a client only picks among the values
that store holds, and every value it sends is checked here (an unknown one is refused with the list it may use)."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import gradio as gr

from prefixkv_core.models import EMBEDDED_SLUG
from prefixkv_core.report.leaderboard import ratio_text
from prefixkv_core.report.leaderboard_store import (BUDGET_MODES, METRICS, QUERY_MODES, LeaderboardPoint,
                                                     LeaderboardStore, points_csv, points_json)

from .export import find_browser, paper_figure, write_static
from .export_store import ExportStore
from .inputs import check_choice, refuse
from .leaderboard_chart import leaderboard_figure

log = logging.getLogger(__name__)

QUERY_MODE_LABELS = {"query_aware": "query-aware", "query_agnostic": "query-agnostic"}
BUDGET_MODE_LABELS = {"published": "published", "equal_memory": "equal memory"}
METRIC_NAMES = {"accuracy": "accuracy", "agreement": "agreement with Full"}
FIGURE_FORMATS = ("png", "pdf")
TABLE_HEADERS = ["Method", "Kept share", "compression_ratio", "Accuracy", "Agreement with Full", "Budget r",
                 "Measured KV share", "Samples / task", "Commit", "Source", "Command"]
TABLE_WIDTHS = ["9%", "6%", "7%", "6%", "7%", "5%", "6%", "5%", "6%", "13%", "30%"]
EMBEDDED_MODELS = ("embedded", EMBEDDED_SLUG)
DEFAULT_TASK = "scene_qa"  # the headline's task, shown first
NO_BROWSER = ("No Chromium or Chrome found (set BROWSER_PATH or install chromium): the figure was not rendered "
              "as PNG/PDF; the CSV and JSON are ready.")


@dataclass(frozen=True)
class Selection:
    """One checked choice of every filter."""
    task: str | None
    model: str | None
    query_mode: str
    budget_mode: str
    metric: str

    def title(self) -> str:
        where = " · ".join(v for v in (self.task, self.model) if v) or "no stored results"
        return (f"{where}: {METRIC_NAMES[self.metric]} against KV budget "
                f"({QUERY_MODE_LABELS[self.query_mode]}, {BUDGET_MODE_LABELS[self.budget_mode]} budgets)")

    def slug(self) -> str:
        text = "-".join(str(v) for v in (self.task, self.model, self.query_mode, self.budget_mode, self.metric) if v)
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "leaderboard"

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "model": self.model, "query_mode": self.query_mode,
                "budget_mode": self.budget_mode, "metric": self.metric}


class LeaderboardView:
    """Needs the stored results (read once by the server), an export store for the downloads (one folder per
    client) and the methods' labels (the registry's, by name)."""

    def __init__(self, store: LeaderboardStore, exports: ExportStore, labels: Mapping[str, str]):
        self.store = store
        self.exports = exports
        self.labels = dict(labels)

    # -- the filters -------------------------------------------------------------------------------------------
    def choices(self) -> dict[str, list[tuple[str, str]]]:
        """(label, value) pairs of every filter, for the page's widgets."""
        return {"task": [(t, t) for t in self.store.values("task")],
                "model": [(m, m) for m in self.store.values("model")],
                "query_mode": [(QUERY_MODE_LABELS[q], q) for q in QUERY_MODES],
                "budget_mode": [(BUDGET_MODE_LABELS[b], b) for b in BUDGET_MODES],
                "metric": [(METRIC_NAMES[m], m) for m in METRICS]}

    def defaults(self) -> Selection:
        """The single-image scene task first where it is stored (the headline's), else the first task."""
        tasks, models = self.store.values("task"), self.store.values("model")
        modes = self.store.values("query_mode")
        task = DEFAULT_TASK if DEFAULT_TASK in tasks else (tasks[0] if tasks else None)
        return Selection(task, models[0] if models else None,
                         "query_aware" if "query_aware" in modes or not modes else modes[0], "published", "accuracy")

    def selection(self, task, model, query_mode, budget_mode, metric) -> Selection:
        """Every filter checked against what it may be; None takes the default."""
        d = self.defaults()
        return Selection(check_choice("task", task, self.store.values("task"), d.task),
                         check_choice("model", model, self.store.values("model"), d.model),
                         check_choice("query_mode", query_mode, QUERY_MODES, d.query_mode),
                         check_choice("budget_mode", budget_mode, BUDGET_MODES, d.budget_mode),
                         check_choice("metric", metric, METRICS, d.metric))

    def points(self, sel: Selection) -> list[LeaderboardPoint]:
        if sel.task is None or sel.model is None:
            return []
        return self.store.select(task=sel.task, model=sel.model, query_mode=sel.query_mode,
                                 budget_mode=sel.budget_mode)

    # -- what the tab shows ------------------------------------------------------------------------------------
    def figure(self, sel: Selection, points: list[LeaderboardPoint]):
        return leaderboard_figure(points, sel.metric, self.labels, title=sel.title())

    def table(self, points: list[LeaderboardPoint]) -> list[list[Any]]:
        def pct(v):
            return "" if v is None else f"{v:.1%}"

        return [[self.labels.get(p.method, p.method), pct(p.kept_share), ratio_text(p.compression_ratio),
                 "" if p.accuracy is None else p.accuracy, "" if p.agreement is None else p.agreement,
                 "" if p.budget is None else p.budget, pct(p.kv_share), p.samples or "", p.commit or "",
                 p.source, p.command or ""] for p in points]

    def note(self, sel: Selection, points: list[LeaderboardPoint]) -> str:
        lines = []
        if not points:
            lines.append(f"No stored results for {sel.title()}." + self._available(sel))
        else:
            sources = ", ".join(f"`{s}`" for s in sorted({p.source for p in points}))
            samples = [p.samples for p in points if p.samples]
            line = f"{len(points)} points, {len({p.method for p in points})} methods, from {sources}"
            if samples:
                n = min(samples)
                line += f"; {n} samples per task, so one answer moves a task's score by {100 / n:.2g} points"
            lines.append(line + ".")
        if sel.model in EMBEDDED_MODELS:
            lines.append("The embedded model sees synthetic scenes only: its rows are on the project's own scene "
                         "tasks, not on a public benchmark.")
        lines += [f"Not read: {p}" for p in self.store.problems[:5]]
        return "\n\n".join(lines)

    def _available(self, sel: Selection) -> str:
        there = sorted({(QUERY_MODE_LABELS.get(p.query_mode, p.query_mode),
                         BUDGET_MODE_LABELS.get(p.budget_mode, p.budget_mode))
                        for p in self.store.select(task=sel.task, model=sel.model)})
        return (" Stored for this task and model: " + "; ".join(f"{q}, {b}" for q, b in there) + ".") if there else ""

    def show(self, task=None, model=None, query_mode=None, budget_mode=None, metric=None):
        """The `leaderboard` event: (figure, table rows, note) for the chosen filters."""
        sel = self.selection(task, model, query_mode, budget_mode, metric)
        points = self.points(sel)
        return self.figure(sel, points), self.table(points), self.note(sel, points)

    # -- downloads ---------------------------------------------------------------------------------------------
    def export(self, task=None, model=None, query_mode=None, budget_mode=None, metric=None, formats=None,
               request: gr.Request = None):
        """The `leaderboard_export` event: the filtered rows as CSV and JSON and the figure in `formats`
        (PNG, PDF) for papers, in a fresh folder of this client's. Returns (files update, message)."""
        sel = self.selection(task, model, query_mode, budget_mode, metric)
        if formats is None:
            formats = list(FIGURE_FORMATS)
        if not isinstance(formats, (list, tuple)) or any(f not in FIGURE_FORMATS for f in formats):
            raise refuse(f"figure_formats must be a list of any of: {', '.join(FIGURE_FORMATS)}")
        points = self.points(sel)
        if not points:
            raise refuse(f"nothing to download: no stored results for {sel.title()}")
        folder = Path(self.exports.new_folder(self.owner(request)))
        base = f"leaderboard-{sel.slug()}"
        files = [folder / f"{base}.csv", folder / f"{base}.json"]
        files[0].write_text(points_csv(points))
        files[1].write_text(points_json(points, **sel.as_dict()))
        messages = []
        if formats:
            figures = [folder / f"{base}.{fmt}" for fmt in formats]
            if find_browser() is None:
                messages.append(NO_BROWSER)
            else:
                paper = paper_figure(self.figure(sel, points), width=760, height=480)
                err = write_static([(paper, path, fmt) for path, fmt in zip(figures, formats)])
                if err:
                    messages.append(f"{err}; the CSV and JSON are ready.")
                files += [p for p in figures if p.exists()]
        (folder / f"{base}-caption.md").write_text(f"{sel.title()}.\n\n{self.note(sel, points)}\n")
        files.append(folder / f"{base}-caption.md")
        names = ", ".join(p.name for p in files)
        return gr.update(value=[str(p) for p in files], visible=True), " ".join([f"**Written** {names}.", *messages])

    @staticmethod
    def owner(request: gr.Request | None) -> str:
        return str(getattr(request, "session_hash", None) or "local")

    def forget(self, request: gr.Request | None) -> None:
        """A client left: its download folder goes."""
        session_hash = getattr(request, "session_hash", None) if request is not None else None
        if session_hash:
            self.exports.forget(str(session_hash))
