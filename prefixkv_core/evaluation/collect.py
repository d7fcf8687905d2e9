"""Leaderboard rows from separate lmms-eval runs of `--model prefixkv` (each with `--log_samples`): every
output folder's results and logged samples, the method and budget read back from its model_args, agreement with
the Full run of the same model and query mode among them.

    python -m prefixkv_core.evaluation.collect runs/full runs/snapkv-0.2 runs/snapkv-0.5 --out runs/board

Writes <out>/leaderboard.csv and <out>/leaderboard-agreement.csv (kvpress's layout, as the sweep writes them)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..policies import REGISTRY, role_method
from .agreement import agreement
from .leaderboard_rows import leaderboard_rows
from .model_args import parse_model_args


def split_model_args(text: str) -> dict[str, Any]:
    """'pretrained=embedded,method=snapkv,knobs="a=1;b=2"' -> dict (commas inside quotes kept), typed as
    lmms-eval types them."""
    parts, current, quote = [], "", None
    for ch in text:
        if ch in "'\"":
            quote = None if quote == ch else quote or ch
        if ch == "," and quote is None:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in parts)):
        key, _, value = part.partition("=")
        low = value.lower()
        out[key] = True if low == "true" else False if low == "false" else value.strip("'\"")
    return out


def read_run(folder: Path) -> dict[str, Any]:
    """One lmms-eval output folder (its latest results) -> a run: method, budget, scores, samples."""
    results_path = sorted(folder.rglob("*_results.json"))[-1]
    res = json.loads(results_path.read_text())
    if res["config"]["model"] != "prefixkv":
        raise ValueError(f"{folder}: a run of model {res['config']['model']!r}, not prefixkv")
    margs = split_model_args(res["config"]["model_args"] or "")
    settings = parse_model_args(margs)
    if settings.is_sweep:
        raise ValueError(f"{folder}: a sweep's model_args; its rows come from prefixkv_core.evaluation.sweep")
    stamp = results_path.name.removesuffix("_results.json")
    samples = {}
    for path in results_path.parent.glob(f"{stamp}_samples_*.jsonl"):
        samples[path.stem.split("_samples_", 1)[1]] = [json.loads(x) for x in path.read_text().splitlines()]
    scores = {}
    for task in samples:
        metrics = res["results"].get(task, {})
        scores[task] = next((float(v) for k, v in metrics.items()
                             if "," in k and "stderr" not in k and isinstance(v, (int, float))), None)
    method, budget = settings.methods[0], float(settings.budgets[0])
    return {"method": method, "budget": budget if REGISTRY[method].uses_budget else 1.0, "model": settings.pretrained,
            "tasks": ",".join(sorted(samples)), "model_args": {**margs, "query_agnostic": settings.query_agnostic,
                                                              "budget_mode": settings.budget_mode},
            "scores": scores, "samples": samples}


def collect(folders: list[Path]) -> dict[str, Any]:
    runs = [read_run(f) for f in folders]
    reference = role_method("reference")
    for run in runs:
        mode = (run["model"], run["model_args"]["query_agnostic"])
        ref = next((r for r in runs if r["method"] == reference
                    and (r["model"], r["model_args"]["query_agnostic"]) == mode), None)
        run["agreement"] = {t: agreement(s, ref["samples"][t]) for t, s in run["samples"].items()
                            if ref and t in ref["samples"]}
    return {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="lmms-eval --output_path folders of prefixkv runs")
    ap.add_argument("--out", default="runs/leaderboard", help="output folder")
    args = ap.parse_args(argv)
    payload = collect([Path(f) for f in args.folders])
    scores, agree = leaderboard_rows(payload)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.csv").write_text(scores)
    (out / "leaderboard-agreement.csv").write_text(agree)
    print(scores + "\nagreement with Full:\n" + agree)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
