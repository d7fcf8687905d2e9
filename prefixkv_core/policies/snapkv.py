"""SnapKV: an observation window of the last prompt queries votes, per KV head, for the tokens to keep.

Every layer keeps the same count (`allocation.uniform`), ranked per KV head by the window's max-pooled votes;
the window itself and the sink are always kept."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.attention import StatRequest
from . import allocation, scoring
from .base import Fact, LayerPlan, Policy, PolicyError, PolicyState, Prefilled, PrefillView, budget_count, knob
from .eviction_order import snap_rank


def snap_votes(window_scores: torch.Tensor, window: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two keys SnapKV's family ranks the tokens before the window by, per KV head: (max-pooled votes with the
    sink's pooled out and the sink itself at +inf, raw votes), each [B, Hkv, N - window]."""
    n = window_scores.shape[-1]
    pooled = scoring.snap_window(window_scores, window, kernel, sink=1)[..., : n - window].clone()
    if pooled.shape[-1] > 0:
        pooled[..., 0] = float("inf")  # the sink
    return pooled, window_scores[..., : n - window].float()


def snap_select(window_scores: torch.Tensor, capacity: int, window: int, kernel: int) -> torch.Tensor:
    """window_scores [B, Hkv, N] -> kept indices [B, Hkv, capacity] (ascending).

    The last `window` tokens are always kept; from the rest, the top `capacity - window` per KV head by
    max-pooled window attention (pooled without the sink's vote), ties broken by the raw vote, then by position.
    The first token (attention sink) is always among them.
    """
    b, h, n = window_scores.shape
    w = min(window, n)
    capacity = max(min(capacity, n), w + 1 if n > w else n)
    pooled, raw = snap_votes(window_scores, w, kernel)
    k = min(capacity - w, pooled.shape[-1])
    chosen = scoring.two_key_order(pooled, raw)[..., :k]
    tail = torch.arange(n - w, n, device=window_scores.device).view(1, 1, -1).expand(b, h, -1)
    return torch.cat([chosen.sort(dim=-1).values, tail], dim=-1)


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


WINDOW_HELP = ("observation window: the last prompt queries that vote (shortened when the prompt or the budget is "
               "shorter)")
KERNEL_HELP = "max-pool width over the votes (odd, so pooling keeps the length)"


def check_kernel(label: str, kernel: int) -> None:
    if kernel % 2 == 0:
        raise PolicyError(f"{label} knob kernel must be odd (max pooling keeps the length); got {kernel}")


@dataclass
class SnapState(PolicyState):
    window: int = 0  # the observation window used on this prompt
    per_head: list[int] = field(default_factory=list)  # per layer, prompt entries every KV head keeps (window in)


@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    """SnapKV: the observation window's max-pooled votes choose, per KV head, the prompt entries to keep.
    Paper: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al., 2024),
    https://arxiv.org/abs/2404.14469"""

    name = "snapkv"
    label = "SnapKV"
    summary = ("The last prompt queries (observation window) vote, per KV head, with max-pooled attention. "
               "Compresses the prompt once; the cache then grows while decoding.")
    colour = "#009E73"
    schedule = "prompt only"
    stage = "KV eviction"

    # the reference repository's LongBench configuration: window 32, max pooling with kernel 7
    window: int = knob(32, help=WINDOW_HELP, low=1, high=4096, integer=True)
    kernel: int = knob(7, help=KERNEL_HELP, low=1, high=63, integer=True)

    def check(self) -> None:
        check_kernel(self.label, self.kernel)

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(window=clamp_window(self.window, prompt_len, self.budget)[0])

    def prefill(self, view: PrefillView) -> Prefilled:
        w, clamped = clamp_window(self.window, view.prompt_len, self.budget)
        state = self.new_state(w)
        if clamped:
            state.notes.append(clamped)
        capacities = self.layer_capacities(view.prompt_len, view.num_layers, w, state)
        plans = [LayerPlan(keep=snap_select(view.stats[i]["window"], capacity, w, self.kernel))
                 for i, capacity in enumerate(capacities)]
        state.per_head = [int(p.keep.shape[-1]) for p in plans]
        return Prefilled(plans, state)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, SnapState) and state.per_head:
            out.append(Fact("per_head", "entries per KV head (every head the same count, window included)",
                            list(state.per_head), kind="per-layer", fmt="d"))
        return out

    def eviction_order(self, view: PrefillView, state: SnapState):
        return [snap_rank(view.stats[i]["window"], state.window, self.kernel) for i in range(view.num_layers)]

    def new_state(self, window: int) -> SnapState:
        """The run's state, before the capacities are known (a subclass adds what its schedule finds)."""
        return SnapState(window=window)

    def layer_capacities(self, prompt_len: int, num_layers: int, window: int, state: SnapState) -> list[int]:
        """Entries each layer keeps, the observation window included: SnapKV spreads the budget evenly."""
        return allocation.uniform(self.budget, prompt_len, num_layers, min_keep=window + 1)

    def eviction_order_words(self) -> str:
        return "its window votes, the observation window last"
