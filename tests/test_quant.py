"""Packed low-bit quantisation for ZipVL (prefixkv_core.kv.quant)."""

import pytest
import torch

from prefixkv_core.kv.quant import (
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_keys,
    quantize_values,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _real_bytes(q: QuantizedTensor) -> int:
    return sum(t.element_size() * t.numel() for t in (q.packed, q.scale, q.zero))


def _expand_stat(q: QuantizedTensor, stat: torch.Tensor) -> torch.Tensor:
    """Per-element view of scale/zero (handles groups along the reduced axis)."""
    n = q.shape[q.axis]
    s = stat.float().movedim(q.axis, -1)
    if q.group_size is not None and s.shape[-1] > 1:
        s = s.repeat_interleave(q.group_size, dim=-1)[..., :n]
    else:
        s = s.expand(*s.shape[:-1], n)
    return s.movedim(-1, q.axis)


def _out_tol(x: torch.Tensor) -> torch.Tensor:
    """Rounding of the output dtype (relative), plus a tiny fp32 absolute slack."""
    eps = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[x.dtype]
    return x.float().abs() * eps + 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", [2, 3])
def test_roundtrip_error_bounded_by_half_scale(device, dtype, bits, axis):
    g = torch.Generator().manual_seed(bits * 10 + axis)
    x = (torch.randn(2, 3, 37, 16, generator=g) * 3 + 0.5).to(device=device, dtype=dtype)
    q = quantize(x, bits, axis=axis)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert q.packed.dtype == torch.uint8 and q.scale.dtype == torch.float16
    assert q.zero.shape == q.scale.shape
    # whole-axis groups: scale broadcasts against the input
    assert q.scale.shape[axis] == 1 and torch.broadcast_shapes(q.scale.shape, x.shape) == x.shape
    err = (y.float() - x.float()).abs()
    bound = _expand_stat(q, q.scale) / 2 + _out_tol(x)
    assert torch.all(err <= bound), (err - bound).max()
    assert torch.isfinite(y.float()).all()


def test_more_bits_less_error():
    x = torch.randn(1, 4, 64, 32, generator=torch.Generator().manual_seed(0))
    errs = {b: (dequantize(quantize(x, b, axis=2)) - x).abs().mean().item() for b in (2, 4, 8)}
    assert errs[8] < errs[4] < errs[2]
    assert errs[4] < errs[2] / 3


@pytest.mark.parametrize("bits,ratio", [(4, 8), (2, 16), (8, 4)])
def test_nbytes_true_and_compact(bits, ratio):
    B, H, T, D = 1, 8, 256, 64
    x = torch.randn(B, H, T, D)
    for q, n_stats in ((quantize_keys(x, bits), B * H * D), (quantize_values(x, bits), B * H * T)):
        assert q.nbytes() == _real_bytes(q)
        fp32 = x.numel() * 4
        assert q.packed.numel() == x.numel() * bits // 8
        assert q.nbytes() == fp32 // ratio + 2 * 2 * n_stats  # codes + fp16 scale and zero
        # overhead: 4 bytes (fp16 scale + zero) per reduced slice of 256 (keys) / 64 (values)
        assert q.nbytes() / fp32 < 1 / ratio + 4 / (4 * x.shape[q.axis]) + 1e-9


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape,axis", [((1, 1, 7, 3), 2), ((1, 2, 5, 5), 3), ((13,), 0), ((3, 1), 0)])
def test_odd_lengths(bits, shape, axis):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    q = quantize(x, bits, axis=axis)
    per = 8 // bits
    assert q.packed.numel() == -(-x.numel() // per)
    assert q.pad == q.packed.numel() * per - x.numel()
    assert q.nbytes() == _real_bytes(q)
    y = dequantize(q)
    assert y.shape == x.shape
    assert torch.all((y - x).abs() <= _expand_stat(q, q.scale) / 2 + 1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_constant_input_exact_and_finite(bits):
    x = torch.full((1, 2, 9, 4), 0.37)
    for q in (quantize_keys(x, bits), quantize_values(x, bits), quantize_keys(x, bits, group_size=4)):
        y = dequantize(q)
        assert torch.isfinite(y).all() and torch.isfinite(q.scale.float()).all()
        assert torch.allclose(y, x, atol=1e-4)
    z = torch.zeros(2, 2, 3, 3)
    assert torch.equal(dequantize(quantize_values(z, 2)), z)
    # one constant row among varied rows
    v = torch.randn(1, 1, 4, 8)
    v[0, 0, 2] = -1.5
    y = dequantize(quantize_values(v, 4))
    assert torch.allclose(y[0, 0, 2], v[0, 0, 2], atol=1e-3)


@pytest.mark.parametrize("bits", [2, 4])
def test_empty_inputs(bits):
    k = torch.randn(1, 2, 0, 8)
    for q in (quantize_keys(k, bits), quantize_values(k, bits), quantize_keys(k, bits, group_size=4)):
        assert q.packed.numel() == 0 and q.nbytes() == _real_bytes(q) == 0
        y = dequantize(q)
        assert y.shape == k.shape and y.dtype == k.dtype
    q = quantize(torch.randn(3, 0, dtype=torch.bfloat16), bits, axis=0)
    assert dequantize(q).shape == (3, 0)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [1, 8, 10, 100])
def test_grouped_keys_and_values(bits, group_size):
    x = torch.randn(2, 2, 45, 24, generator=torch.Generator().manual_seed(2))
    qk = quantize_keys(x, bits, group_size=group_size)
    qv = quantize_values(x, bits, group_size=group_size)
    ng_t = -(-45 // min(group_size, 45))
    ng_d = -(-24 // min(group_size, 24))
    assert qk.scale.shape == (2, 2, ng_t, 24)
    assert qv.scale.shape == (2, 2, 45, ng_d)
    for q in (qk, qv):
        y = dequantize(q)
        assert torch.all((y - x).abs() <= _expand_stat(q, q.scale) / 2 + 1e-5)
        assert q.nbytes() == _real_bytes(q)


def test_groups_match_independent_quantisation():
    """Grouped along T == quantising each slice of the group on its own."""
    x = torch.randn(1, 2, 20, 8, generator=torch.Generator().manual_seed(3))
    y = dequantize(quantize_keys(x, 4, group_size=8))
    parts = [dequantize(quantize_keys(x[:, :, i:i + 8], 4)) for i in range(0, 20, 8)]
    assert torch.equal(y, torch.cat(parts, dim=2))


def test_smaller_groups_reduce_error():
    x = torch.randn(1, 4, 128, 32, generator=torch.Generator().manual_seed(4))
    x[..., ::17, :] *= 8  # outlier tokens
    e_all = (dequantize(quantize_keys(x, 2)) - x).abs().mean()
    e_grp = (dequantize(quantize_keys(x, 2, group_size=16)) - x).abs().mean()
    assert e_grp < e_all


def test_keys_per_channel_values_per_token():
    x = torch.randn(1, 1, 6, 4)
    x[..., 2] *= 100  # one large channel
    qk = quantize_keys(x, 4)
    assert qk.axis == 2 and qk.scale.shape == (1, 1, 1, 4)
    # the large channel has its own scale, the others stay small
    assert qk.scale[0, 0, 0, 2] > 20 * qk.scale[0, 0, 0, 0]
    qv = quantize_values(x, 4)
    assert qv.axis == 3 and qv.scale.shape == (1, 1, 6, 1)
    assert quantize(x, 4, axis=-1).axis == 3


def test_codes_use_full_range_and_pack_low_bits_first():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0])
    q = quantize(x, 2, axis=0)
    assert q.scale.item() == 1.0 and q.zero.item() == 0.0
    # codes 0,1,2,3 -> 0b11100100; then 3 and three padding zeros -> 0b00000011
    assert q.packed.tolist() == [0b11100100, 0b00000011] and q.pad == 3
    assert torch.equal(dequantize(q), x)


def _unpacked_codes(q: QuantizedTensor) -> torch.Tensor:
    """The codes read bit by bit from the packed bytes (lowest bits first), in the tensor's own layout."""
    per, mask = 8 // q.bits, (1 << q.bits) - 1
    codes = [(byte >> (i * q.bits)) & mask for byte in q.packed.tolist() for i in range(per)]
    moved = [s for i, s in enumerate(q.shape) if i != q.axis] + [q.shape[q.axis]]
    return torch.tensor(codes[:q.numel], dtype=torch.float32).view(moved).movedim(-1, q.axis)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape, axis", [((1, 2, 7, 5), 2), ((2, 3, 13, 8), 3), ((1, 1, 1, 3), 2), ((3, 5), 0)])
def test_whole_axis_dequantisation_is_codes_times_scale_plus_zero(dtype, bits, shape, axis):
    """One group along the reduced axis (ZipVL's default) dequantises through a lookup of the packed bytes: the same
    values, bit for bit, as fp32 codes times the stored scale plus the zero, in the input's dtype."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    q = quantize(x, bits, axis)
    expected = (_unpacked_codes(q) * q.scale.float() + q.zero.float()).to(dtype)
    got = dequantize(q)
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got, expected)


def test_large_magnitude_falls_back_to_fp32_stats():
    x = torch.tensor([[-1e6, 2e6, 5.0]], dtype=torch.float32)
    q = quantize(x, 8, axis=1)
    assert q.scale.dtype == torch.float32
    y = dequantize(q)
    assert torch.isfinite(y).all()
    assert torch.all((y - x).abs() <= q.scale / 2 + 1)
    assert q.nbytes() == _real_bytes(q)


def test_bad_bits():
    with pytest.raises(ValueError):
        quantize(torch.randn(4), 3, axis=0)


def test_layouts_read_for_many_layers_pack_as_each_alone():
    """`split_layouts` reads every layer's count and scale dtypes at once; packing with them gives what packing
    each layer alone gives, the fp32 fallback included (one layer's important values overflow fp16 here)."""
    from prefixkv_core.kv.cache import pack_split, split_layouts

    g = torch.Generator().manual_seed(0)
    parts = []
    for layer in range(3):
        keys, values = torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 2, 9, 4, generator=g)
        important = torch.zeros(1, 1, 9, dtype=torch.bool)
        important[0, 0, torch.randperm(9, generator=g)[:2 + layer]] = True
        if layer == 1:
            values[0, 1, important[0, 0].nonzero()[0, 0]] = 60000.0
        parts.append((keys, values, important))
    layouts = split_layouts(parts)
    assert [layout.important for layout in layouts] == [2, 3, 4]
    assert layouts[1].scale_dtypes == (torch.float16, torch.float16, torch.float32, torch.float16)
    for (keys, values, important), layout in zip(parts, layouts):
        order, segments = pack_split(keys, values, important, 4, 2, None, layout)
        idx = order[..., None].expand(1, 2, 9, 4)
        dense_k, dense_v = keys.gather(2, idx), values.gather(2, idx)
        n = layout.important
        alone = [(quantize_keys(dense_k[:, :, lo:hi], bits), quantize_values(dense_v[:, :, lo:hi], bits))
                 for lo, hi, bits in ((0, n, 4), (n, 9, 2))]  # each finds its own scale dtype
        assert len(segments) == 2
        for mine, theirs in zip(segments, alone):
            for a, b in zip((mine.keys, mine.values), theirs):
                assert a.scale.dtype == b.scale.dtype and torch.equal(a.packed, b.packed)
                assert torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)


def _fewest_holding(row: list[float], tau: float) -> int:
    """The fewest largest scores whose sum reaches tau of the total, counted one by one (every one if none)."""
    ranked, total = sorted(row, reverse=True), sum(row)
    if total <= 0:
        return len(row)
    held = 0.0
    for p, score in enumerate(ranked, 1):
        held += score
        if held >= tau * total:
            return p
    return len(row)


def test_adaptive_counts_of_many_layers_equal_each_counted_one_by_one():
    from prefixkv_core.kv.sparse_prefill import adaptive_count, adaptive_counts

    g = torch.Generator().manual_seed(1)
    scores = torch.rand(6, 50, generator=g) ** 4
    scores[2] = 0.0  # nothing attended: every token counts
    for tau in (0.5, 0.975, 1.0):
        counts = adaptive_counts(scores, tau)
        assert counts == [adaptive_count(row, tau) for row in scores]
        if tau < 1.0:  # at tau = 1 the fp32 sums decide where the last tiny scores stop counting
            assert counts == [_fewest_holding(row.tolist(), tau) for row in scores]
