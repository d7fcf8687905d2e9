"""PrefixKV: one global information-retention threshold p, found by bisection, gives every layer the
smallest prefix of its importance-sorted tokens that retains p of its attention. Layers whose importance
is concentrated keep few tokens; layers whose importance is spread keep many."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import StatRequest
from ..lorenz import bisect_threshold, distribute, retention_curves
from .base import (DecodeView, LayerPlan, Policy, PolicyError, PrefillView, budget_count, fixed_point_decode,
                   layer_importance, protected_mask, top_k_keep)

MODES = ("online", "offline")


@dataclass
class PrefixKVPolicy(Policy):
    name = "prefixkv"
    label = "PrefixKV"
    summary = ("Adaptive per-layer budgets: a global retention threshold found by bisection on the layers' "
               "Lorenz curves; offline mode uses ratios calibrated once per model and budget.")

    mode: str = "online"
    # Offline: per-layer kept ratios (mean = budget). The engine fills them from the calibrated file.
    ratios: list[float] | None = None
    normalised_importance: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise PolicyError(f"unknown PrefixKV mode {self.mode!r}; accepted: {', '.join(MODES)}")

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(colsum=True)

    def plans_rows_together(self) -> bool:
        return self.mode == "offline"  # the online search is per sample; calibrated ratios are shared

    def layer_counts(self, view: PrefillView) -> list[int]:
        n, n_layers = view.prompt_len, view.num_layers
        total = int(round(self.budget * n * n_layers))
        if self.mode == "offline":
            if not self.ratios or len(self.ratios) != n_layers:
                raise PolicyError(
                    f"offline PrefixKV needs {n_layers} calibrated layer ratios; run "
                    "`python -m prefixkv_core calibrate` for this model or use mode='online'"
                )
            self.threshold = None
            return distribute(total, list(self.ratios), low=min(2, n), high=n)
        importance = torch.cat([layer_importance(view, i, self.normalised_importance)[0] for i in range(n_layers)])
        result = bisect_threshold(retention_curves(importance), self.budget, min_keep=min(2, n))
        self.threshold, self.iterations, self.converged = result.threshold, result.iterations, result.converged
        return result.counts

    def prefill(self, view: PrefillView):
        if self.mode == "online" and view.cache.layers[0].positions.shape[0] != 1:
            # the searched per-layer counts depend on the sample; offline ratios are shared by every row
            raise ValueError("online PrefixKV's per-layer search runs with batch size 1 only; "
                             "use mode='offline' (calibrated or fixed ratios) for batches")
        counts = self.layer_counts(view)
        self.anchors = counts
        self.layer_ratios = [c / view.prompt_len for c in counts]
        plans = []
        for i, k in enumerate(counts):
            layer = view.layer(i)
            imp = layer_importance(view, i, self.normalised_importance)
            plans.append(LayerPlan(keep=top_k_keep(imp, k, protected_mask(layer, view.prompt_len)[:, :1])))
        return plans

    def decode(self, view: DecodeView):
        targets = [budget_count(r, view.true_len, min_keep=2) for r in self.layer_ratios]
        return fixed_point_decode(view, targets, self.anchors)

    def extras(self):
        out = super().extras()
        out["mode"] = self.mode
        if getattr(self, "threshold", None) is not None:
            out["threshold"] = round(self.threshold, 6)
        if getattr(self, "layer_ratios", None):
            out["layer_ratios"] = [round(r, 4) for r in self.layer_ratios]
        return out
