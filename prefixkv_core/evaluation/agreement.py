"""Agreement with Full (EffiVLM-Bench's "loyalty"): the share of samples whose answer is the uncompressed
model's. Read from lmms-eval's logged samples, so it holds for any task: free-form answers are compared as
normalised text (lowercase, punctuation dropped), multiple-choice answers by the option each picked."""
from __future__ import annotations

import re
from typing import Any


def normalised(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9\- ]+", " ", str(text).lower()).split())


def picked(response: Any) -> Any:
    """What a logged sample answered: its text, or for scored options (loglikelihood pairs) the best one."""
    while isinstance(response, list) and len(response) == 1 and isinstance(response[0], (list, str)):
        response = response[0]
    if isinstance(response, list) and response and all(isinstance(r, (list, tuple)) for r in response):
        scores = [float(r[0]) for r in response]  # one (log-likelihood, is_greedy) per option
        return scores.index(max(scores))
    if isinstance(response, list):
        return tuple(picked(r) for r in response)
    return normalised(response)


def sample_answers(samples: list[dict]) -> dict[Any, Any]:
    """doc_id -> the answer, from one task's lmms-eval samples (`filtered_resps`, else `resps`)."""
    return {s["doc_id"]: picked(s.get("filtered_resps", s.get("resps"))) for s in samples}


def agreement(samples: list[dict], reference: list[dict]) -> float | None:
    """Share of the docs both answered whose answer equals the reference's (None when none is shared)."""
    mine, ref = sample_answers(samples), sample_answers(reference)
    shared = [d for d in mine if d in ref]
    return sum(mine[d] == ref[d] for d in shared) / len(shared) if shared else None
