"""SnapKV: an observation window of the last prompt queries votes, per KV head, for the tokens to keep."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import StatRequest
from .base import LayerPlan, Policy, PrefillView, budget_count


def snap_select(window_scores: torch.Tensor, capacity: int, window: int, kernel: int) -> torch.Tensor:
    """window_scores [B, Hkv, N] -> kept indices [B, Hkv, capacity] (ascending).

    The last `window` tokens are always kept; from the rest, the top `capacity - window` per KV head by
    max-pooled window attention. The first token (attention sink) is always among them.
    """
    b, h, n = window_scores.shape
    w = min(window, n)
    capacity = max(min(capacity, n), w + 1 if n > w else n)
    prefix = window_scores[..., : n - w].float()
    if kernel > 1 and prefix.shape[-1] > 0:
        prefix = F.max_pool1d(prefix.reshape(b * h, 1, -1), kernel, stride=1, padding=kernel // 2).view(b, h, -1)
    if prefix.shape[-1] > 0:
        prefix = prefix.clone()
        prefix[..., 0] = float("inf")  # the sink
    k = min(capacity - w, prefix.shape[-1])
    chosen = torch.topk(prefix, k, dim=-1, sorted=False).indices
    tail = torch.arange(n - w, n, device=window_scores.device).view(1, 1, -1).expand(b, h, -1)
    return torch.cat([chosen.sort(dim=-1).values, tail], dim=-1)


@dataclass
class SnapKVPolicy(Policy):
    name = "snapkv"
    label = "SnapKV"
    summary = ("The last prompt queries (observation window) vote, per KV head, with max-pooled attention. "
               "Compresses the prompt once; the cache then grows while decoding.")
    schedule = "prompt only"

    window: int = 8
    kernel: int = 7

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(window=self.window)

    def prefill(self, view: PrefillView):
        capacity = budget_count(self.budget, view.prompt_len, min_keep=self.window + 1)
        return [
            LayerPlan(keep=snap_select(view.stats[i]["window"], capacity, self.window, self.kernel))
            for i in range(view.num_layers)
        ]
