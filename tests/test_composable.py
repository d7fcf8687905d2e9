"""Allocation and scoring pieces (prefixkv_core/policies/allocation.py, scoring.py), the selection helpers and
the knobs built on them (PrefixKV's scorer / window / sink_in_curves / min_keep / decode, LOOK-M's text_prior),
each against a small naive reference on synthetic tensors."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from prefixkv_core.report.lorenz import retention_curves
from prefixkv_core.policies import EqualMemoryHold, allocation, make_policy, scoring
from prefixkv_core.policies.base import DecodeView, PrefillView, apply_plans, tiered_keep
from prefixkv_core.policies.lookm import lookm_rank_keep
from prefixkv_core.policies.pyramidkv import pyramid_capacities
from prefixkv_core.testing import synthetic_prompt_cache


# -- scoring -------------------------------------------------------------------------------------------------
def test_recency_ranks_the_newest_first():
    pos = torch.tensor([[[0, 3, 7, 9]]])
    assert scoring.recency(pos).tolist() == [[[0.0, 3.0, 7.0, 9.0]]]
    assert scoring.recency(pos).dtype == torch.float32


def test_colsum_and_accumulated_average_the_kv_heads():
    g = torch.Generator().manual_seed(1)
    sums = torch.rand(1, 3, 10, generator=g)
    layer_wise = scoring.colsum(sums)
    assert layer_wise.shape == (1, 1, 10)
    for j in range(10):
        assert float(layer_wise[0, 0, j]) == pytest.approx(sum(float(sums[0, h, j]) for h in range(3)) / 3, rel=1e-6)
    assert torch.equal(scoring.colsum(sums, per_head=True), sums)
    assert torch.equal(scoring.accumulated(sums), layer_wise)


def test_normalised_colsum_divides_by_the_queries_that_see_each_token():
    n = 12
    sums = torch.rand(1, 2, n, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(n).view(1, 1, n).expand(1, 2, n)
    got = scoring.normalised_colsum(sums, pos, n)
    for j in range(n):
        naive = (float(sums[0, 0, j]) + float(sums[0, 1, j])) / 2 / (n - j)
        assert float(got[0, 0, j]) == pytest.approx(naive, rel=1e-6)
    per_head = scoring.normalised_colsum(sums, pos, n, per_head=True)
    assert float(per_head[0, 1, 3]) == pytest.approx(float(sums[0, 1, 3]) / (n - 3), rel=1e-6)


@pytest.mark.parametrize("window,kernel", [(4, 7), (1, 3), (8, 1)])
def test_snap_window_matches_naive_pooling(window, kernel):
    n = 30
    votes = torch.rand(1, 2, n, generator=torch.Generator().manual_seed(window + kernel))
    got = scoring.snap_window(votes, window, kernel)
    assert got.shape == votes.shape
    for h in range(2):
        prefix = votes[0, h, : n - window].tolist()
        pooled = [max(prefix[max(0, j - kernel // 2): j + kernel // 2 + 1]) for j in range(len(prefix))]
        naive = pooled + votes[0, h, n - window:].tolist()
        assert got[0, h].tolist() == pytest.approx(naive)


def test_prefill_scores_dispatch_and_refuse_unknown_scorers():
    n = 16
    g = torch.Generator().manual_seed(3)
    stats = {"colsum": torch.rand(1, 2, n, generator=g), "window": torch.rand(1, 2, n, generator=g)}
    pos = torch.arange(n).view(1, 1, n).expand(1, 2, n)
    assert torch.equal(scoring.prefill_scores(stats, pos, n, "colsum"), scoring.colsum(stats["colsum"]))
    assert torch.equal(scoring.prefill_scores(stats, pos, n, "normalised"),
                       scoring.normalised_colsum(stats["colsum"], pos, n))
    window = scoring.prefill_scores(stats, pos, n, "window", window=4)
    assert window.shape == (1, 2, n) and torch.equal(window, scoring.snap_window(stats["window"], 4))
    with pytest.raises(ValueError, match="accepted: colsum, normalised, window"):
        scoring.prefill_scores(stats, pos, n, "attention")


# -- selection -----------------------------------------------------------------------------------------------
def test_tiered_keep_matches_a_naive_two_key_sort():
    g = torch.Generator().manual_seed(4)
    for k in (0, 3, 7, 12):
        scores = torch.rand(1, 2, 12, generator=g)
        tier = torch.randint(0, 3, (1, 2, 12), generator=g)
        got = tiered_keep(scores, k, tier)
        for h in range(2):
            order = sorted(range(12), key=lambda j: (int(tier[0, h, j]), -float(scores[0, h, j]), j))
            assert got[0, h].tolist() == sorted(order[:k])


# -- allocation ----------------------------------------------------------------------------------------------
def test_uniform_is_the_rounded_budget_within_bounds():
    assert allocation.uniform(0.3, 41, 4) == [12] * 4
    assert allocation.uniform(0.01, 41, 2, min_keep=3) == [3, 3]
    assert allocation.uniform(1.0, 41, 1) == [41]
    assert allocation.uniform(0.5, 2, 3, min_keep=5) == [2, 2, 2]  # never more than there is


def test_pyramid_allocation_follows_the_published_schedule():
    n, layers, budget, w, beta = 1000, 8, 0.2, 8, 20
    caps = allocation.pyramid(n, layers, budget, w, beta)
    assert caps == pyramid_capacities(n, layers, budget, w, beta)  # PyramidKV's preset uses the piece
    avg = budget * n - w
    lo, hi = avg // beta, 2 * avg - avg // beta
    naive = [hi - l * (hi - lo) / (layers - 1) + w for l in range(layers)]
    assert all(abs(c - x) <= 1 for c, x in zip(caps, naive))
    assert sum(caps) == round(avg * layers) + w * layers
    assert allocation.pyramid(n, layers, 0.6, w, beta) is None


def test_from_ratios_is_proportional_and_exact():
    counts = allocation.from_ratios([0.5, 0.3, 0.2], 60, low=2, high=40)
    assert counts == [30, 18, 12]
    assert sum(allocation.from_ratios([0.9, 0.05, 0.05], 61, low=5, high=40)) == 61


def naive_bisection(curves: list[list[float]], budget: float, min_keep: int, total: int | None = None):
    """The spec, step by step: bisect p until the counts are within one token per layer of the target, then
    add (remove) one token where it retains the most (least) until the total is exact."""
    n_layers, n = len(curves), len(curves[0]) - 1
    target = int(round(budget * n * n_layers)) if total is None else total

    def counts(p):
        bar = float(np.float32(p - 1e-7))  # compared in fp32, as the curves are
        return [min(k for k in range(n + 1) if c[k] >= bar) for c in curves]

    lo, hi, p = 0.0, 1.0, 1.0
    best = counts(hi)
    for _ in range(60):
        p = 0.5 * (lo + hi)
        best = counts(p)
        if abs(sum(best) - target) <= n_layers:
            break
        lo, hi = (p, hi) if sum(best) < target else (lo, p)
    c = [min(max(x, min_keep), n) for x in best]
    target = max(min_keep * n_layers, min(n * n_layers, target))
    f32 = [[np.float32(x) for x in row] for row in curves]
    while sum(c) != target:
        step = 1 if sum(c) < target else -1
        cand = [i for i in range(n_layers) if min_keep <= c[i] + step <= n]
        if step > 0:
            i = max(cand, key=lambda i: float(f32[i][c[i] + 1] - f32[i][c[i]]))
        else:
            i = max(cand, key=lambda i: -float(f32[i][c[i]] - f32[i][c[i] - 1]))
        c[i] += step
    return p, c


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [0.1, 0.3, 0.7])
def test_lorenz_bisection_matches_the_naive_spec(seed, budget):
    g = torch.Generator().manual_seed(seed)
    imp = torch.rand(5, 37, generator=g) ** torch.tensor([[1.0], [3.0], [6.0], [0.5], [9.0]])
    imp[:, 0] += 3.0  # a sink that dominates the curves
    found = allocation.lorenz_bisection(imp, budget, min_keep=2)
    p, counts = naive_bisection(retention_curves(imp).tolist(), budget, 2)
    assert found.counts == counts and found.threshold == p
    assert sum(found.counts) == round(budget * 37 * 5)

    # the sink left out of the curves: the threshold shares out the rest, the sink is added to every layer
    skipped = allocation.lorenz_bisection(imp, budget, min_keep=2, skip_first=1)
    p1, rest = naive_bisection(retention_curves(imp[:, 1:]).tolist(), budget, 1, round(budget * 37 * 5) - 5)
    assert skipped.counts == [c + 1 for c in rest] and skipped.threshold == p1
    assert sum(skipped.counts) == round(budget * 37 * 5) and min(skipped.counts) >= 2
    assert skipped.ratios == [c / 37 for c in skipped.counts]


# -- PrefixKV's knobs ----------------------------------------------------------------------------------------
def _prefill_view(n=40, n_layers=3, h=2, seed=0):
    """Image tokens 5..24, column sums more concentrated with depth, a strong sink."""
    return synthetic_prompt_cache(n, n_layers, h, seed, image=(5, 25), sink=6.0, skew=3.0)


def test_prefixkv_window_scorer_asks_for_its_window_and_selects_per_kv_head():
    n = 40
    policy = make_policy("prefixkv", 0.3, scorer="window", window=6)
    assert policy.prefill_stats(n).window == 6 and policy.prefill_stats(n).colsum
    assert make_policy("prefixkv", 0.3).prefill_stats(n).window == 0  # the default asks for none
    assert make_policy("prefixkv", 0.3, scorer="window").prefill_stats(n).window == 8  # SnapKV's default
    assert make_policy("prefixkv", 0.3, scorer="window", window=99).prefill_stats(n).window == n - 1
    cache, stats = _prefill_view(n)
    plans, state = policy.prefill(PrefillView(cache, stats, n, 0.3, 6))
    curves = torch.stack([scoring.snap_window(stats[i]["window"], 6)[0].mean(dim=0) for i in range(3)])
    assert torch.allclose(state.curve_importance, curves)
    assert state.anchors == allocation.lorenz_bisection(curves, 0.3, min_keep=2).counts
    for i, plan in enumerate(plans):
        k = state.anchors[i]
        assert plan.keep.shape == (1, 2, k)
        for h in range(2):  # naive: the sink and the last prompt token, then the head's best window votes
            scores = scoring.snap_window(stats[i]["window"], 6)[0, h].tolist()
            kept = plan.keep[0, h].tolist()
            assert kept == sorted(set(kept)) and kept[0] == 0 and kept[-1] == n - 1
            best = sorted((scores[j] for j in range(1, n - 1)), reverse=True)[: k - 2]
            assert sorted((scores[j] for j in kept[1:-1]), reverse=True) == best  # pooling ties: compare values
    assert {f.key: f.value for f in policy.facts(state)}["scorer"] == "observation-window votes"


def test_prefixkv_sink_in_curves_off_leaves_the_sink_out_and_keeps_the_budget():
    n = 40
    cache, stats = _prefill_view(n)
    with_sink = make_policy("prefixkv", 0.3).prefill(PrefillView(cache, stats, n, 0.3, 0))
    without = make_policy("prefixkv", 0.3, sink_in_curves=False).prefill(PrefillView(cache, stats, n, 0.3, 0))
    assert with_sink.state.curve_importance.shape == (3, n)
    assert without.state.curve_importance.shape == (3, n - 1)
    assert torch.equal(without.state.curve_importance, with_sink.state.curve_importance[:, 1:])
    assert sum(without.state.anchors) == sum(with_sink.state.anchors) == round(0.3 * n * 3)
    assert without.state.threshold != with_sink.state.threshold  # a dominant sink bends every curve
    for plan in without.plans:
        assert 0 in plan.keep[0, 0].tolist() and n - 1 in plan.keep[0, 0].tolist()
    notes = [f.value for f in make_policy("prefixkv", 0.3, sink_in_curves=False).facts(without.state)]
    assert "the attention sink is left out of the Lorenz curves" in notes


def test_prefixkv_min_keep_is_a_floor_at_prefill_and_while_decoding():
    n = 40
    cache, stats = _prefill_view(n)
    policy = make_policy("prefixkv", 0.1, min_keep=5)
    plans, state = policy.prefill(PrefillView(cache, stats, n, 0.1, 0))
    assert min(state.anchors) >= 5 and sum(state.anchors) == max(round(0.1 * n * 3), 15)
    apply_plans(cache, plans)
    view = DecodeView(cache, n + 1, n, 1)
    for layer, ratio in zip(cache.layers, state.layer_ratios):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        layer.append_meta(torch.tensor([[n]]), torch.zeros(1, 1, dtype=torch.bool), 2)
    apply_plans(cache, policy.decode(view, state))
    assert min(cache.lengths()) >= 5
    over = make_policy("prefixkv", 0.05, min_keep=10).prefill(PrefillView(*_prefill_view(n), n, 0.05, 0)).state
    assert sum(over.anchors) == 30 and any("min keep 10" in x for x in over.notes)


def test_prefixkv_decode_grow_compresses_the_prompt_only():
    n = 40
    cache, stats = _prefill_view(n)
    policy = make_policy("prefixkv", 0.3, decode="grow")
    assert not policy.keeps_budget_while_decoding() and make_policy("prefixkv", 0.3).keeps_budget_while_decoding()
    plans, state = policy.prefill(PrefillView(cache, stats, n, 0.3, 0))
    apply_plans(cache, plans)
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        layer.append_meta(torch.tensor([[n]]), torch.zeros(1, 1, dtype=torch.bool), 2)
    assert policy.decode(DecodeView(cache, n + 1, n, 1), state) is None
    assert policy.after_plans(DecodeView(cache, n + 1, n, 1), state) is None  # published: grows
    held = make_policy("prefixkv", 0.3, decode="grow", budget_mode="equal_memory")
    assert isinstance(held, EqualMemoryHold) and held.policy == policy
    assert any("decode = grow" in str(f.value) for f in policy.facts(state))


def test_prefixkv_reports_its_curves_only_online():
    n = 40
    cache, stats = _prefill_view(n)
    online = make_policy("prefixkv", 0.3)
    state = online.prefill(PrefillView(cache, stats, n, 0.3, 0)).state
    assert torch.equal(online.allocation_importance(state),
                       torch.stack([stats[i]["colsum"][0].mean(dim=0) for i in range(3)]))
    offline = make_policy("prefixkv", 0.3, mode="offline", ratios=[0.5, 0.3, 0.1])
    assert offline.allocation_importance(offline.prefill(PrefillView(cache, stats, n, 0.3, 0)).state) is None
    assert make_policy("snapkv", 0.3).allocation_importance(None) is None


def test_the_decode_knob_is_named_decode_for_users():
    from prefixkv_core.policies import describe, knob_value, parse_knobs

    knobs = {d["name"]: d for d in describe()}["prefixkv"]["knobs"]
    assert knobs["decode"] == "fixed_point" and "decode_rule" not in knobs
    assert {"scorer": "colsum", "window": 8, "sink_in_curves": True, "min_keep": 2}.items() <= knobs.items()
    policy = make_policy("prefixkv", 0.3, **parse_knobs(["prefixkv.decode=grow", "prefixkv.scorer=window"])["prefixkv"])
    assert knob_value(policy, "decode") == "grow" and policy.scorer == "window"
    assert callable(policy.decode)  # the method is untouched
    with pytest.raises(ValueError, match="PrefixKV knob decode must be one of fixed_point, grow"):
        make_policy("prefixkv", 0.3, decode="sometimes")


# -- LOOK-M's text prior -------------------------------------------------------------------------------------
def _naive_rank_keep(scores, is_image, positions, heavy, recent):
    n = len(scores)
    pool = n - recent

    def tier(j):
        return 0 if positions[j] < 1 else (2 if is_image[j] else 1)

    order = sorted(range(pool), key=lambda j: (tier(j), -scores[j], j))
    return sorted(order[:heavy]) + list(range(pool, n))


def test_lookm_rank_keep_matches_naive():
    n = 30
    g = torch.Generator().manual_seed(6)
    scores = torch.rand(1, 2, n, generator=g)
    flags = torch.zeros(1, 2, n, dtype=torch.bool)
    flags[..., 8:14] = True  # text-heavy: 24 text tokens, 6 image
    pos = torch.arange(n).view(1, 1, n).expand(1, 2, n)
    got = lookm_rank_keep(scores, flags, pos, heavy=5, recent=4)
    for h in range(2):
        want = _naive_rank_keep(scores[0, h].tolist(), flags[0, h].tolist(), pos[0, h].tolist(), 5, 4)
        assert got[0, h].tolist() == want
        assert 0 in want and not any(flags[0, h, j] for j in want[:-4])  # text first: no image made it


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5])
def test_lookm_rank_keeps_within_the_budget_on_a_text_heavy_prompt(budget):
    n = 40
    cache, stats = _prefill_view(n)
    for layer in cache.layers:  # mostly text: 4 image tokens
        layer.is_image[...] = False
        layer.is_image[..., 10:14] = True
    keep_all = make_policy("lookm", budget, text_prior="keep_all").prefill(PrefillView(cache, stats, n, budget, 0))
    ranked = make_policy("lookm", budget).prefill(PrefillView(cache, stats, n, budget, 0))  # the default
    for plan_all, plan in zip(keep_all.plans, ranked.plans):
        assert plan.keep.shape[-1] == round(budget * n)  # r/2 recent + the ranked rest: exactly r·N
        assert plan_all.keep.shape[-1] > plan.keep.shape[-1]  # keep_all keeps all 36 text tokens
        assert plan.merge is not None  # the evicted are still merged
    assert keep_all.state.notes and not ranked.state.notes
