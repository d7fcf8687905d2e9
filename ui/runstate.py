"""Everything one browser session knows about its comparison: the engine session's own result record (answers
per turn, telemetry, series, ROUGE-L, `to_dict()`), read through, plus what only the app needs: the engine
session, the Stop flag, the displayed images and frames and the kept-patch overlay.

There is one record per run: the engine session feeds it with its events (on the worker thread that runs the
session, under `record.lock`) and the app reads it, taking the same lock while it redraws. Plain Python, so
it is tested without a model or gradio.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from prefixkv_core.report.events import KeptImageMap
from prefixkv_core.report.record import ComparisonRecord, Series, Track, Turn

__all__ = ["Comparison", "OverlayMaps", "SessionBox", "Series", "ShownVisuals", "Track", "Turn"]


@dataclass
class ShownVisuals:
    """The display copies of a comparison's images and video frames, in the order the model read them: `kinds`
    says which is which ("image" or "frame"), `times` a frame's time in its video (None for an image)."""

    images: list[Any]
    kinds: list[str]
    times: list[float | None]

    @property
    def single(self) -> bool:
        """One image and no video: drawn exactly as a lone image always was."""
        return self.kinds == ["image"]


@dataclass
class OverlayMaps:
    """Per-method kept-head share of every image token at one layer, placed on the image's views
    (`prefixkv_core.report.events.KeptImageMap`; computed by the thread that owns the engine session, between two
    decoding steps)."""

    layer: int
    maps: dict[str, KeptImageMap | None]


def _record_field(name: str, doc: str) -> property:
    """A field of the record that the app also writes: read and written on the one record."""
    return property(lambda self: getattr(self.record, name), lambda self, value: setattr(self.record, name, value),
                    doc=doc)


class Comparison:
    """One comparison in the app: the record the engine session feeds, read through (every attribute and method
    of `ComparisonRecord` not named here is the record's own), plus the session, the Stop flag, the image and the
    overlay. Only the names below can be written: a misspelt one raises AttributeError instead of landing
    anywhere."""

    __slots__ = ("record", "session", "cancel", "shown", "overlay", "created")

    active = _record_field("active", "a turn is being generated")
    error = _record_field("error", "a failure of the whole request, for the status line")
    alone = _record_field("alone", "every method is (also) decoded and timed on its own")

    def __init__(self, record: ComparisonRecord, session=None, image=None, shown: ShownVisuals | None = None):
        self.record = record
        self.session = session  # prefixkv_core.Session whose record this is (None once its caches are released)
        self.cancel = threading.Event()
        self.shown = shown  # display copies of the images and frames, or None (the record's `visuals` describe them)
        if image is not None:
            self.image = image
        self.overlay: OverlayMaps | None = None
        self.created = time.time()

    @property
    def image(self):
        """The first image (display copy) or None; setting one image (or None) replaces every visual."""
        return self.shown.images[0] if self.shown is not None and self.shown.images else None

    @image.setter
    def image(self, image) -> None:
        self.shown = None if image is None else ShownVisuals([image], ["image"], [None])

    def __getattr__(self, name: str) -> Any:  # only called for what this class does not hold itself
        if name in Comparison.__slots__:  # not set yet (a copy being built): never ask the record
            raise AttributeError(name)
        return getattr(self.record, name)

    def new_turn(self) -> None:
        """A follow-up is about to run: a fresh Stop flag (the session begins the record's turn itself)."""
        self.cancel = threading.Event()

    def apply(self, item: Any) -> None:
        """What the app's worker queues: an overlay snapshot is the app's own; the engine's events are already in
        the record (the session fed it), so they only tell the app that something changed."""
        if isinstance(item, OverlayMaps):
            self.overlay = item


class SessionBox:
    """Per-tab state kept in gr.State (a class default makes gradio build one per session)."""

    def __init__(self, overlay_layer: int = 0):
        self.run: Comparison | None = None
        self.generation = 0  # bumped by every new run and by Clear; a stale stream stops drawing
        self.pending = False  # a Compare/Ask click is waiting in the queue
        self.stop_requested = False
        self.lorenz_layers: list[int] | None = None
        self.overlay_layer = overlay_layer
        self.view_budget: float | None = None  # budget slider position, for the Lorenz preview
        self.owner: str | None = None  # the Gradio session this box belongs to (key in the registry)
        self.stop_at: float | None = None  # monotonic time of the last Stop with nothing running

    def owner_for(self, request) -> str:
        """The registry key of this box: its Gradio session (`request.session_hash`), or the box itself for a
        direct call."""
        session_hash = getattr(request, "session_hash", None) if request is not None else None
        if session_hash:
            self.owner = str(session_hash)
        elif self.owner is None:
            self.owner = f"local-{id(self)}"
        return self.owner
