"""Evictions carried out for many rows at once: the rows of a batch's shared stores (`decoding/step_buffers.py`)
or of a cache's own stacked layers (`TrackedCache.stack_layers`), whose fields live in one tensor each (one
layer's stores, or a stack of every layer's, each layer with its own capacity), evicted with one copy per field
for all of them instead of a dozen operators per row and layer.

- `gather_many` / `gather_rows`: any kept indices, one per row (the entries that change are copied).
- `drop_ranges`: a range dropped from every head of each row (`RangeDrop`: a fixed-point eviction), the entries
  after it moving up. Its index is computed on the device from a handful of numbers per row, so the step's
  operators do not grow with its rows, and it waits for nothing.

Every (layer, row, head, slot) of a home tensor is one row of it seen as [entries, *tail]; a row's slot for one
head starts at `first + head · capacity`. The image entries each row kept stay on the device until asked for
(`KeptImageCounts`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from .cache import ENTRY_FIELDS, KeptImageCounts, TrackedLayer
from .stores import EntryStore


@dataclass(frozen=True)
class _Home:
    """Where one field of some layers' rows lives: the tensor as [entries, *tail], and per layer its row's first
    entry (head 0, slot 0) and its capacity."""

    key: int  # the identity of the tensor (the stack, or the store's own data)
    entries: torch.Tensor
    firsts: tuple[int, ...]
    capacities: tuple[int, ...]


def _place(store: EntryStore, row: int) -> tuple[int, torch.Tensor, int, int]:
    """(home identity, the home as [entries, *tail], row `row`'s first entry there, the row's capacity)."""
    if store.stack is not None:
        stack, layer = store.stack, store.stack_layer
        cap = stack.capacities[layer]
        return id(stack), stack.entries(), stack.first_entry(layer) + row * stack.heads * cap, cap
    data = store.data
    return id(data), data.view(-1, *data.shape[3:]), row * data.shape[1] * data.shape[2], data.shape[2]


def _homes(rows: Sequence[tuple[TrackedLayer, int]], what: str) -> dict[str, _Home]:
    """Each field's home for these (layer, row of its stores) pairs; raises unless each field of them all lives in
    one tensor."""
    if not _shared_rows([layer for layer, _ in rows]):
        raise ValueError(f"{what} takes full-precision rows of shared stores")
    out = {}
    for name in ENTRY_FIELDS:
        placed = [_place(layer.store_of(name), r) for layer, r in rows]
        if len({key for key, _, _, _ in placed}) != 1:
            raise ValueError(f"{what} takes rows of shared stores that live in one tensor per field")
        out[name] = _Home(placed[0][0], placed[0][1], tuple(p[2] for p in placed), tuple(p[3] for p in placed))
    return out


def _rows_of(layer: TrackedLayer) -> range:
    """The rows of its stores a layer holds (one for a batch row of shared stores, all of them for a cache of
    several prompts)."""
    return range(*layer.store_rows)


@functools.lru_cache(maxsize=256)
def _slot_starts(firsts: tuple[int, ...], capacities: tuple[int, ...], heads: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows, Hkv, 1] where each (row, head) slot starts, [rows, Hkv, 1] its last slot): the same rows evict step
    after step, so these are made once."""
    first = torch.tensor(firsts, device=device)[:, None]
    cap = torch.tensor(capacities, device=device)[:, None]
    start = (first + torch.arange(heads, device=device) * cap).unsqueeze(-1)
    return start, start + (cap.unsqueeze(-1) - 1)


@functools.lru_cache(maxsize=64)
def _slots(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def _shared_rows(layers: Sequence[TrackedLayer]) -> bool:
    """Whether every layer holds full-precision rows without empty slots in stores a joint copy can address (a
    stack of layers, or contiguous data)."""
    return all(not layer.segments and not layer.has_empty_slots
               and all(store.stack is not None or store.data.is_contiguous()
                       for store in map(layer.store_of, ENTRY_FIELDS))
               for layer in layers)


def _group_key(layer: TrackedLayer) -> int:
    store = layer.store_of("keys")  # a batch's rows share their stores, a stack its layers'
    return id(store.stack) if store.stack is not None else id(store)


def _kept_images(home: _Home, heads: int, kept: list[int], device: torch.device) -> KeptImageCounts:
    """The image entries each row holds in its first kept[k] slots, summed over heads, left on the device."""
    longest = max(kept)
    start, _ = _slot_starts(home.firsts, home.capacities, heads, device)
    slots = _slots(longest, device)
    # a row keeping fewer than the longest reads past its own slots (masked below); a short last layer of a stack
    # past the tensor's end, so there the index stops at its last slot (known on the host: no operator otherwise)
    at = (start + slots).reshape(-1)
    end = max(f + (heads - 1) * c for f, c in zip(home.firsts, home.capacities)) + longest
    if end > home.entries.shape[0]:
        at = at.clamp_max(home.entries.shape[0] - 1)
    flags = home.entries.index_select(0, at).view(len(kept), heads, longest)
    held = slots < torch.tensor(kept, device=device)[:, None, None]
    return KeptImageCounts((flags & held).sum(dim=(1, 2)), heads)


def gather_many(pairs: Sequence[tuple[TrackedLayer, torch.Tensor]]) -> None:
    """`layer.gather(index)` for every (layer, index) pair, the full-precision layers whose stores live in one
    tensor per field (a batch's shared stores, one layer's or a stack of every layer's; a cache's own stack of its
    layers, `TrackedCache.stack_layers`) gathered together (`gather_rows`); each layer at most once."""
    groups: dict[int, tuple[list[TrackedLayer], list[torch.Tensor]]] = {}
    for layer, index in pairs:
        # (a row keeping its whole capacity has no free last slot for the joint copy: it gathers alone)
        if not _shared_rows([layer]) or index.shape[0] not in (1, len(_rows_of(layer))) \
                or index.shape[-1] >= layer.store_of("keys").capacity:
            layer.gather(index)
            continue
        group = groups.setdefault(_group_key(layer), ([], []))
        group[0].append(layer)
        group[1].append(index)
    for layers, indices in groups.values():
        if len(layers) == 1:
            layers[0].gather(indices[0])
        else:
            gather_rows(layers, indices)


def gather_rows(layers: Sequence[TrackedLayer], indices: Sequence[torch.Tensor]) -> None:
    """`layers[k].gather(indices[k])` for full-precision layers whose entries live in one tensor per field (rows of
    one layer's shared stores, or of a stack of layers), done as one copy per field for all of them: the same
    entries kept, in a few operations instead of a dozen per row. indices[k]: [1 or the layer's rows, 1 or Hkv,
    K_k] (no empty slots)."""
    rows = [(layer, r) for layer in layers for r in _rows_of(layer)]
    homes = _homes(rows, "gather_rows")
    device = indices[0].device
    heads = layers[0].n_kv
    counts = [int(i.shape[-1]) for layer, i in zip(layers, indices) for _ in _rows_of(layer)]
    longest = max(counts)
    # [rows, Hkv, max K], a layer's rows in order; a shorter row's padding repeats entry 0 (never written)
    blocks = [i.expand(len(_rows_of(layer)), heads, -1) for layer, i in zip(layers, indices)]
    blocks = [b if b.shape[-1] == longest else torch.nn.functional.pad(b, (0, longest - b.shape[-1]))
              for b in blocks]
    index = torch.cat(blocks)
    slots = _slots(index.shape[2], device)
    valid = slots < torch.tensor(counts, device=device)[:, None, None]  # [rows, 1, max K]
    # a slot whose entry stays (or a shorter row's padding) copies its row's last slot onto itself instead: no
    # entry is kept there (every row keeps fewer than its capacity), so no index is written twice with different
    # values, and the copy's size does not hang on the data (no wait for the device to count the moved entries)
    moved = (index != slots) & valid
    flat: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # layout -> (all kept, read, written)
    kept_image = None
    with torch.inference_mode():
        for name in ENTRY_FIELDS:
            home = homes[name]
            layout = (home.firsts, home.capacities)
            if layout not in flat:
                first, last = _slot_starts(home.firsts, home.capacities, heads, device)
                everything = first + index
                flat[layout] = (everything.reshape(-1), torch.where(moved, everything, last).reshape(-1),
                                torch.where(moved, first + slots, last).reshape(-1))
            everything, read, written = flat[layout]
            entries = home.entries
            if name == "is_image":  # image entries kept per row, summed over heads (events ask every step)
                kept = entries.index_select(0, everything).view(index.shape)
                kept_image = KeptImageCounts((kept & valid).sum(dim=(1, 2)), heads)
            entries.index_copy_(0, written, entries.index_select(0, read))
    _set_lengths(rows, counts, kept_image)


def _set_lengths(rows: Sequence[tuple[TrackedLayer, int]], kept: Sequence[int], kept_image: KeptImageCounts) -> None:
    """After a joint eviction: each (layer, row)'s entries, and where each layer's image count (its first row's,
    as `TrackedLayer.image_count` reads) waits on the device."""
    first: dict[int, int] = {}
    for j, ((layer, r), k) in enumerate(zip(rows, kept)):
        for name in ENTRY_FIELDS:
            layer.store_of(name).set_lengths((r, r + 1), k)
        first.setdefault(id(layer), j)
    for layer, _ in rows:
        layer.image_count_on_device(kept_image, first[id(layer)])


def drop_ranges(drops: Sequence[tuple[TrackedLayer, int, int]]) -> None:
    """For each (layer, start, count): drop entries [start, start + count) from every head of the layer, the ones
    after them moving up by `count` (what `layer.gather` does with every other index kept). The batch-1 rows of
    shared stores that live in one tensor per field are done together, one copy per field for all of them;
    any other layer (its own stores, quantised entries, empty slots) drops its range on its own
    (`TrackedLayer.drop_range`). Each layer at most once."""
    groups: dict[int, list[tuple[TrackedLayer, int, int]]] = {}
    for drop in drops:
        layer, start, count = drop
        if count <= 0:
            continue
        if not _shared_rows([layer]):
            layer.drop_range(start, count)
            continue
        groups.setdefault(_group_key(layer), []).append(drop)
    for members in groups.values():
        if len(members) == 1:  # one row: its own slice copies are fewer operators than the joint index
            layer, start, count = members[0]
            layer.drop_range(start, count)
        else:
            _drop_in_home(members)


def _drop_in_home(drops: Sequence[tuple[TrackedLayer, int, int]]) -> None:
    rows = [(layer, r, start, count) for layer, start, count in drops for r in _rows_of(layer)]
    homes = _homes([(layer, r) for layer, r, _, _ in rows], "drop_ranges")
    lengths = [layer.store_of("positions").lengths[r] for layer, r, _, _ in rows]
    after = [n - start - count for (_, _, start, count), n in zip(rows, lengths)]  # entries that move up
    if min(after) < 0 or min(start for _, _, start, _ in rows) < 0:
        raise ValueError("a dropped range must lie within the layer's entries")
    device, heads = homes["keys"].entries.device, drops[0][0].n_kv
    moving = max(after)
    kept = [n - count for (_, _, _, count), n in zip(rows, lengths)]
    with torch.inference_mode():
        if moving > 0:
            # per row: (where the range starts, how many entries it holds, how many move up), one copy to the device
            numbers = torch.tensor([[start, count, a] for (_, _, start, count), a in zip(rows, after)], device=device)
            offsets = _slots(moving, device)
            moves = (offsets < numbers[:, 2:]).unsqueeze(1)  # [rows, 1, M]: slot start + j takes entry start + j + count
            written_from = (numbers[:, :1] + offsets).unsqueeze(1)  # [rows, 1, M]
            shift = numbers[:, 1:2].unsqueeze(1) * moves  # [rows, 1, M]
            flat: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
            for name in ENTRY_FIELDS:
                home = homes[name]
                layout = (home.firsts, home.capacities)
                if layout not in flat:
                    # a slot that takes nothing copies its row's last slot onto itself (no entry is kept there:
                    # every row keeps fewer than its capacity), so no index is written twice with different values
                    first, last = _slot_starts(home.firsts, home.capacities, heads, device)  # [rows, Hkv, 1]
                    written = torch.where(moves, first + written_from, last)
                    flat[layout] = (written.reshape(-1), (written + shift).reshape(-1))
                written, read = flat[layout]
                home.entries.index_copy_(0, written, home.entries.index_select(0, read))
        kept_image = _kept_images(homes["is_image"], heads, kept, device)
    _set_lengths([(layer, r) for layer, r, _, _ in rows], kept, kept_image)
