"""The papers' quality metrics: PPL under compression (teacher forcing) and ROUGE-L against Full."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Iterable

from rouge_score import rouge_scorer


@lru_cache(maxsize=1)
def _scorer() -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of `candidate` against `reference` (1.0 for identical texts, 0.0 if either is empty)."""
    if not candidate.strip() or not reference.strip():
        return 1.0 if candidate.strip() == reference.strip() else 0.0
    return float(_scorer().score(reference, candidate)["rougeL"].fmeasure)


def perplexity(nll_and_counts: Iterable[tuple[float, int]]) -> float:
    """exp(mean NLL over all answer tokens of all samples)."""
    total, count = 0.0, 0
    for nll, n in nll_and_counts:
        total += nll
        count += n
    return math.exp(total / count) if count else float("nan")


def score_perplexity(engine, samples: Iterable[dict[str, Any]], methods, budget: float, knobs=None) -> dict[str, float]:
    """PPL per method over samples {"image", "question", "answer"}: exp(mean NLL of all answer tokens)."""
    per_method: dict[str, list[tuple[float, int]]] = {}
    for sample in samples:
        session = engine.new_session(sample.get("image"), sample["question"], methods, budget, knobs=knobs)
        for name, pair in session.score_answer(sample["answer"]).items():
            per_method.setdefault(name, []).append(pair)
    return {name: perplexity(pairs) for name, pairs in per_method.items()}
