"""Offline PrefixKV calibration: per-layer kept ratios estimated once per model and budget from a few
calibration samples, stored as JSON in assets/prefix_configs/<model-slug>/budget-<r>.json (the files are read
and written by `policies/prefix_configs.py`)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .policies.prefix_configs import ASSETS, CONFIG_ROOT, Calibration, config_path, load_ratios, rescale_to_budget, write_config

__all__ = ["ASSETS", "CONFIG_ROOT", "Calibration", "config_path", "load_ratios", "rescale_to_budget", "write_config",
           "DEFAULT_BUDGETS", "calibrate", "default_samples", "load_sample"]

DEFAULT_BUDGETS = tuple(round(0.1 * i, 1) for i in range(1, 10))


CALIBRATION_PROMPTS = (
    "Describe the image in detail.",
    "What objects are in the picture and what colours are they?",
    "Where is each object in the image?",
)
SCENE_REF = "scene:"


def calibration_seeds(n: int) -> list[int]:
    """Scene seeds for calibration: the last `n` seeds of the TRAIN split.

    No evaluation set reads the train split (the built-in set and benchmarks/vision_accuracy.py use the
    test and val splits and the example photos), and the training stages draw from its start, so these
    scenes are seen by neither evaluation nor training."""
    from scenes import SPLITS

    train = SPLITS["train"]
    if not 0 < n <= 1000:
        raise ValueError(f"calibration uses 1 to 1000 samples, asked for {n}")
    return list(train[len(train) - n:])


def default_samples(n: int = 10) -> list[dict[str, str]]:
    """Calibration samples as written into the config files: {"image": "scene:<seed>", "prompt": ...}."""
    return [{"image": f"{SCENE_REF}{seed}", "prompt": CALIBRATION_PROMPTS[i % len(CALIBRATION_PROMPTS)]}
            for i, seed in enumerate(calibration_seeds(n))]


def load_sample(sample: dict[str, str]) -> tuple[Any, str]:
    """A recorded calibration sample -> (image, prompt) for the engine (scenes rendered, paths as is)."""
    from scenes import render_scene

    image = sample.get("image")
    if image and image.startswith(SCENE_REF):
        image = render_scene(int(image[len(SCENE_REF):])).image
    return image, sample["prompt"]


def calibrate(engine, samples, budgets=DEFAULT_BUDGETS, progress: bool = True) -> dict[float, dict]:
    """Per budget: the online PrefixKV layer ratios of each sample, averaged and rescaled to the budget.

    `samples`: (image, prompt) pairs or recorded samples ({"image": "scene:<seed>" or a path, "prompt"})."""
    import torch
    from tqdm.auto import tqdm

    from .report.lorenz import bisect_threshold, retention_curves

    curves = []
    for sample in tqdm(samples, desc="calibration prefill", disable=not progress):
        image, prompt = load_sample(sample) if isinstance(sample, dict) else sample
        info = engine.analyse(image, prompt)
        curves.append(retention_curves(torch.from_numpy(info.importance)))
    out = {}
    for budget in budgets:
        runs = [bisect_threshold(c, budget, min_keep=min(2, c.shape[-1] - 1)) for c in curves]
        mean = np.mean([r.ratios for r in runs], axis=0)
        out[budget] = {
            "ratios": rescale_to_budget(mean, budget),
            "threshold_mean": float(np.mean([r.threshold for r in runs])),
            "threshold_std": float(np.std([r.threshold for r in runs])),
        }
    return out
