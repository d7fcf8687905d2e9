"""The handlers that only change a view of the finished (or running) comparison: the overlay's layer, the
Lorenz chart's layers and the budget slider's threshold preview. None of them runs the model."""
from __future__ import annotations

import gradio as gr

from prefixkv_core.policies import Budget, PolicyError

from .overlay_sampler import OverlaySampler
from .rendering import Renderer
from .runstate import SessionBox


class ViewControls:
    """Needs the renderer (to redraw the one output that changes), the overlay sampler and the model's
    layer count (every layer a client names is checked against it)."""

    def __init__(self, renderer: Renderer, overlay: OverlaySampler, num_layers: int):
        self.renderer = renderer
        self.overlay = overlay
        self.num_layers = int(num_layers)

    def set_overlay_layer(self, layer, box):
        if not isinstance(box, SessionBox):
            return gr.skip()
        try:
            box.overlay_layer = int(min(max(int(layer), 0), max(self.num_layers - 1, 0)))
        except (TypeError, ValueError, OverflowError):
            return gr.skip()
        comp = box.run
        if comp is None or comp.active:
            return gr.skip()  # while streaming, the worker samples the new layer within a moment
        snap = self.overlay.snapshot(comp, box)
        if snap is None:
            return gr.skip()
        comp.apply(snap)
        return self.renderer.gallery(comp)

    def set_lorenz_layers(self, layers, box):
        if not isinstance(box, SessionBox):
            return gr.skip()
        try:
            chosen = {int(x) for x in (layers or [])[: self.num_layers]}
        except (TypeError, ValueError, OverflowError):
            return gr.skip()
        box.lorenz_layers = sorted(x for x in chosen if 0 <= x < self.num_layers) or None
        return self.renderer.lorenz(box.run, box)

    def set_view_budget(self, budget, box):
        if not isinstance(box, SessionBox):
            return gr.skip()
        try:
            box.view_budget = float(Budget(budget))  # the slider's value, checked like every budget (plain for plotly)
        except PolicyError:
            return gr.skip()
        if box.run is None or box.run.prefill is None:
            return gr.skip()
        return self.renderer.lorenz(box.run, box)
