"""Every named method with its published defaults (and a few knob variants) plans exactly what it planned when
its allocation and scoring were first written out as separate pieces: the kept indices, merges, quantisation
masks and reported facts of a prefill and several decoding steps on seeded synthetic tensors are compared
with the record in tests/data/policy_plans.json.

`python tests/test_policy_plans_frozen.py --write` rewrites that record; do it only for a deliberate change of
a method's behaviour, and say so in the commit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from prefixkv_core.kv.cache import TrackedCache, TrackedLayer
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import DecodeView, PrefillView, apply_plans
from prefixkv_core.testing import synthetic_extra_stats

RECORD = Path(__file__).resolve().parent / "data" / "policy_plans.json"
N, LAYERS, HEADS, DIM, STEPS = 36, 3, 2, 8, 6
BUDGETS = (0.2, 0.5, 0.8)

# case id -> (method, knobs); ids are the keys of the record
CASES = {
    "full": ("full", {}),
    "local": ("local", {}),
    "local-sinks2": ("local", {"sinks": 2}),
    "local-sinks1": ("local", {"sinks": 1}),
    "h2o": ("h2o", {}),
    "h2o-recent": ("h2o", {"recent_fraction": 0.3}),
    "h2o-recent0.1": ("h2o", {"recent_fraction": 0.1}),
    "snapkv": ("snapkv", {}),
    "snapkv-w4k3": ("snapkv", {"window": 4, "kernel": 3}),
    "snapkv-w8": ("snapkv", {"window": 8}),
    "pyramidkv": ("pyramidkv", {}),
    "pyramidkv-w2b5": ("pyramidkv", {"window": 2, "beta": 5}),
    "elastic": ("elastic", {}),
    "elastic-normalised": ("elastic", {"normalised_importance": True}),
    "lookm": ("lookm", {}),
    "lookm-average": ("lookm", {"merge": "average"}),
    "lookm-weighted": ("lookm", {"merge": "weighted"}),
    "lookm-keep-all": ("lookm", {"text_prior": "keep_all"}),
    "zipvl": ("zipvl", {"decode_block": 2}),
    "prefixkv": ("prefixkv", {}),
    "prefixkv-normalised": ("prefixkv", {"scorer": "normalised"}),
    "prefixkv-offline": ("prefixkv", {"mode": "offline", "ratios": [0.5, 0.3, 0.2]}),
    "adakv": ("adakv", {}),
    "random": ("random", {}),  # the draw of seed 0 (the policy as built, before `resolve` sets the comparison's)
    "random-sinks4-recent4": ("random", {"sinks": 4, "recent": 4}),
    "dart": ("dart", {"layer": 1, "budget_of": "image"}),
    "vlcache": ("vlcache", {}),
    "vlcache-window0": ("vlcache", {"recent_window": 0.0}),  # the sink and the last token only
    # the scoring contract's allocations over other scorers, and the methods built on them
    "snapkv-avg5": ("snapkv", {"pooling": "avg", "kernel": 5}),
    "pyramidkv-adaptive": ("pyramidkv", {"head_budget": "adaptive"}),  # Ada-PyramidKV
    "adakv-mixkv": ("adakv", {"mix": "mixkv"}),
    "mixkv": ("mixkv", {}),
    "sparsemm": ("sparsemm", {"head_scores": [3.0, 1.0, 0.5, 0.2, 2.0, 0.0]}),
    "sparsemm-unscored": ("sparsemm", {}),  # no scores: every head the same count
}

# The one place a registered method may be left out of the record, and why. Both plan nothing on the cache: they
# shrink the prefill itself, so a synthetic cache says nothing about them; what they do is tested against naive
# references on real (tiny) models.
EXEMPT = {
    "fastv": "a prefill token reduction: it masks image tokens during its own prefill (tests/test_fastv.py)",
    "visionzip": "a prefill token reduction in the vision tower (tests/test_visionzip.py)",
    "downsample": "a prefill token reduction in the vision tower (tests/test_downsample.py)",
    "random_drop": "a prefill token reduction: FastV's own prefill with a draw (tests/test_random_seed.py)",
    "pyramiddrop": "a prefill token reduction in stages: image tokens leave its own prefill (tests/test_pyramiddrop.py)",
    "vispruner": "a prefill token reduction in the vision tower (tests/test_vispruner.py)",
    "prumerge_plus": "a prefill token reduction in the vision tower (tests/test_prumerge.py)",
}


def synthetic(seed: int) -> tuple[TrackedCache, dict[int, dict[str, torch.Tensor]]]:
    """A prompt of N tokens (image tokens 4..23) in LAYERS layers, with a strong attention sink."""
    g = torch.Generator().manual_seed(seed)
    cache = TrackedCache(LAYERS)
    stats = {}
    flags = torch.zeros(1, N, dtype=torch.bool)
    flags[:, 4:24] = True
    for i in range(LAYERS):
        layer = TrackedLayer()
        layer.update(torch.randn(1, HEADS, N, DIM, generator=g), torch.randn(1, HEADS, N, DIM, generator=g))
        layer.append_meta(torch.arange(N)[None], flags, HEADS)
        colsum = torch.rand(1, HEADS, N, generator=g) ** (1 + 2 * i)
        colsum[..., 0] += 4.0
        stats[i] = {"colsum": colsum, "window": torch.rand(1, HEADS, N, generator=g),
                    "subset": torch.rand(1, HEADS, N, generator=g)}
        layer.scores = colsum.clone()  # the runner's prefill adds the column sums to the scores
        cache.layers[i] = layer
    for i, extra in synthetic_extra_stats(cache, 24, seed).items():  # drawn apart: the cases above stay as recorded
        stats[i].update(extra)
    return cache, stats


def _plan_record(plans) -> list:
    out = []
    for plan in plans or []:
        if plan is None:
            out.append(None)
            continue
        rec = {}
        if plan.keep is not None:
            rec["keep"] = plan.keep.tolist()
        if plan.merge is not None:
            m = plan.merge
            rec["merge"] = {"src": m.src.tolist(), "dst": m.dst.tolist(),
                            "src_weight": [round(float(x), 6) for x in m.src_weight.flatten()],
                            "self_weight": [round(float(x), 6) for x in m.self_weight.flatten()]}
            if m.denominator is not None:
                rec["merge"]["denominator"] = [round(float(x), 6) for x in m.denominator.flatten()]
        if plan.quantise is not None:
            q = plan.quantise
            rec["quantise"] = {"important": q.important.nonzero()[:, -1].tolist(), "bits": [q.bits_hi, q.bits_lo],
                               "group": q.group_size}
        out.append(rec)
    return out


def trace(method: str, knobs: dict, budget: float, seed: int = 0) -> dict:
    """The plans of one prefill and STEPS decoding steps, the cache lengths after each, and the facts."""
    policy = make_policy(method, budget, **knobs)
    cache, stats = synthetic(seed)
    g = torch.Generator().manual_seed(seed + 100)
    prefilled = policy.prefill(PrefillView(cache, stats, N, budget, policy.prefill_stats(N).window))
    steps = [_plan_record(prefilled.plans)]
    apply_plans(cache, prefilled.plans)
    lengths = [cache.lengths()]
    for t in range(STEPS):
        for layer in cache.layers:
            layer.update(torch.randn(1, HEADS, 1, DIM, generator=g), torch.randn(1, HEADS, 1, DIM, generator=g))
            layer.append_meta(torch.tensor([[N + t]]), torch.zeros(1, 1, dtype=torch.bool), HEADS)
        attention = None
        if policy.decode_needs_attention():
            attention = {i: torch.rand(1, HEADS, layer.length, generator=g) for i, layer in enumerate(cache.layers)}
            cache.add_scores(attention)
        plans = policy.decode(DecodeView(cache, N + t + 1, N, t + 1, attention), prefilled.state)
        steps.append(_plan_record(plans))
        apply_plans(cache, plans)
        lengths.append(cache.lengths())
    facts = json.loads(json.dumps(policy.extras(prefilled.state)))
    facts.pop("facts", None)  # the display form; the values are compared through their keys
    return {"plans": steps, "lengths": lengths, "facts": facts}


def record() -> dict:
    return {case: {f"{b:.2f}": trace(method, knobs, b) for b in BUDGETS} for case, (method, knobs) in CASES.items()}


def _same(mine, theirs) -> bool:
    """Indices, counts and flags exactly; weights as recorded, to 6 decimals, within one unit of the last (a weight
    on a rounding boundary moves by one unit when another CPU sums in another order)."""
    if isinstance(mine, float) or isinstance(theirs, float):
        return isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) and abs(mine - theirs) <= 1.5e-6
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine)
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(_same(a, b) for a, b in zip(mine, theirs))
    return mine == theirs


@pytest.fixture(scope="module")
def frozen() -> dict:
    return json.loads(RECORD.read_text())


def test_the_exempt_are_token_reductions_and_not_recorded():
    from prefixkv_core.policies import REGISTRY

    recorded = {method for method, _ in CASES.values()}
    assert all(REGISTRY[m].stage == "prefill token reduction" for m in EXEMPT if m in REGISTRY)
    assert not recorded & set(EXEMPT)


def test_a_method_without_a_case_still_plans_within_its_budget():
    """A new method needs no case here to be traced: its plans on the synthetic prompt keep about r·N entries a
    layer (a case freezes them once they are what the method should plan). A scorer registered here, keeping the
    earliest entries, is among them."""
    from dataclasses import dataclass

    from prefixkv_core.policies import METHODS, REGISTRY, ScoredPolicy, register, unregister

    @dataclass(frozen=True)
    class EarliestPolicy(ScoredPolicy):
        """Earliest: keeps the first prompt entries (a test's scorer), https://arxiv.org/abs/0000.00000"""

        name, label, summary, colour = "earliest_test", "Earliest", "Keeps the first entries.", "#010203"

        def score(self, view, layer):
            return -view.layer(layer).positions.float()

    register(EarliestPolicy)
    try:
        recorded = {method for method, _ in CASES.values()}
        new = [m for m in METHODS if m not in recorded and m not in EXEMPT
               and REGISTRY[m].stage != "prefill token reduction" and REGISTRY[m].uses_budget]
        assert "earliest_test" in new
        for method in new:
            for budget in BUDGETS:
                lengths = trace(method, {}, budget)["lengths"][0]
                assert sum(lengths) / len(lengths) <= round(budget * N) + 2, (method, budget, lengths)
        k = round(0.8 * N)  # the sink, the earliest k - 3 after it, the window of 2
        for plan in trace("earliest_test", {"window": 2}, 0.8)["plans"][0]:
            assert plan["keep"] == [[list(range(k - 2)) + [N - 2, N - 1]] * HEADS]
    finally:
        unregister("earliest_test")


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_defaults_plan_what_they_planned(frozen, case, budget):
    method, knobs = CASES[case]
    got = json.loads(json.dumps(trace(method, knobs, budget)))
    want = frozen[case][f"{budget:.2f}"]
    assert got["lengths"] == want["lengths"], (case, got["lengths"], want["lengths"])
    for step, (mine, theirs) in enumerate(zip(got["plans"], want["plans"])):
        assert _same(mine, theirs), f"{case} at r = {budget}: step {step} plans differ"
    # every recorded fact keeps its value (a setting that departs from the paper may add a fact saying so)
    assert {k: got["facts"].get(k) for k in want["facts"]} == want["facts"]
    if not knobs:
        assert got["facts"] == want["facts"]


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("python tests/test_policy_plans_frozen.py --write  rewrites " + str(RECORD))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
    print(f"wrote {RECORD} ({RECORD.stat().st_size} bytes)")
