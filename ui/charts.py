"""Pure functions: engine data in, Plotly figures out (no gradio, no session state).

Every figure uses the method colours of ui.theme, names its units on the axes and keeps
`uirevision` fixed, so a figure redrawn while tokens stream keeps the user's zoom.
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from prefixkv_core.report.record import MB, BatchSteps, Series  # noqa: F401 - part of this module's vocabulary

from .lorenz_np import bisect_threshold, gini, retention_curves
from .theme import FONT, GRID, colour, layer_colours, tint


def _fig() -> go.Figure:
    """An empty figure without a plotly template: templates cost ~25 ms per figure to copy and validate,
    which matters when charts redraw while tokens stream. _style() sets the few things a template would."""
    return go.Figure(layout=dict(template="none"))


AXIS = dict(gridcolor=GRID, showgrid=True, zeroline=False, ticks="outside", showline=True, linecolor="#888",
            tickcolor="#888", automargin=True)


def _merged(base: dict, extra: Mapping[str, Any]) -> dict:
    """`extra` merged into a copy of `base`, nested dicts key by key (as `update_layout` merges)."""
    out = dict(base)
    for key, value in extra.items():
        old = out.get(key)
        out[key] = _merged(old, value) if isinstance(value, Mapping) and isinstance(old, dict) else value
    return out


def _style(fig: go.Figure, title: str, x: str | None = None, y: str | None = None, height: int = 380,
           subplots: bool | None = False, **layout) -> go.Figure:
    """Title, fonts, white background, light grid: `fig` (freshly built by the caller) gets its whole layout in
    one assignment and is returned. Plotly validates a layout assigned at once in about a millisecond, while
    `update_layout` takes 10-20 ms, and a new figure from `fig.data` would validate every trace again (a fifth
    of a chart's cost; a redraw builds five charts while tokens stream)."""
    spec = dict(
        title=dict(text=title, x=0.01, xanchor="left", font=dict(size=15)),
        font=FONT, height=height, uirevision="keep", paper_bgcolor="white", plot_bgcolor="white",
        margin=dict(l=64, r=16, t=64, b=56), hoverlabel=dict(font_size=12),
        legend=dict(font=dict(size=11), bgcolor="rgba(255,255,255,0.6)"),
    )
    base = fig.layout.to_plotly_json()
    if subplots is None:  # the caller styles its own axes in `layout`
        pass
    elif subplots:  # every axis of the grid
        for key in [k for k in base if k.startswith(("xaxis", "yaxis"))]:
            base[key] = _merged(base[key], AXIS)
    else:
        spec["xaxis"] = dict(AXIS, **({"title": dict(text=x)} if x else {}), **layout.pop("xaxis", {}))
        spec["yaxis"] = dict(AXIS, **({"title": dict(text=y)} if y else {}), **layout.pop("yaxis", {}))
    spec.update(layout)
    fig.layout = _merged(base, spec)
    return fig


@functools.lru_cache(maxsize=64)
def placeholder(title: str, message: str = "Run a comparison to fill this chart.", height: int = 380) -> go.Figure:
    """An empty figure with a centred hint (one object per hint, shared: every run starts with these, and figures
    are never changed once built; exports copy them)."""
    fig = _fig()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=14, color="#777"))
    return _style(fig, title, height=height, xaxis=dict(visible=False), yaxis=dict(visible=False))


@functools.lru_cache(maxsize=32)
def _grid_layout(rows: int, cols: int, titled: int, options: tuple) -> dict:
    """The layout plotly's make_subplots gives a grid (axis domains, anchors, shared axes, one title annotation
    for each of the first `titled` cells), computed once per grid: make_subplots costs about 40 ms a call, most
    of a chart's redraw. `options`: make_subplots' keyword arguments as sorted (name, value) pairs."""
    titles = [f"title {i}" for i in range(titled)]
    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in options}
    return make_subplots(rows=rows, cols=cols, subplot_titles=titles, figure=_fig(), **kwargs).layout.to_plotly_json()


def _grid(rows: int, cols: int, titles: Sequence[str], **options) -> tuple[dict, Callable[[int, int], dict]]:
    """A fresh copy of the grid's layout with its cell titles set, and `cell(row, col)`: the axes a trace of
    that cell names (as make_subplots assigns them: cells numbered row by row from the top left)."""
    layout = copy.deepcopy(_grid_layout(rows, cols, len(titles), tuple(sorted(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))))
    for annotation, text in zip(layout.get("annotations", []), titles):
        annotation["text"] = text

    def cell(row: int, col: int) -> dict:
        k = (row - 1) * cols + col
        suffix = "" if k == 1 else str(k)
        return {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}

    return layout, cell


# -- per-layer retained ratio --------------------------------------------------------------------------------

def retained_bars(latest: Mapping[str, Any], budget: float | None = None, columns: int = 3) -> go.Figure:
    """Small multiples, one per method: per-layer retained share of the full cache, image part solid and
    text part hatched (stacked), so the bar height is the whole retained ratio of that layer.

    `latest` maps method name -> an object with label, kept_per_layer, kept_image_per_layer, full_len
    (a MethodEvent). Methods without per-layer data are left out."""
    items = [(m, ev) for m, ev in latest.items() if ev is not None and ev.kept_per_layer and ev.full_len]
    title = "Retained KV entries per layer (share of the uncompressed cache)"
    if not items:
        return placeholder(title)
    cols = max(1, min(columns, len(items)))
    rows = math.ceil(len(items) / cols)
    kept_all = [np.asarray(ev.kept_per_layer, dtype=float) for _, ev in items]
    subtitles = [f"<b>{ev.label}</b> · {k.mean() / ev.full_len:.0%} kept" for (_, ev), k in zip(items, kept_all)]
    grid, cell = _grid(rows, cols, subtitles, shared_yaxes=True, horizontal_spacing=0.04,
                       vertical_spacing=min(0.3, 0.5 / rows) if rows > 1 else 0.1)
    hover = ("%{meta}<br>layer %{x}<br>image: %{customdata[0]:.0f} entries<br>text: %{customdata[1]:.0f}"
             "<br>kept %{customdata[2]:.0f} of %{customdata[3]:.0f}<extra></extra>")
    traces, shapes = [], []
    layout: dict[str, Any] = {}
    for i, ((method, ev), kept) in enumerate(zip(items, kept_all)):
        r, c = i // cols + 1, i % cols + 1
        img = np.asarray(ev.kept_image_per_layer or [0] * len(kept), dtype=float)
        txt = kept - img
        layers = np.arange(len(kept))
        custom = np.stack([img, txt, kept, np.full_like(kept, ev.full_len)], axis=-1)
        col = colour(method)
        traces.append(go.Bar(x=layers, y=img / ev.full_len, name=f"{ev.label} · image", legendgroup="image",
                             showlegend=False, marker=dict(color=col, line=dict(width=0)), customdata=custom,
                             meta=ev.label, hovertemplate=hover, **cell(r, c)))
        traces.append(go.Bar(x=layers, y=txt / ev.full_len, name=f"{ev.label} · text", legendgroup="text",
                             showlegend=False, customdata=custom, meta=ev.label, hovertemplate=hover,
                             marker=dict(color=tint(col, 0.55), line=dict(width=0),
                                         pattern=dict(shape="/", fgcolor=col, size=5, solidity=0.25)),
                             **cell(r, c)))
        k = "" if i == 0 else str(i + 1)
        xa = dict(AXIS, showgrid=False)
        ya = dict(AXIS, range=[0, 1.05], tickformat=".0%")
        if c == 1:
            ya["title"] = dict(text="retained ratio")
        if i + cols >= len(items):
            xa["title"] = dict(text="layer")
        layout[f"xaxis{k}"], layout[f"yaxis{k}"] = xa, ya
        if budget is not None:
            shapes.append(dict(type="line", xref=f"x{k} domain", yref=f"y{k}", x0=0, x1=1, y0=budget, y1=budget,
                               line=dict(dash="dot", color="#555", width=1)))
    # legend keys: what solid and hatched mean, independent of the method colours
    traces.append(go.Bar(x=[None], y=[None], name="image tokens", marker=dict(color="#777"), legendgroup="image",
                         **cell(1, 1)))
    traces.append(go.Bar(x=[None], y=[None], name="text tokens", legendgroup="text",
                         marker=dict(color="#ddd", pattern=dict(shape="/", fgcolor="#777", size=5, solidity=0.25)),
                         **cell(1, 1)))
    if budget is not None:
        traces.append(go.Scatter(x=[None], y=[None], mode="lines", name=f"budget r = {budget:.2f}",
                                 line=dict(dash="dot", color="#555", width=1), **cell(1, 1)))
    annotations = grid.pop("annotations", [])
    for a, (method, _) in zip(annotations, items):  # subplot titles in the method colours
        a["font"] = dict(color=colour(method), size=13)
    fig = go.Figure(data=traces, layout=grid)
    return _style(fig, title, height=150 + 210 * rows, subplots=None, barmode="stack", bargap=0.15,
                  shapes=shapes, annotations=annotations,
                  legend=dict(orientation="h", yanchor="bottom", y=1.0 + 0.12 / rows, xanchor="right", x=1,
                              font=dict(size=11)),
                  **layout)


# -- Lorenz / information-retention curves -------------------------------------------------------------------

def default_layers(num_layers: int, k: int = 6) -> list[int]:
    """k evenly spaced layers from first to last (all of them when there are at most k)."""
    if num_layers <= k:
        return list(range(num_layers))
    return sorted(set(np.linspace(0, num_layers - 1, k).round().astype(int).tolist()))


def _thin(n_points: int, max_points: int) -> np.ndarray:
    if n_points <= max_points:
        return np.arange(n_points)
    return np.unique(np.linspace(0, n_points - 1, max_points).round().astype(int))


def curve_source(method: str | None, knobs: Mapping[str, Any] | None, curves: Mapping[str, Any] | None) -> str | None:
    """What the Lorenz method's curves were drawn from, when its knobs made them differ from the prefill's
    column sums with the sink counted (None otherwise, or when it reported no curves); the policy says it."""
    from prefixkv_core.policies import REGISTRY

    if method is None or not curves or curves.get(method) is None or method not in REGISTRY:
        return None
    return REGISTRY[method].curves_note(dict(knobs or {}))


def _label(method: str | None) -> str:
    from prefixkv_core.policies import REGISTRY

    return REGISTRY[method].label if method in REGISTRY else "the method"


def _role(role: str) -> str | None:
    from prefixkv_core.policies import role_method

    return role_method(role)


def _role_label(role: str) -> str:
    """The label of the method that plays `role` ("the reference" etc. when none does)."""
    from prefixkv_core.policies import role_label

    return role_label(role, f"the {role}")


def lorenz_figure(importance: np.ndarray, layers: Sequence[int] | None = None, threshold: float | None = None,
                  budget: float | None = None, threshold_label: str | None = None,
                  max_points: int = 400, source: str | None = None, method: str | None = None) -> go.Figure:
    """PrefixKV paper, Figure 2: per layer, the share of attention importance retained (y) when keeping the
    most important x share of tokens. The legend gives each layer's Gini coefficient. The diagonal is a
    perfectly uniform importance; the vertical line keeps the same ratio r in every layer (what uniform
    methods do) and the horizontal line keeps the same importance p in every layer (PrefixKV).

    `importance` [L, N]: the importance PrefixKV ranked by in this run (its scorer, without the sink when it
    leaves it out), else the prefill's column sums; `source` says which, in the title, when not the latter.
    `method`: the method whose threshold is drawn (default: the one that plays the "lorenz" role)."""
    method = method or _role("lorenz")
    label = _label(method)
    threshold_label = threshold_label or (f"{label} threshold" if method else "threshold")
    title = "Importance retained vs tokens kept, per layer" + (f" ({source})" if source else "")
    imp = np.asarray(importance, dtype=np.float32)
    if imp.ndim != 2 or imp.shape[1] == 0:
        return placeholder(title)
    curves = retention_curves(imp)
    ginis = gini(imp)
    n_layers, n = curves.shape[0], curves.shape[1] - 1
    layers = [int(l) for l in (layers if layers is not None else default_layers(n_layers)) if 0 <= int(l) < n_layers]
    idx = _thin(n + 1, max_points)
    x = idx / n
    traces = [go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="uniform importance (Gini 0)",
                         line=dict(dash="dot", color="#9a9a9a", width=1.5), hoverinfo="skip")]
    shapes = []  # given with the layout at once: add_vline/add_hline cost several ms each
    palette = layer_colours(len(layers))
    for l, col in zip(layers, palette):
        traces.append(go.Scatter(x=x, y=curves[l, idx], mode="lines", name=f"layer {l} (Gini {ginis[l]:.2f})",
                                 line=dict(color=col, width=2.2), legendgroup=f"L{l}",
                                 hovertemplate=f"layer {l}<br>tokens kept %{{x:.1%}}<br>importance retained "
                                               "%{y:.1%}<extra></extra>"))
    if budget is not None:
        shapes.append(dict(type="line", x0=budget, x1=budget, xref="x", y0=0, y1=1, yref="y domain",
                           line=dict(dash="dash", color="#555", width=1.2)))
        traces.append(go.Scatter(x=[None], y=[None], mode="lines", name=f"same ratio r = {budget:.2f} in every layer",
                                 line=dict(dash="dash", color="#555", width=1.2)))
        k = min(n, max(0, int(round(budget * n))))
        traces.append(go.Scatter(x=[k / n] * len(layers), y=[float(curves[l, k]) for l in layers], mode="markers",
                                 marker=dict(color=palette, size=8, symbol="circle-open", line=dict(width=2)),
                                 showlegend=False, hovertemplate="ratio r keeps %{y:.1%} of this layer's importance"
                                                                 "<extra></extra>"))
    if threshold is not None:
        col = colour(method) if method else "#555"
        shapes.append(dict(type="line", x0=0, x1=1, xref="x domain", y0=threshold, y1=threshold, yref="y",
                           line=dict(dash="dash", color=col, width=1.5)))
        traces.append(go.Scatter(x=[None], y=[None], mode="lines", name=f"{threshold_label} p = {threshold:.3f}",
                                 line=dict(dash="dash", color=col, width=1.5)))
        cross = [int(np.argmax(curves[l] >= threshold - 1e-7)) / n for l in layers]
        traces.append(go.Scatter(x=cross, y=[threshold] * len(layers), mode="markers", showlegend=False,
                                 marker=dict(color=palette, size=8, symbol="diamond", line=dict(width=1, color=col)),
                                 hovertemplate=f"{label} keeps %{{x:.1%}} of this layer<extra></extra>"))
    fig = go.Figure(data=traces, layout=dict(template="none"))
    return _style(fig, title, "tokens kept, most important first (share of N)", "importance retained (share)",
                  height=420, xaxis=dict(range=[0, 1], tickformat=".0%"), yaxis=dict(range=[0, 1.02], tickformat=".0%"),
                  legend=dict(x=1.02, y=1.0, xanchor="left", yanchor="top", font=dict(size=11)),
                  **({"shapes": shapes} if shapes else {}))


def preview_threshold(importance: np.ndarray, budget: float) -> float:
    """The retention threshold PrefixKV's bisection would pick for this prefill at `budget` (uncalibrated,
    without the engine's protected tokens): lets the budget slider move the threshold line before a run."""
    return bisect_threshold(np.asarray(importance, dtype=np.float32), budget)


# -- memory and latency over decoding ------------------------------------------------------------------------

def memory_figure(series: Mapping[str, Series], reference: str | None = None) -> go.Figure:
    """KV-cache megabytes per method after every generated token (all turns), with the uncompressed size
    (`reference`: the uncompressed method, default the one that plays the "reference" role)."""
    reference = reference or _role("reference")
    title = "KV-cache size while decoding"
    series = {m: s for m, s in series.items() if s.steps}
    if not series:
        return placeholder(title)
    fig = _fig()
    if reference not in series:  # the uncompressed size, from the longest series
        ref = max(series.values(), key=lambda s: len(s.steps))
        fig.add_scatter(x=ref.steps, y=np.asarray(ref.full_kv_bytes) / MB, mode="lines", name="uncompressed",
                        line=dict(color="#9a9a9a", dash="dot", width=1.5),
                        hovertemplate="uncompressed<br>token %{x}<br>%{y:.2f} MB<extra></extra>")
    for method, s in series.items():
        fig.add_scatter(x=s.steps, y=np.asarray(s.kv_bytes) / MB, mode="lines", name=s.label,
                        line=dict(color=colour(method), width=2.2, shape="hv"), customdata=s.turn,
                        hovertemplate=f"{s.label}<br>token %{{x}} (turn %{{customdata}})<br>%{{y:.3f}} MB"
                                      "<extra></extra>")
    return _style(fig, title, "generated tokens (all turns)", "KV cache (MB)", yaxis=dict(rangemode="tozero"))


def _decode_steps(s: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token index, forward s, policy s) of the decode steps (a turn's first token comes from the prefill)."""
    lat, pol, steps = (np.asarray(x, dtype=float) for x in (s.latency_s, s.policy_s, s.steps))
    ok = lat > 0
    return steps[ok], lat[ok], pol[ok]


def latency_figure(series: Mapping[str, Series], batch: BatchSteps | None = None,
                   alone: Mapping[str, Series] | None = None) -> go.Figure:
    """Per-token latency that tells the methods apart.

    Timed alone (`alone`: each method decoded on its own): one line per method, its forward + its policy's
    time, with the batched run's shared step for reference. Batched only: the batch's shared forward once (it
    is not any one method's cost) over each method's own policy time per token."""
    alone = {m: s for m, s in (alone or {}).items() if (np.asarray(s.latency_s, dtype=float) > 0).any()}
    batched = batch is not None and len(batch.steps) > 0
    if alone:
        title = "Per-token latency, each method decoded alone (forward + its policy)"
        fig = _fig()
        if batched:
            fig.add_scatter(x=batch.steps, y=np.asarray(batch.forward_s) * 1000, mode="lines",
                            name="batched run: one forward, shared", customdata=batch.batch_size,
                            line=dict(color="#9a9a9a", dash="dot", width=1.5),
                            hovertemplate="batched step %{x}<br>forward %{y:.1f} ms, shared by %{customdata} "
                                          "methods<extra></extra>")
        for method, s in alone.items():
            steps, lat, pol = _decode_steps(s)
            fig.add_scatter(x=steps, y=(lat + pol) * 1000, mode="lines+markers", name=s.label,
                            line=dict(color=colour(method), width=1.6), marker=dict(size=3),
                            customdata=np.stack([lat * 1000, pol * 1000], axis=-1),
                            hovertemplate=f"{s.label} alone<br>token %{{x}}<br>%{{y:.1f}} ms (forward "
                                          "%{customdata[0]:.1f} + policy %{customdata[1]:.2f})<extra></extra>")
        return _style(fig, title, "generated tokens (all turns)", "latency per token (ms)",
                      yaxis=dict(rangemode="tozero"))
    title = "Per-token latency of the batched run: the shared forward, and each method's own policy time"
    points = {m: _decode_steps(s) for m, s in series.items()}
    points = {m: p for m, p in points.items() if p[0].size}
    if not batched and not points:
        return placeholder(title)
    grid, cell = _grid(2, 1, ["one forward per step, shared by the batch", "each method's own policy time"],
                       shared_xaxes=True, vertical_spacing=0.12, row_heights=[0.45, 0.55])
    traces = []
    if batched:
        traces.append(go.Scatter(x=batch.steps, y=np.asarray(batch.forward_s) * 1000, mode="lines+markers",
                                 name="shared forward", line=dict(color="#555", width=1.6), marker=dict(size=3),
                                 customdata=batch.batch_size, **cell(1, 1),
                                 hovertemplate="step %{x}<br>forward %{y:.1f} ms, shared by %{customdata} methods"
                                               "<extra></extra>"))
    for method, (steps, _, pol) in points.items():
        s = series[method]
        traces.append(go.Scatter(x=steps, y=pol * 1000, mode="lines+markers", name=s.label, **cell(2, 1),
                                 line=dict(color=colour(method), width=1.6), marker=dict(size=3),
                                 hovertemplate=f"{s.label}<br>token %{{x}}<br>policy %{{y:.2f}} ms<extra></extra>"))
    for a in grid.get("annotations", []):
        a["font"] = dict(size=12, color="#555")
    grid["yaxis"].update(rangemode="tozero", title=dict(text="forward (ms)"))
    grid["yaxis2"].update(rangemode="tozero", title=dict(text="policy (ms)"))
    grid["xaxis2"].update(title=dict(text="generated tokens (all turns)"))
    fig = go.Figure(data=traces, layout=grid)
    return _style(fig, title, height=460, subplots=True)


def _shared_labels(points: Mapping[str, tuple[str, float, float]], near: float = 0.04) -> dict[str, str]:
    """One label per cluster of points that sit on top of each other (within `near` on both axes):
    the first point of a cluster carries "A · B · C", the others none, so labels never overprint."""
    clusters: list[list[str]] = []
    for method, (_, x, y) in points.items():
        for cl in clusters:
            _, x0, y0 = points[cl[0]]
            if abs(x - x0) <= near and abs(y - y0) <= near:
                cl.append(method)
                break
        else:
            clusters.append([method])
    texts = {}
    for cl in clusters:
        texts[cl[0]] = " · ".join(points[m][0] for m in cl)
        texts.update({m: "" for m in cl[1:]})
    return texts


def quality_figure(points: Mapping[str, tuple[str, float, float | None]]) -> go.Figure:
    """Quality vs memory: final KV share of full (x) against ROUGE-L to the Full answer (y), per method.
    `points` maps method -> (label, kv_ratio, rouge or None)."""
    title = "Answer quality vs KV-cache size"
    pts = {m: p for m, p in points.items() if p[2] is not None}
    if not pts:
        ref = _role_label("reference")
        return placeholder(title, f"Select {ref} and let the answers finish to compare quality.")
    fig = _fig()
    texts = _shared_labels(pts)
    for method, (label, ratio, rouge) in pts.items():
        fig.add_scatter(x=[ratio], y=[rouge], mode="markers+text", name=label, text=[texts[method]],
                        textposition="top center", textfont=dict(size=11, color=colour(method)),
                        marker=dict(color=colour(method), size=12, line=dict(width=1, color="white")),
                        hovertemplate=f"{label}<br>KV %{{x:.1%}} of full<br>ROUGE-L %{{y:.3f}}<extra></extra>")
    return _style(fig, title, "KV cache (share of uncompressed)", f"ROUGE-L F1 vs {_role_label('reference')}",
                  showlegend=False,
                  xaxis=dict(range=[0, 1.08], tickformat=".0%"), yaxis=dict(range=[0, 1.08]))
