"""What the app's events do, wired by app_builder.py to one Controller. The Controller is built from small
objects, each given what it needs in its constructor:

- `MethodCatalog` (catalog.py): the offered methods, their labels and declarations;
- `Renderer(catalog, crop)` (rendering.py): every output of the page;
- `OverlaySampler(num_layers)` (overlay_sampler.py): the kept-patch maps of a comparison;
- `RunStreamer(renderer, registry, overlay)` (run_stream.py): one run on a worker thread, redrawn at a steady pace;
- `Turns(engine, registry, streamer, methods=, knob_specs=, max_new_tokens=, limits=, image_roots=)` (turns.py):
  Compare and follow-up;
- `TabLifecycle(registry, exports, renderer, engine_busy=, queue_waiting=)` (lifecycle.py): the queued click,
  Stop, Clear, closed tabs;
- `ViewControls(renderer, overlay, num_layers)` (view_controls.py): the handlers that only change a view;
- `Exporter(renderer, exports)` (exporting.py);
- `LeaderboardView(store, exports, labels)` (leaderboard_view.py): the Leaderboard tab, on the stored results
  (`prefixkv_core.report.leaderboard_store`), with an export store of its own for its downloads.

The Controller builds them and offers their handlers under the names app_builder.py and the API use. It also
holds the controller's static facts and the order of the outputs (`output_keys`).

Each browser tab keeps one SessionBox in a gr.State: the current Comparison (the engine session and the result
record it feeds, so follow-ups continue every method's own cache) and the tab's view preferences. Every request
passes the checks in inputs.py and the limits in prefixkv_core.limits before it reaches the engine; the
SessionRegistry decides how long the engine Sessions keep their caches (sessions.py).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator

import gradio as gr

from prefixkv_core.limits import Limits
from prefixkv_core.policies import describe, role_label
from prefixkv_core.report.leaderboard_store import LeaderboardStore, load_leaderboard

from . import queue_probe
from .catalog import MethodCatalog, model_facts
from .export_store import ExportStore
from .exporting import Exporter
from .inputs import DEFAULT_LIMITS, KnobSpec, upload_folder
from .leaderboard_view import LeaderboardView
from .lifecycle import TabLifecycle
from .overlay import crops_to_square
from .overlay_sampler import OverlaySampler
from .panels import banner_markdown
from .rendering import Renderer
from .run_stream import CHART_EVERY_S, OVERLAY_EVERY_S, TEXT_EVERY_S, RunStreamer
from .runstate import Comparison, SessionBox
from .sessions import SessionRegistry
from .turns import OVERLAY_DISPLAY_SIDE, Turns
from .view_controls import ViewControls

__all__ = ["Controller", "SessionBox", "BoxReaper", "TABLE_HEADERS", "table_headers", "FIGURE_NAMES", "ENGINE_QUEUE",
           "TEXT_EVERY_S", "CHART_EVERY_S", "OVERLAY_EVERY_S", "OVERLAY_DISPLAY_SIDE"]

ENGINE_QUEUE = "engine"  # the concurrency id of Compare and follow-ups (app_builder.py)


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


class Controller:
    """Builds the pieces (see the module's docstring) and offers their handlers; holds no run logic itself."""

    def __init__(self, engine, methods: list[str], max_new_tokens_limit: int, knob_specs: list[KnobSpec], *,
                 limits: Limits = DEFAULT_LIMITS, registry: SessionRegistry | None = None,
                 exports: ExportStore | None = None, image_roots: Callable[[], list[str]] | None = None,
                 leaderboard: LeaderboardStore | None = None):
        self.engine = engine
        self.loaded = engine.loaded
        self.limit = int(max_new_tokens_limit)
        self.knob_specs = knob_specs
        self.limits = limits
        self.registry = registry or SessionRegistry(limits)
        self.exports = exports or ExportStore()
        self.image_roots = image_roots or (lambda: [upload_folder()])
        self.blocks = None  # the Blocks, once built (for queue_probe)
        self.catalog = MethodCatalog(methods)
        self.renderer = Renderer(self.catalog, crops_to_square(getattr(self.loaded.processor, "image_processor", None)))
        overlay = OverlaySampler(self.num_layers)
        self.streamer = RunStreamer(self.renderer, self.registry, overlay)
        self.turns = Turns(engine, self.registry, self.streamer, methods=self.catalog.methods,
                           knob_specs=knob_specs, max_new_tokens=self.limit, limits=limits,
                           image_roots=self.image_roots)
        self.tabs = TabLifecycle(self.registry, self.exports, self.renderer, engine_busy=self._no_place_left,
                                 queue_waiting=self._queue_waiting)
        self.views = ViewControls(self.renderer, overlay, self.num_layers)
        self.exporter = Exporter(self.renderer, self.exports)
        self.leaderboard = LeaderboardView(leaderboard if leaderboard is not None else load_leaderboard(),
                                           ExportStore(max_folders=8), {d["name"]: d["label"] for d in describe()})

    # -- static facts ------------------------------------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        return self.catalog.methods

    @property
    def labels(self) -> dict[str, str]:
        return self.catalog.labels

    @property
    def described(self) -> dict[str, dict[str, Any]]:
        return self.catalog.described

    @property
    def crop(self) -> Any:
        return self.renderer.crop

    @property
    def output_keys(self) -> list[str]:
        return self.renderer.output_keys

    @property
    def num_layers(self) -> int:
        return int(self.loaded.num_layers)

    def model_info(self) -> dict[str, Any]:
        return model_facts(self.loaded)

    def banner(self) -> str:
        return banner_markdown(self.model_info())

    def summary(self, method: str) -> str:
        return self.catalog.summary(method)

    def visibility(self, methods) -> list[Any]:
        chosen = set(methods or [])
        return [gr.update(visible=m in chosen) for m in self.methods]

    def _no_place_left(self) -> bool:
        """As many runs going as the server decodes at once (a new one waits in the queue)."""
        return self.registry.running() >= self.limits.max_batch_users

    def _queue_waiting(self, session_hash: str | None) -> int:
        return queue_probe.waiting(self.blocks, session_hash, ENGINE_QUEUE)

    # -- runs (generators: gradio streams a handler only if the function itself is one) ------------------------
    def compare(self, image, prompt, methods, budget, max_new_tokens, do_sample=False, temperature=0.7, top_p=0.9,
                seed=0, box=None, request: gr.Request = None, equal_memory=False, query_agnostic=False,
                time_alone=False, images=None, video=None, frames=None, **knob_values) -> Iterator[list[Any]]:
        yield from self.turns.compare(image, prompt, methods, budget, max_new_tokens, do_sample, temperature, top_p,
                                      seed, box, request, equal_memory=equal_memory, query_agnostic=query_agnostic,
                                      time_alone=time_alone, images=images, video=video, frames=frames,
                                      **knob_values)

    def follow_up(self, question, box=None, request: gr.Request = None) -> Iterator[list[Any]]:
        yield from self.turns.follow_up(question, box, request)

    # -- a tab's lifecycle -------------------------------------------------------------------------------------
    def prepare(self, box: SessionBox):
        return self.tabs.prepare(box)

    def stop(self, box, request: gr.Request = None):
        return self.tabs.stop(box, request)

    def clear(self, box, request: gr.Request = None):
        return self.tabs.clear(box, request)

    def disconnected(self, request: gr.Request = None) -> None:
        self.tabs.disconnected(request)
        self.leaderboard.forget(request)

    def forget_box(self, box) -> None:
        self.tabs.forget_box(box)

    # -- views and export --------------------------------------------------------------------------------------
    def set_overlay_layer(self, layer, box):
        return self.views.set_overlay_layer(layer, box)

    def set_lorenz_layers(self, layers, box):
        return self.views.set_lorenz_layers(layers, box)

    def set_view_budget(self, budget, box):
        return self.views.set_view_budget(budget, box)

    def export(self, formats, box, request: gr.Request = None):
        return self.exporter.export(formats, box, request)

    def export_images(self, comp: Comparison) -> dict[str, Any]:
        return self.exporter.images(comp)

    # -- the Leaderboard tab -----------------------------------------------------------------------------------
    def show_leaderboard(self, task=None, model=None, query_mode=None, budget_mode=None, metric=None):
        return self.leaderboard.show(task, model, query_mode, budget_mode, metric)

    def export_leaderboard(self, task=None, model=None, query_mode=None, budget_mode=None, metric=None,
                           formats=None, request: gr.Request = None):
        return self.leaderboard.export(task, model, query_mode, budget_mode, metric, formats, request)

    # -- drawing -----------------------------------------------------------------------------------------------
    def head(self, method: str, comp: Comparison | None) -> str:
        return self.renderer.head(method, comp)

    def figures(self, comp: Comparison | None, box: SessionBox) -> dict[str, Any]:
        return self.renderer.figures(comp, box)

    def bars(self, comp: Comparison | None):
        return self.renderer.bars(comp)

    def lorenz(self, comp: Comparison | None, box: SessionBox):
        return self.renderer.lorenz(comp, box)

    def gallery(self, comp: Comparison | None) -> list[tuple[Any, str]]:
        return self.renderer.gallery(comp)

    def table(self, comp: Comparison | None) -> list[list[Any]]:
        return self.renderer.table(comp)

    def render(self, comp: Comparison | None, box: SessionBox, phase: str | None, *, panels: bool = True,
               charts_: bool = True, lorenz: bool = True, overlay_: bool = True) -> list[Any]:
        return self.renderer.render(comp, box, phase, panels=panels, charts_=charts_, lorenz=lorenz,
                                    overlay_=overlay_)

    def empty(self, box: SessionBox, phase: str | None = None) -> list[Any]:
        return self.renderer.empty(box, phase)
