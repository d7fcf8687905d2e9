"""What a vision-side token reduction (VisionZip, Downsample) and the runner tell each other, as plain tensors and
arrays.

The runner runs the model's own image path once and hands the policy, per crop the vision tower encoded, the
attention and the keys of the feature layer (`VisionCrops`). The policy answers, per crop, which output tokens
to make and from what (`CropMerge`: each output token a weighted sum of the crop's feature-layer tokens, or of
their projections when the plan says `projected`). The runner projects them, orders them, builds the shorter
prompt and records what each of the language model's image tokens stands for among the prompt's original image
tokens (`ImageTokenSources`), which the kept-patch overlay and the method's facts read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .facts import Fact

# dominant: a patch kept as it is for what it gets (its attention); diverse: one kept as it is for being unlike the
# others (VisPruner); contextual: a merge of patches; pooled: the mean of a block of the patch grid
KINDS = ("cls", "dominant", "diverse", "contextual", "pooled")
KEPT_AS_IS = ("dominant", "diverse")  # kinds that stand for their own patch


@dataclass
class VisionCrops:
    """The feature layer of the vision tower for the crops of one image (all of them, in the tower's order)."""

    attention: torch.Tensor  # [C, T, T] fp32: attention probabilities averaged over heads (query, key)
    keys: torch.Tensor  # [C, T, D] fp32: the layer's keys averaged over heads
    has_cls: bool  # token 0 of every crop is a CLS token (CLIP); SigLIP has none
    prompt_len: int  # N: the prompt's tokens, its image blocks as the processor expanded them
    image_tokens: int  # this image's tokens (every crop's patches that are shown, newline tokens included)
    prompt_image_tokens: int | None = None  # every image's tokens in the prompt (None: this is its only image)
    merged: bool = False  # the crop's tokens are the language model's own image tokens (Qwen's merged 2x2 groups:
    # attention and keys pooled over each group): a plan weighs them directly (`VisionPlan.projected`)
    cls_attention: torch.Tensor | None = None  # [C, T] fp32: the attention a CLS token the crop's tokens leave out
    # pays each of them (InternVL: the CLS token's attention pooled over each pixel-shuffle group), which ranks
    # them where the tower has a CLS token that is not one of the crop's tokens (None: `attention` ranks them)

    def image_part(self, wanted: int) -> int:
        """This image's part of `wanted` image tokens asked for the whole prompt: in proportion to its tokens (all
        of it when it is the prompt's only image), so every image and frame is reduced alike."""
        total = self.prompt_image_tokens or self.image_tokens
        return wanted if total == self.image_tokens else int(round(wanted * self.image_tokens / total))

    def wanted(self, kept_image_tokens) -> int:
        """This image's image tokens to feed, from a policy's `kept_image_tokens(prompt_len, image_tokens)` rule
        applied to the whole prompt."""
        return self.image_part(kept_image_tokens(self.prompt_len, self.prompt_image_tokens or self.image_tokens))

    @property
    def num_crops(self) -> int:
        return int(self.attention.shape[0])

    @property
    def tokens_per_crop(self) -> int:
        return int(self.attention.shape[1])


@dataclass
class CropMerge:
    """The output tokens of one crop: output k = Σ_t weights[k, t] · feature_t over the crop's feature-layer
    tokens (CLS included when there is one); `kinds[k]` says what it is (one of KINDS). `anchors[k]`: the crop
    token output k stands at (a contextual token's anchor; None: each output's first source), which gives it its
    position where tokens carry their own (Qwen's 3-D positions)."""

    weights: torch.Tensor  # [K, T] fp32
    kinds: list[str]
    anchors: list[int] | None = None

    def __post_init__(self):
        if self.weights.shape[0] != len(self.kinds) or any(k not in KINDS for k in self.kinds):
            raise ValueError(f"CropMerge needs one kind ({', '.join(KINDS)}) per output token")

    def sources(self, k: int) -> np.ndarray:
        """The crop tokens output k is made from."""
        return self.weights[k].nonzero().flatten().cpu().numpy()

    def anchor(self, k: int) -> int:
        """The crop token output k stands at."""
        return int(self.anchors[k]) if self.anchors is not None else int(self.sources(k)[0])


@dataclass
class VisionPlan:
    """One `CropMerge` per crop, in the crops' order. `projected`: the weights apply to the projector's outputs
    (pooling the language model's image features, Downsample) instead of the feature layer's (VisionZip)."""

    crops: list[CropMerge]
    projected: bool = False


@dataclass
class ImageTokenSources:
    """What each image token the language model saw stands for. `cells[k]`: the prompt's original image tokens
    (indices into its image block) that LM image token k covers: one for a dominant patch token, every merged
    patch for a contextual one, every patch of its block for a pooled one (a diverse token: one, as a dominant), none for a CLS token (or a patch in
    anyres padding)."""

    kinds: list[str]
    cells: list[np.ndarray]
    original_tokens: int  # image tokens of the prompt as the processor expanded it
    crops: int = 1
    counts: dict[str, int] = field(default_factory=dict)  # kind -> LM image tokens of that kind
    positions: np.ndarray | None = None  # where LM image token k sits in the prompt fed (None: from the first on)
    images: np.ndarray | None = None  # which of the prompt's images LM image token k came from (None: all the first)
    resized: list | None = None  # the images resized before the tower: each one's (width, height) (None: not)

    @property
    def tokens(self) -> int:
        return len(self.kinds)

    def project(self, share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """share [LM image tokens] (e.g. the share of KV heads that hold each) -> (kept, merged), each
        [original image tokens]: a dominant token's share on its own patch; a contextual or pooled token's on every
        patch merged into it. A patch gets the largest share of the tokens that cover it."""
        kept = np.zeros(self.original_tokens, dtype=np.float32)
        merged = np.zeros(self.original_tokens, dtype=np.float32)
        for kind, cells, s in zip(self.kinds, self.cells, share):
            if cells.size == 0 or kind == "cls":
                continue
            target = kept if kind in KEPT_AS_IS else merged
            target[cells] = np.maximum(target[cells], float(s))
        return kept, merged

    def fed_facts(self) -> list[Fact]:
        """How many image tokens the language model was fed, and their share of the prompt's (R, the share
        kept): what every vision-side reduction's panel shows first."""
        return [Fact("image_fed", "image tokens fed to the language model", self.tokens, fmt="d",
                     unit=f" of {self.original_tokens}"),
                Fact("image_kept_share", "R, the share of the image tokens kept", self.tokens / max(1, self.original_tokens),
                     fmt=".0%")]


def join_records(records: list[tuple[ImageTokenSources, int]], positions: np.ndarray) -> ImageTokenSources:
    """One record for the prompt's images: each image's (video's) cells shifted past the images before it, and
    each LM token's image (frame) counted among them all."""
    kinds, cells, images, offset, pictures = [], [], [], 0, 0
    for rec, count in records:
        kinds += rec.kinds
        cells += [c + offset for c in rec.cells]
        images.append(rec.images + pictures)
        offset += rec.original_tokens
        pictures += count
    counts = {kind: kinds.count(kind) for kind in KINDS}
    return ImageTokenSources(kinds, cells, offset, sum(rec.crops for rec, _ in records), counts, positions,
                             np.concatenate(images))
