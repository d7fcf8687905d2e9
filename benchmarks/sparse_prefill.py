"""ZipVL's sparse prefill against Full's on long prompts: the time to the first token of each, alone and side by
side in one run, on a generated clip of 8 and 32 frames (the embedded model sees synthetic scenes only). `--also`
adds rows of other methods at `--budget`, e.g. those that change the prefill (a token drop inside the language
model, a vision-side reduction, DyCoke's temporal merging).

    python -m benchmarks.sparse_prefill --model embedded --frames 8 32 --repeats 3 --out runs/sparse-prefill
    python -m benchmarks.sparse_prefill --model embedded --frames 8 32 --also fastv,pyramiddrop,sparsevlm,dycoke

For each clip every repeat times Full, ZipVL with its sparse prefill and ZipVL with the dense shared prefill (and
the `--also` rows), in turn, each from a prefill of its own (`time_alone`); the table gives the median TTFT, its
ratio to Full's, the share of each layer's tokens the sparse prefill attended with (mean over layers), and whether
the first answer tokens match Full's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.method_args import add_model_args
from prefixkv_core.models import load_model
from prefixkv_core.policies import METHODS
from scenes.video import video_sample

ROWS = {"full": ("full", {}), "zipvl-sparse": ("zipvl", {}), "zipvl-dense": ("zipvl", {"sparse_prefill": False})}


def time_one(engine: Engine, frames, question: str, method: str, knobs: dict, max_new: int,
             budget: float = 1.0) -> dict:
    session = engine.new_session(None, question, [method], budget, GenerationSettings(max_new_tokens=max_new),
                                 {method: knobs} if knobs else None, video=list(frames), frames=len(frames),
                                 time_alone=True, batched=False)
    for _ in session.run():
        pass
    result = session.results()[method]
    state = session.states[method]
    attended = (state.policy.extras(state.policy_state) or {}).get("attended") or []
    return {"ttft_s": result["alone"]["ttft_s"], "text": result["text"], "prompt_tokens": session.prefill.prompt_tokens,
            "attended": sum(attended) / len(attended) if attended else None}


def rows_timed(also: list[str], budget: float) -> dict[str, tuple[str, dict, float]]:
    """Row name -> (method, knobs, budget): Full and ZipVL's two prefills (ZipVL keeps every token: no budget), then
    each of `also` at `budget`."""
    rows = {row: (method, knobs, 1.0) for row, (method, knobs) in ROWS.items()}
    timed = {method for method, _ in ROWS.values()}
    rows.update({f"{method} r={budget:g}": (method, {}, budget) for method in also if method not in timed})
    return rows


def measure(engine: Engine, frame_counts: list[int], repeats: int, max_new: int, seed: int,
            also: list[str] = (), budget: float = 0.3) -> list[dict]:
    out = []
    timed = rows_timed(list(also), budget)
    for count in frame_counts:
        clip = video_sample(seed, frames=count)
        runs = {row: [] for row in timed}
        for _ in range(repeats):
            for row, (method, knobs, r) in timed.items():
                runs[row].append(time_one(engine, clip.frames, clip.question, method, knobs, max_new, r))
        full = statistics.median(r["ttft_s"] for r in runs["full"])
        for row, results in runs.items():
            ttft = statistics.median(r["ttft_s"] for r in results)
            out.append({"frames": count, "row": row, "prompt_tokens": results[0]["prompt_tokens"], "ttft_s": ttft,
                        "x_full": full / ttft if ttft else None, "attended": results[0]["attended"],
                        "same_answer_as_full": results[0]["text"] == runs["full"][0]["text"]})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| frames | prompt tokens | row | TTFT ms | speed-up over Full | tokens attended | answer as Full |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        attended = "" if r["attended"] is None else f"{r['attended']:.0%}"
        lines.append(f"| {r['frames']} | {r['prompt_tokens']:,} | {r['row']} | {1000 * r['ttft_s']:.0f} | "
                     f"{r['x_full']:.2f}x | {attended} | {'yes' if r['same_answer_as_full'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--frames", type=int, nargs="+", default=[8, 32], help="clip lengths to time")
    ap.add_argument("--repeats", type=int, default=3, help="timings per row (the median is reported)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the generated clip's seed")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--also", default="", help="comma-separated methods to time beside ZipVL, at --budget")
    ap.add_argument("--budget", type=float, default=0.3, help="the --also rows' budget (default 0.3)")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    also = [m.strip() for m in args.also.split(",") if m.strip()]
    unknown = [m for m in also if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    if not 0.0 < args.budget <= 1.0:
        ap.error("--budget must lie in (0, 1]")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = measure(Engine(loaded), args.frames, args.repeats, args.max_new_tokens, args.seed, also, args.budget)
    text = f"{loaded.name}, {torch.get_num_threads()} threads, median of {args.repeats}\n\n{table(rows)}\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"model": loaded.name, "rows": rows}, indent=1) + "\n")
        out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
