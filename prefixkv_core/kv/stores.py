"""Where a cache layer's entries live: growable stores, shared by a batch's rows and stacked over its layers.

- `EntryStore`: one per-entry field (keys, values, positions, image flags, scores) of one or several rows, with
  room to grow along the entries: appends write in place, a rewrite (an eviction, a merge) writes a row's new
  entries at the front of its own slot, and when the room runs out the capacity grows by half.
- `StoreStack`: one field of a batch's shared stores for every layer in one flat tensor, each layer its own
  capacity, so that one copy per field evicts from many layers at once (`joint_eviction.py`).
`TrackedLayer` (`cache.py`) keeps its fields here and is what everything else reads and writes them through
(`move_rows_into` moves batch-1 layers into a batch's shared stores).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Sequence

import torch

SPARE_ENTRIES = 64  # room a new store leaves for the entries a decode appends before it first has to grow


def spare_for(entries: int) -> int:
    """Room a batch's shared store leaves a layer whose longest row holds `entries`: SPARE_ENTRIES, less for a
    short one (a layer keeping a handful of entries would otherwise hold mostly room)."""
    return min(SPARE_ENTRIES, 16 + entries // 4)


class EntryStore:
    """One per-entry field of a cache layer held with room to grow: `data` is [rows, Hkv, capacity, *tail] and
    row r's entries are data[r, :, :lengths[r]]. Appending writes after a row's entries in place; when the room
    runs out every row's capacity grows by half (amortised, no copy of the cache per step). Rewriting a row's
    entries (eviction, merging) writes its new contents at the front of its own slot. Several rows may share one
    store: the runner's batched rows, so a step reads them all without copying them."""

    def __init__(self, data: torch.Tensor, lengths: list[int], stack: "StoreStack | None" = None):
        self.data, self.lengths = data, lengths
        self.entry_bytes = math.prod(data.shape[3:]) * data.shape[1] * data.element_size()  # one entry, every head
        self._views: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # rows -> (view, its length)
        # the stack of layers this store is one of (its data is the stack's `layer_view(stack_layer)`), or None
        self.stack, self.stack_layer = stack, 0
        if stack is not None:
            self.stack_layer = stack.add(self)

    @classmethod
    def holding(cls, tensor: torch.Tensor, spare: int | None = None) -> "EntryStore":
        """A store of its own for `tensor` ([rows, Hkv, T, *tail]), with room for `spare` more entries (by default
        `spare_for` its length)."""
        rows, heads, t = tensor.shape[:3]
        spare = spare_for(t) if spare is None else spare
        data = tensor.new_zeros(rows, heads, t + spare, *tensor.shape[3:])
        _copy(data.narrow(2, 0, t), tensor)
        return cls(data, [t] * rows)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    def fits(self, tensor: torch.Tensor, rows: tuple[int, int]) -> bool:
        """Whether `tensor` can be written into `rows` of this store (same heads, tail, dtype and device)."""
        d = self.data
        return (tensor.dim() == d.dim() and tensor.shape[0] == rows[1] - rows[0] and tensor.shape[1] == d.shape[1]
                and tensor.shape[3:] == d.shape[3:] and tensor.dtype == d.dtype and tensor.device == d.device)

    def view(self, rows: tuple[int, int]) -> torch.Tensor:
        n = self.lengths[rows[0]]
        found = self._views.get(rows)
        if found is not None and found[1] == n:
            return found[0]  # views are asked for often (policies read every layer every step): keep them
        view = self.rows_of(rows).narrow(2, 0, n)
        self._views[rows] = (view, n)
        return view

    def reserve(self, needed: int) -> None:
        """Room for `needed` entries in every row (grown by at least half the capacity: amortised O(1)); a store
        in a stack grows in it (`StoreStack.grow`)."""
        if needed <= self.data.shape[2]:
            return
        if self.stack is not None:
            self.stack.grow(self.stack_layer, needed)
            return
        self.data = _grown(self.data, needed, max(self.lengths))
        self._views = {}

    def write(self, rows: tuple[int, int], tensor: torch.Tensor) -> None:
        """Replace the entries of `rows` with `tensor` in place (a row's slot is its own)."""
        self.write_after(rows, 0, tensor)

    def write_after(self, rows: tuple[int, int], start: int, tensor: torch.Tensor) -> None:
        """Replace the entries of `rows` from slot `start` on with `tensor`, the first `start` kept as they are."""
        if tensor.untyped_storage().data_ptr() == self.data.untyped_storage().data_ptr():
            tensor = tensor.clone()  # a view of this store's memory (a slice of itself): copy before overwriting
        t = tensor.shape[2]
        self.reserve(start + t)
        _copy(self.rows_of(rows).narrow(2, start, t), tensor)
        self.set_lengths(rows, start + t)

    def append(self, rows: tuple[int, int], tensor: torch.Tensor) -> None:
        n, q = self.lengths[rows[0]], tensor.shape[2]
        self.reserve(n + q)
        # one operator a field (the slots' index is shared by every field and layer of that length), not a view
        # of the slots and a copy into it: a decode step appends to five fields of every layer
        _index_copy(self.rows_of(rows), _slots_from(n, q, self.data.device), tensor)
        self.set_lengths(rows, n + q)

    def write_after_each_row(self, at: torch.Tensor, tensor: torch.Tensor) -> None:
        """Every row's next entry at once (a batched decode step): `tensor` [rows, Hkv, 1, *tail] (or a scalar)
        written at slot `at` (each row's length, broadcast to the entry's shape). The lengths move on in
        `set_row_lengths`, once every field of the step is written."""
        self.data.scatter_(2, at, tensor)

    def leading(self, t: int) -> torch.Tensor:
        """Every row's first `t` slots (what a batched step's attention reads, a key mask telling the rows apart)."""
        return self.data.narrow(2, 0, t)

    def set_row_lengths(self, lengths: Sequence[int]) -> None:
        """Every row's length at once."""
        self.lengths[:] = lengths

    def rows_of(self, rows: tuple[int, int]) -> torch.Tensor:
        """The data of `rows` (the data itself when they are all of it: one operator fewer per read and write)."""
        return self.data if rows[0] == 0 and rows[1] == self.data.shape[0] else \
            self.data.narrow(0, rows[0], rows[1] - rows[0])

    def set_lengths(self, rows: tuple[int, int], n: int) -> None:
        if rows[1] - rows[0] == 1:
            self.lengths[rows[0]] = n
        else:
            for r in range(*rows):
                self.lengths[r] = n

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class StoreStack:
    """One field of a batch's shared stores for every layer in one flat tensor: layer l's store is a
    [rows, Hkv, capacity_l, *tail] view of its own part of it, as long as that layer's longest row needs (plus
    room), so that one copy per field evicts from many layers at once (`joint_eviction`) while a layer that keeps
    little holds little. A layer that runs out of room grows by half, and with it every layer with little room
    left (so the stack is laid out anew about as rarely as one tensor of a single capacity would grow)."""

    def __init__(self, like: torch.Tensor, rows: int, capacities: Sequence[int]):
        """`like`: a tensor of the field ([*, Hkv, *, *tail], its dtype and device); `capacities`: per layer."""
        self.rows, self.heads, self.tail = rows, like.shape[1], tuple(like.shape[3:])
        self.capacities = list(capacities)
        self.data = like.new_zeros(self._entries(self.capacities) * math.prod(self.tail))
        self._entries_view: tuple[torch.Tensor, torch.Tensor] | None = None
        self._first_slots: tuple[list[int], torch.Tensor] | None = None
        # the layers' stores, weakly: a store keeps its stack (`EntryStore.stack`), not the other way round, so a
        # batch's stacked tensors go with their last store at once instead of waiting for the garbage collector
        self._stores: list[weakref.ref] = []

    def _entries(self, capacities: Sequence[int]) -> int:
        return self.rows * self.heads * sum(capacities)

    def first_entry(self, layer: int) -> int:
        """Where layer `layer`'s store starts, in entries (one head's one slot) from the start of `entries()`."""
        return self.rows * self.heads * sum(self.capacities[:layer])

    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s part as a [rows, Hkv, capacity, *tail] tensor."""
        per_entry = math.prod(self.tail)
        n = self.rows * self.heads * self.capacities[layer]
        return self.data.narrow(0, self.first_entry(layer) * per_entry, n * per_entry).view(
            self.rows, self.heads, self.capacities[layer], *self.tail)

    def entries(self) -> torch.Tensor:
        """Every (layer, row, head, slot) entry as one row: [entries, *tail] (made once per layout)."""
        if self._entries_view is None or self._entries_view[0] is not self.data:
            self._entries_view = (self.data, self.data.view(-1, *self.tail))
        return self._entries_view[1]

    def first_slots(self, device: torch.device) -> torch.Tensor:
        """[layers, rows, Hkv]: where slot 0 of each (layer, row, head) lies in `entries()` (made once per layout:
        a stack grows rarely)."""
        if self._first_slots is None or self._first_slots[0] != self.capacities:
            starts = [[[self.first_entry(l) + (k * self.heads + h) * cap for h in range(self.heads)]
                       for k in range(self.rows)] for l, cap in enumerate(self.capacities)]
            self._first_slots = (list(self.capacities), torch.tensor(starts, device=device))
        return self._first_slots[1]

    @property
    def stores(self) -> list[EntryStore]:
        return [store for store in (ref() for ref in self._stores) if store is not None]

    def add(self, store: EntryStore) -> int:
        """Take `store` (the next layer's view, `layer_view`); returns its layer."""
        self._stores.append(weakref.ref(store))
        return len(self._stores) - 1

    def grow(self, layer: int, needed: int) -> None:
        """Room for `needed` entries in every row of layer `layer`: it grows by at least half, and so does every
        other layer with less room left than `spare_for` gives it; the others keep their capacity."""
        live = {store.stack_layer: store for store in self.stores}
        longest = {l: max(store.lengths) for l, store in live.items()}
        old = self.capacities
        new = list(old)
        for l, cap in enumerate(old):
            if l == layer or cap - longest.get(l, 0) < spare_for(longest.get(l, 0)):
                new[l] = max(needed if l == layer else 0, cap + cap // 2 + 16)
        before = {l: store.data for l, store in live.items()}
        self.capacities = new
        self.data = self.data.new_zeros(self._entries(new) * math.prod(self.tail))
        for l, store in live.items():
            store.data = self.layer_view(l)
            store._views = {}
            n = longest[l]
            _copy(store.data.narrow(2, 0, n), before[l].narrow(2, 0, n))


def _grown(data: torch.Tensor, needed: int, longest: int) -> torch.Tensor:
    """`data` ([rows, Hkv, capacity, *tail]) with room for at least `needed` entries and by at least half its
    capacity more (amortised O(1) appends), its first `longest` entries of every row copied over."""
    capacity = data.shape[2]
    grown = data.new_zeros(data.shape[0], data.shape[1], max(needed, capacity + capacity // 2 + 16), *data.shape[3:])
    _copy(grown.narrow(2, 0, longest), data.narrow(2, 0, longest))
    return grown


@functools.lru_cache(maxsize=256)
def _slots_from(n: int, q: int, device: torch.device) -> torch.Tensor:
    """n, n + 1, ..., n + q - 1: the slots an append of q entries after n writes (the same tensor for every field
    and every layer of that length, so a decode step makes one per length, not one per field)."""
    with torch.inference_mode():
        return torch.arange(n, n + q, device=device)


def _index_copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(2, index, src), also outside inference mode for a dst made in it (see `_copy`)."""
    if torch.is_inference_mode_enabled():
        dst.index_copy_(2, index, src)
    else:
        with torch.inference_mode():
            dst.index_copy_(2, index, src)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), also when dst was made in inference mode (a forward) and we are outside it (a policy)."""
    if torch.is_inference_mode_enabled():
        dst.copy_(src)
    else:
        with torch.inference_mode():
            dst.copy_(src)
