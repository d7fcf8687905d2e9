"""The leaderboard's figure, a pure function: stored points in, a Plotly figure out (no gradio, no files).

x is the share of the uncompressed KV cache a row really held: its measured KV share where the run recorded one
(an `[image]` row or a prompt-only method holds more than its r), else the kept share of kvpress's layout, 1 -
compression_ratio; y is the chosen metric; one line per method in the method's registry colour. Hovering a point shows how it was produced:
the command, the commit and the model."""
from __future__ import annotations

import html
import textwrap
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

from prefixkv_core.report.leaderboard import ratio_text

from .charts import _fig, _style, placeholder
from .theme import colour

METRIC_LABELS = {"accuracy": "accuracy (task metric × 100)", "agreement": "agreement with Full (% of answers)"}
X_TITLE = "share of Full's KV cache held (measured; else 1 − compression_ratio)"
HOVER = ("<b>%{meta}</b><br>held %{x:.1%} of Full's KV cache (compression_ratio %{customdata[0]})<br>"
         "%{customdata[1]}: %{y:.2f}<br>%{customdata[2]}<br>"
         "model: %{customdata[3]}<br>commit: %{customdata[4]}<br>command: %{customdata[5]}<extra></extra>")


def _wrapped(text: str | None, width: int = 72) -> str:
    """Text for a hover label: HTML-escaped (a command may hold '<this folder>'), broken into short lines."""
    if not text:
        return "unknown"
    return "<br>   ".join(html.escape(line) for line in textwrap.wrap(str(text), width) or [""])


def _run_line(p: Any) -> str:
    """The run behind a point: its budget, samples and measured KV share, as far as they are known."""
    parts = []
    if getattr(p, "budget", None) is not None:
        parts.append(f"r = {p.budget:g}")
    if getattr(p, "kv_share", None) is not None:
        parts.append(f"measured KV share {p.kv_share:.1%}")
    if getattr(p, "samples", None):
        parts.append(f"{p.samples} samples per task")
    return ", ".join(parts) or "run details not recorded"


def held_share(p: Any) -> float:
    """Where a point sits on x: its measured KV share, else its kept share (1 - compression_ratio)."""
    kv = getattr(p, "kv_share", None)
    return float(kv) if kv is not None else p.kept_share


def leaderboard_figure(points: Sequence[Any], metric: str = "accuracy", labels: Mapping[str, str] | None = None,
                       title: str = "Score against KV budget") -> go.Figure:
    """One line per method through its points (sorted by kept share), a single marker for a method with one
    point (Full, ZipVL), in the order of `labels`, each at `held_share`. `points` carry method, compression_ratio, kept_share, accuracy, agreement, budget,
    kv_share, samples, command, commit and produced_with (LeaderboardPoint); `labels` map method -> label."""
    if metric not in METRIC_LABELS:
        raise ValueError(f"metric must be one of {', '.join(METRIC_LABELS)}, got {metric!r}")
    labels = labels or {}
    metric_label = METRIC_LABELS[metric]
    scored = [p for p in points if getattr(p, metric) is not None]
    if not scored:
        return placeholder(title, "No stored results for these filters.", height=460)
    fig = _fig()
    by_method: dict[str, list[Any]] = {}
    for p in scored:
        by_method.setdefault(p.method, []).append(p)
    order = {m: i for i, m in enumerate(labels)}  # the registry's order when the labels come from it
    for method, pts in sorted(by_method.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        pts = sorted(pts, key=held_share)
        label = labels.get(method, method)
        custom = [[ratio_text(p.compression_ratio), metric_label.split(" (")[0], _wrapped(_run_line(p)),
                   _wrapped(p.produced_with), html.escape(p.commit or "unknown"), _wrapped(p.command)]
                  for p in pts]
        single = len(pts) == 1
        fig.add_scatter(x=[held_share(p) for p in pts], y=[getattr(p, metric) for p in pts], name=label,
                        mode="markers" if single else "lines+markers", meta=label, customdata=custom,
                        hovertemplate=HOVER, line=dict(color=colour(method), width=2),
                        marker=dict(color=colour(method), size=11 if single else 8,
                                    symbol="diamond" if single else "circle", line=dict(width=1, color="white")))
    return _style(fig, title, X_TITLE, metric_label, height=460, hovermode="closest",
                  xaxis=dict(range=[0, 1.05], tickformat=".0%"), yaxis=dict(range=[-3, 105]),
                  legend=dict(font=dict(size=11), bgcolor="rgba(255,255,255,0.6)", title=dict(text="method")))
