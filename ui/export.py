"""Export for papers: every chart as PNG (scale 3), SVG and PDF in a clean print style, all charts as one
interactive HTML file, the results as JSON and CSV, the results in kvpress's leaderboard layout
(leaderboard.csv), a LaTeX table of the metrics, the transcript as Markdown, and a zip of everything.

Static images need a Chromium/Chrome (kaleido 1.x drives one through choreographer). The browser is taken
from BROWSER_PATH, else found on PATH (chromium, google-chrome, ...). Without one the static formats are
skipped with a message and the HTML, JSON, CSV, LaTeX and Markdown files are still written.
"""
from __future__ import annotations

import copy
import csv
import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import plotly.graph_objects as go

from prefixkv_core.report import leaderboard
from prefixkv_core.policies import REGISTRY, held_in_equal_memory, role_label, role_method
from prefixkv_core.report.record import mode_title

from .theme import PAPER_FONT

log = logging.getLogger(__name__)

STATIC_FORMATS = ("png", "svg", "pdf")
ALL_FORMATS = (*STATIC_FORMATS, "html")
PNG_SCALE = 3
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
STATIC_TIMEOUT_S = 240  # every render of an export together
STATIC_STALL_S = 45  # a render that writes no figure for this long is given up ...
STATIC_ATTEMPTS = 3  # ... and the figures left go to a fresh browser, this many renders in all


@dataclass
class ExportResult:
    directory: str
    files: list[str] = field(default_factory=list)  # individual files, zip first
    zip_path: str | None = None
    messages: list[str] = field(default_factory=list)
    static_ok: bool = False


def find_browser() -> str | None:
    """A Chromium-family executable for kaleido, or None. Sets BROWSER_PATH so choreographer uses it."""
    env = os.environ.get("BROWSER_PATH")
    if env and os.path.isfile(env) and os.access(env, os.X_OK):
        return env
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            os.environ["BROWSER_PATH"] = path
            return path
    return None


def paper_figure(fig: go.Figure, width: int = 720, height: int | None = None) -> go.Figure:
    """A copy in print style: white background, black axes, no in-figure title (it goes in the caption)."""
    out = go.Figure(copy.deepcopy(fig.to_dict()))
    h = height or int(out.layout.height or 420)
    out.update_layout(template="simple_white", font=PAPER_FONT, title=None, width=width, height=h,
                      paper_bgcolor="white", plot_bgcolor="white", margin=dict(l=70, r=20, t=40, b=60))
    out.update_xaxes(showgrid=False, linecolor="black", tickcolor="black", mirror=False)
    out.update_yaxes(showgrid=True, gridcolor="#ececec", linecolor="black", tickcolor="black", mirror=False)
    return out


def _reference_label() -> str:
    """The label of the method ROUGE-L and speed-ups are measured against (its policy plays "reference")."""
    return role_label("reference", "the reference")


def run_mode(results: Mapping[str, Any]) -> str:
    """Which mode produced these results, in words ('published budgets, query-aware', ...)."""
    return mode_title(results.get("budget_mode", "published"), bool(results.get("query_agnostic", False)))


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "figure"


# -- tables ----------------------------------------------------------------------------------------------------

def timing_note(results: Mapping[str, Any]) -> str:
    """One sentence saying how the timings were taken (for the table caption and the transcript)."""
    timing = results.get("timing") or {}
    batch = timing.get("batch")
    parts = []
    if timing.get("batched", True):
        shared = (f"; their one forward per token took {batch['forward_ms_per_step']:.1f} ms, shared by "
                  f"{batch['methods']} methods" if batch else "")
        parts.append(f"The methods decoded as one batch{shared}; policy = each method's own policy time per "
                     "token in that run")
    else:
        parts.append("Each method decoded on its own; policy = its own policy time per token")
    if timing.get("alone"):
        parts.append(f"TTFT, tokens/s and speed-up (tokens/s over {_reference_label()}'s) were measured with each "
                     "method decoded alone, from its own prefill")
    else:
        parts.append("per-method TTFT and tokens/s were not measured (time each method alone for them)")
    return ". ".join(parts) + "."


def result_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per method from Comparison.to_dict(). `ttft_s` / `tokens_per_s` are the main run's (its
    `timing`: batched, sharing each step's forward, or alone); the `alone_*` columns the method on its own."""
    rows = []
    for method, r in results.get("methods", {}).items():
        mean_kept = r.get("mean_kept_ratio")
        alone = r.get("alone") or {}
        rows.append({
            "method": method, "label": r.get("label"), "stage": r.get("stage"), "status": r.get("status"),
            "tokens": r.get("tokens"),
            "kv_mb": r.get("kv_mb"), "kv_ratio": r.get("kv_ratio"),
            "kept_ratio_mean": round(mean_kept, 4) if mean_kept is not None else None,
            "policy_ms_per_token": r.get("policy_ms_per_token"), "compress_ms": r.get("compress_ms"),
            "timing": r.get("timing"), "tokens_per_s": r.get("tokens_per_s"), "ttft_s": r.get("ttft_s"),
            "alone_ttft_s": alone.get("ttft_s"), "alone_tokens_per_s": alone.get("tokens_per_s"),
            "alone_ms_per_token": alone.get("ms_per_token"), "speedup_vs_full_alone": r.get("speedup_vs_full"),
            "alone_same_answer": alone.get("same_answer"),
            "rouge_l_vs_full": r.get("rouge_l_vs_full"),
            "threshold": (r.get("extras") or {}).get("threshold"), "error": r.get("error"),
        })
    return rows


def results_csv(results: Mapping[str, Any]) -> str:
    rows = result_rows(results)
    buf = io.StringIO()
    fields = list(rows[0]) if rows else ["method"]
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


LEADERBOARD_DATASET = "chat"  # the app's results: one conversation, each turn a task


def leaderboard_rows(results: Mapping[str, Any]) -> tuple[list[leaderboard.LeaderboardRow], list[str]]:
    """This comparison in kvpress's leaderboard layout (prefixkv_core.report.leaderboard): a row per method at its
    compression ratio (1 - r; Full 0; a budget-free method at its measured ratio), a task per turn whose score is
    the method's ROUGE-L F1 × 100 against Full's answer to that turn. Returns (rows, tasks)."""
    methods = results.get("methods", {})
    n_turns = max((len(r.get("rouge_l_per_turn") or []) for r in methods.values()), default=0)
    tasks = [f"turn_{i + 1}" for i in range(n_turns)]
    budget_mode = results.get("budget_mode", "published")
    query_aware = not results.get("query_agnostic", False)
    reference = role_method("reference")  # the uncompressed method: nothing removed
    rows = []
    for method, r in methods.items():
        fixed = method in REGISTRY and not REGISTRY[method].uses_budget
        ratio = 0.0 if method == reference else leaderboard.compression_ratio(
            None if fixed else results.get("budget"), r.get("kv_ratio"))
        per_turn = list(r.get("rouge_l_per_turn") or [])
        scores = {t: (None if i >= len(per_turn) or per_turn[i] is None else round(100.0 * per_turn[i], 2))
                  for i, t in enumerate(tasks)}
        name = leaderboard.method_name(method, query_aware=query_aware, held=held_in_equal_memory(
            method, budget_mode, results.get("knobs") or {}))
        rows.append(leaderboard.LeaderboardRow(LEADERBOARD_DATASET, "", str(results.get("model") or ""), name, ratio,
                                               scores))
    return rows, tasks


def results_leaderboard_csv(results: Mapping[str, Any]) -> str:
    rows, tasks = leaderboard_rows(results)
    return leaderboard.to_csv(rows, tasks)


_LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                  "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in str(text))


def _num(v: Any, fmt: str) -> str:
    return "--" if v is None else format(v, fmt)


def results_latex(results: Mapping[str, Any]) -> str:
    """A booktabs table: the method's stage, KV size, share of full, mean kept ratio, ROUGE-L vs Full, the
    method's own policy time and, when each method was timed alone, its TTFT, throughput and speed-up over Full;
    the caption says how."""
    rows = result_rows(results)
    model = latex_escape(results.get("model") or "the model")
    budget = results.get("budget")
    alone = bool((results.get("timing") or {}).get("alone"))
    head = r"Method & Stage & KV (MB) & KV (\% of full) & Kept ratio & ROUGE-L & Policy (ms/token)"
    if alone:
        head += r" & TTFT alone (ms) & Tokens/s alone & Speed-up alone"
    lines = [
        r"% requires \usepackage{booktabs}",
        r"\begin{table}[t]",
        r"  \centering",
        rf"  \caption{{KV-cache compression on {model} at budget $r = {budget:.2f}$, "
        rf"{latex_escape(run_mode(results))} (ROUGE-L against the uncompressed answer). "
        rf"{latex_escape(timing_note(results))}}}",
        r"  \label{tab:kv-compression}",
        r"  \begin{tabular}{ll" + "r" * (8 if alone else 5) + "}",
        r"    \toprule",
        f"    {head} \\\\",
        r"    \midrule",
    ]
    for row in rows:
        ratio = None if row["kv_ratio"] is None else row["kv_ratio"] * 100
        cells = [latex_escape(row["label"]), latex_escape(row["stage"] or "--"), _num(row["kv_mb"], ".3f"),
                 _num(ratio, ".1f"), _num(row["kept_ratio_mean"], ".2f"), _num(row["rouge_l_vs_full"], ".3f"),
                 _num(row["policy_ms_per_token"], ".2f")]
        if alone:
            ttft = None if row["alone_ttft_s"] is None else row["alone_ttft_s"] * 1000
            speed = row["speedup_vs_full_alone"]
            cells += [_num(ttft, ".0f"), _num(row["alone_tokens_per_s"], ".1f"),
                      "--" if speed is None else f"{speed:.2f}$\\times$"]
        lines.append("    " + " & ".join(cells) + " \\\\")
    lines += [r"    \bottomrule", r"  \end{tabular}", r"\end{table}", ""]
    return "\n".join(lines)


def visuals_line(visuals: Mapping[str, Any]) -> str:
    """'3 images (384×384, 640×480, 384×384); video clip-0.mp4, 8 of its 16 frames (0.0 to 3.8 s)', or ''."""
    images, video, parts = visuals.get("images") or [], visuals.get("video"), []
    if images:
        sizes = ", ".join(f"{w}×{h}" for w, h in images)
        parts.append(f"{len(images)} image{'s' if len(images) != 1 else ''} ({sizes})")
    if video:
        stamps = video.get("timestamps") or [0.0]
        parts.append(f"video {video.get('source')}, {video.get('frames')} of its {video.get('total_frames')} frames "
                     f"({stamps[0]:.1f} to {stamps[-1]:.1f} s)")
    return "; ".join(parts)


def transcript_markdown(results: Mapping[str, Any]) -> str:
    """The conversation, turn by turn, with every method's answer and its final badges."""
    out = ["# KV-cache compression comparison", "",
           f"- model: `{results.get('model')}` on {results.get('device')}",
           f"- budget r = {results.get('budget')}",
           f"- mode: {run_mode(results)}",
           f"- settings: {json.dumps(results.get('settings', {}))}"]
    knobs = {m: k for m, k in (results.get("knobs") or {}).items() if k}
    if knobs:
        out.append(f"- knobs: {json.dumps(knobs)}")
    pre = results.get("prefill")
    if pre:
        out.append(f"- prompt: {pre['prompt_tokens']} tokens ({pre['image_tokens']} image), "
                   f"{pre['num_layers']} layers, prefill {pre['prefill_s']} s")
    seen = visuals_line(results.get("visuals") or {})
    if seen:
        out.append(f"- visuals: {seen}")
    methods = results.get("methods", {})
    for i, prompt in enumerate(results.get("prompts", [])):
        out += ["", f"## Turn {i + 1}", "", "**User:** " + prompt.strip(), ""]
        for method, r in methods.items():
            answers = r.get("answers") or []
            answer = answers[i] if i < len(answers) else ""
            out += [f"### {r.get('label', method)}", "", (answer.strip() or "_(no answer)_"), ""]
    out += ["## Final metrics", "", timing_note(results), "",
            f"| method | stage | KV (MB) | KV % of full | ROUGE-L vs {_reference_label()} | policy (ms/token) | "
            "TTFT alone (s) | "
            "tokens/s alone | speed-up alone | status |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def cell(v: Any, suffix: str = "") -> str:
        return "" if v is None else f"{v}{suffix}"

    for row in result_rows(results):
        ratio = None if row["kv_ratio"] is None else f"{row['kv_ratio'] * 100:.1f}"
        out.append(f"| {row['label']} | {row['stage'] or ''} | {cell(row['kv_mb'])} | {cell(ratio)} | "
                   f"{cell(row['rouge_l_vs_full'])} | {cell(row['policy_ms_per_token'])} | "
                   f"{cell(row['alone_ttft_s'])} | {cell(row['alone_tokens_per_s'])} | "
                   f"{cell(row['speedup_vs_full_alone'], 'x')} | {row['status']} |")
    return "\n".join(out) + "\n"


# -- figures ---------------------------------------------------------------------------------------------------

def _write_static(jobs: list[tuple[go.Figure, Path, str]]) -> None:
    import plotly.io as pio

    figs = [f for f, _, _ in jobs]
    pio.write_images(figs, [str(p) for _, p, _ in jobs], format=[fmt for _, _, fmt in jobs],
                     scale=[PNG_SCALE if fmt == "png" else 1 for _, _, fmt in jobs],
                     width=[int(f.layout.width or 720) for f in figs],
                     height=[int(f.layout.height or 420) for f in figs])


def write_static(jobs: list[tuple[go.Figure, Path, str]], timeout: float = STATIC_TIMEOUT_S,
                 stall_s: float = STATIC_STALL_S) -> str | None:
    """Render with kaleido on a helper thread; returns an error message or None.

    Kaleido's browser now and then never answers (it hangs at its start, rarely mid-way): a render that writes no
    new file for `stall_s` is given up and the figures not written yet go to a fresh browser, up to
    `STATIC_ATTEMPTS` renders and `timeout` seconds in all. A slow render that keeps writing is left to finish."""
    deadline = time.monotonic() + timeout
    left = list(jobs)
    def work(todo: list, box: dict) -> None:  # each render its own box: a stalled one that fails later tells no one
        try:
            _write_static(todo)
        except BaseException as exc:  # noqa: BLE001 - reported to the user as one line
            box["error"] = exc

    for attempt in range(1, STATIC_ATTEMPTS + 1):
        box: dict[str, Any] = {}
        t = threading.Thread(target=work, args=(list(left), box), name="kaleido-export", daemon=True)
        t.start()
        written, progress = 0, time.monotonic()
        while t.is_alive() and time.monotonic() < min(deadline, progress + stall_s):
            t.join(0.25)
            now_written = sum(path.exists() for _, path, _ in left)
            if now_written > written:
                written, progress = now_written, time.monotonic()
        if not t.is_alive():
            if "error" not in box:
                return None
            exc = box["error"]
            log.warning("static export failed: %r", exc)
            return f"static export failed ({exc.__class__.__name__}: {str(exc)[:200]})"
        left = [job for job in left if not job[1].exists()]
        if not left:  # every figure written; the browser is slow to close
            return None
        if time.monotonic() >= deadline:
            return f"static export timed out after {timeout:.0f} s"
        log.warning("static export: no figure written in %.0f s (render %d of %d), %d left", stall_s, attempt,
                    STATIC_ATTEMPTS, len(left))
    return f"static export stalled: the browser wrote no figure for {stall_s:.0f} s, {STATIC_ATTEMPTS} times"


def figures_html(figures: Mapping[str, go.Figure], title: str = "KV-cache comparison") -> str:
    """All charts in one self-contained, interactive HTML page (plotly.js embedded once)."""
    parts = []
    for i, (name, fig) in enumerate(figures.items()):
        parts.append(f"<section><h2>{name}</h2>"
                     + fig.to_html(full_html=False, include_plotlyjs=(i == 0)) + "</section>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            "<style>body{font-family:Helvetica,Arial,sans-serif;max-width:1100px;margin:auto}</style>"
            f"</head><body><h1>{title}</h1>{''.join(parts)}</body></html>")


def export_all(figures: Mapping[str, go.Figure], results: Mapping[str, Any], formats=ALL_FORMATS,
               out_root: str | None = None, images: Mapping[str, Any] | None = None) -> ExportResult:
    """Write every requested artefact under a fresh directory and zip it. Never raises for a missing browser.
    `images` (name -> PIL image, e.g. the patch overlays) are saved as PNG next to the figures."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(tempfile.mkdtemp(prefix="prefixkv-export-", dir=out_root))
    base = root / f"kv-compare-{stamp}"
    fig_dir = base / "figures"
    fig_dir.mkdir(parents=True)
    result = ExportResult(directory=str(base))
    formats = [f for f in formats if f in ALL_FORMATS]

    files: list[Path] = []
    (base / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (base / "results.csv").write_text(results_csv(results))
    (base / "leaderboard.csv").write_text(results_leaderboard_csv(results))
    (base / "table.tex").write_text(results_latex(results))
    (base / "transcript.md").write_text(transcript_markdown(results))
    files += [base / "results.json", base / "results.csv", base / "leaderboard.csv", base / "table.tex",
              base / "transcript.md"]

    mode = run_mode(results)  # every caption and title says which mode produced the figure
    # the latency chart's caption also says how its timings were taken
    notes = {name: f". {timing_note(results)}" if name == "latency" else "" for name in figures}
    titles = {name: f"{fig.layout.title.text or name}{notes[name]} [{mode}]" for name, fig in figures.items()}
    (base / "figures" / "captions.md").write_text(
        "\n".join(f"- `{slug(n)}`: {re.sub('<[^>]+>', '', t)}" for n, t in titles.items()) + "\n")
    for name, img in (images or {}).items():
        path = fig_dir / f"{slug(name)}.png"
        img.save(path)
        files.append(path)
    if "html" in formats and figures:
        (fig_dir / "figures.html").write_text(figures_html(figures, f"KV-cache comparison [{mode}]"))
        files.append(fig_dir / "figures.html")

    static = [f for f in formats if f in STATIC_FORMATS]
    if static and figures:
        browser = find_browser()
        if browser is None:
            result.messages.append("No Chromium or Chrome found (set BROWSER_PATH or install chromium): "
                                   "PNG/SVG/PDF skipped; the interactive HTML and the tables were exported.")
        else:
            jobs = []
            for name, fig in figures.items():
                paper = paper_figure(fig)
                for fmt in static:
                    jobs.append((paper, fig_dir / f"{slug(name)}.{fmt}", fmt))
            t0 = time.perf_counter()
            err = write_static(jobs)
            if err is None:
                result.static_ok = True
                files += [p for _, p, _ in jobs if p.exists()]
                result.messages.append(f"{len(jobs)} figure files ({', '.join(static).upper()}) rendered with "
                                       f"{Path(browser).name} in {time.perf_counter() - t0:.1f} s.")
            else:
                result.messages.append(err + "; the interactive HTML and the tables were exported.")
                files += [p for _, p, _ in jobs if p.exists()]

    zip_path = root / f"kv-compare-{stamp}.zip"
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(base.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(root))
    result.zip_path = str(zip_path)
    result.files = [str(zip_path)] + [str(p) for p in files]
    return result
