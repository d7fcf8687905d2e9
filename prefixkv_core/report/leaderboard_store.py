"""The stored leaderboard, read back: every folder under `benchmarks/leaderboard/` that holds a `leaderboard.csv`
(kvpress's layout, `leaderboard.py`), with its `leaderboard-agreement.csv` and `results.json` when present (what
`python -m prefixkv_core.evaluation.sweep` writes), as one point per (task, model, method, query mode, budget
mode, compression ratio) carrying both scores and how the point was produced.

- `accuracy`: the `score` of `leaderboard.csv` (each task's own metric × 100, the mean over the task columns);
- `agreement`: the `score` of `leaderboard-agreement.csv` (the share of answers equal to Full's × 100);
- query mode: from the method's name (`_query_aware`), as the layout defines it;
- budget mode: the run's `budget_mode` in `results.json` (its own `model_args`, else the sweep's); without a
  `results.json`, `_equal_memory` in the name says equal memory;
- `kept_share`: 1 - `compression_ratio`: the budget r of a budgeted method, the measured KV share of a method that
  ignores the budget (ZipVL), 1 for Full;
- provenance: `results.json`'s `command`, `commit` and `model` (with its device and dtype), and the run's own
  budget (when it set the ratio), samples per task and measured KV share.

Plain Python (no policies, no gradio). The folders are chosen here, never by a caller's input. A folder that cannot
be read is skipped and named in `problems`; loading never raises for a bad file.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .leaderboard import COLUMNS, ratio_text, split_method_name

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "benchmarks" / "leaderboard"
SCORES_FILE = "leaderboard.csv"
AGREEMENT_FILE = "leaderboard-agreement.csv"
RESULTS_FILE = "results.json"
MAX_FILE_BYTES = 20 * 2**20  # a leaderboard file larger than this is not read

QUERY_MODES = ("query_aware", "query_agnostic")
BUDGET_MODES = ("published", "equal_memory")
METRICS = ("accuracy", "agreement")
EXPORT_COLUMNS = ("task", "model", "method", "leaderboard_name", "query_mode", "budget_mode", "compression_ratio",
                  "kept_share", "accuracy", "agreement", "budget", "samples_per_task", "measured_kv_share",
                  "commit", "command", "produced_with", "source")


@dataclass
class LeaderboardPoint:
    """One method at one compression ratio, on one task and model, in one query and budget mode."""
    task: str
    model: str
    method: str  # the registry's name, 'snapkv'
    name: str  # the leaderboard's name, 'snapkv_query_aware'
    query_mode: str  # 'query_aware' | 'query_agnostic'
    budget_mode: str  # 'published' | 'equal_memory'
    compression_ratio: float
    accuracy: float | None = None
    agreement: float | None = None
    task_accuracy: dict[str, float | None] = field(default_factory=dict)
    task_agreement: dict[str, float | None] = field(default_factory=dict)
    budget: float | None = None  # the run's r as the sweep was given it
    samples: int | None = None  # samples per task (the fewest of its tasks)
    kv_share: float | None = None  # the measured KV share of the uncompressed cache
    command: str | None = None
    commit: str | None = None
    produced_with: str | None = None  # 'embedded on cpu, dtype auto'
    source: str = ""  # the folder, relative to the leaderboard's root

    @property
    def kept_share(self) -> float:
        """The share of the cache kept: 1 - compression_ratio."""
        return round(1.0 - self.compression_ratio, 4)

    def key(self) -> tuple:
        return (self.task, self.model, self.method, self.query_mode, self.budget_mode,
                ratio_text(self.compression_ratio))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kept_share"] = self.kept_share
        return out

    def export_row(self) -> dict[str, Any]:
        """The flat row of the CSV download (EXPORT_COLUMNS)."""
        return {"task": self.task, "model": self.model, "method": self.method, "leaderboard_name": self.name,
                "query_mode": self.query_mode, "budget_mode": self.budget_mode,
                "compression_ratio": ratio_text(self.compression_ratio), "kept_share": ratio_text(self.kept_share),
                "accuracy": self.accuracy, "agreement": self.agreement, "budget": self.budget,
                "samples_per_task": self.samples, "measured_kv_share": self.kv_share, "commit": self.commit,
                "command": self.command, "produced_with": self.produced_with, "source": self.source}


@dataclass
class LeaderboardStore:
    points: list[LeaderboardPoint] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one line per folder or row that was skipped

    def values(self, attribute: str) -> list[str]:
        """The distinct values of one attribute (task, model, query_mode, budget_mode, method), sorted."""
        return sorted({str(getattr(p, attribute)) for p in self.points})

    def select(self, *, task: str | None = None, model: str | None = None, query_mode: str | None = None,
               budget_mode: str | None = None) -> list[LeaderboardPoint]:
        """The points matching every given filter (None: any), by method then kept share."""
        want = {"task": task, "model": model, "query_mode": query_mode, "budget_mode": budget_mode}
        got = [p for p in self.points if all(v is None or getattr(p, k) == v for k, v in want.items())]
        return sorted(got, key=lambda p: (p.method, p.kept_share))


# -- reading ---------------------------------------------------------------------------------------------------

def _number(text: str | None) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _read_text(path: Path) -> str:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_FILE_BYTES // 2**20} MB")
    return path.read_text(encoding="utf-8")


def read_csv(path: Path) -> dict[tuple[str, str, str, str], tuple[float | None, dict[str, float | None]]]:
    """A leaderboard CSV: (dataset, model, method, compression ratio text) -> (score, task -> score)."""
    reader = csv.DictReader(io.StringIO(_read_text(path)))
    header = tuple(reader.fieldnames or ())
    if header[: len(COLUMNS)] != COLUMNS:
        raise ValueError(f"{path.name} does not start with the columns {', '.join(COLUMNS)}")
    tasks = header[len(COLUMNS):]
    out = {}
    for row in reader:
        ratio = _number(row["compression_ratio"])
        if ratio is None or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{path.name}: compression_ratio {row['compression_ratio']!r} is not in [0, 1]")
        key = (row["dataset"], row["model"], row["method"], ratio_text(ratio))
        out[key] = (_number(row["score"]), {t: _number(row.get(t)) for t in tasks})
    return out


def _produced_with(payload: dict[str, Any], margs: dict[str, Any]) -> str | None:
    model = payload.get("model") or margs.get("pretrained")
    if not model:
        return None
    extra = [f"on {margs['device']}" if margs.get("device") else "",
             f"dtype {margs['dtype']}" if margs.get("dtype") else ""]
    extra = [e for e in extra if e]
    return f"{model}" + (f" ({', '.join(extra)})" if extra else "")


def _matches(value: Any, ratio: float) -> bool:
    try:
        return value is not None and abs(round(1.0 - float(value), 4) - ratio) < 1e-4
    except (TypeError, ValueError):
        return False


def _find_run(payload: dict[str, Any], method: str, query_aware: bool, ratio: float):
    """The results.json run behind one CSV row: the same method (and query mode, when the run says), whose budget
    or measured KV share gives the row's ratio. Returns (run, its model_args, its measured KV share)."""
    shares = payload.get("kv_share") or {}
    for run in payload.get("runs") or []:
        if not isinstance(run, dict) or run.get("method") != method:
            continue
        margs = run.get("model_args") or payload.get("model_args") or {}
        if bool(margs.get("query_agnostic", False)) == query_aware:
            continue
        budget = run.get("budget")
        try:
            kv = shares.get(f"{method}@{float(budget):g}")
        except (TypeError, ValueError):
            kv = None
        if _matches(budget, ratio) or _matches(kv, ratio):
            return run, margs, kv
    return None, payload.get("model_args") or {}, None


def _budget(run: dict[str, Any] | None, ratio: float) -> float | None:
    """The run's budget r when it set the row's ratio (Full and budget-free methods ran beside a budget they
    ignore: None for them)."""
    budget = (run or {}).get("budget")
    return float(budget) if _matches(budget, ratio) else None


def _samples(run: dict[str, Any] | None) -> int | None:
    counts = [n for n in ((run or {}).get("n") or {}).values() if isinstance(n, int)]
    return min(counts) if counts else None


def read_folder(folder: Path, root: Path) -> list[LeaderboardPoint]:
    """The points of one leaderboard folder (raises ValueError / OSError for a file it cannot read)."""
    scores = read_csv(folder / SCORES_FILE)
    agreements = read_csv(folder / AGREEMENT_FILE) if (folder / AGREEMENT_FILE).is_file() else {}
    payload: dict[str, Any] = {}
    if (folder / RESULTS_FILE).is_file():
        payload = json.loads(_read_text(folder / RESULTS_FILE))
        if not isinstance(payload, dict):
            raise ValueError(f"{RESULTS_FILE} is not a JSON object")
    source = folder.relative_to(root).as_posix()
    points = []
    for key in sorted(scores.keys() | agreements.keys()):
        dataset, model, name, ratio = key
        method, query_aware, held = split_method_name(name)
        ratio_value = float(ratio)
        run, margs, kv = _find_run(payload, method, query_aware, ratio_value) if payload else (None, {}, None)
        budget_mode = margs.get("budget_mode") or ("equal_memory" if held else "published")
        accuracy, task_accuracy = scores.get(key, (None, {}))
        agreement, task_agreement = agreements.get(key, (None, {}))
        points.append(LeaderboardPoint(
            task=dataset, model=model, method=method, name=name,
            query_mode="query_aware" if query_aware else "query_agnostic", budget_mode=str(budget_mode),
            compression_ratio=ratio_value, accuracy=accuracy, agreement=agreement, task_accuracy=task_accuracy,
            task_agreement=task_agreement, budget=_budget(run, ratio_value), samples=_samples(run),
            kv_share=None if kv is None else round(float(kv), 4),
            command=payload.get("command"), commit=payload.get("commit"),
            produced_with=_produced_with(payload, margs) if payload else None, source=source))
    return points


def leaderboard_folders(root: Path) -> list[Path]:
    """Every folder under `root` (itself included) that holds a leaderboard.csv, in path order."""
    return sorted(p.parent for p in root.rglob(SCORES_FILE) if p.is_file())


def load_leaderboard(root: Path | str | None = None) -> LeaderboardStore:
    """Every leaderboard folder under `root` (default: the repository's `benchmarks/leaderboard/`). A point that
    another folder already gave (same task, model, method, modes and ratio) is kept from the first folder."""
    root = Path(root) if root is not None else DEFAULT_ROOT
    store = LeaderboardStore()
    if not root.is_dir():
        store.problems.append(f"no leaderboard folder at {root.name}/")
        return store
    seen: dict[tuple, str] = {}
    for folder in leaderboard_folders(root):
        try:
            points = read_folder(folder, root)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            store.problems.append(f"{folder.relative_to(root).as_posix() or '.'}: skipped ({exc})")
            continue
        for p in points:
            if p.key() in seen:
                store.problems.append(f"{p.source}: {p.name} at {ratio_text(p.compression_ratio)} is already in "
                                      f"{seen[p.key()]}; kept that one")
                continue
            seen[p.key()] = p.source
            store.points.append(p)
    return store


# -- writing ---------------------------------------------------------------------------------------------------

def points_csv(points: Iterable[LeaderboardPoint]) -> str:
    """The points as a flat CSV (EXPORT_COLUMNS); missing values are empty cells."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(EXPORT_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for p in points:
        writer.writerow({k: ("" if v is None else v) for k, v in p.export_row().items()})
    return buf.getvalue()


def points_json(points: Iterable[LeaderboardPoint], **context: Any) -> str:
    """The points with every field (per-task scores included), under `points`, beside `context` (the filters)."""
    return json.dumps({**context, "points": [p.as_dict() for p in points]}, indent=1)
