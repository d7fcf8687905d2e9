"""The Gradio Blocks: inputs, one streaming panel per method, live charts, follow-up chat.

`build_app(engine)` takes a ready Engine so tests can inject a tiny model.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import gradio as gr

from prefixkv_core import METHODS, EngineError, GenerationSettings, describe
from prefixkv_core.metrics import rouge_l

import tempfile

from . import charts
from .export import export_all

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "images"
LABELS = {m["name"]: m["label"] for m in describe()}
SCHEDULES = {m["name"]: m["schedule"] for m in describe()}
REFRESH_S = 0.4  # chart/panel refresh period while streaming: keeps the browser responsive
MAX_PROMPT_CHARS = 4000


def _badge(ev, full_text: str | None) -> str:
    mb = ev.kv_bytes / 2**20
    parts = [f"**KV** {mb:.2f} MiB ({ev.kv_ratio:.0%} of full)"]
    if ev.tokens_per_s:
        parts.append(f"**{ev.tokens_per_s:.1f} tok/s**")
    if ev.ttft_s is not None:
        parts.append(f"TTFT {ev.ttft_s:.2f} s")
    if ev.kind == "done" and full_text is not None and ev.method != "full":
        parts.append(f"ROUGE-L vs Full {rouge_l(ev.text, full_text):.3f}")
    return " · ".join(parts)


def _panel(name: str, state: dict) -> str:
    title = f"### {LABELS[name]}\n<sub>{SCHEDULES[name]}</sub>\n\n"
    events = state.get("events", {})
    if name not in events:
        return title + "_not selected_"
    ev = events[name]
    full = events.get("full")
    full_text = full.text if full is not None and full.kind == "done" else None
    history = "".join(f"> **You:** {q}\n>\n> {a}\n\n" for q, a in state.get("history", {}).get(name, []))
    status = {"error": f"⚠️ {ev.error}", "cancelled": "⏹ stopped"}.get(ev.kind, "")
    notes = "; ".join(ev.extras.get("notes", []))
    return (title + _badge(ev, full_text) + "\n\n" + history + (ev.text or "…") + "\n\n" + status
            + (f"\n\n<sub>{notes}</sub>" if notes else ""))


def _outputs(state: dict, budget: float):
    events = state.get("events", {})
    prefill = state.get("prefill")
    threshold = None
    if "prefixkv" in events:
        threshold = events["prefixkv"].extras.get("threshold")
    lorenz = charts.lorenz_figure(prefill.importance, threshold=threshold, budget=budget) if prefill else None
    panels = [_panel(m, state) for m in METHODS]
    return [state, *panels, charts.retained_bars(events), lorenz, charts.memory_figure(state.get("trace", {})),
            charts.latency_figure(state.get("trace", {}))]


def _stream(state: dict, iterator, budget: float):
    """Consume engine events; yield UI updates at most every REFRESH_S (and always at the end)."""
    last = 0.0
    try:
        for ev in iterator:
            if hasattr(ev, "importance"):
                state["prefill"] = ev
                continue
            state["events"][ev.method] = ev
            step_time = ev.step_latency_s + ev.policy_s
            state["trace"].setdefault(ev.method, []).append((ev.step, ev.kv_bytes, step_time))
            if time.monotonic() - last > REFRESH_S:
                last = time.monotonic()
                yield _outputs(state, budget)
    finally:
        close = getattr(iterator, "close", None)
        if close:
            close()  # a closed tab stops the engine at the next step and frees its lock
    yield _outputs(state, budget)


def _run_guarded(fn):
    """Show EngineError messages to the user; never a traceback."""
    def wrapper(*args):
        try:
            yield from fn(*args)
        except EngineError as exc:
            raise gr.Error(str(exc)) from None
        except gr.Error:
            raise
        except Exception as exc:  # noqa: BLE001 - the app must stay up
            raise gr.Error(f"internal error ({exc.__class__.__name__}); the other results are kept") from None
    return wrapper


def build_app(engine, max_new_tokens_limit: int = 256, default_methods=None, banner: str | None = None) -> gr.Blocks:
    loaded = engine.loaded
    examples = sorted(str(p) for p in ASSETS.glob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    default_methods = list(default_methods or METHODS)

    def compare(image, prompt, methods, budget, max_new_tokens, state):
        if not methods:
            raise gr.Error("select at least one method")
        if not isinstance(prompt, str) or not prompt.strip():
            raise gr.Error("the prompt is empty: type a question or instruction")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise gr.Error(f"the prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        if not (0 < float(budget) <= 1):
            raise gr.Error("budget must be in (0, 1]")
        gen = GenerationSettings(max_new_tokens=int(min(max_new_tokens, max_new_tokens_limit)))
        session = engine.new_session(image, prompt, list(methods), float(budget), gen)
        cancel = threading.Event()
        state = {"session": session, "cancel": cancel, "events": {}, "trace": {}, "history": {},
                 "budget": float(budget)}
        yield from _stream(state, session.run(cancel), float(budget))

    def follow_up(question, state):
        if not state or "session" not in state:
            raise gr.Error("run a comparison first; follow-ups continue its caches")
        session = state["session"]
        for name, ev in state["events"].items():
            state["history"].setdefault(name, []).append((session.user_turns[-1], ev.text))
        state["cancel"] = threading.Event()
        state["trace"] = {}
        yield from _stream(state, session.follow_up(question, state["cancel"]), state["budget"])

    def export(state):
        if not state or not state.get("events"):
            raise gr.Error("nothing to export yet: run a comparison first")
        _, *rest = _outputs(state, state["budget"])
        bars_fig, lorenz_fig, memory_fig, latency_fig = rest[len(METHODS):]
        figures = {"retained_ratio": bars_fig, "lorenz": lorenz_fig, "kv_memory": memory_fig,
                   "latency": latency_fig}
        folder = Path(tempfile.mkdtemp(prefix="prefixkv-export-")) / "prefixkv-results"
        archive, notes = export_all(state, figures, folder, state["session"].user_turns)
        files = [str(archive)] + [str(p) for p in sorted(folder.iterdir())]
        return files, "Exported: " + ", ".join(Path(f).name for f in files[1:]) + (
            "\n\n" + "; ".join(notes) if notes else "")

    def stop(state):
        if state and state.get("cancel") is not None:
            state["cancel"].set()

    with gr.Blocks(title="PrefixKV Lab") as demo:
        gr.Markdown("# PrefixKV Lab — KV-cache compression, side by side")
        gr.Markdown(banner or f"Model **{loaded.name}** on **{loaded.device}** ({loaded.dtype}). "
                    + " ".join(f"⚠️ {n}" for n in loaded.notes))
        state = gr.State({})
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(type="pil", label="Image", height=280)
                if examples:
                    gr.Examples(examples=[[e] for e in examples], inputs=[image], label="Example images")
            with gr.Column(scale=1):
                prompt = gr.Textbox(label="Prompt", value="Describe the image in detail.", lines=3)
                methods = gr.CheckboxGroup(choices=[(LABELS[m], m) for m in METHODS], value=default_methods,
                                           label="Methods")
                budget = gr.Slider(0.05, 1.0, value=0.3, step=0.05, label="Budget: kept fraction of the KV cache "
                                   "(ZipVL uses its τ instead)")
                max_new = gr.Slider(1, max_new_tokens_limit, value=min(48, max_new_tokens_limit), step=1,
                                    label="Max new tokens")
                with gr.Row():
                    run_btn = gr.Button("Compare", variant="primary")
                    stop_btn = gr.Button("Stop")
        panels = []
        for row in range(0, len(METHODS), 3):
            with gr.Row(equal_height=False):
                for name in METHODS[row:row + 3]:
                    panels.append(gr.Markdown(f"### {LABELS[name]}", elem_id=f"panel-{name}"))
        with gr.Row():
            followup = gr.Textbox(label="Follow-up question (continues every method's own cache)", scale=4)
            ask_btn = gr.Button("Ask", scale=1)
        with gr.Row():
            bars = gr.Plot(label="Retained ratio per layer")
            lorenz = gr.Plot(label="Lorenz curves")
        with gr.Row():
            memory = gr.Plot(label="KV memory")
            latency = gr.Plot(label="Latency")

        with gr.Row():
            export_btn = gr.Button("Export for papers (PNG/SVG/PDF, JSON, CSV, LaTeX, Markdown)")
        export_files = gr.File(label="Exported files", file_count="multiple")
        export_status = gr.Markdown()

        outputs = [state, *panels, bars, lorenz, memory, latency]
        run_event = run_btn.click(_run_guarded(compare), [image, prompt, methods, budget, max_new, state], outputs,
                                  api_name="compare")
        ask_event = ask_btn.click(_run_guarded(follow_up), [followup, state], outputs, api_name="follow_up")
        stop_btn.click(stop, [state], None, cancels=[run_event, ask_event], api_name="stop")
        export_btn.click(export, [state], [export_files, export_status], api_name="export")
    return demo
