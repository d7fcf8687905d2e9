"""Export for papers: figures (PNG at scale 3, SVG, PDF through kaleido and the system chromium; HTML
always), results as JSON and CSV, a LaTeX table, the transcript as Markdown, and one zip of it all."""
from __future__ import annotations

import csv
import json
import os
import shutil
import zipfile
from pathlib import Path

import plotly.graph_objects as go

from prefixkv_core.metrics import rouge_l

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def find_browser() -> str | None:
    for path in (os.environ.get("BROWSER_PATH"), *CHROMIUM_CANDIDATES, shutil.which("chromium")):
        if path and Path(path).exists():
            return path
    return None


def paper_style(fig: go.Figure) -> go.Figure:
    """A clean, print-friendly copy: white background, serif font, no title bar clutter."""
    out = go.Figure(fig)
    out.update_layout(template="simple_white", font=dict(family="Times New Roman, serif", size=14),
                      width=720, height=440, margin=dict(l=70, r=20, t=50, b=60))
    return out


def results_rows(state: dict) -> list[dict]:
    events = state.get("events", {})
    full = events.get("full")
    rows = []
    for name, ev in events.items():
        rows.append({
            "method": name, "label": ev.label, "status": ev.kind, "tokens": ev.step, "full_len": ev.full_len,
            "kv_bytes": ev.kv_bytes, "full_kv_bytes": ev.full_kv_bytes, "kv_ratio": round(ev.kv_ratio, 4),
            "ttft_s": None if ev.ttft_s is None else round(ev.ttft_s, 4),
            "tokens_per_s": None if ev.tokens_per_s is None else round(ev.tokens_per_s, 3),
            "rouge_l_vs_full": round(rouge_l(ev.text, full.text), 4) if full is not None else None,
            "kept_per_layer": ev.kept_per_layer, "kept_image_per_layer": ev.kept_image_per_layer,
            "text": ev.text, "error": ev.error, "extras": ev.extras,
        })
    return rows


def latex_table(rows: list[dict], budget: float | None) -> str:
    lines = [r"\begin{table}[t]", r"\centering",
             rf"\caption{{KV-cache compression at budget $r={budget}$.}}" if budget is not None else r"\caption{}",
             r"\begin{tabular}{lrrrr}", r"\toprule",
             r"Method & KV (\% of full) & TTFT (s) & tokens/s & ROUGE-L \\", r"\midrule"]
    for r in rows:
        def fmt(v, spec):
            return "--" if v is None else format(v, spec)
        lines.append(f"{r['label']} & {100 * r['kv_ratio']:.1f} & {fmt(r['ttft_s'], '.2f')} & "
                     f"{fmt(r['tokens_per_s'], '.1f')} & {fmt(r['rouge_l_vs_full'], '.3f')} \\\\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def transcript(state: dict, user_turns: list[str]) -> str:
    out = ["# Transcript\n"]
    for name, ev in state.get("events", {}).items():
        out.append(f"## {ev.label}\n")
        answers = [a for _, a in state.get("history", {}).get(name, [])] + [ev.text]
        for q, a in zip(user_turns, answers):
            out.append(f"**User:** {q}\n\n**{ev.label}:** {a}\n")
    return "\n".join(out)


def export_all(state: dict, figures: dict[str, go.Figure], folder: Path, user_turns: list[str]) -> tuple[Path, list[str]]:
    """Write everything under `folder`; returns the zip and notes (e.g. no browser for static images)."""
    folder.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    rows = results_rows(state)
    (folder / "results.json").write_text(json.dumps({"budget": state.get("budget"), "methods": rows}, indent=1))
    with open(folder / "results.csv", "w", newline="") as fh:
        flat = [{k: v for k, v in r.items() if k not in ("kept_per_layer", "kept_image_per_layer", "extras")}
                for r in rows]
        if flat:
            writer = csv.DictWriter(fh, fieldnames=list(flat[0]))
            writer.writeheader()
            writer.writerows(flat)
    (folder / "table.tex").write_text(latex_table(rows, state.get("budget")))
    (folder / "transcript.md").write_text(transcript(state, user_turns))
    browser = find_browser()
    if browser:
        os.environ.setdefault("BROWSER_PATH", browser)
    for name, fig in figures.items():
        if fig is None:
            continue
        styled = paper_style(fig)
        styled.write_html(folder / f"{name}.html", include_plotlyjs="cdn")
        if browser is None:
            continue
        try:
            for fmt in ("png", "svg", "pdf"):
                styled.write_image(folder / f"{name}.{fmt}", format=fmt, scale=3 if fmt == "png" else 1)
        except Exception as exc:  # noqa: BLE001 - static export is best effort; HTML is always there
            notes.append(f"static export of {name} failed ({exc.__class__.__name__}); HTML exported")
    if browser is None:
        notes.append("no chromium found: figures exported as HTML only (install chromium for PNG/SVG/PDF)")
    archive = folder.with_suffix(".zip")
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(folder.iterdir()):
            zf.write(path, path.name)
    return archive, notes
