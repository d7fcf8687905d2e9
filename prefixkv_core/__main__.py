"""Command line: `python -m prefixkv_core {compare,calibrate,calibrate-heads,methods}`.

    python -m prefixkv_core compare --model embedded --image assets/images/scene-0.png \
        --prompt "Describe the image." --methods all --budget 0.3 --json out.json
    python -m prefixkv_core compare --model embedded --image a.png --image b.png \
        --prompt "<image> <image> Which image shows a red circle?" --methods full,snapkv --budget 0.2
    python -m prefixkv_core compare --model embedded --video clip.mp4 --frames 8 --prompt "What moves?"
    python -m prefixkv_core calibrate --model embedded --samples 10
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tqdm.auto import tqdm

from .method_args import MethodArgError, add_method_args, add_model_args, method_args, parse_budgets


def cmd_compare(args) -> int:
    from . import Engine, GenerationSettings, load_model
    from .report.events import MethodEvent

    chosen = method_args(args)  # checked before the model loads
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(loaded)
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    images = args.image or None
    session = engine.new_session(images, args.prompt, chosen.methods, chosen.budget, gen, chosen.knobs,
                                 budget_mode=chosen.budget_mode, query_agnostic=chosen.query_agnostic,
                                 time_alone=args.time_alone is not None,
                                 batched=args.time_alone != "only", video=args.video, frames=args.frames,
                                 draws=args.draws)
    names = list(session.states)
    passes = 2 if args.time_alone == "after" else 1  # the batched run, then every method alone
    bar = tqdm(total=len(names) * args.max_new_tokens * passes, desc="decoding", disable=args.quiet)
    for event in session.run():
        if isinstance(event, MethodEvent) and event.kind in ("token", "done"):
            bar.update(1)
    bar.close()
    payload = {**session.record.to_dict(), "model_slug": loaded.slug, "prompt": args.prompt,
               "image": args.image[0] if args.image and len(args.image) == 1 else args.image, "video": args.video,
               "prompt_tokens": session.prefill.prompt_tokens, "image_tokens": session.prefill.image_tokens}
    results = payload["methods"]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
    if not args.quiet:
        question = "query-agnostic: compressed before the question" if payload["query_agnostic"] else \
            "query-aware: compressed with the question"
        print(f"budget r = {chosen.budget:g}, {payload['budget_mode'].replace('_', ' ')} mode, {question}")
        batch = payload["timing"]["batch"]
        if batch:
            print(f"batched: {batch['methods']} methods share one forward of {batch['forward_ms_per_step']:.1f} ms "
                  "per token (policy times below are each method's own)")
        if payload["timing"]["alone"]:
            print("alone: each method decoded on its own, from its own prefill (TTFT, tokens/s, speed-up over Full)")
        for name, r in results.items():
            ratio = r["kv_bytes"] / r["full_kv_bytes"] if r["full_kv_bytes"] else 1.0
            rl = "" if r["rouge_l_vs_full"] is None else f"  ROUGE-L {r['rouge_l_vs_full']:.3f}"
            print(f"[{name}] KV {ratio:6.1%}{rl}{_timing_text(r)}  {r['error'] or r['text']!r}")
    return 0


def _timing_text(r: dict[str, Any]) -> str:
    """A method's own timings: its policy time per token, and what it took alone when it was timed alone."""
    out = "" if r["policy_ms_per_token"] is None else f"  policy {r['policy_ms_per_token']:.2f} ms/token"
    alone = r.get("alone") or {}
    if alone.get("tokens_per_s"):
        speed = "" if r["speedup_vs_full"] is None else f" ({r['speedup_vs_full']:.2f}x Full)"
        out += f"  alone {alone['tokens_per_s']:.1f} tok/s{speed}"
    if alone.get("ttft_s") is not None:
        out += f", TTFT {alone['ttft_s'] * 1000:.0f} ms"
    return out


def cmd_calibrate(args) -> int:
    from . import Engine, load_model
    from .calibrate import calibrate, default_samples, write_config

    budgets = parse_budgets(args.budgets)  # checked before the model loads
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(loaded)
    samples = default_samples(args.samples)
    found = calibrate(engine, samples, budgets, progress=not args.quiet)
    for budget, result in found.items():
        path = write_config(loaded.slug, loaded.name, budget, result["ratios"], len(samples),
                            extra={"threshold_mean": round(result["threshold_mean"], 6),
                                   "threshold_std": round(result["threshold_std"], 6)}, samples=samples)
        if not args.quiet:
            print(f"budget {budget:.2f}: threshold {result['threshold_mean']:.4f} -> {path}")
    return 0


def cmd_calibrate_heads(args) -> int:
    from . import load_model
    from .calibrate_heads import calibrate_heads

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    path = calibrate_heads(loaded, args.samples, args.max_new_tokens, progress=not args.quiet)
    if not args.quiet:
        print(f"visual-head scores of {loaded.num_layers} layers -> {path}")
    return 0


def cmd_methods(args) -> int:
    from .policies import describe

    for m in describe():
        budget = "uses the budget" if m["uses_budget"] else "ignores the budget"
        print(f"{m['name']:10s} {m['label']}\n           {m['summary']}\n           stage: {m['stage']}; "
              f"schedule: {m['schedule']}; {budget}; colour {m['colour']}")
        if not m["knob_details"]:
            print("           knobs: none")
        for k in m["knob_details"]:
            print(f"           --knob {m['name']}.{k['name']}={_cli_value(k['default'])}: {k['help']} "
                  f"({k['accepted']})")
    return 0


def _cli_value(value: Any) -> str:
    """A default as it would be typed after --knob METHOD.KNOB= (true/false, numbers, text, comma lists)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "(unset)"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prefixkv_core",
                                     description="KV-cache compression methods for vision-language models "
                                                 "(LLaVA-1.5, LLaVA-Interleave, LLaVA-NeXT, LLaVA-OneVision, "
                                                 "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL), side by side.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="run several methods on images (or a video) and a prompt; print and/or "
                                       "write JSON")
    add_model_args(p)
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image file (PNG/JPEG/...); repeat for several, in order: <image> markers in the prompt "
                        "place them, else they come before it; omit for a text-only prompt")
    p.add_argument("--video", default=None, metavar="PATH",
                   help="a video file (MP4/MOV/WebM/MKV/AVI), sampled uniformly to --frames frames that the model "
                        "reads as images after the --image ones (a <video> marker in the prompt places them)")
    p.add_argument("--frames", type=int, default=None,
                   help="frames sampled from --video (1-64, default 8)")
    p.add_argument("--prompt", required=True, help="the user's question or instruction")
    add_method_args(p)
    p.add_argument("--time-alone", nargs="?", const="after", choices=("after", "only"), default=None,
                   metavar="only",
                   help="also decode every method on its own, from its own prefill, and report its TTFT, tokens/s "
                        "and speed-up over Full measured alone (after the batched comparison; '--time-alone only': "
                        "instead of it)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per method")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --sample)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (with --sample)")
    p.add_argument("--seed", type=int, default=0,
                   help="the comparison's seed: sampling (each method starts from it) and the methods that draw "
                        "at random")
    p.add_argument("--draws", type=int, default=1, metavar="N",
                   help="run each control that draws at random (random, random_drop) N times in this comparison, "
                        "as rows random, random~1 ... (row k: the draw of --seed + k), so chance shows as a spread")
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("calibrate", help="estimate offline PrefixKV layer ratios and write them to assets/")
    add_model_args(p)
    p.add_argument("--samples", type=int, default=10,
                   help="calibration samples: generated scenes from the end of the train split, disjoint from "
                        "every evaluation set; recorded in each config file")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", help="comma-separated budgets")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("calibrate-heads", help="score each KV head by how often it looks at what the model names in "
                                               "an image (SparseMM's visual heads) and write the scores to assets/")
    add_model_args(p)
    p.add_argument("--samples", type=int, default=200,
                   help="generated scenes from the end of the train split, disjoint from every evaluation set")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens each scene's description runs to")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_calibrate_heads)

    p = sub.add_parser("methods", help="list the methods, what they do and their knobs")
    p.set_defaults(func=cmd_methods)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .session.engine import EngineError
    from .models import ModelLoadError
    from .policies import PolicyError

    try:
        return args.func(args)
    except (EngineError, ModelLoadError, PolicyError, MethodArgError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
