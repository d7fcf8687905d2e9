"""A sweep: several methods and budgets on lmms-eval tasks for the cost of few decodes. Each sample is decoded
once per budget with every method of the sweep in one batch (the engine's batched decoding), and every
(method, budget) is then one lmms-eval evaluation that reads those answers, so the scores are lmms-eval's own.
Full runs in the same batches, giving each method's agreement with it.

    python -m prefixkv_core.evaluation.sweep --model embedded --methods snapkv,pyramidkv,prefixkv \\
        --budgets 0.1,0.3,0.5 --tasks scene_qa --include_path benchmarks/lmms_tasks --out runs/sweep

Several GPUs: `accelerate launch -m prefixkv_core.evaluation.sweep ...` (each process takes its share of the
samples; rank 0 writes). Writes <out>/results.json (per run and task: the score, the agreement with Full, the
model args; the sweep's engine sessions), <out>/leaderboard.csv (kvpress's layout, the tasks' scores × 100) and
<out>/leaderboard-agreement.csv (the same rows, agreement with Full × 100)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ..method_args import MethodArgError, add_method_args, add_model_args, method_args
from ..report.provenance import git_commit
from .agreement import agreement
from .leaderboard_rows import leaderboard_rows, task_scores
from .model_args import EvalSettings


def model_args_of(args: argparse.Namespace, methods: list[str], budgets: list[float]) -> dict[str, Any]:
    """The sweep's flags as the model's model_args (the same names `--model_args` takes)."""
    knobs = ";".join(args.knob)
    out = {"pretrained": args.model, "methods": "+".join(methods), "budgets": "+".join(f"{b:g}" for b in budgets),
           "budget_mode": "equal_memory" if args.equal_memory else "published",
           "query_agnostic": bool(args.query_agnostic), "device": args.device, "dtype": args.dtype,
           "reference": True}
    return {**out, "knobs": knobs} if knobs else out


def run_sweep(lm, tasks: list[str], include_path: str | None, limit: float | None) -> dict[str, Any]:
    """Every run of the model's sweep through lmms-eval; rank 0 gets {"runs": [...]}, other ranks None."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    settings: EvalSettings = lm.settings
    manager = TaskManager(include_path=include_path)
    reference = (settings.reference, float(settings.budgets[0])) if settings.reference else None
    runs = ([reference] if reference else []) + [r for r in map(lambda r: (r[0], float(r[1])), settings.runs())
                                                 if r != reference]
    out, ref_samples = [], None
    started = time.perf_counter()
    for method, budget in runs:
        lm.select(method, budget)
        res = simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=True, task_manager=manager,
                              bootstrap_iters=0)
        if res is None:  # not rank 0
            continue
        samples = res.get("samples", {})
        if (method, budget) == reference:
            ref_samples = samples
        run = {"method": method, "budget": budget, "scores": task_scores(res),
               "agreement": {t: agreement(s, ref_samples[t]) for t, s in samples.items()} if ref_samples else {},
               "n": {t: len(s) for t, s in samples.items()},
               "answers": {t: {str(s["doc_id"]): s.get("filtered_resps") for s in ss} for t, ss in samples.items()}}
        out.append(run)
    if lm.rank != 0:
        return None
    return {"runs": out, "sessions": lm.bank.sessions, "skipped": lm.bank.skipped,
            "kv_share": lm.bank.kv_share(), "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_method_args(ap, several_budgets=True, budget_default="0.1,0.3,0.5")
    ap.add_argument("--tasks", required=True, help="lmms-eval tasks or groups, comma-separated")
    ap.add_argument("--include_path", default=None, help="a folder of extra task YAMLs (e.g. benchmarks/lmms_tasks)")
    ap.add_argument("--limit", type=float, default=None, help="the first N samples of each task (lmms-eval's --limit)")
    ap.add_argument("--out", default="runs/sweep", help="output folder")
    args = ap.parse_args(argv)
    try:
        chosen = method_args(args)
    except MethodArgError as exc:
        ap.error(str(exc))
    from .lmms_model import PrefixKV

    margs = model_args_of(args, chosen.methods, [float(b) for b in chosen.budgets])
    lm = PrefixKV(**margs)
    result = run_sweep(lm, [t.strip() for t in args.tasks.split(",") if t.strip()], args.include_path, args.limit)
    if result is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m prefixkv_core.evaluation.sweep " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = {"model": args.model, "model_args": margs, "tasks": args.tasks, "limit": args.limit,
               "command": command, "commit": git_commit(),
               "world_size": int(os.environ.get("WORLD_SIZE", "1")), **result}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    score_csv, agree_csv = leaderboard_rows(payload)
    (out / "leaderboard.csv").write_text(score_csv)
    (out / "leaderboard-agreement.csv").write_text(agree_csv)
    print(score_csv)
    print("agreement with Full:\n" + agree_csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
