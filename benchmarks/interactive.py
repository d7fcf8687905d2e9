"""What a user of the app waits for: every method compared at once, decoded as one batch by the runner.

Measured side by side in one process, repeats interleaved (the machines are shared and noisy):

1. decode throughput of all selected methods together (tokens summed over methods / decode wall time)
   divided by that of Full alone through the same engine (goal >= 3x on the embedded model, aim 5x);
2. wall time of the whole comparison, from the request to the last token, shared prefill included;
3. Full alone through the runner / plain `model.generate`, per decoded token (goal >= 0.95);
4. for reference, the same methods run one after another (what the comparison cost before batching);
4b. the hardware's batching ceiling: a plain cached greedy loop in transformers (DynamicCache, the model's own
   attention, no engine) decodes the same prompt at batch B (B = the number of methods) and at batch 1; the
   ceiling is the ratio of their tokens/s, and the runner's efficiency is the throughput ratio (1.) over it;
4c. the user's wait for a first token, timed from the request: Full alone's; in the comparison, the last of the
   methods that share the prefill (they stream first) and the last of those with a prefill of their own (then
   prefilled one after another, each streaming when ready), each over Full alone's; and the
   whole comparison over Full alone's whole run;
5. with --time-alone, what each method costs on its own: in the batched run its own policy time per token
   (the forward is shared and reported once), and decoded alone (the session's batched=False: each method
   from its own prefill) its TTFT, tokens/s, ms per token and speed-up over Full (tokens/s ratio), with a
   check that its answer is the batched one. The one-after-another wall time then comes from that run, whose
   order of methods rotates from one repeat to the next.

    python benchmarks/interactive.py --model embedded --budget 0.3 --new-tokens 64
    python benchmarks/interactive.py --model embedded --threads 1 --new-tokens 16 --time-alone
    python benchmarks/interactive.py --random-weights llava-interleave --new-tokens 24   # the Space's shape
    python benchmarks/interactive.py --random-weights qwen2.5-vl-3b --threads 1 --new-tokens 8   # M-RoPE

`--random-weights` builds a family's example checkpoint with random weights and a stand-in tokenizer
(`llava-1.5`, `llava-interleave`: the Space default llava-interleave-qwen-0.5b, `llava-next`, `llava-onevision`,
or `tiny-<family>`; `qwen2.5-vl-3b`: Qwen2.5-VL-3B-Instruct, `internvl3-1b`: InternVL3-1B): its speed is the
real model's, its answers are noise.
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
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import REPO_ROOT, Pauses, run_info  # noqa: E402
from benchmarks.engine_overhead import generation_inputs, time_generate  # noqa: E402
from prefixkv_core import Engine, GenerationSettings, load_model, resolve_methods  # noqa: E402
from prefixkv_core.models import RANDOM_FAMILIES, RANDOM_MROPE, build_random_model  # noqa: E402
from prefixkv_core.models import encode, format_prompt  # noqa: E402
from prefixkv_core.models import resolve_device, resolve_dtype, vision_inputs  # noqa: E402
from prefixkv_core.models.families import hooks_of, uses_mrope  # noqa: E402
from prefixkv_core.models.compat import cache_kwarg  # noqa: E402
from prefixkv_core.decoding.runner import now  # noqa: E402
from prefixkv_core.method_args import add_model_args  # noqa: E402
from prefixkv_core.policies import make_policy, role_method  # noqa: E402


def span(pauses: Pauses | None, t0: float, t1: float) -> float:
    """Seconds from t0 to t1, less those in which the process was paused (`pauses`; None: all of them)."""
    return t1 - t0 if pauses is None else pauses.active(t0, t1)


def timed_comparison(engine: Engine, image, prompt: str, methods: list[str], budget: float, new_tokens: int,
                     pauses: Pauses | None = None) -> dict:
    """One comparison through the public API. Decode throughput is the runner's with the whole batch formed: from
    the end of the first step that every method took part in (a method with a prefill of its own joins the batch
    once it is ready) to the end of the last one, over the tokens decoded in that time (the rows that joined late
    then finish on their own, in a smaller batch, which the plain loop's ceiling at the whole batch's size does not
    measure; the whole comparison's wall time includes them); every method decodes exactly
    `new_tokens` (end of text ignored) so the counts are comparable. Each method's first token is timed from the
    request, as a user waits for it. With `pauses`, every time leaves out the stretches the process was stopped."""
    device = engine.loaded.device
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = now(device)
    session = engine.new_session(image, prompt, methods, budget, settings)
    full_batch_start, full_batch_end, tokens_since, skip, whole = None, None, 0, 0, False
    errors, first_token = {}, {}
    for ev in session.run():
        kind = getattr(ev, "kind", None)
        if kind == "start":  # the batch is whole once the last method started and a first step ran with it
            full_batch_start, full_batch_end, tokens_since, whole = None, None, 0, False
        elif kind in ("token", "done"):
            if ev.method not in first_token:
                first_token[ev.method] = span(pauses, t0, now(device))
            elif not whole:  # the first step with every row: the window opens when its tokens come out
                full_batch_start, skip, whole, rows = now(device), ev.batch_size - 1, True, ev.batch_size
            elif skip:  # the rest of that step's tokens, decoded before the window opened
                skip -= 1
            elif ev.batch_size == rows:  # the window closes with the last step of the whole batch: the rows that
                tokens_since += 1        # joined late then finish in smaller batches, which the ceiling does not time
                full_batch_end = now(device)
        if kind == "error":
            errors[ev.method] = ev.error
    t_end = now(device)
    decode_s = span(pauses, full_batch_start, full_batch_end or t_end)
    record = session.record.to_dict()
    return {"total_s": span(pauses, t0, t_end), "prefill_s": session.prefill.prefill_s, "decode_s": decode_s,
            "paused_s": 0.0 if pauses is None else pauses.within(t0, t_end),
            "decode_tokens": tokens_since, "decode_tokens_per_s": tokens_since / decode_s if decode_s > 0 else None,
            "prompt_tokens": session.prefill.prompt_tokens, "errors": errors, "batch": record["timing"]["batch"],
            "first_token_s": first_token,
            "methods": {m: {"policy_ms_per_token": r["policy_ms_per_token"], "compress_ms": r["compress_ms"],
                            "text": r["text"]} for m, r in record["methods"].items()}}


def first_token_waits(together: list[dict], alone: list[dict], methods: list[str], reference: str) -> dict:
    """The user's wait for a first token, over the repeats (medians): Full alone's, and in the comparison the
    latest of the methods that share the prefill and of those with a prefill of their own, with their ratios."""
    own = {m for m in methods if make_policy(m, 0.5).own_prefill()}
    full = statistics.median(a["first_token_s"][reference] for a in alone)
    out = {"full_alone_s": full}
    for name, group in (("sharing", [m for m in methods if m not in own]), ("own_prefill", sorted(own))):
        waits = [max(t["first_token_s"][m] for m in group if m in t["first_token_s"]) for t in together
                 if any(m in t["first_token_s"] for m in group)]
        if waits:
            out[f"{name}_s"] = statistics.median(waits)
            out[f"{name}_over_full"] = out[f"{name}_s"] / full
    return out


def timed_alone(engine: Engine, image, prompt: str, methods: list[str], budget: float, new_tokens: int,
                pauses: Pauses | None = None) -> dict:
    """Every method decoded on its own, one after another, each from its own prefill (`batched=False`): the
    session's own per-method TTFT, tokens/s and per-token latency, and the wall time of the whole run."""
    device = engine.loaded.device
    settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = now(device)
    session = engine.new_session(image, prompt, methods, budget, settings, batched=False)
    for _ in session.run():
        pass
    total = span(pauses, t0, now(device))
    out = {}
    for m, r in session.record.to_dict()["methods"].items():
        alone = r["alone"] or {}
        out[m] = {"ttft_s": alone.get("ttft_s"), "tokens_per_s": alone.get("tokens_per_s"),
                  "ms_per_token": alone.get("ms_per_token"), "policy_ms_per_token": alone.get("policy_ms_per_token"),
                  "speedup_vs_full": r["speedup_vs_full"], "text": r["text"], "error": r["error"]}
    return {"total_s": total, "methods": out}


def plain_greedy(loaded, inputs, new_tokens: int, batch: int,
                 pauses: Pauses | None = None) -> tuple[torch.Tensor, float]:
    """A plain cached greedy loop in transformers (DynamicCache, the model's own attention, no engine) over `batch`
    copies of one prompt: prefilled once, its cache repeated to `batch` rows, then `new_tokens - 1` steps of one
    token per row. Returns (the tokens [batch, new_tokens], seconds of the decode steps).

    The model is called as `generate` calls it: the prompt with every tensor the processor made
    (`generation_inputs`); a model with 3-D rotary positions (Qwen-VL) gets the prompt's positions from its own
    `get_rope_index` (the image grids, the token types) and each new token its text position plus the prompt's
    rope delta on all three axes, which is what `generate` passes; other models one position per token."""
    from transformers import DynamicCache

    model, device = loaded.model, loaded.device
    inputs = generation_inputs(loaded, inputs)
    n = inputs["input_ids"].shape[1]
    mrope = uses_mrope(model.config)
    prefill, delta = dict(inputs), 0
    if mrope:
        positions, deltas = hooks_of(model.config).rope_index(model, inputs["input_ids"], vision_inputs(inputs))
        prefill["position_ids"], delta = positions.to(device), int(deltas.reshape(-1)[0])
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(**prefill, **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        token = out.logits[:, -1].argmax(dim=-1).repeat(batch).view(batch, 1)
        tokens = [token]
        t0 = now(device)
        for i in range(new_tokens - 1):
            position = torch.full((batch, 1), n + i + delta, device=device)
            if mrope:  # [3, batch, 1]: the same logical position on the temporal, height and width axes
                position = position.unsqueeze(0).expand(3, -1, -1)
            out = model(input_ids=token, position_ids=position, **cache_kwarg(cache), use_cache=True,
                        logits_to_keep=1)
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
        elapsed = span(pauses, t0, now(device))
    return torch.cat(tokens, dim=1), elapsed


def plain_decode_tokens_per_s(loaded, inputs, new_tokens: int, batch: int, pauses: Pauses | None = None) -> float:
    """Decode tokens/s of the plain cached greedy loop (`plain_greedy`) at batch `batch`: what the hardware gives a
    batch, with nothing of ours."""
    _, elapsed = plain_greedy(loaded, inputs, new_tokens, batch, pauses)
    return batch * (new_tokens - 1) / elapsed


# the random-weight kinds that come with a processor, so image prompts run through the engine: the LLaVA families'
# shapes (and their tiny ones), and the released shapes whose family module builds them (Qwen2.5-VL-3B, InternVL3-1B)
RANDOM_WITH_PROCESSOR = tuple(RANDOM_FAMILIES) + tuple(RANDOM_MROPE)


def add_random_weights_arg(ap: argparse.ArgumentParser) -> None:
    """--random-weights: a family's released shape with random weights, read by `load_benchmark_model`."""
    ap.add_argument("--random-weights", default=None, choices=RANDOM_WITH_PROCESSOR,
                    help="instead of --model: random weights in a family's released shape (llava-interleave: the "
                         "Space default; qwen2.5-vl-3b, internvl3-1b), with a stand-in tokenizer; tiny-<family> "
                         "for smoke runs")


def load_benchmark_model(args):
    if args.random_weights is None:
        return load_model(args.model, device=args.device, dtype=args.dtype)
    if args.random_weights not in RANDOM_WITH_PROCESSOR:
        raise SystemExit(f"--random-weights {args.random_weights!r} has no processor for image prompts; accepted: "
                         f"{', '.join(RANDOM_WITH_PROCESSOR)}")
    return load_random_model(args.random_weights, device=args.device, dtype=args.dtype)


def load_random_model(kind: str, device: str = "auto", dtype: str = "auto"):
    """Random weights in a family's released shape, as `load_model` is called (an `EngineProcess` loader)."""
    device, _ = resolve_device(device)
    return build_random_model(kind, device, resolve_dtype(dtype, device))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_random_weights_arg(ap)
    ap.add_argument("--image", default=str(REPO_ROOT / "assets/images/scene-0.png"))
    ap.add_argument("--prompt", default="Describe the image in detail.")
    ap.add_argument("--methods", default="all")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats; medians are reported")
    ap.add_argument("--no-sequential", action="store_true", help="skip the one-after-another reference run")
    ap.add_argument("--time-alone", action="store_true",
                    help="also time every method decoded on its own (TTFT, tokens/s, speed-up over Full); it "
                         "replaces the one-after-another reference run")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", default=None, help="write every number here (and each repeat's raw runs, as soon as "
                                                 "they are measured, beside it in <name>.partial.json)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    loaded = load_benchmark_model(args)
    pauses = Pauses().start()  # on a shared machine the process may be stopped: those stretches are left out
    engine = Engine(loaded)
    image = Engine.load_image(args.image)
    methods = resolve_methods(args.methods)
    reference = role_method("reference")  # Full: the throughput ratio is over it decoding alone
    inputs = encode(loaded, image, format_prompt(loaded, args.prompt, with_image=True))
    timed_comparison(engine, image, args.prompt, methods, args.budget, 4)  # warm-up

    together, alone, generate, sequential, each, plain = [], [], [], [], [], []
    for rep in tqdm(range(args.repeats), desc="interleaved repeats"):
        together.append(timed_comparison(engine, image, args.prompt, methods, args.budget, args.new_tokens, pauses))
        alone.append(timed_comparison(engine, image, args.prompt, [reference], args.budget, args.new_tokens, pauses))
        generate.append(time_generate(loaded, inputs, args.new_tokens, pauses))
        one = plain_decode_tokens_per_s(loaded, inputs, args.new_tokens, 1, pauses)
        many = plain_decode_tokens_per_s(loaded, inputs, args.new_tokens, len(methods), pauses)
        plain.append({"batch_1_tokens_per_s": one, "batch_b_tokens_per_s": many, "ceiling": many / one})
        if args.time_alone:  # each repeat starts the one-after-another run with another method
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            each.append(timed_alone(engine, image, args.prompt, order, args.budget, args.new_tokens, pauses))
            sequential.append(each[-1]["total_s"])
        elif not args.no_sequential:
            sequential.append(sum(timed_comparison(engine, image, args.prompt, [m], args.budget,
                                                   args.new_tokens, pauses)["total_s"] for m in methods))
        if args.json:  # every repeat's raw runs as soon as they are measured: a run cut short keeps them
            Path(args.json).with_suffix(".partial.json").write_text(json.dumps(
                {"model": loaded.name, "methods": methods, "new_tokens": args.new_tokens, "repeats_done": rep + 1,
                 "paused_s": sum(b - a for a, b in pauses.stretches),
                 "runs": {"together": together, "alone": alone, "generate": generate, "plain": plain,
                          "each_alone": each, "sequential": sequential}}, indent=1, default=str))

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    def med_of(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    per_method = {}
    for m in methods:
        row = {"batched_policy_ms_per_token": med_of(t["methods"][m]["policy_ms_per_token"] for t in together),
               "batched_compress_ms": med_of(t["methods"][m]["compress_ms"] for t in together)}
        if each:
            for key in ("ttft_s", "tokens_per_s", "ms_per_token", "policy_ms_per_token", "speedup_vs_full"):
                row[f"alone_{key}"] = med_of(e["methods"][m][key] for e in each)
            speedups = [e["methods"][m]["speedup_vs_full"] for e in each if e["methods"][m]["speedup_vs_full"]]
            row["alone_speedup_range"] = [min(speedups), max(speedups)] if speedups else None  # repeat to repeat
            # greedy with end of text ignored: alone and batched must give the same tokens
            row["same_answer"] = all(e["methods"][m]["text"] == t["methods"][m]["text"]
                                     for e, t in zip(each, together))
        per_method[m] = row

    report = {**run_info(loaded.device), "model": loaded.name, "dtype": str(loaded.dtype), "methods": methods,
              "budget": args.budget, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "prompt_tokens": together[0]["prompt_tokens"],
              "image_tokens": int((inputs["input_ids"] == loaded.image_token_id).sum()),
              "together_tokens_per_s": med(together, "decode_tokens_per_s"),
              "full_alone_tokens_per_s": med(alone, "decode_tokens_per_s"),
              "generate_tokens_per_s": statistics.median(generate),
              "comparison_wall_s": med(together, "total_s"), "comparison_prefill_s": med(together, "prefill_s"),
              "sequential_wall_s": statistics.median(sequential) if sequential else None,
              "batch_forward_ms_per_step": med_of(t["batch"]["forward_ms_per_step"] for t in together if t["batch"]),
              "time_alone": args.time_alone, "per_method": per_method,
              "errors": together[-1]["errors"], "runs": {"together": together, "alone": alone, "each_alone": each, "plain": plain,
                                                        "generate": generate}}
    report["first_token"] = first_token_waits(together, alone, methods, reference)
    pauses.stop()
    report["paused_s"] = sum(b - a for a, b in pauses.stretches)  # left out of every time above
    report["pauses"] = len(pauses.stretches)
    report["whole_over_full_alone"] = report["comparison_wall_s"] / med(alone, "total_s")
    report["throughput_ratio"] = report["together_tokens_per_s"] / report["full_alone_tokens_per_s"]
    report["runner_over_generate"] = report["full_alone_tokens_per_s"] / report["generate_tokens_per_s"]
    # each repeat's efficiency from that repeat's own runner and plain-loop ratios (taken minutes apart at most)
    report["ceiling_batch"] = len(methods)
    report["plain_batch_1_tokens_per_s"] = med(plain, "batch_1_tokens_per_s")
    report["plain_batch_b_tokens_per_s"] = med(plain, "batch_b_tokens_per_s")
    report["ceiling"] = med(plain, "ceiling")
    efficiencies = [(t["decode_tokens_per_s"] / a["decode_tokens_per_s"]) / p["ceiling"]
                    for t, a, p in zip(together, alone, plain)]
    report["efficiency"] = statistics.median(efficiencies)
    report["efficiency_range"] = [min(efficiencies), max(efficiencies)]

    print(f"\n{loaded.name} on {report['machine']} ({loaded.dtype}, {torch.get_num_threads()} threads), "
          f"commit {report['commit']}, {report['date']}")
    print(f"{len(methods)} methods, budget {args.budget}, prompt {report['prompt_tokens']} tokens "
          f"({report['image_tokens']} image), "
          f"{args.new_tokens} new tokens each, median of {args.repeats}")
    print("| measure | value |\n|---|---|")
    print(f"| decode tok/s, all {len(methods)} methods as one batch (summed) | {report['together_tokens_per_s']:.1f} |")
    print(f"| decode tok/s, Full alone | {report['full_alone_tokens_per_s']:.1f} |")
    print(f"| **throughput ratio** (goal >= 3x) | **{report['throughput_ratio']:.2f}x** |")
    print(f"| plain transformers loop, decode tok/s at batch 1 / batch {len(methods)} | "
          f"{report['plain_batch_1_tokens_per_s']:.1f} / {report['plain_batch_b_tokens_per_s']:.1f} |")
    print(f"| **ceiling**: plain loop batch {len(methods)} / batch 1 | **{report['ceiling']:.2f}x** |")
    low, high = report["efficiency_range"]
    print(f"| **runner efficiency**: throughput ratio / ceiling (goal >= 90 %) | **{100 * report['efficiency']:.0f} %** "
          f"({100 * low:.0f}-{100 * high:.0f} % over the repeats) |")
    print(f"| whole comparison, request to last token | {report['comparison_wall_s']:.1f} s "
          f"(prefill {report['comparison_prefill_s']:.2f} s) |")
    waits = report["first_token"]
    print(f"| first token, Full alone | {waits['full_alone_s']:.2f} s |")
    for name, words in (("sharing", "the methods that share the prefill"), ("own_prefill", "the methods with a "
                                                                                           "prefill of their own")):
        if f"{name}_s" in waits:
            print(f"| first token, the last of {words} | {waits[f'{name}_s']:.2f} s "
                  f"({waits[f'{name}_over_full']:.2f}x Full alone's) |")
    print(f"| whole comparison / Full alone's whole run | {report['whole_over_full_alone']:.2f}x |")
    if sequential:
        print(f"| the same methods one after another | {report['sequential_wall_s']:.1f} s |")
    print(f"| plain model.generate decode tok/s | {report['generate_tokens_per_s']:.1f} |")
    if report["pauses"]:
        print(f"| the process stopped (left out of every time above; the engine's own prefill and step times "
              f"keep it) | {report['paused_s']:.1f} s in {report['pauses']} stretches |")
    print(f"| **Full through the runner / generate** (goal >= 0.95) | **{report['runner_over_generate']:.3f}** |")
    print_per_method(report, methods)
    if report["errors"]:
        print(f"errors: {report['errors']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


def print_per_method(report: dict, methods: list[str]) -> None:
    """Each method's own cost: its policy time in the batched run and, timed alone, its speed."""
    forward = report["batch_forward_ms_per_step"]
    print(f"\nBatched run: one forward of {forward:.1f} ms per token, shared by all {len(methods)} methods; "
          "each method's own policy time per token beside it." if forward else "")
    rows = report["per_method"]

    def f(v, spec):
        return "–" if v is None else format(v, spec)

    if report["time_alone"]:
        print("Alone: each method decoded on its own from its own prefill (median of the repeats).\n")
        print("| method | policy ms/token (batched) | compress ms (batched) | TTFT alone ms | tok/s alone | "
              "ms/token alone | speed-up vs Full (alone) | lowest-highest of the repeats | same answer |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for m in methods:
            r = rows[m]
            ttft = None if r["alone_ttft_s"] is None else 1000 * r["alone_ttft_s"]
            spread = r["alone_speedup_range"]
            spread = "–" if spread is None else f"{spread[0]:.2f}-{spread[1]:.2f}x"
            print(f"| {m} | {f(r['batched_policy_ms_per_token'], '.2f')} | {f(r['batched_compress_ms'], '.1f')} | "
                  f"{f(ttft, '.0f')} | {f(r['alone_tokens_per_s'], '.2f')} | {f(r['alone_ms_per_token'], '.1f')} | "
                  f"{f(r['alone_speedup_vs_full'], '.2f')}x | {spread} | {'yes' if r['same_answer'] else 'NO'} |")
    else:
        print("| method | policy ms/token (batched) | compress ms (batched) |\n|---|---|---|")
        for m in methods:
            r = rows[m]
            print(f"| {m} | {f(r['batched_policy_ms_per_token'], '.2f')} | {f(r['batched_compress_ms'], '.1f')} |")


if __name__ == "__main__":
    sys.exit(main())
