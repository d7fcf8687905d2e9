"""SnapKV: an observation window of the last prompt queries votes, per KV head, for the tokens to keep.

Its scorer is the window's max-pooled votes (ties to the raw vote); every layer keeps the same count and the
window and the sink are always kept (`scored.ScoredPolicy`, whose allocation knobs make it AdaKV or PyramidKV)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.attention import StatRequest
from . import scoring
from .base import PolicyError, PrefillView, knob
from .scored import WINDOW_HELP, ScoredPolicy


KERNEL_HELP = "pooling width over the votes (odd, so pooling keeps the length)"
POOLING_HELP = ("how the votes are smoothed over neighbouring tokens: max (SnapKV's published runs) or avg (the "
                "pooling the SparseMM and MixKV code bases run SnapKV's family with)")


def check_kernel(label: str, kernel: int) -> None:
    if kernel % 2 == 0:
        raise PolicyError(f"{label} knob kernel must be odd (max pooling keeps the length); got {kernel}")


@dataclass(frozen=True)
class SnapKVPolicy(ScoredPolicy):
    """SnapKV: the observation window's max-pooled votes choose, per KV head, the prompt entries to keep.
    Paper: "SnapKV: LLM Knows What You are Looking for Before Generation" (Li et al., 2024),
    https://arxiv.org/abs/2404.14469"""

    name = "snapkv"
    label = "SnapKV"
    summary = ("The last prompt queries (observation window) vote, per KV head, with max-pooled attention. "
               "Compresses the prompt once; the cache then grows while decoding.")
    colour = "#009E73"

    # the reference repository's LongBench configuration: window 32, max pooling with kernel 7
    window: int = knob(32, help=WINDOW_HELP, low=1, high=4096, integer=True)
    kernel: int = knob(7, help=KERNEL_HELP, low=1, high=63, integer=True)
    pooling: str = knob("max", choices=scoring.POOLINGS, help=POOLING_HELP)

    def check(self) -> None:
        check_kernel(self.label, self.kernel)

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(window=self.fitted_window(prompt_len))

    def score(self, view: PrefillView, layer: int) -> torch.Tensor:
        w = self.fitted_window(view.prompt_len)
        return scoring.snap_window(view.stats[layer]["window"], w, self.kernel, sink=1, pooling=self.pooling)

    def tiebreak(self, view: PrefillView, layer: int) -> torch.Tensor:
        return view.stats[layer]["window"]

    def eviction_order_words(self) -> str:
        return "its window votes, the observation window last"
