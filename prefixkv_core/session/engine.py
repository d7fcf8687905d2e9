"""One prefill shared by every method, a cache copy per method, and interleaved decoding that streams
per-step events. One conversation per session, with any number of images and a video's frames.

    engine = Engine(load_model("embedded"))
    session = engine.new_session(image, "Describe the image.", ["full", "prefixkv"], budget=0.3)
    for event in session.run():          # PrefillInfo once, then MethodEvents
        ...
    for event in session.follow_up("And the colours?"):
        ...

Timing. The batched run shares one forward per step among the methods, so only a method's own policy time
(`MethodEvent.policy_s`, `compress_s`) is its own there. `time_alone=True` then also decodes every method on
its own (its own prefill, the same settings; a follow-up from a copy of its cache) and streams those steps as
`MethodEvent(alone=True)`: its TTFT, tokens/s and per-token latency measured alone. `batched=False` decodes
every method alone instead of the batched run.

This module holds the model and checks what a new session is asked for. The session's turn loop is
`session.py`; the pieces it runs on have their own modules: `schedule.py` (one batch, each alone, or timed
alone), `prefill.py` (the prompt encoded, every cache prefilled and compressed), `stepping.py` (one batched step,
the decode loop), `method_state.py` (one method's cache and progress, and its events), `generation.py`
(settings, the next token, the answer's text), `image_input.py` (the image checked), `prompt_layout.py` (where
the question and the image tokens are), `teacher_forcing.py` (scoring a reference answer), `kept_image.py` (the
overlay's map).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from PIL import Image

from ..decoding import runner
from ..errors import EngineError
from ..kv.attention import AttentionProbe, tracked_attention_enabled
from ..kv.cache import TrackedCache
from ..models import LoadedModel
from ..policies import (BUDGET_MODES, MAX_DRAWS, REGISTRY, Budget, PolicyError, ResolveContext, draw_row, make_policy,
                        resolve_methods)
from ..report.events import PrefillInfo
from .generation import GenerationSettings
from .image_input import MAX_IMAGE_SIDE, MAX_VISUALS, load_image, load_images
from .visuals import TurnVisuals, gather_visuals
from .method_state import MethodState
from .session import Session
from .model_worker import ModelLock, ModelWorker
from .step_pool import StepPool
from .prefill_pool import PrefillPool
from ..models.families import uses_mrope

__all__ = ["Engine", "Session", "EngineError", "GenerationSettings", "MethodState", "MAX_IMAGE_SIDE", "MAX_VISUALS"]


class Engine:
    """Holds a loaded model. Sessions may run at once (one thread each): their prefills and steps run on the
    model's own thread (`model_worker.py`), and their decode steps are batched together (`step_pool.py`)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.lock = ModelLock()  # held while the model runs a call (a prefill, or a batched step)
        self.worker = ModelWorker(self.lock)  # the one thread the model's calls run on
        self.pool = StepPool(loaded, self.worker)
        # first-turn prefills of conversations that start together share a forward (not where positions are 3-D)
        self.prefills = PrefillPool(lambda: self.loaded.model, loaded.num_layers, loaded.device,
                                    batchable=not uses_mrope(loaded.model.config))
        tok = loaded.processor.tokenizer
        eos = set()
        for source in (getattr(loaded.model.generation_config, "eos_token_id", None), tok.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(x) for x in source)
        self.eos_ids = eos

    # -- input checks ------------------------------------------------------------------------------------
    @staticmethod
    def load_image(image: Any, *, allowed_roots: Any = None, max_bytes: int | None = None,
                   max_pixels: int | None = None) -> Image.Image | None:
        """None, a PIL image, or a path -> RGB PIL image (downscaled if huge); see `image_input.load_image` for
        who may open which path. Raises EngineError."""
        return load_image(image, allowed_roots=allowed_roots, max_bytes=max_bytes, max_pixels=max_pixels)

    def new_session(self, image: Any, prompt: str, methods: Any = "all", budget: Budget | float = 0.3,
                    generation: GenerationSettings | None = None,
                    knobs: dict[str, dict[str, Any]] | None = None, *, chat_template: bool = True,
                    budget_mode: str = "published", query_agnostic: bool = False, time_alone: bool = False,
                    batched: bool = True, video: Any = None, frames: int | None = None,
                    draws: int = 1, token_limit: int | None = None) -> "Session":
        """`image`: None, one image (PIL or path) or a list of them, in order. `video`: a video file (or a
        `VideoClip`, or a list of frames), sampled uniformly to `frames` frames (default 8) that the model reads
        on its own video path (LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL), else as images after the images.
        Without markers the images and frames come before the prompt's text; `<image>` markers in the prompt place
        the images (one marker each) and a `<video>` marker the frames.

        `chat_template=False` feeds the prompt as plain text (the tokenizer's own special tokens, then the
        text, no turn markup): a document whose continuation is measured, as in language modelling. Such a
        session takes no image and has no follow-up turns.

        `budget_mode`: "published" runs every method as its paper does (prompt-only methods let the cache grow
        while decoding); "equal_memory" also holds the prompt-only ones at r·N_t, so every budgeted method
        holds the same memory at every step.

        `query_agnostic=True` compresses before the question is known, as in a chat where one image is asked
        several questions: the image and any text before the user's question (the template's opening) are
        prefilled and compressed first, then the question is fed through every compressed cache and the answer
        decoded on it. Default (False): the whole prompt, question included, is prefilled and then compressed,
        so the question is in the methods' observation window (query-aware).

        `time_alone=True`: after each turn's batched run, every method is decoded again on its own, from its
        own prefill (a follow-up: from a copy of its cache), and timed alone. `batched=False`: every method
        is decoded on its own, one after another, instead of the batched run (its timings are then all its
        own). The answers are the same either way.

        `draws=N` runs each control that draws at random (Random, Random drop) N times, as rows "random",
        "random~1" … "random~N-1" (with the same knobs): row k is the draw a comparison with seed `seed + k` makes
        for this request, so chance comes as a spread over N draws from one prefill instead of N comparisons.

        `token_limit`: the most tokens the first turn may reach (prompt, every image and frame, and the new tokens),
        the model's context at most (its default); several images or frames over it are refused before anything is
        encoded, with how many of them fit (a server passes its own run limit, so the advice is the tightest)."""
        if isinstance(prompt, (list, tuple)):
            raise EngineError("the engine runs batch size 1: pass one prompt, not a list")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EngineError("the prompt is empty: type a question or instruction")
        if not chat_template and (image is not None or video is not None):
            raise EngineError("a plain-text prompt (chat_template=False) takes no image or video")
        try:
            budget = Budget(budget)  # checked here, once; typed from here on
            names = resolve_methods(methods)
        except PolicyError as exc:
            raise EngineError(str(exc)) from None
        if budget_mode not in BUDGET_MODES:
            raise EngineError(f"budget_mode must be one of {', '.join(BUDGET_MODES)}, got {budget_mode!r}")
        for flag, value in (("query_agnostic", query_agnostic), ("time_alone", time_alone), ("batched", batched)):
            if not isinstance(value, bool):
                raise EngineError(f"{flag} must be True or False, got {value!r}")
        if isinstance(draws, bool) or not isinstance(draws, int) or not 1 <= draws <= MAX_DRAWS:
            raise EngineError(f"draws must be a whole number from 1 to {MAX_DRAWS}, got {draws!r}")
        if query_agnostic and not chat_template:
            raise EngineError("a plain-text prompt (chat_template=False) has no question to hold back: "
                              "query_agnostic needs the chat template")
        generation = generation or GenerationSettings()
        generation.validate()
        knobs = knobs or {}
        if token_limit is not None and (isinstance(token_limit, bool) or not isinstance(token_limit, int)
                                        or token_limit < 1):
            raise EngineError(f"token_limit must be a positive whole number or None, got {token_limit!r}")
        visuals = gather_visuals(self.loaded, prompt, load_images(image), video, frames,
                                 max_new_tokens=generation.max_new_tokens, token_limit=token_limit)
        # what a policy may need before it runs (e.g. offline PrefixKV's calibrated ratios, Random's seed and the
        # request it draws for)
        context = ResolveContext(self.loaded.slug, self.loaded.name, self.loaded.num_layers, budget,
                                 seed=generation.seed, request=visuals.fingerprint(),
                                 family=self.loaded.family)
        policies = {}
        for name in names:
            count = draws if REGISTRY[name].draws_at_random else 1
            for draw in range(count):  # draw k: the seed a comparison with seed + k would have
                try:
                    policies[draw_row(name, draw)] = make_policy(name, budget, budget_mode, **dict(
                        knobs.get(name, {}))).resolve(dataclasses.replace(context, seed=context.seed + draw))
                except (PolicyError, TypeError) as exc:
                    raise EngineError(str(exc)) from None
        session = Session(self, visuals, prompt, policies, budget, generation, knobs,
                          chat_template=chat_template, budget_mode=budget_mode, query_agnostic=query_agnostic,
                          time_alone=time_alone or not batched, batched=batched)
        if batched:  # its first turn may share a prefill forward with turns starting about now
            self.prefills.expect(session)
        return session

    def analyse(self, image: Any, prompt: str) -> PrefillInfo:
        """Prefill only: the per-layer importance of these images and prompt (calibration, Lorenz charts)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise EngineError("the prompt is empty: type a question or instruction")
        visuals = gather_visuals(self.loaded, prompt, load_images(image), None, None, max_new_tokens=1)
        session = Session(self, visuals, prompt, {}, Budget(1.0), GenerationSettings(max_new_tokens=1))
        with self.model_in_use():
            session.turn = 0
            return session.prefill_first_turn(alone=False)

    @contextlib.contextmanager
    def model_in_use(self):
        """Our attention function registered on the model while any turn runs (turns of several sessions overlap:
        `tracked_attention_enabled` counts its open blocks, so the last to end restores the model's own)."""
        with tracked_attention_enabled(self.loaded.model):
            yield self.loaded.model

    # -- model calls ---------------------------------------------------------------------------------------
    def forward(self, cache: TrackedCache, ids: torch.Tensor, start: int, probe: AttentionProbe,
                image_flags: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` [1, T] at true positions start..start+T-1; returns the last position's logits [V]."""
        logits, _ = runner.forward_group(self.loaded.model, cache, ids, start, probe, image_flags, pixel_values)
        return logits[0]
