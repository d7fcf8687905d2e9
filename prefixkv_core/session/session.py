"""One conversation's turn loop: the first turn (prefill, compress, decode), the follow-ups (each method goes on
from its own compressed cache), and what the session tells and keeps (events, the result record).

How the rows are scheduled is `schedule.py`'s; how the first turn's caches are prefilled, `prefill.py`'s; how a
step feeds the rows and the decode loop samples them, `stepping.py`'s."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict
from typing import Any, Iterator, Protocol

import torch
from PIL import Image

from ..errors import EngineError
from ..decoding import runner
from ..decoding.vision_tower import prompt_embeds, vision_features
from ..models import ImageLayout, encode, format_followup, vision_inputs
from ..policies import Budget, Policy, role_methods, row_label
from ..report.events import KeptImageMap, MethodEvent, PrefillInfo
from ..report.record import ComparisonRecord
from .generation import GenerationSettings
from .kept_image import kept_image_map, kept_per_image
from .method_state import MethodState
from .prefill import EncodedPrompt, Prefiller, encode_prompt, prefill_info, share_image, shared_prefill_ticket
from .prefill_pool import PrefillPool, PrefillTicket
from .schedule import schedule_for
from .model_worker import PREFILL, ModelWorker
from .step_pool import StepPool
from .stepping import RowStepper
from .teacher_forcing import answer_nll
from .image_input import load_images
from .stepping import TurnInput
from .visuals import TurnVisuals, gather_visuals


class ModelHolder(Protocol):
    """What a session needs of the engine that made it (`engine.Engine`)."""

    loaded: Any  # the LoadedModel
    worker: ModelWorker  # the model's thread: every prefill and step runs there
    pool: StepPool  # the decode steps of every session decoding now, batched together
    eos_ids: set[int]

    def model_in_use(self) -> contextlib.AbstractContextManager: ...


class Session:
    """One conversation: the image, the turns so far, and every method's own compressed cache.

    Every active method is one row of the runner's batch: each decode step feeds all of them in one model
    call, then each policy compresses its own cache, then one event per method is yielded. With `time_alone`,
    each method is then decoded again on its own and those events say `alone=True`; without `batched`, the
    methods are decoded on their own only, one after another."""

    def __init__(self, engine: ModelHolder, visuals: TurnVisuals, prompt: str, policies: dict[str, Policy],
                 budget: Budget, generation: GenerationSettings, knobs: dict[str, dict[str, Any]] | None = None,
                 chat_template: bool = True, budget_mode: str = "published", query_agnostic: bool = False,
                 time_alone: bool = False, batched: bool = True):
        self.engine = engine
        self.batched = batched  # decode the methods as one batch (else each alone, one after another)
        self.time_alone = time_alone or not batched  # every method's own timings are measured
        self.schedule = schedule_for(batched, self.time_alone)
        self.timing: list[MethodState] = []  # copies being decoded alone after the batched run (their caches)
        self.budget_mode = budget_mode  # one of BUDGET_MODES, for every method of this session
        # True: the prompt before the question is compressed first, then the question is fed (see new_session)
        self.query_agnostic = query_agnostic
        self.chat_template = chat_template  # False: the prompt is plain text, fed without turn markup
        self.visuals = visuals  # the first turn's images and video frames, and the prompt placing them
        self.prompt = prompt
        self.budget = budget
        self.generation = generation
        self.states = {name: MethodState(name, p) for name, p in policies.items()}
        self.turn = -1
        self.user_turns = [prompt]
        self.prefill: PrefillInfo | None = None
        self.bytes_per_token = 0.0
        self.encoded: EncodedPrompt | None = None  # the first turn's prompt, once encoded
        self.released = False
        loaded = engine.loaded
        self.stepper = RowStepper(loaded, generation, engine.eos_ids, engine.worker, engine.pool)
        self._turn_lock = threading.Lock()  # one turn of this conversation at a time
        # the result record every consumer reads (CLI --json, results(), benchmarks), fed with every event
        self.record = ComparisonRecord(
            list(policies), {n: row_label(n, p) for n, p in policies.items()}, prompt, budget, settings=asdict(generation),
            knobs=knobs, model={"name": loaded.name, "device": str(loaded.device)}, budget_mode=budget_mode,
            query_agnostic=query_agnostic, batched=self.batched, alone=self.time_alone, roles=role_methods())
        self.record.visuals = visuals.describe()

    @property
    def image(self) -> Image.Image | None:
        """The first turn's first image (or frame), if any."""
        images = self.images
        return images[0] if images else None

    @property
    def images(self) -> list[Image.Image]:
        """The first turn's images and its video's frames, in the order the model reads them."""
        return [picture for _, picture in self.visuals.in_order()]

    @property
    def image_offset(self) -> int | None:
        return self.encoded.image_offset if self.encoded is not None else None

    @property
    def image_layout(self) -> ImageLayout | None:
        """Where each image token comes from (views, grids)."""
        return self.encoded.image_layout if self.encoded is not None else None

    # -- the turns -----------------------------------------------------------------------------------------
    def run(self, cancel: threading.Event | None = None) -> Iterator[PrefillInfo | MethodEvent]:
        """First turn: shared prefill, per-method compression, every method decoded as one batch."""
        if self.turn >= 0:
            raise EngineError("this session already ran its first turn; use follow_up()")
        with self._model_turn():
            self.turn = 0
            yield from self._recorded(self.schedule.first_turn(self, cancel))

    def follow_up(self, prompt: str, cancel: threading.Event | None = None, *, image: Any = None
                  ) -> Iterator[MethodEvent]:
        """Next user turn: each method continues on its own compressed cache (all methods in one batch). `image`:
        None, one image or a list of images the turn adds (placed as in the first turn: before the text, or where
        the prompt's `<image>` markers put them); their tokens are fed whole to every method, whose policy then
        treats them as it treats any turn's input."""
        if self.turn < 0:
            raise EngineError("run() the first turn before a follow-up")
        if not self.chat_template:
            raise EngineError("a plain-text session (chat_template=False) has no turns to follow up")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EngineError("the follow-up prompt is empty")
        if self.released:
            raise EngineError("this comparison's caches were released to free memory; run Compare again")
        loaded = self.engine.loaded
        images = load_images(image)
        visuals = gather_visuals(loaded, prompt, images, None, None, max_new_tokens=self.generation.max_new_tokens,
                                 first_turn=False)
        with self._model_turn():
            turn = self._turn_input(visuals)
            self.turn += 1
            self.user_turns.append(prompt)
            self.record.begin_turn(prompt)
            yield from self._recorded(self._next_turn(turn, cancel))

    def _turn_input(self, visuals: TurnVisuals) -> TurnInput:
        """A follow-up's text (and images) as the model reads it; with images, their features through the vision
        tower once, scattered into the image tokens' embeddings (on the model's thread)."""
        loaded = self.engine.loaded
        text = format_followup(loaded, visuals.prompt, images=visuals.count)
        encoded = encode(loaded, visuals.images or None, text, add_special_tokens=False)
        ids = encoded["input_ids"]
        self._check_followup_fits(ids[0].tolist())  # before the vision tower runs
        if not visuals.count:
            return TurnInput(ids[0].tolist())
        from ..models.families import hooks

        is_image = loaded.visual_mask(ids)
        images = runner.vision_kwargs(vision_inputs(encoded))
        if not hooks(loaded.family).tower_shared(loaded.model.config):  # each row reads the pixels (DeepStack)
            return TurnInput(ids[0].tolist(), None, is_image[0].tolist(), images)

        def embed():
            with torch.inference_mode():
                features = vision_features(loaded.model, runner.vision_kwargs(vision_inputs(encoded)), record=False)
                return prompt_embeds(loaded.model, ids, is_image, features.image)[0]

        return TurnInput(ids[0].tolist(), self.stepper.on_model(embed), is_image[0].tolist(), images)

    def _next_turn(self, turn: TurnInput, cancel: threading.Event | None) -> Iterator[MethodEvent]:
        live = [s for s in self.states.values() if s.error is None]
        for state in self.states.values():
            if state.error is not None:
                yield self.event(state, "error", alone=self.schedule.alone)
        for state in live:
            state.answers.append(state.text)
        yield from self.schedule.next_turn(self, live, turn, cancel)

    def _check_followup_fits(self, new_ids: list[int]) -> None:
        limit = self.engine.loaded.max_context
        for state in self.states.values():
            if state.error is not None:
                continue
            total = state.true_len + len(state.carry_over(self.engine.eos_ids) + new_ids) + self.generation.max_new_tokens
            if total > limit:
                raise EngineError(f"the conversation would reach {total} tokens, over the model's context of "
                                  f"{limit}; start a new comparison")

    def score_answer(self, answer: str) -> dict[str, tuple[float, int]]:
        """Teacher forcing (`teacher_forcing.py`): feed the reference answer through each method's compressed
        cache, compressing after every token exactly as in generation (all methods in one batch). Returns
        method -> (sum of NLL, answer tokens)."""
        if self.turn >= 0:
            raise EngineError("score_answer() replaces the first turn; use a fresh session")
        tok = self.engine.loaded.processor.tokenizer
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
        if not answer_ids:
            raise EngineError("the reference answer is empty")
        with self._model_turn():
            self.turn = 0
            self.prefill_first_turn(alone=False)
            try:
                return self.stepper.on_model(lambda: answer_nll(self.stepper, list(self.states.values()), answer_ids))
            finally:
                self.stepper.reset()

    # -- what the schedules call ---------------------------------------------------------------------------
    def prefill_first_turn(self, alone: bool, states: list[MethodState] | None = None) -> PrefillInfo:
        """Encode the first turn's prompt, prefill and compress the caches of `states` (default: every method; one
        shared prefill, or each its own when `alone`) and sample each first token, on the model's thread."""
        loaded = self.engine.loaded
        pool: PrefillPool | None = getattr(self.engine, "prefills", None)
        chosen = list(self.states.values()) if states is None else states
        with pool.coming(self) if pool is not None and not alone else contextlib.nullcontext():
            self.encoded = encode_prompt(loaded, self.visuals, chat_template=self.chat_template,
                                         query_agnostic=self.query_agnostic,
                                         max_new_tokens=self.generation.max_new_tokens)
            if not alone:  # the shared prefill and every own prefill of the turn read one pass of the vision tower
                share_image(loaded, self.encoded, [s.policy for s in self.states.values()])
            ticket = shared_prefill_ticket(self.encoded, chosen) if pool is not None and not alone else None
        analysis = self._on_model_sharing(lambda: self._prefiller(pool, ticket).run(chosen, alone=alone), pool,
                                          ticket)
        self._drop_image_once_prefilled()
        self.bytes_per_token = analysis.bytes_per_token
        self.prefill = prefill_info(loaded, self.encoded, analysis)
        return self.prefill

    def prefill_more(self, states: list[MethodState], alone: bool) -> None:
        """After the first turn's prefill: more of its states (a method with a prefill of its own that joins the
        running batch, or a copy to be timed alone), prefilled and compressed, each first token sampled, on the
        model's thread."""
        self.stepper.on_model(lambda: self._prefiller().run(states, alone=alone, analysis=False))
        self._drop_image_once_prefilled()

    def event(self, state: MethodState, kind: str, **how: Any) -> MethodEvent:
        event = state.event(kind, turn=max(self.turn, 0), bytes_per_token=self.bytes_per_token, **how)
        if kind == "done":
            event.kept_per_image = kept_per_image(state.cache, self._image_positions(), self.image_layout,
                                                  state.policy, state.policy_state)
        return event

    def _image_positions(self):
        if self.encoded is None or not self.encoded.n_image:
            return None
        return self.encoded.is_image[0].nonzero().flatten().cpu().numpy()

    # -- memory and results ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop every method's cache (answers and figures stay readable). A follow-up then says to run again.
        Waits for this conversation's turn, if one runs."""
        with self._turn_lock:
            for state in self.states.values():
                state.cache = None
            self.visuals = TurnVisuals([], self.visuals.prompt)
            self._drop_shared_image()
            self.stepper.reset()
            self.timing = []
            self.released = True

    def cache_bytes(self) -> int:
        """Bytes held by this session's caches right now, the batched step's padded tensors included while a
        turn runs (0 once released)."""
        self._settled()
        held = sum(s.cache.stored_nbytes() for s in [*self.states.values(), *self.timing] if s.cache is not None)
        shared = self.encoded.shared_image if self.encoded is not None else None
        return held + self.stepper.nbytes() + (shared.nbytes() if shared is not None else 0)

    def results(self) -> dict[str, dict[str, Any]]:
        """Per-method figures of the current turn, from the result record (see `record.to_dict()` for all)."""
        return self.record.to_dict()["methods"]

    def kept_image_map(self, method: str, layer: int) -> KeptImageMap | None:
        """Share of KV heads that still hold each image token in `layer`, placed on the image's views (every
        crop and newline token of an anyres image included), for the overlay (`kept_image.py`)."""
        state = self.states[method]
        self._settled()
        return kept_image_map(state.cache, layer, self._image_positions(), self.image_layout, state.policy,
                              state.policy_state)

    def kept_image_maps(self, methods: list[str], layer: int) -> dict[str, KeptImageMap | None]:
        """`kept_image_map` of each method at `layer`; None for a method with no cache to show (it failed)."""
        maps: dict[str, KeptImageMap | None] = {}
        for method in methods:
            try:
                maps[method] = self.kept_image_map(method, layer)
            except Exception:  # noqa: BLE001 - a failed method has no cache to show
                maps[method] = None
        return maps

    # -- internals -----------------------------------------------------------------------------------------
    def _settled(self) -> None:
        """A turn that ended may leave its rows' moves out of the batch's shared stores to the model's thread (the
        turn does not wait for them); a reader of the caches waits for them here."""
        if self.stepper.pool is not None:
            self.stepper.pool.settled([*self.states.values(), *self.timing])

    def _drop_image_once_prefilled(self) -> None:
        """The first turn's shared pass of the vision tower is kept for the own prefills still to come (they run
        between decode steps), and dropped once every method has its cache (or failed)."""
        if all(s.cache is not None or s.error is not None for s in self.states.values()):
            self._drop_shared_image()

    def _drop_shared_image(self) -> None:
        if self.encoded is not None:
            self.encoded.shared_image = None

    def _on_model_sharing(self, fn, pool: PrefillPool | None, ticket: PrefillTicket | None):
        """fn() on the model's thread, with `ticket` waiting in the pool meanwhile, as a job that the forward
        serving the ticket may run at once with its own (so that the turns whose prompts shared it start decoding
        together, before any step of the others)."""
        worker, steps = self.stepper.worker, self.stepper.pool
        if ticket is None:
            return self.stepper.on_model(fn)
        if worker is None:
            with pool.waiting(ticket):
                return fn()

        def prefill_then_arrive():
            try:
                out = fn()
            except BaseException:
                if steps is not None:  # it will not decode: the others' steps wait for it no longer
                    steps.not_arriving(self.stepper)
                raise
            if steps is not None:  # the steps of others wait (briefly) for this turn to join them
                steps.arriving(self.stepper, ready=True)
            return out

        job = worker.prepare(prefill_then_arrive)
        ticket.finish = lambda: worker.run_early(job)
        if steps is not None:
            ticket.arrive = lambda: steps.arriving(self.stepper)
        try:
            with pool.waiting(ticket):
                return worker.wait_for(worker.enqueue(job, PREFILL))
        finally:  # the ticket's callbacks hold the job, whose closure holds the ticket: no cycle left for gc
            ticket.finish = ticket.arrive = None

    def _prefiller(self, pool: PrefillPool | None = None, ticket: PrefillTicket | None = None) -> Prefiller:
        return Prefiller(self.engine.loaded, self.stepper, self.encoded, self.budget, self.generation.seed, pool,
                         ticket)

    @contextlib.contextmanager
    def _model_turn(self):
        """One turn of this conversation, with our attention function on the model. The model itself is held for
        each prefill and each step only: other conversations' turns prefill between this one's steps and decode in
        the same batched forwards (`step_pool.py`), all on the model's thread (`model_worker.py`)."""
        with self._turn_lock, self.engine.model_in_use():
            if self.released:  # released while waiting for the model
                raise EngineError("this comparison's caches were released to free memory; run Compare again")
            yield

    def _recorded(self, events: Iterator[PrefillInfo | MethodEvent]) -> Iterator[PrefillInfo | MethodEvent]:
        self.record.active = True
        try:
            for item in events:
                self.record.apply(item)
                yield item
        finally:
            self.record.active = False
            self.stepper.reset()  # the padded step tensors live for one turn
            self.timing = []  # so do the copies timed alone
            self._drop_shared_image()  # and the first turn's image features (a stopped turn leaves own prefills)

