"""Evictions carried out for many rows at once: the rows of a batch's shared stores (`decoding/step_buffers.py`),
whose fields live in one tensor each (one layer's stores, or a stack of every layer's), evicted with one copy per
field for all of them instead of a dozen operators per row and layer.

- `gather_many` / `gather_rows`: any kept indices, one per row (the entries that change are copied).
- `drop_ranges`: a range dropped from every head of each row (`RangeDrop`: a fixed-point eviction), the entries
  after it moving up. Its index is computed on the device from a handful of numbers per row, so the step's
  operators do not grow with its rows.

Neither waits for the device: the image entries each row kept stay on it until asked for (`KeptImageCounts`).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from .cache import ENTRY_FIELDS, EntryStore, KeptImageCounts, TrackedLayer


@functools.lru_cache(maxsize=256)
def _slot_starts(rows: tuple[int, ...], heads: int, capacity: int, device: torch.device) -> torch.Tensor:
    """[rows, Hkv, 1]: where each (row, head) slot of a store of this capacity starts, flattened (the same rows
    evict step after step, so these are made once)."""
    index = torch.tensor(rows, device=device)[:, None] * heads + torch.arange(heads, device=device)
    return (index * capacity).unsqueeze(-1)


@functools.lru_cache(maxsize=256)
def _row_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, device=device)


@functools.lru_cache(maxsize=64)
def _slots(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def _home(store: EntryStore) -> tuple[torch.Tensor, int]:
    """The tensor a store's rows live in and where its first row sits there: its stack's, or its own data."""
    return (store.stack.data, store.stack_row) if store.stack is not None else (store.data, 0)


def gather_many(pairs: Sequence[tuple[TrackedLayer, torch.Tensor]]) -> None:
    """`layer.gather(index)` for every (layer, index) pair, the batch-1 full-precision layers that are rows of
    shared stores gathered together when their stores live in one tensor (`gather_rows`: one layer's shared
    stores, or a stack of every layer's); each layer at most once."""
    groups: dict[int, tuple[list[TrackedLayer], list[torch.Tensor]]] = {}
    for layer, index in pairs:
        if not _shared_rows([layer]) or index.shape[0] != 1:
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
    """`layers[k].gather(indices[k])` for batch-1 layers whose entries live in one tensor per field (rows of one
    layer's shared stores, or of a stack of layers), done as one copy per field for all of them: the same entries
    kept, in a few operations instead of a dozen per row. indices[k]: [1, 1 or Hkv, K_k] (no empty slots)."""
    homes, rows = _rows_in_home(layers, "gather_rows")
    device = indices[0].device
    heads = homes["keys"].shape[1]
    counts = [int(i.shape[-1]) for i in indices]
    # [rows, Hkv, max K]; a shorter row's padding repeats entry 0 (never written)
    index = pad_sequence([i[0].transpose(0, 1).expand(-1, heads) for i in indices], batch_first=True)
    index = index.transpose(1, 2).contiguous()
    slots = _slots(index.shape[2], device)
    valid = slots < torch.tensor(counts, device=device)[:, None, None]  # [rows, 1, max K]
    # only the slots whose entry changes are written; kept indices ascend, so those are the slots from the first
    # evicted entry on (a fixed-point eviction moves the newest few entries, not the row)
    moved = ((index != slots) & valid).reshape(-1)
    flat: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # capacity -> (all kept, read, written)
    kept_image = None
    with torch.inference_mode():
        for name in ENTRY_FIELDS:
            data = homes[name]
            cap = data.shape[2]
            if cap not in flat:  # every (row, head) slot as one row of the flattened store: plain row copies
                first = _slot_starts(rows, heads, cap, device)
                everything = (first + index).reshape(-1)
                flat[cap] = (everything, everything[moved], (first + slots).expand_as(index).reshape(-1)[moved])
            everything, read, written = flat[cap]
            entries = data.view(-1, *data.shape[3:])
            if name == "is_image":  # image entries kept per row, summed over heads (events ask every step)
                kept = entries.index_select(0, everything).view(index.shape)
                kept_image = KeptImageCounts((kept & valid).sum(dim=(1, 2)), heads)
                entries.index_copy_(0, written, kept.view(-1)[moved])
            else:
                entries.index_copy_(0, written, entries.index_select(0, read))
    for name in ENTRY_FIELDS:
        for layer, k in zip(layers, counts):
            layer._stores[name].lengths[layer._rows[0]] = k
    for k, layer in enumerate(layers):
        layer._image_count = (kept_image, k)


def _shared_rows(layers: Sequence[TrackedLayer]) -> bool:
    """Whether every layer is a batch-1, full-precision row of shared stores without empty slots."""
    return all(not layer.segments and not layer.has_empty_slots and layer._rows[1] - layer._rows[0] == 1
               for layer in layers)


def _rows_in_home(layers: Sequence[TrackedLayer], what: str) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """The tensor each field of `layers` lives in and every layer's row there; raises unless they all live in one
    tensor per field, at the same rows in every field."""
    homes = {name: [_home(layer._stores[name]) for layer in layers] for name in ENTRY_FIELDS}
    rows = tuple(start + layer._rows[0] for (_, start), layer in zip(homes["keys"], layers))
    if not _shared_rows(layers) or any(
            any(data is not found[0][0] for data, _ in found)
            or tuple(start + layer._rows[0] for (_, start), layer in zip(found, layers)) != rows
            for found in homes.values()):
        raise ValueError(f"{what} takes full-precision rows of shared stores that live in one tensor per field")
    return {name: found[0][0] for name, found in homes.items()}, rows


def _group_key(layer: TrackedLayer) -> int:
    store = layer._stores["keys"]
    return id(store.stack) if store.stack is not None else id(layer._stores)


def drop_ranges(drops: Sequence[tuple[TrackedLayer, int, int]]) -> None:
    """For each (layer, start, count): drop entries [start, start + count) from every head of the layer, the ones
    after them moving up by `count` (what `layer.gather` does with every other index kept). The batch-1 rows of
    shared stores that live in one tensor per field are done together, one copy per field for all of them;
    any other layer (its own stores, quantised entries, empty slots) drops its range on its own
    (`TrackedLayer.drop_range`). Each layer at most
    once."""
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
    layers = [layer for layer, _, _ in drops]
    homes, rows = _rows_in_home(layers, "drop_ranges")
    lengths = [layer.length for layer in layers]
    after = [n - start - count for (_, start, count), n in zip(drops, lengths)]  # entries that move up
    if min(n - count for (_, _, count), n in zip(drops, lengths)) < 0 or min(after) < 0:
        raise ValueError("a dropped range must lie within the layer's entries")
    keys = homes["keys"]
    device, heads = keys.device, keys.shape[1]
    moving = max(after)
    kept_image = None
    with torch.inference_mode():
        if moving > 0:
            # per row: (where the range starts, how many entries it holds, how many move up), one copy to the device
            numbers = torch.tensor([[start, count, a] for (_, start, count), a in zip(drops, after)], device=device)
            offsets = _slots(moving, device)
            moves = (offsets < numbers[:, 2:]).unsqueeze(1)  # [rows, 1, M]: slot start + j takes entry start + j + count
            written_from = (numbers[:, :1] + offsets).unsqueeze(1)  # [rows, 1, M]
            shift = (numbers[:, 1:2].unsqueeze(1) * moves)  # [rows, 1, M]
            flat: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for name in ENTRY_FIELDS:
                data = homes[name]
                cap = data.shape[2]
                if cap not in flat:
                    # a slot that takes nothing copies the row's last slot onto itself (no entry is kept there:
                    # every row keeps fewer than its capacity), so no index is written twice with different values
                    first = _slot_starts(rows, heads, cap, device)  # [rows, Hkv, 1]
                    written = torch.where(moves, first + written_from, first + (cap - 1))
                    flat[cap] = (written.reshape(-1), (written + shift).reshape(-1))
                written, read = flat[cap]
                entries = data.view(-1, *data.shape[3:])
                entries.index_copy_(0, written, entries.index_select(0, read))
        flags = homes["is_image"]  # image entries each row keeps now, summed over its heads
        kept = torch.tensor([n - count for (_, _, count), n in zip(drops, lengths)], device=device)
        rows_now = flags.index_select(0, _row_index(rows, device))
        kept_image = KeptImageCounts((rows_now & (_slots(flags.shape[2], device) < kept[:, None, None])).sum(dim=(1, 2)),
                                     heads)
    for (layer, _, count), n in zip(drops, lengths):
        for name in ENTRY_FIELDS:
            layer._stores[name].lengths[layer._rows[0]] = n - count
    for k, layer in enumerate(layers):
        layer._image_count = (kept_image, k)
