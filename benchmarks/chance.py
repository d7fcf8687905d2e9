"""Chance as a distribution, and every row at the memory it really holds: the analysis the accuracy benchmarks
share (plain Python over their answer records).

A control that draws at random (Random, Random drop) is asked with several seeds; each question then has a chance
rate, the share of the control's draws that answer it right. A method beats chance when it answers more questions
right than those rates predict: under "the method is no better than the control", its answer to question q is
right with probability p_q, independently, so its number right has mean sum(p_q) and variance sum(p_q (1 - p_q))
(a Poisson-binomial); the one-sided z-test of that count (`beats_chance`) is the test the tables state.

Each answer record also carries the share of Full's KV bytes the method's cache held at the end of the answer
(measured from the tensors). `at_equal_memory` interpolates a method's accuracy at a given real share, within the
shares it was measured at, so methods are compared at equal real memory rather than at equal nominal r.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence


def chance_rates(records: Iterable[dict], control: str, budget: float) -> dict[tuple, float]:
    """(scene or sample, question) -> the share of the control's draws at `budget` that answered it right."""
    right: dict[tuple, list[bool]] = defaultdict(list)
    for r in records:
        if r["method"] == control and r["budget"] == budget:
            right[(r["seed"], r["question"])].append(bool(r["correct"]))
    return {q: sum(v) / len(v) for q, v in right.items()}


def draw_accuracies(records: Iterable[dict], control: str, budget: float) -> list[float]:
    """The control's accuracy at `budget` under each of its draws (seeds), in draw order."""
    by_draw: dict[int, list[bool]] = defaultdict(list)
    for r in records:
        if r["method"] == control and r["budget"] == budget:
            by_draw[int(r.get("draw", 0))].append(bool(r["correct"]))
    return [sum(v) / len(v) for _, v in sorted(by_draw.items())]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation, min and max of a control's per-draw accuracies."""
    n = len(values)
    mean = sum(values) / n if n else float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"draws": n, "mean": mean, "sd": sd, "min": min(values, default=float("nan")),
            "max": max(values, default=float("nan"))}


def normal_sf(z: float) -> float:
    """P(Z >= z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def beats_chance(answers: dict[tuple, bool], rates: dict[tuple, float]) -> tuple[int, float, float]:
    """(questions right, the number chance predicts, one-sided p) over the questions both were asked: the z-test of
    the method's count right against the Poisson-binomial of the control's per-question rates (p = 1 when the
    rates leave no variance and the method does not exceed them)."""
    shared = [q for q in answers if q in rates]
    right = sum(bool(answers[q]) for q in shared)
    expected = sum(rates[q] for q in shared)
    variance = sum(rates[q] * (1 - rates[q]) for q in shared)
    if variance == 0:
        return right, expected, 0.0 if right > expected else 1.0
    return right, expected, normal_sf((right - expected) / math.sqrt(variance))


# A share measured within half a point of the one asked counts as measured there: a budget of r keeps a whole number
# of entries per layer, so a method held at r = 0.5 holds 49.97 % of Full's bytes, and the tables print whole points.
SHARE_TOLERANCE = 0.005


def at_equal_memory(points: Sequence[tuple[float, float]], share: float) -> float | None:
    """Accuracy at a real KV share, linearly interpolated between the measured (share, accuracy) points; None
    outside the shares measured (no extrapolation; a share within SHARE_TOLERANCE of the nearest end takes its
    accuracy)."""
    pts = sorted(points)
    if not pts or share < pts[0][0] - SHARE_TOLERANCE or share > pts[-1][0] + SHARE_TOLERANCE:
        return None
    if share <= pts[0][0]:
        return pts[0][1]
    if share >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= share <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (share - x0) / (x1 - x0)
    return pts[-1][1]
