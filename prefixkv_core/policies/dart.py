"""DART: after the first K layers, the image tokens that duplicate a few pivot tokens are gone.

Paper: Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters More",
EMNLP 2025, https://arxiv.org/abs/2502.11494 (reference code: https://github.com/ZichenWen1/DART).

A prefill token reduction, run like FastV's (`fastv.ImageDropPolicy`): layers 0 … K-1 see every token; at layer K a
few pivot tokens are picked (by default the image tokens and the text tokens after the image whose keys in layer
K-1 have the largest L1 norm, 4 of each as in the reference's LLaVA-1.5 settings), and each pivot in turn keeps
its share of the image tokens least cosine-similar to it, among those not yet kept, similarity measured on layer
K-1's output hidden states through the model's final norm (as the reference does). The image pivots are kept; the
text pivots only choose. Every other image token leaves the forward: layers K and later never compute it.
Text tokens all stay; generated tokens are all kept.

Choices where the reference leaves room (see docs/methods.md): the image pivots count within the kept image
tokens and the rest are split as evenly as possible over all pivots (the reference keeps its pivots on top of
`pivots · (count // pivots)` tokens), so the budget is met exactly; pivots choose in token order (the reference
walks a Python set); ties go to the earlier token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kv.attention import StatRequest
from .base import Fact, PolicyError, PolicyState, knob
from .fastv import FastVState, ImageDropPolicy

PIVOT_RULES = ("key_l1", "key_l2")
PIVOT_RULE_HELP = ("what picks the pivots: the largest norm of layer K-1's keys (all heads together), L1 (the "
                   "reference code) or L2")


def pivot_norms(keys: torch.Tensor, rule: str) -> torch.Tensor:
    """One row: keys [Hkv, N, D] (layer K-1's) -> [N] the norm the pivots are picked by."""
    flat = keys.float().permute(1, 0, 2).reshape(keys.shape[1], -1)  # [N, Hkv·D]: the heads side by side
    return flat.norm(p=1 if rule == "key_l1" else 2, dim=-1)


def largest(scores: torch.Tensor, among: torch.Tensor, k: int) -> torch.Tensor:
    """The k indices of `among` with the largest scores (ties to the earlier token), ascending."""
    order = torch.argsort(scores[among].float(), descending=True, stable=True)[: max(0, k)]
    return among[order].sort().values


def shares(total: int, parts: int) -> list[int]:
    """`total` split over `parts` as evenly as possible, the first ones taking the remainder."""
    base, extra = divmod(max(0, total), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def dart_row(keys: torch.Tensor, hidden: torch.Tensor, is_image: torch.Tensor, keep: int, image_pivots: int,
             text_pivots: int, rule: str) -> tuple[torch.Tensor, int, int]:
    """One row: keys [Hkv, N, D], hidden [N, D], is_image bool [N] -> (bool [N] the image tokens kept, exactly
    min(keep, image tokens) of them; the image and text pivots used). Each pivot, in token order, keeps its share
    of the candidates (image tokens neither pivots nor kept yet) least cosine-similar to it."""
    image = is_image.nonzero().flatten()
    kept = torch.zeros_like(is_image)
    keep = min(keep, image.numel())
    if keep <= 0:
        return kept, 0, 0
    norms = pivot_norms(keys, rule)
    after = torch.arange(int(image[-1]) + 1, is_image.numel(), device=is_image.device)  # the text after the image
    image_piv = largest(norms, image, min(image_pivots, keep))
    text_piv = largest(norms, after, text_pivots)
    pivots = torch.cat([image_piv, text_piv])  # in token order: the text follows the image
    kept[image_piv] = True
    candidate = is_image & ~kept
    unit = F.normalize(hidden.float(), dim=-1)
    for pivot, quota in zip(pivots.tolist(), shares(keep - image_piv.numel(), pivots.numel())):
        if quota == 0:
            continue
        pool = candidate.nonzero().flatten()
        similarity = unit[pool] @ unit[pivot]
        chosen = pool[torch.argsort(similarity, stable=True)[:quota]]  # the least duplicated first
        kept[chosen] = True
        candidate[chosen] = False
    return kept, image_piv.numel(), text_piv.numel()


def dart_keep(keys: torch.Tensor, hidden: torch.Tensor, is_image: torch.Tensor, keep: int, image_pivots: int,
              text_pivots: int, rule: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """keys [B, Hkv, N, D], hidden [B, N, D] (layer K-1's keys and output hidden states), is_image [B, N] ->
    (bool [B, N] tokens kept: every text token and `keep` image tokens per row chosen by `dart_row`; the first
    row's image and text pivot counts). The first token is always kept."""
    kept = ~is_image
    counts = (0, 0)
    for b in range(is_image.shape[0]):
        row, image_piv, text_piv = dart_row(keys[b], hidden[b], is_image[b], keep, image_pivots, text_pivots, rule)
        kept[b] |= row
        if b == 0:
            counts = (image_piv, text_piv)
    kept[:, 0] = True
    return kept, counts


@dataclass
class DARTState(FastVState):
    image_pivots: int = 0  # pivots used (first row)
    text_pivots: int = 0


@dataclass(frozen=True)
class DARTPolicy(ImageDropPolicy):
    """DART: after layer K, each of a few pivot tokens keeps the image tokens least similar to it; the duplicates
    are dropped for every later layer. Paper: "Stop Looking for Important Tokens in Multimodal Language Models:
    Duplication Matters More" (Wen et al., EMNLP 2025), https://arxiv.org/abs/2502.11494"""

    name = "dart"
    label = "DART"
    summary = ("Prefill token reduction: after the first K layers, a few pivot tokens (largest key norms) each keep "
               "the image tokens least similar to them; the duplicates are dropped from every later layer. "
               "Generated tokens are all kept.")
    colour = "#00796B"  # teal

    layer: int = knob(2, help="K: layers 0 … K-1 see every token; layer K-1's keys pick the pivots, its output "
                              "hidden states measure duplication, and layers K and later never see the dropped "
                              "image tokens", low=1, high=1024, integer=True)
    pivots: int = knob(4, help="image pivots: image tokens picked by the pivot rule, kept, each choosing its share "
                               "of the kept image tokens", low=1, high=4096, integer=True)
    text_pivots: int = knob(4, help="text pivots: tokens after the image picked by the pivot rule, each choosing its "
                                    "share of the kept image tokens (fewer when the text after the image is "
                                    "shorter)", low=0, high=4096, integer=True, label="text pivots")
    pivot_rule: str = knob("key_l1", help=PIVOT_RULE_HELP, choices=PIVOT_RULES, label="pivot rule")

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        before = self.layer - 1  # its keys pick the pivots, its output hidden states measure duplication
        return StatRequest(keys=(before,), hidden=(before,))

    def new_state(self) -> DARTState:
        return DARTState(layer=self.layer)

    def choose(self, stats: dict[int, dict[str, torch.Tensor]], is_image: torch.Tensor, keep: int,
               state: PolicyState | None = None) -> torch.Tensor:
        before = stats.get(self.layer - 1, {})
        if before.get("keys") is None or before.get("hidden") is None:
            raise PolicyError("DART picks its pivots from the keys and hidden states of layer K-1, recorded by its "
                              "own prefill (runner.own_prefill)")
        kept, (image_piv, text_piv) = dart_keep(before["keys"], before["hidden"], is_image, keep, self.pivots,
                                                self.text_pivots, self.pivot_rule)
        if isinstance(state, DARTState):
            state.image_pivots, state.text_pivots = image_piv, text_piv
        return kept

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, DARTState) and state.image_pivots:
            out.append(Fact("pivots", "pivots", f"{state.image_pivots} image + {state.text_pivots} text, by "
                                                f"{self.pivot_rule.replace('_', ' ')} norm"))
        return out
