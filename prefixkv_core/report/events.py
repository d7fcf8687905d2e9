"""What the engine tells its listeners (UI, CLI, benchmarks) while it runs.

Plain dataclasses of Python numbers and numpy arrays, so consumers never touch torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..models.layout import ImageLayout


@dataclass
class PrefillInfo:
    """Emitted once per request, after the shared prefill."""

    prompt_tokens: int  # N: prompt length with the image expanded
    image_tokens: int
    num_layers: int
    importance: np.ndarray  # [L, N_c] float32: column sums of prefill attention over the compressed tokens
    is_image: np.ndarray  # [N_c] bool
    image_grid: tuple[int, int] | None  # patches per side (rows, cols) of the (first view's) image tokens, if any
    image_offset: int | None  # index of the first image token in the prompt
    prefill_s: float  # model forward time of the prefill (vision tower and statistics included)
    image_layout: ImageLayout | None = None  # every view of the image (anyres: base view + tiles), if any
    # method -> [L, N'] the per-layer importance whose Lorenz curves its allocation used (online PrefixKV: by
    # its scorer, N' = N - 1 when the sink is left out of the curves)
    curves: dict[str, np.ndarray] = field(default_factory=dict)
    # N_c: the prompt tokens prefilled and compressed at once: all N, or in the query-agnostic mode those
    # before the question (the question is fed afterwards through every compressed cache); None = N
    compressed_tokens: int | None = None


@dataclass
class KeptImageMap:
    """At one layer, the share of KV heads that still hold each image token (0 = evicted everywhere, 1 = kept by
    every head), placed on the views of the image: each crop's patch grid and its newline tokens."""

    layout: ImageLayout
    token_share: np.ndarray  # [image tokens] in prompt order
    # a vision-side reduction (VisionZip): [image tokens] the share of KV heads holding the contextual token each
    # was merged into (0 where none); None when the language model saw the prompt's own image tokens
    merged_share: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.token_share.size)

    def kept_tokens(self) -> int:
        return int((self.token_share > 0).sum())

    def merged_tokens(self) -> int:
        """Image tokens not kept themselves but living on inside a contextual token that is held."""
        if self.merged_share is None:
            return 0
        return int(((self.merged_share > 0) & (self.token_share <= 0)).sum())

    def view_merged(self, view: int) -> np.ndarray | None:
        """[rows, cols] merged share of the view's patch tokens (None without a vision-side reduction)."""
        if self.merged_share is None:
            return None
        return KeptImageMap(self.layout, self.merged_share).view_share(view)

    def mean_share(self) -> float:
        return float(self.token_share.mean()) if self.token_share.size else 0.0

    def _cells(self, view: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        views, rows, cols = self.layout.token_cells()
        mine = views == view
        return rows[mine], cols[mine], self.token_share[mine]

    def view_share(self, view: int) -> np.ndarray:
        """[rows, cols] share of the view's patch tokens."""
        v = self.layout.views[view]
        rows, cols, share = self._cells(view)
        grid = np.zeros((v.rows, v.cols), dtype=np.float32)
        patch = cols < v.cols
        grid[rows[patch], cols[patch]] = share[patch]
        return grid

    def newline_share(self, view: int) -> np.ndarray | None:
        """[rows] share of the newline token closing each row of the view (None when it has none)."""
        v = self.layout.views[view]
        if not v.newline:
            return None
        rows, cols, share = self._cells(view)
        out = np.zeros(v.rows, dtype=np.float32)
        nl = cols == v.cols
        out[rows[nl]] = share[nl]
        return out


EventKind = Literal["start", "token", "done", "error", "cancelled"]


@dataclass
class MethodEvent:
    """One step of one method. `text` is this turn's whole answer so far; `delta` the new part."""

    method: str
    label: str
    kind: EventKind
    turn: int = 0
    step: int = 0  # tokens generated so far in this turn
    text: str = ""
    delta: str = ""
    kept_per_layer: list[int] = field(default_factory=list)
    kept_image_per_layer: list[int] = field(default_factory=list)
    # per image (or video frame) of the prompt, in order: the share of its tokens held over every layer and KV
    # head; filled in on the events that close a turn ("done"), [] otherwise and without images
    kept_per_image: list[float] = field(default_factory=list)
    full_len: int = 0  # N_t: true sequence length (what an uncompressed cache would hold)
    kv_bytes: int = 0  # bytes of this method's cache tensors (packed storage counted as stored)
    full_kv_bytes: int = 0  # bytes an uncompressed cache of full_len tokens takes in this model
    step_latency_s: float = 0.0  # model forward time of the last step (shared by `batch_size` methods)
    policy_s: float = 0.0  # this method's own policy time in the last step (planning, merging, quantising)
    ttft_s: float | None = None  # time to first token of this turn (prefill + compression + 1st step)
    tokens_per_s: float | None = None  # decode throughput of this turn so far (forward + own policy time)
    error: str | None = None
    batch_size: int = 1  # methods decoded together in this step's forward (its latency is shared by them)
    # this method's own policy time on the turn's input: compressing the prompt, or a follow-up's tokens
    compress_s: float | None = None
    # the method was decoded on its own (the session's time-alone pass, or a session that is not batched):
    # every timing of this event is its own
    alone: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # method specific facts (thresholds, notes)
    stage: str = ""  # where the method saves memory (policies.STAGES), as its policy declares

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else 1.0
