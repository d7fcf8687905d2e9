"""PrefixKV: one global information-retention threshold p, found by bisection, gives every layer the
smallest prefix of its importance-sorted tokens that retains p of its attention. Layers whose importance
is concentrated keep few tokens; layers whose importance is spread keep many.

The per-layer counts come from the Lorenz bisection on this prompt (online) or from calibrated per-layer ratios
(offline); the tokens inside a layer are ranked by the prefill's column sums (the paper; `scorer` picks another),
and while decoding Elastic Cache's fixed-point elimination holds each layer at its share."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kv.attention import StatRequest
from . import allocation, prefix_configs, scoring
from .base import (DecodeView, Fact, LayerPlan, Policy, PolicyError, PolicyState, Prefilled, PrefillView,
                   ResolveContext, budget_count, fixed_point_decode, knob, note, protected_mask, top_k_keep)
from .eviction_order import ranked
from .scored import clamp_window

MODES = ("online", "offline")
DECODES = ("fixed_point", "grow")
SCORER_WORDS = {"colsum": "column sums", "normalised": "normalised column sums", "window": "observation-window votes"}


@dataclass
class PrefixKVState(PolicyState):
    mode: str = "online"
    threshold: float | None = None  # the retention threshold p found by bisection (online)
    iterations: int = 0
    converged: bool = True
    anchors: list[int] = field(default_factory=list)  # entries kept per layer after the prompt (K_l)
    layer_ratios: list[float] = field(default_factory=list)  # kept share per layer (R_l)
    # [L, N'] the importance whose Lorenz curves the bisection used (online; sink left out unless counted)
    curve_importance: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefixKVPolicy(Policy):
    """PrefixKV: one information-retention threshold over the layers' Lorenz curves sets each layer's budget.
    Paper: "PrefixKV: Adaptive Prefix KV Cache is What Vision Instruction-Following Models Need for Efficient
    Generation" (Wang et al., 2024), https://arxiv.org/abs/2412.03409"""

    name = "prefixkv"
    label = "PrefixKV"
    summary = ("Adaptive per-layer budgets: a global retention threshold found by bisection on the layers' "
               "Lorenz curves; offline mode uses ratios calibrated once per model and budget.")
    colour = "#D55E00"  # vermillion: the method the tool is about
    stage = "KV eviction"
    roles = ("lorenz", "featured")
    flag_knobs = {"mode": "offline where this model is calibrated, else online"}
    claimed_better_than = ("local", "h2o", "pyramidkv", "elastic")  # the paper's claim (a)

    mode: str = knob("online", help="online: bisect the threshold on this prompt; offline: per-layer ratios "
                                    "calibrated once for this model and budget", choices=MODES)
    # Offline: per-layer kept ratios (rescaled to the budget). `resolve` fills them from the calibrated file.
    ratios: tuple[float, ...] | None = knob(None, help="offline per-layer kept ratios (filled from the calibrated "
                                                       "file when not given)", low=0.0, high=1.0, sequence=True,
                                            editable=False)
    scorer: str = knob("colsum", help="what ranks the tokens and draws the Lorenz curves: colsum = column sums of "
                                      "the prefill attention (the paper); normalised = divided by how many queries "
                                      "see each token; window = SnapKV's observation-window votes, per KV head",
                       choices=scoring.SCORERS)
    window: int = knob(8, help="observation window of the window scorer: the last prompt queries that vote "
                               "(shortened when the prompt is shorter)", low=1, high=4096, integer=True)
    sink_in_curves: bool = knob(True, help="count the attention sink in the Lorenz curves (the paper); off: the sink "
                                           "is kept and the threshold shares out the other entries",
                                label="sink in curves")
    min_keep: int = knob(2, help="fewest entries any layer keeps, the sink and the last prompt token included",
                         low=2, high=65536, integer=True, label="min keep")
    # the knob is called `decode`; its field may not shadow the `decode` method
    decode_rule: str = knob("fixed_point", help="fixed_point: hold every layer at R_l·N_t by deleting at K_l - 25 "
                                                "(the paper); grow: compress the prompt only, the cache then grows",
                            choices=DECODES, name="decode")
    ratios_source: str | None = field(default=None, compare=False)  # where `resolve` found the ratios

    @classmethod
    def auto_knob(cls, knob: str, context: ResolveContext) -> Any:
        """mode: offline (the paper's default) where this model has calibrated ratios, else online."""
        if knob != "mode":
            return super().auto_knob(knob, context)
        found = prefix_configs.load_ratios(context.model_slug, context.budget, context.num_layers)
        return "offline" if found is not None else "online"

    def resolve(self, context: ResolveContext) -> "PrefixKVPolicy":
        """Offline without ratios: load this model's calibrated ratios for the budget (interpolated between
        calibrated budgets)."""
        if self.mode != "offline" or self.ratios:
            return self
        found = prefix_configs.load_ratios(context.model_slug, self.budget, context.num_layers)
        if found is None:
            raise PolicyError(
                f"no calibrated PrefixKV configuration for model '{context.model_slug}'; run "
                f"`python -m prefixkv_core calibrate --model {context.model_name}` or use the online mode")
        source = Path(found.source).name if Path(found.source).is_file() else found.source
        return dataclasses.replace(self, ratios=tuple(found.ratios), ratios_source=source)

    def plans_rows_together(self) -> bool:
        return self.mode == "offline"  # the online search gives each prompt its own counts

    def keeps_budget_while_decoding(self) -> bool:
        return self.decode_rule == "fixed_point"

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        window = clamp_window(self.window, prompt_len)[0] if self.scorer == "window" else 0
        return StatRequest(colsum=True, window=window)

    def _scores(self, view: PrefillView, i: int) -> torch.Tensor:
        """[B, 1|Hkv, N] the scores layer i ranks its tokens by."""
        window = clamp_window(self.window, view.prompt_len)[0]
        return scoring.prefill_scores(view.stats[i], view.layer(i).positions, view.prompt_len, self.scorer, window)

    def _layer_counts(self, view: PrefillView, state: PrefixKVState, scores: list[torch.Tensor]) -> list[int]:
        n, n_layers = view.prompt_len, view.num_layers
        total = int(round(self.budget * n * n_layers))
        floor = min(self.min_keep, n)
        if self.mode == "offline":
            if not self.ratios or len(self.ratios) != n_layers:
                raise PolicyError(
                    f"offline PrefixKV needs {n_layers} calibrated layer ratios; run "
                    "`python -m prefixkv_core calibrate` for this model or use mode='online'"
                )
            return allocation.from_ratios(self.ratios, total, low=floor, high=n)
        # one curve per layer: the layer's ranking averaged over KV heads (head-wise scorers)
        importance = torch.cat([s[0] if s.shape[1] == 1 else s[0].mean(dim=0, keepdim=True) for s in scores])
        skip = 0 if self.sink_in_curves else self.sink_tokens
        result = allocation.lorenz_bisection(importance, self.budget, min_keep=floor, skip_first=skip)
        state.threshold, state.iterations, state.converged = result.threshold, result.iterations, result.converged
        state.curve_importance = importance[:, min(skip, n - 1):]
        if not result.converged:
            state.notes.append(f"bisection stopped after {result.iterations} iterations without converging")
        return result.counts

    def prefill(self, view: PrefillView) -> Prefilled:
        if self.mode == "online" and view.cache.layers[0].positions.shape[0] != 1:
            # the searched per-layer counts depend on the sample; offline ratios are shared by every row
            raise ValueError("online PrefixKV's per-layer search runs with batch size 1 only; "
                             "use mode='offline' (calibrated or fixed ratios) for batches")
        state = PrefixKVState(mode=self.mode)
        if self.scorer == "window":
            clamped = clamp_window(self.window, view.prompt_len)[1]
            if clamped:
                state.notes.append(clamped)
        scores = [self._scores(view, i) for i in range(view.num_layers)]
        counts = self._layer_counts(view, state, scores)
        over = sum(counts) - int(round(self.budget * view.prompt_len * view.num_layers))
        if over > 0:
            state.notes.append(f"the per-layer floor (min keep {self.min_keep}) keeps {over} entries over r·N·L")
        state.anchors = counts
        state.layer_ratios = [c / view.prompt_len for c in counts]
        plans = []
        for i, k in enumerate(counts):
            layer = view.layer(i)
            plans.append(LayerPlan(keep=top_k_keep(scores[i], k, protected_mask(layer, view.prompt_len)[:, :1])))
        return Prefilled(plans, state)

    def eviction_order(self, view: PrefillView, state: PrefixKVState):
        """Its scorer orders the prompt's entries (decode = grow, held at r·N_t in equal-memory mode)."""
        return [ranked(self._scores(view, i)) for i in range(view.num_layers)]

    def eviction_order_words(self) -> str:
        return f"its {SCORER_WORDS[self.scorer]}, in its per-layer counts"

    def decode(self, view: DecodeView, state: PrefixKVState):
        if self.decode_rule == "grow":
            return None
        targets = [budget_count(r, view.true_len, min_keep=self.min_keep) for r in state.layer_ratios]
        return fixed_point_decode(view, targets, state.anchors)

    @classmethod
    def curves_note(cls, knobs: dict[str, Any]) -> str | None:
        parts = []
        if knobs.get("scorer", "colsum") != "colsum":
            parts.append(SCORER_WORDS.get(knobs["scorer"], str(knobs["scorer"])))
        if knobs.get("sink_in_curves", True) is False:
            parts.append("sink left out")
        return f"{cls.label}'s curves: " + ", ".join(parts) if parts else None

    def allocation_importance(self, state: PrefixKVState) -> torch.Tensor | None:
        return state.curve_importance

    def facts(self, state: PrefixKVState) -> list[Fact]:
        out = [Fact("mode", "mode", state.mode)]
        if state.threshold is not None:
            out.append(Fact("threshold", "retention threshold p", round(state.threshold, 6), fmt=".3f"))
        if state.layer_ratios:
            out.append(Fact("layer_ratios", "kept share", [round(r, 4) for r in state.layer_ratios],
                            kind="per-layer", fmt=".0%"))
        # settings that differ from the paper's, said where the numbers are read
        if self.scorer != "colsum":
            out.append(Fact("scorer", "ranked by", SCORER_WORDS[self.scorer]))
        if not self.sink_in_curves and state.mode == "online":
            out.append(note("the attention sink is left out of the Lorenz curves"))
        if self.decode_rule == "grow":
            out.append(note("decode = grow: the prompt is compressed once and the cache grows while decoding"))
        if state.mode == "offline":
            out.append(note(f"offline ratios calibrated for this model ({self.ratios_source})"
                            if self.ratios_source else "offline ratios given by the caller"))
        return out + super().facts(state)
