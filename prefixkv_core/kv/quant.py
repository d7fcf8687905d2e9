"""Packed low-bit asymmetric uniform quantisation (the memory half of ZipVL).

A tensor is quantised along one *reduced axis*: every group of ``group_size``
consecutive elements along that axis (the whole axis when ``group_size`` is
``None``, the reference default) shares one ``scale`` and one ``zero``::

    zero  = min(group)
    scale = (max(group) - min(group)) / (2**bits - 1)
    q     = clamp(round((x - zero) / scale), 0, 2**bits - 1)
    x'    = q * scale + zero

ZipVL uses keys per channel (reduce over the token axis: one scale per
``(B, H, D)``) and values per token (reduce over the channel axis: one scale per
``(B, H, T)``); :func:`quantize_keys` and :func:`quantize_values` say so.

Storage (what :meth:`QuantizedTensor.nbytes` counts, nothing estimated):

* ``packed``: ``uint8``, 1-D, the codes of every element in row-major order of
  the tensor with the reduced axis moved last, ``8 // bits`` codes per byte
  (lowest bits first). When the element count is not a multiple of
  ``8 // bits`` the last byte is padded with zero codes; ``pad`` records how
  many. Group padding is never stored.
* ``scale`` / ``zero``: ``float16`` by default, whatever the input dtype
  (fp32, fp16 and bf16 all go to fp16). Their shape is the input shape with the
  reduced axis replaced by the number of groups, so with ``group_size=None``
  they broadcast against the input directly. If a range does not fit in fp16
  (``|x|`` above ~65000, possible with bf16/fp32 input) they are stored in
  fp32 instead, and ``nbytes`` counts that honestly.

The quantiser uses the *stored* (fp16) scale and zero, rounding the zero down
and the scale up by one fp16 step where rounding to nearest would not cover the
group, so the round-trip error per element is at most the stored ``scale / 2``
(up to fp32 arithmetic) plus the rounding of the output dtype (bf16/fp16). The
fp16 zero can make the stored scale a little larger than ``range / (2**bits-1)``
when a group's magnitude is large relative to its range. A constant group has
``scale == 0``: its codes are all 0 and it dequantises exactly to ``zero``
(no division by zero, no NaN). Empty tensors round-trip to empty tensors.

Everything is vectorised and device-agnostic (CPU or CUDA); the only host sync
is the fp16-overflow check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "QuantizedTensor",
    "quantize",
    "dequantize",
    "quantize_keys",
    "quantize_values",
    "SUPPORTED_BITS",
]

SUPPORTED_BITS = (2, 4, 8)
_FP16_MAX = 65504.0


@dataclass
class QuantizedTensor:
    packed: torch.Tensor  # uint8, 1-D, 8 // bits codes per byte
    scale: torch.Tensor  # float16 (fp32 on fp16 overflow); x.shape with axis -> n_groups
    zero: torch.Tensor  # same shape and dtype as scale (the group minimum)
    bits: int
    shape: tuple  # original shape
    dtype: torch.dtype  # original dtype
    axis: int  # the reduced axis (non-negative)
    group_size: int | None  # None = the whole axis is one group
    pad: int = 0  # zero codes appended to fill the last byte of ``packed``

    def nbytes(self) -> int:
        """True storage in bytes: packed codes + scales + zero points."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    def to(self, device) -> "QuantizedTensor":
        return QuantizedTensor(
            self.packed.to(device), self.scale.to(device), self.zero.to(device),
            self.bits, self.shape, self.dtype, self.axis, self.group_size, self.pad,
        )


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _moved_shape(shape: tuple, axis: int) -> tuple:
    rest = tuple(s for i, s in enumerate(shape) if i != axis)
    return rest + (shape[axis],)


def _pack(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """uint8 codes (any shape) -> 1-D packed uint8 and the number of padding codes."""
    flat = codes.reshape(-1)
    per = 8 // bits
    if per == 1:
        return flat.contiguous(), 0
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    flat = flat.view(-1, per)
    shifts = torch.arange(0, 8, bits, device=flat.device, dtype=torch.uint8)
    packed = torch.bitwise_left_shift(flat, shifts).sum(dim=1, dtype=torch.uint8)
    return packed, pad


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """1-D packed uint8 -> the first ``n`` codes as uint8."""
    per = 8 // bits
    if per == 1:
        return packed[:n]
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    codes = torch.bitwise_right_shift(packed.unsqueeze(1), shifts) & mask
    return codes.reshape(-1)[:n]


def _group_layout(n: int, group_size: int | None) -> tuple[int, int]:
    """(effective group size, number of groups) for a reduced axis of length n."""
    if group_size is not None and group_size <= 0:
        raise ValueError(f"group_size must be positive or None, got {group_size}")
    if n == 0:
        return (group_size or 0), 0
    g = n if group_size is None else min(int(group_size), n)
    return g, -(-n // g)


def quantize(x: torch.Tensor, bits: int, axis: int, group_size: int | None = None,
             scale_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Asymmetric uniform quantisation of ``x`` reducing over ``axis``.

    ``bits`` in {2, 4, 8}. ``group_size=None`` gives one (scale, zero) per slice
    along ``axis``; otherwise groups of ``group_size`` consecutive elements along
    ``axis`` (the last group may be shorter). ``scale_dtype``: the dtype of the
    stored scale and zero when the caller knows it already (`scale_dtype_for`,
    read for many tensors at once); None: found here (one host sync).
    """
    _check_bits(bits)
    if not (x.is_floating_point()):
        raise TypeError(f"quantize expects a floating tensor, got {x.dtype}")
    ndim = x.dim()
    if ndim == 0:
        raise ValueError("quantize needs at least one dimension")
    axis = axis % ndim
    shape = tuple(x.shape)
    n = shape[axis]
    g, n_groups = _group_layout(n, group_size)
    qmax = (1 << bits) - 1

    xm = x.movedim(axis, -1)  # [..., n]
    lead = xm.shape[:-1]
    stat_shape_moved = tuple(lead) + (n_groups,)

    if xm.numel() == 0 or n_groups == 0:
        scale = torch.zeros(stat_shape_moved, dtype=torch.float16, device=x.device)
        zero = torch.zeros_like(scale)
        packed = torch.zeros(0, dtype=torch.uint8, device=x.device)
        return QuantizedTensor(
            packed, scale.movedim(-1, axis), zero.movedim(-1, axis),
            bits, shape, x.dtype, axis, group_size, 0,
        )

    xf = xm.float()
    gpad = n_groups * g - n
    if gpad:
        # Repeat the last element: min/max of the short group are unchanged.
        xf_g = torch.cat([xf, xf[..., -1:].expand(*lead, gpad)], dim=-1)
    else:
        xf_g = xf
    xg = xf_g.reshape(*lead, n_groups, g)
    mn = xg.amin(dim=-1)
    mx = xg.amax(dim=-1)

    # Store scale/zero in fp16 unless a range overflows it (one host sync, unless the caller knew).
    sdtype = scale_dtype
    if sdtype is None:
        sdtype = scale_dtype_for(bool(overflows_fp16(torch.maximum(mn.abs(), mx.abs()).amax())))
    # Round the stored zero down and the stored scale up where needed, so that
    # [zero, zero + qmax * scale] covers the group and |error| <= scale / 2.
    zero_s = mn.to(sdtype)
    zero_s = torch.where(zero_s.float() > mn, torch.nextafter(zero_s, torch.full_like(zero_s, -float("inf"))), zero_s)
    zf = zero_s.float()
    scale_s = ((mx - zf) / qmax).to(sdtype)
    scale_s = torch.where(
        zf + qmax * scale_s.float() < mx,
        torch.nextafter(scale_s, torch.full_like(scale_s, float("inf"))),
        scale_s,
    )

    # Quantise with the stored values so dequantisation is consistent.
    z = zero_s.float().unsqueeze(-1)
    s = scale_s.float().unsqueeze(-1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    codes = torch.round((xg - z) * inv).clamp_(0, qmax).to(torch.uint8)
    codes = codes.reshape(*lead, n_groups * g)
    if gpad:
        codes = codes[..., :n]
    packed, pad = _pack(codes, bits)
    return QuantizedTensor(
        packed, scale_s.movedim(-1, axis), zero_s.movedim(-1, axis),
        bits, shape, x.dtype, axis, group_size, pad,
    )


def overflows_fp16(peak: torch.Tensor) -> torch.Tensor:
    """Whether a tensor whose largest magnitude is `peak` (any shape: several at once) needs fp32 scales: the test
    `quantize` makes, left on the device."""
    return peak.float() > _FP16_MAX / 2


def scale_dtype_for(overflows: bool) -> torch.dtype:
    return torch.float32 if overflows else torch.float16


@functools.lru_cache(maxsize=16)
def _code_table(bits: int, device: torch.device) -> torch.Tensor:
    """[256, 8 // bits] float32: the codes a packed byte holds, lowest bits first (so unpacking and the cast to
    float are one lookup)."""
    per, mask = 8 // bits, (1 << bits) - 1
    table = [[float((b >> (i * bits)) & mask) for i in range(per)] for b in range(256)]
    with torch.inference_mode():
        return torch.tensor(table, dtype=torch.float32, device=device)


def _dequantize_whole_axis(q: QuantizedTensor, total: int) -> torch.Tensor:
    """`dequantize` with one group along the reduced axis: the stored scale and zero broadcast against the
    tensor as it is, so the codes are read through one lookup and moved back as a view. A decode step dequantises
    every packed block of every layer, so it is a handful of operators, not a score; the arithmetic is the
    general path's (fp32 codes times the fp32 value of the stored scale, plus the zero)."""
    codes = _code_table(q.bits, q.packed.device).index_select(0, q.packed.long())  # [bytes, codes a byte]
    if codes.numel() != total:  # the last byte's padding codes
        codes = codes.view(-1).narrow(0, 0, total)
    codes = codes.view(_moved_shape(tuple(q.shape), q.axis))
    if q.axis != len(q.shape) - 1:
        codes = codes.movedim(-1, q.axis)
    out = codes * q.scale + q.zero
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Back to a dense tensor of the original shape and dtype."""
    shape = tuple(q.shape)
    moved = _moved_shape(shape, q.axis)
    n = shape[q.axis]
    total = 1
    for s in shape:
        total *= int(s)
    if total == 0:
        return torch.zeros(shape, dtype=q.dtype, device=q.packed.device)
    g, n_groups = _group_layout(n, q.group_size)
    if n_groups == 1:
        return _dequantize_whole_axis(q, total)
    codes = _unpack(q.packed, q.bits, total).reshape(moved).float()
    s = q.scale.movedim(q.axis, -1).float()  # [..., n_groups]
    z = q.zero.movedim(q.axis, -1).float()
    if n_groups > 1:
        s = s.repeat_interleave(g, dim=-1)[..., :n]
        z = z.repeat_interleave(g, dim=-1)[..., :n]
    out = codes * s + z
    return out.movedim(-1, q.axis).to(q.dtype)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int | None = None,
                  scale_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Keys ``[B, H, T, D]``, per channel: one scale/zero per (B, H, D) over the
    token axis T (groups of ``group_size`` tokens when given)."""
    if k.dim() != 4:
        raise ValueError(f"keys must be [B, H, T, D], got {tuple(k.shape)}")
    return quantize(k, bits, axis=2, group_size=group_size, scale_dtype=scale_dtype)


def quantize_values(v: torch.Tensor, bits: int, group_size: int | None = None,
                    scale_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Values ``[B, H, T, D]``, per token: one scale/zero per (B, H, T) over the
    channel axis D (groups of ``group_size`` channels when given)."""
    if v.dim() != 4:
        raise ValueError(f"values must be [B, H, T, D], got {tuple(v.shape)}")
    return quantize(v, bits, axis=3, group_size=group_size, scale_dtype=scale_dtype)
