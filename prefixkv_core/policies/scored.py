"""The scoring contract: a method that ranks the prompt's entries once is one function, `score`.

    @dataclass(frozen=True)
    class MyPolicy(ScoredPolicy):
        name, label, summary, colour = "mine", "Mine", "…", "#123456"

        def prefill_stats(self, prompt_len):              # what `score` reads from the prefill
            return StatRequest(colsum=True)

        def score(self, view, layer):                     # [B, 1|Hkv, N], higher = kept first
            return view.stats[layer]["colsum"]

Everything else lives here, once: the protected entries (the first `sink_tokens` and the last `window` prompt
tokens, kept whatever they score), how many entries each layer keeps (`layer_budget`: uniform or PyramidKV's
pyramid), how a layer's entries are shared among its KV heads (`head_budget`: the same count, AdaKV's adaptive
ranking across heads, or weights per head such as SparseMM's visual-head scores), the selection
(`selection.py`), the facts, and the order the equal-memory hold evicts by. The allocations are knobs of every
scoring method, so they wrap any scorer: `snapkv.head_budget=adaptive` is AdaKV, `snapkv.layer_budget=pyramid`
PyramidKV, and the named presets (AdaKV, PyramidKV, ...) are subclasses that change defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..report.lorenz import distribute
from . import allocation, selection
from .base import Fact, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, budget_count, knob
from .diversity import MIXES, mixkv_scores
from .eviction_order import ranked

LAYER_BUDGETS = ("uniform", "pyramid")
HEAD_BUDGETS = ("uniform", "adaptive")
WEIGHTED = "weighted"  # a head budget a method with head weights adds to its choices (SparseMM)

WINDOW_HELP = ("observation window: the last prompt tokens, always kept (and, for a scorer that reads their "
               "votes, the queries that vote); shortened when the prompt or the budget is shorter")


def clamp_window(window: int, prompt_len: int, budget: float | None = None) -> tuple[int, str | None]:
    """The observation window this prompt and budget allow, and a note when the knob had to be shortened.

    At least one earlier token must remain to vote on (window < N), and with a budget the window and the sink
    must fit in the layer's round(r·N) entries (window < round(r·N)), so the method never holds more than its
    budget: the published method requires its capacity to exceed its window."""
    w = max(1, min(window, prompt_len - 1))
    note = None
    if w < window:
        note = f"observation window {window} is not shorter than the prompt ({prompt_len} tokens): used {w}"
    if budget is not None:
        capacity = budget_count(budget, prompt_len, min_keep=2)
        if w > capacity - 1:
            w = max(1, capacity - 1)
            note = (f"observation window {window} does not fit in the budget of {capacity} entries per layer "
                    f"(window + sink): used {w}")
    return w, note


@dataclass
class ScoredState(PolicyState):
    window: int = 0  # the observation window used on this prompt
    per_head: list[int] = field(default_factory=list)  # per layer, entries every KV head keeps (uniform heads)
    capacities: list[int] = field(default_factory=list)  # per layer, entries per KV head on average, window in
    uniform: bool = False  # the pyramid did not fit the budget: uniform capacities (PyramidKV's fallback)
    head_counts: list[list[int]] = field(default_factory=list)  # per layer, scored entries kept per KV head


@dataclass(frozen=True)
class ScoredPolicy(Policy):
    """Base of the methods that score the prompt's entries once and keep the best (SnapKV and its family).
    A subclass implements `score` (and `prefill_stats` for what it reads); see the module docstring."""

    schedule = "prompt only"
    stage = "KV eviction"

    window: int = knob(32, help=WINDOW_HELP, low=1, high=4096, integer=True)
    layer_budget: str = knob("uniform", choices=LAYER_BUDGETS, label="layer budget",
                             help="entries per layer: uniform = the same count in every layer; pyramid = "
                                  "shrinking linearly with depth (PyramidKV)")
    beta: int = knob(20, help="pyramid steepness (layer budget = pyramid): the top layer keeps 1/β of the "
                              "bottom's share", low=1, high=1000, integer=True, label="β (beta)")
    head_budget: str = knob("uniform", choices=HEAD_BUDGETS, label="head budget",
                            help="a layer's entries among its KV heads: uniform = the same count per head; "
                                 "adaptive = all heads' scores ranked together (AdaKV)")
    floor_alpha: float = knob(0.2, help="head budget = adaptive: the share of the per-head budget every KV head "
                                        "keeps whatever the ranking (AdaKV's safeguard; 0 = purely adaptive)",
                              low=0.0, high=1.0)
    mix: str = knob("none", choices=MIXES, help="none = rank by the scores; mixkv = MixKV's per-head mix of them "
                                                "(with the value norms) with the keys' diversity, weighed by how "
                                                "redundant the head's keys are (head budgets stay the scores')")

    # -- what a scoring method says ----------------------------------------------------------------------------
    def score(self, view: PrefillView, layer: int) -> torch.Tensor:
        """[B, 1|Hkv, N] fp32 scores of layer `layer`'s prompt entries, higher = kept first ([B, 1, N]: one
        ranking for every KV head). The protected entries are kept whatever they score."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(view, layer)")

    def tiebreak(self, view: PrefillView, layer: int) -> torch.Tensor | None:
        """A second score, the same shape, ranking entries of equal score (None: the lower position first)."""
        return None

    def head_weights(self, view: PrefillView, layer: int) -> list[float]:
        """head budget = weighted (a method that offers it): layer `layer`'s weight per KV head (SparseMM's
        offline head scores)."""
        raise NotImplementedError(f"{type(self).__name__} gives no head weights: head budget 'weighted' needs them")

    def head_share(self) -> float:
        """head budget = weighted: the share of a layer's entries spread evenly before the weights share the rest."""
        return 0.0

    # -- the rest, once ----------------------------------------------------------------------------------------
    def fitted_window(self, prompt_len: int) -> int:
        """The observation window used on a prompt of `prompt_len` tokens (see `clamp_window`)."""
        return clamp_window(self.window, prompt_len, self.budget)[0]

    def plans_rows_together(self) -> bool:
        return self.head_budget == "uniform"  # heads keeping their own counts follow each prompt: a cache each

    def new_state(self, window: int) -> ScoredState:
        """The run's state (a subclass adds what its scorer finds)."""
        return ScoredState(window=window)

    def layer_capacities(self, prompt_len: int, num_layers: int, window: int, state: ScoredState) -> list[int]:
        """Entries per KV head each layer keeps, the window included."""
        if self.layer_budget == "pyramid":
            caps = allocation.pyramid(prompt_len, num_layers, self.budget, window, self.beta)
            if caps is not None:
                return caps
            state.uniform = True
            state.notes.append("budget too large for a pyramid (N < 2(M-W)): uniform SnapKV capacities, as published")
        return allocation.uniform(self.budget, prompt_len, num_layers, min_keep=window + 1)

    def prefill(self, view: PrefillView) -> Prefilled:
        n = view.prompt_len
        w, clamped = clamp_window(self.window, n, self.budget)
        state = self.new_state(w)
        if clamped:
            state.notes.append(clamped)
        state.capacities = self.layer_capacities(n, view.num_layers, w, state)
        plans: list[LayerPlan | None] = []
        weighted = self._weighted_counts(view, w, state.capacities) if self.head_budget == WEIGHTED else None
        for i, capacity in enumerate(state.capacities):
            scores, tiebreak = self._ranked_prefix(view, i, w)
            prefix = self._mixed(view, i, scores)
            if self.head_budget == "uniform" or prefix.shape[1] == 1:
                keep = selection.window_select(prefix, tiebreak, max(min(capacity, n), w + 1), w)
                state.per_head.append(int(keep.shape[-1]))
                plans.append(LayerPlan(keep=keep))
                continue
            heads = prefix.shape[1]
            if capacity >= n:
                state.head_counts.append([n - w] * heads)
                plans.append(None)
                continue
            counts = weighted[i] if weighted is not None else self._adaptive_counts(scores, tiebreak,
                                                                                      heads * (capacity - w), n - w)
            state.head_counts.append(counts)
            plans.append(LayerPlan(keep=selection.heads_select(prefix, tiebreak, counts, w),
                                   empty_slots=min(counts) < max(counts)))
        return Prefilled(plans, state)

    def _ranked_prefix(self, view: PrefillView, i: int, w: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scores of the tokens before the window (the sink at +inf) and their tie-break."""
        n = view.prompt_len
        prefix = self.score(view, i)[..., : n - w].float().clone()
        prefix[..., : min(self.sink_tokens, prefix.shape[-1])] = float("inf")
        tiebreak = self.tiebreak(view, i)
        return prefix, None if tiebreak is None else tiebreak[..., : n - w].float()

    def _mixed(self, view: PrefillView, i: int, prefix: torch.Tensor) -> torch.Tensor:
        """The scores the entries are chosen by: `prefix` itself, or MixKV's mix of it (the sink kept at +inf)."""
        if self.mix == "none":
            return prefix
        s = min(self.sink_tokens, prefix.shape[-1])
        finite = prefix.clone()
        finite[..., :s] = prefix[..., s:].amax(dim=-1, keepdim=True) if prefix.shape[-1] > s else 0.0
        layer = view.layer(i)
        mixed = mixkv_scores(finite, layer.keys, layer.values)
        mixed[..., :s] = float("inf")
        return mixed

    def _adaptive_counts(self, prefix: torch.Tensor, tiebreak: torch.Tensor | None, total: int, high: int
                         ) -> list[int]:
        """AdaKV: the layer's heads ranked together, then floored."""
        adaptive = selection.flattened_counts(prefix, total, tiebreak)[0].tolist()
        return selection.floored_counts(adaptive, total, self.floor_alpha, high=high)

    def _weighted_counts(self, view: PrefillView, w: int, capacities: list[int]) -> list[list[int]]:
        """SparseMM: the whole model's scored entries (every layer's heads × its capacity less the window) shared
        among all heads of all layers, a share `head_share()` of each layer's per-head count evenly, the rest in
        proportion to the heads' weights normalised over the model; each head at most N - W."""
        heads = view.layer(0).n_kv
        per_head = [max(0, c - w) for c in capacities]
        floors = [int(b * self.head_share()) for b in per_head]
        total = heads * sum(per_head)
        weights = [max(0.0, float(x)) for i in range(view.num_layers) for x in self.head_weights(view, i)]
        if len(weights) != heads * view.num_layers:
            raise ValueError(f"{self.label}: {len(weights)} head weights for {view.num_layers} layers of {heads} "
                             "KV heads")
        mass = sum(weights) or 1.0
        pool = total - heads * sum(floors)
        shares = [floors[j // heads] + pool * x / mass for j, x in enumerate(weights)]
        flat = distribute(total, shares, low=max(1, min(floors)), high=view.prompt_len - w)  # the sink at least
        return [flat[i * heads:(i + 1) * heads] for i in range(view.num_layers)]

    def eviction_order(self, view: PrefillView, state: ScoredState):
        """Its own scores, the window last of all prompt entries (ranked across heads when heads keep their own
        counts)."""
        n = view.prompt_len
        out = []
        for i in range(view.num_layers):
            scores = self.score(view, i).float()
            if self.mix != "none":  # the entries before the window go by the mixed scores
                w = min(state.window, n)
                mixed = self._mixed(view, i, scores[..., : n - w])
                scores = torch.cat([mixed, scores[..., n - w:].expand(-1, mixed.shape[1], -1)], dim=-1)
            rank = ranked(scores, torch.arange(n, device=scores.device).view(1, 1, -1) >= n - min(state.window, n))
            rank.across_heads = self.head_budget != "uniform"
            out.append(rank)
        return out

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if not isinstance(state, ScoredState):
            return out
        if self.layer_budget == "pyramid" and state.capacities:
            out.insert(0, Fact("capacities", "capacity per KV head (every head the same count, window included)",
                               list(state.capacities), kind="per-layer", fmt="d", unit=" entries"))
        elif state.per_head:
            out.append(Fact("per_head", "entries per KV head (every head the same count, window included)",
                            list(state.per_head), kind="per-layer", fmt="d"))
        if state.head_counts:
            out.append(Fact("head_min", "fewest voted entries in one KV head", [min(c) for c in state.head_counts],
                            kind="per-layer", fmt="d"))
            out.append(Fact("head_max", "most in one KV head", [max(c) for c in state.head_counts],
                            kind="per-layer", fmt="d"))
        return out

    def eviction_order_words(self) -> str:
        return "its scores, the observation window last"
