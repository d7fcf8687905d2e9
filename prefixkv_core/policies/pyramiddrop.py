"""PyramidDrop: image tokens leave the forward in stages, a share λ of them at each, ranked by the last prompt token.

Paper: Xing et al., "PyramidDrop: Accelerating Your Large Vision-Language Models via Pyramid Visual Redundancy
Reduction", CVPR 2025, https://arxiv.org/abs/2410.17247 (reference code: https://github.com/Cooperx521/PyramidDrop).

A prefill token reduction with several stages (`prefill_token_drops`): the language model's L layers are cut into
S stages at layers K_s = round(s·L/S) (LLaVA-1.5's 32 layers, S = 4: 8, 16, 24, the reference's `layer_list`).
Layers before K_1 see every token; at each K_s the image tokens still in the forward are ranked by the attention
the last prompt token pays them, averaged over heads, and the best ⌊I·λ^s⌋ of the prompt's I image tokens go on
(the reference's ratios 1, λ, λ², λ³ of the original count, λ = 0.5), the others never reach layer K_s or later.
Text tokens all stay; generated tokens are all kept, so each layer's cache holds what it computed: a pyramid.

Where this tool departs (docs/methods.md):
- the ranking at K_s is the attention of layer K_s - 1 (the stage's last layer), recorded by the attention function
  as the forward runs; the reference projects layer K_s - 1's output through layer K_s's own norm, query and key
  weights before layer K_s runs, which needs the model's code, and this tool hooks only its attention;
- the kept tokens keep their true positions (the reference renumbers them 0 … M - 1 after each stage and shifts the
  decoding positions to match);
- the budget r is, by default, the prompt's cache averaged over layers (`budget_of = cache`, λ found so the mean
  holds at most r·N entries, as every method is compared at); `budget_of = image` sets λ = r, the paper's knob.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.attention import StatRequest
from .base import Fact, LayerPlan, Policy, PolicyError, PolicyState, Prefilled, PrefillView, TokenDrop, knob
from .fastv import kept_tokens_plan
from .image_budget import BUDGET_OF

BUDGET_OF_HELP = ("what the budget r sets. cache: the prompt's KV cache averaged over layers (λ found so the mean "
                  "holds at most r·N entries, as for every method); image: λ = r, the share of the image tokens each "
                  "stage keeps of the stage before (the paper's knob)")


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """The layers where a stage begins after the first, K_s = round(s·L/S) for s = 1 … S-1 (distinct, in [1, L))."""
    return sorted({min(num_layers - 1, max(1, round(s * num_layers / stages))) for s in range(1, stages)}
                  ) if num_layers > 1 else []


def stage_counts(image_tokens: int, lam: float, stages: int) -> list[int]:
    """Image tokens the layers of stage s = 1 … len(stages) see: ⌊I·λ^s⌋ (the reference's int(I·ratio))."""
    return [int(image_tokens * lam ** s) for s in range(1, stages + 1)]


def mean_cache(prompt_len: int, image_tokens: int, layers: list[int], num_layers: int, lam: float) -> float:
    """The prompt's entries per layer, averaged over the L layers, when the stages at `layers` keep λ^s."""
    text = prompt_len - image_tokens
    bounds = [0, *layers, num_layers]
    counts = [image_tokens, *stage_counts(image_tokens, lam, len(layers))]
    return sum((bounds[s + 1] - bounds[s]) * (text + counts[s]) for s in range(len(counts))) / num_layers


def lambda_for(budget: float, prompt_len: int, image_tokens: int, layers: list[int], num_layers: int) -> float:
    """The largest λ in [0, 1] whose pyramid holds at most r·N entries per layer on average (0 when none does)."""
    target = budget * prompt_len
    if mean_cache(prompt_len, image_tokens, layers, num_layers, 1.0) <= target:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if mean_cache(prompt_len, image_tokens, layers, num_layers, mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def stage_keep(scores: torch.Tensor, is_image: torch.Tensor, keep: int) -> torch.Tensor:
    """scores [B, M] (the last prompt token's attention to the tokens still in), is_image [B, M] -> bool [B, M]:
    every text token and the `keep` image tokens with the highest scores (ties to the earlier token)."""
    ranked = torch.where(is_image, scores.float(), torch.full_like(scores, float("-inf"), dtype=torch.float))
    order = torch.argsort(ranked, dim=-1, descending=True, stable=True)[:, :keep]
    return (~is_image).scatter(1, order, True) if keep > 0 else ~is_image


@dataclass
class PyramidDropState(PolicyState):
    layers: list[int] = field(default_factory=list)  # K_1 … K_{S-1}
    lam: float = 1.0  # λ
    image_tokens: int = 0
    image_kept: list[int] = field(default_factory=list)  # per stage after the first, image tokens its layers see


@dataclass(frozen=True)
class PyramidDropPolicy(Policy):
    """PyramidDrop: at the start of each of S stages of layers, the image tokens the last prompt token attends to
    least leave the forward, a share λ kept each time. Paper: "PyramidDrop: Accelerating Your Large
    Vision-Language Models via Pyramid Visual Redundancy Reduction" (Xing et al., CVPR 2025),
    https://arxiv.org/abs/2410.17247"""

    name = "pyramiddrop"
    label = "PyramidDrop"
    summary = ("Prefill token reduction in stages: at the start of each quarter of the layers, the image tokens the "
               "last prompt token attends to least are dropped, λ kept each time (a pyramid). Text and generated "
               "tokens are all kept.")
    colour = "#AD1457"
    schedule = "prompt only"
    stage = "prefill token reduction"
    control = "random_drop"

    stages: int = knob(4, help="S: the stages the layers are cut into; each after the first begins at "
                               "K_s = round(s·L/S) (LLaVA-1.5: 8, 16, 24)", low=2, high=64, integer=True)
    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF, label="budget of")

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(last_query=True)

    def plan(self, prompt_len: int, is_image: torch.Tensor, num_layers: int) -> PyramidDropState:
        """The stages' layers and counts for this prompt (the same in every row: one prompt format)."""
        state = PyramidDropState(layers=stage_layers(num_layers, self.stages), image_tokens=int(is_image[0].sum()))
        if self.budget_of == "image":
            state.lam = float(self.budget)
        else:
            state.lam = lambda_for(self.budget, prompt_len, state.image_tokens, state.layers, num_layers)
            reached = mean_cache(prompt_len, state.image_tokens, state.layers, num_layers, state.lam)
            if reached > self.budget * prompt_len + 1e-9:
                state.notes.append(f"dropping every image token from layer {state.layers[0]} on holds "
                                   f"{reached / prompt_len:.0%} of the cache, not r = {self.budget:.0%}")
        state.image_kept = stage_counts(state.image_tokens, state.lam, len(state.layers))
        return state

    def choose(self, stats, layer: int, kept: torch.Tensor, is_image: torch.Tensor, keep: int) -> torch.Tensor:
        """At stage layer `layer`: bool [B, M] over the tokens still in (`kept` [B, M], their prompt positions)."""
        last = stats.get(layer - 1, {}).get("last_query")
        if last is None:
            raise PolicyError("PyramidDrop ranks the image tokens by the last query's attention of the layer before each "
                              "stage, recorded by its own prefill (runner.own_prefill)")
        if last.shape[-1] != kept.shape[1]:
            raise PolicyError(f"layer {layer - 1} recorded {last.shape[-1]} tokens, {kept.shape[1]} are still in")
        return stage_keep(last.float().mean(dim=1), is_image.gather(1, kept), keep)

    def prefill_token_drops(self, prompt_len: int, is_image: torch.Tensor, num_layers: int,
                            frames=None) -> list[TokenDrop]:
        state = self.plan(prompt_len, is_image, num_layers)
        if not state.image_tokens:
            return []
        return [TokenDrop(layer, lambda stats, kept, layer=layer, keep=keep: self.choose(stats, layer, kept, is_image, keep))
                for layer, keep in zip(state.layers, state.image_kept)]

    def prefill(self, view: PrefillView) -> Prefilled:
        """The plans of a prefill whose layers hold every token (None where its own prefill already left them
        behind): stage by stage the same choice, among the tokens the stage before kept."""
        is_image = view.layer(0).is_image[:, 0]
        state = self.plan(view.prompt_len, is_image, view.num_layers)
        plans: list[LayerPlan | None] = [None] * view.num_layers
        if not state.image_tokens:
            return Prefilled(plans, state)
        kept = torch.ones_like(is_image)
        bounds = [*state.layers, view.num_layers]
        for s, (layer, keep) in enumerate(zip(state.layers, state.image_kept)):
            seen = view.layer(layer - 1).positions[:, 0].long()  # the tokens layer K_s - 1 computed, in order
            candidates = kept.gather(1, seen)
            scores = view.stats[layer - 1]["last_query"].float().mean(dim=1)
            scores = torch.where(candidates, scores, torch.full_like(scores, float("-inf")))
            chosen = stage_keep(scores, is_image.gather(1, seen) & candidates, keep) & candidates
            kept = torch.zeros_like(kept).scatter(1, seen, chosen)
            for i in range(layer, bounds[s + 1]):
                plans[i] = kept_tokens_plan(view.layer(i).positions[:, 0], kept)
        return Prefilled(plans, state)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, PyramidDropState) and state.image_tokens and state.layers:
            out.append(Fact("stage_layers", "stages begin at layers", ", ".join(map(str, [0, *state.layers]))))
            out.append(Fact("lambda", "λ, the share each stage keeps", round(state.lam, 4), fmt=".2f"))
            out.append(Fact("image_kept", "image tokens each stage sees",
                            " → ".join(map(str, [state.image_tokens, *state.image_kept]))))
        return out
