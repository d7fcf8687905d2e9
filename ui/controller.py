"""What the app's events do, wired by app_builder.py to one Controller. Its jobs live in their own modules and
are mixed in here: `rendering.py` (every output, and the view-only handlers), `run_stream.py` (a run on a
worker thread, redrawn at a steady pace), `lifecycle.py` (Compare, follow-up, Stop, Clear, closed tabs) and
`exporting.py`. This module holds the controller's static facts and the order of the outputs (`output_keys`).

Each browser tab keeps one SessionBox in a gr.State: the current Comparison (the engine session and the result
record it feeds, so follow-ups continue every method's own cache) and the tab's view preferences. Every request
passes the checks in inputs.py and the limits in prefixkv_core.limits before it reaches the engine; the
SessionRegistry decides how long the engine Sessions keep their caches (sessions.py).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import gradio as gr

from prefixkv_core import describe
from prefixkv_core.policies import role_label
from prefixkv_core.limits import Limits

from .export_store import ExportStore
from .exporting import Exporting
from .inputs import DEFAULT_LIMITS, KnobSpec, upload_folder
from .lifecycle import ENGINE_QUEUE, OVERLAY_DISPLAY_SIDE, Lifecycle
from .overlay import crops_to_square
from .panels import banner_markdown
from .rendering import Rendering
from .run_stream import CHART_EVERY_S, OVERLAY_EVERY_S, TEXT_EVERY_S, Streaming
from .runstate import SessionBox
from .sessions import SessionRegistry

__all__ = ["Controller", "SessionBox", "BoxReaper", "TABLE_HEADERS", "table_headers", "FIGURE_NAMES", "ENGINE_QUEUE",
           "TEXT_EVERY_S", "CHART_EVERY_S", "OVERLAY_EVERY_S", "OVERLAY_DISPLAY_SIDE"]



def table_headers() -> list[str]:
    """The metrics table's columns: the method's own policy time (batched or alone), then what it costs decoded
    on its own (Time each method alone). ROUGE-L and the speed-up name the method they are measured against (the
    one whose policy plays the "reference" role)."""
    ref = role_label("reference", "reference")
    return ["Method", "KV (MB)", "KV % of full", "Kept ratio", f"ROUGE-L vs {ref}", "Policy (ms/token)",
            "Compress (ms)", "TTFT alone (ms)", "tok/s alone", f"× {ref} (alone)", "Status"]


TABLE_HEADERS = table_headers()  # the reference is a built-in method, so its label does not change
FIGURE_NAMES = ("retained-per-layer", "lorenz", "kv-memory", "latency", "quality-vs-memory")


class BoxReaper:
    """The gr.State's delete_callback. Gradio copies a component's arguments (deeply, on page loads), so this
    holds the controller by a weak reference: copying a bound method would copy the model with it."""

    def __init__(self, controller: "Controller"):
        self._controller = weakref.ref(controller)

    def __call__(self, box) -> None:
        controller = self._controller()
        if controller is not None:
            controller.forget_box(box)


class Controller(Lifecycle, Streaming, Exporting, Rendering):
    def __init__(self, engine, methods: list[str], max_new_tokens_limit: int, knob_specs: list[KnobSpec], *,
                 limits: Limits = DEFAULT_LIMITS, registry: SessionRegistry | None = None,
                 exports: ExportStore | None = None, image_roots: Callable[[], list[str]] | None = None):
        self.engine = engine
        self.loaded = engine.loaded
        self.methods = list(methods)
        self.limit = int(max_new_tokens_limit)
        self.knob_specs = knob_specs
        self.limits = limits
        self.registry = registry or SessionRegistry(limits)
        self.exports = exports or ExportStore()
        self.image_roots = image_roots or (lambda: [upload_folder()])
        self.blocks = None  # the Blocks, once built (for queue_probe)
        self.described = {d["name"]: d for d in describe()}
        self.labels = {m: self.described[m]["label"] for m in self.methods}
        self.crop = crops_to_square(getattr(self.loaded.processor, "image_processor", None))
        self.output_keys = (["status"] + [f"head:{m}" for m in self.methods] + [f"chat:{m}" for m in self.methods]
                            + ["bars", "lorenz", "memory", "latency", "quality", "gallery", "table", "results", "box"])

    @property
    def num_layers(self) -> int:
        return int(self.loaded.num_layers)

    def model_info(self) -> dict[str, Any]:
        ld = self.loaded
        return {"name": ld.name, "slug": ld.slug, "device": str(ld.device), "dtype": str(ld.dtype).replace("torch.", ""),
                "num_layers": ld.num_layers, "image_tokens": ld.image_seq_length, "max_context": ld.max_context,
                "vision_trained": ld.vision_trained, "notes": list(ld.notes)}

    def banner(self) -> str:
        return banner_markdown(self.model_info())

    def summary(self, method: str) -> str:
        """The method's stage (where it saves memory) and schedule (when), from its declaration."""
        d = self.described[method]
        return "no compression" if d["stage"] == "none" else f"{d['stage']} · {d['schedule']}"

    def visibility(self, methods) -> list[Any]:
        chosen = set(methods or [])
        return [gr.update(visible=m in chosen) for m in self.methods]
