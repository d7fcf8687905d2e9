"""Timing a step's parts without waiting for the device in the middle of the step.

A decode step times its shared forward and each row's policy work (planning, eviction, holding). Reading the clock
after a `cuda.synchronize` would make every timed part a host round trip: at batch 16 that was 65 waits a step,
more than the step's own work on a GPU. Instead a `Stopwatch` marks the device's timeline (CUDA events, recorded
on the current stream, no wait) and reads the seconds between two marks only when asked: after the step's tokens
were read back, which waited for every mark already, so reading them costs nothing. On the CPU a mark is the
clock itself (the work ran when it was called).

What a CUDA span measures is the device's timeline between two marks: the kernels launched between them, and any
time the device sat waiting for the host to launch them. For a launch-bound step that is the host's time; for a
bandwidth-bound one the kernels'. Either way it is the part's share of the step's wall time.
"""
from __future__ import annotations

import time

import torch


class Stopwatch:
    """Marks on one device's timeline; the seconds between two of them, read later (`Elapsed`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> int:
        """Mark now (on a GPU: after the work queued so far); returns the mark's number."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def seconds(self, start: int, end: int) -> float:
        """Seconds between marks `start` and `end` (waits for the device to reach `end` if it has not yet)."""
        a, b = self._marks[start], self._marks[end]
        if not self.cuda:
            return b - a
        b.synchronize()  # free once the step's tokens were read back
        return a.elapsed_time(b) / 1000.0


class Elapsed:
    """Seconds read off a stopwatch when first asked for (`float(e)`): a sum of its spans, each with a weight (a
    row's share of work done for several rows at once)."""

    __slots__ = ("_watch", "_spans", "_value")

    def __init__(self, watch: Stopwatch | None = None):
        self._watch = watch
        self._spans: list[tuple[int, int, float]] = []
        self._value: float | None = None if watch is not None else 0.0

    def add(self, start: int, end: int, weight: float = 1.0) -> None:
        self._spans.append((start, end, weight))
        self._value = None

    def __float__(self) -> float:
        if self._value is None:
            self._value = sum(w * self._watch.seconds(a, b) for a, b, w in self._spans)
        return self._value

    def __repr__(self) -> str:
        return f"Elapsed({float(self):.6f})"
