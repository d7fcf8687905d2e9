"""The controller's streaming: one run's engine generator on a worker thread (`streaming.StreamWorker`), redrawn
at a steady pace (panels often, charts at most once a second, the final state always), the overlay sampled
between decoding steps, and how a run ends (done, stopped, refused, failed)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import gradio as gr

from .runstate import Comparison, OverlayMaps, SessionBox
from .streaming import StreamWorker

TEXT_EVERY_S = 0.25  # panels (answers, badges) refresh at most this often while streaming
CHART_EVERY_S = 1.0  # charts refresh at most this often; the final state is always drawn
OVERLAY_EVERY_S = 1.5  # the worker samples the kept-patch maps this often


class Streaming:
    """Mixed into the Controller; uses `render`, `registry` and `num_layers`."""

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
                if first_turn:  # a refused follow-up began no turn: the conversation stays as it was
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
