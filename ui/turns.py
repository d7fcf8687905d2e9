"""Compare and follow-up: a client's request checked against the offer and the limits, room reserved for its
caches in the session registry, then streamed. The first turn builds a new engine Session; a follow-up
continues every method's own compressed cache."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import gradio as gr

from prefixkv_core import EngineError, GenerationSettings
from prefixkv_core.limits import (LimitError, Limits, check_followup, estimate_run_bytes, kv_bytes_per_token,
                                  run_token_limit)

from .catalog import model_facts
from .inputs import (KnobSpec, check_budget_mode, check_query_agnostic, check_request, check_sampling,
                     check_switch, collect_knobs, refuse)
from .lifecycle import stopped_while_queued
from .run_stream import RunStreamer, drop_if_released, let_go
from .runstate import Comparison, SessionBox
from .sessions import SessionRegistry
from .visual_request import ONE_IMAGE_SIDE, check_first_turn, gather, shown

log = logging.getLogger(__name__)

OVERLAY_DISPLAY_SIDE = ONE_IMAGE_SIDE  # the longest side of a lone image kept for the overlay


class Turns:
    """Needs the engine (images, sessions, the loaded model's sizes), the session registry (room for the caches,
    and their release), the streamer, and what a request may ask: the offered `methods`, their `knob_specs`,
    the `max_new_tokens` ceiling, the server's `limits` and the folders an image may come from
    (`image_roots()`)."""

    def __init__(self, engine, registry: SessionRegistry, streamer: RunStreamer, *, methods: list[str],
                 knob_specs: list[KnobSpec], max_new_tokens: int, limits: Limits,
                 image_roots: Callable[[], list[str]]):
        self.engine = engine
        self.registry = registry
        self.streamer = streamer
        self.methods = list(methods)
        self.knob_specs = knob_specs
        self.max_new_tokens = int(max_new_tokens)
        self.limits = limits
        self.image_roots = image_roots

    def compare(self, image, prompt, methods, budget, max_new_tokens, do_sample=False, temperature=0.7, top_p=0.9,
                seed=0, box=None, request: gr.Request = None, equal_memory=False, query_agnostic=False,
                time_alone=False, images=None, video=None, frames=None, **knob_values) -> Iterator[list[Any]]:
        box = box if isinstance(box, SessionBox) else SessionBox()
        owner = box.owner_for(request)
        if stopped_while_queued(box):
            yield self.streamer.not_started(box)
            return
        try:
            session, display, budget = self._new_session(
                box, owner, (image, images, video, frames), prompt, methods, budget, max_new_tokens,
                (do_sample, temperature, top_p, seed), (equal_memory, query_agnostic, time_alone), knob_values)
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
        session.record.model.update(model_facts(self.engine.loaded))
        comp = Comparison(session.record, session=session, shown=display)
        self.registry.add(owner, session, stop=lambda: comp.cancel.set(), forget=lambda reason: let_go(comp, reason))
        box.view_budget = float(budget)  # a plain number for the charts (plotly serialises floats only)
        yield from self.streamer.stream(box, comp, lambda cancel: drop_if_released(session, session.run(cancel)),
                                        first_turn=True)

    def _new_session(self, box: SessionBox, owner: str, visual_inputs: tuple, prompt, methods, budget,
                     max_new_tokens, sampling: tuple, switches: tuple, knob_values: dict):
        """Checks every value, builds the engine Session (no caches yet) and reserves room for its caches.
        `visual_inputs`: (image, images, video, frames) as the request sent them. Returns (session, the display
        copies of its images and frames, the checked budget)."""
        loaded, limits = self.engine.loaded, self.limits
        prompt, methods, budget, max_new = check_request(prompt, methods, budget, max_new_tokens, self.max_new_tokens,
                                                         max_chars=limits.max_prompt_chars)
        unknown = [m for m in methods if m not in self.methods]
        if unknown:
            raise refuse(f"unknown or unavailable method(s): {', '.join(map(str, unknown))}; "
                         f"available: {', '.join(self.methods)}")
        methods = [m for m in self.methods if m in methods]
        do_sample, temperature, top_p, seed = check_sampling(*sampling)
        equal_memory, query_agnostic, time_alone = switches
        budget_mode = check_budget_mode(equal_memory)
        query_agnostic = check_query_agnostic(query_agnostic)
        time_alone = check_switch("time_alone", time_alone)
        settings = GenerationSettings(max_new_tokens=max_new, do_sample=do_sample, temperature=temperature,
                                      top_p=top_p, seed=seed)
        knobs = collect_knobs(self.knob_specs, knob_values, methods)
        visuals = gather(self.engine, *visual_inputs, limits, self.image_roots())
        # the engine places the visuals (markers, order) and checks them against the model's context, encoding
        # nothing yet; then the run is held to the server's own limit
        session = self.engine.new_session(visuals.engine_images(), prompt, methods, budget, settings, knobs,
                                          budget_mode=budget_mode, query_agnostic=query_agnostic,
                                          time_alone=time_alone, video=visuals.clip,
                                          frames=len(visuals.frames) if visuals.clip is not None else None,
                                          token_limit=run_token_limit(limits, loaded))
        tokens = check_first_turn(limits, loaded, prompt, session.visuals, max_new)
        if box.run is not None and box.run.active:
            box.run.cancel.set()  # its caches are dropped next: the engine must let go of them first
        self.registry.reserve(owner, estimate_run_bytes(loaded, tokens, len(methods), budget))
        return session, shown(session, visuals.clip), budget

    def follow_up(self, question, box=None, request: gr.Request = None) -> Iterator[list[Any]]:
        box = box if isinstance(box, SessionBox) else SessionBox()
        owner = box.owner_for(request)
        comp = box.run
        try:
            if stopped_while_queued(box):
                yield self.streamer.not_started(box)
                return
            self._check_follow_up(owner, comp, question)
        except LimitError as exc:
            box.pending = False
            raise refuse(str(exc)) from None
        except gr.Error:
            box.pending = False
            raise
        comp.new_turn()  # a fresh Stop flag; the session begins the record's turn
        session = comp.session
        yield from self.streamer.stream(
            box, comp, lambda cancel: drop_if_released(session, session.follow_up(question, cancel)), first_turn=False)

    def _check_follow_up(self, owner: str, comp: Comparison | None, question) -> None:
        """Refuses a follow-up that has nothing to continue or would pass a limit; reserves room for its caches."""
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
        loaded = self.engine.loaded
        added = check_followup(self.limits, loaded, question, conversation_tokens=conversation_tokens(comp),
                               max_new_tokens=int(comp.settings.get("max_new_tokens", self.max_new_tokens)))
        growth = kv_bytes_per_token(loaded) * added * len(comp.methods)
        if comp.alone:  # every cache is copied as the turn starts, to decode each method alone afterwards
            growth = 2 * growth + comp.session.cache_bytes()
        self.registry.reserve(owner, growth, keep_own=True)


def conversation_tokens(comp: Comparison) -> int:
    """Tokens the longest method's conversation holds so far (uncompressed length)."""
    lengths = [t.last.full_len for t in comp.tracks.values() if t.last is not None and t.last.full_len]
    if lengths:
        return max(lengths)
    return comp.prefill.prompt_tokens if comp.prefill is not None else 0
