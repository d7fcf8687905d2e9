"""How a turn's answer is decoded: the generation settings, the choice of each next token (greedy, or top-p
sampling with each method's own generator) and the answer's text."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EngineError


@dataclass
class GenerationSettings:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    ignore_eos: bool = False  # decode exactly max_new_tokens (benchmarks); end of text still never shows

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise EngineError("sampling needs temperature > 0 and top_p in (0, 1]")


def next_token(logits: torch.Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> int:
    """The token after `logits` [V]: the most likely one, or (sampling) one drawn from the smallest set of
    tokens whose probability reaches top_p, at the settings' temperature, with the method's own generator (so
    every method draws the same numbers whatever the others do)."""
    if not settings.do_sample:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / settings.temperature, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < settings.top_p
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
    return int(order[choice].item())


def answer_text(tokenizer, ids: list[int], eos_ids: set[int]) -> str:
    """The answer's text so far; end-of-text tokens never show (with ignore_eos they may be decoded past)."""
    return tokenizer.decode([i for i in ids if i not in eos_ids], skip_special_tokens=True)
