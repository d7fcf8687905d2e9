"""Equal-memory mode: the budgeted methods that compress the prompt once (every policy whose schedule is "prompt
only", and PrefixKV with decode = grow) held at about r·N_t entries after the prompt and after every token, the way the every-step methods hold themselves, so
all budgeted methods are compared at the same memory and under the same rules.

1. Layer l holds round(ρ_l · N_t) entries, where ρ_l is the layer's share right after the method compressed the
   prompt, rescaled so the shares average r (PyramidKV keeps its per-layer capacities; LOOK-M, whose text may
   exceed the budget with `text_prior = keep_all`, is brought down to r).
2. Always kept: the attention sink, the last prompt token and the newest entry.
3. Then every user turn fed after the prompt (a follow-up question, or the question of a query-agnostic run)
   whole, for the rest of the conversation (cut, oldest tokens first, only in a layer whose whole budget is
   smaller than the question).
4. Then the recent window the every-step methods protect: the newest max(1, round(RECENT_SHARE · T_l)) entries
   of the layer (H2O's published split: half of its budget for recent tokens), generated or prompt.
5. Generated entries that have left the window go first, the oldest first.
6. Then the prompt's entries go in the order of the method's OWN ranking (`HoldRank`), lowest first: SnapKV and
   PyramidKV their observation window, then the rest by max-pooled window votes, per KV head; LOOK-M its recent
   window, then text, then image tokens, each by accumulated attention, per KV head (and it merges what it
   evicts into the most similar kept key); AdaKV its window votes ranked across all KV heads of the layer (a
   head keeps as many as it has among the layer's best); PrefixKV its scorer. A method that states none: its
   entries' accumulated attention (the prefill's column sums, per KV head).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..kv.cache import TrackedCache
from .base import (BUDGET_MODES, EMPTY_SLOT, DecodeView, LayerPlan, Policy, PolicyError, PolicyState, Prefilled,
                   PrefillView, budget_count, tiered_keep)
from .facts import Fact, facts_to_extras, note
from .eviction_order import HoldRank, accumulated_rank

MIN_HELD = 3  # the sink, the last prompt token and the newest entry
RECENT_SHARE = 0.5  # the recent window every-step methods protect: H2O's published half of the budget
_PROTECTED, _TURN, _WINDOW, _PROMPT, _GENERATED = 0, 1, 2, 3, 1_000_000  # ranking tiers, lowest kept first
_EMPTY = 2_000_000  # an empty slot of a head-wise layer (AdaKV): never kept


def layer_shares(cache: TrackedCache, prompt_len: int, budget: float) -> list[float]:
    """Each layer's share of N_t to hold: its prompt entries now over N, rescaled to average `budget`."""
    kept = [int((layer.positions[0, 0] < prompt_len).sum()) for layer in cache.layers]
    mean = sum(kept) / len(kept)
    if mean <= 0:
        return [budget] * len(kept)
    return [budget * k / mean for k in kept]


def _held_order(positions: torch.Tensor, prompt_len: int, target: int, rank: HoldRank,
                turns: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(score, tier, always kept) of every entry of a held layer [B, Hkv, T] by the rule in the module docstring:
    lower tier kept first, then higher score. `target`: the entries one head may hold."""
    newest_first = torch.argsort(torch.argsort(positions, dim=-1, descending=True), dim=-1)  # 0 = the newest
    window = newest_first < max(1, int(round(RECENT_SHARE * target)))
    protected = (positions == 0) | (positions == prompt_len - 1) | (newest_first == 0)
    turn = torch.zeros_like(protected)
    for start, end in turns:
        turn |= (positions >= start) & (positions < end)
    prompt = positions < prompt_len
    own_scores, own_tiers = rank.at(positions, prompt_len)
    tier = torch.where(protected, _PROTECTED, torch.where(turn, _TURN, torch.where(window, _WINDOW, torch.where(
        prompt, _PROMPT + own_tiers, _GENERATED))))
    # the method's scores order its prompt entries; recency orders the turns, the window and generated entries
    score = torch.where(prompt & ~window, own_scores, positions.float())
    return score, tier, protected


def held_keep(positions: torch.Tensor, prompt_len: int, target: int, rank: HoldRank,
              turns: list[tuple[int, int]]) -> torch.Tensor:
    """Indices [B, Hkv, K] (ascending) of the entries a held layer keeps, by the rule in the module docstring.
    positions [B, Hkv, T]: the entries' true positions; turns: [start, end) position spans of fed user turns.
    K = target, or more when the entries that are always kept outnumber it."""
    score, tier, protected = _held_order(positions, prompt_len, target, rank, turns)
    k = max(target, int(protected.sum(dim=-1).max()))
    return tiered_keep(score, k, tier)


def held_keep_across_heads(positions: torch.Tensor, prompt_len: int, target: int, rank: HoldRank,
                           turns: list[tuple[int, int]]) -> tuple[torch.Tensor, bool]:
    """The same rule for a layer whose KV heads hold different counts (AdaKV): the layer keeps Hkv · target
    entries in all, every head's entries ranked together, so a head keeps as many as it has among the best.
    positions [1, Hkv, T] with EMPTY_SLOT padding (never kept). Returns (keep [1, Hkv, K] ascending, EMPTY_SLOT
    first in the heads that keep fewer; whether any head does)."""
    _, h, t = positions.shape
    real = positions >= 0
    score, tier, protected = _held_order(positions, prompt_len, target, rank, turns)
    tier = torch.where(real, tier, _EMPTY)
    k = min(int(real.sum()), max(h * target, int((protected & real).sum())))
    chosen = tiered_keep(score.reshape(1, 1, -1), k, tier.reshape(1, 1, -1))[0, 0]
    per_head = [chosen[chosen // t == g] % t for g in range(h)]  # ascending within each head
    longest = max(c.numel() for c in per_head)
    rows = [torch.cat([c.new_full((longest - c.numel(),), EMPTY_SLOT), c]) for c in per_head]
    return torch.stack(rows).unsqueeze(0), min(c.numel() for c in per_head) < longest


def hold_plans(view: DecodeView, shares: list[float], ranks: list[HoldRank], turns: list[tuple[int, int]],
               budget: float | None = None) -> list[LayerPlan | None]:
    """Plans that bring layer l to round(shares[l] · N_t) entries (at least MIN_HELD) by the rule above; a layer
    ranked across its KV heads (AdaKV) holds round(budget · N_t) entries per KV head on average instead (the
    budget r, else its share)."""
    plans: list[LayerPlan | None] = []
    for layer, share, rank in zip(view.cache.layers, shares, ranks):
        if rank.across_heads:
            target = budget_count(share if budget is None else budget, view.full_len, min_keep=MIN_HELD)
            if int((layer.positions >= 0).sum()) <= layer.n_kv * target:
                plans.append(None)
                continue
            keep, ragged = held_keep_across_heads(layer.positions, view.prompt_len, target, rank, turns)
            plan = LayerPlan(keep=keep, empty_slots=ragged)
        else:
            target = budget_count(share, view.full_len, min_keep=MIN_HELD)  # r is a share of the uncompressed N_t
            if layer.length <= target:
                plans.append(None)
                continue
            plan = LayerPlan(keep=held_keep(layer.positions, view.prompt_len, target, rank, turns))
        if rank.merge is not None:  # the method merges what it evicts (LOOK-M)
            plan.merge = rank.merge(layer.keys, plan.keep)
        plans.append(plan)
    return plans


def needs_hold(policy: Policy) -> bool:
    """Whether equal-memory mode must hold `policy`: a budgeted method that does not hold its budget itself while
    decoding (a prompt-only one)."""
    return policy.uses_budget and not policy.keeps_budget_while_decoding()


@dataclass
class HeldState(PolicyState):
    """A held run's state: the wrapped policy's own, and what the hold keeps between steps."""

    inner: PolicyState = field(default_factory=PolicyState)
    ranks: list[HoldRank] = field(default_factory=list)  # per layer: the method's own order of its prompt entries
    shares: list[float] = field(default_factory=list)  # per layer: its share of N_t (set at the first hold)
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of user turns fed after the prompt
    held_len: int = 0  # N_t at the last hold (0: not held yet)


@dataclass(frozen=True)
class EqualMemoryHold:
    """A prompt-only policy, held at about r·N_t after the prompt and after every step by the rule of this
    module, so that it is compared with the every-step methods at the same memory (kvpress wraps a press in a
    DecodingPress for the same purpose). Everything else is the wrapped policy's: its name, knobs, statistics,
    prefill plans and facts (`make_policy(..., budget_mode="equal_memory")` builds it)."""

    policy: Policy

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "policy":  # copying and pickling must not recurse
            raise AttributeError(name)
        return getattr(self.policy, name)

    def resolve(self, context) -> "EqualMemoryHold":
        return EqualMemoryHold(self.policy.resolve(context))

    def prefill(self, view: PrefillView) -> Prefilled:
        plans, inner = self.policy.prefill(view)
        ranks = self.policy.eviction_order(view, inner)  # before the plans change the cache
        return Prefilled(plans, HeldState(inner=inner, ranks=ranks or []))

    def decode(self, view: DecodeView, state: HeldState) -> list[LayerPlan | None] | None:
        return self.policy.decode(view, state.inner)

    def after_plans(self, view: DecodeView, state: HeldState) -> list[LayerPlan | None] | None:
        """Bring every layer back to its share of r·N_t, after the prefill's plans and after every step's."""
        first = state.held_len == 0
        if not first and view.step == 0 and view.true_len > state.held_len:  # a user turn was fed: kept whole
            state.turns.append((state.held_len, view.true_len))
        state.held_len = view.true_len
        if first:  # right after the prompt was compressed
            state.shares = layer_shares(view.cache, view.prompt_len, self.policy.budget)
            if not state.ranks:  # the method states no order of its own
                state.ranks = [accumulated_rank(layer, view.prompt_len) for layer in view.cache.layers]
        return hold_plans(view, state.shares, state.ranks, state.turns, self.policy.budget)

    def facts(self, state: HeldState) -> list[Fact]:
        return [*self.policy.facts(state.inner), note(
            f"equal memory: held at r·N_t while decoding (a recent window of half the budget, the questions whole, "
            f"the prompt evicted by {self.policy.eviction_order_words()})")]

    def extras(self, state: HeldState | None) -> dict[str, Any]:
        return facts_to_extras(self.facts(state)) if state is not None else {}

    def allocation_importance(self, state: HeldState) -> torch.Tensor | None:
        return self.policy.allocation_importance(state.inner)

    def image_token_sources(self, state: HeldState | None):
        return self.policy.image_token_sources(state.inner if state is not None else None)


def hold_for(policy: Policy, budget_mode: str) -> Policy | EqualMemoryHold:
    """The policy as a comparison in `budget_mode` (one of BUDGET_MODES) runs it."""
    if budget_mode not in BUDGET_MODES:
        raise PolicyError(f"budget mode must be one of {', '.join(BUDGET_MODES)}, got {budget_mode!r}")
    return EqualMemoryHold(policy) if budget_mode == "equal_memory" and needs_hold(policy) else policy

