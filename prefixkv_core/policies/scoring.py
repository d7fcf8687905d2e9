"""Which entries a layer keeps: scores over its entries, higher = kept first.

Every scorer is a small pure function returning fp32 scores shaped [B, 1, T] (one ranking per layer: the
layer-wise methods) or [B, Hkv, T] (a ranking per KV head: SnapKV's window). Methods pick one, rank with
`base.top_k_keep` (protected entries forced in) and add their own specifics (windows kept whole, merges).

- `recency`: newer entries first (Local / StreamingLLM).
- `colsum`: column sums of the prefill attention over every prompt query, averaged over the heads (the
  papers' importance; H2O keeps accumulating them while decoding, see `accumulated`).
- `normalised_colsum`: the same divided by how many prompt queries see each token (N - j), which removes
  the bias towards early tokens.
- `snap_window`: the votes of the last W prompt queries (SnapKV's observation window), max-pooled.
- `two_key_order`: a ranking by one score, ties broken by a second (SnapKV's pooled votes, then raw votes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SCORERS = ("colsum", "normalised", "window")  # the prefill scorers a method can be told to rank by
SNAP_KERNEL = 7  # SnapKV's max-pool width over the window's votes (its published default)


def recency(positions: torch.Tensor) -> torch.Tensor:
    """positions [B, H, T] (true token positions) -> [B, H, T]: the newest entry scores highest."""
    return positions.float()


def colsum(column_sums: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """[B, Hkv, N] column sums of the prefill attention -> [B, 1, N] averaged over KV heads (the layer's
    importance), or the [B, Hkv, N] sums themselves with `per_head`."""
    return column_sums if per_head else column_sums.mean(dim=1, keepdim=True)


def normalised_colsum(column_sums: torch.Tensor, positions: torch.Tensor, prompt_len: int,
                      per_head: bool = False) -> torch.Tensor:
    """`colsum` divided by the number of prompt queries that can see each token (N - j, at least 1).
    positions [B, Hkv, N]: the entries' true positions."""
    scores = colsum(column_sums, per_head)
    pos = positions.float() if per_head else positions[:, :1].float()
    return scores / (prompt_len - pos).clamp_min(1.0)


def accumulated(scores: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """A layer's running scores ([B, Hkv, T]: prefill column sums plus every decoding query's attention, as
    the cache accumulates them for H2O) -> [B, 1, T] averaged over KV heads, or per KV head."""
    return scores if per_head else scores.mean(dim=1, keepdim=True)


POOLINGS = ("max", "avg")  # how SnapKV's family smooths the window's votes: max pooling (SnapKV's runs), average


def snap_window(window_votes: torch.Tensor, window: int, kernel: int = SNAP_KERNEL, sink: int = 0,
                pooling: str = "max") -> torch.Tensor:
    """SnapKV's scores per KV head. window_votes [B, Hkv, N]: attention of the last `window` prompt queries
    summed over them. The tokens before the window get their votes pooled (width `kernel`, stride 1, same
    length, among themselves only: `max`, or `avg` with the edges padded by zeros as torch's average pooling
    counts them); the window's own tokens keep their raw votes (SnapKV keeps them whatever they score). The
    first `sink` tokens (kept whatever they score) are left out of the pool: their votes do not lift their
    neighbours (they count as padding), and they keep their raw votes. -> [B, Hkv, N] fp32."""
    b, h, n = window_votes.shape
    w = min(window, n)
    raw = window_votes[..., : n - w].float()
    prefix = raw
    if kernel > 1 and prefix.shape[-1] > 0:
        s = min(sink, prefix.shape[-1])
        masked = raw.clone()
        flat = masked.reshape(b * h, 1, -1)
        if pooling == "avg":
            masked[..., :s] = 0.0
            prefix = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2).view(b, h, -1)
        else:
            masked[..., :s] = float("-inf")
            prefix = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).view(b, h, -1)
        prefix[..., :s] = raw[..., :s]
    return torch.cat([prefix, window_votes[..., n - w:].float()], dim=-1)


def two_key_order(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Indices along the last axis, best first: higher `first`, then (among equal `first`) higher `second`,
    then the lower index. first, second [..., T] (broadcastable to each other)."""
    first, second = torch.broadcast_tensors(first.float(), second.float())
    order = torch.argsort(second, dim=-1, descending=True, stable=True)
    return order.gather(-1, torch.argsort(first.gather(-1, order), dim=-1, descending=True, stable=True))


def prefill_scores(stats: dict[str, torch.Tensor], positions: torch.Tensor, prompt_len: int, scorer: str,
                   window: int = 8, kernel: int = SNAP_KERNEL) -> torch.Tensor:
    """One layer's scores over its prompt entries by the named scorer (one of SCORERS): `colsum` and
    `normalised` rank the layer as a whole ([B, 1, N]); `window` ranks per KV head ([B, Hkv, N]).
    stats: the layer's prefill statistics ("colsum", and "window" for the window scorer)."""
    if scorer == "colsum":
        return colsum(stats["colsum"])
    if scorer == "normalised":
        return normalised_colsum(stats["colsum"], positions, prompt_len)
    if scorer == "window":
        return snap_window(stats["window"], window, kernel)
    raise ValueError(f"unknown scorer {scorer!r}; accepted: {', '.join(SCORERS)}")
