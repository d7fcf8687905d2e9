"""The headline's rows in the leaderboard's layout (`prefixkv_core.report.leaderboard`), for the app's Leaderboard
tab: one folder per budget mode and query mode with `leaderboard.csv` (accuracy × 100), `leaderboard-agreement.csv`
(agreement with Full's own answers × 100, EffiVLM-Bench's loyalty) and `results.json` (each row's run: its budget,
questions and the share of Full's KV bytes it measured, the command and commit).

A row's score is every question pooled (`scene_qa`'s, the headline table's cell); its columns are one per question
type or subtask (`scene_qa_colour` …, as the lmms-eval task's subtasks are named), in both files. A row per
method and budget as `vision_accuracy.summarise` gives them; the `[image]` rows (budget_of=image) and the controls
asked with several draws (their mean over the draws) are rows of their own. `compression_ratio` is 1 - r as kvpress
writes it; the tab plots each row at its measured KV share."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from prefixkv_core.report.leaderboard import LeaderboardRow, compression_ratio, method_name, to_csv
from prefixkv_core.report.provenance import git_commit
from scenes import QTYPES

TASK = "scene_qa"
NO_BUDGET = 1.0  # a method without a budget (Full, ZipVL) is reported at 1


def ran_on(loaded) -> dict[str, str]:
    """The device and dtype the model really ran on (not the 'auto' asked for), as `write` records them."""
    return {"device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch.")}


def rows(summary: dict, model: str, query_agnostic: bool, task: str = TASK,
         qtypes: tuple[str, ...] | list[str] = QTYPES) -> tuple[list[LeaderboardRow], list[LeaderboardRow]]:
    """(accuracy rows, agreement rows) from `vision_accuracy.summarise`'s summary, named as the layout names a
    query-aware run; `qtypes`: the task's question types or subtasks, a column each. Full agrees with itself."""
    scores, agreements = [], []
    for key, per in summary.items():
        if "all" not in per:
            continue
        method, budget = key.rsplit("@", 1)
        b = float(budget)
        ratio = 0.0 if method == "full" else compression_ratio(None if b == NO_BUDGET else b, per.get("kv_share"))
        base = dict(dataset=task, data_dir="", model=model, method=method_name(method, query_aware=not query_agnostic),
                    compression_ratio=ratio)
        pooled = 100.0 * per["all"]["accuracy"]
        by_type = {f"{task}_{q}": 100.0 * per[q]["accuracy"] for q in qtypes if q in per}
        scores.append(LeaderboardRow(**base, scores=by_type or {task: pooled}, overall=pooled))
        if method == "full":
            agree, agree_by_type = 1.0, {q: 1.0 for q in qtypes if q in per}
        else:
            agree = per.get("agrees_with_full", {}).get("accuracy")
            agree_by_type = {q: v["accuracy"] for q, v in per.get("agrees_with_full_by_type", {}).items()}
        agree_columns = {f"{task}_{q}": 100.0 * agree_by_type[q] for q in qtypes if q in agree_by_type}
        agreements.append(LeaderboardRow(**base, scores=agree_columns or {task: None if agree is None else 100.0 * agree},
                                         overall=None if agree is None else 100.0 * agree))
    return scores, agreements


def results(summary: dict, *, model: str, budget_mode: str, query_agnostic: bool, device: str, dtype: str,
            command: str, commit: str, task: str = TASK) -> dict:
    """`results.json`: what the leaderboard store reads back for each row (`leaderboard_store._find_run`)."""
    margs = {"pretrained": model, "budget_mode": budget_mode, "query_agnostic": query_agnostic, "device": device,
             "dtype": dtype}
    runs, shares = [], {}
    for key, per in summary.items():
        if "all" not in per:
            continue
        method, budget = key.rsplit("@", 1)
        runs.append({"method": method, "budget": float(budget), "n": {task: per["all"]["n"]}, "model_args": margs})
        if per.get("kv_share") is not None:
            shares[key] = round(per["kv_share"], 4)
    return {"model": model, "model_args": margs, "tasks": task, "runs": runs, "kv_share": shares,
            "command": command, "commit": commit}


def write(folder: Path, summary: dict, *, model: str, budget_mode: str, query_agnostic: bool, device: str = "cpu",
          dtype: str = "auto", command: str | None = None, commit: str | None = None, task: str = TASK,
          qtypes: tuple[str, ...] | list[str] = QTYPES, script: str = "benchmarks.vision_accuracy") -> list[Path]:
    """Write the three files into `folder` (created); returns their paths. `task`: the task column (the single
    image headline's `scene_qa`, or a long-cache task); `qtypes`: its question types or subtasks."""
    folder.mkdir(parents=True, exist_ok=True)
    score_rows, agree_rows = rows(summary, model, query_agnostic, task, qtypes)
    command = command or f"python -m {script} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    payload = results(summary, model=model, budget_mode=budget_mode, query_agnostic=query_agnostic, device=device,
                      dtype=dtype, command=command, commit=commit or git_commit(), task=task)
    out = [folder / "leaderboard.csv", folder / "leaderboard-agreement.csv", folder / "results.json"]
    columns = [f"{task}_{q}" for q in qtypes if any(f"{task}_{q}" in r.scores for r in score_rows)] or [task]
    agree_columns = [c for c in columns if any(c in r.scores for r in agree_rows)] or [task]
    out[0].write_text(to_csv(score_rows, columns))
    out[1].write_text(to_csv(agree_rows, agree_columns))
    out[2].write_text(json.dumps(payload, indent=1) + "\n")
    return out
