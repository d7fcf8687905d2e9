"""ROUGE-L for the panels: the engine's metric when it exists, the rouge-score package otherwise."""
from __future__ import annotations

try:
    from prefixkv_core.metrics import rouge_l  # noqa: F401
except ImportError:  # pragma: no cover - older engine
    from functools import lru_cache

    from rouge_score import rouge_scorer

    @lru_cache(maxsize=1)
    def _scorer():
        return rouge_scorer.RougeScorer(["rougeL"])

    def rouge_l(candidate: str, reference: str) -> float:
        if not candidate.strip() or not reference.strip():
            return 1.0 if candidate.strip() == reference.strip() else 0.0
        return float(_scorer().score(reference, candidate)["rougeL"].fmeasure)
