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
        consistent there), or once the run has ended."""
        if comp.shown is None or comp.session is None or comp.prefill is None or not comp.prefill.image_tokens:
            return None
        layer = self.layer_for(box)
        maps = {}
        for m in comp.methods:
            try:
                maps[m] = comp.session.kept_image_map(m, layer)
            except Exception:  # noqa: BLE001 - a failed method has no cache to show
                maps[m] = None
        return OverlayMaps(layer, maps)
