"""SparseVLM: the question's own tokens rate the image tokens at three depths; the least rated leave, a few recycled.

Paper: Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model Inference",
ICML 2025, https://arxiv.org/abs/2410.04417 (reference code: https://github.com/Gumpest/SparseVLMs, its v1.5).

A prefill token reduction in stages (`prefill_token_drops`). Before the first layer runs, the raters are chosen from
the prompt as the language model reads it (its input embeddings): every image token's similarities to the text
after the first image are turned into a softmax over that text, averaged over the image tokens, and the text tokens
above the average rate (the reference's `m > m.mean()`). After each pruning layer (LLaVA-1.5's 32 layers: 2, 6 and
15; scaled to the model's depth) the image tokens still in are ranked by the attention the raters pay them in that
layer (averaged over heads and raters) and the best of the stage's count go on. Of those left behind, the best
30 % (+1) are recycled: clustered by density peaks over k nearest neighbours (DPC-kNN, about one cluster per 10
of them) on the layer's output, each cluster going on as one token, the mean of its members. Recycled tokens are
image tokens: a later stage may drop or recycle them again. Text and generated tokens are all kept.

The counts are the reference's: of 576 image tokens, 300, 200, 110 at "192 tokens"; 303, 110, 36 at 128;
238, 48, 26 at 96; 66, 30, 17 at 64 (its RETAIN_TOKN, the image tokens per layer on average).

Where this tool departs (docs/methods.md):
- between and beyond the four published settings the counts are interpolated linearly (as shares of the image
  tokens, at the settings' 192/576 ... 64/576; every token at 1, none at 0), scaled to the prompt's image tokens;
- the budget r is, by default, the prompt's cache averaged over layers (`budget_of = cache`: the largest setting
  whose layers hold at most r·N entries on average, recycled tokens counted); `budget_of = image`: r is the
  setting's share of the image tokens (1/3 is the reference's 192 of 576);
- a stage that would keep every image token keeps them all (the reference always drops at least one), so r = 1 is
  Full;
- kept and recycled tokens keep their true positions (the reference renumbers them after each stage); a recycled
  token stands at its cluster's centre, the centre's position and place in the sequence (the reference puts the
  recycled tokens after the kept image tokens);
- the density ties the reference breaks with a random 1e-6 go to the earlier token;
- with several images or a video, their image tokens are ranked together, the raters are the text after the
  first image.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.attention import StatRequest
from .base import Fact, Policy, PolicyError, PolicyState, Prefilled, PrefillView, Recycled, TokenDrop, knob
from .image_budget import BUDGET_OF

REFERENCE_LAYERS = 32
PRUNING_LAYERS = (2, 6, 15)  # of LLaVA-1.5's 32
# the reference's image tokens kept at each pruning layer, of 576, per setting (image tokens per layer on average)
SETTINGS = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}
REFERENCE_IMAGE_TOKENS = 576
RECYCLE_SHARE = 0.3  # of the tokens a stage leaves behind, the best-rated share recycled (+1)
CLUSTER_SHARE = 0.1  # clusters per recycled token (+1)
BUDGET_OF_HELP = ("what the budget r sets. cache: the prompt's KV cache averaged over layers (the largest setting "
                  "whose layers hold at most r·N entries on average, as for every method); image: the image tokens "
                  "per layer on average, as a share (the paper's 192, 128 or 64 of 576: r = 1/3, 2/9, 1/9)")


def pruning_layers(num_layers: int) -> list[int]:
    """The layers after which image tokens leave: the reference's 2, 6, 15 of 32 scaled to `num_layers` (distinct,
    each before the last layer)."""
    if num_layers < 2:
        return []
    return sorted({min(num_layers - 2, round(k * num_layers / REFERENCE_LAYERS)) for k in PRUNING_LAYERS})


def stage_shares(setting: float) -> list[float]:
    """The share of the image tokens each of the three stages keeps at `setting` (image tokens per layer on
    average, as a share of them): the published settings' counts, interpolated linearly between them, towards
    every token at 1 and none at 0."""
    nodes = [(0.0, (0.0, 0.0, 0.0))]
    nodes += [(tokens / REFERENCE_IMAGE_TOKENS, tuple(c / REFERENCE_IMAGE_TOKENS for c in counts))
              for tokens, counts in sorted(SETTINGS.items())]
    nodes.append((1.0, (1.0, 1.0, 1.0)))
    x = min(1.0, max(0.0, float(setting)))
    for (x0, y0), (x1, y1) in zip(nodes, nodes[1:]):
        if x <= x1:
            t = (x - x0) / (x1 - x0)
            return [a + t * (b - a) for a, b in zip(y0, y1)]
    return [1.0, 1.0, 1.0]


def recycled_count(left_behind: int) -> tuple[int, int]:
    """(tokens recycled, clusters they make) of the `left_behind` image tokens a stage drops: the reference's
    int(0.3·n) + 1 and int(m / 10) + 1, neither more than it has."""
    if left_behind <= 0:
        return 0, 0
    recycled = min(left_behind, int(RECYCLE_SHARE * left_behind) + 1)
    return recycled, min(recycled, int(recycled * CLUSTER_SHARE) + 1)


@dataclass
class Stage:
    after_layer: int  # the pruning layer whose raters' attention ranks the image tokens
    kept: int  # image tokens kept by rating
    recycled: int  # of the others, the ones clustered
    clusters: int  # the tokens those make

    @property
    def image_out(self) -> int:
        return self.kept + self.clusters


def stages_for(image_tokens: int, setting: float, layers: list[int], recycle: bool = True) -> list[Stage]:
    """Each stage's counts over `image_tokens`: its share of them (at most the image tokens still in), and the
    tokens recycled of those it leaves behind. A stage keeping every token still in drops nothing."""
    out, held = [], image_tokens
    for layer, share in zip(layers, stage_shares(setting)):
        kept = min(held, int(round(share * image_tokens)))
        recycled, clusters = recycled_count(held - kept) if recycle else (0, 0)
        out.append(Stage(layer, kept, recycled, clusters))
        held = kept + clusters
    return out


def mean_cache(prompt_len: int, image_tokens: int, stages: list[Stage], num_layers: int) -> float:
    """The prompt's entries per layer averaged over the layers: layers up to the first pruning layer hold every
    token, each later one what the last stage before it let through."""
    text, total, held, at = prompt_len - image_tokens, 0, image_tokens, 0
    for stage in stages:
        total += (stage.after_layer + 1 - at) * (text + held)
        at, held = stage.after_layer + 1, stage.image_out
    return (total + (num_layers - at) * (text + held)) / num_layers


def setting_for(budget: float, prompt_len: int, image_tokens: int, layers: list[int], num_layers: int,
                recycle: bool = True, steps: int = 2000) -> float:
    """The largest setting (on a grid of 1/`steps`) whose layers hold at most r·N entries on average (0 when none
    does)."""
    for k in range(steps, -1, -1):
        x = k / steps
        if mean_cache(prompt_len, image_tokens, stages_for(image_tokens, x, layers, recycle), num_layers) \
                <= budget * prompt_len + 1e-9:
            return x
    return 0.0


def text_raters(embeds: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
    """One row: embeds [N, D], is_image bool [N] -> bool [N] the raters: of the text after the first image token,
    those whose softmax share (over that text) of an image token's similarity, averaged over the image tokens, is
    above that average's mean. Without text after the image, the last token rates alone."""
    raters = torch.zeros_like(is_image)
    image = is_image.nonzero().flatten()
    if image.numel() == 0:
        return raters
    text = (~is_image).nonzero().flatten()
    text = text[text > image[0]]
    if text.numel() == 0:
        raters[-1] = True
        return raters
    relevance = torch.softmax(embeds[image].float() @ embeds[text].float().T, dim=-1).mean(dim=0)
    raters[text[relevance > relevance.mean()]] = True
    return raters


def density_peak_clusters(x: torch.Tensor, clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN over the rows of x [M, D]: (centres [C] indices, assignment [M] of each row to a centre's place in
    `centres`). Distances are Euclidean over sqrt(D); a row's density exp(-mean squared distance to its C nearest,
    itself included); its separation the distance to the nearest denser row (the largest distance for the densest;
    ties of density go to the earlier row); the C rows with the largest density x separation are the centres, and
    each row joins the nearest (a centre its own)."""
    m, d = x.shape
    c = max(1, min(clusters, m))
    dist = torch.cdist(x.float(), x.float()) / d ** 0.5
    nearest = dist.topk(c, dim=-1, largest=False).values
    density = torch.exp(-(nearest ** 2).mean(dim=-1))
    rank = torch.empty(m, dtype=torch.long)
    rank[torch.argsort(-density, stable=True)] = torch.arange(m)
    denser = rank[None, :] < rank[:, None]  # [i, j]: j is denser than i
    separation = torch.where(denser, dist, torch.full_like(dist, float("inf"))).amin(dim=-1)
    separation = torch.where(torch.isinf(separation), dist.max(), separation)
    centres = torch.argsort(separation * density, descending=True, stable=True)[:c]
    assignment = dist[:, centres].argmin(dim=-1)
    assignment[centres] = torch.arange(c)
    return centres, assignment


def stage_choice(scores: torch.Tensor, is_image: torch.Tensor, hidden: torch.Tensor, stage: Stage
                 ) -> tuple[torch.Tensor, Recycled | None]:
    """One stage over the tokens still in: scores [B, M] (the raters' attention), is_image [B, M], hidden
    [B, M, D] (the pruning layer's output) -> (bool [B, M] the tokens going on: every text token, the `kept` best
    rated image tokens, and each cluster's centre; the clusters of the `recycled` best rated of the others)."""
    b, m = is_image.shape
    mask = ~is_image.clone()
    slots, members = [], []
    for r in range(b):
        image = is_image[r].nonzero().flatten()
        order = image[torch.argsort(scores[r, image].float(), descending=True, stable=True)]
        mask[r, order[:stage.kept]] = True
        if stage.clusters:
            chosen = order[stage.kept:stage.kept + stage.recycled]
            centres, assignment = density_peak_clusters(hidden[r, chosen].float(), stage.clusters)
            mask[r, chosen[centres]] = True
            slots.append(chosen[centres])
            member = torch.zeros(len(centres), m, dtype=torch.bool)
            member[assignment, chosen] = True
            members.append(member)
    if not slots:
        return mask, None
    return mask, Recycled(torch.stack(slots), torch.stack(members))


@dataclass
class SparseVLMState(PolicyState):
    setting: float = 1.0  # image tokens per layer on average, as a share of them (the reference's RETAIN_TOKN/576)
    image_tokens: int = 0
    stages: list[Stage] = field(default_factory=list)


@dataclass(frozen=True)
class SparseVLMPolicy(Policy):
    """SparseVLM: text raters chosen from the prompt's embeddings rank the image tokens after three layers; the
    least rated leave the forward, the best of those recycled into merged tokens. Paper: "SparseVLM: Visual Token
    Sparsification for Efficient Vision-Language Model Inference" (Zhang et al., ICML 2025),
    https://arxiv.org/abs/2410.04417"""

    name = "sparsevlm"
    label = "SparseVLM"
    summary = ("Prefill token reduction in three stages: the text tokens most relevant to the image rate the image "
               "tokens after layers 2, 6 and 15 (of 32); the least rated are dropped and the best of those merged "
               "into a few recycled tokens. Text and generated tokens are all kept.")
    colour = "#00897B"
    schedule = "prompt only"
    stage = "prefill token reduction"
    control = "random_drop"

    budget_of: str = knob("cache", help=BUDGET_OF_HELP, choices=BUDGET_OF, label="budget of")
    recycle: bool = knob(True, help="merge the best rated of the dropped image tokens into a few recycled ones "
                                    "(the reference's v1.5; off: they are dropped, as in its later SparseVLM+)")

    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest(rated=True)

    def choose_raters(self, embeds: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        return torch.stack([text_raters(e, f) for e, f in zip(embeds, is_image)])

    def plan(self, prompt_len: int, is_image: torch.Tensor, num_layers: int) -> SparseVLMState:
        """The setting and each stage's counts for this prompt (the same in every row: one prompt format)."""
        state = SparseVLMState(image_tokens=int(is_image[0].sum()))
        layers = pruning_layers(num_layers)
        if self.budget_of == "image":
            state.setting = float(self.budget)
        else:
            state.setting = setting_for(self.budget, prompt_len, state.image_tokens, layers, num_layers, self.recycle)
        state.stages = stages_for(state.image_tokens, state.setting, layers, self.recycle)
        reached = mean_cache(prompt_len, state.image_tokens, state.stages, num_layers)
        if self.budget_of == "cache" and reached > self.budget * prompt_len + 1e-9:
            state.notes.append(f"its fewest image tokens hold {reached / prompt_len:.0%} of the cache, not "
                               f"r = {self.budget:.0%}")
        return state

    def choose(self, stats, kept: torch.Tensor, hidden: torch.Tensor, is_image: torch.Tensor, stage: Stage):
        rated = stats.get(stage.after_layer, {}).get("rated")
        if rated is None:
            raise PolicyError("SparseVLM ranks the image tokens by its raters' attention, recorded by its own prefill "
                              "(runner.own_prefill)")
        if rated.shape[-1] != kept.shape[1]:
            raise PolicyError(f"layer {stage.after_layer} recorded {rated.shape[-1]} tokens, {kept.shape[1]} are "
                              "still in")
        # a recycled token is an image token: its centre's flag
        return stage_choice(rated.float().mean(dim=1), is_image.gather(1, kept), hidden, stage)

    def prefill_token_drops(self, prompt_len: int, is_image: torch.Tensor, num_layers: int,
                            frames=None) -> list[TokenDrop]:
        state = self.plan(prompt_len, is_image, num_layers)
        return [TokenDrop(stage.after_layer + 1,
                          lambda stats, kept, hidden, stage=stage: self.choose(stats, kept, hidden, is_image, stage),
                          reads_hidden=True, recycles=self.recycle)
                for stage in state.stages if state.image_tokens and not _keeps_all(state, stage)]

    def prefill(self, view: PrefillView) -> Prefilled:
        """Its own prefill left the dropped tokens behind: nothing more to plan. A cache whose layers hold every
        token (not its own prefill's) cannot be given the recycled tokens: it is left whole, and the panel says so."""
        is_image = view.layer(0).is_image[:, 0]
        state = self.plan(view.prompt_len, is_image, view.num_layers)
        if any(not _keeps_all(state, s) for s in state.stages) and \
                view.layer(view.num_layers - 1).length >= view.prompt_len:
            state.notes.append("this cache holds every token in every layer: SparseVLM's stages run in its own "
                               "prefill, so nothing was dropped")
        return Prefilled([None] * view.num_layers, state)

    def facts(self, state: PolicyState) -> list[Fact]:
        out = super().facts(state)
        if isinstance(state, SparseVLMState) and state.image_tokens and state.stages:
            out.append(Fact("stage_layers", "image tokens rated after layers",
                            ", ".join(str(s.after_layer) for s in state.stages)))
            out.append(Fact("setting", "image tokens per layer on average", round(state.setting, 4), fmt=".0%",
                            unit=" of them"))
            out.append(Fact("image_kept", "image tokens each stage lets through",
                            " → ".join(map(str, [state.image_tokens, *(s.image_out for s in state.stages)]))))
            out.append(Fact("recycled", "recycled tokens made", sum(s.clusters for s in state.stages), fmt="d",
                            unit=f" of {sum(s.recycled for s in state.stages)} merged"))
        return out


def _keeps_all(state: SparseVLMState, stage: Stage) -> bool:
    """Whether `stage` lets every image token still in through as it is (nothing dropped, nothing recycled)."""
    held = state.image_tokens
    for s in state.stages:
        if s is stage:
            return s.kept >= held and not s.clusters
        held = s.image_out
    return True
