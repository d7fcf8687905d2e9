"""A tab's lifecycle around its runs: the click that queues a run, Stop, Clear, and what happens when a tab
closes or Gradio deletes its state. Also the one rule Compare and follow-up share with Stop: was the request
stopped while it waited in the queue?"""
from __future__ import annotations

import time
from typing import Callable

import gradio as gr

from . import queue_probe
from .export_store import ExportStore
from .rendering import Renderer
from .runstate import SessionBox
from .sessions import SessionRegistry


def stopped_while_queued(box: SessionBox) -> bool:
    """Was Stop pressed after this request joined the queue? Clears the browser's flag either way."""
    queued_at = queue_probe.enqueued_at()
    if queued_at is not None:
        stopped = box.stop_at is not None and box.stop_at >= queued_at
    else:  # a direct call, or a gradio without the queue's bookkeeping: the browser's own flag
        stopped = box.stop_requested
    box.stop_requested = False
    return stopped


class TabLifecycle:
    """Needs the session registry and the export store (what a tab holds, dropped when it goes), the renderer
    (Clear draws the empty page), `engine_busy()` (are as many runs going as may go at once?) and `queue_waiting(session)`
    (how many requests of that Gradio session wait for the model)."""

    def __init__(self, registry: SessionRegistry, exports: ExportStore, renderer: Renderer, *,
                 engine_busy: Callable[[], bool], queue_waiting: Callable[[str | None], int]):
        self.registry = registry
        self.exports = exports
        self.renderer = renderer
        self.engine_busy = engine_busy
        self.queue_waiting = queue_waiting

    def prepare(self, box: SessionBox):
        """Runs at once on click (not queued): a Stop from now on applies to the queued request."""
        box = box if isinstance(box, SessionBox) else SessionBox()
        box.pending = True
        box.stop_requested = False
        return ("Queued: as many users' runs as the server decodes at once are going; this one starts when one of "
                "them ends." if self.engine_busy() else "Starting…"), box

    def stop(self, box, request: gr.Request = None):
        if not isinstance(box, SessionBox):
            return "Nothing to stop: no comparison is running in this session."
        if box.run is not None and box.run.active:
            box.run.cancel.set()
            return "■ Stopping: every method finishes its current token…"
        box.stop_at = time.monotonic()
        session_hash = getattr(request, "session_hash", None) if request is not None else None
        if box.pending or self.queue_waiting(session_hash):
            box.stop_requested = True
            return "■ The queued request will not start."
        return "Nothing to stop: no comparison is running or waiting in this session."

    def clear(self, box, request: gr.Request = None):
        box = box if isinstance(box, SessionBox) else SessionBox()
        owner = box.owner_for(request)
        box.generation += 1
        if box.run is not None:
            box.run.cancel.set()
        self.registry.release_owner(owner)
        box.run, box.pending, box.stop_requested = None, False, False
        return [*self.renderer.empty(box), "", gr.update(value=None, visible=False), ""]

    def disconnected(self, request: gr.Request = None) -> None:
        """The client's connection closed (Gradio's unload event): drop its caches and its exports."""
        owner = getattr(request, "session_hash", None) if request is not None else None
        if owner:
            self.registry.release_owner(owner, reason="closed")
            self.exports.forget(owner)

    def forget_box(self, box) -> None:
        """Gradio deleted a session's state (an hour after it closed): drop whatever it still holds."""
        if isinstance(box, SessionBox) and box.owner:
            if box.run is not None:
                box.run.cancel.set()
            self.registry.release_owner(box.owner, reason="closed")
            self.exports.forget(box.owner)
            box.run = None
