"""Which image patches each method's cache still holds, sampled for the overlay at the tab's chosen layer."""
from __future__ import annotations

from .runstate import Comparison, OverlayMaps, SessionBox


class OverlaySampler:
    """Needs only the model's layer count (the tab's layer is clamped to it)."""

    def __init__(self, num_layers: int):
        self.num_layers = int(num_layers)

    def layer_for(self, box: SessionBox) -> int:
        return int(min(max(box.overlay_layer, 0), self.num_layers - 1))

    def snapshot(self, comp: Comparison, box: SessionBox) -> OverlayMaps | None:
        """Runs on the thread that owns the engine session, between two decoding steps (the caches are
        consistent there), or once the run has ended. With the engine in its own process the sample is taken there
        between two of the turn's events, or skipped (None: the page keeps the last one) if none comes soon."""
        if comp.shown is None or comp.session is None or comp.prefill is None or not comp.prefill.image_tokens:
            return None
        layer = self.layer_for(box)
        maps = comp.session.kept_image_maps(comp.methods, layer)
        return None if maps is None else OverlayMaps(layer, maps)  # None: the engine had no moment for it now
