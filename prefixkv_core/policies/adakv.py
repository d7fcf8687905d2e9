"""AdaKV (Ada-SnapKV): SnapKV's observation-window votes, with each layer's budget shared out among its KV heads.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference", 2024, https://arxiv.org/abs/2407.11550.

It is SnapKV with `head_budget = adaptive`: a layer keeps the same total as SnapKV (`Hkv · C` entries), but
instead of `C` per KV head, the votes of all its heads compete in one ranking: a head whose attention is
concentrated needs few entries, a head whose attention is spread gets more. A floor (share `floor_alpha` of the
per-head budget) keeps every head from starving, as the reference configuration does. The cache then holds a
different number of entries per head: the shorter heads are padded with empty slots, masked from attention and
not counted in the reported bytes (the entries actually kept, as the method's flattened per-head cache stores
them). The same allocation wraps any scorer: `pyramidkv.head_budget=adaptive` is the reference's Ada-PyramidKV.
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import knob
from .scored import HEAD_BUDGETS
from .snapkv import SnapKVPolicy


@dataclass(frozen=True)
class AdaKVPolicy(SnapKVPolicy):
    """AdaKV (Ada-SnapKV): head-wise budgets over SnapKV's observation-window votes, the layer's total fixed.
    Paper: "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"
    (Feng et al., 2024), https://arxiv.org/abs/2407.11550"""

    name = "adakv"
    label = "AdaKV"
    summary = ("SnapKV's window votes ranked across all KV heads of a layer: each head keeps its own count, the "
               "layer's total is SnapKV's. Compresses the prompt once; the cache then grows while decoding.")
    colour = "#66A61E"

    head_budget: str = knob("adaptive", choices=HEAD_BUDGETS, label="head budget",
                            help="a layer's entries among its KV heads: adaptive = all heads' scores ranked "
                                 "together (the method); uniform = the same count per head (SnapKV)")

    def eviction_order_words(self) -> str:
        return "its window votes ranked across the layer's KV heads, the observation window last"
