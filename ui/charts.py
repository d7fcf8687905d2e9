"""Pure functions: engine data -> Plotly figures (no gradio, no torch state)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import torch

from prefixkv_core.lorenz import gini, retention_curves

from .theme import FONT, colour


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, font=FONT, template="plotly_white",
                      margin=dict(l=60, r=20, t=50, b=50), legend=dict(font=dict(size=11)))
    return fig


def retained_bars(events: dict) -> go.Figure:
    """Per-layer retained ratio per method; the image part solid, the text part hatched."""
    fig = go.Figure()
    for name, ev in events.items():
        if not ev.kept_per_layer or not ev.full_len:
            continue
        layers = list(range(len(ev.kept_per_layer)))
        img = np.asarray(ev.kept_image_per_layer, dtype=float) / ev.full_len
        txt = (np.asarray(ev.kept_per_layer, dtype=float) - np.asarray(ev.kept_image_per_layer)) / ev.full_len
        fig.add_bar(x=layers, y=img, name=f"{ev.label} · image", marker_color=colour(name), offsetgroup=name,
                    legendgroup=name)
        fig.add_bar(x=layers, y=txt, base=img, name=f"{ev.label} · text", marker_color=colour(name),
                    marker_pattern_shape="/", marker_opacity=0.55, offsetgroup=name, legendgroup=name)
    fig.update_layout(barmode="group", yaxis_range=[0, 1.05])
    return _layout(fig, "Retained KV entries per layer (share of the full cache)", "layer", "retained ratio")


def lorenz_figure(importance: np.ndarray, layers: list[int] | None = None, threshold: float | None = None,
                  budget: float | None = None) -> go.Figure:
    """Information-retention curves (tokens sorted by importance) per layer, Gini in the legend."""
    imp = torch.from_numpy(np.asarray(importance, dtype=np.float32))
    curves = retention_curves(imp).numpy()
    ginis = gini(imp).numpy()
    n_layers, n = curves.shape[0], curves.shape[1] - 1
    if layers is None:
        layers = sorted(set(np.linspace(0, n_layers - 1, min(6, n_layers)).round().astype(int).tolist()))
    x = np.arange(n + 1) / n
    fig = go.Figure()
    for l in layers:
        fig.add_scatter(x=x, y=curves[l], mode="lines", name=f"layer {l} (Gini {ginis[l]:.2f})")
    fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", name="uniform importance",
                    line=dict(dash="dot", color="#999"))
    if threshold is not None:
        fig.add_hline(y=threshold, line=dict(dash="dash", color=colour("prefixkv")),
                      annotation_text=f"PrefixKV threshold p = {threshold:.3f}")
    if budget is not None:
        fig.add_vline(x=budget, line=dict(dash="dot", color="#555"), annotation_text=f"budget r = {budget:.2f}")
    fig.update_layout(xaxis_range=[0, 1], yaxis_range=[0, 1.02])
    return _layout(fig, "Importance retained vs tokens kept (per layer)", "fraction of tokens kept (by importance)",
                   "fraction of importance retained")


def memory_figure(history: dict) -> go.Figure:
    """KV megabytes per method over decoding steps."""
    fig = go.Figure()
    for name, points in history.items():
        steps = [p[0] for p in points]
        fig.add_scatter(x=steps, y=[p[1] / 2**20 for p in points], mode="lines", name=name,
                        line=dict(color=colour(name)))
    return _layout(fig, "KV cache size while decoding", "generated tokens", "KV cache (MiB)")


def latency_figure(history: dict) -> go.Figure:
    fig = go.Figure()
    for name, points in history.items():
        fig.add_scatter(x=[p[0] for p in points], y=[p[2] * 1000 for p in points], mode="lines", name=name,
                        line=dict(color=colour(name)))
    return _layout(fig, "Per-token latency (model forward + policy)", "generated tokens", "ms per token")
