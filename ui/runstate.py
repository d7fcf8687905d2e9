"""Everything one browser session knows about its comparison: the engine's result record (answers per turn,
telemetry, series, ROUGE-L, `to_dict()`), plus what only the app needs: the engine session, the Stop flag,
the displayed image and the kept-patch overlay.

Plain Python fed with the engine's events (`apply`), so it is tested without a model or gradio.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from prefixkv_core.events import KeptImageMap, PrefillInfo
from prefixkv_core.record import ComparisonRecord, Series, Track, Turn

__all__ = ["Comparison", "OverlayMaps", "Series", "Track", "Turn"]


@dataclass
class OverlayMaps:
    """Per-method kept-head share of every image token at one layer, placed on the image's views
    (`prefixkv_core.events.KeptImageMap`; computed by the thread that owns the engine session, between two
    decoding steps)."""

    layer: int
    maps: dict[str, KeptImageMap | None]


class Comparison(ComparisonRecord):
    """One comparison in the app: the engine's record plus the session, Stop flag, image and overlay."""

    def __init__(self, methods: list[str], labels: dict[str, str], prompt: str, budget: float,
                 settings: dict[str, Any], knobs: dict[str, dict[str, Any]], image=None,
                 model: dict[str, Any] | None = None, budget_mode: str = "published", query_agnostic: bool = False,
                 alone: bool = False):
        self.cancel = threading.Event()
        super().__init__(methods, labels, prompt, budget, settings, knobs, model, budget_mode, query_agnostic,
                         alone=alone)
        self.image = image  # PIL image (display copy) or None
        self.session = None  # prefixkv_core.Session, set by the app once created
        self.overlay_layer = 0
        self.overlay: OverlayMaps | None = None
        self.created = time.time()

    def begin_turn(self, prompt: str) -> None:
        super().begin_turn(prompt)
        self.cancel = threading.Event()

    def apply(self, item: Any) -> None:
        if isinstance(item, OverlayMaps):
            self.overlay = item
            return
        super().apply(item)
        if isinstance(item, PrefillInfo) and item.num_layers:
            self.overlay_layer = min(self.overlay_layer, item.num_layers - 1)
