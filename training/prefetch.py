"""Training batches built ahead in worker processes (--workers N).

Rendering scenes, running the image processor and tokenising are the CPU side of a training step; on a GPU
they would leave it idle most of the time. Every batch depends only on its step index, so a run gives the
same batches with any number of workers (0 = built in the training process, no extra processes).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch


class _Steps(torch.utils.data.Dataset):
    def __init__(self, make: Callable[[int], Any], start: int, stop: int):
        self.make, self.start, self.stop = make, start, stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, i: int) -> Any:
        return self.make(self.start + i)


def _quiet_worker(_: int) -> None:
    torch.set_num_threads(1)  # a worker renders; its own thread pool would fight the trainer's


def batches(make: Callable[[int], Any], start: int, stop: int, workers: int = 0,
            ahead: int = 4) -> Iterator[Any]:
    """`make(step)` for step in [start, stop), in order; with `workers` > 0 built `ahead` batches per worker
    in advance by forked workers (they inherit the tokenizer and processor, nothing is pickled)."""
    if workers <= 0:
        return (make(s) for s in range(start, stop))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loader = torch.utils.data.DataLoader(
        _Steps(make, start, stop), batch_size=None, shuffle=False, num_workers=workers, prefetch_factor=ahead,
        persistent_workers=False, worker_init_fn=_quiet_worker, multiprocessing_context="fork")
    return iter(loader)
