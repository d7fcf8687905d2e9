"""FastV: after the first K layers, the image tokens the last prompt token attends to least are gone.

Paper: Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
Vision-Language Models", ECCV 2024, https://arxiv.org/abs/2403.06764.

A prefill token reduction: it changes the prefill itself, so it runs one of its own. Layers 0 … K-1 see every
token. A score from layer K-1 ranks the image tokens (`rank`: by default the attention of its last query,
averaged over heads, as the reference code ranks them); from layer K on the lowest-ranked ones leave the forward
(`prefill_token_drop`: the runner asks for the choice when the forward reaches layer K, and layers K and later
compute the kept tokens only, as in the paper), so those layers' caches never hold them. Text tokens all stay.
The ranking is made once, on the prompt; generated tokens are all kept afterwards. `ImageDropPolicy` is the part
DART (dart.py) shares: the own prefill whose later layers never see the dropped image tokens, the budget mapping
and the plans.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..kv.attention import StatRequest
from ..models.embedded import EMBEDDED_SLUG
from .base import (Fact, LayerPlan, Policy, PolicyError, PolicyState, Prefilled, PrefillView, ResolveContext, TokenDrop,
                   draw_seed, knob)
from .image_budget import BUDGET_OF

BUDGET_OF_HELP = ("what the budget r is a share of. cache: the prompt's KV cache averaged over layers, as for every "
                  "method (image tokens are dropped after layer K until the mean reaches r); image: the image tokens "
                  "kept after layer K (R; the paper's R is the share dropped)")
RANKS = ("last_query", "mean_received", "random")
RANK_HELP = ("what ranks the image tokens at layer K-1. last_query: the last prompt token's attention averaged over "
             "heads (the reference code); mean_received: the attention each token receives, averaged over every "
             "prompt query and head (the paper's text); random: a seeded uniform draw (the reference code's control)")
EMBEDDED_NOTE = ("on the embedded model, the last query's layer-1 attention picks against the objects (2.6 of 17 "
                 "object patches in its top 47, a random 47 hold 6): with half the image kept it answers 14 % at "
                 "K = 2, 67 % at K = 4 and 100 % from K = 8, Full 98 % (the layer knob; docs/methods.md, FastV on the "
                 "embedded model)")


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


def rank_scores(stats: dict[str, torch.Tensor], rank: str, seed: int = 0) -> torch.Tensor:
    """One layer's statistics -> [B, N] fp32 scores over the prompt tokens (higher = kept first).

    last_query: the last query's row ("last_query" [B, Hkv, N], each KV head the mean over its query heads),
    averaged over heads; mean_received: the column sums over every prompt query ("colsum" [B, Hkv, N]) averaged
    over heads and divided by N; random: uniform noise from a CPU generator seeded with `seed`, the same in
    every row."""
    if rank == "last_query":
        return stats["last_query"].float().mean(dim=1)  # equal-sized groups: the mean over every query head
    colsum = stats["colsum"].float()
    if rank == "mean_received":
        return colsum.mean(dim=1) / colsum.shape[-1]
    if rank == "random":
        noise = torch.rand(colsum.shape[-1], generator=torch.Generator(device="cpu").manual_seed(int(seed)))
        return noise.to(colsum.device).expand(colsum.shape[0], -1)
    raise PolicyError(f"unknown FastV rank {rank!r}; accepted: {', '.join(RANKS)}")


def fastv_keep(score: torch.Tensor, is_image: torch.Tensor, keep: int) -> torch.Tensor:
    """score [B, N] (`rank_scores`); is_image [B, N] -> bool [B, N] tokens kept: every text token and the `keep`
    image tokens with the highest score (ties to the earlier token). The first token is always kept."""
    score = torch.where(is_image, score.float(), torch.full_like(score, float("inf"), dtype=torch.float))
    n_text = int((~is_image[0]).sum())
    order = torch.argsort(score, dim=-1, descending=True, stable=True)[:, : n_text + keep]
    kept = torch.zeros_like(is_image).scatter_(1, order, True)
    kept[:, 0] = True
    return kept


def kept_tokens_plan(positions: torch.Tensor, kept: torch.Tensor) -> LayerPlan | None:
    """The plan that keeps a layer's entries of the tokens `kept` (bool [B, N]), from the entries' true positions
    ([B, T], every head alike after a prompt): None when the layer holds those only (its prefill left the others
    behind, `prefill_token_drop`), else their indices."""
    entry_kept = kept.gather(1, positions.long())
    if bool(entry_kept.all()):
        return None
    return LayerPlan(keep=torch.stack([row.nonzero().flatten() for row in entry_kept]).unsqueeze(1))


@dataclass
class FastVState(PolicyState):
    layer: int = 0  # K: the first layer without the dropped tokens
    image_tokens: int = 0
    image_kept: int = 0  # in layers K and later
    rank: str = ""  # what ranked the image tokens (FastV's `rank`)


@dataclass(frozen=True)
class ImageDropPolicy(Policy):
    """What FastV and DART share (not a method of its own): a prefill of their own whose layers from K on never see
    the image tokens `choose` drops, decided from what layers 0 … K-1 recorded; once the prompt is done those
    entries leave the caches of layers K and later. Text tokens all stay; generated tokens are all kept."""

    schedule = "prompt only"
    stage = "prefill token reduction"
    control = "random_drop"

    layer: int = knob(2, help="K: layers 0 … K-1 see every token; layers K and later never see the dropped image "
                              "tokens", low=1, high=1024, integer=True)
    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF)

    def choose(self, stats: dict[int, dict[str, torch.Tensor]], is_image: torch.Tensor, keep: int,
               state: PolicyState | None = None) -> torch.Tensor:
        """bool [B, N] the tokens layers K and later keep (every text token and `keep` image tokens per row), from
        the statistics of layers 0 … K-1; `state` (in the prefill's planning) may note what was found."""
        raise NotImplementedError

    def new_state(self) -> FastVState:
        return FastVState(layer=self.layer)

    def _keep(self, prompt_len: int, is_image: torch.Tensor, num_layers: int) -> int:
        return kept_image_tokens(self.budget, prompt_len, int(is_image[0].sum()), num_layers, self.layer,
                                 self.budget_of)

    def prefill_token_drop(self, prompt_len: int, is_image: torch.Tensor, num_layers: int) -> TokenDrop | None:
        keep = self._keep(prompt_len, is_image, num_layers)
        if self.layer >= num_layers or keep >= int(is_image[0].sum()):
            return None
        return TokenDrop(self.layer, lambda stats, kept: self.choose(stats, is_image, keep))

    def prefill(self, view: PrefillView) -> Prefilled:
        n, num_layers = view.prompt_len, view.num_layers
        is_image = view.layer(0).is_image[:, 0]
        n_image = int(is_image[0].sum())
        keep = self._keep(n, is_image, num_layers)
        state = self.new_state()
        state.image_tokens, state.image_kept = n_image, keep
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
        kept = self.choose(view.stats, is_image, keep, state)  # the same count in every row of a batch
        for i in range(self.layer, num_layers):
            plans[i] = kept_tokens_plan(view.layer(i).positions[:, 0], kept)
        return Prefilled(plans, state)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, FastVState) and state.image_tokens:
            share = state.image_kept / state.image_tokens
            out.append(Fact("image_kept", f"image tokens kept from layer {state.layer} on", state.image_kept,
                            fmt="d", unit=f" of {state.image_tokens}"))
            out.append(Fact("image_kept_share", "R, the share of the image tokens kept", share, fmt=".0%",
                            unit=f" ({1 - share:.0%} dropped, what FastV's paper calls R)"))
            if state.rank:
                out.append(Fact("rank", "ranked by", state.rank.replace("_", " ")))
        return out


@dataclass(frozen=True)
class FastVPolicy(ImageDropPolicy):
    """FastV: after layer K the image tokens the last prompt token attends to least are dropped for every later
    layer. Paper: "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
    Vision-Language Models" (Chen et al., ECCV 2024), https://arxiv.org/abs/2403.06764"""

    name = "fastv"
    label = "FastV"
    summary = ("Prefill token reduction: after the first K layers, the image tokens the last prompt token attends to "
               "least are dropped from every later layer. Generated tokens are all kept.")
    colour = "#17BECF"

    layer: int = knob(2, help="K: layers 0 … K-1 see every token; layer K-1 ranks the image tokens and layers K and "
                              "later never see the dropped ones", low=1, high=1024, integer=True)
    rank: str = knob("last_query", help=RANK_HELP, choices=RANKS)
    # not knobs, set by `resolve`: the comparison's seed and the request's fingerprint (the random ranking's
    # draw, `draw_seed`) and the model's slug
    seed: int = field(default=0, kw_only=True)
    request: int = field(default=0, kw_only=True)
    model_slug: str = field(default="", kw_only=True)

    def resolve(self, context: ResolveContext) -> "FastVPolicy":
        return dataclasses.replace(self, seed=int(context.seed), request=int(context.request),
                                   model_slug=context.model_slug)

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        # layer K-1's last query ranks the image tokens; the column sums are always recorded
        return StatRequest(last_query=self.rank == "last_query")

    def new_state(self) -> FastVState:
        return FastVState(layer=self.layer, rank=self.rank)

    def prefill(self, view: PrefillView) -> Prefilled:
        plans, state = super().prefill(view)
        if state.image_tokens and self.model_slug.startswith(EMBEDDED_SLUG):
            state.notes.append(EMBEDDED_NOTE)
        return Prefilled(plans, state)

    def choose(self, stats: dict[int, dict[str, torch.Tensor]], is_image: torch.Tensor, keep: int,
               state: PolicyState | None = None) -> torch.Tensor:
        layer_stats = stats.get(self.layer - 1, {})
        if self.rank == "last_query" and layer_stats.get("last_query") is None:
            raise PolicyError("FastV ranks the image tokens by the last query's attention of layer K-1, recorded by "
                              "its own prefill (runner.own_prefill)")
        return fastv_keep(rank_scores(layer_stats, self.rank, draw_seed(self.seed, self.request)), is_image, keep)
