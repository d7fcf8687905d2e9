"""DyCoke: a video's frames merged over time in the prefill, the cache's image entries pruned per step while decoding.

Paper: Tao et al., "DyCoke: Dynamic Compression of Tokens for Fast Video Large Language Models", CVPR 2025,
https://arxiv.org/abs/2411.15024 (reference code: https://github.com/KD-TAO/DyCoke).

Two stages.
1. Temporal token merging (TTM), a prefill token reduction before the first layer (`prefill_token_drops`, at layer
   0): the video's F frames, in windows of four (a, a+1, a+2, a+3), each compared patch by patch with another
   frame of its window by the cosine similarity of the language model's input embeddings: a+1 with a, a+3 with
   a+2, then a+2 with a. Each compared frame keeps the int(r·P) of its P patch tokens least like the same patch of
   the frame it is compared with; a window's first frame stays whole. The others never reach a layer, so no layer
   holds them (about (1 + 3r)/4 of the video's tokens stay).
2. Dynamic pruning (DP), while decoding (`step_subset`): at every decode step, the new token's attention in layer
   L - 1 (averaged over heads) ranks the cache's I image entries; layers L and later attend to the int(I·(1 - p))
   best of them and to every text and generated entry. Nothing is evicted: the next step ranks them all again.

Defaults as published (the reference's README: dycoke_l=3, dycoke_p=0.7, dycoke_k=0.7): L = 3, p = 0.7, and the
budget r is the share of a compared frame's tokens kept, the reference's 1 - K (the tool's default r = 0.3 is its
K = 0.7). At r = 1 both stages are off: it is Full.

Where the reference leaves room or this tool departs (docs/methods.md):
- the kept tokens keep their own positions and order; the reference feeds the kept features as a shorter sequence
  (positions renumbered), a compared frame's tokens in similarity order;
- each odd frame is compared with its own pair (the reference's index reads the pair before's similarities, and
  the last pair's for the first); every whole window gets the second comparison (the reference's loop skips the
  last window); a last odd frame stays whole (the reference's loop drops it);
- DP prunes at every step; the reference prunes only at the steps whose layer-(L - 1) image attention has a
  cosine similarity under 0.9 to the step before's, and attends to every entry at the others;
- the frames compared are the tokens the model reads a video as: OneVision's pooled frame grids (the reference's
  196 a frame), Qwen's merged temporal groups, each frame's image tokens (newline tokens left out) where a family
  reads a video as images. Without two frames of one size TTM merges nothing (a note says so); DP still runs;
- L is clamped to the model's layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Fact, Policy, PolicyState, Prefilled, PrefillView, TokenDrop, knob

WINDOW = 4  # frames a window holds (the reference's)


def compared_frames(num_frames: int) -> list[tuple[int, int]]:
    """(frame, the frame it is compared with) for every frame TTM merges, in the reference's order: each odd frame
    with the even one before it, then each window's third frame with its first."""
    pairs = [(f + 1, f) for f in range(0, num_frames - 1, 2)]
    pairs += [(a + 2, a) for a in range(0, num_frames, WINDOW) if a + 2 < num_frames]
    return pairs


def ttm_keep(features: torch.Tensor, keep: int) -> torch.Tensor:
    """features [F, P, D] (each frame's patch tokens, column j the same patch in every frame) -> bool [F, P]: a
    compared frame keeps its `keep` patches least similar to the same patch of the frame it is compared with (ties
    to the earlier patch); the others are kept whole. Every comparison reads the frames as they came in."""
    num_frames, patches = features.shape[:2]
    kept = torch.ones(num_frames, patches, dtype=torch.bool, device=features.device)
    unit = F.normalize(features.float(), dim=-1)
    for frame, other in compared_frames(num_frames):
        similarity = (unit[frame] * unit[other]).sum(dim=-1)
        least = torch.argsort(similarity, stable=True)[:max(0, keep)]
        kept[frame] = torch.zeros(patches, dtype=torch.bool, device=features.device).scatter(0, least, True)
    return kept


def dp_keep(attention: torch.Tensor, is_image: torch.Tensor, keep: int) -> torch.Tensor:
    """attention [R, Hkv, T] (the new token's in each of R rows, T >= n), is_image [R, n] (which of their n
    entries are image entries) -> bool [R, n]: every entry but the image entries outside each row's `keep` most
    attended (averaged over heads)."""
    n = is_image.shape[1]
    scores = attention[..., :n].float().mean(dim=1).masked_fill(~is_image, float("-inf"))
    out = ~is_image
    if keep > 0:
        out.scatter_(1, torch.topk(scores, min(keep, n), dim=1, sorted=False).indices, True)
    return out


@dataclass
class DyCokeState(PolicyState):
    image_tokens: int = 0  # the prompt's image tokens
    image_kept: int = 0  # those that reached the first layer
    pruning_layer: int = 0  # L: the first layer that attends to DP's subset (0: DP off)


@dataclass(frozen=True)
class DyCokePolicy(Policy):
    """DyCoke: a video's frames merged over time before the first layer (each compared frame keeps the patches
    least like the frame before), then per decode step the image entries the new token attends to least skipped
    from layer L on. Paper: "DyCoke: Dynamic Compression of Tokens for Fast Video Large Language Models" (Tao et
    al., CVPR 2025), https://arxiv.org/abs/2411.15024"""

    name = "dycoke"
    label = "DyCoke"
    summary = ("Video: in windows of four frames, three keep only the patches least like another frame's (temporal "
               "merging before the first layer); while decoding, layers from L on attend to the image entries the "
               "new token attends to most in layer L − 1, chosen again at every step.")
    colour = "#C2185B"
    schedule = "prompt only"
    stage = "prefill token reduction"
    control = "random_drop"

    layer: int = knob(3, help="L: the first layer whose decoding attention reads only the image entries chosen by "
                              "layer L − 1's (the reference's dycoke_l)", low=1, high=256, integer=True)
    prune: float = knob(0.7, help="p: the share of the image entries each decode step skips from layer L on (the "
                                  "reference's dycoke_p; 0 turns dynamic pruning off)", low=0.0, high=1.0)

    def frame_keep(self, patches: int) -> int:
        """A compared frame's patches TTM keeps: int(r·P)."""
        return int(float(self.budget) * patches)

    def prefill_token_drops(self, prompt_len: int, is_image: torch.Tensor, num_layers: int,
                            frames=None) -> list[TokenDrop]:
        if frames is None or float(self.budget) >= 1.0:
            return []
        image_at = is_image[0].nonzero().flatten()
        tokens = image_at[torch.as_tensor(frames, dtype=torch.long, device=image_at.device)]  # [F, P] positions
        keep = self.frame_keep(tokens.shape[1])
        return [TokenDrop(0, lambda stats, kept, hidden: self.choose(hidden, tokens, keep), reads_hidden=True)]

    def choose(self, hidden: torch.Tensor, tokens: torch.Tensor, keep: int) -> torch.Tensor:
        """Before the first layer: bool [B, N] over the prompt (`hidden` [B, N, D], the input embeddings; `tokens`
        [F, P], each frame's patch tokens as prompt positions)."""
        rows, n = hidden.shape[:2]
        mask = torch.ones(rows, n, dtype=torch.bool, device=hidden.device)
        at = tokens.to(hidden.device)
        for r in range(rows):
            mask[r, at.flatten()] = ttm_keep(hidden[r, at], keep).flatten()
        return mask

    def pruning_layer(self, num_layers: int) -> int:
        """L clamped to the model's layers (0: DP off: no layer after one to rate with, p = 0, or r = 1, which is
        Full)."""
        on = num_layers > 1 and self.prune > 0 and float(self.budget) < 1.0
        return min(int(self.layer), num_layers - 1) if on else 0

    def new_state(self) -> DyCokeState:
        return DyCokeState()

    def prefill(self, view: PrefillView) -> Prefilled:
        """Plans nothing: TTM acted in its own prefill. Finds what it did (the prompt's tokens that never reached a
        layer were its)."""
        state = self.new_state()
        first = view.layer(0)
        flags = first.is_image[0, 0]
        state.image_kept = int(flags.sum())
        dropped = view.prompt_len - first.length
        state.image_tokens = state.image_kept + dropped
        state.pruning_layer = self.pruning_layer(view.num_layers) if state.image_kept else 0
        if not dropped and float(self.budget) < 1.0:
            state.notes.append("no two video frames of one size to merge: temporal merging kept every token")
        return Prefilled([None] * view.num_layers, state)

    def decode_needs_attention(self) -> bool:
        return self.prune > 0 and float(self.budget) < 1.0  # DP reads the new token's attention in layer L − 1

    def decode_attention_layers(self, state: PolicyState | None) -> tuple[int, ...] | None:
        if isinstance(state, DyCokeState) and state.pruning_layer:
            return (state.pruning_layer - 1,)  # the one layer DP rates with
        return None

    def step_subset(self, state: PolicyState, cache):
        if not isinstance(state, DyCokeState) or not state.pruning_layer:
            return None
        rating = cache.layers[state.pruning_layer - 1]  # every layer holds the same entries (TTM drops before all)
        keep = int(rating.image_count() * (1.0 - float(self.prune)))  # counted again only after an eviction

        def choose(attention: torch.Tensor) -> torch.Tensor:  # [R, Hkv, T] -> [R, n]
            return dp_keep(attention, rating.is_image[:, 0], keep)

        return state.pruning_layer, choose

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, DyCokeState) and state.image_tokens:
            out.append(Fact("ttm_kept", "image tokens after temporal merging", state.image_kept, fmt="d",
                            unit=f" of {state.image_tokens}"))
            if state.pruning_layer:
                kept = int(state.image_kept * (1.0 - float(self.prune)))
                out.append(Fact("dp_subset", f"image entries each step attends to from layer {state.pruning_layer}",
                                kept, fmt="d", unit=f" of {state.image_kept}"))
        return out
