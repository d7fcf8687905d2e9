"""What every KV-cache policy is, and the helpers they share.

A policy is frozen configuration: a registry name, its colour and description, and its knobs (declared
with `knob(...)`, validated when the policy is built). Two functions over tensors do the work:
`prefill(view)` returns one `LayerPlan` per layer after the prompt together with the run's state (what
this run found: capacities, thresholds, anchors, notes); `decode(view, state)` may return plans after each
generated token (or after a follow-up turn's tokens). `facts(state)` says, typed, what to show about the
run. How many entries each layer keeps and which ones are small pieces shared by the methods
(allocation.py, scoring.py). Policies never touch the model; the engine applies plans to the
`TrackedCache` (gather, merge, quantise), so all bookkeeping lives in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import torch

from ..kv.attention import StatRequest
from ..kv.cache import TrackedCache, TrackedLayer, split_layouts
from ..kv.joint_eviction import drop_ranges, gather_many
from . import scoring
from .facts import Fact, facts_to_extras, note
from .budget import Budget, check_budget
from .knobs import KnobInfo, PolicyError, knob, knob_fields, validate_knobs

__all__ = ["BUDGET_MODES", "STAGES", "ROLES", "EMPTY_SLOT", "PolicyError", "Merge", "Quantise", "LayerPlan", "RangeDrop", "TokenDrop", "PrefillView", "DecodeView", "PolicyState",
           "ResolveContext", "Prefilled", "Policy", "Fact", "note", "knob", "KnobInfo", "Budget", "check_budget",
           "budget_count", "protected_mask", "protected_positions", "plans_by_equal_count", "top_k_keep", "tiered_keep", "drop_range_keep", "fixed_point_decode",
           "layer_importance", "apply_plans", "apply_plans_together"]

# How budgeted methods are compared. "published": each as its paper runs it (prompt-only methods compress the
# prompt once and then let the cache grow). "equal_memory": the prompt-only ones are also held at about r·N_t
# while decoding (see equal_memory.py), so every budgeted method holds the same memory at every step.
BUDGET_MODES = ("published", "equal_memory")

# Where in inference a method saves memory (each policy declares one; the app, the docs and the exports show it):
# "prefill token reduction" methods change the prefill itself, so that some tokens never reach (some layers of)
# the language model, and get a prefill of their own; the others compress the cache of the one shared prefill.
STAGES = ("none", "prefill token reduction", "KV eviction", "KV merging", "quantisation")

# The parts a method may play in a comparison beyond its own panel; at most one registered method plays each, so
# nothing outside the policies names a method:
# "reference": the uncompressed reference that ROUGE-L, speed-ups and KV shares are measured against (Full);
# "lorenz": the method whose per-layer allocation the Lorenz chart draws, with its threshold (PrefixKV);
# "featured": the method this lab studies: its paper's claims are the ones the benchmarks check, and its line is
# drawn thicker in their figures (PrefixKV).
ROLES = ("reference", "lorenz", "featured")

# In a plan's `keep`, an empty slot: head-wise methods that keep different counts per KV head (AdaKV) pad the
# shorter heads with it. The slot holds no entry (true position -1), is masked from attention and costs no bytes.
EMPTY_SLOT = -1


@dataclass
class Merge:
    """Merge entries `src` into `dst` (indices into the layer's current order, [B, 1|Hkv, E])."""

    src: torch.Tensor
    dst: torch.Tensor
    src_weight: torch.Tensor  # [B, 1|Hkv, E]
    self_weight: torch.Tensor  # [B, 1|Hkv, T]
    # [B, 1|Hkv, T] what each entry's weighted sum is divided by; None = the sum of its weights (a weighted
    # mean). LOOK-M's weighted merge divides by the number of merged entries + 1 (its Eq. 12).
    denominator: torch.Tensor | None = None


@dataclass
class Quantise:
    important: torch.Tensor  # bool [B, 1, T_fp] over the full-precision entries
    bits_hi: int = 4
    bits_lo: int = 2
    group_size: int | None = None


@dataclass
class LayerPlan:
    """What to do to one layer: merge first (optional), then keep `keep` ([B, 1|Hkv, K], ascending; EMPTY_SLOT
    entries first pad heads that keep fewer), or quantise."""

    keep: torch.Tensor | None = None
    merge: Merge | None = None
    quantise: Quantise | None = None
    empty_slots: bool = False  # `keep` holds EMPTY_SLOT entries (heads keeping different counts)


class RangeDrop(LayerPlan):
    """A plan that drops entries [start, start + count) of a layer holding `length`, in every head and row (the
    entries after them move up): a fixed-point eviction. Said as a range, the batched step carries it out for
    every row at once from these numbers (`kv/joint_eviction.drop_ranges`); its `keep` indices are made only
    when something reads them."""

    def __init__(self, length: int, start: int, count: int, device: torch.device | str):
        if not (0 <= start and 0 < count and start + count <= length):
            raise ValueError(f"cannot drop [{start}, {start + count}) from {length} entries")
        self.length, self.start, self.count, self.device = length, start, count, torch.device(device)
        self._keep: torch.Tensor | None = None
        super().__init__()

    @property
    def keep(self) -> torch.Tensor:
        if self._keep is None:
            self._keep = drop_range_keep(self.length, self.start, self.count, self.device)
        return self._keep

    @keep.setter
    def keep(self, value: torch.Tensor | None) -> None:
        self._keep = value

    def __repr__(self) -> str:
        return f"RangeDrop(length={self.length}, start={self.start}, count={self.count})"


@dataclass(frozen=True)
class TokenDrop:
    """Tokens an own prefill leaves behind at layer `layer` (FastV, DART; PyramidDrop's stages): when the forward
    reaches layer K, `choose(stats, kept)` says from what the layers before recorded (layer -> statistics) which
    of the tokens still in the forward go on. `kept` [B, M]: those tokens' prompt positions (every position
    before the first stage), the order of their statistics' columns in the layers since the last stage; the
    answer is bool [B, M], the same count in every row. Layers K and later compute those only. `reads_hidden`:
    `choose(stats, kept, hidden)` is also handed the hidden states layer K gets ([B, M, D]), and may answer
    (mask, `Recycled`) to merge some of the tokens into others (SparseVLM), which it says by `recycles`: its cache
    is then not a masked forward's."""

    layer: int
    choose: Callable[..., Any]
    reads_hidden: bool = False
    recycles: bool = False


@dataclass
class Recycled:
    """Tokens a stage makes from others (SparseVLM's recycled clusters): each of `slots` [B, C] (indices among the
    tokens still in before the stage, each one the stage keeps) goes on with the mean of the hidden states of its
    `members` (bool [B, C, M], the same count C in every row) instead of its own, at its own position."""

    slots: torch.Tensor
    members: torch.Tensor


@dataclass
class PrefillView:
    """Read-only facts after the shared prefill."""

    cache: TrackedCache
    stats: dict[int, dict[str, torch.Tensor]]  # layer -> {"colsum", "window", "subset"}: [B, Hkv, N] fp32
    prompt_len: int  # N
    budget: float
    window: int  # observation window used for the "window" statistic
    # what a prefill token reduction did in this method's own prefill (e.g. VisionZip's merge record), else None
    reduction: Any = None

    @property
    def num_layers(self) -> int:
        return len(self.cache.layers)

    def layer(self, i: int) -> TrackedLayer:
        return self.cache.layers[i]

    def importance(self, i: int) -> torch.Tensor:
        """[B, N] layer-wise importance: column sums averaged over heads (fp32)."""
        return self.stats[i]["colsum"].mean(dim=1)


@dataclass
class DecodeView:
    cache: TrackedCache
    true_len: int  # N_t: prompt + everything generated or fed so far
    prompt_len: int
    step: int  # tokens generated so far in this turn
    attention: dict[int, torch.Tensor] | None = None  # layer -> last query's attention [B, Hkv, T], if asked
    # prompt tokens a prefill token reduction kept from the language model (VisionZip): its positions run
    # N - reduced_by + t, while an uncompressed conversation holds full_len = true_len + reduced_by tokens
    reduced_by: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.cache.layers)

    @property
    def full_len(self) -> int:
        """N_t of the uncompressed conversation: what the budget r is a share of."""
        return self.true_len + self.reduced_by


@dataclass
class PolicyState:
    """What one run of a policy found at prefill and needs while decoding. Methods subclass it with their
    own typed fields; `notes` are sentences worth showing (fallbacks, clamped knobs, budget overruns)."""

    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ResolveContext:
    """What a policy may need to know about the model before a run (e.g. to load calibrated settings)."""

    model_slug: str
    model_name: str
    num_layers: int
    budget: float
    seed: int = 0  # the comparison's seed (`GenerationSettings.seed`), for methods that draw at random
    # a fingerprint of the request (its prompt, images and frames): the methods that draw at random draw from it
    # and the seed together (`draw_seed`), so every question gets a draw of its own and a request its same draw
    request: int = 0
    family: str = ""  # the model's family key (`models.families.FAMILY_INFO`); "" when not known


def draw_seed(seed: int, request: int) -> int:
    """The seed of a random draw for one request: the comparison's seed mixed with the request's fingerprint
    (0: the seed itself)."""
    if not request:
        return int(seed)
    import hashlib

    digest = hashlib.sha256(f"{int(seed)}:{int(request)}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


class Prefilled(NamedTuple):
    """A policy's answer to the prompt: one plan per layer, and the run's state for decoding and facts."""

    plans: list[LayerPlan | None]
    state: PolicyState


@dataclass(frozen=True)
class Policy:
    """Base class. Subclasses are `@dataclass(frozen=True)`, set the class variables, declare their knobs
    with `knob(...)` and implement `prefill` (and `decode` if they act while decoding)."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    colour: ClassVar[str] = ""  # "#rrggbb", used by every chart and panel
    uses_budget: ClassVar[bool] = True
    # "every step": the cache is held at about r·N_t after every token; "prompt only": compress once.
    schedule: ClassVar[str] = "every step"
    stage: ClassVar[str] = "KV eviction"  # one of STAGES: where in inference this method saves memory
    sink_tokens: ClassVar[int] = 1
    roles: ClassVar[tuple[str, ...]] = ()  # any of ROLES this method plays in a comparison
    # the chance control of this method's own kind, which its table lines are read against: the KV-eviction
    # Random for the methods that keep cache entries, the image-token drop for those that drop image tokens;
    # None for a control itself and for the methods no control is drawn for
    control: ClassVar[str | None] = "random"
    is_control: ClassVar[bool] = False
    # its answer depends on a random draw (from the comparison's seed and the request): a comparison may run it
    # several times, each row another draw (`Engine.new_session(draws=N)`), so chance is a spread, not one draw
    draws_at_random: ClassVar[bool] = False
    # knobs the benchmarks also take as a flag of their own, --<method>-<knob> (method_args.add_knob_flags): knob
    # -> what its default, "auto", picks for the model (`auto_knob` picks it)
    flag_knobs: ClassVar[dict[str, str]] = {}
    # the methods this one's paper reports it beats at every budget (the claim benchmarks/quality.py checks for
    # the method that plays the "featured" role)
    claimed_better_than: ClassVar[tuple[str, ...]] = ()

    budget: Budget = 0.3  # a plain number is made a Budget (checked) when the policy is built

    def __post_init__(self):
        object.__setattr__(self, "budget", Budget(self.budget))
        validate_knobs(self)
        self.check()

    def check(self) -> None:
        """Rules that involve several knobs; raise PolicyError naming them."""

    @classmethod
    def auto_knob(cls, knob: str, context: ResolveContext) -> Any:
        """The value of `knob` (one of `flag_knobs`) this method picks for the model in `context`."""
        raise PolicyError(f"{cls.name} picks no value for its {knob!r} knob by itself")

    def resolve(self, context: ResolveContext) -> "Policy":
        """The policy to run for this model and budget (e.g. with calibrated settings filled in)."""
        return self

    # What the shared prefill must record for this policy.
    def prefill_stats(self, prompt_len: int) -> StatRequest:
        return StatRequest()

    # Whether decode steps must record the current query's attention (e.g. H2O's accumulation).
    def decode_needs_attention(self) -> bool:
        return False

    # -- prefill token reduction: a prefill of the method's own ----------------------------------------------
    def own_prefill(self) -> bool:
        """Whether this method changes the prefill itself (stage "prefill token reduction"), so that it runs a
        prefill of its own (`runner.own_prefill`) instead of compressing the shared one; it still decodes in
        the shared batch."""
        return self.stage == "prefill token reduction"

    def prefill_token_drop(self, prompt_len: int, is_image: torch.Tensor, num_layers: int) -> TokenDrop | None:
        """For an own prefill: the tokens that leave the forward after some layer (`TokenDrop`), chosen from what
        the earlier layers recorded (FastV). None: every layer sees every token."""
        return None

    def prefill_token_drops(self, prompt_len: int, is_image: torch.Tensor, num_layers: int,
                            frames: Any = None) -> list[TokenDrop]:
        """For an own prefill: the stages at which tokens leave the forward, by ascending layer (PyramidDrop's
        several; by default the one `prefill_token_drop` gives, if any). `frames` [F, P]: where a video's frames lie
        among the prompt's image tokens (`ImageLayout.frame_tokens`: column j the same patch of every frame), None
        without one (DyCoke compares frames)."""
        drop = self.prefill_token_drop(prompt_len, is_image, num_layers)
        return [] if drop is None else [drop]

    def decode_attention_layers(self, state: PolicyState | None) -> tuple[int, ...] | None:
        """With `decode_needs_attention`: the layers whose attention a decode step must record for this row (None:
        every layer's, as H2O accumulates them); a step records no layer nobody asked for."""
        return None

    def step_subset(self, state: PolicyState, cache: TrackedCache):
        """For a decode step: (L, choose) when layers L and later should attend to a subset of this row's entries
        that step (DyCoke's dynamic pruning): choose(attention [R, Hkv, T]), handed the new token's attention in
        layer L - 1 (R: the rows the cache holds), answers bool [R, n] over their n entries. Needs
        `decode_needs_attention`. None: every entry."""
        return None

    def prefill_sparsity(self, prompt_len: int):
        """For an own prefill: a `kv.sparse_prefill.SparsePrefill` when the prefill's attention should run on each
        layer's important tokens only (ZipVL), else None (dense attention)."""
        return None

    def choose_raters(self, embeds: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        """For an own prefill asking for the "rated" statistic (`StatRequest.rated`): the queries whose attention it
        sums (bool [B, N]), chosen from the prompt as the language model reads it (embeds [B, N, D] fp32, the
        first layer's input; is_image [B, N]) before any layer runs (SparseVLM's text raters)."""
        raise PolicyError(f"{self.name} asks for the rated statistic but chooses no raters")

    def vision_plan(self, crops):
        """For an own prefill with an image: how to shrink each crop's vision features before the language model
        sees them (`reduction.VisionPlan`, from the crops' `reduction.VisionCrops`), or None to feed the image as
        the model's own path encodes it (VisionZip)."""
        return None

    def image_token_sources(self, state: PolicyState | None):
        """When the language model saw other image tokens than the prompt's (a vision-side reduction): what each of
        its image tokens stands for (`reduction.ImageTokenSources`), for the kept-patch overlay. None otherwise."""
        return None

    def plans_rows_together(self) -> bool:
        """Whether one cache may hold several prompts as rows: prefill/decode then plan every row at once
        (each row its own entries, the same count per layer). Otherwise every prompt needs its own cache."""
        return True

    def prefill(self, view: PrefillView) -> Prefilled:
        return Prefilled([None] * view.num_layers, PolicyState())

    def decode(self, view: DecodeView, state: PolicyState) -> list[LayerPlan | None] | None:
        return None

    def keeps_budget_while_decoding(self) -> bool:
        """Whether this run itself holds the cache at about its budget after every token ("every step");
        prompt-only methods compress once and let the cache grow."""
        return self.schedule == "every step"

    def after_plans(self, view: DecodeView, state: PolicyState) -> list[LayerPlan | None] | None:
        """Plans carried out after the prefill's plans, and after every step's were: a second pass over the cache
        the first one left (the equal-memory hold, `equal_memory.EqualMemoryHold`). None: nothing more."""
        return None

    def eviction_order(self, view: PrefillView, state: PolicyState) -> list[Any] | None:
        """Per layer, the order in which this method would evict its prompt's entries if something had to make
        room later (`eviction_order.HoldRank`, from the prefill's view before its plans are carried out). None:
        by their accumulated attention."""
        return None

    def eviction_order_words(self) -> str:
        """`eviction_order` in words."""
        return "accumulated attention"

    def allocation_importance(self, state: PolicyState) -> torch.Tensor | None:
        """[L, N'] the per-layer importance this run divided its budget by (its Lorenz curves), if any."""
        return None

    @classmethod
    def curves_note(cls, knobs: dict[str, Any]) -> str | None:
        """With these knobs, what this method's Lorenz curves were drawn from when that is not the prefill's
        column sums with the sink counted (the chart's title says it); None otherwise."""
        return None

    def facts(self, state: PolicyState) -> list[Fact]:
        """What to show next to this method's panel about this run (override to add typed facts)."""
        return [note(n) for n in state.notes]

    def extras(self, state: PolicyState | None) -> dict[str, Any]:
        """The facts of this run in JSON-able form (events, exports); empty before the prefill."""
        return facts_to_extras(self.facts(state)) if state is not None else {}

    @classmethod
    def knobs(cls) -> dict[str, Any]:
        """Knob name -> default, for the UI's advanced section and the CLI."""
        return {name: default for name, default, _ in knob_fields(cls)}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Everything a listener shows about the method, JSON-able."""
        details = []
        for name, default, info in knob_fields(cls):
            details.append({
                "name": name, "label": info.label or name, "default": default, "help": info.help,
                "accepted": "true or false" if isinstance(default, bool) and info.choices is None
                else info.accepted(),
                "choices": list(info.choices) if info.choices is not None else None,
                "low": info.low, "high": info.high, "low_open": info.low_open, "high_open": info.high_open,
                "integer": info.integer, "sequence": info.sequence, "editable": info.editable,
            })
        return {"name": cls.name, "label": cls.label, "summary": cls.summary, "schedule": cls.schedule,
                "stage": cls.stage, "uses_budget": cls.uses_budget, "roles": list(cls.roles), "colour": cls.colour,
                "control": cls.control, "is_control": cls.is_control, "knobs": cls.knobs(), "knob_details": details}


def budget_count(ratio: float, n: int, min_keep: int = 1) -> int:
    """round(ratio·n) clamped to [min_keep, n]."""
    return max(min(min_keep, n), min(n, int(round(ratio * n))))


def protected_mask(layer: TrackedLayer, prompt_len: int, sink: int = 1) -> torch.Tensor:
    """[B, Hkv, T] True for entries that must survive: the first `sink` positions and the last prompt token
    (never an empty slot)."""
    return protected_positions(layer.positions, prompt_len, sink)


def protected_positions(pos: torch.Tensor, prompt_len: int, sink: int = 1) -> torch.Tensor:
    """`protected_mask` for true positions of any shape (e.g. several layers stacked)."""
    return ((pos < sink) & (pos >= 0)) | (pos == prompt_len - 1)


def top_k_keep(scores: torch.Tensor, k: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (ascending) of the k best entries along the last axis; `forced` entries always first in line.

    scores [B, H, T] (fp32); forced bool broadcastable. Ranking is a two-key sort (forced, score) done in
    fp32 with +inf for forced entries, never by adding a large constant in low precision."""
    s = scores.float()
    if forced is not None:
        s = s.masked_fill(forced, float("inf"))
    k = max(0, min(k, s.shape[-1]))
    idx = torch.topk(s, k, dim=-1, sorted=False).indices
    return idx.sort(dim=-1).values


def tiered_keep(scores: torch.Tensor, k: int, tier: torch.Tensor) -> torch.Tensor:
    """Indices (ascending) of the k best entries along the last axis by a two-key sort: lower `tier` first
    (an integer per entry, broadcastable to scores), then higher score; ties keep the lower index.

    scores [B, H, T]. E.g. tier 0 for the sink, 1 for text, 2 for image tokens ranks text first within the
    count instead of forcing all of it in."""
    s = scores.float()
    order = torch.argsort(s, dim=-1, descending=True, stable=True)
    tiers = tier.expand_as(s).gather(-1, order)
    order = order.gather(-1, torch.argsort(tiers, dim=-1, stable=True))
    k = max(0, min(k, s.shape[-1]))
    return order[..., :k].sort(dim=-1).values


def drop_range_keep(length: int, start: int, count: int, device) -> torch.Tensor:
    """Indices [1, 1, length - count] of every entry except [start, start + count)."""
    idx = torch.arange(length, device=device)
    keep = torch.cat([idx[:start], idx[start + count :]])
    return keep.view(1, 1, -1)


def plans_by_equal_count(cache: TrackedCache, targets: list[int], keep) -> list[LayerPlan | None]:
    """A plan for every layer holding more than its target (None for the others). The layers that hold the same
    count and target are planned at once: `keep(layers, target)` gives their kept indices stacked,
    [len(layers), B, 1|Hkv, target] (one ranking for all of them, the same as ranking each alone)."""
    plans: list[LayerPlan | None] = [None] * len(cache.layers)
    same: dict[tuple[int, int], list[int]] = {}  # (entries held, target) -> the layers over their target
    for i, (layer, target) in enumerate(zip(cache.layers, targets)):
        if layer.length > target:
            same.setdefault((layer.length, target), []).append(i)
    for (_, target), members in same.items():
        kept = keep([cache.layers[i] for i in members], target)
        for j, i in enumerate(members):
            plans[i] = LayerPlan(keep=kept[j])
    return plans


FIXED_POINT_DISTANCE = 25  # Elastic Cache's fixed point: this many entries before the end of the compressed prompt


def fixed_point_decode(view: DecodeView, targets: list[int], anchors: list[int]) -> list[LayerPlan | None]:
    """Elastic Cache's fixed-point elimination, used by Elastic and PrefixKV while decoding.

    Layer l may hold `targets[l]` entries. When it holds more, the entries at the fixed index
    fp = K_l - FIXED_POINT_DISTANCE (K_l = entries kept after the prompt; K_l // 2 if that is < 1) are deleted,
    so the entries before fp stay frozen and the cache from fp on behaves as a FIFO of recent tokens.
    """
    plans: list[LayerPlan | None] = []
    for layer, target, k in zip(view.cache.layers, targets, anchors):
        excess = layer.length - target
        if excess <= 0:
            plans.append(None)
            continue
        fp = k - FIXED_POINT_DISTANCE
        if fp < 1:
            fp = k // 2
        fp = max(1, min(fp, layer.length - excess - 1))  # never the sink, never the newest entry
        plans.append(RangeDrop(layer.length, fp, excess, layer.entries_device))
    return plans


def layer_importance(view: PrefillView, i: int, normalised: bool = False) -> torch.Tensor:
    """[B, 1, N] importance of layer i: column sums averaged over heads.

    `normalised` divides by the number of prompt queries that can see each token (N - j), removing the
    bias towards early tokens; the papers' default is the plain column sum."""
    if normalised:
        return scoring.normalised_colsum(view.stats[i]["colsum"], view.layer(i).positions, view.prompt_len)
    return scoring.colsum(view.stats[i]["colsum"])


def apply_plans(cache: TrackedCache, plans: list[LayerPlan | None] | Prefilled | None) -> None:
    """Carry out a policy's plans (a list, or the plans of a `Prefilled`): merge first (sources still
    present), then keep, or quantise."""
    if isinstance(plans, Prefilled):
        plans = plans.plans
    if not plans:
        return
    layouts = _split_layouts(cache, plans)
    for i, (layer, plan) in enumerate(zip(cache.layers, plans)):
        if plan is None:
            continue
        if _as_range(plan, layer):
            layer.drop_range(plan.start, plan.count)
            continue
        if plan.merge is not None:
            m = plan.merge
            layer.merge(m.src, m.dst, m.src_weight, m.self_weight, m.denominator)
        if plan.keep is not None:
            layer.gather(plan.keep, empty_slots=plan.empty_slots)
        if plan.quantise is not None:
            q = plan.quantise
            layer.quantize_fp_part(q.important, q.bits_hi, q.bits_lo, q.group_size, layouts.get(i))


def _split_layouts(cache: TrackedCache, plans: list[LayerPlan | None]) -> dict:
    """Layer -> its `SplitLayout`, read at once for every layer whose plan only packs its entries (ZipVL packs every
    layer in the same step: one wait for the device, not five a layer)."""
    packing = [i for i, plan in enumerate(plans) if plan is not None and plan.quantise is not None
               and plan.merge is None and plan.keep is None and cache.layers[i].keys.shape[2] > 0]
    if len(packing) < 2:
        return {}
    parts = []
    for i in packing:
        layer = cache.layers[i]
        parts.append((layer.keys, layer.values, plans[i].quantise.important.expand(layer.keys.shape[0], 1, -1)))
    return dict(zip(packing, split_layouts(parts)))


def _as_range(plan: LayerPlan, layer: TrackedLayer) -> bool:
    """Whether `plan` is carried out as the range it drops (a `RangeDrop` nothing changed since it was made)."""
    return isinstance(plan, RangeDrop) and plan._keep is None and plan.length == layer.length


def apply_plans_together(rows: Sequence[tuple[TrackedCache, list[LayerPlan | None] | None]]) -> None:
    """`apply_plans` for the caches of one batched step (each with its own plans). Plans that only keep entries
    (the usual decode-time eviction) are carried out together, one gather per layer and field for every row of
    a batch's shared stores, and range drops (a fixed-point eviction) with one copy per field for every row and
    layer; merging, quantising and empty slots go row by row."""
    together: list[tuple[TrackedLayer, torch.Tensor]] = []
    ranges: list[tuple[TrackedLayer, int, int]] = []
    for cache, plans in rows:
        if not plans:
            continue
        alone: list[LayerPlan | None] = []
        for layer, plan in zip(cache.layers, plans):
            if _as_range(plan, layer):
                ranges.append((layer, plan.start, plan.count))
                alone.append(None)
            elif plan is not None and plan.keep is not None and plan.merge is None and plan.quantise is None \
                    and not plan.empty_slots:
                together.append((layer, plan.keep))
                alone.append(None)
            else:
                alone.append(plan)
        apply_plans(cache, alone)
    gather_many(together)
    drop_ranges(ranges)
