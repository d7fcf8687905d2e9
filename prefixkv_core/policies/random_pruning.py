"""Random: the prompt's entries kept uniformly at random at the budget, a control that says whether a method's
choice beats chance.

Paper: Peng et al., "Can Visual Input Be Compressed? A Visual Token Compression Benchmark for Large Multimodal
Models" (UniPruneBench), 2025, https://arxiv.org/abs/2511.02650, which finds random pruning a surprisingly strong
baseline.

Each layer keeps round(r·N) prompt entries: the always-kept ones (the first `sinks` positions and the newest
`recent` prompt tokens; by default only the attention sink and the last prompt token, which every method here
keeps) and a uniform random sample of the others. One draw per layer, shared by every KV head (the literature's
random pruning drops tokens, not heads' entries), from a generator seeded with the comparison's seed
(`GenerationSettings.seed`, handed over by `resolve`) mixed with the request's fingerprint (its prompt, images
and frames: `ResolveContext.request`), so every question gets a draw of its own and the same request and seed
draw the same entries, batched or alone. Prompt only: generated tokens are all kept (as SnapKV does); the equal-memory mode evicts the prompt by
the same draw.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .base import (Fact, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, ResolveContext, budget_count, draw_seed,
                   knob)
from .eviction_order import ranked

SINKS_HELP = ("leading prompt tokens always kept (1: only the attention sink, which every method keeps; "
              "StreamingLLM keeps 4)")
RECENT_HELP = "newest prompt tokens always kept (1: only the last prompt token, which every method keeps)"


def draw(seed: int, num_layers: int, n: int) -> torch.Tensor:
    """[num_layers, n] uniform noise in [0, 1) from a CPU generator seeded with `seed`: row l ranks layer l's
    prompt entries (the same seed and shape give the same draw on every device)."""
    return torch.rand(num_layers, n, generator=torch.Generator(device="cpu").manual_seed(int(seed)))


def forced_counts(sinks: int, recent: int, capacity: int) -> tuple[int, int]:
    """(sinks, recent) fitted into `capacity` entries (capacity >= 2): at least one of each, sinks first."""
    s = max(1, min(sinks, capacity - 1))
    return s, max(1, min(recent, capacity - s))


def random_keep(noise: torch.Tensor, positions: torch.Tensor, capacity: int, sinks: int, recent: int,
                prompt_len: int) -> torch.Tensor:
    """noise [N] (one layer's draw, by prompt position); positions [B, 1, T] the entries' true positions ->
    kept indices [B, 1, capacity] (ascending): the forced entries (positions < sinks or >= N - recent), then the
    other entries with the highest noise."""
    score = noise.to(positions.device)[positions.clamp(0, prompt_len - 1)]
    forced = (positions < sinks) | (positions >= prompt_len - recent)
    score = score.masked_fill(forced, float("inf"))
    k = min(capacity, score.shape[-1])
    return torch.topk(score, k, dim=-1, sorted=False).indices.sort(dim=-1).values


@dataclass
class RandomState(PolicyState):
    seed: int = 0  # the draw's seed
    forced: tuple[int, int] = (1, 1)  # (sinks, recent) always kept, as fitted into the budget


@dataclass(frozen=True)
class RandomPolicy(Policy):
    """Random: every layer keeps round(r·N) prompt entries, the protected ones and a uniform random sample of the
    rest (one draw per layer, shared by the KV heads), seeded with the comparison's seed. Paper: "Can Visual Input
    Be Compressed? A Visual Token Compression Benchmark for Large Multimodal Models" (Peng et al., 2025,
    UniPruneBench), https://arxiv.org/abs/2511.02650"""

    name = "random"
    control = None
    is_control = True
    draws_at_random = True
    label = "Random"
    summary = ("A control: each layer keeps round(r·N) prompt entries drawn uniformly at random (the sink and the "
               "last prompt token always), one draw per layer from the comparison's seed. Compresses the prompt "
               "once; the cache then grows while decoding.")
    colour = "#7F7F7F"  # grey: chance, the line every method should be above
    schedule = "prompt only"
    stage = "KV eviction"

    sinks: int = knob(1, help=SINKS_HELP, low=1, high=64, integer=True)
    recent: int = knob(1, help=RECENT_HELP, low=1, high=4096, integer=True)
    # not knobs, set by `resolve`: the comparison's seed (`ResolveContext.seed`) and the request's fingerprint,
    # which together seed the draw (`draw_seed`)
    seed: int = field(default=0, kw_only=True)
    request: int = field(default=0, kw_only=True)

    def resolve(self, context: ResolveContext) -> "RandomPolicy":
        return dataclasses.replace(self, seed=int(context.seed), request=int(context.request))

    @property
    def draw_seed(self) -> int:
        return draw_seed(self.seed, self.request)

    def prefill(self, view: PrefillView) -> Prefilled:
        n = view.prompt_len
        capacity = budget_count(self.budget, n, min_keep=2)
        sinks, recent = forced_counts(self.sinks, self.recent, capacity)
        state = RandomState(seed=self.draw_seed, forced=(sinks, recent))
        if (sinks, recent) != (self.sinks, self.recent):
            state.notes.append(f"sinks {self.sinks} + recent {self.recent} do not fit in the budget of {capacity} "
                               f"entries per layer: kept {sinks} + {recent}")
        noise = draw(self.draw_seed, view.num_layers, n)
        plans = []
        for i in range(view.num_layers):
            positions = view.layer(i).positions[:, :1]
            plans.append(LayerPlan(keep=random_keep(noise[i], positions, capacity, sinks, recent, n)))
        return Prefilled(plans, state)

    def eviction_order(self, view: PrefillView, state: RandomState):
        """The same draw orders the prompt's eviction (held at r·N_t in equal-memory mode)."""
        n = view.prompt_len
        sinks, recent = state.forced
        noise = draw(self.draw_seed, view.num_layers, n)
        pos = torch.arange(n)
        first = (pos < sinks) | (pos >= n - recent)
        device = view.layer(0).positions.device
        return [ranked(noise[i].view(1, 1, n).to(device), first.view(1, 1, n).to(device))
                for i in range(view.num_layers)]

    def eviction_order_words(self) -> str:
        return "the same random draw (the always-kept entries last)"

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, RandomState):
            sinks, recent = state.forced
            out.append(Fact("seed", "draw", state.seed, fmt="d",
                            unit=f" (seed {self.seed} and this request; one draw per layer, shared by its KV heads)"))
            out.append(Fact("always_kept", "always kept", sinks + recent, fmt="d",
                            unit=f" entries per layer ({sinks} first, {recent} newest prompt)"))
        return out
