"""The result record as JSON-ready dictionaries: every method's figures of the current turn, and the whole record
(the CLI's --json, the app's `results` output, exported results.json)."""
from __future__ import annotations

from typing import Any

import numpy as np

MB = 1e6  # decimal megabytes, as the app's badges and charts show them


def method_summary(record, method: str) -> dict[str, Any]:
    """One method's figures of the current turn (`ComparisonRecord.method_summary`)."""
    t = record.tracks[method]
    ev, cur = t.last, t.turn
    rouge = record.rouge(method)
    return {
        "label": t.label,
        "stage": ev.stage if ev is not None and ev.stage else None,
        "status": cur.status if cur else "waiting",
        "text": cur.answer if cur else "",
        "answers": [x.answer for x in t.turns],
        "tokens": ev.step if ev is not None else 0,
        "kv_bytes": ev.kv_bytes if ev is not None else None,
        "full_kv_bytes": ev.full_kv_bytes if ev is not None else None,
        "kv_mb": round(ev.kv_bytes / MB, 4) if ev is not None else None,
        "kv_ratio": round(ev.kv_ratio, 4) if ev is not None else None,
        # the main run's throughput and TTFT: batched (the step's forward is shared by the batch, see
        # "timing" at the top), or the method's own when the session decoded every method alone
        "timing": "batched" if record.batched else "alone",
        "tokens_per_s": round(ev.tokens_per_s, 2) if ev is not None and ev.tokens_per_s else None,
        "ttft_s": round(ev.ttft_s, 4) if ev is not None and ev.ttft_s is not None else None,
        # the method's own cost, measured around its policy calls in the main run
        "policy_ms_per_token": round(1000 * cur.policy_s / cur.decode_steps, 4) if cur and cur.decode_steps
        else None,
        "compress_ms": round(1000 * ev.compress_s, 3) if ev is not None and ev.compress_s is not None else None,
        "alone": alone_summary(record, method),
        "speedup_vs_full": _round(record.speedup(method), 3),
        "rouge_l_vs_full": round(rouge, 4) if rouge is not None else None,
        # every turn's ROUGE-L against Full's answer to it (None where either did not finish)
        "rouge_l_per_turn": [None if x is None else round(x, 4) for x in
                             (record.rouge(method, i) for i in range(len(t.turns)))],
        "kept_per_layer": list(ev.kept_per_layer) if ev is not None else [],
        "kept_image_per_layer": list(ev.kept_image_per_layer) if ev is not None else [],
        "kept_per_image": list(ev.kept_per_image) if ev is not None else [],
        "full_len": ev.full_len if ev is not None else None,
        "mean_kept_ratio": record.mean_kept_ratio(method),
        "extras": jsonable(ev.extras) if ev is not None else {},
        "error": next((x.error for x in reversed(t.turns) if x.error), None),
    }

def alone_summary(record, method: str) -> dict[str, Any] | None:
    """The current turn decoded on its own: TTFT, tokens/s, per-token latency (forward + policy), and
    whether the answer is the main run's."""
    run = record.alone_turn(method)
    if run is None:
        return None
    ev, main = run.last, record.tracks[method].turn
    done = run.status == "done"
    return {
        "status": run.status,
        "tokens": ev.step if ev is not None else 0,
        "ttft_s": _round(ev.ttft_s if ev is not None else None, 4),
        "tokens_per_s": _round(ev.tokens_per_s if ev is not None else None, 2),
        "ms_per_token": _round(1000 * sum(run.latency_s) / len(run.latency_s) if run.latency_s else None, 3),
        "policy_ms_per_token": _round(1000 * run.policy_s / run.decode_steps if run.decode_steps else None, 4),
        "latency_ms": [round(1000 * x, 3) for x in run.latency_s],
        # after a batched run: did the method alone give the same answer (None while either is unfinished)
        "same_answer": run.answer == main.answer if record.batched and done and main is not None
        and main.status == "done" else None,
        "error": run.error,
    }

def record_dict(record) -> dict[str, Any]:
    """JSON-ready results: the CLI's --json, the app's `results` output and exported results.json."""
    pre = record.prefill
    return {
        "model": record.model.get("name"),
        "device": record.model.get("device"),
        "budget": record.budget,
        "budget_mode": record.budget_mode,
        "query_agnostic": record.query_agnostic,
        # how the figures were timed: the batched run (its shared forward once, here) and/or each method
        # decoded on its own (each method's "alone")
        "timing": {"batched": record.batched, "alone": record.alone, "batch": record.batch_summary()},
        "settings": jsonable(record.settings),
        "knobs": jsonable(record.knobs),
        "prompts": list(record.prompts),
        "turn": record.turn_index + 1,
        "finished": record.finished and not record.active,
        "error": record.error,
        "prefill": None if pre is None else {
            "prompt_tokens": pre.prompt_tokens, "image_tokens": pre.image_tokens,
            "num_layers": pre.num_layers, "prefill_s": round(pre.prefill_s, 4),
            "compressed_tokens": pre.compressed_tokens if pre.compressed_tokens is not None else pre.prompt_tokens,
            "image_grid": list(pre.image_grid) if pre.image_grid else None,
            # every view of the image: one grid, or an anyres base view + high-resolution tiles
            "image_views": pre.image_layout.describe() if pre.image_layout is not None else None,
            # per image (a video: per frame), in prompt order: [start, stop) among the prompt's image tokens
            "image_ranges": [list(r) for r in pre.image_layout.image_ranges()] if pre.image_layout is not None
            else None,
        },
        "visuals": jsonable(record.visuals),
        "methods": {m: method_summary(record, m) for m in record.methods},
    }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def jsonable(x: Any) -> Any:
    """Plain JSON types from numpy arrays / scalars and nested containers (anything else as its str)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
