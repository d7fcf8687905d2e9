"""Numpy faces of prefixkv_core.report.lorenz, so the chart code never handles torch tensors itself."""
from __future__ import annotations

import numpy as np
import torch

from prefixkv_core.report import lorenz


def _t(importance: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(importance, dtype=np.float32))


def retention_curves(importance: np.ndarray) -> np.ndarray:
    """[L, N] -> [L, N+1]: share of importance held by the k most important tokens, k = 0..N."""
    return lorenz.retention_curves(_t(importance)).numpy()


def gini(importance: np.ndarray) -> np.ndarray:
    """[L, N] -> [L] Gini coefficients in [0, 1]."""
    return lorenz.gini(_t(importance)).numpy()


def bisect_threshold(importance: np.ndarray, budget: float) -> float:
    """PrefixKV's global retention threshold p for `budget` on these importances."""
    curves = lorenz.retention_curves(_t(importance))
    return float(lorenz.bisect_threshold(curves, float(budget), min_keep=min(2, curves.shape[-1] - 1)).threshold)
