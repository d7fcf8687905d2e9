"""ZipVL: keep every token, but store the important ones at 4 bit and the rest at 2 bit. The share of
important tokens adapts per layer: the fewest tokens holding τ of the probe queries' attention."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.attention import StatRequest
from ..kv.sparse_prefill import SparsePrefill, adaptive_counts, important_tokens, visibility_counts
from .base import DecodeView, Fact, LayerPlan, Policy, PolicyState, Prefilled, PrefillView, Quantise, knob


def probe_queries(n: int, fraction: float = 0.05, seed: int = 0) -> torch.Tensor:
    """The last `fraction` of the prompt plus `fraction` of the rest sampled with a fixed seed."""
    n_last = max(1, int(round(fraction * n)))
    rest = n - n_last
    n_sample = min(rest, max(0, int(round(fraction * n))))
    g = torch.Generator().manual_seed(seed)
    sampled = torch.randperm(rest, generator=g)[:n_sample] if rest > 0 else torch.empty(0, dtype=torch.long)
    return torch.cat([sampled.sort().values, torch.arange(rest, n)])


@dataclass
class ZipVLState(PolicyState):
    probe_queries: torch.Tensor | None = None  # prompt query indices whose attention ranked the tokens
    important_ratios: list[float] = field(default_factory=list)  # share of each layer's tokens at high precision
    attended: list[float] = field(default_factory=list)  # sparse prefill: share of each layer's tokens that attended
    # per layer: entries at full precision after the last plans (None: not known yet), so that a decode step records
    # the attention of the layers whose block fills that step only
    full_precision: list[int] | None = None


BITS = (2, 4, 8)


@dataclass(frozen=True)
class ZipVLPolicy(Policy):
    """ZipVL: an adaptive share of important tokens per layer kept at high precision, the rest at low.
    Paper: "ZipVL: Efficient Large Vision-Language Models with Dynamic Token Sparsification and KV Cache
    Compression" (He et al., 2024), https://arxiv.org/abs/2410.08584"""

    name = "zipvl"
    control = None  # it keeps every entry: no draw of entries to compare with
    label = "ZipVL"
    summary = ("Keeps every token; important tokens (the fewest holding τ of the attention, per layer) at "
               "4 bit, the rest at 2 bit. The budget slider does not apply: τ sets the trade-off.")
    colour = "#7B61C9"
    uses_budget = False
    schedule = "quantise prompt, then every 100 tokens"
    stage = "quantisation"

    tau: float = knob(0.975, help="τ: share of attention the high-precision tokens must hold (sets ZipVL's "
                                  "size/quality trade-off)", low=0.0, high=1.0, low_open=True, label="τ (tau)")
    bits_hi: int = knob(4, help="bits for important tokens", choices=BITS)
    bits_lo: int = knob(2, help="bits for the rest", choices=BITS)
    group_size: int = knob(0, help="quantisation group size (0 = the whole channel / token, as in the reference)",
                           low=0, high=65536, integer=True)
    probe_fraction: float = knob(0.05, help="share of queries probed to rank tokens (the last ones plus as many "
                                            "sampled)", low=0.0, high=0.5, low_open=True)
    decode_block: int = knob(100, help="re-quantise the newest tokens every this many generated tokens",
                             low=1, high=100000, integer=True)
    seed: int = knob(0, help="seed of the probe-query sample", low=0, high=2**31 - 1, integer=True)
    sparse_prefill: bool = knob(True, help="the prefill's attention runs on each layer's important tokens only (the "
                                           "paper's sparse prefill, a prefill of its own); false: the shared dense "
                                           "prefill, only the cache is quantised", label="sparse prefill")

    def own_prefill(self) -> bool:
        return self.sparse_prefill

    def prefill_sparsity(self, prompt_len: int) -> SparsePrefill | None:
        if not self.sparse_prefill:
            return None
        return SparsePrefill(self.tau, probe_queries(prompt_len, self.probe_fraction, self.seed))

    def plans_rows_together(self) -> bool:
        return False  # the adaptive share and the quantisation are planned for one row

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(query_subset=probe_queries(prompt_len, self.probe_fraction, self.seed))

    def decode_needs_attention(self) -> bool:
        return True

    def _plan(self, scores: torch.Tensor, normaliser: torch.Tensor | None, count: int | None = None
              ) -> tuple[LayerPlan, int]:
        """scores [B, 1, T] over the full-precision entries -> quantise them, the top-p at high precision (`count`:
        p, when counted already; the top-p by the scores alone then)."""
        flat = scores[0, 0]
        top = important_tokens(flat, normaliser, self.tau) if count is None else torch.topk(flat, count).indices
        p = top.numel()
        important = torch.zeros_like(flat, dtype=torch.bool)
        important[top] = True
        group = self.group_size or None
        return LayerPlan(quantise=Quantise(important.view(1, 1, -1), self.bits_hi, self.bits_lo, group)), p

    def prefill(self, view: PrefillView) -> Prefilled:
        n = view.prompt_len
        if view.cache.layers[0].positions.shape[0] != 1:
            raise ValueError("ZipVL runs with batch size 1 only")
        queries = probe_queries(n, self.probe_fraction, self.seed)
        counts = visibility_counts(n, queries).to(view.layer(0).positions.device)
        plans, ratios = [], []
        for i in range(view.num_layers):
            scores = view.stats[i]["subset"].mean(dim=1, keepdim=True)
            plan, p = self._plan(scores, counts)
            plans.append(plan)
            ratios.append(p / n)
        attended = [float((view.stats[i]["important"][0] >= 0).sum()) / n for i in range(view.num_layers)
                    if "important" in view.stats[i]]
        # every layer's prompt goes packed: nothing is left at full precision
        return Prefilled(plans, ZipVLState(probe_queries=queries, important_ratios=ratios, attended=attended,
                                           full_precision=[0] * view.num_layers))

    def decode_attention_layers(self, state: PolicyState | None) -> tuple[int, ...] | None:
        """The layers whose block of new entries fills with this step's token: the only ones whose attention
        ZipVL reads (a step of several tokens records every layer)."""
        if not isinstance(state, ZipVLState) or state.full_precision is None:
            return None
        return tuple(i for i, n in enumerate(state.full_precision) if n + 1 >= self.decode_block)

    def decode(self, view: DecodeView, state: ZipVLState):
        plans: list[LayerPlan | None] = []
        full_precision = []
        due: dict[int, list[int]] = {}  # full-precision length -> the layers whose block is full
        for i, layer in enumerate(view.cache.layers):
            fp_len = layer.full_precision_length
            plans.append(None)
            # a full block, and the step recorded this layer's attention (every step that fills one does)
            if fp_len < self.decode_block or view.attention is None or i not in view.attention:
                full_precision.append(fp_len)
                continue
            due.setdefault(fp_len, []).append(i)
            full_precision.append(0)  # its plan packs them all
        for fp_len, layers in due.items():
            # the current query's attention to the full-precision (newest) entries, every due layer's counted at once
            scores = [view.attention[i][..., -fp_len:].mean(dim=1, keepdim=True) for i in layers]
            counts = adaptive_counts(torch.cat([s[0] for s in scores]), self.tau)
            for i, s, count in zip(layers, scores, counts):
                plans[i] = self._plan(s, None, count)[0]
        state.full_precision = full_precision
        return plans

    def facts(self, state: ZipVLState) -> list[Fact]:
        share = [Fact("important_ratios", f"{self.bits_hi}-bit share", [round(r, 4) for r in state.important_ratios],
                      kind="per-layer", fmt=".0%")]
        if state.attended:
            share.append(Fact("attended", "prefill tokens that attended (sparse prefill)",
                              [round(r, 4) for r in state.attended], kind="per-layer", fmt=".0%"))
        return (share if state.important_ratios else []) + super().facts(state)
