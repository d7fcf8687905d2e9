"""Random drop: from layer K on, a uniformly drawn share of the image tokens is gone; the chance control of the
methods that drop image tokens (FastV, DART, VisionZip, Downsample).

Paper: Peng et al., "Can Visual Input Be Compressed? A Visual Token Compression Benchmark for Large Multimodal
Models" (UniPruneBench), 2025, https://arxiv.org/abs/2511.02650, whose random baseline (as LightCompress's)
drops image tokens only, one draw that every later layer shares.

It is FastV's own prefill with the ranking replaced by a draw: layers 0 … K-1 see every token, and from layer K
on only the drawn image tokens go on (text tokens all stay), so those layers' caches never hold the others. The
budget maps as FastV's (`budget_of`: the cache averaged over layers, or the share of image tokens). The draw
comes from the comparison's seed and the request (`ResolveContext.request`: its prompt, images and frames), so
every question gets its own draw, and the same request and seed the same one, batched or alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .base import Fact, PolicyState, ResolveContext, draw_seed, knob
from .fastv import FastVState, ImageDropPolicy, fastv_keep


def image_draw(seed: int, n: int) -> torch.Tensor:
    """[n] uniform noise in [0, 1) from a CPU generator seeded with `seed` (the same on every device)."""
    return torch.rand(n, generator=torch.Generator(device="cpu").manual_seed(int(seed)))


@dataclass
class RandomDropState(FastVState):
    seed: int = 0  # the draw's seed (the comparison's and the request's)


@dataclass(frozen=True)
class RandomDropPolicy(ImageDropPolicy):
    """Random drop: after layer K a uniform random draw of the image tokens goes on, the rest are dropped for every
    later layer (the image-token control). Paper: "Can Visual Input Be Compressed? A Visual Token Compression
    Benchmark for Large Multimodal Models" (Peng et al., 2025, UniPruneBench), https://arxiv.org/abs/2511.02650"""

    name = "random_drop"
    label = "Random drop"
    summary = ("A control: after the first K layers a uniformly drawn share of the image tokens is dropped from every "
               "later layer (text tokens stay), one draw per request from the comparison's seed; the chance line "
               "for FastV, DART, VisionZip and Downsample.")
    colour = "#B0B0B0"  # a lighter grey than Random's: the other chance line
    control = None
    is_control = True
    draws_at_random = True

    layer: int = knob(2, help="K: layers 0 … K-1 see every token; layers K and later never see the image tokens "
                              "the draw leaves out (2, as FastV's and DART's default)", low=1, high=1024, integer=True)
    # not knobs, set by `resolve`: the comparison's seed and the request's fingerprint
    seed: int = field(default=0, kw_only=True)
    request: int = field(default=0, kw_only=True)

    def resolve(self, context: ResolveContext) -> "RandomDropPolicy":
        return dataclasses.replace(self, seed=int(context.seed), request=int(context.request))

    def new_state(self) -> RandomDropState:
        return RandomDropState(layer=self.layer, rank="random", seed=draw_seed(self.seed, self.request))

    def choose(self, stats: dict[int, dict[str, torch.Tensor]], is_image: torch.Tensor, keep: int,
               state: PolicyState | None = None) -> torch.Tensor:
        noise = image_draw(draw_seed(self.seed, self.request), is_image.shape[-1]).to(is_image.device)
        return fastv_keep(noise.expand(is_image.shape[0], -1), is_image, keep)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, RandomDropState):
            out.append(Fact("seed", "draw", state.seed, fmt="d",
                            unit=f" (seed {self.seed} and this request; one draw for layers {state.layer}+)"))
        return out
