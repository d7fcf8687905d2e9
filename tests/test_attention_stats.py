"""The chunked statistics path against a naive full attention matrix (GQA, offsets, several chunks)."""
import pytest
import torch
import torch.nn.functional as F

from prefixkv_core.kv.attention import StatRequest, _attention_with_stats, _decode_with_statistic, _sdpa_output


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
