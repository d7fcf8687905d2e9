"""What a sweep saves: the engine time of answering scene_qa questions for several methods and budgets the way
the lmms-eval sweep does (each sample decoded once per budget, every method a row of one batch, Full beside
them), against one evaluation per method and budget (each sample decoded once per run, one method at a time).
Both through the same `AnswerBank` the lmms-eval model uses; lmms-eval's own overhead and the model loads of
separate runs are left out, so the ratio is the engine's alone (separate lmms-eval runs cost more still).

    python -m benchmarks.sweep_cost --samples 6 --methods snapkv,pyramidkv,h2o,prefixkv --budgets 0.1,0.3
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from prefixkv_core import Engine, load_model
from prefixkv_core.evaluation.answers import AnswerBank, Sample
from prefixkv_core.evaluation.gen_kwargs import generation_settings
from prefixkv_core.evaluation.model_args import parse_model_args
from scenes import QTYPES, render_scene

from .scene_tasks import MAX_NEW_TOKENS, TASK_DIR


def samples(n: int) -> list[Sample]:
    """The first questions of each scene_qa subtask in turn, as the lmms-eval model builds them."""
    rows = {q: json.loads((TASK_DIR / "data" / f"{q}.json").read_text()) for q in QTYPES}
    picked = [rows[QTYPES[i % len(QTYPES)]][i // len(QTYPES)] for i in range(n)]
    gen = generation_settings({"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "temperature": 0}, seed=0)
    return [Sample(r["id"], r["question"], render_scene(r["seed"]).image, ("\n\n",), gen) for r in picked]


def timed(engine: Engine, model_args: dict, todo: list[Sample]) -> tuple[float, int, dict]:
    bank = AnswerBank(engine, parse_model_args(model_args))
    runs = bank.settings.runs() + ([(bank.settings.reference, bank.settings.budgets[0])]
                                   if bank.settings.reference else [])
    t0 = time.perf_counter()
    answers = {(s.sample_id, m, float(b)): bank.answer(s, (m, float(b))) for s in todo for m, b in runs}
    return time.perf_counter() - t0, bank.sessions, answers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--methods", default="snapkv,pyramidkv,h2o,prefixkv")
    ap.add_argument("--budgets", default="0.1,0.3")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model, device=args.device))
    todo = samples(args.samples)
    base = {"pretrained": args.model}
    timed(engine, {**base, "method": "full"}, todo[:1])  # warm-up
    sweep_s, sweep_sessions, sweep_answers = timed(
        engine, {**base, "methods": args.methods.replace(",", "+"), "budgets": args.budgets.replace(",", "+"),
                 "reference": True}, todo)
    settings = parse_model_args({**base, "methods": args.methods.replace(",", "+"),
                                 "budgets": args.budgets.replace(",", "+"), "reference": True})
    separate_s, separate_sessions, same = 0.0, 0, True
    for method, budget in [("full", settings.budgets[0]), *settings.runs()]:
        s, n, answers = timed(engine, {**base, "method": method, "budget": float(budget)}, todo)
        separate_s += s
        separate_sessions += n
        same &= all(sweep_answers[k] == v for k, v in answers.items() if k in sweep_answers)
    out = {"model": args.model, "samples": len(todo), "methods": args.methods, "budgets": args.budgets,
           "runs": 1 + len(settings.runs()), "sweep_s": round(sweep_s, 1), "sweep_sessions": sweep_sessions,
           "separate_s": round(separate_s, 1), "separate_sessions": separate_sessions,
           "ratio": round(separate_s / sweep_s, 2), "same_answers": same, "threads": torch.get_num_threads()}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
