"""One method's side of a conversation: its policy, its compressed cache, where it stands in the current turn,
and the event that reports it."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..kv.cache import TrackedCache
from ..report.events import MethodEvent
from ..policies import Policy, PolicyState, row_label


@dataclass
class MethodState:
    name: str
    policy: Policy
    cache: TrackedCache | None = None
    true_len: int = 0  # tokens this method's language model has seen (its next true position)
    prompt_len: int = 0
    reduced_by: int = 0  # prompt tokens its own prefill kept from the language model (VisionZip); full N_t is
    # true_len + reduced_by
    first_logits: torch.Tensor | None = None  # [V] after its prefill (its own, or the shared one)
    pending: int | None = None  # sampled token not yet fed to the model
    turn_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    error: str | None = None
    ttft_s: float | None = None
    compress_s: float | None = None  # the policy's time on this turn's input (the prompt, a follow-up's tokens)
    compute_s: float = 0.0  # forward + policy time spent on this turn's decode steps
    steps: int = 0
    generator: torch.Generator | None = None
    policy_state: PolicyState | None = None  # what the policy's prefill returned for this run
    answers: list[str] = field(default_factory=list)  # this method's answers to the earlier turns

    def twin(self) -> "MethodState":
        """An independent copy of this method's conversation: its cache, its policy's run state, its sampler
        (to decode the same turn again, alone)."""
        twin = copy.copy(self)
        twin.cache = self.cache.clone() if self.cache is not None else None
        twin.policy_state = copy.deepcopy(self.policy_state)
        twin.turn_ids, twin.answers = list(self.turn_ids), list(self.answers)
        if self.generator is not None:
            twin.generator = torch.Generator(device="cpu")
            twin.generator.set_state(self.generator.get_state())
        return twin

    def carry_over(self, eos_ids: set[int]) -> list[int]:
        """The last answer token, sampled but never fed, unless it closed the turn (EOS is not fed: the
        follow-up text closes the assistant turn itself)."""
        if self.pending is None or self.pending in eos_ids:
            return []
        return [self.pending]

    def is_done(self, max_new_tokens: int, eos_ids: set[int], ignore_eos: bool = False) -> bool:
        ended = self.pending in eos_ids and not ignore_eos
        return ended or len(self.turn_ids) >= max_new_tokens

    def fail(self, exc: Exception) -> None:
        """This method stops here with the error; the others go on."""
        self.error = f"{exc.__class__.__name__}: {exc}"
        self.finished = True

    def event(self, kind: str, *, turn: int, bytes_per_token: float, delta: str = "", latency: float = 0.0,
              policy_s: float = 0.0, batch_size: int = 1, alone: bool = False) -> MethodEvent:
        """Where this method stands now, as its listeners see it. `bytes_per_token`: the uncompressed cache's
        bytes per token (its full size is that times every token the method was given)."""
        cache = self.cache
        full_len = self.true_len + self.reduced_by
        return MethodEvent(
            method=self.name, label=row_label(self.name, self.policy), kind=kind, turn=turn,
            step=len(self.turn_ids), text=self.text, delta=delta,
            kept_per_layer=cache.lengths() if cache is not None else [],
            kept_image_per_layer=cache.image_counts() if cache is not None else [],
            full_len=full_len,
            kv_bytes=cache.nbytes() if cache is not None else 0,
            full_kv_bytes=int(round(bytes_per_token * full_len)),
            step_latency_s=latency, policy_s=policy_s, ttft_s=self.ttft_s, compress_s=self.compress_s,
            tokens_per_s=(self.steps / self.compute_s) if self.compute_s > 0 else None,
            error=self.error, extras=self.policy.extras(self.policy_state), batch_size=batch_size,
            stage=self.policy.stage, alone=alone,
        )
