"""The page's drawing: every output (panels, charts, overlay gallery, table) from a comparison and the tab's
view settings, in the order the page lists its outputs (`output_keys`)."""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Callable

import gradio as gr

from prefixkv_core.policies import REGISTRY

from . import charts
from .catalog import MethodCatalog
from .overlay_visuals import visuals_caption, visuals_overlay
from .panels import chat_messages, header_html, status_line
from .runstate import Comparison, SessionBox, Track


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(v * scale, spec)


def output_keys(methods: list[str]) -> list[str]:
    """The page's outputs in the order every handler returns them (app_builder.py lists its components so)."""
    return (["status"] + [f"head:{m}" for m in methods] + [f"chat:{m}" for m in methods]
            + ["bars", "lorenz", "memory", "latency", "quality", "gallery", "table", "results", "box"])


def _drawn_data(comp: Comparison) -> tuple[tuple, tuple]:
    """What the run's charts and table draw, in a form that changes whenever any of it does: (values, objects
    compared by identity): per method its latest telemetry event, how long its series are, each turn's status
    and answer length; the shared forward's steps and the budget. (Cheap: a few items per method.)"""
    values = tuple((m, len(t.series.steps), len(t.alone_series.steps),
                    tuple((turn.status, len(turn.answer or ""), turn.alone is not None and turn.alone.status)
                          for turn in t.turns))
                   for m, t in comp.tracks.items()) + (len(comp.batch.steps), comp.budget)
    return values, tuple(t.last for t in comp.tracks.values())


class FigureMemo:
    """The last figure of each chart of the recent comparisons, reused while what it draws is unchanged. Several
    visitors' redraws share the server's interpreter with the model (through the GIL), so a chart is built again
    only when its data changed: the final redraw of a run, a redraw with the charts' data as it was, and every
    run's first redraw (an empty comparison draws the same placeholders) cost a lookup instead. A key is (values
    compared with ==, objects compared by identity: an id alone may be reused once its object is gone)."""

    def __init__(self, size: int = 96):
        self.size = size
        self._entries: OrderedDict[tuple, tuple[tuple, tuple, Any]] = OrderedDict()

    def get(self, slot: tuple, key: tuple[tuple, tuple], build: Callable[[], Any]) -> Any:
        values, objects = key
        entry = self._entries.get(slot)
        if (entry is not None and entry[0] == values and len(entry[1]) == len(objects)
                and all(a is b for a, b in zip(entry[1], objects))):
            self._entries.move_to_end(slot)
            return entry[2]
        value = build()
        self._entries[slot] = (values, objects, value)
        self._entries.move_to_end(slot)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value


def _slot(comp: Comparison, name: str) -> tuple:
    """A chart of one comparison (its id and creation time: an id alone may be reused once it is gone)."""
    return (name, id(comp), comp.created)


class Renderer:
    """Draws the page. Needs the offered methods (`catalog`: names, labels, declarations) and how the vision
    tower crops an image (`crop`, so the overlay lies on what the model saw)."""

    def __init__(self, catalog: MethodCatalog, crop: Any):
        self.catalog = catalog
        self.crop = crop
        self.output_keys = output_keys(catalog.methods)
        self._idle_heads: dict[str, str] = {}
        self.memo = FigureMemo()

    def as_list(self, values: dict[str, Any]) -> list[Any]:
        """Named outputs in the page's order; an output not named is left as it is (gr.skip)."""
        return [values.get(k, gr.skip()) for k in self.output_keys]

    def idle_head(self, method: str) -> str:
        """The panel header of a method outside the run: its name and description (the same every time)."""
        cached = self._idle_heads.get(method)
        if cached is None:
            cached = self._idle_heads[method] = self.head(method, None)
        return cached

    def head(self, method: str, comp: Comparison | None) -> str:
        track = comp.tracks.get(method) if comp is not None else None
        summary, budget_note = self.catalog.summary(method), self.catalog.shows_budget_note(method)
        if track is None:  # not in this run (or no run yet): name, description, no badges
            return header_html(Track(method, self.catalog.labels[method]), summary, None, budget_note)
        return header_html(track, summary, comp, budget_note)

    def figures(self, comp: Comparison | None, box: SessionBox) -> dict[str, Any]:
        """Every chart of this comparison, keyed by its export name (each built again only when its data changed,
        `FigureMemo`; with no comparison, the placeholders, which `charts.placeholder` builds once)."""
        if comp is None:
            return {"retained-per-layer": self.bars(None), "lorenz": self.lorenz(None, box),
                    "kv-memory": charts.placeholder("KV-cache size while decoding"),
                    "latency": charts.placeholder("Per-token latency"),
                    "quality-vs-memory": charts.placeholder("Answer quality vs KV-cache size")}
        key = _drawn_data(comp)
        return {
            "retained-per-layer": self.bars(comp, key),
            "lorenz": self.lorenz(comp, box),
            "kv-memory": self.memo.get(_slot(comp, "kv-memory"), key, lambda: charts.memory_figure(comp.series())),
            "latency": self.memo.get(_slot(comp, "latency"), key, lambda: charts.latency_figure(
                comp.series(), comp.batch, comp.alone_series())),
            "quality-vs-memory": self.memo.get(_slot(comp, "quality"), key, lambda: charts.quality_figure(
                comp.quality_points())),
        }

    def bars(self, comp: Comparison | None, key: Any = None):
        if comp is None:
            return charts.placeholder("Retained KV entries per layer (share of the uncompressed cache)")
        key = _drawn_data(comp) if key is None else key
        return self.memo.get(_slot(comp, "bars"), key, lambda: charts.retained_bars(comp.latest(), budget=comp.budget))

    def lorenz(self, comp: Comparison | None, box: SessionBox):
        if comp is None or comp.prefill is None:
            return charts.placeholder("Importance retained vs tokens kept, per layer",
                                      "Run a comparison: the curves come from the shared prefill.")
        layers = box.lorenz_layers if box.lorenz_layers else charts.default_layers(comp.prefill.num_layers)
        budget = box.view_budget if box.view_budget is not None else comp.budget
        method = comp.lorenz_method  # the method whose allocation the chart draws (a policy's declared role)
        label = REGISTRY[method].label if method in REGISTRY else "the method"
        threshold, threshold_label = comp.threshold(), f"{label} threshold"
        importance = comp.curve_importance()  # the curves that method's allocation used, if it ran
        if abs(budget - comp.budget) > 1e-9 or threshold is None:
            if method in comp.tracks and abs(budget - comp.budget) <= 1e-9 and comp.active:
                threshold = None  # wait for the run's own threshold
            else:
                try:
                    threshold = charts.preview_threshold(importance, budget)
                    threshold_label = f"{label} threshold (preview)"
                except Exception:  # noqa: BLE001 - a preview is optional
                    threshold = None
        key = ((tuple(layers), budget, threshold, threshold_label, method), (comp.prefill, importance))
        return self.memo.get(_slot(comp, "lorenz"), key, lambda: charts.lorenz_figure(
            importance, layers, threshold=threshold, budget=budget, threshold_label=threshold_label, method=method,
            source=charts.curve_source(method, comp.knobs.get(method), comp.prefill.curves)))

    def gallery(self, comp: Comparison | None) -> list[tuple[Any, str]]:
        """Per method, its kept patches over every image and frame of the comparison, with a caption."""
        if comp is None or comp.shown is None or comp.overlay is None:
            return []
        key = ((comp.overlay.layer,), (comp.overlay, comp.shown))  # a sample replaces the maps, never edits them
        return self.memo.get(_slot(comp, "gallery"), key, lambda: self._gallery_items(comp))

    def _gallery_items(self, comp: Comparison) -> list[tuple[Any, str]]:
        items = []
        for m in comp.methods:
            share = comp.overlay.maps.get(m)
            if share is None:
                continue
            label = self.catalog.labels.get(m, m)
            items.append((visuals_overlay(comp.shown, share, m, self.crop),
                          visuals_caption(label, share, comp.overlay.layer, comp.shown)))
        return items

    def table(self, comp: Comparison | None) -> list[list[Any]]:
        if comp is None:
            return []
        rows = []
        for m in comp.methods:
            s = comp.method_summary(m)
            ratio = s["mean_kept_ratio"]
            alone = s["alone"] or {}
            rows.append([s["label"], _fmt(s["kv_mb"], ".3f"), _fmt(s["kv_ratio"], ".1f", 100), _fmt(ratio, ".2f"),
                         _fmt(s["rouge_l_vs_full"], ".3f"), _fmt(s["policy_ms_per_token"], ".2f"),
                         _fmt(s["compress_ms"], ".1f"), _fmt(alone.get("ttft_s"), ".0f", 1000),
                         _fmt(alone.get("tokens_per_s"), ".1f"), _fmt(s["speedup_vs_full"], ".2f"), s["status"]])
        return rows

    def render(self, comp: Comparison | None, box: SessionBox, phase: str | None, *, panels: bool = True,
               charts_: bool = True, lorenz: bool = True, overlay_: bool = True) -> list[Any]:
        with comp.lock if comp is not None else nullcontext():  # the engine feeds the record meanwhile
            return self.as_list(self._outputs(comp, box, phase, panels=panels, charts_=charts_, lorenz=lorenz,
                                               overlay_=overlay_))

    def _outputs(self, comp: Comparison | None, box: SessionBox, phase: str | None, *, panels: bool, charts_: bool,
                 lorenz: bool, overlay_: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"status": status_line(comp, phase), "box": box}
        if panels:
            for m in self.catalog.methods:
                in_run = comp is not None and m in comp.tracks
                # A method outside the run gets its idle panel again, not gr.skip(): gradio rebuilds the component
                # for every skipped output of an update (about 3 ms a chat panel), sixteen of them each redraw.
                out[f"head:{m}"] = self.head(m, comp) if in_run else self.idle_head(m)
                out[f"chat:{m}"] = chat_messages(comp.tracks[m]) if in_run else []
            out["results"] = comp.to_dict() if comp is not None else {}
        if charts_:
            figs = self.figures(comp, box)
            out.update(bars=figs["retained-per-layer"], memory=figs["kv-memory"], latency=figs["latency"],
                       quality=figs["quality-vs-memory"], table=self.table(comp))
            if lorenz:
                out["lorenz"] = figs["lorenz"]
        elif lorenz:
            out["lorenz"] = self.lorenz(comp, box)
        if overlay_:
            out["gallery"] = self.gallery(comp)
        return out

    def empty(self, box: SessionBox, phase: str | None = None) -> list[Any]:
        return self.render(None, box, phase)
