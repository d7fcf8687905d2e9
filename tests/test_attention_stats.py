"""The chunked statistics path against a naive full attention matrix (GQA, offsets, several chunks)."""
import pytest
import torch

from prefixkv_core.kv.attention import (StatRequest, _attention_with_stats, _decode_with_statistic, _sdpa_output,
                                       post_vision_queries)


def _naive(q, k, v, scale, key_mask=None):
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = h // hkv
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ kr.transpose(-1, -2)) * scale
    allowed = torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq)[:, None])
    if key_mask is not None:
        allowed = allowed & key_mask.repeat_interleave(h // key_mask.shape[1], 1)[:, :, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    per_kv = probs.view(b, hkv, g, tq, tk)
    return probs @ vr, per_kv


@pytest.mark.parametrize("q_len,k_len,heads,kv_heads", [(300, 300, 4, 2), (130, 400, 4, 4), (1, 57, 6, 2)])
def test_stats_match_naive(q_len, k_len, heads, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(1, heads, q_len, 16)
    k, v = torch.randn(1, kv_heads, k_len, 16), torch.randn(1, kv_heads, k_len, 16)
    subset = torch.tensor(sorted({0, q_len // 2, q_len - 1}))
    req = StatRequest(colsum=True, window=min(8, q_len), query_subset=subset, last_query=True)
    out, stats = _attention_with_stats(q, k, v, 0.25, None, req)
    ref_out, per_kv = _naive(q, k, v, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["colsum"], per_kv.sum(3).mean(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stats["window"], per_kv[:, :, :, -min(8, q_len):].sum(3).mean(2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["subset"], per_kv[:, :, :, subset].sum(3).mean(2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["last_query"], per_kv[:, :, :, -1].mean(2), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_sdpa_output(q, k, v, 0.25, None), ref_out, atol=1e-5, rtol=1e-5)


def test_key_mask_in_both_paths():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    mask = torch.rand(1, 2, 50) > 0.4
    mask[..., 0] = True
    ref_out, per_kv = _naive(q, k, v, 0.3, mask)
    out, stats = _attention_with_stats(q, k, v, 0.3, mask, StatRequest(colsum=True))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["colsum"], per_kv.sum(3).mean(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_sdpa_output(q, k, v, 0.3, mask), ref_out, atol=1e-5, rtol=1e-5)
    assert float(stats["colsum"][~mask].abs().max()) == 0.0


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_decode_step_matches_naive(rows, per_head_mask):
    """A decode step (one query per row): the fused kernel with each KV head's query heads as its queries, and the
    leading rows' output from the probabilities of their statistic, both equal full attention; the statistic is
    the last query's row averaged over each KV head's query heads."""
    torch.manual_seed(2)
    q, k, v = torch.randn(3, 6, 1, 8), torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    lengths = torch.tensor([40, 25, 33])
    mask = (torch.arange(40) < lengths[:, None])[:, None, :]  # rows of different lengths
    if per_head_mask:  # and empty slots at the front of some heads
        mask = mask.repeat(1, 2, 1)
        mask[1, 0, :4] = False
        mask[2, 1, :7] = False
    ref_out, per_kv = _naive(q, k, v, 0.3, mask)
    torch.testing.assert_close(_sdpa_output(q, k, v, 0.3, mask), ref_out, atol=1e-5, rtol=1e-5)
    out, stat = _decode_with_statistic(q, k, v, 0.3, mask, rows)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stat, per_kv[:rows, :, :, -1].mean(2), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q_len,k_len,heads,kv_heads", [(300, 300, 4, 2), (130, 400, 4, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_post_vision_stats_match_naive(q_len, k_len, heads, kv_heads, masked):
    """The post-vision queries' attention sums, and per key how many of them score it below 1% of their row's
    largest probability (visible keys only), over two rows whose images end at different places."""
    torch.manual_seed(3)
    q = torch.randn(2, heads, q_len, 16) * 2
    k, v = torch.randn(2, kv_heads, k_len, 16), torch.randn(2, kv_heads, k_len, 16)
    flags = torch.zeros(2, q_len, dtype=torch.bool)
    flags[0, 10:q_len - 40] = True
    flags[1, 5:q_len - 1] = True  # the image ends the prompt: the last query alone
    after = post_vision_queries(flags)
    assert after[0].nonzero().flatten().tolist() == list(range(q_len - 40, q_len))
    assert after[1].nonzero().flatten().tolist() == [q_len - 1]
    mask = None
    if masked:
        mask = torch.rand(2, 1, k_len) > 0.3
        mask[..., -q_len:] = True  # every query still sees its own token
    req = StatRequest(colsum=True, post_vision=0.01)
    out, stats = _attention_with_stats(q, k, v, 0.25, mask, req, after)
    ref_out, per_kv = _naive(q, k, v, 0.25, mask)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    weight = after.float()[:, None, None, :, None]
    torch.testing.assert_close(stats["post_vision"], (per_kv * weight).sum(3).mean(2), atol=1e-5, rtol=1e-5)
    allowed = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(q_len)[:, None])
    if mask is not None:
        allowed = allowed & mask[:, :, None, :]
    sparse = torch.zeros(2, kv_heads, k_len)
    g = heads // kv_heads
    for b in range(2):
        for h in range(heads):
            for i in after[b].nonzero().flatten().tolist():
                row = per_kv[b, h // g, h % g, i]
                seen = allowed[b, 0, i] if allowed.dim() == 4 else allowed[i]
                sparse[b, h // g] += ((row < 0.01 * row.max()) & seen).float() / g
    torch.testing.assert_close(stats["post_vision_sparse"], sparse, atol=1e-4, rtol=1e-5)


def test_post_vision_without_an_image_takes_every_query_and_needs_flags():
    flags = torch.zeros(1, 6, dtype=torch.bool)
    assert post_vision_queries(flags).all()
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="after_image"):
        _attention_with_stats(q, k, v, 0.5, None, StatRequest(post_vision=0.01))
    with pytest.raises(ValueError, match="thresholds"):
        StatRequest.union([StatRequest(post_vision=0.01), StatRequest(post_vision=0.02)])
    both = StatRequest.union([StatRequest(keys=(1,), hidden=(1,)), StatRequest(keys=(0,), post_vision=0.01)])
    assert both.keys == (0, 1) and both.hidden == (1,) and both.post_vision == 0.01 and both.any()
