"""Text of the method panels (header with live badges, chat history), the status line and the banner."""
from __future__ import annotations

import html
import re
from typing import Any

from prefixkv_core.policies import facts_from_extras

from .charts import MB
from .runstate import Comparison, Track

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
STATUS_TEXT = {"waiting": "waiting", "prefilling": "in its own prefill…", "streaming": "streaming…", "done": "done",
               "stopped": "stopped", "error": "error"}


def clean(text: str) -> str:
    """Drop control characters a (random) model may emit; keep newlines and tabs."""
    return _CONTROL.sub("", text or "")


def _badge(text: str, cls: str = "") -> str:
    return f'<span class="badge {cls}">{html.escape(text)}</span>'


def _fmt_mb(nbytes: int) -> str:
    mb = nbytes / MB
    return f"{mb:.2f} MB" if mb >= 0.1 else f"{mb * 1000:.1f} kB"


def facts_note(extras: dict[str, Any] | None) -> str:
    """The facts a method reported about its run (thresholds, per-layer ranges, notes), one phrase each."""
    return " · ".join(f.text() for f in facts_from_extras(extras))


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _ms(ms: float) -> str:
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms"


def timing_badges(track: Track, comparison: Comparison) -> list[str]:
    """What this method cost on its own. In the batched run only its policy time is its own (the forward is
    shared, and shown once in the status line); timed alone, its TTFT, tokens/s and speed-up over Full."""
    badges = []
    turn = track.turn
    if turn is not None and turn.decode_steps:
        badges.append(_badge(f"policy {_ms(1000 * turn.policy_s / turn.decode_steps)}/token", "policy"))
    ev = turn.last if turn is not None else None
    if ev is not None and ev.compress_s is not None and comparison.batched:
        badges.append(_badge(f"compress {_ms(1000 * ev.compress_s)}", "policy"))
    run = turn.alone if turn is not None else None
    if run is None:
        if comparison.alone and comparison.batched and turn is not None and turn.status == "done" \
                and comparison.active:
            badges.append(_badge("timing alone: waiting", "alone"))
        return badges
    if run.status == "streaming":
        badges.append(_badge("timing alone…", "alone"))
    last = run.last
    if last is not None and last.tokens_per_s:
        speed = comparison.speedup(track.method)
        note = (f" · {speed:.2f}× {_reference_label(comparison)}" if speed is not None
                and track.method != comparison.reference else "")
        badges.append(_badge(f"alone {last.tokens_per_s:.1f} tok/s{note}", "alone"))
    if last is not None and last.ttft_s is not None:
        badges.append(_badge(f"TTFT alone {_seconds(last.ttft_s)}", "alone"))
    return badges


def _reference_label(comparison: Comparison) -> str:
    """The label of the method the others are measured against (its policy plays the "reference" role)."""
    track = comparison.tracks.get(comparison.reference) if comparison.reference else None
    return track.label if track is not None else "the reference"


def header_html(track: Track, summary: str, comparison: Comparison | None, uses_budget: bool = True) -> str:
    """Method name, one-line description, badges: state, KV size (MB and % of full), the method's own policy
    time, its TTFT / tokens/s / speed-up over Full when timed alone, ROUGE-L."""
    name = html.escape(track.label)
    turn = track.turn
    status = turn.status if turn is not None and comparison is not None else "waiting"
    if status == "waiting" and comparison is not None and comparison.prefill is not None and not comparison.finished:
        status = "prefilling"  # the shared prefill is done: this method's own runs between the others' steps
    badges = [_badge(STATUS_TEXT.get(status, status), f"state-{status}")]
    ev = track.last if comparison is not None else None
    if ev is not None:
        badges.append(_badge(f"KV {_fmt_mb(ev.kv_bytes)} · {ev.kv_ratio:.0%} of full", "kv"))
    if comparison is not None:
        badges += timing_badges(track, comparison)
        if track.method == comparison.reference:
            if len(comparison.tracks) > 1:
                badges.append(_badge("ROUGE-L reference", "rouge"))
        else:
            r = comparison.rouge(track.method)
            if r is not None:
                badges.append(_badge(f"ROUGE-L {r:.3f} vs {_reference_label(comparison)}", "rouge"))
    sub = html.escape(summary)
    if not uses_budget:
        sub += " <i>(budget slider not used)</i>"
    out = [f'<div class="method-head m-{track.method}"><span class="method-name">{name}</span>'
           f'<div class="method-sub">{sub}</div><div class="badges">{"".join(badges)}</div>']
    if ev is not None:
        note = facts_note(ev.extras)
        if note:
            out.append(f'<div class="method-note">{html.escape(note)}</div>')
    if turn is not None and turn.error and comparison is not None:
        out.append(f'<div class="method-error">⚠ {html.escape(turn.error)}</div>')
    out.append("</div>")
    return "".join(out)


def chat_messages(track: Track) -> list[dict[str, str]]:
    """This method's conversation in Chatbot 'messages' format; the answer streams into the last turn."""
    msgs: list[dict[str, str]] = []
    for turn in track.turns:
        msgs.append({"role": "user", "content": clean(turn.user)})
        if turn.status == "error" and not turn.answer:
            msgs.append({"role": "assistant", "content": f"⚠ {clean(turn.error or 'failed')}"})
        elif turn.answer or turn.status != "waiting":
            text = clean(turn.answer) or "…"
            if turn.status == "stopped":
                text += " ■"
            msgs.append({"role": "assistant", "content": text})
    return msgs


def _visuals_note(comparison: Comparison) -> str:
    """': 3 images, 8 frames' when a comparison has more than one image or a video; '' otherwise."""
    visuals = getattr(comparison.record, "visuals", None) or {}
    images = len(visuals.get("images") or [])
    frames = int((visuals.get("video") or {}).get("frames") or 0)
    if images <= 1 and not frames:
        return ""
    parts = [f"{n} {word}{'s' if n != 1 else ''}" for n, word in ((images, "image"), (frames, "frame")) if n]
    return ": " + ", ".join(parts)


def status_line(comparison: Comparison | None, phase: str | None = None) -> str:
    """One line above the panels: what is happening and the shared prefill facts."""
    if comparison is None:
        return phase or ("Upload an image, several images or a video (or pick an example), type a prompt and press "
                         "**Compare**.")
    parts = []
    if phase:
        parts.append(phase)
    pre = comparison.prefill
    if pre is not None:
        prefill = (f"shared prefill {pre.prefill_s:.2f} s" if comparison.batched
                   else f"prefill {pre.prefill_s:.2f} s (each method its own)")
        parts.append(f"prompt {pre.prompt_tokens} tokens ({pre.image_tokens} image{_visuals_note(comparison)}) · "
                     f"{pre.num_layers} layers · " + prefill)
    batch = comparison.batch_summary()
    if batch is not None:  # the forward every method of the batch shared: one figure, not one per panel
        who = f"{batch['methods']} methods share" if batch["methods"] > 1 else "one method:"
        parts.append(f"batched: {who} one forward of {batch['forward_ms_per_step']:.0f} ms per token")
    if comparison.alone:
        parts.append("each method also timed alone" if comparison.batched else "each method decoded alone")
    parts.append(f"budget r = {comparison.budget:.2f} ({comparison.mode_title()})")
    if pre is not None and comparison.query_agnostic and pre.compressed_tokens is not None:
        parts.append(f"{pre.compressed_tokens} tokens compressed before the question")
    if len(comparison.prompts) > 1:
        parts.append(f"turn {len(comparison.prompts)}")
    return " · ".join(parts)


def banner_markdown(info: dict[str, Any]) -> str:
    """Names the model and device; warns when the vision tower is untrained."""
    line = (f"**Model:** `{info.get('name')}` on **{info.get('device')}** ({info.get('dtype')}) · "
            f"{info.get('num_layers')} layers · {info.get('image_tokens')} image tokens per image · "
            f"context {info.get('max_context')}")
    out = [line]
    if not info.get("vision_trained", True):
        out.append('<span class="banner-warn">⚠ This model\'s vision tower is untrained: it cannot see the '
                   "image, so answers ignore its content. The compression methods still run on the image "
                   "tokens exactly as on a trained model.</span>")
    notes = [n for n in info.get("notes", []) if "untrained" not in n]
    if notes:
        out.append("<small>" + html.escape("; ".join(notes)) + "</small>")
    return "<br>".join(out)
