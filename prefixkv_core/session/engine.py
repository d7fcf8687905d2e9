"""One prefill shared by every method, a cache copy per method, and interleaved decoding that streams
per-step events. Batch size 1: one image and one conversation per session.

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

This module is the turn loop (prefill, compress, decode, follow up). The pieces it runs on have their own:
`method_state.py` (one method's cache and progress, and its events), `generation.py` (settings, the next
token, the answer's text), `image_input.py` (the image checked), `prompt_layout.py` (where the question and
the image tokens are), `teacher_forcing.py` (scoring a reference answer), `kept_image.py` (the overlay's map).
"""
from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Any, Iterator

import torch
from PIL import Image

from ..decoding import runner
from ..kv.attention import AttentionProbe, tracked_attention_enabled
from ..kv.cache import TrackedCache
from ..errors import EngineError
from ..report.events import KeptImageMap, MethodEvent, PrefillInfo
from .generation import GenerationSettings, answer_text, next_token
from .image_input import MAX_IMAGE_SIDE, load_image
from .kept_image import kept_image_map
from .method_state import MethodState
from ..models import ImageLayout, LoadedModel, encode, format_followup, format_prompt, vision_inputs
from ..policies import BUDGET_MODES, Budget, Policy, PolicyError, ResolveContext, make_policy, resolve_methods
from .prompt_layout import image_token_layout, question_start
from ..report.record import ComparisonRecord
from .teacher_forcing import answer_nll

__all__ = ["Engine", "Session", "EngineError", "GenerationSettings", "MethodState", "MAX_IMAGE_SIDE"]


class Engine:
    """Holds a loaded model. Runs are serialised: one session generates at a time on one model."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.lock = threading.Lock()
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
                    batched: bool = True) -> "Session":
        """`chat_template=False` feeds the prompt as plain text (the tokenizer's own special tokens, then the
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
        own). The answers are the same either way."""
        if isinstance(prompt, (list, tuple)):
            raise EngineError("the engine runs batch size 1: pass one prompt, not a list")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EngineError("the prompt is empty: type a question or instruction")
        if not chat_template and image is not None:
            raise EngineError("a plain-text prompt (chat_template=False) takes no image")
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
        if query_agnostic and not chat_template:
            raise EngineError("a plain-text prompt (chat_template=False) has no question to hold back: "
                              "query_agnostic needs the chat template")
        generation = generation or GenerationSettings()
        generation.validate()
        knobs = knobs or {}
        # what a policy may need before it runs (e.g. offline PrefixKV's calibrated ratios, Random's seed)
        context = ResolveContext(self.loaded.slug, self.loaded.name, self.loaded.num_layers, budget,
                                 seed=generation.seed)
        policies = {}
        for name in names:
            try:
                policies[name] = make_policy(name, budget, budget_mode, **dict(knobs.get(name, {}))).resolve(context)
            except (PolicyError, TypeError) as exc:
                raise EngineError(str(exc)) from None
        return Session(self, self.load_image(image), prompt, policies, budget, generation, knobs,
                       chat_template=chat_template, budget_mode=budget_mode, query_agnostic=query_agnostic,
                       time_alone=time_alone or not batched, batched=batched)

    def analyse(self, image: Any, prompt: str) -> PrefillInfo:
        """Prefill only: the per-layer importance of this image and prompt (calibration, Lorenz charts)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise EngineError("the prompt is empty: type a question or instruction")
        session = Session(self, self.load_image(image), prompt, {}, Budget(1.0), GenerationSettings(max_new_tokens=1))
        with self.lock, tracked_attention_enabled(self.loaded.model):
            session.turn = 0
            return session._prefill_all()

    # -- model calls ---------------------------------------------------------------------------------------
    def forward(self, cache: TrackedCache, ids: torch.Tensor, start: int, probe: AttentionProbe,
                image_flags: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `ids` [1, T] at true positions start..start+T-1; returns the last position's logits [V]."""
        logits, _ = runner.forward_group(self.loaded.model, cache, ids, start, probe, image_flags, pixel_values)
        return logits[0]


class Session:
    """One conversation: the image, the turns so far, and every method's own compressed cache.

    Every active method is one row of the runner's batch: each decode step feeds all of them in one model
    call, then each policy compresses its own cache, then one event per method is yielded. With `time_alone`,
    each method is then decoded again on its own and those events say `alone=True`; without `batched`, the
    methods are decoded on their own only, one after another."""

    def __init__(self, engine: Engine, image: Image.Image | None, prompt: str, policies: dict[str, Policy],
                 budget: Budget, generation: GenerationSettings, knobs: dict[str, dict[str, Any]] | None = None,
                 chat_template: bool = True, budget_mode: str = "published", query_agnostic: bool = False,
                 time_alone: bool = False, batched: bool = True):
        self.engine = engine
        self.batched = batched  # decode the methods as one batch (else each alone, one after another)
        self.time_alone = time_alone or not batched  # every method's own timings are measured
        self._timing: list[MethodState] = []  # copies being decoded alone after the batched run (their caches)
        self.budget_mode = budget_mode  # one of BUDGET_MODES, for every method of this session
        # True: the prompt before the question is compressed first, then the question is fed (see new_session)
        self.query_agnostic = query_agnostic
        self.chat_template = chat_template  # False: the prompt is plain text, fed without turn markup
        self.image = image
        self.prompt = prompt
        self.budget = budget
        self.generation = generation
        self.states = {name: MethodState(name, p) for name, p in policies.items()}
        self.turn = -1
        self.user_turns = [prompt]
        self.prefill: PrefillInfo | None = None
        self.bytes_per_token = 0.0
        self.image_offset: int | None = None
        self.image_layout: ImageLayout | None = None  # where each image token comes from (views, grids)
        self.released = False
        self._buffers: runner.StepBuffers | None = None  # padded step tensors, reused within one turn
        loaded = engine.loaded
        # the result record every consumer reads (CLI --json, results(), benchmarks), fed with every event
        self.record = ComparisonRecord(
            list(policies), {n: p.label for n, p in policies.items()}, prompt, budget, settings=asdict(generation),
            knobs=knobs, model={"name": loaded.name, "device": str(loaded.device)}, budget_mode=budget_mode,
            query_agnostic=query_agnostic, batched=self.batched, alone=self.time_alone)

    def _recorded(self, events: Iterator[PrefillInfo | MethodEvent]) -> Iterator[PrefillInfo | MethodEvent]:
        self.record.active = True
        try:
            for item in events:
                self.record.apply(item)
                yield item
        finally:
            self.record.active = False
            self._buffers = None  # the padded step tensors live for one turn
            self._timing = []  # so do the copies timed alone

    # -- public ------------------------------------------------------------------------------------------
    def run(self, cancel: threading.Event | None = None) -> Iterator[PrefillInfo | MethodEvent]:
        """First turn: shared prefill, per-method compression, every method decoded as one batch."""
        if self.turn >= 0:
            raise EngineError("this session already ran its first turn; use follow_up()")
        with self.engine.lock, tracked_attention_enabled(self.engine.loaded.model):
            if self.released:  # released while waiting for the model
                raise EngineError("this comparison's caches were released to free memory; run Compare again")
            self.turn = 0
            yield from self._recorded(self._first_turn(cancel))

    def _first_turn(self, cancel: threading.Event | None) -> Iterator[PrefillInfo | MethodEvent]:
        yield self._prefill_all()
        alone = not self.batched
        if not alone:
            self._form_batch(list(self.states.values()))
        for state in self.states.values():
            yield self._event(state, "start", alone=alone)
        if alone:
            for state in self.states.values():
                yield from self._decode_all(cancel, [state], alone=True)
            return
        yield from self._decode_all(cancel)
        if not self.time_alone:
            return
        # every method again on its own: its own prefill, compression and decoding, timed alone
        for name, done in self.states.items():
            if done.error is not None or (cancel is not None and cancel.is_set()):
                continue
            twin = MethodState(name, done.policy)
            self._timing = [twin]
            self._prefill_states([twin], alone=True, analysis=False)
            yield self._event(twin, "start", alone=True)
            yield from self._decode_all(cancel, [twin], alone=True)
            self._timing = []

    def follow_up(self, prompt: str, cancel: threading.Event | None = None) -> Iterator[MethodEvent]:
        """Next user turn: each method continues on its own compressed cache (all methods in one batch)."""
        if self.turn < 0:
            raise EngineError("run() the first turn before a follow-up")
        if not self.chat_template:
            raise EngineError("a plain-text session (chat_template=False) has no turns to follow up")
        if not isinstance(prompt, str) or not prompt.strip():
            raise EngineError("the follow-up prompt is empty")
        if self.released:
            raise EngineError("this comparison's caches were released to free memory; run Compare again")
        loaded = self.engine.loaded
        with self.engine.lock, tracked_attention_enabled(loaded.model):
            followup = format_followup(loaded, prompt)
            new_ids = encode(loaded, None, followup, add_special_tokens=False)["input_ids"][0].tolist()
            for state in self.states.values():
                if state.error is not None:
                    continue
                total = state.true_len + len(state.carry_over(self.engine.eos_ids) + new_ids) + self.generation.max_new_tokens
                if total > loaded.max_context:
                    raise EngineError(f"the conversation would reach {total} tokens, over the model's context of "
                                      f"{loaded.max_context}; start a new comparison")
            self.turn += 1
            self.user_turns.append(prompt)
            self.record.begin_turn(prompt)
            yield from self._recorded(self._next_turn(new_ids, cancel))

    def _next_turn(self, new_ids: list[int], cancel: threading.Event | None) -> Iterator[MethodEvent]:
        live = [s for s in self.states.values() if s.error is None]
        for state in self.states.values():
            if state.error is not None:
                yield self._event(state, "error", alone=not self.batched)
        for state in live:
            state.answers.append(state.text)
        if not self.batched:  # each method fed and decoded on its own, one after another
            for state in live:
                self._feed_turn([state], new_ids)
                yield self._event(state, "error" if state.error is not None else "start", alone=True)
                yield from self._decode_all(cancel, [state], alone=True)
            return
        # copies of every cache as the turn starts, to decode each method alone after the batched run
        copies = [s.twin() for s in live] if self.time_alone else []
        self._timing = copies
        self._feed_turn(live, new_ids)
        self._form_batch(live)
        for state in live:
            yield self._event(state, "error" if state.error is not None else "start")
        yield from self._decode_all(cancel)
        while copies:
            twin = copies.pop(0)
            self._timing = [twin, *copies]
            if self.states[twin.name].error is not None or (cancel is not None and cancel.is_set()):
                continue
            self._feed_turn([twin], new_ids)
            yield self._event(twin, "error" if twin.error is not None else "start", alone=True)
            yield from self._decode_all(cancel, [twin], alone=True)
        self._timing = []

    def release(self) -> None:
        """Drop every method's cache (answers and figures stay readable). A follow-up then says to run again."""
        with self.engine.lock:
            for state in self.states.values():
                state.cache = None
            self.image = None
            self._buffers = None
            self._timing = []
            self.released = True

    def cache_bytes(self) -> int:
        """Bytes held by this session's caches right now, the batched step's padded tensors included while a
        turn runs (0 once released)."""
        held = sum(s.cache.stored_nbytes() for s in [*self.states.values(), *self._timing] if s.cache is not None)
        return held + (self._buffers.nbytes() if self._buffers is not None else 0)

    def results(self) -> dict[str, dict[str, Any]]:
        """Per-method figures of the current turn, from the result record (see `record.to_dict()` for all)."""
        return self.record.to_dict()["methods"]

    def kept_image_map(self, method: str, layer: int) -> KeptImageMap | None:
        """Share of KV heads that still hold each image token in `layer`, placed on the image's views (every
        crop and newline token of an anyres image included), for the overlay (`kept_image.py`)."""
        state = self.states[method]
        return kept_image_map(state.cache, layer, self.image_offset, self.image_layout, state.policy,
                              state.policy_state)

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
        with self.engine.lock, tracked_attention_enabled(self.engine.loaded.model):
            self.turn = 0
            self._prefill_all()
            try:
                return answer_nll(self, answer_ids)
            finally:
                self._buffers = None

    # -- internals ---------------------------------------------------------------------------------------
    def _prefill_all(self) -> PrefillInfo:
        """Prefill and compress every method's cache: one shared prefill, or (not batched) one per method."""
        loaded = self.engine.loaded
        n, n_image, is_image, split, importance, curves, prefill_s = self._prefill_states(
            list(self.states.values()), alone=not self.batched)
        first = self.image_layout.views[0] if self.image_layout is not None else None
        self.prefill = PrefillInfo(
            prompt_tokens=n, image_tokens=n_image, num_layers=loaded.num_layers,
            importance=importance.float().cpu().numpy(), is_image=is_image[0, :split].cpu().numpy(),
            image_grid=(first.rows, first.cols) if first is not None else None, image_offset=self.image_offset,
            prefill_s=prefill_s, image_layout=self.image_layout, curves=curves, compressed_tokens=split)
        return self.prefill

    def _prefill_states(self, states: list[MethodState], alone: bool, analysis: bool = True):
        """Encode the prompt, prefill and compress each state's cache and sample its first token. `alone`: each
        state gets its own prefill, recording only its own policy's statistics (its time to first token is
        then all its own); else one prefill is shared (the last state takes its cache, the others a copy).
        Returns (prompt tokens, image tokens, image flags, tokens compressed at once, importance [L, N_c], Lorenz
        curves, prefill seconds: the shared one, or the first state's own); None without `analysis` (a method
        timed alone again)."""
        loaded = self.engine.loaded
        text = (format_prompt(loaded, self.prompt, with_image=self.image is not None) if self.chat_template
                else self.prompt)
        inputs = encode(loaded, self.image, text)
        ids = inputs["input_ids"]
        n = ids.shape[1]
        is_image = ids == loaded.image_token_id
        n_image = int(is_image.sum())
        if n + self.generation.max_new_tokens > loaded.max_context:
            raise EngineError(
                f"the prompt is {n} tokens ({n_image} for the image) + {self.generation.max_new_tokens} new tokens, "
                f"over the model's context of {loaded.max_context}: shorten the prompt or lower max new tokens")
        self.image_offset = int(is_image[0].nonzero()[0]) if n_image else None
        self.image_layout = image_token_layout(loaded, self.image, n_image)
        # the tokens compressed at once: the whole prompt, or (query-agnostic) what comes before the question
        split = question_start(loaded, self.image, self.prompt, text, ids, is_image) if self.query_agnostic else n

        def shared_prefill(policies):
            return runner.prefill(loaded.model, context, context_image, vision_inputs(inputs), policies,
                                  loaded.num_layers, loaded.device)

        # one prefill shared by every method that compresses its cache (it also gives the importance charts);
        # a method that changes the prefill itself (prefill token reduction) runs its own below. Alone, every
        # method runs its own, recording only what its policy asks for.
        context, context_image = ids[:, :split], is_image[:, :split]
        sharing = [s for s in states if not s.policy.own_prefill()]
        shared = None if alone else shared_prefill([s.policy for s in sharing])
        analysed = shared  # the prefill whose column sums the importance charts show
        if shared is not None:
            self.bytes_per_token = shared.cache.nbytes() / split  # before any compression
        curves = {}  # method -> the importance its per-layer allocation used (its Lorenz curves)

        for state in states:
            state.generator = torch.Generator(device="cpu").manual_seed(self.generation.seed)
            try:
                if state.policy.own_prefill():
                    prefilled = runner.own_prefill(loaded.model, state.policy, context, context_image,
                                                   vision_inputs(inputs), loaded.num_layers, loaded.device,
                                                   loaded.image_token_id)
                    state.cache = prefilled.cache
                elif alone:
                    prefilled = shared_prefill([state.policy])
                    state.cache = prefilled.cache
                    if analysed is None and analysis:
                        analysed = prefilled
                        self.bytes_per_token = prefilled.cache.nbytes() / split
                else:  # the last method to share the prefill takes its cache, the others a copy
                    prefilled = shared
                    state.cache = shared.cache if state is sharing[-1] else shared.cache.clone()
                own_n = prefilled.prompt_len
                state.prompt_len = state.true_len = own_n
                state.reduced_by = split - own_n
                state.first_logits = prefilled.logits[0]
                t1 = runner.now(loaded.device)
                stats = runner.policy_stats(state.policy, prefilled.stats, own_n)
                state.policy_state = runner.compress_prefill(state.policy, state.cache, stats, own_n, self.budget,
                                                             prefilled.reduction, state.reduced_by)
                used = state.policy.allocation_importance(state.policy_state)
                if used is not None:
                    curves[state.name] = used.float().cpu().numpy()
                state.compress_s = runner.now(loaded.device) - t1
                state.ttft_s = prefilled.seconds + state.compress_s
            except Exception as exc:  # one method failing must not stop the others
                state.fail(exc)
        if split < n:  # each method alone is fed the question on its own
            for group in ([[s] for s in states] if alone else [states]):
                self._feed_question(ids[0, split:].tolist(), group)
        for state in states:
            if state.error is None:
                state.pending = self._sample(state, state.first_logits)
                state.turn_ids = [state.pending]
                state.text = self._detok(state.turn_ids)
        if not analysis:
            return None
        if analysed is None:  # every method ran a prefill of its own: the charts' analysis is still wanted
            analysed = shared_prefill([])
            self.bytes_per_token = analysed.cache.nbytes() / split
        importance = torch.stack([analysed.stats[l]["colsum"][0].mean(dim=0) for l in range(loaded.num_layers)])
        return n, n_image, is_image, split, importance, curves, analysed.seconds

    def _feed_question(self, question: list[int], states: list[MethodState]) -> None:
        """Query-agnostic mode: feed the question through the states' compressed caches (one batched forward);
        each method's first answer token comes from its own logits, its time to first token includes this feed
        (and its compression time the policy's work on the question)."""
        live = [s for s in states if s.error is None]
        if not live:
            return
        device = self.engine.loaded.device
        t0 = runner.now(device)
        logits, _, policy_s = self._advance(live, [list(question)] * len(live), step=0)
        elapsed = runner.now(device) - t0
        for r, state in enumerate(live):
            if state.error is None:
                state.ttft_s += elapsed
                state.compress_s = (state.compress_s or 0.0) + policy_s.get(state.name, 0.0)
                state.first_logits = logits[r]

    def _feed_turn(self, states: list[MethodState], new_ids: list[int]) -> None:
        """Feed a follow-up turn's tokens (after each method's own carried-over token) through every cache."""
        if not states:
            return
        device = self.engine.loaded.device
        t0 = runner.now(device)
        chunks = [s.carry_over(self.engine.eos_ids) + new_ids for s in states]
        logits, _, policy_s = self._advance(states, chunks, step=0)
        elapsed = runner.now(device) - t0
        for r, state in enumerate(states):
            if state.error is not None:
                continue
            state.ttft_s = elapsed
            state.compress_s = policy_s.get(state.name)
            state.compute_s, state.steps, state.finished = 0.0, 0, False
            state.pending = self._sample(state, logits[r])
            state.turn_ids = [state.pending]
            state.text = self._detok(state.turn_ids)

    def _form_batch(self, states: list[MethodState]) -> None:
        """The methods about to decode together move into the batch's shared stores before the first step."""
        max_new = self.generation.max_new_tokens
        active = [s for s in states if s.error is None and s.cache is not None and not s.finished
                  and not self._is_done(s, max_new)]
        if len(active) < 2:
            return
        if self._buffers is None:
            self._buffers = runner.StepBuffers()
        try:
            runner.form_batch([s.cache for s in active], [s.policy.decode_needs_attention() for s in active],
                              self._buffers)
        except Exception:  # noqa: BLE001 - the first step meets the same problem and fails its rows with it
            self._buffers = None

    def _advance(self, states: list[MethodState], chunks: list[list[int]], step: int
                 ) -> tuple[torch.Tensor, float, dict[str, float]]:
        """Feed chunks[r] to states[r] in one batched forward, then let each policy compress its own cache.
        Returns (logits [B, V], forward seconds, method -> policy seconds). A failing forward fails every row
        in it; a failing policy fails its own method only."""
        loaded = self.engine.loaded
        device = loaded.device
        t0 = runner.now(device)
        try:
            if self._buffers is None:
                self._buffers = runner.StepBuffers()
            out = runner.forward_rows(loaded.model, [s.cache for s in states], chunks, [s.true_len for s in states],
                                      [s.policy.decode_needs_attention() for s in states], device, self._buffers)
        except Exception as exc:
            for state in states:
                state.fail(exc)
            return torch.zeros(len(states), 1), 0.0, {}
        forward_s = runner.now(device) - t0
        rows = []
        for r, (state, chunk) in enumerate(zip(states, chunks)):
            state.true_len += len(chunk)
            rows.append(runner.DecodeRow(state.policy, state.policy_state, state.cache, state.true_len,
                                         state.prompt_len, step, out.attention[r], state.reduced_by))
        policy_s = {}
        for state, (seconds, error) in zip(states, runner.compress_decode_rows(rows, device)):
            if error is not None:  # one method failing must not stop the others
                state.fail(error)
            policy_s[state.name] = seconds
        return out.logits, forward_s, policy_s

    def _decode_all(self, cancel: threading.Event | None, states: list[MethodState] | None = None,
                    alone: bool = False) -> Iterator[MethodEvent]:
        """Every active method (of `states`, default all) decodes one token per step, all in one batch; one
        event per method per step. `alone`: the events say the states were decoded on their own."""
        states = list(self.states.values()) if states is None else states
        max_new = self.generation.max_new_tokens
        for state in states:
            if state.error is None and self._is_done(state, max_new):
                state.finished = True
        for state in states:
            if state.error is None:
                yield self._event(state, "done" if state.finished else "token", delta=state.text, alone=alone)
        while True:
            active = [s for s in states if not s.finished and s.error is None]
            if not active:
                return
            if cancel is not None and cancel.is_set():
                for s in active:
                    s.finished = True
                    yield self._event(s, "cancelled", alone=alone)
                return
            logits, forward_s, policy_s = self._advance(active, [[s.pending] for s in active],
                                                        step=len(active[0].turn_ids))
            greedy = None if self.generation.do_sample else logits.argmax(dim=-1).tolist()  # one sync per step
            for r, state in enumerate(active):
                if state.error is not None:
                    yield self._event(state, "error", alone=alone)
                    continue
                own_s = policy_s.get(state.name, 0.0)
                state.compute_s += forward_s + own_s
                state.steps += 1
                state.pending = greedy[r] if greedy is not None else self._sample(state, logits[r])
                state.turn_ids.append(state.pending)
                text = self._detok(state.turn_ids)
                delta = text[len(state.text):] if text.startswith(state.text) else text
                state.text = text
                state.finished = self._is_done(state, max_new)
                yield self._event(state, "done" if state.finished else "token", delta=delta, latency=forward_s,
                                  policy_s=own_s, batch_size=len(active), alone=alone)

    def _is_done(self, state: MethodState, max_new: int) -> bool:
        return state.is_done(max_new, self.engine.eos_ids, self.generation.ignore_eos)

    def _sample(self, state: MethodState, logits: torch.Tensor) -> int:
        return next_token(logits, self.generation, state.generator)

    def _detok(self, ids: list[int]) -> str:
        return answer_text(self.engine.loaded.processor.tokenizer, ids, self.engine.eos_ids)

    def _event(self, state: MethodState, kind: str, **how: Any) -> MethodEvent:
        return state.event(kind, turn=max(self.turn, 0), bytes_per_token=self.bytes_per_token, **how)

