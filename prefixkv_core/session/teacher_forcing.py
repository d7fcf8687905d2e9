"""Teacher-forced scoring: a reference answer fed token by token through every method's compressed cache,
compressed after every token exactly as generation does (all methods in one batch), giving each method's
negative log-likelihood of the answer (the benchmarks' perplexity). `Session.score_answer` runs it."""
from __future__ import annotations

import torch

from .method_state import MethodState
from .stepping import RowStepper


def answer_nll(stepper: RowStepper, states: list[MethodState], answer_ids: list[int]) -> dict[str, tuple[float, int]]:
    """After the first turn's prefill (each live state's first logits are set): method -> (sum of NLL, answer
    tokens), for every method that did not fail along the way."""
    live = [s for s in states if s.error is None]
    nll = {s.name: 0.0 for s in live}
    logits = {s.name: s.first_logits for s in live}
    for i, token in enumerate(answer_ids):
        for s in live:
            nll[s.name] -= float(torch.log_softmax(logits[s.name].float(), dim=-1)[token])
        if i + 1 < len(answer_ids):
            live = [s for s in live if s.error is None]
            if not live:
                break
            batch_logits, _, _ = stepper.advance(live, [[token]] * len(live), step=i + 1)
            logits.update({s.name: batch_logits[r] for r, s in enumerate(live)})
    return {s.name: (nll[s.name], len(answer_ids)) for s in states if s.error is None}
