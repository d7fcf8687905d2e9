"""A long multimodal context, measured: a video of 8 and 32 frames on LLaVA-OneVision's shape (its own video
path: every frame pooled to 14 x 14 tokens), every method compared at once.

Per frame count, measured side by side in one process (each repeat: Full alone, then the whole comparison, so
both meet the same machine):

1. each budgeted method's KV bytes over Full's, from the cache tensors at the end of the answer (`kv_bytes` /
   `full_kv_bytes` of the record: the bytes the tensors hold, not a formula), beside the budget r;
2. the whole comparison's wall time (request to last token, every method, prefills included) over Full alone's
   (goal <= 2.2x);
3. the peak memory of the prefill: the process's resident set high-water mark, reset before the run (Linux
   /proc/self/clear_refs) and read after the first token, above what the process held before it; on CUDA the
   allocator's peak.

    python benchmarks/long_context.py --random-weights llava-onevision --frames 8,32 --budget 0.3 --new-tokens 16
    python benchmarks/long_context.py --random-weights tiny-llava-onevision --frames 4 --new-tokens 4   # a smoke run

`--random-weights` builds the family's example checkpoint with random weights (llava-onevision: the 0.5B model's
shape); its speed and memory are the real model's, its answers noise. `--model` takes a real checkpoint instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.common import REPO_ROOT, run_info  # noqa: E402
from benchmarks.interactive import add_random_weights_arg, load_benchmark_model  # noqa: E402
from prefixkv_core import Engine, GenerationSettings, resolve_methods  # noqa: E402
from prefixkv_core.decoding.runner import now  # noqa: E402
from prefixkv_core.method_args import add_model_args  # noqa: E402
from prefixkv_core.policies import REGISTRY, role_method  # noqa: E402
from prefixkv_core.session.video_input import load_video  # noqa: E402

PROMPT = "What happens in the video? Describe it."


def _rss_peak_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_now_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak(device: torch.device) -> int | None:
    """Start a peak-memory window; returns the bytes held now (the baseline)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    now_kib = _rss_now_kib()
    return None if now_kib is None else now_kib * 1024


def peak_since(device: torch.device, baseline: int | None) -> int | None:
    """Bytes above `baseline` at the window's peak."""
    if baseline is None:
        return None
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    peak = _rss_peak_kib()
    return None if peak is None else peak * 1024 - baseline


def timed_run(engine: Engine, frames: list, methods: list[str], budget: float, new_tokens: int) -> dict:
    """One comparison of `methods` on the clip's frames: wall time, the prefill's peak memory (up to the first
    token), and every method's KV bytes at the end."""
    device = engine.loaded.device
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    baseline = reset_peak(device)
    t0 = now(device)
    session = engine.new_session(None, PROMPT, methods, budget, settings, video=frames, frames=len(frames))
    prefill_peak = None
    for event in session.run():
        if prefill_peak is None and getattr(event, "kind", None) in ("token", "done"):
            prefill_peak = peak_since(device, baseline)
    total = now(device) - t0
    record = session.record.to_dict()
    kv = {m: {"kv_bytes": r["kv_bytes"], "full_kv_bytes": r["full_kv_bytes"],
              "kv_share": r["kv_bytes"] / r["full_kv_bytes"] if r["full_kv_bytes"] else None, "error": r["error"]}
          for m, r in record["methods"].items()}
    return {"total_s": total, "prefill_peak_bytes": prefill_peak, "prompt_tokens": record["prefill"]["prompt_tokens"],
            "image_tokens": record["prefill"]["image_tokens"], "methods": kv}


def measure(engine: Engine, frames: list, methods: list[str], budget: float, new_tokens: int, repeats: int) -> dict:
    reference = role_method("reference")
    alone, together = [], []
    for _ in range(repeats):  # interleaved: Full alone, then the comparison
        alone.append(timed_run(engine, frames, [reference], budget, new_tokens))
        together.append(timed_run(engine, frames, methods, budget, new_tokens))
    full_s = statistics.median(a["total_s"] for a in alone)
    whole_s = statistics.median(t["total_s"] for t in together)
    last = together[-1]
    return {"frames": len(frames), "prompt_tokens": last["prompt_tokens"], "video_tokens": last["image_tokens"],
            "full_alone_s": [a["total_s"] for a in alone], "comparison_s": [t["total_s"] for t in together],
            "comparison_over_full": whole_s / full_s,
            "prefill_peak_bytes": {"full_alone": alone[-1]["prefill_peak_bytes"],
                                   "comparison": last["prefill_peak_bytes"]},
            "methods": last["methods"]}


def report(result: dict, budget: float) -> str:
    lines = [f"### {result['frames']} frames: {result['prompt_tokens']} prompt tokens, {result['video_tokens']} of "
             "them the video's", "",
             "| method | KV bytes held | share of Full's | r |", "|---|---|---|---|"]
    for m, r in result["methods"].items():
        uses = REGISTRY[m].uses_budget
        if r["error"] or r["kv_bytes"] is None:
            lines.append(f"| {m} | - | not run: {(r['error'] or '')[:70]} | {budget if uses else '-'} |")
            continue
        lines.append(f"| {m} | {r['kv_bytes'] / 2**20:.2f} MiB | {r['kv_share']:.3f} | {budget if uses else '-'} |")
    peak = result["prefill_peak_bytes"]
    mib = {k: ("n/a" if v is None else f"{v / 2**20:.0f} MiB") for k, v in peak.items()}
    lines += ["", f"whole comparison / Full alone: {result['comparison_over_full']:.2f}x "
                  f"(Full alone {', '.join(f'{s:.1f}' for s in result['full_alone_s'])} s; comparison "
                  f"{', '.join(f'{s:.1f}' for s in result['comparison_s'])} s)",
              f"prefill peak memory above the process's: Full alone {mib['full_alone']}, the comparison "
              f"{mib['comparison']}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_random_weights_arg(ap)
    ap.add_argument("--clip", default=str(REPO_ROOT / "assets/videos/clip-0.mp4"))
    ap.add_argument("--frames", default="8,32", help="comma-separated frame counts")
    ap.add_argument("--methods", default="all")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    loaded = load_benchmark_model(args)
    engine = Engine(loaded)
    methods = resolve_methods(args.methods)
    results = []
    for count in (int(x) for x in args.frames.split(",")):
        frames = list(load_video(args.clip, count).frames)
        if len(frames) < count:  # a short clip: its frames repeated in order, as a longer clip of it would give
            frames = [frames[i * len(frames) // count] for i in range(count)]
        results.append(measure(engine, frames, methods, args.budget, args.new_tokens, args.repeats))
        print(report(results[-1], args.budget), flush=True)
        if args.json:  # after every frame count: a long run stopped later keeps what it measured
            Path(args.json).write_text(json.dumps({"run": run_info(loaded.device), "model": loaded.name,
                                                   "budget": args.budget, "new_tokens": args.new_tokens,
                                                   "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
