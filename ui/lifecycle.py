"""The controller's lifecycle handlers: Compare and follow-up (checked, reserved, then streamed), Stop, Clear,
and what happens when a tab closes or its state is deleted."""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import gradio as gr

from prefixkv_core import EngineError, GenerationSettings
from prefixkv_core.limits import LimitError, check_followup, check_prompt, estimate_run_bytes, kv_bytes_per_token

from . import queue_probe
from .inputs import (check_budget_mode, check_query_agnostic, check_request, check_sampling, check_switch,
                     collect_knobs, downscale, refuse)
from .runstate import Comparison, SessionBox

log = logging.getLogger(__name__)

OVERLAY_DISPLAY_SIDE = 1024
ENGINE_QUEUE = "engine"  # the concurrency id of Compare and follow-ups (app_builder.py)


class Lifecycle:
    """Mixed into the Controller; uses `engine`, `registry`, `exports`, `limits`, `_stream`, `empty`."""

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
        # the engine session's own record is the one this comparison reads (the session feeds it)
        session.record.model.update(self.model_info())
        comp = Comparison(session.record, session=session,
                          image=downscale(image, OVERLAY_DISPLAY_SIDE) if image is not None else None)
        self.registry.add(owner, session, stop=lambda: comp.cancel.set(),
                          forget=lambda reason: self._let_go(comp, reason))
        box.view_budget = float(budget)  # a plain number for the charts (plotly serialises floats only)
        yield from self._stream(box, comp, lambda cancel: self._tidy(session, session.run(cancel)), first_turn=True)

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
        comp.new_turn()  # a fresh Stop flag; the session begins the record's turn
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
