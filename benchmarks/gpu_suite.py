"""Every GPU figure in one command, sized for a few minutes on one H100: a GPU is rarely at hand, and then briefly.

    python benchmarks/gpu_suite.py                    # on a CUDA machine: every part, within --deadline-s
    python benchmarks/gpu_suite.py --tiny             # the same parts on tiny shapes on the CPU (a check of the suite)
    python benchmarks/gpu_suite.py --parts space,app  # some parts only

The parts, in the order they run (each in a process of its own, so that a crash or an out-of-memory in one
leaves the others their figures, and each with a time limit):

- `table3`: PrefixKV's Table 3 setting: random weights in LLaVA-1.5-7B's shapes, bf16, batch 16, prompt 1024 +
  generate 512 tokens; Full (plain transformers and through the engine) and PrefixKV at budgets 0.2 / 0.4 / 0.6 /
  0.8, offline with the per-layer ratios its authors released (shared by every prompt) and online (`speed.py`):
  decode throughput, latency, KV bytes and peak GPU memory (about 200 s on an H100).
- `space`: every method compared at once on the Space default's shape (llava-interleave-qwen-0.5b, random
  weights), each also decoded alone (`interactive.py --time-alone`): the batched decode over Full alone, the
  batching ceiling of plain transformers, first-token waits.
- `onevision`: every method at once on LLaVA-OneVision-0.5B's shape (anyres: several image crops).
- `app`: the app answering through its API (`app_visitors.py`) on the Space shape: one visitor alone, then four at
  once, as `gradio_client` sees the stream; the model in a process of its own, beside a bare Gradio app on the same
  engine (`--engine-process floor`), two rounds each.
- `table3-b48`: the paper's batch-48 row (624 + 256, where its GPU ran out of memory; Full and PrefixKV at 0.2),
  under the memory of the paper's card (an A100 40 GB: `--memory-cap-gib 40`), run last: it only fits the time
  left on a fast card.

It writes `gpu_suite.json` (every number of every part) and `gpu_suite.md` (the report) into --out, with each
part's own outputs and log beside them; commit the report under benchmarks/reports/. Without a CUDA device and
without --tiny it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from benchmarks.common import REPO_ROOT, run_info  # noqa: E402

BENCH = Path(__file__).resolve().parent
NO_GPU = ("No CUDA GPU is visible here (torch.cuda.is_available() is False), so there are no GPU figures to "
          "measure. Run this on a machine with an NVIDIA GPU, or pass --tiny to check the suite itself on tiny "
          "shapes on the CPU.")


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    script: str
    gpu_args: tuple[str, ...]
    tiny_args: tuple[str, ...]
    limit_s: float  # the most this part may take on the GPU; a part is skipped when less than `min_s` is left
    min_s: float
    output: str  # "speed" (a folder with results.json and speed.md) or "json" (one JSON; stdout is the report)


PARTS = (
    Part("table3", "PrefixKV's Table 3 setting: LLaVA-1.5-7B shapes, bf16, batch 16", "speed.py",
         ("--random-weights", "llava-1.5-7b", "--dtype", "bfloat16", "--batch", "16",
          "--settings", "1024x512", "--methods", "full,prefixkv", "--budgets", "0.2,0.4,0.6,0.8",
          "--also", "prefixkv.mode=online"),
         ("--random-weights", "tiny", "--batch", "2", "--settings", "48x4", "--methods", "full,prefixkv",
          "--budgets", "0.2,0.8", "--warmup-steps", "1", "--also", "prefixkv.mode=online"),
         limit_s=240, min_s=120, output="speed"),
    Part("space", "Every method at once on the Space default's shape (llava-interleave-qwen-0.5b)",
         "interactive.py",
         ("--random-weights", "llava-interleave", "--methods", "all", "--budget", "0.3", "--new-tokens", "64",
          "--repeats", "1", "--time-alone"),
         ("--random-weights", "tiny-llava-interleave", "--methods", "full,h2o,fastv", "--new-tokens", "4",
          "--repeats", "1", "--time-alone"),
         limit_s=120, min_s=60, output="json"),
    Part("onevision", "Every method at once on LLaVA-OneVision-0.5B's shape", "interactive.py",
         ("--random-weights", "llava-onevision", "--methods", "all", "--budget", "0.3", "--new-tokens", "64",
          "--repeats", "1", "--no-sequential"),
         ("--random-weights", "tiny-llava-onevision", "--methods", "full,snapkv", "--new-tokens", "4",
          "--repeats", "1", "--no-sequential"),
         limit_s=90, min_s=45, output="json"),
    Part("app", "The app through its API on the Space shape: one visitor, then four at once", "app_visitors.py",
         # served as app.py serves it (the model in a process of its own) beside the bare Gradio app: on a GPU the
         # server's Python no longer shares the model's processors, which is where the app's own cost can be read
         ("--random-weights", "llava-interleave", "--clients", "4", "--new-tokens", "48", "--engine-process", "floor",
          "--repeats", "2"),
         ("--random-weights", "tiny-llava-interleave", "--clients", "2", "--new-tokens", "4"),
         limit_s=150, min_s=75, output="json"),
    Part("table3-b48", "PrefixKV's Table 3, batch 48 (624 + 256)", "speed.py",
         ("--random-weights", "llava-1.5-7b", "--dtype", "bfloat16", "--batch", "48", "--settings", "624x256",
          "--methods", "full,prefixkv", "--budgets", "0.2", "--no-stock", "--memory-cap-gib", "40"),
         ("--random-weights", "tiny", "--batch", "3", "--settings", "40x3", "--methods", "full,prefixkv",
          "--budgets", "0.2", "--no-stock", "--warmup-steps", "1"),
         limit_s=100, min_s=60, output="speed"),
)
PART_NAMES = tuple(p.name for p in PARTS)


def shortened(args: tuple[str, ...]) -> list[str]:
    """--short: PrefixKV at its lowest and highest budget only, no method timed alone (about half the time)."""
    out = [a for a in args if a != "--time-alone"]
    if "--budgets" in out:
        i = out.index("--budgets") + 1
        budgets = out[i].split(",")
        out[i] = ",".join(dict.fromkeys([budgets[0], budgets[-1]]))
    return out


def part_command(part: Part, tiny: bool, out: Path, short: bool = False) -> list[str]:
    own = part.tiny_args if tiny else part.gpu_args
    args = [sys.executable, str(BENCH / part.script), *(shortened(own) if short else own),
            "--device", "cpu" if tiny else "cuda"]
    if tiny:
        args += ["--threads", "1"]
    if part.output == "speed":
        args += ["--out", str(out / part.name), "--no-png", "--quiet"]
    else:
        args += ["--json", str(out / f"{part.name}.json")]
    return args


def run_part(part: Part, tiny: bool, out: Path, limit_s: float, short: bool = False) -> dict:
    """Run one part in its own process; its output goes to <out>/<name>.log. Returns its status and numbers."""
    cmd = part_command(part, tiny, out, short)
    log = out / f"{part.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=limit_s).returncode
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            rc, status = None, f"stopped at its time limit ({limit_s:.0f} s)"
    wall = time.perf_counter() - t0
    result, report = None, None
    if part.output == "speed":
        folder = out / part.name
        if (folder / "results.json").exists():
            result = json.loads((folder / "results.json").read_text())
            report = (folder / "speed.md").read_text()
    elif (out / f"{part.name}.json").exists():
        result = json.loads((out / f"{part.name}.json").read_text())
        report = printed_report(log.read_text())
    return {"title": part.title, "status": status, "exit_code": rc, "wall_s": round(wall, 1),
            "command": " ".join([f"benchmarks/{part.script}", *cmd[2:]]),
            "log": log.name, "result": result, "report": report,
            "log_tail": None if status == "ok" else tail(log.read_text(), 40)}


def printed_report(text: str) -> str:
    """The markdown a benchmark printed: from its first table or heading line on (progress bars dropped)."""
    noise = ("it/s]", "s/it]", "Closing server running on port", "[app_visitors]")
    lines = [ln for ln in text.splitlines() if not any(n in ln for n in noise) and "\r" not in ln]
    starts = [i for i, ln in enumerate(lines) if ln.startswith(("|", "#", "App through", "Model"))]
    return "\n".join(lines[max(0, starts[0] - 2):] if starts else lines[-40:]).strip()


def tail(text: str, n: int) -> str:
    return "\n".join(text.replace("\r", "\n").splitlines()[-n:])


def markdown(summary: dict) -> str:
    info = summary["run"]
    lines = [f"# GPU figures: {info['machine']}", "",
             f"{info['date']}; commit {info['commit']}; torch {info['torch']}, transformers {info['transformers']}, "
             f"Python {info['python']}." + (" **Tiny shapes on the CPU: a check of the suite, not figures.**"
                                            if summary["tiny"] else "")
             + (" Run with --short: PrefixKV at its lowest and highest budget, no method timed alone."
                if summary.get("short") else ""),
             f"The whole suite: {summary['wall_s']:.0f} s (deadline {summary['deadline_s']:.0f} s). Random weights "
             "in each model's released shapes: the speed and memory are the real model's, the answers are noise.",
             "", "| part | what | status | wall |", "|---|---|---|---|"]
    for name, p in summary["parts"].items():
        lines.append(f"| {name} | {p['title']} | {p['status']} | {p.get('wall_s', 0):.0f} s |")
    for name, p in summary["parts"].items():
        lines += ["", f"## {name}: {p['title']}", "", f"`python {p['command']}`" if p.get("command")
                  else "", ""]
        if p.get("report"):
            lines.append(p["report"])
        if p.get("log_tail"):
            lines += ["", "Last lines of its log:", "", "```", p["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma-separated, of {', '.join(PART_NAMES)}")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the suite, measures nothing")
    ap.add_argument("--deadline-s", type=float, default=480.0,
                    help="the whole suite's time; a part that cannot have its minimum in what is left is skipped")
    ap.add_argument("--short", action="store_true",
                    help="PrefixKV at its lowest and highest budget only, no method timed alone (about half the time)")
    ap.add_argument("--out", default=None, help="output folder (default out/benchmarks/gpu-suite[-tiny])")
    args = ap.parse_args(argv)
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PART_NAMES]
    if unknown or not chosen:
        raise SystemExit(f"--parts: unknown {', '.join(unknown) or '(none given)'}; accepted: {', '.join(PART_NAMES)}")

    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else REPO_ROOT / "out" / "benchmarks" / ("gpu-suite-tiny" if args.tiny
                                                                              else "gpu-suite")
    out.mkdir(parents=True, exist_ok=True)
    summary = {"run": run_info("cpu" if args.tiny else "cuda"), "tiny": args.tiny, "short": args.short,
               "deadline_s": args.deadline_s,
               "parts": {}}
    t0 = time.perf_counter()
    for part in (p for p in PARTS if p.name in chosen):
        left = args.deadline_s - (time.perf_counter() - t0)
        if not args.tiny and left < part.min_s:
            summary["parts"][part.name] = {"title": part.title, "status": f"skipped: {left:.0f} s left of the "
                                           f"deadline, it needs {part.min_s:.0f} s", "wall_s": 0}
            continue
        limit = part.limit_s * 4 if args.tiny else min(part.limit_s, left)  # a 2-core CPU is slower than the GPU
        print(f"[gpu_suite] {part.name}: {part.title} (at most {limit:.0f} s)", flush=True)
        summary["parts"][part.name] = run_part(part, args.tiny, out, limit, args.short)
        print(f"[gpu_suite] {part.name}: {summary['parts'][part.name]['status']} in "
              f"{summary['parts'][part.name]['wall_s']:.0f} s", flush=True)
        summary["wall_s"] = time.perf_counter() - t0
        write(out, summary)  # after every part: a suite stopped from outside keeps what it measured
    summary["wall_s"] = time.perf_counter() - t0
    write(out, summary)
    print(markdown(summary))
    print(f"wrote {out / 'gpu_suite.md'} and {out / 'gpu_suite.json'}")
    return 0 if all(p["status"] == "ok" for p in summary["parts"].values()) else 1


def write(out: Path, summary: dict) -> None:
    (out / "gpu_suite.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "gpu_suite.md").write_text(markdown(summary))


if __name__ == "__main__":
    sys.exit(main())
