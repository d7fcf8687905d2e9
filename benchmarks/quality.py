"""Quality vs budget, the papers' protocol: for every method and budget, PPL of the reference answers fed
through the compressed cache (teacher forcing, compressing after every token as in generation) and ROUGE-L
F1 of the greedy output against the full-cache greedy output of the same model.

    python benchmarks/quality.py --model embedded --quick                 # 5 samples, 3 budgets: < 10 min on 2 CPU cores
    python benchmarks/quality.py --model llava-hf/llava-1.5-7b-hf --device cuda
    accelerate launch --multi_gpu --num_processes 4 benchmarks/quality.py --model ...  # data parallel, same tables
    accelerate launch --multi_gpu --num_processes 2 benchmarks/quality.py --device cpu ...  # 2 CPU processes (gloo)
    python benchmarks/quality.py --text builtin --context-tokens 1024 --continuation-tokens 64 --pairs 8

Text mode (--text FILE|builtin): long-context language modelling without an image. K pairs (a context of N
tokens, the M tokens that follow it) are cut from one plain text; the context is fed as plain text (no chat
template: the continuation is the text's own next tokens, not an assistant's reply) and the PPL is that of the
continuation teacher-forced through each compressed cache. ROUGE-L compares greedy continuations with Full's.
The built-in text is the Python Language Reference shipped with the interpreter (benchmarks/data.py).

Full (and every method that ignores the budget, e.g. ZipVL) runs once per sample and is reused for every
budget; Full's output is the ROUGE reference. Records are appended to <out>/records.rank<R>.jsonl after each
(sample, budget), so a crashed or interrupted run continues where it stopped when started again with the
same --out. Outputs in <out>: ppl / rouge_l / kv_kept tables (.md, .csv, .tex), results.json (every raw
number), claims.md (does PrefixKV beat Local, H2O, PyramidKV and Elastic at every budget?), leaderboard.csv
(kvpress's leaderboard layout: a row per method and compression ratio, a ROUGE-L column per task; see
prefixkv_core/report/leaderboard.py), quality.html (+ quality.png when Chromium is installed).

`--equal-memory` also holds the prompt-only methods at r·N_t while decoding, so
every budgeted method is compared at the same memory. `--query-agnostic` compresses the image and any text
before the question first, then feeds the question and decodes on the compressed cache (image prompts only:
the text mode has no question). The tables, the figure and results.json say which modes produced them, and
each mode's records go to their own folder.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (MODE_NOTES, QUERY_NOTES, REPO_ROOT, RecordStore, Table,  # noqa: E402
                               run_info, run_title, save_figure)
from prefixkv_core.method_args import (MethodArgError, MethodArgs, add_knob_flags, add_method_args,  # noqa: E402
                                       add_model_args, method_args, resolve_knob_flags)
from prefixkv_core.policies import REGISTRY, ResolveContext, role_method  # noqa: E402
from benchmarks.data import (DataError, LongText, Sample, cut_text_pairs, dataset_spec, load_dataset,  # noqa: E402
                             load_long_text, resolve_image)

DEFAULT_BUDGETS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
QUICK = {"limit": 5, "budgets": "0.1,0.3,0.5", "max_new_tokens": 12, "max_answer_tokens": 16}
# text mode: (context tokens, continuation tokens, pairs), full and --quick
TEXT_DEFAULTS = {"context_tokens": 1024, "continuation_tokens": 64, "pairs": 8}
TEXT_QUICK = {"context_tokens": 512, "continuation_tokens": 32, "pairs": 3}
FULL_DEFAULTS = {"limit": None, "budgets": DEFAULT_BUDGETS, "max_new_tokens": 64, "max_answer_tokens": 0}
# the method ROUGE-L is measured against, and the one whose paper's claim is checked (declared by their policies)
REFERENCE, FEATURED = role_method("reference"), role_method("featured")
# that paper's claim (a): its method beats these at every budget (declared by its policy)
CLAIM_BASELINES = REGISTRY[FEATURED].claimed_better_than if FEATURED is not None else ()


def budget_key(b: float | None) -> str:
    return "-" if b is None else f"{b:.2f}"


def record_key(r: dict[str, Any]) -> tuple[str, str, str]:
    return (r["sample"], r["method"], budget_key(r["budget"]))


# -- evaluation of one sample ------------------------------------------------------------------------------

class PlainTextPrompts:
    """The engine as the text mode uses it: every session feeds its prompt (a context cut from a long text) as
    plain text, without the chat template."""

    def __init__(self, engine):
        self.engine = engine
        self.loaded = engine.loaded

    def new_session(self, *args, **kwargs):
        return self.engine.new_session(*args, chat_template=False, **kwargs)


def truncate_answer(tokenizer, answer: str, max_tokens: int) -> str:
    """The first `max_tokens` tokens of the answer (0 = all), decoded back to text."""
    if max_tokens <= 0:
        return answer
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return answer if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def _run_group(engine, image, sample: Sample, answer: str, methods: list[str], budget: float | None,
               settings, knobs: dict, steps_bar=None) -> list[dict[str, Any]]:
    """One generation session and one teacher-forcing session for `methods` at `budget`."""
    from prefixkv_core import GenerationSettings
    from prefixkv_core.report.events import MethodEvent

    gen = GenerationSettings(max_new_tokens=settings["max_new_tokens"])
    session_budget = 1.0 if budget is None else budget
    budget_mode = settings.get("budget_mode", "published")
    query_agnostic = bool(settings.get("query_agnostic", False))
    out = {m: {"sample": sample.id, "method": m, "budget": budget, "text": "", "nll": None, "n_tokens": None,
               "error": None} for m in methods}
    try:
        session = engine.new_session(image, sample.question, methods, session_budget, gen, knobs,
                                     budget_mode=budget_mode, query_agnostic=query_agnostic)
        for ev in session.run():
            if steps_bar is not None and isinstance(ev, MethodEvent) and ev.kind in ("token", "done"):
                steps_bar.update(1)
        for m, res in session.results().items():
            out[m].update(text=res["text"], kv_bytes=res["kv_bytes"], full_kv_bytes=res["full_kv_bytes"],
                          kept_ratio=res["mean_kept_ratio"], full_len=res["full_len"],
                          prompt_tokens=session.prefill.prompt_tokens if session.prefill else None,
                          error=res["error"], extras=_small_extras(res.get("extras") or {}))
        scorer = engine.new_session(image, sample.question, methods, session_budget, gen, knobs,
                                    budget_mode=budget_mode, query_agnostic=query_agnostic)
        for m, (nll, n) in scorer.score_answer(answer).items():
            out[m].update(nll=nll, n_tokens=n)
            if steps_bar is not None:
                steps_bar.update(n)
        for m, st in scorer.states.items():
            if st.error and not out[m]["error"]:
                out[m]["error"] = f"scoring: {st.error}"
    except Exception as exc:  # one bad sample must not end a long run: record it and go on
        for r in out.values():
            r["error"] = r["error"] or f"{exc.__class__.__name__}: {exc}"
    return list(out.values())


def _small_extras(extras: dict[str, Any]) -> dict[str, Any]:
    keep = {}
    for k in ("mode", "threshold", "notes"):
        if k in extras:
            keep[k] = extras[k]
    return keep


def evaluate_sample(engine, sample: Sample, image_root: Path, methods: list[str], budgets: list[float],
                    settings: dict, knobs: dict, done: set, store: RecordStore | None = None,
                    steps_bar=None) -> list[dict[str, Any]]:
    """Every missing (sample, method, budget) record of this sample; budget-free methods once (budget None)."""
    from prefixkv_core.policies import REGISTRY

    fixed = [m for m in methods if not REGISTRY[m].uses_budget]
    varying = [m for m in methods if REGISTRY[m].uses_budget]
    groups: list[tuple[float | None, list[str]]] = [(None, [m for m in fixed if (sample.id, m, "-") not in done])]
    for b in budgets:
        groups.append((b, [m for m in varying if (sample.id, m, budget_key(b)) not in done]))
    groups = [(b, ms) for b, ms in groups if ms]
    if not groups:
        return []
    new: list[dict[str, Any]] = []
    try:
        image = resolve_image(sample.image, image_root)
    except DataError as exc:
        for b, ms in groups:
            new += [{"sample": sample.id, "method": m, "budget": b, "text": "", "nll": None, "n_tokens": None,
                     "error": str(exc)} for m in ms]
        if store is not None:
            store.append(new)
        return new
    answer = truncate_answer(engine.loaded.tokenizer, sample.answer, settings["max_answer_tokens"])
    for b, ms in groups:
        recs = _run_group(engine, image, sample, answer, ms, b, settings, knobs, steps_bar)
        if store is not None:
            store.append(recs)  # after every (sample, budget): a crash loses at most this group
        new += recs
    return new


# -- aggregation -------------------------------------------------------------------------------------------

def sample_task(sample: Sample, text_mode: bool = False) -> str:
    """The task a sample belongs to in the leaderboard export: its `kind` in the data file (the built-in set:
    scene-description, scene-qa-count, photo-qa, ...), `continuation` in the text mode, else `all`."""
    if text_mode:
        return "continuation"
    return str(sample.extra.get("kind") or "all")


def leaderboard_rows(records: list[dict[str, Any]], samples: list[Sample], methods: list[str], budgets: list[float],
                     *, dataset: str, data_dir: str, model: str, budget_mode: str, query_agnostic: bool,
                     knobs: dict, text_mode: bool = False) -> tuple[list, list[str]]:
    """The run in kvpress's leaderboard layout (prefixkv_core.report.leaderboard): one row per method and compression
    ratio (1 - r; Full 0; a budget-free method once, at its measured ratio), a ROUGE-L × 100 column per task.
    Returns (rows, tasks in first-seen order)."""
    from prefixkv_core.policies import held_in_equal_memory
    from prefixkv_core.report.leaderboard import LeaderboardRow, compression_ratio, method_name, task_score
    from prefixkv_core.report.metrics import rouge_l
    from prefixkv_core.policies import REGISTRY

    by_key = {record_key(r): r for r in records}
    tasks = list(dict.fromkeys(sample_task(s, text_mode) for s in samples))
    query_aware = not query_agnostic and not text_mode  # the text mode's prompts have no question
    rows = []
    for m in methods:
        fixed = not REGISTRY[m].uses_budget
        for b in ([None] if fixed else budgets):
            per_task: dict[str, list[float]] = {t: [] for t in tasks}
            shares = []
            for sample in samples:
                r = by_key.get((sample.id, m, budget_key(b)))
                ref = by_key.get((sample.id, REFERENCE, "-"))
                if r is None or r.get("error") or ref is None or ref.get("error"):
                    continue
                per_task[sample_task(sample, text_mode)].append(rouge_l(r.get("text", ""), ref.get("text", "")))
                if r.get("full_kv_bytes"):
                    shares.append(r["kv_bytes"] / r["full_kv_bytes"])
            if m == REFERENCE:
                ratio = 0.0
            else:
                ratio = compression_ratio(b, sum(shares) / len(shares) if shares else None)
            rows.append(LeaderboardRow(dataset, data_dir, model, method_name(
                m, query_aware=query_aware, held=held_in_equal_memory(m, budget_mode, knobs)), ratio,
                {t: task_score(v) for t, v in per_task.items()}))
    return rows, tasks


def aggregate(records: list[dict[str, Any]], sample_ids: list[str], methods: list[str],
              budgets: list[float]) -> dict[str, Any]:
    """Tables (method -> budget -> value) over `sample_ids` in that order, so every process count gives the
    same sums in the same order."""
    from prefixkv_core.report.metrics import perplexity, rouge_l
    from prefixkv_core.policies import REGISTRY

    by_key = {record_key(r): r for r in records}
    ppl: dict[str, dict[str, Any]] = {}
    rouge: dict[str, dict[str, Any]] = {}
    kept: dict[str, dict[str, Any]] = {}
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for m in methods:
        ppl[m], rouge[m], kept[m], counts[m] = {}, {}, {}, {}
        for b in budgets:
            bk = budget_key(b) if REGISTRY[m].uses_budget else "-"
            pairs, rls, kvs, errors, missing = [], [], [], 0, 0
            for sid in sample_ids:
                r = by_key.get((sid, m, bk))
                if r is None:
                    missing += 1
                    continue
                if r.get("error"):
                    errors += 1
                    continue
                if r.get("nll") is not None and r.get("n_tokens"):
                    pairs.append((float(r["nll"]), int(r["n_tokens"])))
                ref = by_key.get((sid, REFERENCE, "-"))
                if ref is not None and not ref.get("error"):
                    rls.append(rouge_l(r.get("text", ""), ref.get("text", "")))
                if r.get("full_kv_bytes"):
                    kvs.append(r["kv_bytes"] / r["full_kv_bytes"])
            col = budget_key(b)
            ppl[m][col] = perplexity(pairs) if pairs else ("ERR" if errors else None)
            rouge[m][col] = sum(rls) / len(rls) if rls else ("ERR" if errors else None)
            kept[m][col] = 100.0 * sum(kvs) / len(kvs) if kvs else ("ERR" if errors else None)
            counts[m][col] = {"samples": len(sample_ids) - missing - errors, "errors": errors, "missing": missing,
                              "answer_tokens": sum(n for _, n in pairs)}
    return {"ppl": ppl, "rouge_l": rouge, "kv_kept_pct": kept, "counts": counts}


def make_tables(agg: dict[str, Any], methods: list[str], budgets: list[float], note: str,
                budget_mode: str = "published", query_agnostic: bool = False) -> dict[str, Table]:
    cols = [budget_key(b) for b in budgets]
    specs = {
        "ppl": ("PPL of the reference answers (teacher forcing through the compressed cache; lower is better)",
                "min", 3),
        "rouge_l": ("ROUGE-L F1 of the greedy output vs Full's greedy output (higher is better)", "max", 3),
        "kv_kept": ("KV cache kept at the end of generation, % of Full's bytes (ZipVL: packed 4/2-bit)", None, 1),
    }
    source = {"ppl": agg["ppl"], "rouge_l": agg["rouge_l"], "kv_kept": agg["kv_kept_pct"]}
    tables = {}
    for name, (title, best, digits) in specs.items():
        t = Table(title=f"{title} [{run_title(budget_mode, query_agnostic)}]", row_header="method \\ budget",
                  rows=list(methods), columns=cols, digits=digits, best=best, exclude_from_best=(REFERENCE,),
                  notes=[note, MODE_NOTES[budget_mode], QUERY_NOTES[query_agnostic]])
        for m in methods:
            for c in cols:
                t.values[(m, c)] = source[name][m].get(c)
        errs = {m: sum(v["errors"] for v in agg["counts"][m].values()) for m in methods}
        bad = [f"{m} ({n})" for m, n in errs.items() if n]
        if bad:
            t.notes.append("Errored runs left out of the averages: " + ", ".join(bad) + "; see results.json.")
        tables[name] = t
    return tables


def check_claims(agg: dict[str, Any], methods: list[str], budgets: list[float]) -> list[str]:
    """Claim (a) of the featured method's paper (PrefixKV's), checked on this run: lower PPL and higher ROUGE-L
    than the methods its policy says it beats (Local, H2O, PyramidKV and Elastic Cache) at every budget, the gap
    widening as the budget shrinks."""
    base = [m for m in CLAIM_BASELINES if m in methods]
    if FEATURED not in methods or not base:
        return [f"Claim (a) not checked: needs {FEATURED} and at least one of " + ", ".join(CLAIM_BASELINES) + "."]
    me = REGISTRY[FEATURED].label
    lines = [f"Claim (a): {me} has lower PPL and higher ROUGE-L than {', '.join(base)} at every budget, "
             "with the gap widening as the budget shrinks.", ""]
    overall = True
    for metric, better in (("ppl", "lower"), ("rouge_l", "higher")):
        holds_at, fails_at, gaps = [], [], []
        for b in budgets:
            c = budget_key(b)
            p = agg[metric][FEATURED].get(c)
            others = {m: agg[metric][m].get(c) for m in base}
            others = {m: v for m, v in others.items() if isinstance(v, float)}
            if not isinstance(p, float) or not others:
                fails_at.append(f"{c} (no value)")
                continue
            if better == "lower":
                best_m = min(others, key=others.get)
                ok, gap = p < others[best_m], others[best_m] - p
            else:
                best_m = max(others, key=others.get)
                ok, gap = p > others[best_m], p - others[best_m]
            gaps.append((b, gap))
            (holds_at if ok else fails_at).append(c if ok else f"{c} ({best_m} {others[best_m]:.3f} vs "
                                                               f"{me} {p:.3f})")
        overall &= not fails_at
        name = "PPL" if metric == "ppl" else "ROUGE-L"
        lines.append(f"- {name}: {'HOLDS' if not fails_at else 'DOES NOT HOLD'} at every budget. "
                     f"Better at: {', '.join(holds_at) or 'none'}. Not better at: {', '.join(fails_at) or 'none'}.")
        if len(gaps) >= 2:
            lo, hi = gaps[0], gaps[-1]
            widening = lo[1] > hi[1] and lo[1] > 0
            lines.append(f"  Margin over the best of the baselines (positive = {me} better): "
                         + ", ".join(f"{budget_key(b)}: {g:+.3f}" for b, g in gaps)
                         + f" -> the advantage {'widens' if widening else 'does not widen'} as the budget shrinks "
                           f"(margin {lo[1]:+.3f} at {budget_key(lo[0])} vs {hi[1]:+.3f} at {budget_key(hi[0])}).")
    lines += ["", f"Overall: claim (a) {'HOLDS' if overall else 'DOES NOT HOLD'} on this model and data."]
    return lines


def make_figure(agg: dict[str, Any], methods: list[str], budgets: list[float], title: str):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from prefixkv_core.policies import REGISTRY

    fig = make_subplots(rows=1, cols=3, subplot_titles=("PPL (lower is better)", "ROUGE-L vs Full (higher is better)",
                                                        "KV kept (% of Full)"))
    xs = [float(b) for b in budgets]
    for m in methods:
        color = REGISTRY[m].colour  # the method's own colour, as in the app
        fixed = not REGISTRY[m].uses_budget
        for col, key in enumerate(("ppl", "rouge_l", "kv_kept_pct"), start=1):
            ys = [agg[key][m].get(budget_key(b)) for b in budgets]
            ys = [y if isinstance(y, float) else None for y in ys]
            fig.add_trace(go.Scatter(
                x=xs, y=ys, name=REGISTRY[m].label + (" (no budget)" if fixed and m != REFERENCE else ""),
                legendgroup=m, showlegend=col == 1, mode="lines" if fixed else "lines+markers",
                line=dict(color=color, dash="dash" if fixed else "solid", width=3 if m == FEATURED else 2)),
                row=1, col=col)
    for col in (1, 2, 3):
        fig.update_xaxes(title_text="budget (kept fraction)", row=1, col=col)
    fig.update_layout(title=title, width=1400, height=480, template="plotly_white",
                      legend=dict(orientation="h", y=-0.2))
    return fig


# -- the run -----------------------------------------------------------------------------------------------

def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def weights_digest(model) -> str:
    """A cheap identity of the weights (strided samples of every parameter), so a resumed run notices when a
    model's weights changed under the same name (e.g. the embedded model's vision tower after training)."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 1024)].double()
            h.update(f"{name}:{tuple(p.shape)}:{float(sample.sum()):.9e}:{float(sample.abs().sum()):.9e}".encode())
    return h.hexdigest()[:12]


def repo_relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(Path(path).resolve())


def build_parser() -> argparse.ArgumentParser:
    from prefixkv_core.policies import METHODS

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  python benchmarks/quality.py --model embedded --quick\n"
               "  python benchmarks/quality.py --data mmvet.jsonl --image-root images/ --methods full,local,prefixkv "
               "--budgets 0.1,0.5\n  accelerate launch --num_processes 2 benchmarks/quality.py --limit 20\n"
               f"Methods: {', '.join(METHODS)}.")
    add_model_args(p, device_help="auto (CUDA if present; under accelerate each process takes its own GPU), cpu, "
                                  "cuda, cuda:N (default auto)")
    p.add_argument("--data", default="builtin",
                   help="'builtin' (benchmarks/data/builtin.jsonl, 45 samples) or a .jsonl/.json file in the flat "
                        "(image, question, answer) or LLaVA conversation format")
    p.add_argument("--image-root", default=None, help="folder image paths are relative to (default: the data file's)")
    text = p.add_argument_group(
        "text mode", "long-context language modelling without an image: pairs (context, continuation) cut from "
                     "one plain text, the context fed without the chat template, PPL of the continuation")
    text.add_argument("--text", default=None, metavar="FILE|builtin",
                      help="a UTF-8 plain-text file, or 'builtin': the Python Language Reference shipped with the "
                           "interpreter (pydoc_data, PSF License, about 113k tokens for SmolLM2); replaces --data")
    text.add_argument("--context-tokens", type=int, default=None, metavar="N",
                      help=f"tokens of context per pair (default {TEXT_DEFAULTS['context_tokens']}; --quick "
                           f"{TEXT_QUICK['context_tokens']})")
    text.add_argument("--continuation-tokens", type=int, default=None, metavar="M",
                      help=f"tokens scored after each context (default {TEXT_DEFAULTS['continuation_tokens']}; "
                           f"--quick {TEXT_QUICK['continuation_tokens']}); replaces --max-answer-tokens")
    text.add_argument("--pairs", type=int, default=None, metavar="K",
                      help=f"pairs, spread evenly over the text without overlap (default {TEXT_DEFAULTS['pairs']}; "
                           f"--quick {TEXT_QUICK['pairs']})")
    add_method_args(p, several_budgets=True, budget_default=None,
                    methods_help="'all' or a comma-separated list; the reference (Full) is always added (ROUGE-L is "
                                 "measured against it)",
                    budget_help=f"comma-separated kept fractions (default {DEFAULT_BUDGETS}; --quick: {QUICK['budgets']})",
                    query_agnostic_help="compress the image and any text before the question first, then feed the "
                                        "question and decode on the compressed cache, as in a chat about one image "
                                        "(default: compress with the question in the prompt); not with --text")
    p.add_argument("--limit", type=int, default=None, help="use the first N samples (--quick: 5)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per output (default 64; --quick 12)")
    p.add_argument("--max-answer-tokens", type=int, default=None,
                   help="score only the first N tokens of each reference answer, 0 = all (default 0; --quick 16)")
    p.add_argument("--quick", action="store_true",
                   help="a subset that finishes in minutes on a 2-core CPU with the embedded model: "
                        "first 5 samples, budgets 0.1/0.3/0.5, 12 new tokens, answers cut at 16 tokens "
                        "(explicit options override these)")
    add_knob_flags(p)  # --prefixkv-mode: a knob a policy lets the benchmarks set as a flag of its own
    p.add_argument("--out", default=None, help="output folder (default out/benchmarks/quality-<model>[-quick]"
                                               "[-equal-memory][-query-agnostic]); records there are resumed")
    p.add_argument("--fresh", action="store_true", help="discard the records already in --out and start over")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per process (default: cores / processes)")
    p.add_argument("--no-png", action="store_true", help="HTML figure only, skip the PNG export")
    p.add_argument("--quiet", action="store_true", help="no progress bars; print only the output paths")
    return p


def resolve_settings(args, chosen: MethodArgs) -> dict[str, Any]:
    base = QUICK if args.quick else FULL_DEFAULTS
    limit = args.limit if args.limit is not None else base["limit"]
    return {
        "limit": limit,
        "budget_mode": chosen.budget_mode,
        "query_agnostic": chosen.query_agnostic,
        "budgets": chosen.budgets,
        "max_new_tokens": args.max_new_tokens if args.max_new_tokens is not None else base["max_new_tokens"],
        "max_answer_tokens": (args.max_answer_tokens if args.max_answer_tokens is not None
                              else base["max_answer_tokens"]),
    }


def text_settings(args) -> dict[str, Any]:
    """The text mode's own settings; the continuation is scored whole (it is already M tokens)."""
    base = TEXT_QUICK if args.quick else TEXT_DEFAULTS
    out = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    for k, v in out.items():
        if v < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be at least 1")
    if args.data != "builtin":
        raise SystemExit("--text and --data are alternatives: give one")
    if args.query_agnostic:
        raise SystemExit("--query-agnostic holds the question back while the prompt is compressed; the text mode's "
                         "prompts are plain text with no question: leave it out with --text")
    return {**out, "text": args.text, "max_answer_tokens": 0}


def text_samples(loaded, long_text: LongText, settings: dict[str, Any]) -> list[Sample]:
    """The pairs of the text mode, checked against the model's context."""
    need = settings["context_tokens"] + max(settings["continuation_tokens"], settings["max_new_tokens"])
    if need > loaded.max_context:
        raise SystemExit(f"--context-tokens + --continuation-tokens (or --max-new-tokens) is {need} tokens, over "
                         f"the model's context of {loaded.max_context}")
    try:
        samples = cut_text_pairs(loaded.tokenizer, long_text.text, settings["context_tokens"],
                                 settings["continuation_tokens"], settings["pairs"])
    except DataError as exc:
        raise SystemExit(f"--text: {exc}") from None
    return samples[: settings["limit"]] if settings["limit"] else samples


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from prefixkv_core import Engine, load_model

    # On a machine without a GPU (or with --device cpu) processes started by `accelerate launch --multi_gpu`
    # / torchrun must be told to use CPU collectives (gloo); otherwise accelerate sees no distributed run.
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=on_cpu)
    rank, world = state.process_index, state.num_processes
    main_proc = state.is_main_process
    try:  # the reference (Full) is always run: ROUGE-L is measured against it
        chosen = method_args(args, budgets_default=(QUICK if args.quick else FULL_DEFAULTS)["budgets"],
                             with_reference=True)
    except MethodArgError as exc:
        raise SystemExit(str(exc)) from None
    settings = resolve_settings(args, chosen)
    long_text = None
    if args.text:
        settings.update(text_settings(args))
        try:
            long_text = load_long_text(args.text)
        except DataError as exc:
            raise SystemExit(f"--text: {exc}") from None
    if settings["max_new_tokens"] < 1:
        raise SystemExit("--max-new-tokens must be at least 1")
    methods = chosen.methods
    data_path, default_root = dataset_spec(args.data)
    try:
        samples = load_dataset(data_path, settings["limit"]) if long_text is None else []
    except DataError as exc:
        raise SystemExit(f"--data: {exc}") from None
    image_root = Path(args.image_root) if args.image_root else default_root

    device = args.device
    if device == "auto" and world > 1 and torch.cuda.is_available():
        device = f"cuda:{state.local_process_index}"
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    elif world > 1 and "OMP_NUM_THREADS" not in os.environ and not str(device).startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    loaded = load_model(args.model, device=device, dtype=args.dtype)
    engine = Engine(loaded)
    sessions = engine if long_text is None else PlainTextPrompts(engine)
    data_label = f"{len(samples)} samples of {data_path.name}"
    if long_text is not None:
        samples = text_samples(loaded, long_text, settings)
        data_label = (f"{len(samples)} pairs of {settings['context_tokens']} context + "
                      f"{settings['continuation_tokens']} continuation tokens from {long_text.source}, "
                      "plain text without the chat template")

    try:  # flags such as --prefixkv-mode: auto is the policy's own pick for this model
        flagged = resolve_knob_flags(args, chosen, ResolveContext(loaded.slug, loaded.name, loaded.num_layers,
                                                                  settings["budgets"][0]))
    except MethodArgError as exc:
        raise SystemExit(str(exc)) from None
    knobs = chosen.knobs
    flagged_title = "; ".join(f"{REGISTRY[m].label} " + ", ".join(f"{k} {v}" for k, v in ks.items())
                              for m, ks in flagged.items())

    budget_mode, query_agnostic = settings["budget_mode"], settings["query_agnostic"]
    out = Path(args.out) if args.out else REPO_ROOT / "out" / "benchmarks" / (
        f"quality-{loaded.slug}" + ("-quick" if args.quick else "")
        + ("-equal-memory" if budget_mode == "equal_memory" else "")
        + ("-query-agnostic" if query_agnostic else ""))
    if long_text is not None and not args.out:  # text runs keep their own default folder
        out = out.with_name(out.name + "-text")
    fingerprint = {
        "model": loaded.name, "model_slug": loaded.slug, "weights": weights_digest(loaded.model),
        "vision_trained": loaded.vision_trained, "dtype": str(loaded.dtype).replace("torch.", ""),
        "device_type": loaded.device.type, "data": repo_relative(data_path), "data_sha": file_sha(data_path),
        "image_root": repo_relative(image_root), "max_new_tokens": settings["max_new_tokens"],
        "max_answer_tokens": settings["max_answer_tokens"], "knobs": knobs, "budget_mode": budget_mode,
        "query_agnostic": query_agnostic,
    }
    if long_text is not None:  # the text (by digest), not the unused --data file, identifies the data
        fingerprint.update(data=f"text:{args.text}", data_sha=hashlib.sha256(long_text.text.encode()).hexdigest()[:12],
                           image_root=None, context_tokens=settings["context_tokens"],
                           continuation_tokens=settings["continuation_tokens"], chat_template=False)
    store = RecordStore(out, rank)
    cfg_path = out / "config.json"
    # Every process checks (so none is left waiting at the barrier below); only the main one writes.
    if not args.fresh and cfg_path.is_file() and store.shards():
        old = json.loads(cfg_path.read_text())
        old.setdefault("budget_mode", "published")  # records written before the modes were recorded
        old.setdefault("query_agnostic", False)
        if old != fingerprint:
            diff = {k: (old.get(k), v) for k, v in fingerprint.items() if old.get(k) != v}
            raise SystemExit(f"{out} holds records of a different configuration {diff}; use --fresh to discard "
                             "them or another --out")
    state.wait_for_everyone()
    if main_proc:
        out.mkdir(parents=True, exist_ok=True)
        if args.fresh:
            for shard in store.shards():
                shard.unlink()
        cfg_path.write_text(json.dumps(fingerprint, indent=1) + "\n")
    state.wait_for_everyone()

    # Later lines win; a record that ended in an error is tried again (an OOM or a crash may not recur).
    done_records = list({record_key(r): r for r in store.load()}.values())
    done = {record_key(r) for r in done_records if not r.get("error")}
    sample_ids = [s.id for s in samples]
    my_new: list[dict[str, Any]] = []
    quiet = args.quiet or not main_proc
    t0 = time.perf_counter()
    with state.split_between_processes(list(range(len(samples)))) as my_indices:
        my_samples = [samples[i] for i in my_indices]
        bar = tqdm(my_samples, desc=f"samples (process {rank + 1}/{world})" if world > 1 else "samples",
                   disable=quiet, unit="sample")
        steps = tqdm(desc="tokens generated + scored", disable=quiet, unit="tok", leave=False)
        for sample in bar:
            bar.set_postfix_str(sample.id)
            my_new += evaluate_sample(sessions, sample, image_root, methods, settings["budgets"], settings, knobs,
                                      done, store, steps)
        steps.close()
        bar.close()
        mine = {s.id for s in my_samples}
        my_records = [r for r in done_records if r["sample"] in mine] + my_new
    elapsed = time.perf_counter() - t0
    all_records = gather_object(my_records) if world > 1 else my_records
    elapsed_all = gather_object([elapsed]) if world > 1 else [elapsed]
    new_all = gather_object([len(my_new)]) if world > 1 else [len(my_new)]
    # the last collective: leave the process group now (a process that exits with gloo's threads still up can be
    # aborted by the C++ runtime, seen under load on the 2-core machine); a single process has none to leave
    state.destroy_process_group()
    if not main_proc:
        return 0

    merged = {record_key(r): r for r in all_records}
    records = sorted(merged.values(), key=lambda r: (sample_ids.index(r["sample"]) if r["sample"] in sample_ids
                                                     else len(sample_ids), methods.index(r["method"])
                                                     if r["method"] in methods else 99, budget_key(r["budget"])))
    agg = aggregate(records, sample_ids, methods, settings["budgets"])
    info = run_info(loaded.device)
    note = (f"{loaded.name} ({loaded.slug}), {data_label}, "
            f"{settings['max_new_tokens']} new tokens, answers {'cut at ' + str(settings['max_answer_tokens']) + ' tokens' if settings['max_answer_tokens'] else 'whole'}, "
            + (f"{flagged_title}, " if flagged_title else "")
            + f"{run_title(budget_mode, query_agnostic)}; {info['machine']}, {info['date']}, "
            f"commit {info['commit']}.")
    if not loaded.vision_trained:
        note += " The vision tower is untrained: the numbers measure language-side behaviour."
    tables = make_tables(agg, methods, settings["budgets"], note, budget_mode, query_agnostic)
    written = []
    for name, t in tables.items():
        written += t.write(out, name)
    claims = check_claims(agg, methods, settings["budgets"])
    (out / "claims.md").write_text("\n".join(claims) + "\n")
    from prefixkv_core.report.leaderboard import to_csv as leaderboard_csv

    lb_rows, lb_tasks = leaderboard_rows(
        records, samples, methods, settings["budgets"], knobs=knobs, model=loaded.name, budget_mode=budget_mode,
        query_agnostic=query_agnostic, text_mode=long_text is not None,
        dataset=("text-" + (args.text if args.text == "builtin" else Path(args.text).stem)) if long_text is not None
        else Path(data_path).stem,
        data_dir=str(settings["context_tokens"]) if long_text is not None else "")
    (out / "leaderboard.csv").write_text(leaderboard_csv(lb_rows, lb_tasks))
    summary_md = "\n".join(Table(**{**vars(t), "notes": []}).to_markdown() for t in tables.values())
    summary_md += "\n" + note + "\n\n" + "\n".join(claims) + "\n"
    (out / "tables.md").write_text(summary_md)
    fig = make_figure(agg, methods, settings["budgets"], f"Quality vs budget: {loaded.name}, {len(samples)} samples, "
                      f"{run_title(budget_mode, query_agnostic)}")
    fig_paths, png_msg = save_figure(fig, out / "quality", png=not args.no_png)
    payload = {
        "run": info, "config": fingerprint, "settings": settings, "budget_mode": budget_mode,
        "query_agnostic": query_agnostic,
        # the knobs set by a method's own flag, as run: "prefixkv_mode" (--prefixkv-mode)
        **{f"{m}_{k}": v for m, ks in flagged.items() for k, v in ks.items()},
        "processes": world,
        "elapsed_s_per_process": elapsed_all, "new_records": sum(new_all),
        "resumed_records": len(records) - sum(new_all), "methods": methods, "budgets": settings["budgets"],
        "samples": sample_ids, "model_notes": loaded.notes, "vision_trained": loaded.vision_trained,
        "tables": {"ppl": agg["ppl"], "rouge_l": agg["rouge_l"], "kv_kept_pct": agg["kv_kept_pct"]},
        "counts": agg["counts"], "claims": claims, "records": records,
    }
    if long_text is not None:
        payload["text_mode"] = {"source": long_text.source, "pairs": [s.as_dict() for s in samples]}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if not args.quiet:
        print(summary_md)
        print(png_msg)
        print(f"elapsed {max(elapsed_all):.0f} s on {world} process(es); {sum(new_all)} new records, "
              f"{len(records) - sum(new_all)} resumed from {out}")
    print(f"wrote {out}/(ppl|rouge_l|kv_kept).(md|csv|tex), tables.md, claims.md, leaderboard.csv, results.json, "
          + ", ".join(p.name for p in fig_paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
