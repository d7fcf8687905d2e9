"""Elastic Cache: keep the most important tokens as anchors and merge every other token into its nearest
anchor; while decoding, delete at a fixed point so the older part stays frozen and the rest is a FIFO.

Every layer keeps the same count (`allocation.uniform`), ranked by the prefill's column sums (optionally
normalised); the merge into the nearest anchor and the fixed-point decoding are its own."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.attention import StatRequest
from . import allocation
from .base import (DecodeView, LayerPlan, Merge, Policy, PolicyState, Prefilled, PrefillView, fixed_point_decode,
                   knob, layer_importance, protected_mask, top_k_keep)


def nearest_anchor(anchors: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """anchors [K] ascending, others [E] -> index into anchors of the nearest anchor by position
    (ties go to the lower index)."""
    right = torch.searchsorted(anchors, others).clamp(max=anchors.numel() - 1)
    left = (right - 1).clamp(min=0)
    d_left = (others - anchors[left]).abs()
    d_right = (anchors[right] - others).abs()
    return torch.where(d_left <= d_right, left, right)


def merge_into_nearest(keep: torch.Tensor, length: int, protected: torch.Tensor | None = None) -> Merge | None:
    """keep [1, 1, K] ascending entry indices (entries in position order) -> merge of the rest, mean-wise.

    Destinations are the kept entries that are not `protected` ([length] bool): the sink and the last
    prompt token stay as they are and never absorb others (merging into them makes the last prompt token
    swallow dozens of tokens and the output collapse at small budgets). None when nothing is evicted or no
    unprotected anchor exists (the evicted entries are then simply dropped)."""
    device = keep.device
    kept = keep[0, 0]
    is_kept = torch.zeros(length, dtype=torch.bool, device=device)
    is_kept[kept] = True
    is_anchor = is_kept.clone()
    if protected is not None:
        is_anchor &= ~protected.to(device)
    anchors = is_anchor.nonzero().flatten()
    others = (~is_kept).nonzero().flatten()
    if others.numel() == 0 or anchors.numel() == 0:
        return None
    dst = anchors[nearest_anchor(anchors, others)]
    ones = torch.ones(1, 1, others.numel(), device=device)
    return Merge(src=others.view(1, 1, -1), dst=dst.view(1, 1, -1), src_weight=ones,
                 self_weight=torch.ones(1, 1, length, device=device))


@dataclass
class ElasticState(PolicyState):
    anchors: list[int] = field(default_factory=list)  # entries kept per layer after the prompt (K_l)


@dataclass(frozen=True)
class ElasticPolicy(Policy):
    """Elastic Cache: importance-driven merging at prefill, fixed-point elimination while decoding.
    Paper: "Efficient Inference of Vision Instruction-Following Models with Elastic Cache" (Liu et al., 2024),
    https://arxiv.org/abs/2407.18121"""

    name = "elastic"
    label = "Elastic Cache"
    summary = ("Top-r·N tokens by prefill importance are kept; the others are merged (averaged) into their "
               "nearest kept token, never into the sink or the last prompt token. Decoding deletes at a fixed "
               "point (K-25): older entries stay frozen.")
    colour = "#CC79A7"
    stage = "KV merging"

    normalised_importance: bool = knob(False, help="divide column sums by how many queries see each token")

    def plans_rows_together(self) -> bool:
        return False  # the merge is planned for one row

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(colsum=True)

    def prefill(self, view: PrefillView) -> Prefilled:
        counts = allocation.uniform(self.budget, view.prompt_len, view.num_layers, min_keep=2)
        plans = []
        for i, k in enumerate(counts):
            layer = view.layer(i)
            if view.cache.layers[i].positions.shape[0] != 1:
                raise ValueError("Elastic Cache merging runs with batch size 1 only")
            imp = layer_importance(view, i, self.normalised_importance)  # [1, 1, N]
            protected = protected_mask(layer, view.prompt_len)[:, :1]
            keep = top_k_keep(imp, k, protected)
            merge = merge_into_nearest(keep, layer.length, protected[0, 0]) if k < layer.length else None
            plans.append(LayerPlan(keep=keep, merge=merge))
        return Prefilled(plans, ElasticState(anchors=counts))

    def decode(self, view: DecodeView, state: ElasticState):
        targets = allocation.uniform(self.budget, view.true_len, view.num_layers, min_keep=2)
        return fixed_point_decode(view, targets, state.anchors)
