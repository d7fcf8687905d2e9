"""Speed and memory vs budget: decode throughput, time to first token, per-token latency, KV bytes and the real
peak memory of `full` and every method at budgets 0.2/0.4/0.6/0.8, for given prompt / generation lengths and
batch size, all measured in one run (warm-up first, CUDA synchronised around every timed region).

    python benchmarks/speed.py --model embedded --quick                        # CPU smoke run, ~3 minutes
    python benchmarks/speed.py --paper                                         # PrefixKV Table 3 setting:
        # random LLaVA-1.5-7B shapes, batch 16, 1024 + 512 and 624 + 256 tokens, bf16 on the GPU
    python benchmarks/speed.py --random-weights llava-1.5-13b --batch 8 --settings 1024x512

Prompts are synthetic and of exact length: BOS, the image block (random pixels), random text ids. Every
method decodes the whole batch in one forward per step through the engine's runner: methods whose per-layer
kept counts do not depend on the sample keep the prompts in one cache; Elastic Cache, ZipVL and online
PrefixKV keep a cache per prompt, padded and masked into the same forward (the `mode` column says which).
`full-stock` is the full cache through transformers' own DynamicCache and sdpa (no tracking): the
engine-free baseline. An out-of-memory configuration is reported as OOM, not as a crash. `--equal-memory`
also holds the prompt-only methods at r·N_t while decoding; `--query-agnostic`
compresses BOS + the image block first and then feeds the text (the question) through the compressed caches.
The tables, the figure and results.json say which modes produced them. `--ideal` also times transformers alone
(DynamicCache + sdpa) stepping a cache of each method's per-layer lengths: what those lengths can cost at best.
`--tensor-peak` (CPU) adds the most bytes each configuration's tensors held at once, from torch's profiler.
Outputs in --out: speed.md/.csv/.tex, results.json (every step time), speed.html (+ .png with Chromium).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.batched import STOCK, run_ideal, run_timed, sync, synthetic_batch  # noqa: E402
from benchmarks.common import (MODE_NOTES, QUERY_NOTES, REPO_ROOT, PeakRSS, Table, TensorPeak,  # noqa: E402
                               run_info, run_title, save_figure)
from prefixkv_core.method_args import add_knob_flags, add_method_args, add_model_args  # noqa: E402
from prefixkv_core.models import RANDOM_KINDS, LoadedModel, build_random_model  # noqa: E402

DEFAULT_BUDGETS = "0.2,0.4,0.6,0.8"
QUICK = {"settings": "512x32", "batch": 1, "warmup_steps": 2}
PAPER = {"random_weights": "llava-1.5-7b", "batch": 16, "settings": "1024x512,624x256",
         "methods": "full,local,h2o,snapkv,pyramidkv,lookm,prefixkv",
         # PrefixKV both ways: offline with the per-layer ratios its authors released (shared by every prompt, as
         # their Table 3 ran it) and online (the bisection on each prompt, a cache per prompt)
         "also": ["prefixkv.mode=online"]}
PAPER_SPEEDUP = 1.8  # PrefixKV Table 3: decode throughput at a 20% budget vs full, LLaVA-1.5-7B


def parse_settings(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower().replace("+", "x")
        try:
            p, g = item.split("x")
            out.append((int(p), int(g)))
        except ValueError:
            raise SystemExit(f"--settings expects PROMPTxGEN pairs such as 1024x512,624x256; got {item!r}") from None
        if out[-1][1] < 2:
            raise SystemExit("--settings: generation length must be at least 2 (one prefill token + one decode step)")
    return out


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_cap(device: torch.device, gib: float | None) -> str | None:
    """Cap what this process may allocate on a CUDA device (a smaller card's memory); the header's note, or None."""
    if gib is None:
        return None
    if device.type != "cuda":
        return f"--memory-cap-gib {gib:g} has no effect on {device.type}: the cap is CUDA's allocator's."
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return f"Memory capped at {gib:g} GiB ({fraction:.0%} of this card's {total / 2**30:.0f} GiB)."


def variant_rows(items: list[str]) -> dict[str, tuple[str, dict]]:
    """--also's rows: METHOD.KNOB=VALUE -> {"METHOD[KNOB=VALUE]": (METHOD, {KNOB: VALUE})}."""
    from prefixkv_core.policies import REGISTRY, parse_knobs

    out = {}
    for item in items:
        try:
            (method, knobs), = parse_knobs([item]).items()
        except ValueError as exc:
            raise SystemExit(f"--also: {exc}") from None
        if method not in REGISTRY:
            raise SystemExit(f"--also: unknown method {method!r}")
        out[f"{method}[{', '.join(f'{k}={v}' for k, v in knobs.items())}]"] = (method, knobs)
    return out


def measure(sm: LoadedModel, method: str, budget: float, knobs: dict, batch_inputs, gen_len: int,
            warmup_steps: int, budget_mode: str = "published", query_agnostic: bool = False,
            ideal_too: bool = False, tensor_peak: bool = False) -> dict[str, Any]:
    """Warm up, then time one configuration: the whole batch through the runner. `ideal_too`: then time
    transformers alone stepping a cache of the per-layer lengths the method kept after its prefill (its first
    prompt's), grown by one entry a step (`batched.IdealRun`). `tensor_peak` (CPU): then run it once more, untimed,
    for the most bytes its tensors held at once (`TensorPeak`)."""
    ids, is_image, pixels = batch_inputs
    b = ids.shape[0]
    run_timed(sm, method, budget, knobs, ids, is_image, pixels, max(2, warmup_steps + 1), budget_mode,
              query_agnostic)
    free_memory(sm.device)
    sync(sm.device)
    if sm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(sm.device)
        base = torch.cuda.memory_allocated(sm.device)
    rss = PeakRSS() if sm.device.type != "cuda" else None
    if rss:
        rss.__enter__()
    try:
        result = run_timed(sm, method, budget, knobs, ids, is_image, pixels, gen_len, budget_mode, query_agnostic)
    finally:
        if rss:
            rss.__exit__(None, None, None)
    if sm.device.type == "cuda":
        peak, peak_over = torch.cuda.max_memory_allocated(sm.device), torch.cuda.max_memory_allocated(sm.device) - base
        peak_kind = "torch.cuda.max_memory_allocated"
    else:
        peak, peak_over = rss.peak, rss.peak - rss.start
        peak_kind = rss.method
    steps = result["step_s"]
    decode_s = sum(steps)
    ideal = None
    if ideal_too and method != STOCK:  # transformers alone on a cache of the lengths this method kept
        lengths = result["kept_after_prefill"]
        run_ideal(sm, lengths, ids, max(2, warmup_steps + 1))
        timed = run_ideal(sm, lengths, ids, gen_len)["step_s"]
        ideal = b * (gen_len - 1) / sum(timed) if sum(timed) > 0 else None
    tensors_over = None
    if tensor_peak and sm.device.type != "cuda":
        free_memory(sm.device)
        with TensorPeak() as held:
            run_timed(sm, method, budget, knobs, ids, is_image, pixels, gen_len, budget_mode, query_agnostic)
        tensors_over = held.peak_over
    ttft = result["ttft_s"]
    new_tokens = b * (gen_len - 1)
    kv = result["kv_bytes"]
    full_kv = sm.kv_bytes_per_token() * result["true_len"] * b
    mode = "batch 1" if b == 1 else f"batched x{b}" + ("" if method == STOCK else f", {result['cache_mode']}")
    return {
        "status": "ok", "mode": mode, "ttft_s": ttft,
        "decode_s": decode_s, "decode_tokens_per_s": new_tokens / decode_s if decode_s > 0 else None,
        "e2e_tokens_per_s": b * gen_len / (ttft + decode_s),
        "ms_per_token": 1000 * statistics.mean(steps) if steps else None,
        "ms_per_token_p50": 1000 * statistics.median(steps) if steps else None,
        "ms_per_token_p90": 1000 * sorted(steps)[int(0.9 * (len(steps) - 1))] if steps else None,
        "kv_bytes": kv, "full_kv_bytes": full_kv, "kv_pct": 100.0 * kv / full_kv if full_kv else None,
        "kept_per_layer": result["kept_per_layer"], "kept_after_prefill": result["kept_after_prefill"], "peak_bytes": peak, "peak_over_start_bytes": peak_over,
        "peak_kind": peak_kind, "step_s": steps, "extras": result["extras"], "ideal_tokens_per_s": ideal,
        "tensor_peak_over_bytes": tensors_over,
    }


def build_parser() -> argparse.ArgumentParser:
    from prefixkv_core.policies import METHODS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Examples:\n  python benchmarks/speed.py --model embedded --quick\n"
                                       "  python benchmarks/speed.py --paper --device cuda\n"
                                       "  python benchmarks/speed.py --random-weights embedded --batch 4 "
                                       "--settings 1024x64 --methods full,local,prefixkv\n"
                                       f"Methods: {', '.join(METHODS)} (+ {STOCK}, added unless --no-stock).")
    # no default here: --paper takes random LLaVA-1.5-7B weights unless --model is given
    add_model_args(p, default_model=None, model_help="'embedded' (default), 'tiny-llama', a local model dir or a hub id")
    p.add_argument("--random-weights", default=None, choices=RANDOM_KINDS,
                   help="build a randomly initialised model with these exact shapes instead of loading one "
                        "(llava-1.5-7b / llava-1.5-13b: CLIP ViT-L/14-336 + Llama-2; a family's example checkpoint: "
                        "llava-1.5, llava-interleave (the Space default, llava-interleave-qwen-0.5b), llava-next, "
                        "llava-onevision; tiny-<family> and embedded / tiny for CPU)")
    p.add_argument("--no-stock", action="store_true", help=f"leave out the {STOCK} baseline")
    add_method_args(p, several_budgets=True, methods_default=None, methods_help="'all' (default) or a comma-separated list",
                    budget_default=DEFAULT_BUDGETS,
                    query_agnostic_help="compress BOS + the image block first, then feed the prompt's text (the "
                                        "question) through the compressed caches; TTFT includes that feed (default: "
                                        "compress the whole prompt)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens, image block included (default 1024)")
    p.add_argument("--gen-len", type=int, default=512, help="generated tokens per prompt (default 512)")
    p.add_argument("--settings", default=None,
                   help="several PROMPTxGEN settings, e.g. 1024x512,624x256 (overrides --prompt-len/--gen-len)")
    p.add_argument("--batch", type=int, default=None, help="prompts per batch (default 1; --paper 16)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed decode steps after an untimed prefill before each configuration (default 4)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every configuration N times, round-robin, and keep the median decode run")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run for CPU: 512-token prompt, 32 new tokens, batch 1, 2 warm-up steps")
    p.add_argument("--paper", action="store_true",
                   help="PrefixKV Table 3: random LLaVA-1.5-7B shapes, batch 16, settings 1024x512 and 624x256, "
                        "the methods of the paper's table (explicit options override)")
    add_knob_flags(p)  # --prefixkv-mode: a knob a policy lets the benchmarks set as a flag of its own
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and random weights")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None,
                   help="output folder (default out/benchmarks/speed-<model>[-quick][-paper][-equal-memory]"
                        "[-query-agnostic])")
    p.add_argument("--no-png", action="store_true", help="HTML figure only")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--also", action="append", default=[], metavar="METHOD.KNOB=VALUE",
                   help="one more row of METHOD with this knob set (repeatable), e.g. prefixkv.mode=online beside "
                        "the prefixkv row; its label is METHOD[KNOB=VALUE]")
    p.add_argument("--memory-cap-gib", type=float, default=None,
                   help="on CUDA: let this process allocate at most this many GiB (torch.cuda."
                        "set_per_process_memory_fraction), e.g. 40 for the A100 40 GB of PrefixKV's Table 3")
    p.add_argument("--tensor-peak", action="store_true",
                   help="on the CPU, also run each configuration once more, untimed, under torch's profiler: the most "
                        "bytes its tensors held at once above the start ('tensors +MiB', and 'x full's'), which the "
                        "resident set cannot tell apart from one configuration to the next")
    p.add_argument("--ideal", action="store_true",
                   help="also time transformers alone (DynamicCache + sdpa) stepping a cache of each method's "
                        "per-layer lengths: the columns 'ideal tok/s', 'x ideal' (the method against it) and "
                        f"'ideal x stock' (what those lengths buy over {STOCK})")
    return p


def load_speed_model(args) -> LoadedModel:
    from prefixkv_core.models import load_model, resolve_device, resolve_dtype

    if args.random_weights:
        dev, _ = resolve_device(args.device)
        return build_random_model(args.random_weights, dev, resolve_dtype(args.dtype, dev), seed=args.seed)
    return load_model(args.model or "embedded", device=args.device, dtype=args.dtype)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prefixkv_core.method_args import MethodArgError, flag_knob_values, method_args
    from prefixkv_core.policies import REGISTRY, PolicyError, ResolveContext, knob_value, make_policy, role_method

    if args.paper:
        if args.model is None and args.random_weights is None:
            args.random_weights = PAPER["random_weights"]
        args.batch = args.batch or PAPER["batch"]
        args.settings = args.settings or PAPER["settings"]
        args.methods = args.methods or PAPER["methods"]
        args.also = args.also or list(PAPER["also"])
    if args.quick:
        args.settings = args.settings or QUICK["settings"]
        args.batch = args.batch or QUICK["batch"]
        args.warmup_steps = QUICK["warmup_steps"] if args.warmup_steps is None else args.warmup_steps
    batch = args.batch or 1
    warmup = 4 if args.warmup_steps is None else args.warmup_steps
    if batch < 1 or args.repeats < 1 or warmup < 0:
        raise SystemExit("--batch and --repeats must be at least 1, --warmup-steps at least 0")
    settings = parse_settings(args.settings or f"{args.prompt_len}x{args.gen_len}")
    try:
        chosen = method_args(args)
    except MethodArgError as exc:
        raise SystemExit(str(exc)) from None
    budgets, methods, knobs_all = chosen.budgets, chosen.methods, chosen.knobs
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    budget_mode, query_agnostic = chosen.budget_mode, chosen.query_agnostic
    # the uncompressed reference (the "x full" column) and the method whose paper's speed claim is checked
    reference, featured = role_method("reference"), role_method("featured")
    mode_title = run_title(budget_mode, query_agnostic)

    t_load = time.perf_counter()
    sm = load_speed_model(args)
    cap_note = memory_cap(sm.device, args.memory_cap_gib)
    load_s = time.perf_counter() - t_load
    for p_len, g_len in settings:
        if sm.max_context and p_len + g_len > sm.max_context:
            raise SystemExit(f"setting {p_len}x{g_len} exceeds the model's context of {sm.max_context} tokens")
    info = run_info(sm.device)
    out = Path(args.out) if args.out else REPO_ROOT / "out" / "benchmarks" / (
        f"speed-{sm.slug}" + ("-quick" if args.quick else "") + ("-paper" if args.paper else "")
        + ("-equal-memory" if budget_mode == "equal_memory" else "") + ("-query-agnostic" if query_agnostic else ""))
    out.mkdir(parents=True, exist_ok=True)

    also = variant_rows(args.also)  # row label -> (method, its knobs)
    # configurations: (setting, row, budget); budget-free methods once per setting
    rows = ([STOCK] if not args.no_stock else []) + methods + list(also)

    def method_of(row: str) -> str:
        return also[row][0] if row in also else row

    configs = []
    for si, _ in enumerate(settings):
        for m in rows:
            uses = m != STOCK and REGISTRY[method_of(m)].uses_budget
            for b in (budgets if uses else [None]):
                configs.append((si, m, b))
    inputs = {si: synthetic_batch(sm, batch, p, seed=args.seed + si) for si, (p, _) in enumerate(settings)}
    flag_notes: dict[tuple[int, str, float | None], str] = {}  # what knob flags such as --prefixkv-mode chose
    knob_cache: dict[tuple[int, str, Any], dict] = {}

    def knobs_for(si: int, m: str, b: float | None) -> dict:
        """The method's knobs at this budget: --knob, then its flags (auto: its pick for the model and budget),
        then what its own resolve hook fills in (e.g. PrefixKV's calibrated ratios), as the app runs it."""
        key = (si, m, b)
        if key not in knob_cache:
            row, m = m, method_of(m)
            base = {**knobs_all.get(m, {}), **(also[row][1] if row in also else {})}
            context = ResolveContext(sm.slug, sm.name, sm.num_layers, 1.0 if b is None else b)
            try:
                flagged = flag_knob_values(args, m, base, context)
                if flagged:
                    base.update(flagged)
                    asked = make_policy(m, context.budget, **base)
                    resolved = asked.resolve(context)
                    filled = {k: knob_value(resolved, k) for k in REGISTRY[m].knobs()
                              if knob_value(resolved, k) != knob_value(asked, k)}
                    base.update(filled)
                    flag_notes[(si, row, b)] = ", ".join(f"{k} {v}" for k, v in flagged.items()) + (
                        f" ({', '.join(filled)} filled in for this model)" if filled else "")
            except (MethodArgError, PolicyError) as exc:
                raise SystemExit(str(exc)) from None
            knob_cache[key] = base
        return knob_cache[key]

    results: dict[tuple[int, str, Any], list[dict]] = {c: [] for c in configs}
    bar = tqdm(total=len(configs) * args.repeats, desc="configurations", disable=args.quiet, unit="cfg")
    for rep in range(args.repeats):
        for si, m, b in configs:
            p_len, g_len = settings[si]
            bar.set_postfix_str(f"{p_len}x{g_len} {m} {'' if b is None else b}")
            try:
                res = measure(sm, method_of(m), 1.0 if b is None else b, knobs_for(si, m, b) if m != STOCK else {},
                              inputs[si], g_len, warmup, budget_mode, query_agnostic, args.ideal, args.tensor_peak)
            except Exception as exc:  # noqa: BLE001 - OOM and per-method failures become table cells
                res = {"status": "OOM" if is_oom(exc) else "error", "error": f"{exc.__class__.__name__}: {exc}"[:300],
                       "mode": "batch 1" if batch == 1 else f"batched x{batch}"}
                if not args.quiet:
                    tqdm.write(f"{settings[si][0]}x{settings[si][1]} {m} {'' if b is None else b}: {res['status']} "
                               f"({res['error'][:160]})")
            if res["status"] != "ok":
                free_memory(sm.device)  # after the except block, so the traceback's tensors can go too
            results[(si, m, b)].append(res)
            bar.update(1)
    bar.close()

    def pick(runs: list[dict]) -> dict:
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            return runs[0]
        ok.sort(key=lambda r: r["decode_tokens_per_s"] or 0)
        return ok[len(ok) // 2]

    final = {c: pick(r) for c, r in results.items()}
    tables, claim_lines, raw = [], [], []
    for si, (p_len, g_len) in enumerate(settings):
        full = final.get((si, reference, None))
        full_tps = full.get("decode_tokens_per_s") if full and full["status"] == "ok" else None
        stock = final.get((si, STOCK, None))
        stock_tps = stock.get("decode_tokens_per_s") if stock and stock["status"] == "ok" else None
        cols = ["mode", "decode tok/s", "x full", "e2e tok/s", "TTFT ms", "ms/token", "p90 ms/token", "KV MiB",
                "KV % full", "peak MiB", "peak +MiB", "status"]
        if args.ideal:
            cols[3:3] = ["ideal tok/s", "x ideal", "ideal x stock"]
        if args.tensor_peak:
            cols[-1:-1] = ["tensors +MiB", "x full's"]
        t = Table(title=f"Speed and memory: {sm.name}, batch {batch}, prompt {p_len} + generate {g_len} tokens "
                        f"[{mode_title}]", row_header="method @ budget", rows=[], columns=cols, digits=2,
                  notes=[MODE_NOTES[budget_mode], QUERY_NOTES[query_agnostic]])
        for (sj, m, b), r in final.items():
            if sj != si:
                continue
            label = m if b is None else f"{m} @ {b:.1f}"
            t.rows.append(label)
            raw.append({"prompt_len": p_len, "gen_len": g_len, "batch": batch, "method": m, "budget": b,
                        **{k: v for k, v in r.items()},
                        "repeats": [x.get("decode_tokens_per_s") for x in results[(sj, m, b)]]})
            if r["status"] != "ok":
                t.values[(label, "status")] = r["status"]
                t.values[(label, "mode")] = r["mode"]
                continue
            tps = r["decode_tokens_per_s"]
            vals = {"mode": r["mode"], "decode tok/s": tps, "x full": tps / full_tps if full_tps else None,
                    "e2e tok/s": r["e2e_tokens_per_s"], "TTFT ms": 1000 * r["ttft_s"], "ms/token": r["ms_per_token"],
                    "p90 ms/token": r["ms_per_token_p90"], "KV MiB": r["kv_bytes"] / 2**20, "KV % full": r["kv_pct"],
                    "peak MiB": r["peak_bytes"] / 2**20, "peak +MiB": r["peak_over_start_bytes"] / 2**20,
                    "status": "ok"}
            ideal = r.get("ideal_tokens_per_s")
            if args.ideal and ideal:
                vals.update({"ideal tok/s": ideal, "x ideal": tps / ideal,
                             "ideal x stock": ideal / stock_tps if stock_tps else None})
            held, full_held = r.get("tensor_peak_over_bytes"), (full or {}).get("tensor_peak_over_bytes")
            if args.tensor_peak and held is not None:
                vals.update({"tensors +MiB": held / 2**20, "x full's": held / full_held if full_held else None})
            t.values.update({(label, c): v for c, v in vals.items()})
        if stock_tps and full_tps:
            t.notes.append(f"Engine overhead: full through the engine decodes at {full_tps / stock_tps:.2f}x the "
                           f"speed of {STOCK} (plain DynamicCache + sdpa).")
        for (sj, m, b), desc in flag_notes.items():
            if sj == si:
                t.notes.append(f"{REGISTRY[method_of(m)].label}" + (f" {m[m.index('['):]}" if m in also else "")
                               + (f" @ {b:.1f}" if b is not None else "") + f": {desc}.")
        tables.append(t)
        for row in [r for r in rows if method_of(r) == featured]:  # its default row, and any --also row of it
            pk = final.get((si, row, 0.2))
            if pk is None:
                continue
            named = "PrefixKV" + (row[row.index("["):] if row in also else "")
            if pk["status"] == "ok" and full_tps:
                ratio = pk["decode_tokens_per_s"] / full_tps
                e2e = pk["e2e_tokens_per_s"] / full["e2e_tokens_per_s"]
                claim_lines.append(
                    f"- {p_len}+{g_len}, batch {batch}: {named} @ 0.2 decodes at {ratio:.2f}x full "
                    f"({pk['decode_tokens_per_s']:.1f} vs {full_tps:.1f} tok/s; end to end {e2e:.2f}x) -> the paper's "
                    f"{PAPER_SPEEDUP}x {'HOLDS' if ratio >= PAPER_SPEEDUP else 'DOES NOT HOLD'} here "
                    f"({pk['mode']}).")
            else:
                claim_lines.append(f"- {p_len}+{g_len}, batch {batch}: {named} @ 0.2 {pk['status']}, full "
                                   f"{'ok' if full_tps else 'failed/OOM'}: no ratio.")
    header = [f"Model: {sm.name} ({sm.param_count() / 1e9:.2f} B parameters, {sm.num_layers} layers, "
              f"{str(sm.dtype).replace('torch.', '')}, {sm.device})" + (" - random weights" if sm.random_weights else ""),
              f"Machine: {info['machine']}; {info['date']}; commit {info['commit']}; torch {info['torch']}, "
              f"{info['torch_threads']} threads; model ready in {load_s:.0f} s.",
              f"Peak memory: {'torch.cuda.max_memory_allocated (weights included); +MiB = above the allocation before the configuration' if sm.device.type == 'cuda' else 'process peak RSS (weights included; kernel VmHWM reset per configuration where Linux allows it, else sampled); +MiB = above the RSS at the start of the configuration'}.",
              f"decode tok/s = batch x (generated - 1) / decode time (every step synchronised, policy time included); "
              f"e2e adds the prefill; warm-up {warmup} steps per configuration; repeats {args.repeats} (median).",
              f"Mode: {mode_title} (see each table's notes).", *([cap_note] if cap_note else []),
              f"Every method decodes its {batch} prompts in one forward per step (the runner); `mode` says whether they "
              "share one cache or keep one each." if batch > 1 else "Batch 1: every method runs alone."]
    claims = ["Claim (b): PrefixKV at a 20% budget decodes 1.8x faster than full (paper: LLaVA-1.5-7B, batch 16)."]
    claims += claim_lines or ["- not measured (needs prefixkv, full and budget 0.2)"]
    md = "\n".join(header) + "\n\n" + "\n".join(t.to_markdown() for t in tables) + "\n" + "\n".join(claims) + "\n"
    (out / "speed.md").write_text(md)
    for i, t in enumerate(tables):
        suffix = "" if len(tables) == 1 else f"-{settings[i][0]}x{settings[i][1]}"
        (out / f"speed{suffix}.csv").write_text(t.to_csv())
        (out / f"speed{suffix}.tex").write_text(t.to_latex())
    payload = {"run": info, "model": sm.name, "slug": sm.slug, "random_weights": sm.random_weights,
               "params": sm.param_count(), "dtype": str(sm.dtype), "device": str(sm.device), "batch": batch,
               "settings": settings, "budgets": budgets, "methods": rows, "budget_mode": budget_mode,
               "query_agnostic": query_agnostic,
               "warmup_steps": warmup,
               "repeats": args.repeats, "flag_knobs": {f"{m} {settings[s][0]}x{settings[s][1]}@{b}": d
                                                       for (s, m, b), d in flag_notes.items()},
               "header": header, "claims": claims, "results": raw, "model_notes": sm.notes}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    fig = make_figure(raw, settings, budgets, featured, f"Speed vs budget: {sm.name}, batch {batch}, {mode_title}")
    paths, png_msg = save_figure(fig, out / "speed", png=not args.no_png)
    if not args.quiet:
        print(md)
        print(png_msg)
    print(f"wrote {out}/speed.md, speed*.csv, speed*.tex, results.json, " + ", ".join(p.name for p in paths))
    return 0


def make_figure(raw: list[dict], settings, budgets, featured: str | None, title: str):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(settings), cols=3, subplot_titles=[
        f"{s[0]}+{s[1]}: {name}" for s in settings for name in ("decode tok/s", "KV MiB", "peak memory MiB")])
    from prefixkv_core.policies import method_colours

    colours = {**method_colours(), STOCK: "#7f7f7f"}  # each method's own colour; the stock baseline grey
    methods = list(dict.fromkeys(r["method"] for r in raw))
    xs = [float(b) for b in budgets]
    for si, (p_len, g_len) in enumerate(settings):
        for m in methods:
            rs = [r for r in raw if r["method"] == m and r["prompt_len"] == p_len and r["gen_len"] == g_len]
            if not rs:
                continue
            fixed = rs[0]["budget"] is None
            for col, key, scale in ((1, "decode_tokens_per_s", 1.0), (2, "kv_bytes", 2**-20), (3, "peak_bytes", 2**-20)):
                if fixed:
                    v = rs[0].get(key) if rs[0]["status"] == "ok" else None
                    ys = [v * scale if v is not None else None] * len(xs)
                else:
                    by_b = {r["budget"]: r for r in rs}
                    ys = [by_b[b][key] * scale if b in by_b and by_b[b]["status"] == "ok" else None for b in budgets]
                fig.add_trace(go.Scatter(x=xs, y=ys, name=m, legendgroup=m, showlegend=(si == 0 and col == 1),
                                         mode="lines" if fixed else "lines+markers",
                                         line=dict(color=colours.get(m.split("[")[0], "#999999"), dash="dash" if fixed else "solid",
                                                   width=3 if m == featured else 2)), row=si + 1, col=col)
    fig.update_xaxes(title_text="budget (kept fraction)")
    fig.update_layout(title=title, width=1400, height=420 * len(settings), template="plotly_white")
    return fig


if __name__ == "__main__":
    sys.exit(main())
