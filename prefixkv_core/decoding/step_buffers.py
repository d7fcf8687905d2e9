"""What a turn's batched steps keep from one step to the next: the rows' shared stores, and the padded tensors of
multi-token steps.

Per layer, the batch's rows live in one or two groups of shared stores (`RowGroup`): row k of a group's stores
(keys, values, positions, flags, scores) is the entries of the group's k-th row. Rows move in once (a copy of
their entries); from then on decode steps append each row's new entry in place and attention reads a group's
rows at once through their lengths (a key mask), so a step copies nothing that grows with the cache. Policies
evict and merge in a row's own slot.

A group is as long as its longest row, and every row of it is read that far (masked). When one method keeps
far more entries than the others (Full and a method that quantises beside several that evict), one group
would hold and read mostly padding: then the long rows get a group of their own, when that saves at least
`SPLIT_MIN_BYTES` of the layer's stores and a `1 - SPLIT_SHARE` share of them. Small caches (the embedded
model) stay in one group, where one attention call per layer is cheaper than two.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..kv.cache import ENTRY_FIELDS, TrackedLayer, move_rows_into
from ..kv.stores import SPARE_ENTRIES, EntryStore, StoreStack, spare_for
from .step_lengths import StepLengths

SPLIT_MIN_BYTES = 8 * 2**20  # a layer's stores split in two only when that saves this much ...
SPLIT_SHARE = 0.7  # ... and leaves at most this share of the single group's size


def split_by_length(lengths: Sequence[int], spare: int = SPARE_ENTRIES, entry_bytes: int = 0) -> list[list[int]]:
    """The batch's rows (indices into `lengths`, each row's entries) as one group, or two (the longest rows, the
    rest) when that saves enough of the stores: each group holds its longest row plus `spare` entries per row,
    `entry_bytes` an entry of every head (keys and values). Each group's rows ascending."""
    b = len(lengths)
    whole = b * (max(lengths) + spare)
    order = sorted(range(b), key=lambda r: (-lengths[r], r))
    best, cut = whole, 0
    for k in range(1, b):
        cost = k * (lengths[order[0]] + spare) + (b - k) * (lengths[order[k]] + spare)
        if cost < best:
            best, cut = cost, k
    if cut and (whole - best) * entry_bytes >= SPLIT_MIN_BYTES and best <= SPLIT_SHARE * whole:
        return [sorted(order[:cut]), sorted(order[cut:])]
    return [list(range(b))]


@dataclass
class RowGroup:
    """Batch rows (ascending) that share one set of stores: the group's k-th row is row k of the stores."""

    rows: list[int]
    stores: dict[str, EntryStore]
    index: torch.Tensor  # the rows, as a tensor on the model's device (to pick them out of a step's tensors)
    whole: bool  # the group holds every row of the batch, in order
    occupants: list = field(default_factory=list)  # per row: the layer living there (weakly)
    refreshed: list = field(default_factory=list)  # per row: what a quantised row's working copy holds
    linked: list = field(default_factory=list)  # per row: a quantised row's `Link` to its working copy, or None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores.values())


@dataclass
class Link:
    """A quantised layer whose own stores are views of its working copy (its full-precision keys and values after
    the dequantised entries, its metadata over all of them), so a step's append writes both at once."""

    layer: weakref.ref
    own: dict[str, EntryStore]  # the layer's stores, views of the group's row
    data: dict[str, torch.Tensor]  # the group's tensors they view (a store that grew has new ones)

    def holds(self, layer: TrackedLayer, stores: dict[str, EntryStore]) -> bool:
        """Whether `layer` still keeps its entries in these views and the group still has the tensors they view."""
        return (self.layer() is layer and layer.lives_in(self.own, 0)
                and all(stores[n].data is d for n, d in self.data.items()))


def _dead():
    return None


def _segments_held(refreshed: tuple | None, layer: TrackedLayer) -> int:
    """How many of `layer`'s packed segments, from the first, a slot last refreshed as `refreshed` (its segments'
    ids and length, or None) holds already: the ones it was written from, when the layer kept them and added
    after them (packed segments are never evicted)."""
    if refreshed is None:
        return 0
    held = refreshed[0]
    ids = tuple(id(seg) for seg in layer.segments[:len(held)])
    return len(held) if ids == held else 0


class StepBuffers:
    """What a turn's batched steps keep from one step to the next (one per turn; drop it afterwards).

    - Per layer, the rows' shared stores (`groups`), see the module's docstring.
    - The padded tensors of multi-token steps (a follow-up's or the question's tokens, once per turn), laid
      out as [row's entries | padding | the step's tokens], reused without zeroing: a row attends only to its
      own entries and the step's tokens (the key mask), and the rest holds earlier finite entries, which the
      mask turns into exact zeros."""

    def __init__(self):
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._groups: dict[int, list[RowGroup]] = {}
        self._where: dict[int, dict[int, tuple[RowGroup, int]]] = {}  # layer -> batch row -> (group, row in it)
        self.step_lengths = StepLengths()  # the rows' lengths on the device, moved on from step to step

    def get(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H, t, D] padded views shaped like `keys`/`values` ([B, H, *, D]) with room for t entries."""
        b, h, _, d = keys.shape
        found = self._layers.get(layer_idx)
        if (found is None or found[0].shape[0] < b or found[0].shape[2] < t or found[0].shape[1] != h
                or found[0].shape[3] != d or found[0].dtype != keys.dtype or found[0].device != keys.device):
            grown = t if found is None else max(t, found[0].shape[2] + found[0].shape[2] // 2)
            rows = b if found is None else max(b, found[0].shape[0])
            found = (keys.new_zeros(rows, h, grown + 16, d), values.new_zeros(rows, h, grown + 16, values.shape[-1]))
            self._layers[layer_idx] = found
        return found[0][:b, :, :t], found[1][:b, :, :t]

    def groups(self, layer_idx: int, rows: Sequence[TrackedLayer]) -> list[RowGroup]:
        """The groups of shared stores of layer `layer_idx` holding `rows` (batch-1 layers, the batch's rows in
        order), each row moved in unless it lives there already. A row holding quantised entries stays out
        (`refresh_row`)."""
        groups = self._groups.get(layer_idx)
        if groups is not None and sum(len(g.rows) for g in groups) == len(rows):
            for g in groups:
                stores = g.stores
                for k, r in enumerate(g.rows):
                    layer = rows[r]
                    if not layer.lives_in(stores, k) and not layer.segments:
                        break
                else:
                    continue
                break
            else:
                return groups  # every row lives here already (the usual decode step): nothing to check or move
        if groups is None or sum(len(g.rows) for g in groups) != len(rows) or not self._fit(
                groups[0].stores, [layer for layer in rows[:1] if not layer.segments]):
            groups = self._new_groups(layer_idx, rows)
        for g in groups:
            movers = []
            for k, r in enumerate(g.rows):
                layer = rows[r]
                if layer.segments or layer.lives_in(g.stores, k):
                    continue
                previous = g.occupants[k]()
                if previous is not None and previous is not layer and previous.lives_in(g.stores, k):
                    previous.own_storage()  # a row that left the batch keeps its entries
                self._unlink(g, k)
                movers.append((k, layer))
                g.occupants[k] = weakref.ref(layer)
            if movers:
                move_rows_into(movers, g.stores)
        return groups

    def form(self, rows_by_layer: Sequence[Sequence[TrackedLayer]]) -> None:
        """The shared stores of every layer at once (`rows_by_layer[i]`: layer i of each batch row, in order), rows
        moved in. When every layer groups its rows alike (one group, or the same two), each group's stores are
        stacked over the layers (`StoreStack`, one tensor per field, each layer's part as long as the group's
        longest row in that layer), so a step's evictions from many layers are one copy per field; otherwise each
        layer gets groups of its own."""
        layouts = [self._layout(rows) for rows in rows_by_layer]
        first, _, split = layouts[0]
        stackable = all(other == split for _, _, other in layouts) and all(
            all(f.shape[1:2] + f.shape[3:] == first[n].shape[1:2] + first[n].shape[3:] and f.dtype == first[n].dtype
                and f.device == first[n].device for n, f in fields.items()) for fields, _, _ in layouts)
        if not stackable:
            for i, rows in enumerate(rows_by_layer):
                self._new_groups(i, rows)
        else:
            stacks = []
            for members in split:  # each layer as long as its own longest row of the group, plus room
                rooms = [(n := max(lengths[r] for r in members)) + spare_for(n) for _, lengths, _ in layouts]
                stacks.append({name: StoreStack(t, len(members), rooms) for name, t in first.items()})
            for i in range(len(layouts)):
                made = [(members, {name: EntryStore(stack.layer_view(i), [0] * len(members), stack)
                                   for name, stack in group.items()})
                        for members, group in zip(split, stacks)]
                self._set_groups(i, made, len(rows_by_layer[i]), first["keys"].device)
        for i, rows in enumerate(rows_by_layer):
            self.groups(i, rows)

    def holds_batch(self, rows: int) -> bool:
        """Whether the stores were formed for a batch of this many rows (else `form` them anew)."""
        groups = self._groups.get(0)
        return groups is not None and sum(len(g.rows) for g in groups) == rows

    @staticmethod
    def _layout(rows: Sequence[TrackedLayer]) -> tuple[dict[str, torch.Tensor], list[int], list[list[int]]]:
        """A layer's fields to shape its stores by, its rows' lengths, and its rows in one group or two."""
        resident = [layer for layer in rows if not layer.segments]
        like = resident[0] if resident else rows[0]
        fields = {name: getattr(like, name) if resident else (like.full_keys() if name == "keys" else
                                                             like.full_values() if name == "values" else
                                                             getattr(like, name)) for name in ENTRY_FIELDS}
        entry_bytes = sum(fields[n][0, :, :1].numel() * fields[n].element_size() for n in ("keys", "values"))
        lengths = [layer.length for layer in rows]
        return fields, lengths, split_by_length(lengths, SPARE_ENTRIES, entry_bytes)

    def _new_groups(self, layer_idx: int, rows: Sequence[TrackedLayer]) -> list[RowGroup]:
        fields, lengths, split = self._layout(rows)
        made = []
        for members in split:
            longest = max(lengths[r] for r in members)
            room = longest + spare_for(longest)
            made.append((members, {name: EntryStore(t.new_zeros(len(members), t.shape[1], room, *t.shape[3:]),
                                                    [0] * len(members)) for name, t in fields.items()}))
        return self._set_groups(layer_idx, made, len(rows), fields["keys"].device)

    def _set_groups(self, layer_idx: int, made: list[tuple[list[int], dict[str, EntryStore]]], b: int,
                    device: torch.device) -> list[RowGroup]:
        groups = [RowGroup(members, stores, torch.tensor(members, device=device), members == list(range(b)),
                           [_dead] * len(members), [None] * len(members), [None] * len(members))
                  for members, stores in made]
        self._groups[layer_idx] = groups
        self._where[layer_idx] = {r: (g, k) for g in groups for k, r in enumerate(g.rows)}
        return groups

    @staticmethod
    def _fit(stores: dict[str, EntryStore], resident: Sequence[TrackedLayer]) -> bool:
        return all(stores[name].fits(getattr(layer, name), (0, 1)) for layer in resident for name in ENTRY_FIELDS)

    def refresh_row(self, layer_idx: int, r: int, layer: TrackedLayer) -> None:
        """Batch row r's slot in its group as the working copy of a layer that holds quantised entries: its
        entries dequantised, written again only when its entries changed other than by the steps' own appends (a
        new quantised block). The layer's own stores then become views of the slot (`Link`): its full-precision
        entries after the dequantised ones, its metadata over all of them, so a step's append writes both."""
        group, k = self._where[layer_idx][r]
        stores = group.stores
        signature = (tuple(id(seg) for seg in layer.segments), layer.length)
        if group.refreshed[k] != signature or stores["keys"].lengths[k] != layer.length:
            if layer.shares_a_store_with(stores):
                layer.own_storage()
            # the packed segments the slot holds already (dequantised, from its last refresh) stay; the new ones and
            # the full-precision entries after them are written (a new block packs every 100 tokens)
            kept = _segments_held(group.refreshed[k], layer)
            start = sum(seg.keys.shape[2] for seg in layer.segments[:kept])
            stores["keys"].write_after((k, k + 1), start, layer.full_keys(kept))
            stores["values"].write_after((k, k + 1), start, layer.full_values(kept))
            for name in ("positions", "is_image", "scores"):  # metadata whole: a row's scores may have moved on
                stores[name].write((k, k + 1), getattr(layer, name))
            group.refreshed[k] = signature
        elif group.linked[k] is not None and group.linked[k].holds(layer, stores):
            return
        self._link(group, k, layer)

    def _link(self, group: RowGroup, k: int, layer: TrackedLayer) -> None:
        packed = layer.length - layer.keys.shape[2]  # entries held quantised, before the full-precision ones
        own = {}
        for name, store in group.stores.items():
            start = packed if name in ("keys", "values") else 0
            view = store.data.narrow(0, k, 1).narrow(2, start, store.capacity - start)
            own[name] = EntryStore(view, [store.lengths[k] - start])
        layer.keep_in(own)
        group.linked[k] = Link(weakref.ref(layer), own, {n: st.data for n, st in group.stores.items()})

    def _unlink(self, group: RowGroup, k: int) -> None:
        """Before another row moves into slot k: a quantised layer whose stores view it takes its entries along."""
        link = group.linked[k]
        layer = link.layer() if link is not None else None
        if layer is not None and layer.shares_a_store_with(link.own):
            layer.own_storage()
        group.linked[k] = None
        group.refreshed[k] = None  # the slot no longer holds its working copy

    def took_step_entry(self, layer_idx: int, r: int, layer: TrackedLayer) -> bool:
        """After a decode step's append: whether batch row r's quantised layer got the new entry in its own stores
        too (they view its working copy), now counted; False when they do not (the caller appends it to them)."""
        group, k = self._where[layer_idx][r]
        link = group.linked[k]
        if link is None or not link.holds(layer, group.stores):
            return False
        for store in link.own.values():
            store.set_lengths((0, 1), store.lengths[0] + 1)
        group.refreshed[k] = (group.refreshed[k][0], layer.length)
        return True

    def refreshed(self, layer_idx: int, r: int, layer: TrackedLayer) -> None:
        """Batch row r's working copy took the step's new entry, as the layer did."""
        group, k = self._where[layer_idx][r]
        group.refreshed[k] = (tuple(id(seg) for seg in layer.segments), layer.length)

    def nbytes(self) -> int:
        padded = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._layers.values())
        return padded + sum(g.nbytes() for groups in self._groups.values() for g in groups)
