"""Calibrated PrefixKV configurations on disk: per-layer kept ratios for one model and budget, one JSON file each
in assets/prefix_configs/<model-slug>/budget-<r>.json (written by `python -m prefixkv_core calibrate`), read by
offline PrefixKV (interpolated between calibrated budgets)."""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from ..models.assets import ASSETS

CONFIG_ROOT = ASSETS / "prefix_configs"
# Random weights in a released model's shapes read that model's configuration when they have none of their own: a
# speed run in those shapes is about the per-layer lengths the released model's offline PrefixKV keeps (its
# authors' Table 3 setting). The LLaVA-1.5 configurations are the ratios the authors released.
SHAPES_OF = {"random-llava-1.5-7b": "llava-hf--llava-1.5-7b-hf", "random-llava-1.5-13b": "llava-hf--llava-1.5-13b-hf",
             "random-embedded": "embedded-smollm2-135m"}


@dataclass
class Calibration:
    ratios: list[float]
    source: str  # file used, or "interpolated between A and B"


def config_path(slug: str, budget: float, root: Path = CONFIG_ROOT) -> Path:
    return root / slug / f"budget-{budget:.2f}.json"


def _available(slug: str, root: Path) -> dict[float, Path]:
    folder = root / slug
    found = {}
    for path in sorted(folder.glob("budget-*.json")) if folder.is_dir() else []:
        try:
            found[float(path.stem.split("-", 1)[1])] = path
        except ValueError:
            continue
    return found


def rescale_to_budget(ratios: np.ndarray, budget: float) -> list[float]:
    """Scale ratios so their mean is the budget, respecting the [0, 1] bounds (excess moved to others)."""
    r = np.clip(np.asarray(ratios, dtype=np.float64), 1e-6, 1.0)
    for _ in range(50):
        r = np.clip(r * (budget / r.mean()), 1e-6, 1.0)
        if abs(r.mean() - budget) < 1e-9:
            break
    return [float(x) for x in r]


def load_ratios(slug: str, budget: float, num_layers: int, root: Path = CONFIG_ROOT) -> Calibration | None:
    """The calibrated ratios for this budget; between two calibrated budgets, interpolate and rescale."""
    files = _available(slug, root)
    if not files and slug in SHAPES_OF:
        files = _available(SHAPES_OF[slug], root)
    if not files:
        return None

    def read(path: Path) -> np.ndarray:
        data = json.loads(path.read_text())
        ratios = np.asarray(data["ratios"], dtype=np.float64)
        if ratios.shape != (num_layers,):
            raise ValueError(f"{path} has {ratios.size} layer ratios, the model has {num_layers} layers")
        return ratios

    for b, path in files.items():
        if abs(b - budget) < 1e-6:
            return Calibration(rescale_to_budget(read(path), budget), str(path))
    budgets = sorted(files)
    lower = max((b for b in budgets if b < budget), default=budgets[0])
    upper = min((b for b in budgets if b > budget), default=budgets[-1])
    if lower == upper:
        return Calibration(rescale_to_budget(read(files[lower]), budget), f"rescaled from {files[lower].name}")
    w = (budget - lower) / (upper - lower)
    mixed = (1 - w) * read(files[lower]) + w * read(files[upper])
    return Calibration(rescale_to_budget(mixed, budget),
                       f"interpolated between {files[lower].name} and {files[upper].name}")


def write_config(slug: str, model_name: str, budget: float, ratios: Iterable[float], num_samples: int,
                 root: Path = CONFIG_ROOT, extra: dict | None = None,
                 samples: list[dict[str, str]] | None = None) -> Path:
    """Write one config; `samples` (the calibration samples, as from `default_samples`) are recorded so
    anyone can check they are disjoint from the evaluation data."""
    path = config_path(slug, budget, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model_name,
        "slug": slug,
        "budget": round(budget, 4),
        "ratios": [round(float(r), 6) for r in ratios],
        "num_samples": num_samples,
        "date": _dt.date.today().isoformat(),
    }
    if samples is not None:
        payload["calibration_samples"] = [dict(x) for x in samples]
    payload.update(extra or {})
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
