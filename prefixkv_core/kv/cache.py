"""A transformers `DynamicCache` whose layers also track, per cached entry, the true position, whether it
came from the image, and an accumulated attention score, and which can hold part of its entries in
packed low-bit form (ZipVL).

Layers may hold different numbers of entries. Every operation that reorders or drops entries goes through
`TrackedLayer` (`gather`, `drop_range`, `merge`; for many rows at once `joint_eviction.py`), so keys, values,
positions, flags and scores can never fall out of step. Where the fields live: `stores.py`.
Metadata is stored per KV head ([B, Hkv, T]) because head-wise methods keep different entries per head.

A head-wise method may also keep a different *number* of entries per KV head (AdaKV). The layer stays one
tensor, the shorter heads padded with empty slots at the front (true position -1, zero keys and values); the
runner masks empty slots out of attention (`key_mask`), and `nbytes`/`lengths` count only the entries kept,
as a per-head (flattened) cache would store them. `stored_nbytes` says what the padded tensors take.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .quant import QuantizedTensor, dequantize, overflows_fp16, quantize_keys, quantize_values, scale_dtype_for
from .stores import SPARE_ENTRIES, EntryStore, StoreStack, spare_for


@dataclass
class QuantSegment:
    """A block of entries stored quantised. It always sits before the full-precision part."""

    keys: QuantizedTensor
    values: QuantizedTensor
    _nbytes: int | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        if self._nbytes is None:  # a segment never changes once packed; events ask for its size every step
            self._nbytes = self.keys.nbytes() + self.values.nbytes()
        return self._nbytes


ENTRY_FIELDS = ("keys", "values", "positions", "is_image", "scores")
META_FIELDS = ("positions", "is_image", "scores")  # what a cache knows of each entry besides its key and value


def write_step_metadata(stacks: Mapping[str, StoreStack], slots: Mapping[str, torch.Tensor], layers: int,
                        positions: torch.Tensor | int) -> None:
    """A decode step's new entries' metadata, written for every layer at once into stacks over `layers` layers
    (`META_FIELDS`; `slots[name]`: each (layer, row, head)'s next slot in the field's `entries()`): the position
    (`positions` [rows], each row's, or one int for every row), no image flag (a step feeds text), a zero score."""
    with torch.inference_mode():
        for name in META_FIELDS:
            stack, at = stacks[name], slots[name]
            entries = stack.entries()
            if name != "positions":
                entries.index_fill_(0, at, False if name == "is_image" else 0.0)
            elif isinstance(positions, int):
                entries.index_fill_(0, at, positions)
            else:
                shape = (layers, stack.rows, stack.heads)
                entries.index_copy_(0, at, positions.view(1, -1, 1).expand(shape).reshape(-1))


def per_head_meta(positions: torch.Tensor, is_image: torch.Tensor, n_kv: int):
    """[B, T_new] positions / image flags -> per-KV-head positions, flags and zero scores ([B, Hkv, T_new])."""
    pos = positions[:, None, :].expand(-1, n_kv, -1)
    img = is_image[:, None, :].expand(-1, n_kv, -1)
    return pos, img, torch.zeros(pos.shape, dtype=torch.float32, device=pos.device)


def _entry_field(name: str, doc: str) -> property:
    def get(self):
        store = self._stores.get(name)
        return None if store is None else store.view(self._rows)

    def set(self, value):
        self._assign(name, value)

    return property(get, set, doc=doc)


class TrackedLayer(DynamicLayer):
    """Entries are ordered: [quantised segments..., full-precision keys/values]; metadata covers all.

    Each field lives in an `EntryStore` (rows `_rows` of it): reading `layer.keys` gives a view of this layer's
    entries, assigning it writes the new entries into the layer's own slot in place, and a forward appends
    there. The runner moves the rows of a batch into shared stores (`move_into`), where they stay."""

    keys = _entry_field("keys", "[B, Hkv, T_fp, D] the full-precision keys")
    values = _entry_field("values", "[B, Hkv, T_fp, D] the full-precision values")
    positions = _entry_field("positions", "long [B, Hkv, T] the true position of every entry")
    is_image = _entry_field("is_image", "bool [B, Hkv, T] whether an entry came from the image")
    scores = _entry_field("scores", "float32 [B, Hkv, T] accumulated attention")

    def __init__(self):
        self._stores: dict[str, EntryStore] = {}
        self._rows = (0, 1)  # this layer's rows of its stores
        super().__init__()
        self.segments: list[QuantSegment] = []
        # cached image_count(): a count, (counts of a joint eviction still on the device, this layer's row), or
        # None = recount
        self._image_count: int | tuple["KeptImageCounts", int] | None = None
        self._empty: tuple[float, int] | None = None  # cached empty-slot counts (row 0 per head, all); None = recount
        self.has_empty_slots = False  # some KV head holds empty slots (position -1): mask them from attention

    def twin(self) -> "TrackedLayer":
        """An independent copy: every field in stores of its own, the packed segments copied, what it knows of
        itself (its dtype and device, empty slots, its cached counts) the same."""
        twin = TrackedLayer()
        for name in ENTRY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(twin, name, value)
        twin.segments = copy.deepcopy(self.segments)
        twin.has_empty_slots, twin.is_initialized = self.has_empty_slots, self.is_initialized
        for known in ("dtype", "device"):  # set by transformers' lazy initialisation
            if hasattr(self, known):
                setattr(twin, known, getattr(self, known))
        twin._image_count, twin._empty = self._image_count, self._empty  # set after the fields (which reset them)
        return twin

    # -- storage ------------------------------------------------------------------------------------
    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if name == "positions":
            self._empty = None  # appends never make empty slots; only new positions do
        elif name == "is_image":
            self._image_count = None
        if value is None:
            self._stores = {n: st for n, st in self._stores.items() if n != name}
            return
        store = self._stores.get(name)
        rows = self._rows
        if store is not None and store.fits(value, rows):
            own = rows == (0, store.data.shape[0])
            if not (own and value.shape[2] + SPARE_ENTRIES < store.capacity // 2):
                store.write(rows, value)  # in place: eviction and merging compact the slot
                return
            # the layer's own store, now much larger than its entries (a compressed prompt): give the room back
        self._own_store(name, EntryStore.holding(value))

    def _own_store(self, name: str, store: EntryStore) -> None:
        """Give this layer a store of its own for `name`, leaving any store it shared (its other fields move
        along when they are next assigned; `move_into` and `own_storage` move them all)."""
        if self._stores and any(s.data.shape[0] != store.data.shape[0] or self._rows != (0, s.data.shape[0])
                                for s in self._stores.values()):
            self.own_storage()
        self._stores = {**self._stores, name: store}  # never changed in place: a batch's rows share one dict
        self._rows = (0, store.data.shape[0])

    def own_storage(self) -> None:
        """Move every field into stores of this layer's own (out of a batch's shared stores)."""
        fields = {name: getattr(self, name) for name in list(self._stores)}
        self._stores = {name: EntryStore.holding(t) for name, t in fields.items()}
        rows = {t.shape[0] for t in fields.values()}
        self._rows = (0, rows.pop() if rows else 1)

    def keep_in(self, stores: dict[str, EntryStore]) -> None:
        """Keep every field in `stores`, each holding this batch-1 layer's entries as its only row (e.g. views of
        a batch's working copy of a quantised layer)."""
        self._stores, self._rows = dict(stores), (0, 1)

    def lives_in(self, stores: dict[str, EntryStore], row: int) -> bool:
        """Whether every field of this (batch-1) layer is row `row` of `stores`."""
        return self._rows[0] == row and (self._stores is stores or
                                         all(self._stores.get(n) is s for n, s in stores.items()))

    def shares_a_store_with(self, stores: dict[str, EntryStore]) -> bool:
        """Whether any field of this layer lives in one of `stores`."""
        return any(self._stores.get(n) is s for n, s in stores.items())

    def store_of(self, name: str) -> EntryStore | None:
        """The store holding field `name` (this layer's rows of it: `store_rows`), for the code that writes many
        layers' stores at once (`joint_eviction`); None before the field exists."""
        return self._stores.get(name)

    @property
    def store_rows(self) -> tuple[int, int]:
        """This layer's rows of its stores, [first, end)."""
        return self._rows

    def move_into(self, stores: dict[str, EntryStore], row: int) -> None:
        """Copy this batch-1 layer's entries into row `row` of `stores` (a batch's shared stores) and keep them
        there: later appends, evictions and merges write that row in place."""
        move_rows_into([(row, self)], stores)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _append(self, name: str, tensor: torch.Tensor) -> None:
        store = self._stores.get(name)
        if store is None or not store.fits(tensor, self._rows):
            current = getattr(self, name)
            self._own_store(name, EntryStore.holding(tensor if current is None else torch.cat([current, tensor], 2)))
        else:
            store.append(self._rows, tensor)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append full-precision keys and values after this layer's entries (their metadata follows through
        `append_meta_per_head`); `update` does the same and returns what attention reads."""
        self._append("keys", keys)
        self._append("values", values)

    # -- transformers' side -------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append(key_states, value_states)
        keys, values = self.keys, self.values
        if not self.segments:
            return keys, values
        # Dequantise on the fly: the packed form is what the cache really stores.
        k_q = [dequantize(s.keys) for s in self.segments]
        v_q = [dequantize(s.values) for s in self.segments]
        return torch.cat(k_q + [keys], dim=-2), torch.cat(v_q + [values], dim=-2)

    def get_seq_length(self) -> int:
        keys = self.keys
        fp = 0 if (not self.is_initialized or keys is None or keys.numel() == 0) else keys.shape[-2]
        return fp + sum(s.length for s in self.segments)

    # -- metadata -----------------------------------------------------------------------------------
    def append_meta(self, positions: torch.Tensor, is_image: torch.Tensor, n_kv: int) -> None:
        """positions/is_image: [B, T_new] for the entries just appended."""
        self.append_meta_per_head(*per_head_meta(positions, is_image, n_kv), has_image=bool(is_image.any()))

    def append_meta_per_head(self, pos: torch.Tensor, img: torch.Tensor, zeros: torch.Tensor, has_image: bool) -> None:
        """The same with the per-KV-head tensors ([B, Hkv, T_new]) already built (shared by every layer);
        `has_image` says whether any new entry is an image entry (known to the caller without a device sync)."""
        if has_image or "positions" not in self._stores:  # (a view of the positions would cost an operator)
            self._image_count = None
        self._append("positions", pos)
        self._append("is_image", img)
        self._append("scores", zeros)

    def meta_written(self, n: int) -> None:
        """The metadata of the `n` text entries just appended to its keys and values was written into this layer's
        stores for it (`TrackedCache`'s write for every layer at once): they now count them."""
        for name in META_FIELDS:
            store = self._stores[name]
            store.set_lengths(self._rows, store.lengths[self._rows[0]] + n)

    @property
    def length(self) -> int:
        store = self._stores.get("positions")
        return 0 if store is None else store.lengths[self._rows[0]]

    @property
    def full_precision_length(self) -> int:
        """Entries held at full precision, after the packed segments (read off the store: no view made)."""
        store = self._stores.get("keys")
        return 0 if store is None else store.lengths[self._rows[0]]

    @property
    def entries_device(self) -> torch.device:
        """Where the entries live (read off the store: no view made, which a policy's every-step call would pay)."""
        return self._stores["positions"].data.device

    @property
    def n_kv(self) -> int:
        return self.keys.shape[1]

    def full_keys(self, first_segment: int = 0) -> torch.Tensor:
        """All keys in entry order (dequantised where stored packed), from the `first_segment`-th packed segment's on."""
        return torch.cat([dequantize(s.keys) for s in self.segments[first_segment:]] + [self.keys], dim=-2)

    def full_values(self, first_segment: int = 0) -> torch.Tensor:
        return torch.cat([dequantize(s.values) for s in self.segments[first_segment:]] + [self.values], dim=-2)

    def key_mask(self) -> torch.Tensor | None:
        """[B, Hkv, T] True where a KV head holds an entry (False on empty slots); None when no head has any."""
        return self.positions >= 0 if self.has_empty_slots else None

    def kept_per_head(self) -> float:
        """Entries held, averaged over the KV heads (of the first batch row); the length when no slot is empty."""
        if not self.has_empty_slots:
            return float(self.length)
        return self.length - self._empty_slots()[0]

    def _empty_slots(self) -> tuple[float, int]:
        """(empty slots per KV head of the first row, averaged; empty slots in all rows), counted again only
        after the positions were rewritten (events ask every step)."""
        if self._empty is None:
            empty = self.positions < 0
            self._empty = (float(empty[0].sum()) / empty.shape[1], int(empty.sum()))
        return self._empty

    # -- edits ----------------------------------------------------------------------------------------
    def gather(self, index: torch.Tensor, empty_slots: bool = False) -> None:
        """Keep entries `index` ([B, 1 or Hkv, K], into the current order) in that order. With `empty_slots`,
        index -1 (EMPTY_SLOT) makes an empty slot: position -1, zero key and value, no image flag, no score."""
        if self.segments:
            raise RuntimeError("entries stored quantised cannot be evicted; this method does not evict")
        if index.shape[0] == 1 and index.shape[1] == 1 and not empty_slots and self._gather_in_place(index.view(-1)):
            return
        b, h, _, d = self.keys.shape
        empty = None
        if index.shape[0] == 1 and index.shape[1] == 1 and not empty_slots:
            # one index for every row and head: whole entries copied as they lie (far cheaper than a gather)
            idx = index.view(-1)
            keys, values, positions, is_image, scores = (getattr(self, n).index_select(2, idx) for n in ENTRY_FIELDS)
        else:
            idx = index.expand(b, h, -1)
            if empty_slots:
                empty = idx < 0
                idx = idx.clamp_min(0)
            keys = self.keys.gather(2, idx[..., None].expand(-1, -1, -1, d))
            values = self.values.gather(2, idx[..., None].expand(-1, -1, -1, self.values.shape[-1]))
            positions, is_image, scores = (getattr(self, n).gather(2, idx) for n in ("positions", "is_image", "scores"))
        if empty is not None:
            keys, values = keys.masked_fill_(empty[..., None], 0), values.masked_fill_(empty[..., None], 0)
            positions, scores = positions.masked_fill_(empty, -1), scores.masked_fill_(empty, 0.0)
            is_image &= ~empty
            self.has_empty_slots = True
        # every field is computed before any is written: the writes go to the layer's own slot, in place
        self.keys, self.values, self.positions, self.is_image, self.scores = keys, values, positions, is_image, scores
        self._image_count = None

    def _gather_in_place(self, idx: torch.Tensor) -> bool:
        """`gather` of one index [K] for every row and head, read straight from each store and written to the front
        of the layer's slot (three operators a field, no view made); False, doing nothing, where the layer's own
        stores would then be far larger than its entries (`_assign` gives that room back instead)."""
        k = idx.shape[0]
        stores = [self._stores[name] for name in ENTRY_FIELDS]
        if any(self._rows == (0, st.data.shape[0]) and k + SPARE_ENTRIES < st.capacity // 2 for st in stores):
            return False
        with torch.inference_mode():
            kept = []
            for store in stores:  # every field read before any is written
                data = store.rows_of(self._rows)
                kept.append((store, data, data.index_select(2, idx)))
            for store, data, values in kept:
                data.narrow(2, 0, k).copy_(values)
                store.set_lengths(self._rows, k)
        self._image_count = None
        self._empty = None
        return True

    def drop_range(self, start: int, count: int) -> None:
        """Drop entries [start, start + count) of every head and row, the entries after them moving up: what
        `gather` does with every other index kept, done as a slice copy per field in the layer's own slot (a
        fixed-point eviction moves the newest few entries, not the layer)."""
        n = self.length
        if not (0 <= start and 0 < count and start + count <= n):
            raise ValueError(f"cannot drop [{start}, {start + count}) from {n} entries")
        if self.segments or self.has_empty_slots:
            kept = torch.arange(n, device=self.entries_device)
            self.gather(torch.cat([kept[:start], kept[start + count:]]).view(1, 1, -1))
            return
        after = n - start - count
        with torch.inference_mode():
            for name in ENTRY_FIELDS:
                store = self._stores[name]
                data = store.rows_of(self._rows)
                if after > 0:
                    moved = data.narrow(2, start + count, after)
                    if after > count:  # the entries overlap the slots they move to
                        moved = moved.clone()
                    data.narrow(2, start, after).copy_(moved)
                store.set_lengths(self._rows, n - count)
        self._image_count = None  # counted when asked for, with the cache's other layers (`image_counts`)

    def merge(self, src: torch.Tensor, dst: torch.Tensor, src_weight: torch.Tensor, self_weight: torch.Tensor,
              denominator: torch.Tensor | None = None):
        """Weighted merge: entry j becomes (w_j·x_j + Σ_e w_e·x_e) / d_j for keys and values, where d_j is
        `denominator` ([B, 1 or Hkv, T]) or, when None, w_j + Σ_e w_e (a weighted mean).

        src, dst, src_weight: [B, 1 or Hkv, E] (dst indexes the current order); self_weight [B, 1 or Hkv, T].
        Call before `gather` drops the sources. Positions, flags and scores of the targets are kept.
        """
        self.keys, self.values = merged_entries(self.keys, self.values, src, dst, src_weight, self_weight, denominator)

    def quantize_fp_part(self, important: torch.Tensor, bits_hi: int, bits_lo: int, group_size: int | None,
                         layout: "SplitLayout | None" = None):
        """Move the full-precision entries into two packed segments: `important` ([B, 1, T_fp] bool,
        same count per batch row) at `bits_hi`, the rest at `bits_lo` (`layout`: see `pack_split`). Metadata is
        reordered to match."""
        t_fp = self.keys.shape[2]
        if t_fp == 0:
            return
        start = self.length - t_fp
        b = self.keys.shape[0]
        order, segments = pack_split(self.keys, self.values, important.expand(b, 1, t_fp), bits_hi, bits_lo,
                                     group_size, layout)
        prefix = torch.arange(start, device=order.device).view(1, 1, -1).expand(b, 1, -1)
        full_order = torch.cat([prefix, order + start], dim=-1)
        for name in ("positions", "is_image", "scores"):  # the metadata follows the packed order
            meta = getattr(self, name)
            setattr(self, name, meta.gather(2, full_order.expand(b, meta.shape[1], -1)))
        self.segments.extend(segments)
        self.keys = self.keys[:, :, :0]
        self.values = self.values[:, :, :0]

    # -- accounting -----------------------------------------------------------------------------------
    def stored_nbytes(self) -> int:
        """Bytes of the entries as stored (empty slots included; not the stores' spare room)."""
        fp = 0
        rows = self._rows
        for name in ("keys", "values"):
            store = self._stores.get(name)
            if store is not None:  # from the store's shape: events ask every step, no view needed
                fp += (rows[1] - rows[0]) * store.lengths[rows[0]] * store.entry_bytes
        return fp + sum(s.nbytes() for s in self.segments)

    def nbytes(self) -> int:
        """Bytes of the entries this layer keeps: packed segments as stored, empty slots not counted."""
        if not self.has_empty_slots or self.keys is None:
            return self.stored_nbytes()
        keys, values = self._stores["keys"].data, self._stores["values"].data
        per_entry = keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()
        held = (self._rows[1] - self._rows[0]) * keys.shape[1] * self.length - self._empty_slots()[1]
        return held * per_entry + sum(s.nbytes() for s in self.segments)

    def image_count_on_device(self, counts: "KeptImageCounts", k: int) -> None:
        """After an eviction done for many layers at once: this layer's image count is `counts`' k-th, still on
        the device, read when `image_count` is first asked for."""
        self._image_count = (counts, k)

    def image_count(self) -> int:
        """Image entries, averaged over KV heads (head-wise methods keep different entries per head).
        Counted again only after entries were dropped or image entries added (events ask every step)."""
        if isinstance(self._image_count, tuple):
            counts, k = self._image_count
            self._image_count = counts.of(k)
        if self._image_count is not None:
            return self._image_count
        if self.is_image is None:
            return 0
        flags = self.is_image[0]  # the mean over heads of each head's count: their total over the heads
        self._image_count = int(round(int(flags.sum()) / flags.shape[0]))
        return self._image_count


def merged_entries(keys: torch.Tensor, values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                   src_weight: torch.Tensor, self_weight: torch.Tensor, denominator: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`TrackedLayer.merge` over plain tensors: (keys, values) [B, Hkv, T, D] with entry j = (w_j·x_j + Σ_e w_e·x_e)
    / d_j, computed in fp32."""
    b, h, t, _ = keys.shape
    src = src.expand(b, h, -1)
    dst = dst.expand(b, h, -1)
    w_src = src_weight.expand(b, h, -1).to(torch.float32)
    w_self = self_weight.expand(b, h, t).to(torch.float32)
    if denominator is None:
        denom = w_self.clone().scatter_add_(2, dst, w_src)
    else:
        denom = denominator.expand(b, h, t).to(torch.float32)
    out = []
    for x in (keys, values):
        xf = x.float()
        moved = xf.gather(2, src[..., None].expand(-1, -1, -1, x.shape[-1])) * w_src[..., None]
        total = (xf * w_self[..., None]).scatter_add_(2, dst[..., None].expand(-1, -1, -1, x.shape[-1]), moved)
        out.append((total / denom[..., None]).to(x.dtype))
    return out[0], out[1]


@dataclass(frozen=True)
class SplitLayout:
    """What packing a layer's full-precision entries in two segments must know on the host: how many are important,
    and the dtype of each segment's stored scales (important keys, other keys, important values, other values)."""

    important: int
    scale_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]


def split_layouts(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[SplitLayout]:
    """The `SplitLayout` of each (keys [B, Hkv, T, D], values, important [B, 1, T]) to pack, for many layers with one
    read of the device (a packing step of every layer would otherwise wait five times a layer)."""
    found = []
    for keys, values, important in parts:
        chosen = important[:, 0]  # [B, T]
        peaks = [field.abs().amax(dim=(1, 3)) for field in (keys, values)]  # [B, T]: each entry's largest magnitude
        zero = peaks[0].new_zeros(())
        found.append(torch.stack([chosen[0].sum().float()] + [  # fp32: a count is exact there, not in bf16
            overflows_fp16(torch.where(mask, peak, zero).amax()).float() for peak in peaks for mask in (chosen, ~chosen)]))
    if not found:
        return []
    return [SplitLayout(int(row[0]), tuple(scale_dtype_for(bool(w)) for w in row[1:]))
            for row in torch.stack(found).tolist()]


def pack_split(keys: torch.Tensor, values: torch.Tensor, important: torch.Tensor, bits_hi: int, bits_lo: int,
               group_size: int | None, layout: SplitLayout | None = None) -> tuple[torch.Tensor, list[QuantSegment]]:
    """Full-precision entries [B, Hkv, T, D] packed in two segments: the `important` ones ([B, 1, T] bool, the same
    count per row) at `bits_hi`, the rest at `bits_lo`. `layout`: what `split_layouts` read for them (None: read
    here). Returns (the entries' order [B, 1, T]: important first, then the rest, each in their own order; the
    segments)."""
    layout = layout or split_layouts([(keys, values, important)])[0]
    order = torch.argsort((~important).to(torch.int8), dim=-1, stable=True)
    n_hi = layout.important
    idx = order.expand(keys.shape[0], keys.shape[1], -1)[..., None]
    keys = keys.gather(2, idx.expand(-1, -1, -1, keys.shape[-1]))
    values = values.gather(2, idx.expand(-1, -1, -1, values.shape[-1]))
    k_hi, k_lo, v_hi, v_lo = layout.scale_dtypes
    segments = [QuantSegment(quantize_keys(keys[:, :, lo:hi], bits, group_size, k_dtype),
                             quantize_values(values[:, :, lo:hi], bits, group_size, v_dtype))
                for lo, hi, bits, k_dtype, v_dtype in ((0, n_hi, bits_hi, k_hi, v_hi),
                                                       (n_hi, keys.shape[2], bits_lo, k_lo, v_lo)) if hi > lo]
    return order, segments


def move_rows_into(movers: Sequence[tuple[int, TrackedLayer]], stores: dict[str, EntryStore]) -> None:
    """`layer.move_into(stores, row)` for several (row, batch-1 layer) pairs at once (a turn's first batched
    step moves every row in): each row's entries copied as they lie, with none of the per-write checks."""
    fields = {name: [getattr(layer, name) for _, layer in movers] for name in stores}
    if any(f is None for values in fields.values() for f in values):
        raise RuntimeError("only a layer holding entries can move into a batch's stores")
    with torch.inference_mode():
        for name, store in stores.items():
            store.reserve(max(f.shape[2] for f in fields[name]))
            data, lengths = store.data, store.lengths
            for (r, _), f in zip(movers, fields[name]):
                n = f.shape[2]
                data[r].narrow(1, 0, n).copy_(f[0])
                lengths[r] = n
    for r, layer in movers:  # the batch's own dict, shared by its rows (so `lives_in` is one identity check)
        layer._stores, layer._rows = stores, (r, r + 1)


class KeptImageCounts:
    """The image entries each row of a joint eviction kept (summed over heads), left on the device until one of
    them is asked for, then read for every row at once: the eviction itself waits for nothing."""

    def __init__(self, sums: torch.Tensor, heads: int):
        self._sums, self._heads = sums, heads
        self._values: list[int] | None = None

    def of(self, k: int) -> int:
        if self._values is None:
            self.fill(self._sums.tolist())
        return self._values[k]

    @property
    def unread(self) -> torch.Tensor | None:
        """The sums still on the device ([rows], int64), or None once read: a caller reading something else back
        anyway (a step's tokens) can read these with it and `fill` them."""
        return self._sums

    def fill(self, sums: list[int]) -> None:
        self._values = [int(round(v / self._heads)) for v in sums]
        self._sums = None


def unread_image_counts(caches: Sequence["TrackedCache"]) -> list[KeptImageCounts]:
    """The image counts of these caches' layers still on the device (each once). A cache's layers that must be
    counted again (an eviction of their own) are counted now, on the device, so that the step's one read brings
    them back with the rest (`read_with_counts`) instead of a read when the events ask."""
    found: dict[int, KeptImageCounts] = {}
    for cache in caches:
        cache.count_stale_layers()
        for layer in cache.layers:
            pending = layer._image_count
            if isinstance(pending, tuple) and pending[0].unread is not None:
                found.setdefault(id(pending[0]), pending[0])
    return list(found.values())


def read_with_counts(values: torch.Tensor, counts: Sequence[KeptImageCounts]) -> list[int]:
    """`values.tolist()` ([n] int64), the still-unread image counts read back in the same transfer and filled in: one
    wait for the device instead of one more per joint eviction."""
    parts = [c.unread for c in counts if c.unread is not None]
    if not parts:
        return values.tolist()
    read = torch.cat([values.to(torch.int64), *[p.to(values.device, torch.int64) for p in parts]]).tolist()
    n, start = values.shape[0], values.shape[0]
    for c in [c for c in counts if c.unread is not None]:
        size = c.unread.shape[0]
        c.fill(read[start:start + size])
        start += size
    return read[:n]


class TrackedCache(DynamicCache):
    """One `TrackedLayer` per text-model layer. Set `pending` before each forward so new entries get their
    true positions and image flags.

    `rope_deltas` [B]: for a model with 3-D rotary positions (Qwen-VL's M-RoPE), what its prompt's positions
    gained over the true ones (the model's rope delta: an image advances the position by the longer side of its
    merged grid, not by its number of tokens); every token after the prompt runs at its true position plus it.
    None until a prompt with 3-D positions was fed (and always for the other models)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = [TrackedLayer() for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_meta: tuple | None = None
        self._pending_has_image: bool | None = None
        self._meta_of_every_layer = False  # this forward's metadata written for every layer at its first layer
        self._pending_first: int | None = None
        # (the stacks' layout, every layer's length, the slots the next entries' metadata goes to): a step moves them
        # on
        self._next_meta_slots: tuple[tuple, list[int], torch.Tensor] | None = None
        self.rope_deltas: torch.Tensor | None = None

    def set_pending(self, positions: torch.Tensor, is_image: torch.Tensor, has_image: bool | None = None,
                    first_position: int | None = None) -> None:
        """The next forward's true positions and image flags [B, T]. `has_image`: whether any flag is set, when the
        caller knows (a decode step's tokens are text): reading it off the flags waits for the device.
        `first_position`: the position of every row's first token, when the caller knows that they share it."""
        self.pending = (positions, is_image)
        self._pending_has_image = has_image
        self._pending_first = first_position
        self._pending_meta = None  # per-KV-head form, built at the first layer and shared by the others

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.pending is None:
            raise RuntimeError("TrackedCache.set_pending(positions, is_image) must be called before a forward")
        if layer_idx == 0:
            self._meta_of_every_layer = self._write_every_layers_meta()
        if self._meta_of_every_layer:
            self.layers[layer_idx].meta_written(self.pending[0].shape[1])
            return keys, values
        n_kv = key_states.shape[1]
        if self._pending_meta is None or self._pending_meta[0].shape[1] != n_kv:
            positions, is_image = self.pending
            has_image = self._pending_has_image
            self._pending_meta = (*per_head_meta(positions, is_image, n_kv),
                                  bool(is_image.any()) if has_image is None else has_image)
        pos, img, zeros, has_image = self._pending_meta
        self.layers[layer_idx].append_meta_per_head(pos, img, zeros, has_image)
        return keys, values

    def _write_every_layers_meta(self) -> bool:
        """At a decode step's first layer: every layer's new entry's position, image flag (none: a step feeds text)
        and zero score written at once, three operators for the step instead of three a layer, when every layer's
        metadata lives in one stack per field, in layer order (`stack_layers`). False, writing nothing: each
        layer appends its own."""
        positions, _ = self.pending
        if positions.shape[1] != 1 or self._pending_has_image is not False:
            return False
        stacks = [self.layers[0].store_of(name) for name in META_FIELDS]
        if any(store is None or store.stack is None for store in stacks):
            return False
        stacks = [store.stack for store in stacks]
        for i, layer in enumerate(self.layers):
            for name, stack in zip(META_FIELDS, stacks):
                store = layer.store_of(name)
                if store is None or store.stack is not stack or store.stack_layer != i or layer.segments:
                    return False
        if self.layers[0].store_rows != (0, stacks[0].rows):
            return False
        lengths = [layer.length for layer in self.layers]
        for layer, n in zip(self.layers, lengths):  # room for the new entry first (a stack grows for all fields)
            for name in META_FIELDS:
                layer.store_of(name).reserve(n + 1)
        if len({tuple(stack.capacities) for stack in stacks}) != 1:
            return False  # (stacks made together grow together: one layout)
        # where the slots lie follows from the layout alone (`StoreStack.first_slots`): the last step's slots, moved
        # on by one, serve while it and the lengths are what they were made for
        layout = (tuple(stacks[0].capacities), stacks[0].rows, stacks[0].heads)
        known = self._next_meta_slots
        with torch.inference_mode():
            if known is not None and known[0] == layout and known[1] == lengths:
                slots = known[2]
            else:  # each row's next slot in every layer and head, as one index
                ends = torch.tensor(lengths, device=positions.device).view(-1, 1, 1)  # [L, 1, 1]
                slots = (stacks[0].first_slots(positions.device) + ends).view(-1)
            write_step_metadata(dict(zip(META_FIELDS, stacks)), dict.fromkeys(META_FIELDS, slots), len(self.layers),
                                positions if self._pending_first is None else self._pending_first)
            self._next_meta_slots = (layout, [n + 1 for n in lengths], slots.add_(1))
        return True

    def add_scores(self, stats: dict[int, torch.Tensor]) -> None:
        """Accumulate per-layer attention ([B, Hkv, T], aligned with the layer's entries) into scores."""
        with torch.inference_mode():  # in place, in each layer's own slot
            for layer_idx, s in stats.items():
                scores = self.layers[layer_idx].scores
                scores.add_(s if s.device == scores.device else s.to(scores.device))

    def clone(self) -> "TrackedCache":
        """An independent copy (`TrackedLayer.twin` of every layer)."""
        twin = TrackedCache(len(self.layers))
        twin.layers = [layer.twin() for layer in self.layers]
        twin.rope_deltas = self.rope_deltas
        return twin

    def split_rows(self) -> list["TrackedCache"]:
        """One batch-1 cache per batch row (e.g. after prefilling several prompts in one forward)."""
        return list(self.each_row())

    def each_row(self) -> Iterator["TrackedCache"]:
        """`split_rows` one row at a time: a caller that compresses each row before taking the next holds one
        uncompressed copy at a time, not a copy of the whole batch."""
        for r in range(self.layers[0].positions.shape[0]):
            twin = TrackedCache(len(self.layers))
            for mine, theirs in zip(self.layers, twin.layers):
                if mine.segments:
                    raise RuntimeError("a cache holding quantised entries cannot be split into rows")
                theirs.lazy_initialization(mine.keys, mine.values)
                for name in ENTRY_FIELDS:
                    setattr(theirs, name, getattr(mine, name)[r:r + 1].clone())
                theirs.has_empty_slots = mine.has_empty_slots
            if self.rope_deltas is not None:
                twin.rope_deltas = self.rope_deltas[r:r + 1]
            yield twin

    @property
    def batch_size(self) -> int:
        return self.layers[0].positions.shape[0]

    def key_masks(self, new_tokens: int) -> dict[int, torch.Tensor]:
        """Per layer with empty slots: the key mask of a forward that appends `new_tokens` entries
        ([B, Hkv, T + new_tokens], True = may attend)."""
        out = {}
        for i, layer in enumerate(self.layers):
            mask = layer.key_mask()
            if mask is not None:
                out[i] = torch.cat([mask, mask.new_ones(*mask.shape[:2], new_tokens)], dim=-1)
        return out

    # -- what the UI shows ---------------------------------------------------------------------------
    def stack_layers(self, fields: Sequence[str] = ENTRY_FIELDS) -> bool:
        """Move every layer's `fields` into stores stacked over the layers (`StoreStack`: one tensor per field, each
        layer its own part, as long as it holds plus room), so that a decode step's evictions from every layer (and
        row) are one copy per field (`joint_eviction`), not a few operators per layer and field, and its metadata
        is written for every layer at once (`META_FIELDS`: what a cache that only grows stacks). For a cache whose
        layers hold full-precision entries alike in shape, each in stores of its own; returns whether its layers'
        `fields` are stacked (False: left as they were)."""
        layers = self.layers
        # (a joint eviction takes no empty slots: a cache with some only stacks what an append writes)
        evicts = "keys" in fields
        if not layers or any(layer.keys is None or layer.segments or (evicts and layer.has_empty_slots)
                             for layer in layers):
            return False
        rows = layers[0].keys.shape[0]
        if any(layer._rows != (0, rows) or any(st.data.shape[0] != rows for st in layer._stores.values())
               for layer in layers):
            return False  # rows of a batch's shared stores: stacked there, if at all
        stacks = {id(layer._stores[name].stack) for layer in layers for name in fields}
        if len(stacks) == len(fields) and id(None) not in stacks:
            return True  # stacked already
        first = {name: getattr(layers[0], name) for name in fields}
        for layer in layers[1:]:
            for name, like in first.items():
                f = getattr(layer, name)
                if f.shape[1] != like.shape[1] or f.shape[3:] != like.shape[3:] or f.dtype != like.dtype \
                        or f.device != like.device:
                    return False
        rooms = [layer.length + spare_for(layer.length) for layer in layers]
        made = {name: StoreStack(t, rows, rooms) for name, t in first.items()}
        with torch.inference_mode():
            for i, layer in enumerate(layers):
                stores = {name: EntryStore(stack.layer_view(i), [0] * rows, stack) for name, stack in made.items()}
                for name, store in stores.items():
                    f = getattr(layer, name)
                    store.data.narrow(2, 0, f.shape[2]).copy_(f)
                    store.lengths[:] = [f.shape[2]] * rows
                layer._stores = {**layer._stores, **stores}  # never changed in place (see `_own_store`)
                layer._rows = (0, rows)
        return True

    def lengths(self) -> list[int]:
        """Entries each layer keeps (averaged over KV heads when heads keep different counts)."""
        return [int(round(layer.kept_per_head())) for layer in self.layers]

    def stored_nbytes(self) -> int:
        """Bytes of the cache tensors as allocated (a head-wise cache's empty slots included)."""
        return sum(layer.stored_nbytes() for layer in self.layers)

    def image_counts(self) -> list[int]:
        """Image entries per layer (see `TrackedLayer.image_count`). The layers that must be counted again are
        counted together, so asking waits for the device once, not once per layer."""
        self.count_stale_layers()
        return [layer.image_count() for layer in self.layers]

    def count_stale_layers(self) -> None:
        """Count the image entries of the layers that must be counted again (an eviction of their own), together
        and on the device (`KeptImageCounts`): read when first asked for, in one transfer for all of them."""
        stale = [layer for layer in self.layers if layer._image_count is None and layer.is_image is not None]
        if stale:
            flags = [layer.is_image[0] for layer in stale]  # [Hkv, T] each: the first row, as `image_count` reads
            counts = KeptImageCounts(torch.stack([f.sum() for f in flags]), flags[0].shape[0])
            for k, layer in enumerate(stale):
                layer.image_count_on_device(counts, k)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
