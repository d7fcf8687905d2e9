"""lmms-eval results as leaderboard rows (`prefixkv_core/report/leaderboard.py`: kvpress's layout), one row per
method and budget, one column per task: the task's score, and beside it the same rows for the agreement with Full.

A task's score is its first metric as lmms-eval reports it, × 100 when it is a share in [0, 1] (accuracy); a
group's aggregate is left out (the row's `score` is the mean of its task columns, as kvpress computes it)."""
from __future__ import annotations

from typing import Any

from ..policies import REGISTRY, held_in_equal_memory, parse_knobs
from ..report.leaderboard import LeaderboardRow, compression_ratio, method_name, to_csv
from .model_args import split_list_knobs


def task_scores(res: dict[str, Any]) -> dict[str, float | None]:
    """task -> its first metric's value, for the tasks that logged samples (leaf tasks, not groups)."""
    out = {}
    for task in res.get("samples", {}):
        metrics = res["results"].get(task, {})
        value = next((v for k, v in metrics.items()
                      if "," in k and "stderr" not in k and isinstance(v, (int, float))), None)
        out[task] = None if value is None else float(value)
    return out


def _scaled(value: float | None) -> float | None:
    return None if value is None else 100.0 * value if 0.0 <= value <= 1.0 else value


def leaderboard_rows(payload: dict[str, Any]) -> tuple[str, str]:
    """A sweep's results.json (or `collect.py`'s runs: each may carry its own `model_args`) -> (scores CSV,
    agreement CSV), both in the leaderboard's layout."""
    scores, agreements = [], []
    for run in payload["runs"]:
        margs = run.get("model_args", payload.get("model_args", {}))
        query_aware = not margs.get("query_agnostic", False)
        budget_mode = margs.get("budget_mode", "published")
        knobs = parse_knobs(split_list_knobs(margs.get("knobs", "")))
        method, budget = run["method"], run["budget"]
        kv = payload.get("kv_share", {}).get(f"{method}@{budget:g}")
        ratio = compression_ratio(budget if REGISTRY[method].uses_budget else None,
                                  1.0 if kv is None else kv)
        name = method_name(method, query_aware=query_aware,
                           held=held_in_equal_memory(method, budget_mode, knobs))
        common = dict(dataset=str(run.get("tasks", payload.get("tasks", ""))), data_dir="",
                      model=str(run.get("model", payload.get("model", ""))), method=name, compression_ratio=ratio)
        scores.append(LeaderboardRow(**common, scores={t: _scaled(v) for t, v in run["scores"].items()}))
        agreements.append(LeaderboardRow(**common, scores={t: _scaled(v) for t, v in run["agreement"].items()}))
    tasks = sorted({t for r in scores for t in r.scores})
    return to_csv(scores, tasks), to_csv(agreements, tasks)
