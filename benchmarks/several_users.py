"""Several users at once: what the last of N users who send a comparison at the same moment waits, against one
user alone, when their turns share the model (each user's run on its own thread, as the app runs them: their
prefills take turns between steps, and their methods' rows decode together in one batched forward per step).

Measured side by side in one process, repeats interleaved (the machines are shared and noisy):

1. one user alone: request to last token (median over the repeats);
2. N users at once, each with another image and prompt: request to the last user's last token, and each user's own
   wait; the goal is the last user's wait within 1.6x of one user alone;
3. for reference, the same N requests one after another (what a server that runs one request at a time gives
   its last user);
4. whether every answer equals the same request alone (greedy, end of text ignored), how many batched steps held
   rows of several users, and the most rows one step held;
5. what bounds the last user's wait: the prefills are not batched (each user's runs between steps, one after
   another: N of them take N times one user's prefill), and the decode of N·M rows at once is only as much
   faster than N decodes of M rows as the hardware's batching allows (the ceiling: a plain cached greedy loop in
   transformers, no engine, at batch N·M over batch M, in tokens/s); and what batching the prefills could buy
   (the prefill ceiling: a plain transformers forward over N copies of one prompt at once against one copy, in
   prompts/s; N would be free batching). Users whose prompts have one length and layout (`--prompt`: one prompt
   on same-sized images) share their first-turn prefills' forward (`session/prefill_pool.py`);
   `--prefills-alone-too` also sends them at once with every prefill alone, interleaved, for what that buys.

    python benchmarks/several_users.py --model embedded --users 4 --methods full,snapkv,h2o,prefixkv
    python benchmarks/several_users.py --random-weights llava-interleave --threads 2 --users 4 --new-tokens 8
    python benchmarks/several_users.py --threads 2 --prompt "What color is the circle?" --prefills-alone-too
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import REPO_ROOT, run_info  # noqa: E402
from benchmarks.interactive import add_random_weights_arg, generation_inputs, load_benchmark_model  # noqa: E402
from benchmarks.interactive import plain_decode_tokens_per_s  # noqa: E402
from prefixkv_core import Engine, GenerationSettings, resolve_methods  # noqa: E402
from prefixkv_core.decoding.runner import now  # noqa: E402
from prefixkv_core.limits import peak_memory_bytes, process_memory_bytes  # noqa: E402
from prefixkv_core.method_args import add_model_args  # noqa: E402
from prefixkv_core.models import encode, format_prompt  # noqa: E402

PROMPTS = ["Describe the image in detail.", "What objects are in the picture?", "Which colours do you see?",
           "Where is the largest shape?", "How many things are there?", "Is anything on the left?",
           "What stands in the middle?", "Name the smallest object."]


def user_requests(n: int, prompt: str | None = None) -> list[tuple]:
    """N different requests: another scene image for each user, and another prompt (or `prompt` for all)."""
    images = sorted((REPO_ROOT / "assets/images").glob("scene-*.png"))
    return [(Engine.load_image(str(images[i % len(images)])), prompt or PROMPTS[i % len(PROMPTS)]) for i in range(n)]


def new_user_session(engine: Engine, request: tuple, methods: list[str], budget: float, new_tokens: int):
    image, prompt = request
    return engine.new_session(image, prompt, methods, budget,
                              GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True))


def run_user(engine: Engine, session, t0: float, out: dict) -> None:
    """One user's comparison (its session made), timed from `t0` (the moment every user sent theirs)."""
    for _ in session.run():
        pass
    out["wall_s"] = now(engine.loaded.device) - t0
    out["prefill_s"] = session.prefill.prefill_s
    out["texts"] = {m: r["text"] for m, r in session.results().items()}


def at_once(engine: Engine, requests: list[tuple], methods: list[str], budget: float, new_tokens: int) -> dict:
    """Every request sent at the same moment, each on its own thread."""
    pool = engine.pool
    shared_before, formed_before, steps_before = pool.shared_steps, pool.formed, pool.steps
    prefills_before = dict(engine.prefills.forwards)
    pool.largest_batch = 0
    outs = [{} for _ in requests]
    t0 = now(engine.loaded.device)
    # every user's request arrives now: the sessions are made at once (as the app makes each before running it)
    sessions = [new_user_session(engine, r, methods, budget, new_tokens) for r in requests]
    threads = [threading.Thread(target=run_user, args=(engine, session, t0, o)) for session, o in zip(sessions, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"last_s": max(o["wall_s"] for o in outs), "each_s": [o["wall_s"] for o in outs],
            "texts": [o["texts"] for o in outs], "shared_steps": pool.shared_steps - shared_before,
            "formed": pool.formed - formed_before, "steps": pool.steps - steps_before,
            "largest_batch": pool.largest_batch,
            "prefill_forwards": {rows: n - prefills_before.get(rows, 0) for rows, n in engine.prefills.forwards.items()
                                 if n > prefills_before.get(rows, 0)}}


def one_after_another(engine: Engine, requests: list[tuple], methods: list[str], budget: float,
                      new_tokens: int) -> dict:
    outs = [{} for _ in requests]
    t0 = now(engine.loaded.device)
    for r, o in zip(requests, outs):
        run_user(engine, new_user_session(engine, r, methods, budget, new_tokens), t0, o)
    return {"last_s": outs[-1]["wall_s"], "each_s": [o["wall_s"] for o in outs], "texts": [o["texts"] for o in outs],
            "prefill_s": [o["prefill_s"] for o in outs]}


def plain_prefill_prompts_per_s(loaded, inputs, batch: int) -> float:
    """Prompts/s of a plain transformers prefill (the model's own attention, no engine) over `batch` copies of one
    prompt in one forward: no padding, the best case for batching the prefills of users who arrive together. The
    model gets what `generate` would (`generation_inputs`: Qwen-VL's token types, so its M-RoPE positions)."""
    batched = {k: v.repeat(batch, *[1] * (v.dim() - 1)) if torch.is_tensor(v) else v
               for k, v in generation_inputs(loaded, inputs).items()}
    with torch.inference_mode():
        t0 = now(loaded.device)
        loaded.model(**batched, use_cache=False, logits_to_keep=1)
        return batch / (now(loaded.device) - t0)


def hardware_bound_s(users: int, prefill_s: float, alone_s: float, prefill_ceiling: float, ceiling: float) -> float:
    """The least the last of `users` simultaneous users can wait on this hardware, whatever the scheduling: every
    prefill batched at the prefill ceiling (users prompts cost users / prefill_ceiling prefills), then one decode of
    every user's rows at the decode ceiling (users / ceiling times one user's decode, alone_s - prefill_s). A
    ceiling below 1 (batching slower than taking turns) counts as 1: a scheduler could take turns instead."""
    return (users * prefill_s / max(1.0, prefill_ceiling)
            + (alone_s - prefill_s) * users / max(1.0, ceiling))


def phase(name: str) -> None:
    """Progress on stderr, with the resident memory so far."""
    print(f"{name} done; resident {process_memory_bytes() / 2**30:.2f} GiB", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_random_weights_arg(ap)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--methods", default="full,snapkv,h2o,prefixkv")
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats; medians are reported")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--prompt", default=None,
                    help="every user asks this (default: another prompt each); one prompt on same-sized images "
                         "lets the users' first-turn prefills share a forward")
    ap.add_argument("--prefills-alone-too", action="store_true",
                    help="each repeat also sends the users at once with every prefill alone (no shared prefill "
                         "forward), interleaved: what sharing the prefills buys")
    ap.add_argument("--json", default=None, help="write every number here")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    loaded = load_benchmark_model(args)
    engine = Engine(loaded)
    methods = resolve_methods(args.methods)
    requests = user_requests(args.users, args.prompt)
    at_once(engine, requests[:2], methods, args.budget, 2)  # warm-up

    image, prompt = requests[0]
    inputs = encode(loaded, image, format_prompt(loaded, prompt, with_image=True))
    alone, together, unshared, serial, ceilings, prefill_ceilings = [], [], [], [], [], []
    for _ in tqdm(range(args.repeats), desc="interleaved repeats"):
        alone.append(one_after_another(engine, requests[:1], methods, args.budget, args.new_tokens))
        phase("one user alone")
        together.append(at_once(engine, requests, methods, args.budget, args.new_tokens))
        phase(f"{args.users} users at once")
        if args.prefills_alone_too:
            engine.prefills.batchable = False
            try:
                unshared.append(at_once(engine, requests, methods, args.budget, args.new_tokens))
            finally:
                engine.prefills.batchable = True
            phase(f"{args.users} users at once, every prefill alone")
        serial.append(one_after_another(engine, requests, methods, args.budget, args.new_tokens))
        phase("one after another")
        rows = len(methods)
        ceilings.append(plain_decode_tokens_per_s(loaded, inputs, args.new_tokens, rows * args.users)
                        / plain_decode_tokens_per_s(loaded, inputs, args.new_tokens, rows))
        prefill_ceilings.append(plain_prefill_prompts_per_s(loaded, inputs, args.users)
                                / plain_prefill_prompts_per_s(loaded, inputs, 1))

    alone_s = statistics.median(a["last_s"] for a in alone)
    last_s = statistics.median(t["last_s"] for t in together)
    serial_s = statistics.median(s["last_s"] for s in serial)
    same = all(t["texts"] == s["texts"] for t, s in zip(together, serial)) and \
        all(u["texts"] == s["texts"] for u, s in zip(unshared, serial))
    prefill_s = statistics.median(a["prefill_s"][0] for a in alone)
    ratios = [t["last_s"] / a["last_s"] for t, a in zip(together, alone)]
    ceiling, prefill_ceiling = statistics.median(ceilings), statistics.median(prefill_ceilings)
    report = {**run_info(loaded.device), "model": loaded.name, "dtype": str(loaded.dtype), "users": args.users,
              "methods": methods, "budget": args.budget, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "one_user_s": alone_s, "last_of_n_at_once_s": last_s,
              "last_over_one": last_s / alone_s, "last_over_one_range": [min(ratios), max(ratios)],
              "one_after_another_last_s": serial_s, "one_after_another_over_one": serial_s / alone_s,
              "same_answers_as_alone": same, "shared_steps": [t["shared_steps"] for t in together],
              "formed": [t["formed"] for t in together], "steps": [t["steps"] for t in together],
              "largest_batch": max(t["largest_batch"] for t in together),
              "one_prefill_s": prefill_s, "prefills_over_one": args.users * prefill_s / alone_s,
              "ceiling": ceiling, "prefill_ceiling": prefill_ceiling,
              "hardware_bound_s": hardware_bound_s(args.users, prefill_s, alone_s, prefill_ceiling, ceiling),
              "peak_rss_bytes": peak_memory_bytes(),
              "prefill_forwards": [t["prefill_forwards"] for t in together],
              "runs": {"alone": alone, "together": together, "one_after_another": serial,
                       "together_prefills_alone": unshared}}
    if unshared:
        report["prefills_alone_last_s"] = statistics.median(t["last_s"] for t in unshared)
        report["shared_over_alone_prefills"] = [t["last_s"] / u["last_s"] for t, u in zip(together, unshared)]

    print(f"\n{loaded.name} on {report['machine']} ({loaded.dtype}, {report['threads']} threads), commit "
          f"{report['commit']}, {report['date']}")
    print(f"{args.users} users at once, each comparing {len(methods)} methods ({', '.join(methods)}), budget "
          f"{args.budget}, {args.new_tokens} new tokens each, median of {args.repeats}")
    print("| measure | value |\n|---|---|")
    print(f"| one user alone, request to last token | {alone_s:.2f} s |")
    low, high = report["last_over_one_range"]
    print(f"| **{args.users} users at once: the last one's wait** (goal <= 1.6x) | **{last_s:.2f} s = "
          f"{report['last_over_one']:.2f}x** ({low:.2f}-{high:.2f}x over the repeats) |")
    print(f"| the same requests one after another: the last one's wait | {serial_s:.2f} s = "
          f"{report['one_after_another_over_one']:.2f}x |")
    print(f"| every answer equal to the same request alone | {'yes' if same else 'NO'} |")
    print(f"| first-turn prefills: forwards holding k users' prompts (per repeat, k: forwards) | "
          f"{'; '.join(', '.join(f'{k}: {n}' for k, n in sorted(f.items())) for f in report['prefill_forwards'])} |")
    if unshared:
        shares = report["shared_over_alone_prefills"]
        print(f"| the same at once with every prefill alone: the last one's wait; shared over alone (per repeat) | "
              f"{report['prefills_alone_last_s']:.2f} s; {statistics.median(shares):.2f}x "
              f"({min(shares):.2f}-{max(shares):.2f}x) |")
    print(f"| batched steps holding several users' rows (per repeat) | {report['shared_steps']} |")
    print(f"| most rows in one step | {report['largest_batch']} |")
    print(f"| steps that formed the shared stores anew, of all batched steps (per repeat) | "
          f"{', '.join(f'{f} of {n}' for f, n in zip(report['formed'], report['steps']))} |")
    print(f"| one user's prefill; {args.users} prefills one after another (not batched) | {prefill_s:.2f} s; "
          f"{report['prefills_over_one']:.2f}x one user's wait |")
    print(f"| ceiling: plain transformers decode tok/s at batch {len(methods) * args.users} / batch {len(methods)} "
          f"(x{args.users} would be free batching) | {report['ceiling']:.2f}x |")
    print(f"| prefill ceiling: plain transformers prompts/s, {args.users} copies of one prompt in one forward / one "
          f"(x{args.users} would be free batching) | {report['prefill_ceiling']:.2f}x |")
    bound = report["hardware_bound_s"]
    print(f"| the least the last user can wait here: {args.users} prefills batched at the prefill ceiling, then one "
          f"decode of {len(methods) * args.users} rows at the decode ceiling | {bound:.2f} s = {bound / alone_s:.2f}x |")
    print(f"| the process's peak resident memory (model included) | {report['peak_rss_bytes'] / 2**30:.2f} GiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
