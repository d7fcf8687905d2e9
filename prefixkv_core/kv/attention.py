"""The attention function the engine registers for the text model.

Why our own: the built-in causal mask is sized from layer 0, which breaks once layers hold different
numbers of tokens. This function builds its own bottom-right-aligned causal mask from the shapes it is
given, and, when an `AttentionProbe` asks for it, computes the attention statistics the policies need
(column sums, observation-window sums, sampled-query sums, the current query's row, the post-vision queries'
sums and sparsity, a layer's keys) in fp32 without materialising more than one query chunk of the attention
matrix at a time. A layer's output hidden states are recorded by a forward hook (`hidden_states_recorded`),
as the attention function never sees them.

The probe travels as the `kv_probe` keyword argument of the model's forward: transformers passes
unknown keyword arguments down to the attention function, so nothing global holds per-run state.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .sparse_prefill import SparsePrefill, sparse_attention

ATTN_NAME = "prefixkv_tracked"
# Bytes of fp32 attention probabilities computed at once; bounds peak memory of statistics capture.
_CHUNK_BYTES = 64 * 2**20


@dataclass
class StatRequest:
    """Which statistics one forward pass should record (all per KV head, fp32, shape [B, Hkv, Tk])."""

    colsum: bool = False  # sum over every query of this pass of A[h, i, j]
    window: int = 0  # sum over the last `window` queries only (SnapKV's observation window)
    query_subset: torch.Tensor | None = None  # sum over these query indices only (ZipVL's probe)
    last_query: bool = False  # the last query's attention row (decode-time scoring)
    # Further observation windows recorded in the same pass, each as stats[f"window:{w}"], so methods that
    # asked for different windows each get their own (a shared prefill serves several methods).
    windows: tuple[int, ...] = ()
    # How many batch rows, counted from the first, want the last-query statistic (None = every row); the
    # statistic then has one row each. The runner puts those rows first, so they are a view of the batch.
    last_query_rows: int | None = None
    # The layers whose last-query statistic is recorded (None: every layer); the others attend as if nothing were
    # asked (DyCoke's rows read one layer's)
    last_query_layers: tuple[int, ...] | None = None
    # The post-vision queries (each row's queries after its last image token; the last query alone when the image
    # ends the prompt): stats["post_vision"], their attention summed over them, and stats["post_vision_sparse"],
    # per key how many of them give it less than `post_vision` times their row's largest probability (counting
    # visible keys only; VL-Cache's sparsity). None: not recorded. Needs the probe's `after_image`.
    post_vision: float | None = None
    keys: tuple[int, ...] = ()  # layers whose keys are kept as stats[layer]["keys"], [B, Hkv, Tk, D] fp32 (DART)
    # layers whose output hidden states, through the text model's final norm, are kept as stats[layer]["hidden"],
    # [B, T, D] fp32 (DART); recorded by `hidden_states_recorded`, not by the attention function
    hidden: tuple[int, ...] = ()
    # the attention of the probe's `raters` (each row's own queries, chosen while the forward runs) summed over
    # them, as stats["rated"] (SparseVLM's text raters)
    rated: bool = False

    def any(self) -> bool:
        return (self.colsum or bool(self.all_windows()) or self.query_subset is not None or self.last_query
                or self.post_vision is not None or self.rated)

    def last_query_count(self, batch: int) -> int:
        """How many of a batch's first rows want the last query's row (0 when none is asked for)."""
        if not self.last_query:
            return 0
        return batch if self.last_query_rows is None else self.last_query_rows

    def all_windows(self) -> tuple[int, ...]:
        return tuple(sorted({w for w in (self.window, *self.windows) if w > 0}))

    @classmethod
    def union(cls, requests) -> "StatRequest":
        """One request that records what every request in `requests` asked for."""
        out = cls()
        for r in requests:
            out.colsum |= r.colsum
            out.last_query |= r.last_query
            out.rated |= r.rated
            out.windows = tuple(sorted(set(out.windows) | set(r.all_windows())))
            out.keys = tuple(sorted(set(out.keys) | set(r.keys)))
            out.hidden = tuple(sorted(set(out.hidden) | set(r.hidden)))
            if r.post_vision is not None:
                if out.post_vision is not None and out.post_vision != r.post_vision:
                    raise ValueError("two different post-vision sparsity thresholds cannot share one forward pass")
                out.post_vision = r.post_vision
            if r.query_subset is not None:
                if out.query_subset is not None and not torch.equal(out.query_subset, r.query_subset):
                    raise ValueError("two different probe-query subsets cannot share one forward pass")
                out.query_subset = r.query_subset
        return out


@dataclass
class AttentionProbe:
    """Per-forward request + results. Pass as `model(..., kv_probe=probe)`."""

    request: StatRequest = field(default_factory=StatRequest)
    # layer -> bool [B, 1 or Hkv, Tk], True = may attend. Used for batching/padding and by tests.
    key_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    stats: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # layer -> the batch's rows in groups, each kept in tensors of its own (a decode step of the runner whose rows
    # are split by length): (rows [G] ascending, keys [G, Hkv, T_g, D], values, key mask [G, 1|Hkv, T_g] or
    # None). Attention then reads each group where it lives instead of the keys and values it was handed.
    row_groups: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]] = field(
        default_factory=dict)
    # bool [B, Tq]: the queries after each row's last image token (the post-vision statistics' queries); the
    # runner sets it from the image flags when the request asks for them
    after_image: torch.Tensor | None = None
    # a prefill whose attention runs on each layer's important tokens only (ZipVL, `sparse_prefill`); None: dense
    sparse: SparsePrefill | None = None
    # a decode step's key subsets for some rows from a layer on (DyCoke's dynamic pruning); None: every key
    subset: "StepSubset | None" = None
    # bool [B, Tq]: the queries whose attention the "rated" statistic sums (set before the first layer runs, e.g.
    # by `raters_chosen`; cut with the tokens a token drop leaves behind)
    raters: torch.Tensor | None = None

    def key_mask(self, layer: int) -> torch.Tensor | None:
        return self.key_masks.get(layer)

    def reset(self, request: StatRequest | None = None) -> None:
        self.request = request or StatRequest()
        self.stats = {}


@dataclass
class StepSubset:
    """The keys some rows of a decode step attend to from a layer on (DyCoke's dynamic pruning). `rows`: (batch
    rows, first layer, choose): from that layer on, those rows (consecutive) attend only to the entries
    choose(attention) keeps (bool [R, n] over their first n entries), where attention [R, Hkv, T] is their
    last-query statistic in the layer before, so the rows must be among those that want it (the batch's first
    rows). Chosen once a step; the batch's mask made once per key length."""

    rows: list[tuple[tuple[int, ...], int, Any]]
    _keep: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    _masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def mask(self, stats: dict, layer: int, bsz: int, k_len: int, device) -> torch.Tensor | None:
        """[B, 1, k_len]: the key mask of `layer` (True outside the subsets), None where no row's subset applies."""
        active = tuple(rows for rows, first, _ in self.rows if layer >= first)
        if not active:
            return None
        found = self._masks.get((active, k_len))
        if found is None:
            found = torch.ones(bsz, 1, k_len, dtype=torch.bool, device=device)
            for rows, first, choose in self.rows:
                if layer < first:
                    continue
                at = slice(rows[0], rows[-1] + 1)
                if list(rows) != list(range(at.start, at.stop)):
                    raise ValueError("a step subset's rows must be consecutive")
                keep = self._keep.get(rows)
                if keep is None:
                    rated = stats.get(first - 1, {}).get("last_query")
                    if rated is None or rated.shape[0] < at.stop:
                        raise ValueError("a step subset needs its rows' last-query statistic in the layer before")
                    keep = self._keep[rows] = choose(rated[at])
                n = min(int(keep.shape[-1]), k_len)
                found[at, 0, :n] = keep[:, :n]
            self._masks[(active, k_len)] = found
        return found


def _causal_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """Bottom-right aligned: query i (of the last q_len tokens) sees keys 0 .. k_len - q_len + i."""
    q_idx = torch.arange(q_len, device=device).unsqueeze(1)
    k_idx = torch.arange(k_len, device=device).unsqueeze(0)
    return k_idx <= (k_len - q_len + q_idx)


def tracked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, Tq, D]; key/value [B, Hkv, Tk, D] (the whole layer cache). Returns ([B, Tq, H, D], None)."""
    probe: AttentionProbe | None = kwargs.get("kv_probe")
    layer = getattr(module, "layer_idx", 0)
    bsz, n_heads, q_len, head_dim = query.shape
    n_kv, k_len = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else head_dim**-0.5
    extra_mask = probe.key_mask(layer) if probe is not None else None
    request = probe.request if probe is not None else None
    chosen = None
    if probe is not None and probe.subset is not None and q_len == 1:
        chosen = probe.subset.mask(probe.stats, layer, bsz, k_len, query.device)
        if chosen is not None:
            extra_mask = chosen if extra_mask is None else (extra_mask & chosen)

    if request is not None and request.last_query_layers is not None and layer not in request.last_query_layers \
            and _only_last_query(request):
        request = None  # this layer records nothing
    if request is not None:
        _check_rows(request)
    groups = probe.row_groups.get(layer) if probe is not None else None
    if probe is not None and probe.sparse is not None and q_len > 1:
        out, probe.stats[layer] = sparse_attention(query, key, value, scale, probe.sparse)
    elif groups:
        out = _grouped_decode(query, groups, scale, probe, layer, chosen, request)
    elif request is None or not request.any():
        out = _sdpa_output(query, key, value, scale, extra_mask)
    elif _only_last_query(request) and q_len == 1:
        out, stat = _decode_with_statistic(query, key, value, scale, extra_mask, request.last_query_count(bsz))
        probe.stats[layer] = {"last_query": stat}
    elif _only_last_query(request):
        # the fused kernel for the output; one softmax row per query head for the statistic, for the rows that
        # want it (the first ones: a view of the batch, no copy)
        rows = request.last_query_count(bsz)
        out = _sdpa_output(query, key, value, scale, extra_mask)
        probe.stats[layer] = {"last_query": _last_query_probs(_first_rows(query, rows), _first_rows(key, rows), scale,
                                                              _leading(extra_mask, rows)).mean(dim=2)}
    else:
        out, stats = _attention_with_stats(query, key, value, scale, extra_mask, request, probe.after_image,
                                           probe.raters)
        probe.stats[layer] = stats
    if request is not None and layer in request.keys:
        probe.stats.setdefault(layer, {})["keys"] = key.float()
    return out.transpose(1, 2).contiguous(), None


def _sdpa_output(query, key, value, scale, extra_mask):
    bsz, n_heads, q_len, head_dim = query.shape
    n_kv, k_len = key.shape[1], key.shape[2]
    if q_len == 1 and n_heads != n_kv:
        # one query per head (a decode step): each KV head's query heads become its queries, so a key mask per KV
        # head broadcasts as it is and the fused kernel reads every key once per KV head (a fifth faster on CPU
        # than grouped-query attention over the query heads)
        folded = query.reshape(bsz, n_kv, n_heads // n_kv, head_dim)
        mask = extra_mask.unsqueeze(2) if extra_mask is not None else None  # [B, Hkv|1, 1, Tk]
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
        return out.reshape(bsz, n_heads, 1, head_dim)
    mask = None
    if q_len > 1:
        mask = _causal_mask(q_len, k_len, query.device)
    if extra_mask is not None:
        # [B, Hkv|1, Tk] -> broadcast over the query heads of each group and the queries
        em = _expand_heads(extra_mask, query.shape[1]).unsqueeze(2)
        mask = em if mask is None else (em & mask)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )


def _leading(mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The first `rows` batch rows of a key mask (one broadcast over the batch stays as it is)."""
    return mask if mask is None or mask.shape[0] == 1 else mask[:rows]


def _trailing(mask: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The batch rows of a key mask after the first `rows`."""
    return mask if mask is None or mask.shape[0] == 1 else mask[rows:]


def _decode_with_statistic(query, key, value, scale, extra_mask, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step (one query per row) whose first `rows` rows want the last query's attention: their output
    comes from the probabilities the statistic needs anyway (one softmax, the keys read once), the fused kernel
    attends for the other rows. Returns (out [B, H, 1, D], the statistic [rows, Hkv, Tk])."""
    bsz, n_heads, _, head_dim = query.shape
    probs = _last_query_probs(_first_rows(query, rows), _first_rows(key, rows), scale,
                              _leading(extra_mask, rows))  # [rows, Hkv, group, Tk]
    out = _as(torch.matmul(probs, _fp32(_first_rows(value, rows))), query.dtype).reshape(rows, n_heads, 1, head_dim)
    if rows < bsz:
        rest = _sdpa_output(query[rows:], key[rows:], value[rows:], scale, _trailing(extra_mask, rows))
        out = torch.cat([out, rest])
    return out, probs.mean(dim=2)


def _first_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` batch rows of `t`: `t` itself when they are all of it (every step, every layer: an operator
    a GPU would dispatch for nothing)."""
    return t if rows == t.shape[0] else t[:rows]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, without dispatching an operator when it is of that dtype already."""
    return t if t.dtype == dtype else t.to(dtype)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.float32)


def _grouped_decode(query, groups, scale, probe: AttentionProbe, layer: int, chosen=None,
                    request: StatRequest | None = None) -> torch.Tensor:
    """A decode step whose rows live in groups (`AttentionProbe.row_groups`): each group attends over its own
    keys; the rows that want the last query's statistic (the batch's first rows, so each group's first ones)
    get it zero-padded to the longest group. `chosen` [B, 1, T]: the step's key subsets (`StepSubset`), if any."""
    request = request or StatRequest()  # None: this layer records nothing
    if query.shape[2] != 1 or (request.any() and not _only_last_query(request)):
        raise ValueError("rows in groups are for decode steps that at most ask for the last query's row")
    wanted = request.last_query_count(query.shape[0])
    out = torch.empty_like(query)
    stat = None
    if wanted:
        longest = max(keys.shape[2] for _, keys, _, _ in groups)
        stat = query.new_zeros(wanted, groups[0][1].shape[1], longest, dtype=torch.float32)
    for rows, keys, values, mask in groups:
        q = query.index_select(0, rows)
        if chosen is not None:
            mine_chosen = _fitted(chosen.index_select(0, rows), keys.shape[2])
            mask = mine_chosen if mask is None else (mask & mine_chosen)
        mine = int((rows < wanted).sum()) if wanted else 0
        if mine:
            found, statistic = _decode_with_statistic(q, keys, values, scale, mask, mine)
            stat[:, :, :keys.shape[2]].index_copy_(0, rows[:mine], statistic)
        else:
            found = _sdpa_output(q, keys, values, scale, mask)
        out.index_copy_(0, rows, found)
    if stat is not None:
        probe.stats[layer] = {"last_query": stat}
    return out


def _fitted(mask: torch.Tensor, k_len: int) -> torch.Tensor:
    """A key mask [..., T] cut or padded (with True) to k_len keys."""
    if mask.shape[-1] >= k_len:
        return mask[..., :k_len]
    return torch.cat([mask, mask.new_ones(*mask.shape[:-1], k_len - mask.shape[-1])], dim=-1)


def _only_last_query(req: StatRequest) -> bool:
    return req.last_query and not (req.colsum or req.all_windows() or req.query_subset is not None
                                   or req.post_vision is not None or req.rated)


def _check_rows(req: StatRequest) -> None:
    if req.last_query_rows is not None and not _only_last_query(req):
        raise ValueError("last_query_rows applies to a decode-time request for the last query's row only")


def _last_query_probs(query, key, scale, extra_mask) -> torch.Tensor:
    """The last query's attention probabilities in fp32, each KV head's query heads together: [B, Hkv, group, Tk]
    (their mean over the group is the statistic). The last query sees every key (bottom-right causal
    alignment), so only the key mask applies."""
    bsz, n_heads, _, head_dim = query.shape
    n_kv = key.shape[1]
    last = query if query.shape[2] == 1 else query[:, :, -1:]
    q = _fp32(last).reshape(bsz, n_kv, n_heads // n_kv, head_dim) * scale
    scores = torch.matmul(q, _fp32(key).transpose(-1, -2))  # [B, Hkv, group, Tk]
    if extra_mask is not None:
        scores = torch.where(extra_mask.unsqueeze(2), scores, float("-inf"))
    # never a fully masked row: the last query always sees its own token, which no key mask hides
    return torch.softmax(scores, dim=-1)


def _expand_heads(mask: torch.Tensor, n_heads: int) -> torch.Tensor:
    if mask.shape[1] == 1:
        return mask
    return mask.repeat_interleave(n_heads // mask.shape[1], dim=1)


def _attention_with_stats(query, key, value, scale, extra_mask, req: StatRequest, after_image=None, raters=None):
    """Chunked exact attention in fp32 that also returns the requested per-KV-head statistics (`after_image`
    [B, Tq]: the post-vision queries, when the request asks for their statistics; `raters` [B, Tq]: the queries
    the "rated" statistic sums over)."""
    bsz, n_heads, q_len, head_dim = query.shape
    n_kv, k_len = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    kf = key.float().transpose(-1, -2)  # [B, Hkv, D, Tk]
    vf = value.float()
    per_query_bytes = n_heads * k_len * 4 * bsz
    # small chunks let the causal skip above drop about half of the work; the byte cap bounds memory
    chunk = max(1, min(q_len, 128, _CHUNK_BYTES // max(per_query_bytes, 1)))
    want = {
        "colsum": req.colsum,
        "subset": req.query_subset is not None,
        "last_query": req.last_query,
    }
    acc = {name: torch.zeros(bsz, n_kv, k_len, device=query.device) for name, on in want.items() if on}
    win_starts = {w: q_len - min(w, q_len) for w in req.all_windows()}
    for w in win_starts:
        acc[f"window:{w}"] = torch.zeros(bsz, n_kv, k_len, device=query.device)
    if req.post_vision is not None:
        if after_image is None or after_image.shape != (bsz, q_len):
            raise ValueError("post-vision statistics need the probe's after_image flags, one per query of each row")
        for name in ("post_vision", "post_vision_sparse"):
            acc[name] = torch.zeros(bsz, n_kv, k_len, device=query.device)
    if req.rated:
        if raters is None or raters.shape != (bsz, q_len):
            raise ValueError("the rated statistic needs the probe's raters, one flag per query of each row")
        acc["rated"] = torch.zeros(bsz, n_kv, k_len, device=query.device)
    subset_flags = None
    if req.query_subset is not None:
        subset_flags = torch.zeros(q_len, dtype=torch.bool, device=query.device)
        subset_flags[req.query_subset.to(query.device)] = True
    em = extra_mask.unsqueeze(2) if extra_mask is not None else None  # [B, Hkv|1, 1, 1, Tk] later
    out = torch.empty(bsz, n_heads, q_len, head_dim, dtype=query.dtype, device=query.device)

    offset = k_len - q_len  # query i sees keys 0 .. offset + i
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        tc = stop - start
        visible = offset + stop  # keys past this are masked for the whole chunk: skip them (causal)
        q = query[:, :, start:stop].float().reshape(bsz, n_kv, group * tc, head_dim)
        scores = torch.matmul(q, kf[..., :visible]).mul_(scale).view(bsz, n_kv, group, tc, visible)
        # only the last `tc` visible keys can be masked by causality (the chunk's own diagonal block)
        diag_lo = max(0, offset + start)
        if diag_lo < visible:
            q_idx = torch.arange(start, stop, device=query.device).view(tc, 1)
            k_idx = torch.arange(diag_lo, visible, device=query.device).view(1, -1)
            scores[..., diag_lo:].masked_fill_(k_idx > offset + q_idx, float("-inf"))
        if em is not None:
            scores.masked_fill_(~em[..., :visible].unsqueeze(3), float("-inf"))  # [B, Hkv|1, 1, 1, Tk]
        probs = torch.softmax(scores, dim=-1)
        if em is not None:
            probs.nan_to_num_(0.0)  # a fully masked row gives zeros
        out_c = torch.matmul(probs.view(bsz, n_kv, group * tc, visible), vf[:, :, :visible])
        out[:, :, start:stop] = out_c.view(bsz, n_heads, tc, head_dim).to(query.dtype)
        if want["colsum"]:
            acc["colsum"][..., :visible] += probs.sum(dim=3).mean(dim=2)
        for w, win_start in win_starts.items():
            if stop > win_start:
                lo = max(start, win_start) - start
                acc[f"window:{w}"][..., :visible] += probs[:, :, :, lo:].sum(dim=3).mean(dim=2)
        if want["subset"]:
            rows = subset_flags[start:stop]
            if rows.any():
                acc["subset"][..., :visible] += probs[:, :, :, rows].sum(dim=3).mean(dim=2)
        if req.post_vision is not None:
            _add_post_vision(acc, scores, probs, after_image[:, start:stop], req.post_vision)
        if req.rated:
            weight = raters[:, start:stop].to(probs.dtype).view(bsz, 1, 1, tc, 1)
            acc["rated"][..., :visible] += (probs * weight).sum(dim=3).mean(dim=2)
        if want["last_query"] and stop == q_len:
            acc["last_query"][..., :visible] = probs[:, :, :, -1].mean(dim=2)
    if req.window > 0:
        acc["window"] = acc[f"window:{req.window}"]  # the single-window name policies read
    return out, acc


def _add_post_vision(acc: dict[str, torch.Tensor], scores: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
                     threshold: float) -> None:
    """Add one query chunk's post-vision statistics. scores, probs [B, Hkv, group, tc, visible] (masked scores are
    -inf); rows bool [B, tc]: the chunk's post-vision queries. A key counts as sparse for a query when it is
    visible and gets less than `threshold` times the query's largest probability."""
    if not bool(rows.any()):
        return
    visible = probs.shape[-1]
    weight = rows.to(probs.dtype).view(rows.shape[0], 1, 1, rows.shape[1], 1)
    acc["post_vision"][..., :visible] += (probs * weight).sum(dim=3).mean(dim=2)
    below = (probs < threshold * probs.amax(dim=-1, keepdim=True)) & (scores > float("-inf"))
    acc["post_vision_sparse"][..., :visible] += (below.to(probs.dtype) * weight).sum(dim=3).mean(dim=2)


def post_vision_queries(image_flags: torch.Tensor) -> torch.Tensor:
    """image_flags bool [B, T] -> bool [B, T]: each row's queries after its last image token; the last query alone
    when the image ends the row (or when the row has no image token, every query)."""
    b, t = image_flags.shape
    idx = torch.arange(t, device=image_flags.device).expand(b, t)
    last = torch.where(image_flags, idx, torch.full_like(idx, -1)).amax(dim=1, keepdim=True)  # -1: no image
    after = idx > last
    after[:, -1] = True
    return after


@contextlib.contextmanager
def hidden_states_recorded(model, probe: "AttentionProbe"):
    """While the block runs, the text model's decoder layers in `probe.request.hidden` record their output hidden
    states, through the text model's final norm, as probe.stats[layer]["hidden"] ([B, T, D] fp32)."""
    layers = probe.request.hidden
    if not layers:
        yield
        return
    text = model.get_decoder()
    handles = []

    def hook(index):
        def record(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            probe.stats.setdefault(index, {})["hidden"] = text.norm(hidden).float()
        return record

    try:
        for index in (i for i in layers if 0 <= i < len(text.layers)):
            handles.append(text.layers[index].register_forward_hook(hook(index)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _no_mask(*args, **kwargs):
    """The model must not build a mask: it would be sized from layer 0 and wrong for the others."""
    return None


# Blocks of tracked attention may nest and overlap (a benchmark inside a turn, turns of several sessions on
# their own threads): per model, the implementations before its outermost block and how many blocks are open;
# the registration itself stays while any block of any model is open.
_OPEN_BLOCKS: dict[int, tuple[int, dict[str, str]]] = {}
_OPEN_LOCK = threading.Lock()


@contextlib.contextmanager
def tracked_attention_enabled(model):
    """Our attention for the text model only while the block runs. Blocks nest and overlap: the model's own
    implementations come back when its last open block exits, and the registration goes with the last block of
    any model."""
    with _OPEN_LOCK:
        depth, before = _OPEN_BLOCKS.get(id(model), (0, None))
        if not _OPEN_BLOCKS:
            AttentionInterface.register(ATTN_NAME, tracked_attention)
            AttentionMaskInterface.register(ATTN_NAME, _no_mask)
        if depth == 0:
            before = _current_implementations(model)
            try:
                model.set_attn_implementation({"text_config": ATTN_NAME, "vision_config": before["vision_config"]})
            except Exception:
                _unregister_if_idle()
                raise
        _OPEN_BLOCKS[id(model)] = (depth + 1, before)
    try:
        yield model
    finally:
        with _OPEN_LOCK:
            depth, before = _OPEN_BLOCKS.pop(id(model))
            if depth > 1:
                _OPEN_BLOCKS[id(model)] = (depth - 1, before)
            else:
                model.set_attn_implementation(before)
                _unregister_if_idle()


def _unregister_if_idle() -> None:
    if not _OPEN_BLOCKS:
        AttentionInterface._global_mapping.pop(ATTN_NAME, None)
        AttentionMaskInterface._global_mapping.pop(ATTN_NAME, None)


def _current_implementations(model) -> dict[str, str]:
    cfg = model.config
    text = cfg.get_text_config()._attn_implementation or "sdpa"
    vision_cfg = getattr(cfg, "vision_config", None)
    vision = (vision_cfg._attn_implementation if vision_cfg is not None else None) or "sdpa"
    return {"text_config": text, "vision_config": vision}


def is_registered() -> bool:
    return ATTN_NAME in AttentionInterface._global_mapping


@contextlib.contextmanager
def raters_chosen(model, probe: "AttentionProbe", choose, is_image: torch.Tensor):
    """While the block runs one forward of a prompt, the text model's first decoder layer hands its input hidden
    states (the prompt's embeddings as the language model reads them, [B, N, D] fp32) and `is_image` [B, N] to
    `choose`, whose answer (bool [B, N]) becomes the probe's raters before any attention runs."""
    first = model.get_decoder().layers[0]

    def before_first(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        probe.raters = choose(hidden.float(), is_image.to(hidden.device))
        return None

    handle = first.register_forward_pre_hook(before_first, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
