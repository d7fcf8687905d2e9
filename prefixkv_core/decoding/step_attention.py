"""The last query's attention of a batched decode step, as each row's policy reads it, and its accumulation into
the rows' scores.

`forward_rows` records the attention of the rows that want it (the first `wanted` rows of the step: `[wanted, Hkv,
T]` a layer). Slicing each row's part out of every layer, and adding it into each row's scores, would cost a few
operators per row and layer every step; here a row's part is sliced only when its policy reads it
(`RowAttention`), and where the rows' scores live in one shared store in the step's order (`StepBuffers`, their
working copies included), a layer's statistic is added into them at once (`StepAttention.add_to_scores`): one
operator a layer for every row. A row's entries get exactly what adding its own part gives; the slots after a
row's entries get the zeros its key mask gave them there."""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch

from ..kv.stores import EntryStore


class StepAttention:
    """One decode step's statistic: `stats` layer -> [wanted, Hkv, T] (row r's entries are its first
    lengths[layer][r]); `homes` layer -> the shared store holding the scores of rows 0..wanted - 1 in that order,
    for every layer the step recorded, or None when some row's scores live elsewhere (they are added row by row)."""

    def __init__(self, stats: Mapping[int, torch.Tensor], lengths: Mapping[int, Sequence[int]], wanted: int,
                 homes: Mapping[int, EntryStore] | None):
        self.stats, self.lengths, self.wanted = stats, lengths, wanted
        self.homes = homes if homes is not None and all(i in homes for i in stats) else None
        self.scores_added = False

    def rows(self) -> list["RowAttention"]:
        return [RowAttention(self, r) for r in range(self.wanted)]

    def add_to_scores(self) -> bool:
        """Add every layer's statistic into the rows' scores at once, if they share stores (once a step); whether
        the rows' scores now hold it."""
        if self.homes is None:
            return False
        if not self.scores_added:
            with torch.inference_mode():
                for i, stat in self.stats.items():
                    target = self.homes[i].leading(stat.shape[2])
                    if target.shape[0] != self.wanted:
                        target = target.narrow(0, 0, self.wanted)
                    target.add_(stat)
            self.scores_added = True
        return True


class RowAttention(Mapping):
    """Row r's part of a step's statistic, layer -> [1, Hkv, T_row] aligned with its entries, sliced when read."""

    def __init__(self, step: StepAttention, r: int):
        self.step, self.r = step, r
        self._sliced: dict[int, torch.Tensor] = {}

    @property
    def scores_added(self) -> bool:
        """Whether the step added this row's part into its scores already (`StepAttention.add_to_scores`)."""
        return self.step.scores_added

    def __getitem__(self, layer: int) -> torch.Tensor:
        found = self._sliced.get(layer)
        if found is None:
            stat = self.step.stats[layer]  # KeyError for a layer the step did not record
            found = self._sliced[layer] = stat[self.r:self.r + 1, :, :self.step.lengths[layer][self.r]]
        return found

    def __iter__(self) -> Iterator[int]:
        return iter(self.step.stats)

    def __len__(self) -> int:
        return len(self.step.stats)
