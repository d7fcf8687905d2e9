"""Downsample: the language model sees the image on a coarser grid, a control that says whether a token-selection
method beats plain downsampling.

Paper: Liao et al., "Are We Using the Right Benchmark: An Evaluation Framework for Visual Token Compression
Methods" (VTC-Bench), 2025, https://arxiv.org/abs/2510.07143, which finds that simple image downsampling beats
many visual token compression methods.

Where the image is made coarser is the knob `where`:

- `image` (the default where the family's token count follows the image size: LLaVA-NeXT and OneVision's anyres
  tiles, Qwen-VL's native resolution), as the benchmark draws it: every image is resized before the vision tower,
  scaled on both sides so that the processor makes the most tokens not above its share of the budget, and the
  prompt is re-encoded with the smaller images (`decoding.image_resize`); the model reads it by its own path. A video
  Qwen2-VL or Qwen2.5-VL reads natively has every frame scaled alike (OneVision's native video is pooled instead).
- `projector_out` (the default on fixed-resolution towers, LLaVA-1.5, Interleave and the embedded model, where a
  smaller image is resized back to the tower's input and changes nothing): a prefill token reduction through the
  same extension point as VisionZip (`vision_plan`): every crop the tower encodes has its side x side patch grid
  average-pooled to side' x side' (adaptive average pooling's bins) after the projector, so the language model gets
  side'² tokens per crop instead of the crop's patches.
- `projector_in`: the same pooling of the tower's feature layer, before the projector.

On InternVL (`decoding.internvl_vision`) a crop is a tile, and its grid is the tile's square grid of image tokens
(each a pixel-shuffled 2x2 block of patches): `projector_out` pools the model's image tokens, `projector_in` the
pixel-shuffled vectors the projector reads.

Nothing is evicted afterwards; generated tokens are all kept.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..models.embedded import EMBEDDED_SLUG
from .base import Fact, Policy, PolicyState, Prefilled, PrefillView, ResolveContext, knob, note
from .image_budget import BUDGET_OF, fed_image_tokens
from .reduction import CropMerge, ImageTokenSources, VisionCrops, VisionPlan

BUDGET_OF_HELP = ("what the budget r is a share of. cache: the prompt's KV cache (text included), as for every "
                  "method; image: the prompt's image tokens (the paper's convention)")


WHERE = ("auto", "image", "projector_out", "projector_in")
WHERE_HELP = ("where the image is made coarser. image: resized before the vision tower, for about r' of its "
              "tokens (anyres and native-resolution families); projector_out: each crop's projected patch grid "
              "average-pooled; projector_in: the tower's feature grid pooled before the projector; auto: image where "
              "the family's token count follows the image size, else projector_out")


def where_for(family: str) -> str:
    """`where` for `auto` on a family (a key of FAMILY_INFO; "" unknown): `image` where a smaller image is fewer
    tokens, else `projector_out`."""
    from ..models.families import FAMILY_INFO

    info = FAMILY_INFO.get(family)
    return "image" if info is not None and info.token_count_follows_image_size else "projector_out"


EMBEDDED_NOTE = ("on the embedded model, pooling erases the image: its image tokens carry the words of a grid of "
                 "phrases, and a bin's mean is nearest to the fill word (98 % of an 8x8 grid's tokens; 1 % of a scene's "
                 "colour, shape and printed words survive), so it answers near chance (24 % of the scene questions "
                 "with 44 % of the image tokens fed, Full 99 %; docs/methods.md, Downsample on the embedded model)")


def pool_bins(side: int, out: int) -> list[tuple[int, int]]:
    """The [start, stop) rows (or columns) each of `out` pooled rows averages over a grid of `side`: adaptive average
    pooling's bins, floor(i·side/out) to ceil((i+1)·side/out)."""
    return [(i * side // out, -(-(i + 1) * side // out)) for i in range(out)]


def pool_weights(side: int, out: int, has_cls: bool) -> torch.Tensor:
    """[out², T] pooled token (row-major over the out x out grid) -> the mean of its bin's patches, over a crop's
    T = side² tokens (+ a CLS token first, weight 0)."""
    first = int(has_cls)
    weights = torch.zeros(out * out, side * side + first)
    bins = pool_bins(side, out)
    for a, (r0, r1) in enumerate(bins):
        for b, (c0, c1) in enumerate(bins):
            cells = [first + r * side + c for r in range(r0, r1) for c in range(c0, c1)]
            weights[a * out + b, cells] = 1.0 / len(cells)
    return weights


def pooled_side(wanted: int, crops: int, side: int) -> int:
    """The pooled grid's side for about `wanted` image tokens over `crops` crops: round(sqrt(wanted / crops)), in
    [1, side] (one crop: round(sqrt(r')·side) for a share r' = wanted / side² of its patches)."""
    return max(1, min(side, int(round(math.sqrt(max(wanted, 0) / crops)))))


@dataclass
class DownsampleState(PolicyState):
    image_tokens: int = 0  # in the prompt
    sources: ImageTokenSources | None = None  # what the language model's image tokens stand for (None: unreduced)
    pooled: int = 0  # the side of every crop's pooled grid
    resized: list = field(default_factory=list)  # `image`: every image's (width, height) as the tower saw it


@dataclass(frozen=True)
class DownsamplePolicy(Policy):
    """Downsample: every crop's patch grid average-pooled to a smaller grid after the projector, so the language
    model sees about r of the image tokens. Paper: "Are We Using the Right Benchmark: An Evaluation Framework for
    Visual Token Compression Methods" (Liao et al., 2025, VTC-Bench), https://arxiv.org/abs/2510.07143"""

    name = "downsample"
    control = None
    is_control = True
    label = "Downsample"
    summary = ("A control: the image resized before the vision tower (anyres and native-resolution families) or "
               "each crop's patch grid average-pooled (side ≈ √r'·side), so the language model sees fewer image "
               "tokens, none chosen by importance. Prompt only.")
    colour = "#BCBD22"  # olive
    schedule = "prompt only"
    stage = "prefill token reduction"

    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF)
    where: str = knob("auto", help=WHERE_HELP, choices=WHERE)
    model_slug: str = field(default="", kw_only=True)  # not a knob: set by `resolve`, for the embedded model's note

    def resolve(self, context: ResolveContext) -> "DownsamplePolicy":
        where = where_for(context.family) if self.where == "auto" else self.where
        return dataclasses.replace(self, model_slug=context.model_slug, where=where)

    @property
    def resizes_image(self) -> bool:
        """Whether the prompt's images are resized before the tower (`where = image`) instead of pooled."""
        return self.where == "image"

    def pooling_instead(self) -> "DownsamplePolicy":
        """This policy pooling the projected grid (for what cannot be resized: a native video's frames)."""
        return dataclasses.replace(self, where="projector_out")

    def kept_image_tokens(self, prompt_len: int, image_tokens: int) -> int:
        """Image tokens asked for: `cache`, r·N minus the text; `image`, r of the image tokens."""
        return fed_image_tokens(self.budget, self.budget_of, prompt_len, image_tokens)

    def vision_plan(self, crops: VisionCrops) -> VisionPlan | None:
        if self.where == "image":
            return None  # the image is resized before the tower instead (the session's prefill), never pooled
        has_cls = bool(crops.has_cls)
        side = math.isqrt(crops.tokens_per_crop - int(has_cls))
        if side * side != crops.tokens_per_crop - int(has_cls):
            raise ValueError(f"a crop of {crops.tokens_per_crop} tokens is not a square patch grid")
        wanted = crops.wanted(self.kept_image_tokens)
        out = pooled_side(wanted, crops.num_crops, side)
        if out >= side or crops.num_crops * out * out >= crops.image_tokens:
            return None  # no fewer tokens than the model's own path feeds: nothing to pool
        weights = pool_weights(side, out, has_cls)
        return VisionPlan([CropMerge(weights, ["pooled"] * (out * out)) for _ in range(crops.num_crops)],
                          projected=self.where != "projector_in")

    def prefill(self, view: PrefillView) -> Prefilled:
        sources = view.reduction if isinstance(view.reduction, ImageTokenSources) else None
        fed = int(view.layer(0).is_image[0, 0].sum())
        state = DownsampleState(image_tokens=sources.original_tokens if sources else fed, sources=sources)
        if sources is None:
            state.notes.append("every image token is kept at this budget" if fed else "no image: nothing to pool")
            return Prefilled([None] * view.num_layers, state)
        resized = getattr(view.reduction, "resized", None)
        if resized:
            state.resized = list(resized)
        else:
            state.pooled = math.isqrt(sources.tokens // sources.crops)
        if self.model_slug.startswith(EMBEDDED_SLUG):
            state.notes.append(EMBEDDED_NOTE)
        full_prompt = view.prompt_len - sources.tokens + sources.original_tokens
        wanted = self.kept_image_tokens(full_prompt, sources.original_tokens)
        if wanted < sources.tokens:
            how = (f"the image resized to {_sizes(state.resized)}" if state.resized
                   else f"{state.pooled}x{state.pooled} per crop")
            state.notes.append(f"{sources.tokens} image tokens fed ({how}) where r = "
                               f"{self.budget:.0%} asks for {max(0, wanted)}")
        return Prefilled([None] * view.num_layers, state)

    def image_token_sources(self, state: PolicyState | None) -> ImageTokenSources | None:
        return state.sources if isinstance(state, DownsampleState) else None

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, DownsampleState) and state.sources is not None:
            s = state.sources
            out += s.fed_facts()
            if state.resized:
                out.append(Fact("grid", "image resized to", _sizes(state.resized)))
                out.append(note("image resizing: each image scaled before the vision tower, the prompt re-encoded "
                                "with fewer image tokens"))
                return out
            crops = f" per crop, {s.crops} crops" if s.crops > 1 else ""
            out.append(Fact("grid", "pooled grid", f"{state.pooled}x{state.pooled}{crops}"))
            what = "feature grid pooled before the projector" if self.where == "projector_in" else \
                "projected patch grid average-pooled"
            out.append(note(f"grid pooling: the {what}; the vision tower sees the image at its own resolution"))
        return out


def _sizes(sizes) -> str:
    return ", ".join(f"{w}x{h}" for w, h in sizes)
