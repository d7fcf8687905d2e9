"""Results in the layout of kvpress's leaderboard: one row per method and compression ratio, the columns
`dataset, data_dir, model, method, compression_ratio, score`, then one score column per task.

kvpress's conventions, kept so rows from here sit beside its own:
- `compression_ratio` is the share of the KV cache REMOVED (kvpress's presses), 1 - r here; the uncompressed run
  is 0.00. A method that ignores the budget (ZipVL, quantisation) gets its measured ratio: 1 - its KV bytes over
  the uncompressed cache's.
- `method` is the method's name, with `_query_aware` when the prompt was compressed with the question in view
  (kvpress evaluates without the question by default and names such runs apart), and `_equal_memory` when the
  equal-memory mode changed how the method ran (a prompt-only method held at r·N_t).
- `score` is higher-is-better and the mean of the task columns. Here a task's score is the mean ROUGE-L F1 ×
  100 of the method's greedy answers against the uncompressed model's (Full's) on that task's samples, so Full
  scores 100.

The quality benchmark (`leaderboard.csv` in its output folder) and the app's export both write it.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

COLUMNS = ("dataset", "data_dir", "model", "method", "compression_ratio", "score")


@dataclass
class LeaderboardRow:
    dataset: str
    data_dir: str
    model: str
    method: str
    compression_ratio: float
    scores: dict[str, float | None] = field(default_factory=dict)  # task -> score (None: not measured)
    # the row's score when it is not the mean of its task columns (a pooled score beside its parts' columns)
    overall: float | None = None

    @property
    def score(self) -> float | None:
        """`overall` when given, else the mean of the measured task scores (None when no task was measured)."""
        if self.overall is not None:
            return round(self.overall, 2)
        got = [s for s in self.scores.values() if s is not None]
        return round(sum(got) / len(got), 2) if got else None


def method_name(method: str, *, query_aware: bool, held: bool = False) -> str:
    """The leaderboard's name for a method run: `_query_aware` when the question was in view while compressing,
    `_equal_memory` when the equal-memory mode held the method."""
    return method + ("_equal_memory" if held else "") + ("_query_aware" if query_aware else "")


def split_method_name(name: str) -> tuple[str, bool, bool]:
    """The inverse of `method_name`: 'snapkv_equal_memory_query_aware' -> ('snapkv', True, True), as
    (method, query_aware, held)."""
    query_aware = name.endswith("_query_aware")
    base = name[: -len("_query_aware")] if query_aware else name
    held = base.endswith("_equal_memory")
    return (base[: -len("_equal_memory")] if held else base), query_aware, held


def compression_ratio(budget: float | None, kv_share: float | None = None) -> float:
    """The removed share of the cache: 1 - r for a budgeted method, 1 - the measured KV share otherwise."""
    if budget is not None:
        return round(1.0 - float(budget), 4)
    return round(1.0 - float(kv_share), 4) if kv_share is not None else 0.0


def task_score(rouge_values: list[float]) -> float | None:
    """A task's score: mean ROUGE-L F1 × 100 (None without samples)."""
    return round(100.0 * sum(rouge_values) / len(rouge_values), 2) if rouge_values else None


def ratio_text(x: float) -> str:
    """0.7 -> '0.70', 0.875 -> '0.875': two decimals as kvpress writes them, more only when needed."""
    text = f"{x:.4f}".rstrip("0")
    return text if len(text.split(".")[1]) >= 2 else f"{x:.2f}"


def to_csv(rows: list[LeaderboardRow], tasks: list[str] | None = None) -> str:
    """The CSV: the leaderboard's columns, then one column per task (in `tasks` order, else sorted), rows sorted by
    method, then compression ratio. Missing scores are empty cells."""
    tasks = list(tasks) if tasks is not None else sorted({t for r in rows for t in r.scores})
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*COLUMNS, *tasks])
    for r in sorted(rows, key=lambda r: (r.method, r.compression_ratio)):
        score = r.score
        writer.writerow([r.dataset, r.data_dir, r.model, r.method, ratio_text(r.compression_ratio),
                         "" if score is None else f"{score:.2f}",
                         *("" if r.scores.get(t) is None else f"{r.scores[t]:.2f}" for t in tasks)])
    return buf.getvalue()
