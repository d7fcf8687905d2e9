"""What the app's events do: validate, start the engine on a worker thread, turn its events into
throttled UI updates, and handle stop / clear / follow-up / overlay / Lorenz / export.

The Blocks layout lives in app_builder.py; this module knows the order of the outputs (OUTPUT_KEYS) and
fills them. Each browser tab keeps one SessionBox in a gr.State: the current Comparison (with the engine
Session, so follow-ups continue every method's own cache) and the tab's view preferences.

Every request passes the checks in inputs.py and the limits in prefixkv_core.limits before it reaches the
engine; the SessionRegistry decides how long the engine Sessions keep their caches (sessions.py).
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Iterator

import gradio as gr

from prefixkv_core import EngineError, GenerationSettings, describe
from prefixkv_core.policies import REGISTRY
from prefixkv_core.limits import (LimitError, Limits, check_followup, check_prompt, estimate_run_bytes,
                                  kv_bytes_per_token)

from . import charts, queue_probe
from .export import ALL_FORMATS, export_all
from .export_store import ExportStore
from .inputs import (DEFAULT_LIMITS, KnobSpec, check_budget_mode, check_query_agnostic, check_request, check_sampling,
                     check_switch, collect_knobs, downscale, refuse, upload_folder)
from .overlay import caption, crops_to_square, overlay
from .panels import banner_markdown, chat_messages, header_html, status_line
from .runstate import Comparison, OverlayMaps, Track
from .sessions import SessionRegistry
from .streaming import StreamWorker

log = logging.getLogger(__name__)

TEXT_EVERY_S = 0.25  # panels (answers, badges) refresh at most this often while streaming
CHART_EVERY_S = 1.0  # charts refresh at most this often; the final state is always drawn
OVERLAY_EVERY_S = 1.5  # the worker samples the kept-patch maps this often
OVERLAY_DISPLAY_SIDE = 1024
# the method's own policy time (batched or alone), then what it costs decoded on its own (Time each method alone)
TABLE_HEADERS = ["Method", "KV (MB)", "KV % of full", "Kept ratio", "ROUGE-L vs Full", "Policy (ms/token)",
                 "Compress (ms)", "TTFT alone (ms)", "tok/s alone", "× Full (alone)", "Status"]
FIGURE_NAMES = ("retained-per-layer", "lorenz", "kv-memory", "latency", "quality-vs-memory")
ENGINE_QUEUE = "engine"  # the concurrency id of Compare and follow-ups (app_builder.py)


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


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    return "–" if v is None else format(v * scale, spec)


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

    # -- static facts --------------------------------------------------------------------------------------------
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

    # -- rendering -----------------------------------------------------------------------------------------------
    def _as_list(self, values: dict[str, Any]) -> list[Any]:
        return [values.get(k, gr.skip()) for k in self.output_keys]

    def head(self, method: str, comp: Comparison | None) -> str:
        track = comp.tracks.get(method) if comp is not None else None
        d = self.described[method]
        uses_budget = d["uses_budget"] or d["schedule"] == "none"  # a method that never compresses has no note
        if track is None:  # not in this run (or no run yet): name, description, no badges
            return header_html(Track(method, self.labels[method]), self.summary(method), None, uses_budget)
        return header_html(track, self.summary(method), comp, uses_budget)

    def figures(self, comp: Comparison | None, box: SessionBox) -> dict[str, Any]:
        """Every chart of this comparison, keyed by its export name."""
        return {
            "retained-per-layer": self.bars(comp),
            "lorenz": self.lorenz(comp, box),
            "kv-memory": charts.memory_figure(comp.series()) if comp else charts.placeholder("KV-cache size while decoding"),
            "latency": charts.latency_figure(comp.series(), comp.batch, comp.alone_series()) if comp
            else charts.placeholder("Per-token latency"),
            "quality-vs-memory": charts.quality_figure(comp.quality_points()) if comp
            else charts.placeholder("Answer quality vs KV-cache size"),
        }

    def bars(self, comp: Comparison | None):
        if comp is None:
            return charts.placeholder("Retained KV entries per layer (share of the uncompressed cache)")
        return charts.retained_bars(comp.latest(), budget=comp.budget)

    def lorenz(self, comp: Comparison | None, box: SessionBox):
        if comp is None or comp.prefill is None:
            return charts.placeholder("Importance retained vs tokens kept, per layer",
                                      "Run a comparison: the curves come from the shared prefill.")
        layers = box.lorenz_layers if box.lorenz_layers else charts.default_layers(comp.prefill.num_layers)
        budget = box.view_budget if box.view_budget is not None else comp.budget
        method = comp.lorenz_method  # the method whose allocation the chart draws (a policy's declared role)
        label = REGISTRY[method].label if method in REGISTRY else "the method"
        threshold, threshold_label = comp.threshold(), f"{label} threshold"
        importance = comp.curve_importance()  # the curves that method's allocation used, if it ran
        if abs(budget - comp.budget) > 1e-9 or threshold is None:
            if method in comp.tracks and abs(budget - comp.budget) <= 1e-9 and comp.active:
                threshold = None  # wait for the run's own threshold
            else:
                try:
                    threshold = charts.preview_threshold(importance, budget)
                    threshold_label = f"{label} threshold (preview)"
                except Exception:  # noqa: BLE001 - a preview is optional
                    threshold = None
        return charts.lorenz_figure(importance, layers, threshold=threshold, budget=budget,
                                    threshold_label=threshold_label, method=method,
                                    source=charts.curve_source(method, comp.knobs.get(method), comp.prefill.curves))

    def gallery(self, comp: Comparison | None) -> list[tuple[Any, str]]:
        if comp is None or comp.image is None or comp.overlay is None:
            return []
        items = []
        for m in comp.methods:
            share = comp.overlay.maps.get(m)
            if share is None:
                continue
            items.append((overlay(comp.image, share, m, self.crop), caption(self.labels.get(m, m), share, comp.overlay.layer)))
        return items

    def table(self, comp: Comparison | None) -> list[list[Any]]:
        if comp is None:
            return []
        rows = []
        for m in comp.methods:
            s = comp.method_summary(m)
            kept = s["kept_per_layer"]
            ratio = (sum(kept) / len(kept) / s["full_len"]) if kept and s["full_len"] else None
            alone = s["alone"] or {}
            rows.append([s["label"], _fmt(s["kv_mb"], ".3f"), _fmt(s["kv_ratio"], ".1f", 100), _fmt(ratio, ".2f"),
                         _fmt(s["rouge_l_vs_full"], ".3f"), _fmt(s["policy_ms_per_token"], ".2f"),
                         _fmt(s["compress_ms"], ".1f"), _fmt(alone.get("ttft_s"), ".0f", 1000),
                         _fmt(alone.get("tokens_per_s"), ".1f"), _fmt(s["speedup_vs_full"], ".2f"), s["status"]])
        return rows

    def render(self, comp: Comparison | None, box: SessionBox, phase: str | None, *, panels: bool = True,
               charts_: bool = True, lorenz: bool = True, overlay_: bool = True, all_heads: bool = False) -> list[Any]:
        out: dict[str, Any] = {"status": status_line(comp, phase), "box": box}
        if panels:
            for m in self.methods:
                in_run = comp is not None and m in comp.tracks
                if in_run or all_heads:
                    out[f"head:{m}"] = self.head(m, comp if in_run else None)
                    out[f"chat:{m}"] = chat_messages(comp.tracks[m]) if in_run else []
            out["results"] = comp.to_dict() if comp is not None else {}
        if charts_:
            figs = self.figures(comp, box)
            out.update(bars=figs["retained-per-layer"], memory=figs["kv-memory"], latency=figs["latency"],
                       quality=figs["quality-vs-memory"], table=self.table(comp))
            if lorenz:
                out["lorenz"] = figs["lorenz"]
        elif lorenz:
            out["lorenz"] = self.lorenz(comp, box)
        if overlay_:
            out["gallery"] = self.gallery(comp)
        return self._as_list(out)

    def empty(self, box: SessionBox, phase: str | None = None) -> list[Any]:
        return self.render(None, box, phase, all_heads=True)

    # -- streaming -----------------------------------------------------------------------------------------------
    def _overlay_snapshot(self, comp: Comparison, box: SessionBox) -> OverlayMaps | None:
        """Runs on the worker thread between two decoding steps (the caches are consistent there)."""
        if comp.image is None or comp.session is None or comp.prefill is None or not comp.prefill.image_tokens:
            return None
        layer = int(min(max(box.overlay_layer, 0), self.num_layers - 1))
        maps = {}
        for m in comp.methods:
            try:
                maps[m] = comp.session.kept_image_map(m, layer)
            except Exception:  # noqa: BLE001 - a failed method has no cache to show
                maps[m] = None
        return OverlayMaps(layer, maps)

    def _phase(self, comp: Comparison) -> str:
        cur = [t.turn for t in comp.tracks.values() if t.turn is not None]
        done = sum(t.status in ("done", "stopped", "error") for t in cur)
        if comp.prefill is None:
            return "Prefill: encoding the image and prompt once for every method…"
        if done < len(cur) or not comp.alone:
            return f"Generating: {done} of {len(cur)} methods finished"
        runs = [t.alone for t in cur if t.status == "done"]
        timed = sum(r is not None and r.status in ("done", "stopped", "error") for r in runs)
        return f"Timing each method alone: {timed} of {len(runs)} measured"

    def _stream(self, box: SessionBox, comp: Comparison, factory: Callable, first_turn: bool) -> Iterator[list[Any]]:
        box.pending = False
        if box.run is not None and box.run is not comp and box.run.active:
            box.run.cancel.set()
        box.run = comp
        box.generation += 1
        generation = box.generation
        comp.active = True
        self.registry.begin(box.owner)
        t0 = time.perf_counter()
        worker = StreamWorker(factory, comp.cancel, snapshot=lambda: self._overlay_snapshot(comp, box),
                              snapshot_every=OVERLAY_EVERY_S)
        yield self.render(comp, box, self._phase(comp), all_heads=first_turn, overlay_=first_turn,
                          lorenz=first_turn)
        worker.start()
        failure = None
        last_chart, had_prefill, had_threshold = time.monotonic(), comp.prefill is not None, comp.threshold() is not None
        try:
            for batch in worker.batches(TEXT_EVERY_S):
                if box.generation != generation:  # cleared or superseded: stop drawing, stop the engine
                    comp.cancel.set()
                    return
                overlay_new = False
                for item in batch.items:
                    comp.apply(item)
                    overlay_new |= isinstance(item, OverlayMaps)
                if batch.error:
                    failure = batch
                if batch.ended:
                    break
                if not batch.items:
                    continue
                now = time.monotonic()
                new_lorenz = (comp.prefill is not None and not had_prefill) or (
                    comp.threshold() is not None and not had_threshold)
                charts_due = now - last_chart >= CHART_EVERY_S or new_lorenz
                if charts_due:
                    last_chart = now
                had_prefill, had_threshold = comp.prefill is not None, comp.threshold() is not None
                yield self.render(comp, box, self._phase(comp), charts_=charts_due, lorenz=new_lorenz,
                                  overlay_=overlay_new)
        finally:
            comp.active = False
            self.registry.end(box.owner)
            if worker.thread.is_alive():
                comp.cancel.set()  # closed tab, Clear, or an error in the UI: the engine stops within a token
        elapsed = time.perf_counter() - t0
        if failure is not None:
            msg = failure.error or "unknown error"
            if failure.engine_error:
                comp.stop_all("stopped")
                if not first_turn:
                    comp.rollback_turn()
                else:
                    comp.error = msg
                phase = f"⚠ {msg}"
            else:
                comp.error = msg
                comp.stop_all("error")
                phase = "⚠ The run failed; the server is still up. Try again or with other settings."
        elif comp.cancel.is_set():
            comp.stop_all("stopped")
            phase = f"■ Stopped after {elapsed:.1f} s; partial answers are kept."
        else:
            phase = f"✓ Done in {elapsed:.1f} s."
        box.stop_requested = False
        yield self.render(comp, box, phase)
        if failure is not None:
            raise gr.Error(failure.error if failure.engine_error else
                           f"The run failed ({failure.error}). The app is still running.", print_exception=False)

    # -- events --------------------------------------------------------------------------------------------------
    def prepare(self, box: SessionBox):
        """Runs at once on click (not queued): a Stop from now on applies to the queued request."""
        box = box if isinstance(box, SessionBox) else SessionBox()
        box.pending = True
        box.stop_requested = False
        busy = self.engine.lock.locked()
        return ("Queued: another run is using the model; this one starts when it finishes." if busy
                else "Starting…"), box

    def _owner(self, box: SessionBox, request: gr.Request | None) -> str:
        """The registry key of this box: its Gradio session, or the box itself for a direct call."""
        session_hash = getattr(request, "session_hash", None) if request is not None else None
        if session_hash:
            box.owner = str(session_hash)
        elif box.owner is None:
            box.owner = f"local-{id(box)}"
        return box.owner

    def _stopped_while_queued(self, box: SessionBox) -> bool:
        """Was Stop pressed after this request joined the queue? Clears the browser's flag either way."""
        queued_at = queue_probe.enqueued_at()
        if queued_at is not None:
            stopped = box.stop_at is not None and box.stop_at >= queued_at
        else:  # a direct call, or a gradio without the queue's bookkeeping: the browser's own flag
            stopped = box.stop_requested
        box.stop_requested = False
        return stopped

    def _not_started(self, box: SessionBox) -> list[Any]:
        box.pending = False
        return self._as_list({"status": "■ Stopped before it started.", "box": box})

    def compare(self, image, prompt, methods, budget, max_new_tokens, do_sample=False, temperature=0.7, top_p=0.9,
                seed=0, box=None, request: gr.Request = None, equal_memory=False, query_agnostic=False,
                time_alone=False, **knob_values) -> Iterator[list[Any]]:
        box = box if isinstance(box, SessionBox) else SessionBox()
        owner = self._owner(box, request)
        if self._stopped_while_queued(box):
            yield self._not_started(box)
            return
        try:
            prompt, methods, budget, max_new = check_request(prompt, methods, budget, max_new_tokens, self.limit,
                                                             max_chars=self.limits.max_prompt_chars)
            unknown = [m for m in methods if m not in self.methods]
            if unknown:
                raise refuse(f"unknown or unavailable method(s): {', '.join(map(str, unknown))}; "
                             f"available: {', '.join(self.methods)}")
            methods = [m for m in self.methods if m in methods]
            do_sample, temperature, top_p, seed = check_sampling(do_sample, temperature, top_p, seed)
            budget_mode = check_budget_mode(equal_memory)
            query_agnostic = check_query_agnostic(query_agnostic)
            time_alone = check_switch("time_alone", time_alone)
            settings = GenerationSettings(max_new_tokens=max_new, do_sample=do_sample, temperature=temperature,
                                          top_p=top_p, seed=seed)
            knobs = collect_knobs(self.knob_specs, knob_values, methods)
            image = downscale(self.engine.load_image(
                image, allowed_roots=self.image_roots(), max_bytes=self.limits.max_image_bytes,
                max_pixels=self.limits.max_image_pixels)) if image is not None else None
            tokens = check_prompt(self.limits, self.loaded, prompt, with_image=image is not None, max_new_tokens=max_new,
                                  image_size=image.size if image is not None else None)
            session = self.engine.new_session(image, prompt, methods, budget, settings, knobs,
                                              budget_mode=budget_mode, query_agnostic=query_agnostic,
                                              time_alone=time_alone)  # no caches yet
            if box.run is not None and box.run.active:
                box.run.cancel.set()  # its caches are dropped next: the engine must let go of them first
            self.registry.reserve(owner, estimate_run_bytes(self.loaded, tokens, len(methods), budget))
        except (EngineError, LimitError) as exc:
            box.pending = False
            raise refuse(str(exc)) from None
        except gr.Error:
            box.pending = False
            raise
        except Exception as exc:  # noqa: BLE001 - never a traceback in the browser
            box.pending = False
            log.exception("compare: unexpected error")
            raise gr.Error(f"Could not start the comparison ({exc.__class__.__name__}).", print_exception=False) from None
        comp = Comparison(methods, self.labels, prompt, budget,
                          {"max_new_tokens": max_new, "do_sample": settings.do_sample, "temperature": settings.temperature,
                           "top_p": settings.top_p, "seed": settings.seed}, knobs,
                          image=downscale(image, OVERLAY_DISPLAY_SIDE) if image is not None else None,
                          model=self.model_info(), budget_mode=budget_mode, query_agnostic=query_agnostic,
                          alone=time_alone)
        comp.session = session
        self.registry.add(owner, session, stop=lambda: comp.cancel.set(),
                          forget=lambda reason: self._let_go(comp, reason))
        box.view_budget = budget
        yield from self._stream(box, comp, lambda cancel: self._tidy(session, session.run(cancel)), first_turn=True)

    @staticmethod
    def _tidy(session, events: Iterator[Any]) -> Iterator[Any]:
        """The engine's events, then: if the registry released this session while its run still waited for
        the model (a client that left before its turn came), drop what the run built since."""
        try:
            yield from events
        finally:
            if getattr(session, "released", False) and session.cache_bytes():
                session.release()

    @staticmethod
    def _let_go(comp: Comparison, reason: str | None) -> None:
        """The registry dropped this comparison's caches: keep its answers and charts, let go of the engine
        session (and its copy of the image); a closed connection's display image goes too (Gradio keeps a
        closed session's state for an hour)."""
        comp.session = None
        if reason == "closed":
            comp.image = None

    def _conversation_tokens(self, comp: Comparison) -> int:
        """Tokens the longest method's conversation holds so far (uncompressed length)."""
        lengths = [t.last.full_len for t in comp.tracks.values() if t.last is not None and t.last.full_len]
        if lengths:
            return max(lengths)
        return comp.prefill.prompt_tokens if comp.prefill is not None else 0

    def follow_up(self, question, box=None, request: gr.Request = None) -> Iterator[list[Any]]:
        box = box if isinstance(box, SessionBox) else SessionBox()
        owner = self._owner(box, request)
        comp = box.run
        try:
            if self._stopped_while_queued(box):
                yield self._not_started(box)
                return
            if comp is not None and comp.prefill is not None and (
                    comp.session is None or getattr(comp.session, "released", False)):
                reason = self.registry.released_reason(owner) or "this comparison's caches were released"
                raise refuse(f"{reason}; run Compare again to continue")
            if comp is None or comp.session is None or comp.prefill is None:
                raise refuse("run a comparison first: a follow-up continues every method's own compressed cache")
            if comp.active:
                raise refuse("the answers are still streaming: wait for them or press Stop")
            if not isinstance(question, str) or not question.strip():
                raise refuse("the follow-up question is empty" if question is None or isinstance(question, str)
                             else f"question must be text, got {type(question).__name__}")
            added = check_followup(self.limits, self.loaded, question,
                                   conversation_tokens=self._conversation_tokens(comp),
                                   max_new_tokens=int(comp.settings.get("max_new_tokens", self.limit)))
            growth = kv_bytes_per_token(self.loaded) * added * len(comp.methods)
            if comp.alone:  # every cache is copied as the turn starts, to decode each method alone afterwards
                growth = 2 * growth + comp.session.cache_bytes()
            self.registry.reserve(owner, growth, keep_own=True)
        except LimitError as exc:
            box.pending = False
            raise refuse(str(exc)) from None
        except gr.Error:
            box.pending = False
            raise
        comp.begin_turn(question)
        session = comp.session
        yield from self._stream(box, comp, lambda cancel: self._tidy(session, session.follow_up(question, cancel)),
                                first_turn=False)

    def stop(self, box, request: gr.Request = None):
        if not isinstance(box, SessionBox):
            return "Nothing to stop: no comparison is running in this session."
        if box.run is not None and box.run.active:
            box.run.cancel.set()
            return "■ Stopping: every method finishes its current token…"
        box.stop_at = time.monotonic()
        session_hash = getattr(request, "session_hash", None) if request is not None else None
        if box.pending or queue_probe.waiting(self.blocks, session_hash, ENGINE_QUEUE):
            box.stop_requested = True
            return "■ The queued request will not start."
        return "Nothing to stop: no comparison is running or waiting in this session."

    def clear(self, box, request: gr.Request = None):
        box = box if isinstance(box, SessionBox) else SessionBox()
        owner = self._owner(box, request)
        box.generation += 1
        if box.run is not None:
            box.run.cancel.set()
        self.registry.release_owner(owner)
        box.run, box.pending, box.stop_requested = None, False, False
        return [*self.empty(box), "", gr.update(value=None, visible=False), ""]

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
        snap = self._overlay_snapshot(comp, box)
        if snap is None:
            return gr.skip()
        comp.apply(snap)
        return self.gallery(comp)

    def set_lorenz_layers(self, layers, box):
        if not isinstance(box, SessionBox):
            return gr.skip()
        try:
            chosen = {int(x) for x in (layers or [])[: self.num_layers]}
        except (TypeError, ValueError, OverflowError):
            return gr.skip()
        box.lorenz_layers = sorted(x for x in chosen if 0 <= x < self.num_layers) or None
        return self.lorenz(box.run, box)

    def set_view_budget(self, budget, box):
        if not isinstance(box, SessionBox):
            return gr.skip()
        try:
            value = float(budget)
        except (TypeError, ValueError, OverflowError):
            return gr.skip()
        if not (0.0 < value <= 1.0):  # NaN included
            return gr.skip()
        box.view_budget = value
        if box.run is None or box.run.prefill is None:
            return gr.skip()
        return self.lorenz(box.run, box)

    def export(self, formats, box, request: gr.Request = None):
        comp = box.run if isinstance(box, SessionBox) else None
        if comp is None or comp.prefill is None:
            raise refuse("nothing to export yet: run a comparison first")
        if formats is not None and not isinstance(formats, (list, tuple)):
            raise refuse(f"formats must be a list of any of: {', '.join(ALL_FORMATS)}")
        formats = [f for f in (formats or ALL_FORMATS) if isinstance(f, str) and f in ALL_FORMATS]
        folder = self.exports.new_folder(self._owner(box, request))
        try:
            result = export_all(self.figures(comp, box), comp.to_dict(), formats, images=self.export_images(comp),
                                out_root=folder)
        except Exception as exc:  # noqa: BLE001
            log.exception("export failed")
            raise gr.Error(f"export failed ({exc.__class__.__name__}: {str(exc)[:200]})", print_exception=False) from None
        note = " ".join(result.messages)
        names = ", ".join(sorted({p.rsplit("/", 1)[-1] for p in result.files[1:]}))
        return (gr.update(value=result.files, visible=True),
                f"**Exported** {len(result.files) - 1} files + zip: {names}. {note}")

    def export_images(self, comp: Comparison) -> dict[str, Any]:
        items = self.gallery(comp)
        if not items:
            return {}
        return {f"overlay-layer{comp.overlay.layer}-{m}": img
                for m, (img, _) in zip([m for m in comp.methods if comp.overlay.maps.get(m) is not None], items)}

    def visibility(self, methods) -> list[Any]:
        chosen = set(methods or [])
        return [gr.update(visible=m in chosen) for m in self.methods]
