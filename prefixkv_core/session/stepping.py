"""A turn's steps: method rows fed through the model in one batched forward, each policy compressing its own
cache after it, and the decode loop that samples one token per row per step and reports it."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from ..decoding import runner
from ..decoding.stopwatch import Elapsed
from ..kv.cache import read_with_counts
from ..models import LoadedModel
from ..report.events import MethodEvent
from .generation import GenerationSettings, answer_text, next_token
from .method_state import MethodState
from .model_worker import PREFILL, STEP, ModelWorker
from .step_pool import StepPool, advance_rows, form_rows

# (state, kind, **how) -> the event that reports it (the session knows the turn and the bytes per token)
EventMaker = Callable[..., MethodEvent]


@dataclass
class TurnInput:
    """A follow-up turn's tokens, and with images its input embeddings (the images' features scattered into their
    tokens, computed once for every method) and which of its tokens are image tokens. A family whose model adds
    more than the embeddings (Qwen3-VL's DeepStack) has no embeddings: each method's row reads the images'
    tensors (`rope_inputs`) through the model's own path."""

    ids: list[int]
    embeds: torch.Tensor | None = None  # [T, H]
    is_image: list[bool] | None = None
    rope_inputs: dict | None = None  # the images' tensors from the processor (their grids: 3-D positions, Qwen-VL)

    @property
    def has_images(self) -> bool:
        return self.is_image is not None


class Joining(Protocol):
    """Rows that join a running decode once they are ready (the methods with a prefill of their own, prefilled one
    at a time between the others' steps)."""

    waiting: list[MethodState]

    def next(self) -> MethodState:
        """Make the next waiting row ready (its cache prefilled and compressed, its first token sampled)."""

    def stop(self) -> list[MethodState]:
        """Cancelled: the rows still waiting, each failed with a message that says it never started."""


class RowStepper:
    """Feeds rows (each a method's conversation) through the model, one batched forward per step. Holds the padded
    step tensors and shared stores the rows use within one turn (`reset` drops them)."""

    def __init__(self, loaded: LoadedModel, generation: GenerationSettings, eos_ids: set[int],
                 worker: ModelWorker | None = None, pool: StepPool | None = None):
        self.loaded = loaded
        self.generation = generation
        self.eos_ids = eos_ids
        self.worker = worker  # the model's thread (None: this thread calls the model itself)
        self.pool = pool  # batches the decode steps with other turns' (None: this turn's rows only)
        self._member: int | None = None  # this turn's membership of the pool while it decodes
        self.buffers: runner.StepBuffers | None = None
        self.unread_counts: list = []  # the last step's image counts still on the device (`StepResult.image_counts`)

    def reset(self) -> None:
        self.buffers = None

    def nbytes(self) -> int:
        return self.buffers.nbytes() if self.buffers is not None else 0

    # -- one step --------------------------------------------------------------------------------------------
    def advance(self, states: list[MethodState], chunks: list[list[int]], step: int
                ) -> tuple[torch.Tensor, Elapsed, dict[str, Elapsed]]:
        """Feed chunks[r] to states[r] in one batched forward of these rows only (the caller holds the model), then
        let each policy compress its own cache. Returns (logits [B, V], forward seconds, method -> policy
        seconds), the seconds read when first asked for (`float`, once the tokens were read back: see
        `decoding/stopwatch.py`). A failing forward fails every row in it; a failing policy fails its own method
        only."""
        if self.buffers is None:
            self.buffers = runner.StepBuffers()
        done = advance_rows(self.loaded, self.buffers, states, chunks, [step] * len(states))
        self.unread_counts = done.image_counts
        return done.logits, done.forward_s, {s.name: t for s, t in zip(states, done.policy_s)}

    def on_model(self, fn, priority: int = PREFILL):
        """fn() where the model runs: on the model's thread (`model_worker.py`), or here without one."""
        return fn() if self.worker is None else self.worker.call(fn, priority)

    def advance_shared(self, states: list[MethodState], chunks: list[list[int]], step: int, alone: bool = False
                       ) -> tuple[torch.Tensor, Elapsed, dict[str, Elapsed]]:
        """`advance`, in the step pool's batch with the rows of every other turn decoding now (other users'
        comparisons); `alone` (or without a pool): these rows only, a step of their own on the model's thread."""
        if alone or self.pool is None:
            return self.on_model(lambda: self.advance(states, chunks, step), STEP)
        done = self.pool.advance(states, chunks, [step] * len(states), member=self._member)
        self.unread_counts = done.image_counts
        return done.logits, done.forward_s, {s.name: t for s, t in zip(states, done.policy_s)}

    def form_batch(self, states: list[MethodState]) -> None:
        """The methods about to decode together move into the batch's shared stores before the first step."""
        if self.pool is not None:  # the pool forms its batch whenever its rows change
            return
        active = [s for s in states if s.error is None and s.cache is not None and not s.finished
                  and not self.is_done(s)]
        if len(active) < 2:
            return
        if self.buffers is None:
            self.buffers = runner.StepBuffers()
        if not self.on_model(lambda: form_rows(active, self.buffers), STEP):
            self.buffers = None

    # -- a turn's input ----------------------------------------------------------------------------------------
    def feed_question(self, question: list[int], states: list[MethodState]) -> None:
        """Query-agnostic mode: feed the question through the states' compressed caches (one batched forward);
        each method's first answer token comes from its own logits, its time to first token includes this feed
        (and its compression time the policy's work on the question)."""
        live = [s for s in states if s.error is None]
        if not live:
            return
        t0 = runner.now(self.loaded.device)
        logits, _, policy_s = self.advance(live, [list(question)] * len(live), step=0)
        elapsed = runner.now(self.loaded.device) - t0
        for r, state in enumerate(live):
            if state.error is None:
                state.ttft_s += elapsed
                state.compress_s = (state.compress_s or 0.0) + float(policy_s.get(state.name, 0.0))
                state.first_logits = logits[r]

    def feed_turn(self, states: list[MethodState], turn: TurnInput, alone: bool = False) -> None:
        """Feed a follow-up turn's tokens (after each method's own carried-over token) through every cache (in the
        pool's batch unless `alone`; a turn with images: each method's row on its own, as input embeddings)."""
        if not states:
            return
        t0 = runner.now(self.loaded.device)
        chunks = [s.carry_over(self.eos_ids) + turn.ids for s in states]
        if turn.has_images:
            outcome = [self.on_model(lambda s=s: self._feed_embedded(s, turn), STEP) for s in states]
            logits, policy_s = [o[0] for o in outcome], {s.name: o[1] for s, o in zip(states, outcome)}
        else:
            logits, _, policy_s = self.advance_shared(states, chunks, step=0, alone=alone)
        elapsed = runner.now(self.loaded.device) - t0
        for r, state in enumerate(states):
            if state.error is not None:
                continue
            state.ttft_s = elapsed
            own = policy_s.get(state.name)
            state.compress_s = float(own) if own is not None else None
            state.compute_s, state.steps, state.finished = 0.0, 0, False
            self.start_answer(state, logits[r])

    def _feed_embedded(self, state: MethodState, turn: TurnInput) -> tuple[torch.Tensor | None, Elapsed | float]:
        """One method's follow-up with images: its carried-over token and the turn fed as input embeddings (image
        tokens flagged), then its policy compresses as after any step. -> (logits [V], policy seconds)."""
        if state.error is not None:
            return None, 0.0
        model, device = self.loaded.model, self.loaded.device
        carry = state.carry_over(self.eos_ids)
        try:
            ids = torch.tensor([carry + turn.ids], device=device)
            flags = torch.tensor([[False] * len(carry) + list(turn.is_image)], device=device)
            wanted = state.policy.decode_needs_attention()
            request = runner.StatRequest(last_query=wanted)
            if turn.embeds is None:  # the model's own path over the turn's images (see TurnInput)
                logits, stats = runner.forward_group(model, state.cache, ids, state.true_len, request, flags,
                                                     turn.rope_inputs)
            else:
                embeds = torch.cat([model.get_input_embeddings()(ids[:, :len(carry)])[0],
                                    turn.embeds.to(device)])[None]
                logits, stats = runner.forward_group(model, state.cache, ids, state.true_len, request, flags,
                                                     inputs_embeds=embeds, rope_inputs=turn.rope_inputs)
        except Exception as exc:  # one method failing must not stop the others
            state.fail(exc)
            return None, 0.0
        state.true_len += ids.shape[1]
        row = runner.DecodeRow(state.policy, state.policy_state, state.cache, state.true_len, state.prompt_len, 0,
                               runner.last_query(stats) if wanted else None, state.reduced_by)
        (seconds, error), = runner.compress_decode_rows([row], device)
        if error is not None:
            state.fail(error)
        return logits[0], seconds

    def start_answer(self, state: MethodState, logits: torch.Tensor) -> None:
        """The turn's first answer token, sampled from the logits after its input."""
        state.pending = self.sample(state, logits)
        state.turn_ids = [state.pending]
        state.text = self.detok(state.turn_ids)

    # -- the decode loop ---------------------------------------------------------------------------------------
    def decode(self, states: list[MethodState], event: EventMaker, cancel: threading.Event | None,
               alone: bool = False, joining: Joining | None = None) -> Iterator[MethodEvent]:
        """Every active state decodes one token per step, all in one batch; one event per state per step.
        `alone`: the events say the states were decoded on their own. `joining`: rows with a prefill of their own,
        prefilled one after another once the others' first tokens went out, each streaming its own first token as
        soon as it is ready, then all decoded as one batch: a late row's first token waits for no step of the others,
        and the batch is whole from its first step (fewer steps in smaller batches at the end)."""
        if alone or self.pool is None:
            yield from self._decode(list(states), event, cancel, alone, joining)
            return
        with self.pool.member(self) as member:  # other turns' rows share these steps
            self._member = member
            try:
                yield from self._decode(list(states), event, cancel, alone, joining)
            finally:
                self._member = None

    def _decode(self, rows: list[MethodState], event: EventMaker, cancel: threading.Event | None, alone: bool,
                joining: Joining | None) -> Iterator[MethodEvent]:
        yield from self._first_tokens(rows, event, alone)
        while True:
            active = [s for s in rows if not s.finished and s.error is None]
            waiting = joining is not None and bool(joining.waiting)
            if cancel is not None and cancel.is_set():
                for s in active:
                    s.finished = True
                    yield event(s, "cancelled", alone=alone)
                for s in joining.stop() if waiting else []:
                    yield event(s, "cancelled", alone=alone)
                return
            if not active and not waiting:
                return
            if waiting:  # the rows with a prefill of their own, one after another, each streaming once it is ready
                while joining.waiting and not (cancel is not None and cancel.is_set()):
                    with self._away():
                        joined = joining.next()
                    rows.append(joined)
                    yield from self._first_tokens([joined], event, alone, start=True)
                self.form_batch([s for s in rows if not s.finished and s.error is None])
                continue  # a stop while they prefilled is seen above; otherwise the whole batch steps
            yield from self._step(active, event, alone)

    def _away(self):
        """While this turn prefills a joining row, the pool's other turns step without waiting for it."""
        if self.pool is None or self._member is None:
            return contextlib.nullcontext()
        return self.pool.away(self._member)

    def _first_tokens(self, states: list[MethodState], event: EventMaker, alone: bool,
                      start: bool = False) -> Iterator[MethodEvent]:
        """The states' first answer tokens (sampled after their input), as events; `start`: a state joining a
        running decode says so first."""
        for state in states:
            if start:
                yield event(state, "error" if state.error is not None else "start", alone=alone)
            if state.error is None and self.is_done(state):
                state.finished = True
            if state.error is None:
                yield event(state, "done" if state.finished else "token", delta=state.text, alone=alone)

    def _step(self, active: list[MethodState], event: EventMaker, alone: bool) -> Iterator[MethodEvent]:
        """One batched step of the active states and its events."""
        logits, forward_s, policy_s = self.advance_shared(active, [[s.pending] for s in active],
                                                          step=len(active[0].turn_ids), alone=alone)
        # one wait for the device a step: the tokens, and the image counts the step's evictions kept with them;
        # sampling, every row's logits come to the host at once and each row draws there with its own generator
        if self.generation.do_sample:
            greedy, device, logits = None, logits.device, logits.float().cpu()
            read_with_counts(torch.zeros(0, dtype=torch.int64, device=device), self.unread_counts)
        else:
            greedy = read_with_counts(logits.argmax(dim=-1), self.unread_counts)
        self.unread_counts = []
        forward_s = float(forward_s)  # read once the tokens are: the device has passed every mark by then
        for r, state in enumerate(active):
            if state.error is not None:
                yield event(state, "error", alone=alone)
                continue
            token = greedy[r] if greedy is not None else self.sample(state, logits[r])
            own_s = float(policy_s.get(state.name, 0.0))
            delta = self._take(state, token, forward_s + own_s)
            yield event(state, "done" if state.finished else "token", delta=delta, latency=forward_s,
                        policy_s=own_s, batch_size=len(active), alone=alone)

    def _take(self, state: MethodState, token: int, seconds: float) -> str:
        """Append a decoded token to the state's answer; returns the new text."""
        state.compute_s += seconds
        state.steps += 1
        state.pending = token
        state.turn_ids.append(token)
        text = self.detok(state.turn_ids)
        delta = text[len(state.text):] if text.startswith(state.text) else text
        state.text = text
        state.finished = self.is_done(state)
        return delta

    def is_done(self, state: MethodState) -> bool:
        return state.is_done(self.generation.max_new_tokens, self.eos_ids, self.generation.ignore_eos)

    def sample(self, state: MethodState, logits: torch.Tensor) -> int:
        return next_token(logits, self.generation, state.generator)

    def detok(self, ids: list[int]) -> str:
        return answer_text(self.loaded.processor.tokenizer, ids, self.eos_ids)
