"""Every layer's row lengths before a batched decode step, on the device, kept from one step to the next.

A batched step reads each row's length in every layer as tensors: where the row's new entry goes (a scatter index
for the keys and values, one flat index into the metadata's stacks) and, when the rows hold different numbers of
entries, a key mask. Made anew every step they cost a dozen operators; but from one step to the next every row
gains one entry (a prompt-only method) or keeps its count (an every-step eviction: one in, one out), so they are
moved on in place instead: one operator a step, or none, and one for the key masks when a step reads them."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..kv.stores import SPARE_ENTRIES


def _moved_by(before: list[list[int]] | None, now: Sequence[Sequence[int]]) -> int | None:
    """1 when every length grew by one, 0 when none changed, None otherwise (or when the batch's shape changed)."""
    if before is None or len(before) != len(now) or any(len(a) != len(b) for a, b in zip(before, now)):
        return None
    if all(a == b for a, b in zip(before, now)):
        return 0
    if all(n == m + 1 for a, b in zip(before, now) for m, n in zip(a, b)):
        return 1
    return None


class StepLengths:
    """What `ends` [L, B] (every layer's row lengths before the step), and the tensors made from it, hold."""

    def __init__(self):
        self.lengths: list[list[int]] | None = None  # per layer, each row's entries: what `ends` holds
        self.ends: torch.Tensor | None = None
        self._layer_ends: tuple[torch.Tensor, ...] = ()
        self._index: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (heads, dim) -> each layer's index
        self._masks: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        self._masks_fresh = False
        self._meta: dict[tuple, torch.Tensor] = {}  # a stacks' layout -> its metadata slots for the step

    def start(self, lengths: Sequence[Sequence[int]], device: torch.device) -> None:
        """Before a step: every layer's row lengths (per layer, per row)."""
        moved = _moved_by(self.lengths, lengths)
        if moved is None:
            self.ends = torch.tensor(lengths, device=device)
            self._layer_ends = self.ends.unbind(0)
            self._index, self._masks, self._meta = {}, None, {}
        elif moved:
            self.ends.add_(1)  # every view made of it (the layers' ends, the scatter indices) moves on with it
            for slots in self._meta.values():
                slots.add_(1)
        self.lengths = [list(row) for row in lengths]
        self._masks_fresh = False

    def layer_ends(self, layer: int) -> torch.Tensor:
        """[B]: layer `layer`'s row lengths before the step."""
        return self._layer_ends[layer]

    def append_index(self, layer: int, heads: int, dim: int) -> torch.Tensor:
        """[B, heads, 1, dim]: each row's next slot, the index that scatters the step's new keys (or values)."""
        found = self._index.get((heads, dim))
        if found is None:
            n_layers, b = self.ends.shape
            found = self._index[(heads, dim)] = self.ends.view(n_layers, b, 1, 1, 1).expand(
                n_layers, b, heads, 1, dim).unbind(0)
        return found[layer]

    def key_mask(self, layer: int, t: int) -> torch.Tensor:
        """[B, 1, t]: True up to and including each row's new entry (made for every layer at once)."""
        longest = max(max(row) for row in self.lengths) + 1
        if self._masks is None or self._masks[0].shape[0] < longest:
            slots = torch.arange(longest + SPARE_ENTRIES, device=self.ends.device)
            masks = slots <= self.ends.unsqueeze(-1)  # [L, B, W]
            self._masks = (slots, masks, masks.unsqueeze(2).unbind(0))
        elif not self._masks_fresh:
            torch.le(self._masks[0], self.ends.unsqueeze(-1), out=self._masks[1])
        self._masks_fresh = True
        return self._masks[2][layer][..., :t]

    def meta_slots(self, layout: tuple, starts: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Flat [L·B·Hkv]: each row's next slot in every layer and head of stacks laid out as `layout`, whose slot 0
        of each (layer, row, head) `starts()` gives ([L, B, Hkv]); kept while the layout holds."""
        found = self._meta.get(layout)
        if found is None:
            self._meta = {layout: (starts() + self.ends[:, :, None]).view(-1)}  # a new layout: the old ones go
            found = self._meta[layout]
        return found
