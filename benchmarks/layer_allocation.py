"""How each method spreads its budget over the layers: the entries every layer holds once the prompt was compressed.

    python -m benchmarks.layer_allocation --tasks scene_qa,scene_multi,scene_video --samples 3 \
        --methods prefixkv,h2o --budgets 0.1,0.3,0.5 --query-agnostic

For each sample (scene_qa: the first question of each of the first --samples test scenes; scene_multi and
scene_video: the first --samples test samples of each subtask, asked as `long_accuracy.py` asks them) and budget,
one session of the methods; each method's per-layer entry counts are read from its first event after the prompt
(with --query-agnostic: the visual prefix compressed, then the question fed). Per task, method and budget it
prints the prompt's length and, as median (lowest-highest) over the samples:

- the layers holding at most --floor entries (PrefixKV's fewest is the sink and the last prompt token, 2),
- the layers holding under a quarter of their even share (r/4 of the prompt's tokens),
- the smallest and the largest layer's share of the prompt.

A method that keeps r in every layer (H2O, Local) has none of the first two; a per-layer allocation shows how far
it moves entries between layers. --json writes every sample's counts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.method_args import add_model_args
from prefixkv_core.models import load_model
from prefixkv_core.policies import resolve_methods
from scenes import render_scene, split_seeds

from benchmarks.long_accuracy import TASKS as LONG_TASKS
from benchmarks.long_accuracy import items, question

TASKS = ("scene_qa", *LONG_TASKS)


def prompts(task: str, samples: int, frames: int):
    """(sample id, images, prompt, video) of the samples asked for `task`."""
    if task == "scene_qa":
        for seed in split_seeds("test", samples):
            scene = render_scene(seed)
            yield f"{task}/{seed}", [scene.image], scene.qa[0].question, None
        return
    for _, sub, seed in items(task, "test", samples):
        images, prompt, video, _, _ = question(task, seed, False, frames)
        yield f"{task}/{sub}/{seed}", images, prompt, video


def layer_counts(engine: Engine, images, prompt: str, video, methods: list[str], budget: float, frames: int,
                 query_agnostic: bool) -> dict[str, tuple[list[int], int]]:
    """Each method's (entries per layer, tokens it was given) at its first event after the prompt."""
    session = engine.new_session(images or None, prompt, methods, budget, GenerationSettings(max_new_tokens=1),
                                 query_agnostic=query_agnostic, video=video, frames=frames)
    first: dict[str, tuple[list[int], int]] = {}
    for event in session.run():
        method = getattr(event, "method", None)
        if method and method not in first and event.kept_per_layer:
            first[method] = (list(event.kept_per_layer), event.full_len)
    return first


def spread(counts: list[int], prompt_len: int, budget: float, floor: int) -> dict[str, float]:
    """One sample's allocation, summarised."""
    return {"at_floor": sum(1 for c in counts if c <= floor),
            "under_quarter": sum(1 for c in counts if c < budget / 4 * prompt_len),
            "min_share": min(counts) / prompt_len, "max_share": max(counts) / prompt_len}


def median_range(values: list[float], fmt: str) -> str:
    text = fmt.format(statistics.median(values))
    if min(values) == max(values):
        return text
    return f"{text} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(rows: list[dict], floor: int) -> str:
    """Per task, method and budget: the summaries' medians and ranges over the samples."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["method"], row["budget"]), []).append(row)
    lines = [f"| task | method | r | prompt tokens | layers at <= {floor} entries | layers under r/4 of the prompt "
             "| smallest layer | largest layer |", "|---|---|---|---|---|---|---|---|"]
    for (task, method, budget), group in groups.items():
        lines.append(" | ".join([
            f"| {task}", method, f"{budget:g}", median_range([g["prompt_len"] for g in group], "{:.0f}"),
            median_range([g["at_floor"] for g in group], "{:g}"),
            median_range([g["under_quarter"] for g in group], "{:g}"),
            median_range([100 * g["min_share"] for g in group], "{:.1f} %"),
            median_range([100 * g["max_share"] for g in group], "{:.1f} %")]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=3, help="scenes (scene_qa) or samples of each subtask")
    ap.add_argument("--methods", default="prefixkv,h2o")
    ap.add_argument("--budgets", default="0.1,0.3,0.5")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--floor", type=int, default=3, help="a layer at most this many entries counts as starved")
    ap.add_argument("--query-agnostic", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if unknown := [t for t in tasks if t not in TASKS]:
        ap.error(f"unknown task(s) {unknown}; expected {', '.join(TASKS)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    methods = resolve_methods(args.methods)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    engine = Engine(load_model(args.model, device=args.device, dtype=args.dtype))
    rows = []
    for task in tasks:
        for sample, images, prompt, video in prompts(task, args.samples, args.frames):
            for budget in budgets:
                counts = layer_counts(engine, images, prompt, video, methods, budget, args.frames,
                                      args.query_agnostic)
                for method, (per_layer, prompt_len) in counts.items():
                    rows.append({"task": task, "sample": sample, "method": method, "budget": budget,
                                 "prompt_len": prompt_len, "per_layer": per_layer,
                                 **spread(per_layer, prompt_len, budget, args.floor)})
            print(f"{sample} done", file=sys.stderr, flush=True)
    mode = "query-agnostic" if args.query_agnostic else "question in view"
    print(f"Entries per layer once the prompt was compressed ({mode}, model {args.model})\n")
    print(table(rows, args.floor))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
