"""Accuracy on the long-cache scene tasks, per subtask, through the engine: scene_multi (2-6 images per question)
and scene_video (a clip per question), the test split's first --samples samples of each subtask (40, as the
lmms-eval tasks benchmarks/lmms_tasks/scene_multi and scene_video ask them).

    python -m benchmarks.long_accuracy                                   # Full, and the blank-images baseline
    python -m benchmarks.long_accuracy --methods full,snapkv,prefixkv --budgets 0.1,0.3 --json runs/long.json
    python -m benchmarks.long_accuracy --methods all --budgets 0.2 --query-agnostic --checkpoint runs/long.jsonl

Each sample is asked as the lmms tasks ask it: a multi-image sample's images and `MultiSample.prompt` (a note on
how the images are numbered, then the question), graded by `MultiSample.grade` ("Image 2" counts as "2" for the
`which` questions); a clip as the mp4 the lmms task writes (`scenes.video.cached_clip`, 16 frames) with its
question, the engine sampling --frames frames (default 8), graded by `scenes.grading.is_correct`. Greedy, a few new
tokens. Every method of one budget answers in one session (the engine runs them batched); a method without a budget
(Full, ZipVL) is asked once, with the first budget, and reported at budget 1. --query-agnostic compresses the
visuals before the question is fed.

The blank-images baseline asks the reference method (Full) the same questions over blank grey images (as many as
the sample has) and a clip of blank grey frames: what the questions and answer priors give without the pictures.
--no-blank leaves it out.

Prints a table (accuracy per subtask, and per task over its subtasks) and writes --json (every answer, the
summary); --checkpoint appends each sample's answers to a JSON-lines file and skips those already there (a
run naming more methods asks only the methods there lack, Full answering beside them for the KV shares).

The headline in the seeds' settings (`--methods all --budgets 0.05,0.1,0.2,0.3,0.5 --query-agnostic
--budget-of-image --control-seeds 5 --out STEM`): every answer records the share of Full's KV bytes its method held
(measured from the tensors); per task, the methods x budgets table with that share, chance as the controls' spread
over their draws and the z-test of each method against the control of its own kind, the table at equal real memory,
and a figure of accuracy against the measured share (STEM.md, STEM.html/.png), as vision_accuracy.py reports the
single-image headline.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.method_args import add_model_args
from prefixkv_core.models import load_model
from prefixkv_core.policies import parse_knobs, resolve_methods, role_method, split_draw
from scenes.grading import is_correct
from scenes.multi import MULTI_SUBTASKS, grade as multi_grade, multi_sample, multi_seeds
from scenes.video import VIDEO_SUBTASKS, cached_clip, video_sample, video_seeds

from . import vision_accuracy as va
from .vision_accuracy import BLANK_GREY, reported_budget, sessions, uses_budget

TASKS = {"scene_multi": MULTI_SUBTASKS, "scene_video": VIDEO_SUBTASKS}
CLIP_FRAMES = 16  # the lmms task's clips
BLANK = "blank"  # the condition of the blank-images baseline (the real samples: "images")
IMAGE_SIZE = 384


def blank_images(n: int) -> list:
    from PIL import Image

    return [Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BLANK_GREY) for _ in range(n)]


def ask(engine: Engine, images, prompt: str, methods: list[str], budget: float, max_new: int, *, video=None,
        frames: int | None = None, knobs: dict | None = None, query_agnostic: bool = False,
        seed: int = 0, draws: int = 1) -> dict[str, tuple[str, float | None, float | None]]:
    """Each row's (answer, share of Full's KV bytes held at the end of it, share of the image tokens kept where
    the method reports one) for one first turn, all methods in one session (batched by the engine). `seed`: the
    comparison's seed (the controls' draw); `draws`: the controls that draw at random answer that many times, as
    rows "random", "random~1" … (`policies.split_draw`)."""
    session = engine.new_session(images or None, prompt, methods, budget,
                                 GenerationSettings(max_new_tokens=max_new, seed=seed), knobs,
                                 query_agnostic=query_agnostic, video=video, frames=frames, draws=draws)
    for _ in session.run():
        pass
    return {m: ((r["error"] and f"ERROR {r['error']}") or r["text"],
                r["kv_bytes"] / r["full_kv_bytes"] if r.get("kv_bytes") and r.get("full_kv_bytes") else None,
                (r.get("extras") or {}).get("image_kept_share"))
            for m, r in session.results().items()}


def items(task: str, split: str, samples: int, subtasks: list[str] | None = None):
    """(task, subtask, seed) of every sample asked, subtask by subtask."""
    for sub in TASKS[task]:
        if subtasks and sub not in subtasks:
            continue
        seeds = multi_seeds(split, samples, sub) if task == "scene_multi" else video_seeds(split, samples, sub)
        for seed in seeds:
            yield task, sub, seed


def question(task: str, seed: int, blank: bool, frames: int):
    """(images, prompt, video, answer, grade) of one sample as the lmms task asks it; `blank`: the same prompt
    over blank grey images (a blank clip)."""
    if task == "scene_multi":
        s = multi_sample(seed)
        images = blank_images(s.n_images) if blank else list(s.images)
        return images, s.prompt, None, s.answer, lambda out: multi_grade(out, s.answer, s.subtask)
    s = video_sample(seed, CLIP_FRAMES, draw=False)
    video = blank_images(CLIP_FRAMES) if blank else str(cached_clip(seed, CLIP_FRAMES))
    return None, s.question, video, s.answer, lambda out: is_correct(out, s.answer)


def read_checkpoint(path: Path | None) -> dict[tuple, dict]:
    """(task, seed, budget, condition) -> what earlier runs wrote for it: their records joined and the methods they
    asked (`methods`; a line written before lines named them: the methods of its records). Several lines may hold
    one key (a later run asked only the methods the earlier ones lacked). A torn last line, from a run stopped
    mid-write, is dropped and asked again."""
    done: dict[tuple, dict] = {}
    if path is None or not path.exists():
        return done
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a torn last line: asked again
        key = (line["task"], line["seed"], line["budget"], line["condition"])
        asked = line.get("methods") or {r["method"].removesuffix(va.IMAGE_SUFFIX) for r in line["records"]}
        joined = done.setdefault(key, {"task": key[0], "seed": key[1], "budget": key[2], "condition": key[3],
                                       "methods": set(), "records": []})
        joined["methods"] |= set(asked)
        joined["records"] += line["records"]
    return done


def evaluate(engine: Engine, tasks: list[str], split: str, samples: int, methods: list[str], budgets: list[float],
             max_new: int, frames: int, *, blank: bool = True, knobs: dict | None = None,
             query_agnostic: bool = False, subtasks: list[str] | None = None,
             checkpoint: Path | None = None, image_rows: bool = False, control_seeds: int = 1,
             shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """Every sample at every budget (all methods of a budget in one session; with `image_rows` the methods with a
    `budget_of` knob again with budget_of=image; the controls that draw at random as N rows of draws), then the
    blank baseline with the reference method; one record per answer. `checkpoint`: a JSON-lines file that gets one
    line per sample, budget and condition as it finishes; what is in it is not asked again (a long run resumes), and
    a run with more methods asks only the methods its lines lack (the rows there are kept). `shard` (i, n): only
    the samples whose index is i modulo n are asked (n processes share a run, each with a checkpoint of its own)."""
    done = read_checkpoint(checkpoint)
    runs = [(budget, ms, "images") for j, budget in enumerate(budgets)
            if (ms := [m for m in methods if uses_budget(m) or j == 0])]
    reference = role_method("reference")
    if blank:
        runs.append((1.0, [reference], BLANK))
    todo = [item for t in tasks for item in items(t, split, samples, subtasks)]
    records: list[dict] = []
    bar = tqdm(total=len(todo) * len(runs), desc="sample x run", file=sys.stderr, mininterval=5)
    for budget, ms, condition in runs:
        for index, (task, sub, seed) in enumerate(todo):
            bar.update()
            earlier = done.get((task, seed, budget, condition), {"methods": set(), "records": []})
            records += earlier["records"]
            missing = [m for m in ms if m not in earlier["methods"]]  # a run with fewer methods: ask the others
            if not missing or index % shard[1] != shard[0]:
                continue
            # the reference answers too (the KV shares are measured against it), recorded only when missing
            asked = missing if reference in missing else [reference, *missing]
            images, prompt, video, answer, grade = question(task, seed, condition == BLANK, frames)
            line = {"task": task, "seed": seed, "budget": budget, "condition": condition, "methods": missing,
                    "records": []}
            groups = sessions(asked, knobs or {}, image_rows) if condition != BLANK else [(asked, {}, "")]
            for group, group_knobs, suffix in groups:
                outs = ask(engine, images, prompt, group, budget, max_new, video=video,
                           frames=frames if video else None, knobs=group_knobs, query_agnostic=query_agnostic,
                           draws=control_seeds if condition != BLANK else 1)
                for row, (text, kv, kept) in outs.items():
                    m, draw = split_draw(row)
                    if m not in missing:
                        continue
                    line["records"].append(
                        {"task": task, "subtask": sub, "seed": seed, "split": split, "condition": condition,
                         "method": m + suffix, "budget": reported_budget(m, budget), "draw": draw, "prompt": prompt,
                         "question": prompt, "answer": answer, "output": text, "correct": bool(grade(text)),
                         "kv_share": kv, "image_kept_share": kept})
            records += line["records"]
            if checkpoint is not None:
                with checkpoint.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    bar.close()
    return records


def row_name(method: str, budget: float, condition: str) -> str:
    return f"{method}@{budget:g}" + (f" [{BLANK}]" if condition == BLANK else "")


def summarise(records: list[dict]) -> dict:
    """row (method@budget, the blank baseline marked) -> {subtask or task: {correct, n, accuracy}}."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in records:
        row = row_name(r["method"], r["budget"], r["condition"])
        for col in (f"{r['task']}/{r['subtask']}", r["task"]):
            acc[row][col][0] += r["correct"]
            acc[row][col][1] += 1
    return {row: {c: {"correct": k, "n": n, "accuracy": k / n} for c, (k, n) in cols.items()}
            for row, cols in acc.items()}


def task_summary(records: list[dict], task: str) -> dict:
    """One task's answers (the real images, not the blank baseline) in vision_accuracy's summary shape (method@budget
    -> {"all": accuracy over the task's samples, "kv_share", "image_kept_share", a control's "draws"}), so its
    tables, chance test and figure read them as they read the single-image headline."""
    mine = [r for r in records if r["task"] == task and r["condition"] != BLANK]
    summary = va.summarise({"records": [{**r, "qtype": r["subtask"]} for r in mine], "descriptions": []})
    return {k: v for k, v in summary.items() if "all" in v}


def headline(records: list[dict], tasks: list[str], stem: Path | None, query_agnostic: bool) -> str:
    """Per task: methods x budgets (accuracy, measured KV share, R), chance over the controls' draws, the table at
    equal real memory, and (with `stem`) the figure against the measured share."""
    out = []
    for task in tasks:
        summary = task_summary(records, task)
        if not any(uses_budget(k.rsplit("@", 1)[0]) for k in summary):
            continue
        parts = [f"### {task}\n", va.pivot(summary), va.chance_lines(records_of(records, task), summary),
                 va.equal_memory_table(summary)]
        if stem is not None:
            print(va.figure(summary, stem.with_name(f"{stem.name}-{task}"), "published", query_agnostic, "random",
                            title=f"{task}: accuracy vs the KV bytes held"), file=sys.stderr)
        out.append("\n".join(p for p in parts if p))
    return "\n".join(out)


def records_of(records: list[dict], task: str) -> list[dict]:
    """One task's answers on the real images, keyed as the chance test keys them: (sample seed, prompt)."""
    return [r for r in records if r["task"] == task and r["condition"] != BLANK]


def columns(tasks: list[str]) -> list[str]:
    return [c for t in tasks for c in [*(f"{t}/{s}" for s in TASKS[t]), t]]


def markdown(summary: dict, tasks: list[str]) -> str:
    cols = [c for c in columns(tasks) if any(c in per for per in summary.values())]
    short = [c.split("/", 1)[1] if "/" in c else f"**{c}**" for c in cols]
    lines = ["| method@budget | " + " | ".join(short) + " |", "|---" * (len(cols) + 1) + "|"]
    for row, per in summary.items():
        lines.append(f"| {row} | " + " | ".join(
            f"{per[c]['accuracy']:.1%} ({per[c]['correct']}/{per[c]['n']})" if c in per else "-" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def leaderboard_folder(root: Path, task: str, model: str, query_agnostic: bool) -> Path:
    """Where a run's rows of one task go: root/<task>/<model>-query-agnostic (or -query-aware), the layout of the
    single-image headline's rows (`scene_qa/embedded-query-agnostic`), so a later run of the same setting replaces
    them. A hub id or a local directory is named by its last part."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", model.rstrip("/\\").replace("\\", "/").split("/")[-1]) or "model"
    return root / task / f"{name}-{'query-agnostic' if query_agnostic else 'query-aware'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--tasks", default="scene_multi,scene_video", help="comma-separated: scene_multi, scene_video")
    ap.add_argument("--subtasks", default="", help="comma-separated subtasks to ask (default: all)")
    ap.add_argument("--split", default="test", choices=["test", "val"])
    ap.add_argument("--samples", type=int, default=40, help="samples per subtask (the lmms tasks: 40)")
    ap.add_argument("--methods", default=role_method("reference"),
                    help="comma-separated engine methods, or 'all' (default: the reference, Full)")
    ap.add_argument("--budgets", default="1.0", help="comma-separated KV budgets (default 1.0)")
    ap.add_argument("--query-agnostic", action="store_true",
                    help="compress the images before the question is fed (the engine's query-agnostic mode)")
    ap.add_argument("--knob", action="append", default=[], metavar="METHOD.KNOB=VALUE",
                    help="a method's own setting, repeatable")
    ap.add_argument("--frames", type=int, default=8, help="frames the engine samples from each clip (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--no-blank", action="store_true", help="leave out the blank-images baseline")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--checkpoint", default=None, metavar="PATH",
                    help="append each sample's answers here as they finish, and skip those already in it")
    ap.add_argument("--shard", default="0/1", type=va.shard_arg, metavar="I/N",
                    help="ask only the samples whose index is I modulo N: N processes share one run, each with a "
                         "--checkpoint of its own; join the files (cat) and run again without --shard for the whole")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the records and the summary here")
    ap.add_argument("--budget-of-image", action="store_true",
                    help="also run the methods with a budget_of knob with budget_of=image (rows '<method>[image]')")
    ap.add_argument("--control-seeds", type=int, default=1, metavar="N",
                    help="ask the controls that draw at random with N seeds (chance as their spread)")
    ap.add_argument("--leaderboard", default=None, metavar="DIR",
                    help="also write each task's rows in the leaderboard's layout under DIR/<task>/<model>-<query "
                         "mode>/, as the single-image headline's rows are kept (the app's Leaderboard tab reads "
                         "benchmarks/leaderboard/)")
    ap.add_argument("--out", default=None, metavar="STEM",
                    help="write the headline per task (STEM.md) and its figures (STEM-<task>.html/.png)")
    args = ap.parse_args(argv)

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {unknown}; expected {', '.join(TASKS)}")
    subtasks = [s.strip() for s in args.subtasks.split(",") if s.strip()] or None
    methods = resolve_methods(args.methods)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()] or [1.0]
    t0 = time.time()
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(loaded)
    records = evaluate(engine, tasks, args.split, args.samples, methods, budgets, args.max_new_tokens, args.frames,
                       blank=not args.no_blank, knobs=parse_knobs(args.knob), query_agnostic=args.query_agnostic,
                       subtasks=subtasks, checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                       image_rows=args.budget_of_image, control_seeds=max(1, args.control_seeds),
                       shard=args.shard)
    summary = summarise(records)
    mode = "query-agnostic" if args.query_agnostic else "question in view"
    md = (f"Long-cache scene tasks, {args.split} split, {args.samples} samples per subtask, model {args.model}, "
          f"{args.frames} frames per clip, {mode}\n\n" + markdown(summary, tasks))
    stem = Path(args.out) if args.out else None
    if stem is not None:
        stem.parent.mkdir(parents=True, exist_ok=True)
    top = headline(records, tasks, stem, args.query_agnostic) if len(budgets) > 1 or budgets != [1.0] else ""
    if top:
        md += "\n## Every method against the KV bytes it held\n\n" + top
    if stem is not None:
        stem.with_suffix(".md").write_text(md)
    if args.leaderboard:
        from . import accuracy_leaderboard

        for task in tasks:
            accuracy_leaderboard.write(leaderboard_folder(Path(args.leaderboard), task, args.model,
                                                          args.query_agnostic), task_summary(records, task),
                                       model=args.model,
                                       budget_mode="published", query_agnostic=args.query_agnostic,
                                       **accuracy_leaderboard.ran_on(loaded), task=task, qtypes=TASKS[task],
                                       script="benchmarks.long_accuracy")
    print(md)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "model": args.model, "vision_trained": loaded.vision_trained, "split": args.split,
            "samples": args.samples, "tasks": tasks, "methods": methods, "budgets": budgets, "frames": args.frames,
            "max_new_tokens": args.max_new_tokens, "query_agnostic": args.query_agnostic, "blank": not args.no_blank,
            "accuracy": {row: {c: v["accuracy"] for c, v in per.items()} for row, per in summary.items()},
            "summary": summary, "seconds": round(time.time() - t0, 1), "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
