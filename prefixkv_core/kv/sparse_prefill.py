"""ZipVL's sparse prefill attention: in each layer, only the important tokens attend, to the important tokens.

The probe queries' attention (`query_subset`: the last ones and a sample, computed first and cheaply) ranks the
layer's tokens; the fewest holding τ of it are important (the adaptive ratio, `adaptive_count`), chosen by their
normalised scores (the sum over the probe queries that see a token, divided by how many do). Attention is then
computed for the important queries over the important keys only, with one fused kernel on that shorter sequence;
the other tokens' attention outputs are zero (the paper pads them), their keys and values still enter the cache.
The last prompt token is always important: its output gives the first generated token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SparsePrefill:
    """A prefill whose attention runs on each layer's important tokens only (ZipVL)."""

    tau: float  # the share of the probe queries' attention the important tokens hold
    queries: torch.Tensor  # the probe queries (prompt indices, ascending)


def adaptive_count(scores: torch.Tensor, tau: float) -> int:
    """scores [N] >= 0 -> smallest p with the top-p scores summing to at least tau of the total."""
    return adaptive_counts(scores[None], tau)[0]


def adaptive_counts(scores: torch.Tensor, tau: float) -> list[int]:
    """`adaptive_count` of every row of scores [L, N] (one layer a row), with one read of the device. A row of
    zeros needs every token; fp32 rounding can leave the last cumulative value just under
    tau (often at tau = 1): then every token is needed, never N + 1 of them."""
    s, _ = torch.sort(scores.float().clamp_min(0), dim=-1, descending=True)
    total = s.sum(dim=-1, keepdim=True)
    cum = torch.cumsum(s, dim=-1) / total
    found = torch.searchsorted(cum, torch.full_like(total, tau - 1e-9)) + 1
    n = s.shape[-1]
    return torch.where(total > 0, found.clamp_max(n), n).view(-1).tolist()


def visibility_counts(n: int, queries: torch.Tensor) -> torch.Tensor:
    """[N]: how many of the probe queries can see token j (query i sees j <= i)."""
    hist = torch.zeros(n)
    hist.index_add_(0, queries.cpu(), torch.ones(queries.numel()))
    return torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])


def important_tokens(scores: torch.Tensor, normaliser: torch.Tensor | None, tau: float) -> torch.Tensor:
    """scores [T] (a layer's attention sums, averaged over heads) -> the important tokens' indices (ascending): the
    adaptive count of them, chosen by `scores / normaliser` (the normalised scores; None: the scores)."""
    p = adaptive_count(scores, tau)
    ranked = scores / normaliser.to(scores.device).clamp_min(1.0) if normaliser is not None else scores
    return torch.topk(ranked, p).indices.sort().values


def probe_sums(query: torch.Tensor, key: torch.Tensor, scale: float, queries: torch.Tensor) -> torch.Tensor:
    """The probe queries' attention, summed over them: [B, Hkv, N] fp32, each KV head the mean of its query heads
    (what `StatRequest.query_subset` records)."""
    bsz, n_heads, n, head_dim = query.shape
    n_kv = key.shape[1]
    idx = queries.to(query.device)
    q = query[:, :, idx].float().reshape(bsz, n_kv, n_heads // n_kv, idx.numel(), head_dim)
    scores = torch.matmul(q, key.float().transpose(-1, -2).unsqueeze(2)) * scale  # [B, Hkv, g, P, N]
    causal = torch.arange(n, device=query.device).view(1, -1) > idx.view(-1, 1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    return probs.sum(dim=3).mean(dim=2)


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     plan: SparsePrefill) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A prefill's attention (query [B, H, N, D], key and value [B, Hkv, N, D], the whole prompts) on each row's
    important tokens only -> (out [B, H, N, D], {"subset": the probe sums [B, Hkv, N], "important": [B, p_max] the
    important tokens' indices, -1 after a row's last})."""
    if query.shape[2] != key.shape[2]:
        raise ValueError("the sparse prefill runs on whole prompts (as many queries as keys)")
    n = query.shape[2]
    sums = probe_sums(query, key, scale, plan.queries)
    seen = visibility_counts(n, plan.queries)
    out = torch.zeros_like(query)
    kept = []
    for b in range(query.shape[0]):  # each row's important tokens are its own
        chosen = important_tokens(sums[b].mean(dim=0), seen, plan.tau)
        chosen = torch.unique(torch.cat([chosen, torch.tensor([n - 1], device=chosen.device)]))  # sorted
        q, k, v = query[b:b + 1, :, chosen], key[b:b + 1, :, chosen], value[b:b + 1, :, chosen]
        out[b:b + 1, :, chosen] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                 enable_gqa=q.shape[1] != k.shape[1])
        kept.append(chosen)
    important = torch.full((len(kept), max(c.numel() for c in kept)), -1, dtype=torch.long, device=query.device)
    for b, chosen in enumerate(kept):
        important[b, :chosen.numel()] = chosen
    return out, {"subset": sums, "important": important}
