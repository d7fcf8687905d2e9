"""MixKV: SnapKV's window votes mixed, per KV head, with the diversity of the keys (`diversity.mixkv_scores`).

Paper: Liu et al., "Mixing Importance with Diversity: Joint Optimization for KV Cache Compression in Large
Vision-Language Models", 2025, https://arxiv.org/abs/2510.20707 (reference code: github.com/xuyang-liu16/MixKV,
its `headwisemixkv` rule over SnapKV).

It is SnapKV with `mix = mixkv` and the reference's settings for its base methods: an observation window of 32,
votes smoothed by average pooling of width 5. The mix wraps any scoring method the same way
(`adakv.mix=mixkv` is MixKV over AdaKV, whose head budgets stay the votes', as in the reference;
`pyramidkv.mix=mixkv` over PyramidKV).

Where the reference leaves room or this tool departs (docs/methods.md):
- the head's redundancy ρ, its mixing weight, is measured on the prompt itself (the mean cosine of two of the
  head's keys); the reference reads it from a table calibrated offline for one model (Qwen2-VL, 28 layers × 4 KV
  heads) and applies it to every model, which cannot index another shape; its code computes the same quantity
  online, commented out;
- the sink is kept, as in SnapKV here, and its vote is left out of the pooling; the min-max normalisation has the
  reference's rescaling guard (1e-8) too, so a head of equal value norms scores 0 instead of NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import scoring
from .base import knob
from .diversity import MIXES
from .snapkv import KERNEL_HELP, POOLING_HELP, SnapKVPolicy


@dataclass(frozen=True)
class MixKVPolicy(SnapKVPolicy):
    """MixKV: per KV head, SnapKV's importance mixed with the keys' diversity by the head's redundancy.
    Paper: "Mixing Importance with Diversity: Joint Optimization for KV Cache Compression in Large Vision-Language
    Models" (Liu et al., 2025), https://arxiv.org/abs/2510.20707"""

    name = "mixkv"
    label = "MixKV"
    summary = ("SnapKV's window votes (and the value norms) mixed per KV head with how different each key is from the "
               "head's mean key; heads with similar keys lean on diversity. Compresses the prompt once.")
    colour = "#7B1FA2"

    kernel: int = knob(5, help=KERNEL_HELP, low=1, high=63, integer=True)
    pooling: str = knob("avg", choices=scoring.POOLINGS, help=POOLING_HELP)
    mix: str = knob("mixkv", choices=MIXES, help="mixkv = the method; none = SnapKV's ranking by the votes alone")

    def eviction_order_words(self) -> str:
        return "its mixed scores, the observation window last"
