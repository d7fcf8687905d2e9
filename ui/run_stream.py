"""One run of a comparison streamed to the page: the engine generator on a worker thread
(`streaming.StreamWorker`), redrawn at a steady pace (panels often, charts at most once a second, the complete
answers as soon as they are, then the final state with every chart), the overlay sampled between decoding steps,
and how a run ends (done, stopped, refused, failed)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import gradio as gr

from prefixkv_core.report.record import ENDED_STATUSES

from .overlay_sampler import OverlaySampler
from .rendering import Renderer
from .runstate import Comparison, OverlayMaps, SessionBox
from .sessions import SessionRegistry
from .streaming import Batch, StreamWorker

TEXT_EVERY_S = 0.25  # panels (answers, badges) refresh at most this often while streaming
CHART_EVERY_S = 1.0  # charts refresh at most this often; the final state is always drawn
OVERLAY_EVERY_S = 1.5  # the worker samples the kept-patch maps this often
# Redraws are Python work that holds the interpreter (and the comparison's record, which the engine feeds) while
# they run: building the charts costs about a third of a second on a CPU, and gradio's turning the update into what
# it sends costs about as much again (measured with benchmarks/app_visitors.py). With several visitors streaming at
# once they would take the time the model needs, so every stream spaces its redraws by what building them costs and
# how many streams run: all of them together build for at most these shares of the server's time (and about as
# much again goes to sending).
CHART_SHARE = 0.08
TEXT_SHARE = 0.05


def phase(comp: Comparison) -> str:
    """What the status line says while a run goes on."""
    cur = [t.turn for t in comp.tracks.values() if t.turn is not None]
    done = sum(t.status in ENDED_STATUSES for t in cur)
    if comp.prefill is None:
        return "Prefill: encoding the image and prompt once for every method…"
    if done < len(cur) or not comp.alone:
        return f"Generating: {done} of {len(cur)} methods finished"
    runs = [t.alone for t in cur if t.status == "done"]
    timed = sum(r is not None and r.status in ENDED_STATUSES for r in runs)
    return f"Timing each method alone: {timed} of {len(runs)} measured"


def drop_if_released(session, events: Iterator[Any]) -> Iterator[Any]:
    """The engine's events, then: if the registry released this session while its run still waited for the
    model (a client that left before its turn came), drop what the run built since."""
    try:
        yield from events
    finally:
        if getattr(session, "released", False) and session.cache_bytes():
            session.release()


def let_go(comp: Comparison, reason: str | None) -> None:
    """The registry dropped this comparison's caches: keep its answers and charts, let go of the engine session
    (and its copy of the image); a closed connection's display image goes too (Gradio keeps a closed session's
    state for an hour)."""
    comp.session = None
    if reason == "closed":
        comp.image = None


class _Pace:
    """When the next redraw comes and whether it brings the charts: panels every TEXT_EVERY_S and charts every
    CHART_EVERY_S at the least, spaced further when redraws cost more than their share of the server's time with
    `streams()` runs streaming at once; the Lorenz chart at once when it gains something to draw (the prefill's
    curves, then the run's own threshold)."""

    def __init__(self, comp: Comparison, streams: Callable[[], int] = lambda: 1):
        self.comp = comp
        self.streams = streams
        self.last_chart = time.monotonic()
        self.had_prefill, self.had_threshold = comp.prefill is not None, comp.threshold() is not None
        self.text_cost = 0.0  # seconds of the last panels-only redraw
        self.chart_cost = 0.0  # seconds of the last redraw with the charts

    def text_interval(self) -> float:
        return max(TEXT_EVERY_S, max(1, self.streams()) * self.text_cost / TEXT_SHARE)

    def chart_interval(self) -> float:
        return max(CHART_EVERY_S, max(1, self.streams()) * self.chart_cost / CHART_SHARE)

    def next(self) -> tuple[bool, bool]:
        """(charts due, Lorenz chart new) for the redraw about to be made. A new Lorenz chart is drawn alone: the
        other charts keep their pace (a short answer's final redraw is then its only one with every chart)."""
        comp, now = self.comp, time.monotonic()
        has_prefill, has_threshold = comp.prefill is not None, comp.threshold() is not None
        new_lorenz = (has_prefill and not self.had_prefill) or (has_threshold and not self.had_threshold)
        charts_due = now - self.last_chart >= self.chart_interval()
        if charts_due:
            self.last_chart = now
        self.had_prefill, self.had_threshold = has_prefill, has_threshold
        return charts_due, new_lorenz

    def drew(self, kind: str, seconds: float) -> None:
        """What a redraw ("charts", "lorenz" alone or "panels" alone) cost: the next ones are spaced by it."""
        if kind == "charts":
            self.chart_cost = seconds
        elif kind == "panels":
            self.text_cost = seconds


class RunStreamer:
    """Streams runs to the page. Needs the renderer (every redraw), the session registry (a run in progress
    is marked busy there, so its caches are never dropped under it; how many are busy paces the redraws) and the
    overlay sampler (called on the worker thread)."""

    def __init__(self, renderer: Renderer, registry: SessionRegistry, overlay: OverlaySampler):
        self.renderer = renderer
        self.registry = registry
        self.overlay = overlay

    def not_started(self, box: SessionBox) -> list[Any]:
        """The outputs of a request that Stop cancelled while it waited in the queue."""
        box.pending = False
        return self.renderer.as_list({"status": "■ Stopped before it started.", "box": box})

    def stream(self, box: SessionBox, comp: Comparison, factory: Callable, first_turn: bool) -> Iterator[list[Any]]:
        """Runs `factory(cancel)` (the engine's events) on a worker thread and yields the page's outputs."""
        box.pending = False
        if box.run is not None and box.run is not comp and box.run.active:
            box.run.cancel.set()
        box.run = comp
        box.generation += 1
        generation = box.generation
        comp.active = True
        self.registry.begin(box.owner)
        t0 = time.perf_counter()
        worker = StreamWorker(factory, comp.cancel, snapshot=lambda: self.overlay.snapshot(comp, box),
                              snapshot_every=OVERLAY_EVERY_S)
        # the engine starts before the first redraw is sent: gradio resumes this generator only once it has turned
        # that redraw into what it sends, which under load took longer than the prefill's own start
        worker.start()
        superseded, failure = False, None
        try:
            yield self.renderer.render(comp, box, phase(comp), overlay_=first_turn,
                                       lorenz=first_turn)  # placeholders (built once) and the panels: cheap
            superseded, failure = yield from self._redraws(worker, box, comp, generation)
        finally:
            comp.active = False
            self.registry.end(box.owner)
            if worker.thread.is_alive():
                comp.cancel.set()  # closed tab, Clear, or an error in the UI: the engine stops within a token
        if superseded:
            return
        box.stop_requested = False
        yield self.renderer.render(comp, box, self._ending(comp, failure, time.perf_counter() - t0, first_turn))
        if failure is not None:
            raise gr.Error(failure.error if failure.engine_error else
                           f"The run failed ({failure.error}). The app is still running.", print_exception=False)

    def _redraws(self, worker: StreamWorker, box: SessionBox, comp: Comparison,
                 generation: int) -> Iterator[list[Any]]:
        """Yields a redraw per batch of events. Returns (superseded, the batch that carried a failure if any):
        superseded when Clear or a newer run took the tab, which then draws nothing more of this run."""
        pace, failure = _Pace(comp, self.registry.running), None  # every visitor's run going now
        for batch in worker.batches(pace.text_interval):
            if box.generation != generation:  # cleared or superseded: stop drawing, stop the engine
                comp.cancel.set()
                return True, None
            overlay_new = False
            for item in batch.items:
                comp.apply(item)
                overlay_new |= isinstance(item, OverlayMaps)
            if batch.error:
                failure = batch
            if batch.ended:
                break
            if batch.settled:  # the answers are complete: shown before the final overlay sample and the charts
                if failure is None and not comp.cancel.is_set():
                    yield self.renderer.render(comp, box, phase(comp), charts_=False, lorenz=False, overlay_=False)
                continue
            if not batch.items:
                continue
            charts_due, new_lorenz = pace.next()
            t0 = time.perf_counter()
            outputs = self.renderer.render(comp, box, phase(comp), charts_=charts_due, lorenz=new_lorenz,
                                           overlay_=overlay_new)
            pace.drew("charts" if charts_due else "lorenz" if new_lorenz else "panels", time.perf_counter() - t0)
            yield outputs
        return False, failure

    @staticmethod
    def _ending(comp: Comparison, failure: Batch | None, elapsed: float, first_turn: bool) -> str:
        """Marks how the run ended on the comparison and says it for the status line."""
        if failure is not None:
            msg = failure.error or "unknown error"
            if failure.engine_error:
                comp.stop_all("stopped")
                if first_turn:  # a refused follow-up began no turn: the conversation stays as it was
                    comp.error = msg
                return f"⚠ {msg}"
            comp.error = msg
            comp.stop_all("error")
            return "⚠ The run failed; the server is still up. Try again or with other settings."
        if comp.cancel.is_set():
            comp.stop_all("stopped")
            return f"■ Stopped after {elapsed:.1f} s; partial answers are kept."
        return f"✓ Done in {elapsed:.1f} s."
