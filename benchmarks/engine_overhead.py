"""What the engine itself costs, measured side by side in one run on one model:

1. decode tokens/s of the uncompressed reference (Full, the method whose policy plays the "reference" role)
   through the engine divided by plain `model.generate` (goal >= 0.95);
2. prefill time with importance capture divided by prefill without it (goal: at most 10% more);
3. for each method at one budget on a long prompt (>= 2,000 tokens), each run on its own: KV bytes / the
   uncompressed KV bytes and decode speed relative to the reference.

The method, budget and knob flags are the CLI's (`prefixkv_core.method_args`).

    python benchmarks/engine_overhead.py --model embedded --prompt-tokens 2000 --new-tokens 32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from prefixkv_core import Engine, GenerationSettings, load_model  # noqa: E402
from prefixkv_core.kv.attention import AttentionProbe, StatRequest, tracked_attention_enabled  # noqa: E402
from prefixkv_core.kv.cache import TrackedCache  # noqa: E402
from prefixkv_core.models import encode, format_prompt  # noqa: E402
from prefixkv_core.models.families import uses_mrope  # noqa: E402
from prefixkv_core.method_args import MethodArgError, add_method_args, add_model_args, method_args  # noqa: E402
from prefixkv_core.decoding.runner import sync  # noqa: E402

FILLER = ("The museum's east wing holds maps, letters and instruments from early voyages; each room is lit "
          "softly and every label gives the date, the maker and the place where the object was found. ")


def long_prompt(loaded, target_tokens: int) -> str:
    """A question after enough filler text that prompt + image reach about `target_tokens`."""
    tok = loaded.tokenizer
    per = len(tok(FILLER, add_special_tokens=False)["input_ids"])
    repeats = max(1, (target_tokens - loaded.image_seq_length - 40) // per)
    return FILLER * repeats + "\nDescribe the image and summarise the text above."


def generation_inputs(loaded, inputs: dict) -> dict:
    """The prompt's tensors as transformers' `generate` takes them from the processor: `encode`'s output plus, for a
    model with 3-D rotary positions (Qwen-VL), the token types `mm_token_type_ids` (1 image, 2 video, 0 text) that
    the processor returns and `encode` leaves out; with them (and `image_grid_thw`) the model computes its M-RoPE
    positions, without them it would run the prompt at 1-D text positions."""
    config = loaded.model.config
    if not uses_mrope(config) or "mm_token_type_ids" in inputs:
        return dict(inputs)
    ids = inputs["input_ids"]
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == int(config.image_token_id)] = 1
    if getattr(config, "video_token_id", None) is not None:
        types[ids == int(config.video_token_id)] = 2
    return {**inputs, "mm_token_type_ids": types}


def time_generate(loaded, inputs, new_tokens: int, pauses=None) -> float:
    """Decode tokens/s of plain model.generate: a stopping criterion stamps the time after every step, so the
    prefill is left out exactly (no subtraction of two noisy runs). `pauses` (`common.Pauses`): the stretches in
    which the process was stopped are left out. The prompt's tensors are given as the processor gives them
    (`generation_inputs`: Qwen-VL's token types, so its 3-D positions)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    inputs = generation_inputs(loaded, inputs)

    class Stamps(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            sync(loaded.device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    stamps = Stamps()
    with torch.inference_mode():
        loaded.model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              stopping_criteria=StoppingCriteriaList([stamps]))
    # stamp 0 follows the prefill (first token); each later stamp follows one decode step
    elapsed = stamps.times[-1] - stamps.times[0]
    if pauses is not None:
        elapsed = pauses.active(stamps.times[0], stamps.times[-1])
    return (len(stamps.times) - 1) / max(elapsed, 1e-9)


def time_engine(engine, image, prompt, methods, budget, new_tokens, knobs=None, **modes) -> dict:
    """method -> its last event, the methods decoded together for `new_tokens` tokens each (EOS ignored).
    `modes`: budget_mode / query_agnostic of `Engine.new_session`."""
    gen = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
    session = engine.new_session(image, prompt, methods, budget, gen, knobs, **modes)
    last = {}
    for ev in session.run():
        if getattr(ev, "kind", None) in ("done", "error"):
            last[ev.method] = ev
    return last


def prefill_times(engine, loaded, inputs, repeats: int) -> tuple[float, float]:
    """Median prefill forward with and without the importance statistics (colsum + window)."""
    ids = inputs["input_ids"]
    flags = ids == loaded.image_token_id
    out = {}
    with tracked_attention_enabled(loaded.model):
        for label, req in (("plain", StatRequest()), ("capture", StatRequest(colsum=True, window=8))):
            times = []
            for _ in range(repeats):
                cache = TrackedCache(loaded.num_layers)
                sync(loaded.device)
                t0 = time.perf_counter()
                engine.forward(cache, ids, 0, AttentionProbe(req), flags, inputs.get("pixel_values"))
                sync(loaded.device)
                times.append(time.perf_counter() - t0)
            out[label] = statistics.median(times)
    return out["plain"], out["capture"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--image", default=str(Path(__file__).resolve().parent.parent / "assets/images/scene-0.png"))
    ap.add_argument("--prompt-tokens", type=int, default=2000, help="long-prompt length for part 3")
    ap.add_argument("--short-prompt", default="Describe the image in detail.", help="prompt for parts 1-2")
    ap.add_argument("--new-tokens", type=int, default=32)
    add_method_args(ap, budget_default=0.2,
                    methods_help="'all' or a comma-separated list for part 3; the reference (Full) is always added "
                                 "(the others' speed is relative to it)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write every number here")
    args = ap.parse_args(argv)
    try:
        chosen = method_args(args, with_reference=True)
    except MethodArgError as exc:
        raise SystemExit(str(exc)) from None
    reference = chosen.reference  # the uncompressed method the others are measured against
    modes = {"budget_mode": chosen.budget_mode, "query_agnostic": chosen.query_agnostic}

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(loaded)
    image = Engine.load_image(args.image)
    report = {"model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype),
              "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d")}

    # 1. engine vs generate, both on the short prompt, interleaved repeats
    inputs = encode(loaded, image, format_prompt(loaded, args.short_prompt, with_image=True))
    gen_tps, eng_tps = [], []
    for _ in tqdm(range(args.repeats), desc="engine vs generate"):
        gen_tps.append(time_generate(loaded, inputs, args.new_tokens))
        ev = time_engine(engine, image, args.short_prompt, [reference], 1.0, args.new_tokens)[reference]
        eng_tps.append(ev.tokens_per_s)
    report["generate_tokens_per_s"] = statistics.median(gen_tps)
    report["engine_full_tokens_per_s"] = statistics.median(eng_tps)
    report["engine_over_generate"] = report["engine_full_tokens_per_s"] / report["generate_tokens_per_s"]

    # 2. prefill overhead of importance capture, on the long prompt
    prompt = long_prompt(loaded, args.prompt_tokens)
    long_inputs = encode(loaded, image, format_prompt(loaded, prompt, with_image=True))
    report["long_prompt_tokens"] = int(long_inputs["input_ids"].shape[1])
    plain, capture = prefill_times(engine, loaded, long_inputs, args.repeats)
    report["prefill_plain_s"], report["prefill_capture_s"] = plain, capture
    report["prefill_capture_overhead"] = capture / plain - 1.0

    # 3. every method at the budget on the long prompt
    # each method on its own, so its decode speed is its own (together they would share one batched forward)
    last = {}
    for method in tqdm(chosen.methods, desc="methods one at a time"):
        last.update(time_engine(engine, image, prompt, [method], chosen.budget, args.new_tokens,
                                chosen.knobs, **modes))
    full = last[reference]
    rows = {}
    for name, ev in last.items():
        rows[name] = {"kv_ratio": ev.kv_bytes / ev.full_kv_bytes, "tokens_per_s": ev.tokens_per_s,
                      "speed_vs_full": (ev.tokens_per_s or 0) / full.tokens_per_s, "ttft_s": ev.ttft_s,
                      "error": ev.error}
    report["methods"] = rows

    print(f"\nmodel {loaded.name} on {loaded.device} ({loaded.dtype}), {torch.get_num_threads()} threads")
    print(f"decode: engine {reference} {report['engine_full_tokens_per_s']:.2f} tok/s vs generate "
          f"{report['generate_tokens_per_s']:.2f} tok/s -> ratio {report['engine_over_generate']:.3f} (goal >= 0.95)")
    print(f"prefill of {report['long_prompt_tokens']} tokens: plain {plain:.3f}s, with importance capture "
          f"{capture:.3f}s -> overhead {report['prefill_capture_overhead']:+.1%} (goal <= +10%)")
    print(f"\nbudget {chosen.budget} on a {report['long_prompt_tokens']}-token prompt, {args.new_tokens} new tokens:")
    print(f"| method | KV bytes / uncompressed | decode tok/s | speed vs {reference} | TTFT s |\n|---|---|---|---|---|")
    for name, r in rows.items():
        if r["error"]:
            print(f"| {name} | error: {r['error']} | | | |")
        else:
            print(f"| {name} | {r['kv_ratio']:.3f} | {r['tokens_per_s']:.2f} | {r['speed_vs_full']:.2f} | "
                  f"{r['ttft_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
