"""Shared pieces of the benchmark scripts: run facts (machine, commit, date), tables written as Markdown /
CSV / LaTeX, Plotly figures written as HTML (and PNG when a Chromium is present), an append-only JSONL
record store for resumable runs, and the process's peak memory for CPU runs."""
from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from prefixkv_core.policies import REGISTRY
from prefixkv_core.policies import parse_knobs as parse_knob_items
from prefixkv_core.report.provenance import git_commit  # noqa: F401 - the benchmarks record it
from prefixkv_core.report.record import BUDGET_MODE_TITLES, mode_title as run_title  # noqa: F401 - used by the scripts

REPO_ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"

# How budgeted methods were compared (prefixkv_core.policies.BUDGET_MODES) and whether the prompt was compressed
# with the question in view or before it: every table and figure title says which (run_title).
MODE_TITLES = BUDGET_MODE_TITLES
_labels = [c.label for c in REGISTRY.values() if c.uses_budget and c.schedule == "prompt only"]
PROMPT_ONLY = ", ".join(_labels[:-1]) + " and " + _labels[-1] if len(_labels) > 1 else "".join(_labels)
MODE_NOTES = {
    "published": f"Budgets as published: {PROMPT_ONLY} compress the prompt once and their cache grows "
                 "while decoding; the other budgeted methods hold about r·N_t at every step.",
    "equal_memory": f"Equal memory: every budgeted method holds about r·N_t at every step ({PROMPT_ONLY} held "
                    "while decoding as the every-step methods hold themselves: a recent window of half the budget, a "
                    "fed question whole, the prompt's entries evicted by the method's own ranking).",
}
QUERY_NOTES = {
    False: "Query-aware: the whole prompt, question included, is prefilled and then compressed (the question is in "
           "the methods' observation window).",
    True: "Query-agnostic: the image and any text before the question are prefilled and compressed first; the "
          "question is then fed through each compressed cache and the answer decoded on it.",
}


# -- run facts ---------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: Any = None) -> str:
    """'NVIDIA H100 80GB HBM3' on CUDA, else '<cpu model>, N cores'."""
    import torch

    dev = str(device) if device is not None else ""
    if dev.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(dev).index or 0
        return torch.cuda.get_device_name(idx)
    return f"{cpu_name()}, {os.cpu_count()} cores"


def run_info(device: Any = None) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": git_commit(),
        "machine": machine_description(device),
        "host": platform.node(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


# -- tables ------------------------------------------------------------------------------------------------

@dataclass
class Table:
    """A methods x budgets (or any rows x columns) table of numbers; None = no value, str = a status (OOM)."""

    title: str
    row_header: str
    rows: list[str]
    columns: list[str]
    values: dict[tuple[str, str], Any] = field(default_factory=dict)
    digits: int = 3
    best: str | None = None  # "min" or "max": bold the best value of each column (rows in `exclude` skipped)
    exclude_from_best: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    def cell(self, row: str, col: str) -> str:
        v = self.values.get((row, col))
        if v is None:
            return "-"
        if isinstance(v, str):
            return v
        if isinstance(v, float) and not math.isfinite(v):
            return "inf" if v > 0 else "nan"
        return f"{v:.{self.digits}f}" if isinstance(v, float) else str(v)

    def best_rows(self, col: str) -> set[str]:
        if self.best not in ("min", "max"):
            return set()
        nums = {r: self.values.get((r, col)) for r in self.rows if r not in self.exclude_from_best}
        nums = {r: v for r, v in nums.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if len(nums) < 2:
            return set()
        target = (min if self.best == "min" else max)(round(v, self.digits) for v in nums.values())
        return {r for r, v in nums.items() if round(v, self.digits) == target}

    def to_markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join([self.row_header] + self.columns) + " |",
               "|" + "---|" * (len(self.columns) + 1)]
        bold = {c: self.best_rows(c) for c in self.columns}
        for r in self.rows:
            cells = [f"**{self.cell(r, c)}**" if r in bold[c] else self.cell(r, c) for c in self.columns]
            out.append("| " + " | ".join([r] + cells) + " |")
        out += [""] + [f"{n}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow([self.row_header] + self.columns)
        for r in self.rows:
            w.writerow([r] + ["" if self.values.get((r, c)) is None else self.cell(r, c) for c in self.columns])
        return buf.getvalue()

    def to_latex(self) -> str:
        def esc(s: str) -> str:
            for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#")):
                s = s.replace(a, b)
            return s

        bold = {c: self.best_rows(c) for c in self.columns}
        lines = [r"\begin{table}[t]", r"\centering", r"\small",
                 r"\begin{tabular}{l" + "r" * len(self.columns) + "}", r"\toprule",
                 " & ".join([esc(self.row_header)] + [esc(c) for c in self.columns]) + r" \\", r"\midrule"]
        for r in self.rows:
            cells = [(r"\textbf{" + esc(self.cell(r, c)) + "}") if r in bold[c] else esc(self.cell(r, c))
                     for c in self.columns]
            lines.append(" & ".join([esc(r)] + cells) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}", r"\caption{" + esc(self.title) + "}", r"\end{table}"]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path, stem: str) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for ext, text in (("md", self.to_markdown()), ("csv", self.to_csv()), ("tex", self.to_latex())):
            p = out_dir / f"{stem}.{ext}"
            p.write_text(text)
            paths.append(p)
        return paths


# -- figures -----------------------------------------------------------------------------------------------

def find_chromium() -> str | None:
    """The Chromium kaleido should drive: $BROWSER_PATH, /usr/bin/chromium, or one on PATH."""
    for cand in (os.environ.get("BROWSER_PATH"), CHROMIUM, shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def save_figure(fig, stem: Path, png: bool = True, timeout_s: float = 120.0) -> tuple[list[Path], str]:
    """Write `stem`.html (self-contained, always) and `stem`.png (kaleido + Chromium, if present).
    Returns (paths written, a one-line message about the PNG)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    html = stem.with_suffix(".html")
    fig.write_html(str(html), include_plotlyjs=True, full_html=True)
    paths = [html]
    if not png:
        return paths, "PNG not requested"
    browser = find_chromium()
    if browser is None:
        return paths, f"PNG skipped: no Chromium at {CHROMIUM} (install chromium for static export); HTML written"
    os.environ.setdefault("BROWSER_PATH", browser)
    box: dict[str, Any] = {}
    png_path = stem.with_suffix(".png")

    def work():
        try:
            fig.write_image(str(png_path), width=int(fig.layout.width or 1100), height=int(fig.layout.height or 480),
                            scale=2)
        except BaseException as exc:  # noqa: BLE001 - reported as one line
            box["error"] = exc

    t = threading.Thread(target=work, daemon=True, name="kaleido")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return paths, f"PNG skipped: kaleido timed out after {timeout_s:.0f} s"
    if "error" in box:
        exc = box["error"]
        return paths, f"PNG failed ({exc.__class__.__name__}: {str(exc)[:160]})"
    return paths + [png_path], f"PNG written with {browser}"


# -- resumable records -------------------------------------------------------------------------------------

class RecordStore:
    """Append-only JSONL records, one file per process (`<stem>.rank<R>.jsonl`); every shard is read back on
    resume, so a run may continue with a different number of processes. A record's identity is `key(record)`;
    when a key occurs twice the later line wins. A torn last line (a crash mid-write) is ignored."""

    def __init__(self, out_dir: Path, rank: int = 0, stem: str = "records"):
        self.out_dir = Path(out_dir)
        self.stem = stem
        self.path = self.out_dir / f"{stem}.rank{rank}.jsonl"

    def shards(self) -> list[Path]:
        return sorted(self.out_dir.glob(f"{self.stem}.rank*.jsonl"))

    def load(self) -> list[dict[str, Any]]:
        records = []
        for path in self.shards():
            with open(path) as fh:
                for line in fh:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # torn write at a crash
        return records

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            for r in records:
                fh.write(json.dumps(r, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


# -- pauses ------------------------------------------------------------------------------------------------

class Pauses:
    """The stretches in which this process made no progress at all (stopped by a job scheduler on a shared machine,
    SIGSTOP then SIGCONT, or not scheduled): a daemon thread stamps `time.perf_counter()` every `tick_s`; a gap of
    more than `gap_s` between two stamps is a pause. `within(t0, t1)` is how much of [t0, t1] was paused, so a
    timed stretch can count only the time the process ran (`active(t0, t1)`). Costs one wake-up per tick."""

    def __init__(self, tick_s: float = 0.05, gap_s: float = 0.5):
        self.tick_s, self.gap_s = tick_s, gap_s
        self.stretches: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = time.perf_counter()

    def start(self) -> "Pauses":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pauses", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        with self._lock:
            self._last = time.perf_counter()
        while not self._stop.wait(self.tick_s):
            t = time.perf_counter()
            with self._lock:
                if t - self._last > self.gap_s:
                    self.stretches.append((self._last + self.tick_s, t))
                self._last = t

    def within(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] (perf_counter times) that fell in a pause; a pause that ended a moment ago, before
        the stamping thread ran again, counts up to now."""
        now = time.perf_counter()
        with self._lock:
            stretches = list(self.stretches)
            if self._thread is not None and now - self._last > self.gap_s:
                stretches.append((self._last + self.tick_s, now))
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in stretches)

    def active(self, t0: float, t1: float) -> float:
        """t1 - t0 less its paused seconds."""
        return (t1 - t0) - self.within(t0, t1)


# -- memory ------------------------------------------------------------------------------------------------

def current_rss() -> int:
    """Resident set size of this process in bytes (psutil if installed, else /proc/self/statm)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _vm_hwm() -> int | None:
    """This process's peak resident set (VmHWM) in bytes, from /proc/self/status; None where unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _vm_hwm() is not None
    except OSError:
        return False


class TensorPeak:
    """Context manager: the most bytes the CPU tensors held at once over a block, above what they held at its start
    (`.peak_over`), summed from the allocation and free records of torch's profiler. It is the real tensors' figure
    on the CPU, as `torch.cuda.max_memory_allocated` is on CUDA; the resident set cannot give it, because the
    allocator keeps the pages that tensors freed, so one configuration's peak hides the next one's. The profiler
    records every operator, which slows the block: run it on a pass that is not timed."""

    def __enter__(self) -> "TensorPeak":
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self.peak_over = 0
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        records = sorted((r.start_ns(), r.nbytes()) for r in self._prof.profiler.kineto_results.events()
                         if r.name() == "[memory]" and r.device_type().name == "CPU")
        held = 0
        for _, delta in records:
            held += delta
            self.peak_over = max(self.peak_over, held)


class PeakRSS:
    """Context manager for this process's peak RSS over a block; `.peak` and `.start` in bytes.

    On Linux the kernel's own high-water mark is reset at entry and read at exit (exact, no thread that could
    disturb the timings). Elsewhere a thread samples the RSS every `interval_s` (`.method` says which)."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak = 0
        self.start = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.interval_s)

    def __enter__(self):
        self.start = self.peak = current_rss()
        if _reset_hwm():
            self.method = "process peak RSS (kernel VmHWM, reset per configuration)"
            return self
        self.method = f"process RSS sampled every {self.interval_s * 1000:.0f} ms"
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, _vm_hwm() or 0)
        self.peak = max(self.peak, current_rss())
        return False


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def parse_float_list(text: str, name: str = "values") -> list[float]:
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name} expects comma-separated numbers, e.g. 0.1,0.3,0.5; got {text!r}") from None
    if not vals:
        raise SystemExit(f"--{name} is empty")
    return vals


def parse_knobs(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """METHOD.KNOB=VALUE items -> {method: {knob: value}}, through the engine's own parser."""
    try:
        return parse_knob_items(items)
    except ValueError as exc:
        raise SystemExit(f"--knob: {exc}") from None
