"""FastV: after the first K layers, the image tokens the last prompt token attends to least are gone.

Paper: Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
Vision-Language Models", ECCV 2024, https://arxiv.org/abs/2403.06764.

A prefill token reduction: it changes the prefill itself, so it runs one of its own. Layers 0 … K-1 see every
token. The attention of layer K-1's last query, averaged over heads, ranks the image tokens; from layer K on the
lowest-ranked ones are masked out of every later layer's attention (the runner asks `prefill_key_masks` during
the forward) and, once the prompt is done, their entries leave those layers' caches. Text tokens all stay.
Generated tokens are all kept afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.attention import StatRequest
from .base import Fact, LayerPlan, Policy, PolicyError, PolicyState, Prefilled, PrefillView, knob

BUDGET_OF = ("cache", "image")
BUDGET_OF_HELP = ("what the budget r is a share of. cache: the prompt's KV cache averaged over layers, as for every "
                  "method (image tokens are dropped after layer K until the mean reaches r); image: the image tokens "
                  "kept after layer K (the paper's 1 - R)")


def kept_image_tokens(budget: float, prompt_len: int, image_tokens: int, num_layers: int, layer: int,
                      budget_of: str) -> int:
    """How many image tokens the layers from K on keep. `cache`: drop d image tokens in the L - K later layers
    so that the cache averaged over all L layers holds r·N, d = (1 - r)·N·L / (L - K), at most every image token."""
    if layer >= num_layers or image_tokens == 0:
        return image_tokens
    if budget_of == "image":
        return min(image_tokens, max(0, int(round(budget * image_tokens))))
    dropped = int(round((1.0 - budget) * prompt_len * num_layers / (num_layers - layer)))
    return image_tokens - min(image_tokens, max(0, dropped))


def fastv_keep(last_query: torch.Tensor, is_image: torch.Tensor, keep: int) -> torch.Tensor:
    """last_query [B, Hkv, N]: the last prompt query's attention (each KV head: the mean over its query heads);
    is_image [B, N] -> bool [B, N] tokens kept: every text token and the `keep` image tokens with the highest
    attention averaged over heads (ties to the earlier token). The first token is always kept."""
    score = last_query.float().mean(dim=1)  # equal-sized groups: the mean over every query head
    score = torch.where(is_image, score, torch.full_like(score, float("inf")))
    n_text = int((~is_image[0]).sum())
    order = torch.argsort(score, dim=-1, descending=True, stable=True)[:, : n_text + keep]
    kept = torch.zeros_like(is_image).scatter_(1, order, True)
    kept[:, 0] = True
    return kept


class DropAfterLayer:
    """The key-mask rule of FastV's prefill: nothing before layer K; from K on, the tokens `fastv_keep` chose from
    layer K-1's last-query attention (decided once, at layer K)."""

    def __init__(self, layer: int, is_image: torch.Tensor, keep: int):
        self.layer, self.is_image, self.keep = layer, is_image, keep
        self.kept: torch.Tensor | None = None

    def __call__(self, layer: int, stats: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor | None:
        if layer < self.layer:
            return None
        if self.kept is None:
            self.kept = fastv_keep(stats[self.layer - 1]["last_query"], self.is_image, self.keep)
        return self.kept[:, None, :]


@dataclass
class FastVState(PolicyState):
    layer: int = 0  # K: the first layer without the dropped tokens
    image_tokens: int = 0
    image_kept: int = 0  # in layers K and later


@dataclass(frozen=True)
class FastVPolicy(Policy):
    """FastV: after layer K the image tokens the last prompt token attends to least are dropped for every later
    layer. Paper: "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
    Vision-Language Models" (Chen et al., ECCV 2024), https://arxiv.org/abs/2403.06764"""

    name = "fastv"
    label = "FastV"
    summary = ("Prefill token reduction: after the first K layers, the image tokens the last prompt token attends to "
               "least are dropped from every later layer. Generated tokens are all kept.")
    colour = "#17BECF"
    schedule = "prompt only"
    stage = "prefill token reduction"

    layer: int = knob(2, help="K: layers 0 … K-1 see every token; layer K-1's last query ranks the image tokens and "
                              "layers K and later never see the dropped ones", low=1, high=1024, integer=True)
    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF)

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(last_query=True)  # layer K-1's last query ranks the image tokens

    def _keep(self, prompt_len: int, is_image: torch.Tensor, num_layers: int) -> int:
        return kept_image_tokens(self.budget, prompt_len, int(is_image[0].sum()), num_layers, self.layer,
                                 self.budget_of)

    def prefill_key_masks(self, prompt_len: int, is_image: torch.Tensor, num_layers: int):
        keep = self._keep(prompt_len, is_image, num_layers)
        if self.layer >= num_layers or keep >= int(is_image[0].sum()):
            return None
        return DropAfterLayer(self.layer, is_image, keep)

    def prefill(self, view: PrefillView) -> Prefilled:
        n, num_layers = view.prompt_len, view.num_layers
        is_image = view.layer(0).is_image[:, 0]
        n_image = int(is_image[0].sum())
        keep = self._keep(n, is_image, num_layers)
        state = FastVState(layer=self.layer, image_tokens=n_image, image_kept=keep)
        if self.layer >= num_layers:
            state.notes.append(f"K = {self.layer} is not below the model's {num_layers} layers: nothing is dropped")
        plans: list[LayerPlan | None] = [None] * num_layers
        if n_image == 0 or keep >= n_image or self.layer >= num_layers:
            state.image_kept = n_image
            return Prefilled(plans, state)
        if self.budget_of == "cache" and keep == 0:
            reached = (self.layer * n + (num_layers - self.layer) * (n - n_image)) / (num_layers * n)
            state.notes.append(f"dropping every image token after layer {self.layer} holds {reached:.0%} of the "
                               f"cache, not r = {self.budget:.0%}")
        last_query = view.stats[self.layer - 1].get("last_query")
        if last_query is None:
            raise PolicyError("FastV ranks the image tokens by the last query's attention of layer K-1, recorded by "
                              "its own prefill (runner.own_prefill)")
        kept = fastv_keep(last_query, is_image, keep)  # the same count in every row of a batch
        index = torch.stack([row.nonzero().flatten() for row in kept]).unsqueeze(1)
        for i in range(self.layer, num_layers):
            plans[i] = LayerPlan(keep=index)
        return Prefilled(plans, state)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, FastVState) and state.image_tokens:
            out.append(Fact("image_kept", f"image tokens kept from layer {state.layer} on", state.image_kept,
                            fmt="d", unit=f" of {state.image_tokens}"))
        return out
