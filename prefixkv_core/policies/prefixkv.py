"""PrefixKV: one global information-retention threshold p, found by bisection, gives every layer the
smallest prefix of its importance-sorted tokens that retains p of its attention. Layers whose importance
is concentrated keep few tokens; layers whose importance is spread keep many."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..attention import StatRequest
from ..lorenz import bisect_threshold, distribute, retention_curves
from .base import (DecodeView, Fact, LayerPlan, Policy, PolicyError, PolicyState, Prefilled, PrefillView,
                   ResolveContext, budget_count, fixed_point_decode, knob, layer_importance, note, protected_mask,
                   top_k_keep)

MODES = ("online", "offline")


@dataclass
class PrefixKVState(PolicyState):
    mode: str = "online"
    threshold: float | None = None  # the retention threshold p found by bisection (online)
    iterations: int = 0
    converged: bool = True
    anchors: list[int] = field(default_factory=list)  # entries kept per layer after the prompt (K_l)
    layer_ratios: list[float] = field(default_factory=list)  # kept share per layer (R_l)


@dataclass(frozen=True)
class PrefixKVPolicy(Policy):
    name = "prefixkv"
    label = "PrefixKV"
    summary = ("Adaptive per-layer budgets: a global retention threshold found by bisection on the layers' "
               "Lorenz curves; offline mode uses ratios calibrated once per model and budget.")
    colour = "#D55E00"  # vermillion: the method the tool is about

    mode: str = knob("online", help="online: bisect the threshold on this prompt; offline: per-layer ratios "
                                    "calibrated once for this model and budget", choices=MODES)
    # Offline: per-layer kept ratios (rescaled to the budget). `resolve` fills them from the calibrated file.
    ratios: tuple[float, ...] | None = knob(None, help="offline per-layer kept ratios (filled from the calibrated "
                                                       "file when not given)", low=0.0, high=1.0, sequence=True,
                                            editable=False)
    normalised_importance: bool = knob(False, help="divide column sums by how many queries see each token")
    ratios_source: str | None = field(default=None, compare=False)  # where `resolve` found the ratios

    def resolve(self, context: ResolveContext) -> "PrefixKVPolicy":
        """Offline without ratios: load this model's calibrated ratios for the budget (interpolated between
        calibrated budgets)."""
        if self.mode != "offline" or self.ratios:
            return self
        from .. import calibrate

        found = calibrate.load_ratios(context.model_slug, self.budget, context.num_layers)
        if found is None:
            raise PolicyError(
                f"no calibrated PrefixKV configuration for model '{context.model_slug}'; run "
                f"`python -m prefixkv_core calibrate --model {context.model_name}` or use the online mode")
        source = Path(found.source).name if Path(found.source).is_file() else found.source
        return dataclasses.replace(self, ratios=tuple(found.ratios), ratios_source=source)

    def plans_rows_together(self) -> bool:
        return self.mode == "offline"  # the online search gives each prompt its own counts

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(colsum=True)

    def _layer_counts(self, view: PrefillView, state: PrefixKVState) -> list[int]:
        n, n_layers = view.prompt_len, view.num_layers
        total = int(round(self.budget * n * n_layers))
        if self.mode == "offline":
            if not self.ratios or len(self.ratios) != n_layers:
                raise PolicyError(
                    f"offline PrefixKV needs {n_layers} calibrated layer ratios; run "
                    "`python -m prefixkv_core calibrate` for this model or use mode='online'"
                )
            return distribute(total, list(self.ratios), low=min(2, n), high=n)
        importance = torch.cat([layer_importance(view, i, self.normalised_importance)[0] for i in range(n_layers)])
        result = bisect_threshold(retention_curves(importance), self.budget, min_keep=min(2, n))
        state.threshold, state.iterations, state.converged = result.threshold, result.iterations, result.converged
        if not result.converged:
            state.notes.append(f"bisection stopped after {result.iterations} iterations without converging")
        return result.counts

    def prefill(self, view: PrefillView) -> Prefilled:
        if self.mode == "online" and view.cache.layers[0].positions.shape[0] != 1:
            # the searched per-layer counts depend on the sample; offline ratios are shared by every row
            raise ValueError("online PrefixKV's per-layer search runs with batch size 1 only; "
                             "use mode='offline' (calibrated or fixed ratios) for batches")
        state = PrefixKVState(mode=self.mode)
        counts = self._layer_counts(view, state)
        state.anchors = counts
        state.layer_ratios = [c / view.prompt_len for c in counts]
        plans = []
        for i, k in enumerate(counts):
            layer = view.layer(i)
            imp = layer_importance(view, i, self.normalised_importance)
            plans.append(LayerPlan(keep=top_k_keep(imp, k, protected_mask(layer, view.prompt_len)[:, :1])))
        return Prefilled(plans, state)

    def decode(self, view: DecodeView, state: PrefixKVState):
        targets = [budget_count(r, view.true_len, min_keep=2) for r in state.layer_ratios]
        return fixed_point_decode(view, targets, state.anchors)

    def facts(self, state: PrefixKVState) -> list[Fact]:
        out = [Fact("mode", "mode", state.mode)]
        if state.threshold is not None:
            out.append(Fact("threshold", "retention threshold p", round(state.threshold, 6), fmt=".3f"))
        if state.layer_ratios:
            out.append(Fact("layer_ratios", "kept share", [round(r, 4) for r in state.layer_ratios],
                            kind="per-layer", fmt=".0%"))
        if state.mode == "offline":
            out.append(note(f"offline ratios calibrated for this model ({self.ratios_source})"
                            if self.ratios_source else "offline ratios given by the caller"))
        return out + super().facts(state)
