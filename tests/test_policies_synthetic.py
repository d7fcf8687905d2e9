"""Policies and Lorenz/bisection on synthetic tensors, against small naive reference functions."""
import numpy as np
import pytest
import torch

from prefixkv_core.kv.cache import TrackedCache, TrackedLayer
from prefixkv_core.report.lorenz import (bisect_threshold, counts_for_threshold, distribute, gini, lorenz_curves,
                                  retention_curves)
from prefixkv_core.policies import METHODS, REGISTRY, PolicyError, describe, make_policy, resolve_methods
from prefixkv_core.policies.base import (DecodeView, LayerPlan, PolicyState, PrefillView, RangeDrop, apply_plans,
                                         fixed_point_decode, top_k_keep)
from prefixkv_core.policies.elastic import merge_into_nearest, nearest_anchor
from prefixkv_core.policies.lookm import lookm_keep, similarity_merge
from prefixkv_core.policies.pyramidkv import pyramid_capacities
from prefixkv_core.policies import scoring
from prefixkv_core.kv.sparse_prefill import adaptive_count, visibility_counts
from prefixkv_core.policies.zipvl import probe_queries
from prefixkv_core.testing import synthetic_extra_stats


def _layer(n=20, h=2, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = TrackedLayer()
    k, v = torch.randn(1, h, n, d, generator=g), torch.randn(1, h, n, d, generator=g)
    layer.update(k, v)
    layer.append_meta(torch.arange(n)[None], torch.zeros(1, n, dtype=torch.bool), h)
    layer.scores = torch.rand(1, h, n, generator=g)
    return layer


# -- Lorenz / Gini / bisection -------------------------------------------------------------------------------
def test_lorenz_curves_are_monotone_from_zero_to_one():
    imp = torch.rand(5, 50) ** 4
    for curves in (retention_curves(imp), lorenz_curves(imp)):
        assert torch.all(curves[:, 0] == 0) and torch.allclose(curves[:, -1], torch.ones(5))
        assert torch.all(curves[:, 1:] >= curves[:, :-1] - 1e-6)
    g = gini(imp)
    assert torch.all((g >= 0) & (g <= 1))


def test_gini_extremes_and_naive_formula():
    assert float(gini(torch.ones(1, 100))[0]) == pytest.approx(0.0, abs=1e-6)
    one_hot = torch.zeros(1, 100)
    one_hot[0, 3] = 1.0
    assert float(gini(one_hot)[0]) == pytest.approx(0.99, abs=1e-6)  # (n-1)/n for a discrete one-hot
    x = np.random.RandomState(1).rand(40)
    # naive: mean absolute difference / (2 * mean)
    naive = np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())
    assert float(gini(torch.tensor(x)[None])[0]) == pytest.approx(naive, abs=1e-6)


def test_bisection_hits_the_budget_and_concentrated_layers_keep_less():
    torch.manual_seed(0)
    flat = torch.rand(3, 200) + 1.0
    peaked = torch.rand(3, 200) ** 8
    curves = retention_curves(torch.cat([flat, peaked]))
    for budget in (0.1, 0.3, 0.5, 0.9):
        res = bisect_threshold(curves, budget)
        assert sum(res.counts) == round(budget * 200 * 6)
        assert res.converged and res.iterations <= 60
        assert min(res.counts[:3]) > max(res.counts[3:])
        assert np.mean(res.ratios) == pytest.approx(budget, abs=1e-9)


def test_counts_for_threshold_naive():
    imp = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    curves = retention_curves(imp)  # 0, .4, .7, .9, 1
    assert counts_for_threshold(curves, 0.7).tolist() == [2]
    assert counts_for_threshold(curves, 0.71).tolist() == [3]
    assert counts_for_threshold(curves, 0.0).tolist() == [0]


def test_distribute_sums_and_bounds():
    for total in (10, 37, 100):
        out = distribute(total, [3.0, 1.0, 1.0, 0.5], low=1, high=40)
        assert sum(out) == total and all(1 <= x <= 40 for x in out)


# -- selection primitives ------------------------------------------------------------------------------------
def test_top_k_keep_forces_protected_and_sorts():
    s = torch.tensor([[[0.1, 0.9, 0.2, 0.8, 0.05]]])
    forced = torch.tensor([[[True, False, False, False, True]]])
    assert top_k_keep(s, 3, forced).tolist() == [[[0, 1, 4]]]
    assert top_k_keep(s, 2).tolist() == [[[1, 3]]]


def _naive_pool(raw, kernel):
    """Max pooling of one head's votes before the window, the sink's (position 0) left out of every window; the
    sink itself keeps its raw vote."""
    pooled = [max(v for i, v in enumerate(raw[max(0, j - kernel // 2): j + kernel // 2 + 1], max(0, j - kernel // 2))
                  if i > 0) if j > 0 else raw[0] for j in range(len(raw))]
    return pooled


def _naive_snap(scores, capacity, window, kernel):
    """Per head, the sink, then the best by (pooled vote, raw vote, earlier position), then the window."""
    b, h, n = scores.shape
    out = []
    for head in range(h):
        raw = scores[0, head, : n - window].tolist()
        pooled = _naive_pool(raw, kernel)
        ranked = sorted(range(1, n - window), key=lambda j: (-pooled[j], -raw[j], j))
        out.append(sorted([0] + ranked[: capacity - window - 1]) + list(range(n - window, n)))
    return out


def snapkv_keep(votes, capacity, window, kernel):
    """SnapKV's prefill plan for one layer whose window votes are `votes` [1, H, N], at a budget of `capacity`
    entries per KV head: its kept indices [1, H, capacity]."""
    _, h, n = votes.shape
    layer = TrackedLayer()
    layer.update(torch.zeros(1, h, n, 2), torch.zeros(1, h, n, 2))
    layer.append_meta(torch.arange(n)[None], torch.zeros(1, n, dtype=torch.bool), h)
    cache = TrackedCache(1)
    cache.layers[0] = layer
    policy = make_policy("snapkv", capacity / n, window=window, kernel=kernel)
    plans, state = policy.prefill(PrefillView(cache, {0: {"window": votes}}, n, capacity / n, window))
    assert state.window == window
    return plans[0].keep


def test_snap_select_matches_naive():
    torch.manual_seed(3)
    scores = torch.rand(1, 3, 40)
    got = snapkv_keep(scores, 15, 4, 7)[0]
    assert got.tolist() == _naive_snap(scores, 15, 4, 7)


def test_snap_ties_on_pooled_votes_go_to_the_raw_vote():
    """A strong token shares its pooled score with its neighbours: at a budget of one voted entry it is the one kept,
    not its left neighbour (position order would pick that)."""
    votes = torch.full((1, 1, 20), 0.01)
    votes[0, 0, 9] = 0.9  # neighbours 6..12 all pool to 0.9
    keep = snapkv_keep(votes, 2 + 4, 4, 7)[0, 0].tolist()  # sink + 1 voted + window 4
    assert keep == [0, 9, 16, 17, 18, 19]


def test_snap_sink_vote_lifts_no_neighbour():
    """The sink's large vote is not pooled into positions 1..3: they rank by their own neighbourhoods."""
    votes = torch.full((1, 1, 24), 0.01)
    votes[0, 0, 0] = 5.0  # the sink
    votes[0, 0, 12] = 0.5
    votes[0, 0, 1] = 0.02
    keep = snapkv_keep(votes, 1 + 2 + 4, 4, 7)[0, 0].tolist()  # sink + 2 voted + window 4
    assert keep == [0, 9, 12, 20, 21, 22, 23]  # 12, then the earliest of its pooled neighbours (raw votes tie)
    pooled = scoring.snap_window(votes, 4, 7, sink=1)[0, 0]
    assert float(pooled[0]) == 5.0 and float(pooled[1]) == pytest.approx(0.02)
    assert float(scoring.snap_window(votes, 4, 7)[0, 0, 1]) == 5.0  # without `sink` the sink lifts them


def test_pyramid_capacities_follow_the_schedule():
    caps = pyramid_capacities(n=1000, num_layers=32, budget=0.2, window=8)
    assert len(caps) == 32 and all(a >= b for a, b in zip(caps, caps[1:]))
    assert sum(caps) / 32 == pytest.approx(200, abs=0.5)
    avg = 200 - 8
    assert caps[0] - 8 == pytest.approx(2 * avg - avg // 20, abs=1)  # max = 2(M-W) - min
    assert caps[-1] - 8 == pytest.approx(avg // 20, abs=1)
    assert pyramid_capacities(n=1000, num_layers=32, budget=0.6, window=8) is None  # N < 2(M-W): fallback


def test_nearest_anchor_naive_and_ties_go_low():
    anchors = torch.tensor([0, 4, 10])
    others = torch.tensor([1, 2, 3, 5, 7, 8, 9, 11])
    got = anchors[nearest_anchor(anchors, others)].tolist()
    naive = [min(anchors.tolist(), key=lambda a: (abs(a - o), a)) for o in others.tolist()]
    assert got == naive and got[4] == 4  # 7 is 3 from 4 and 3 from 10: the lower wins


def test_elastic_merge_is_the_mean_of_anchor_and_merged():
    layer = _layer(n=6, h=1)
    keys = layer.keys.clone()
    keep = torch.tensor([[[0, 3]]])
    m = merge_into_nearest(keep, 6)
    layer.merge(m.src, m.dst, m.src_weight, m.self_weight)
    layer.gather(keep)
    # 1 -> 0; 2 -> 3 (tie between 0 and 3? |2-0|=2 > |3-2|=1); 4, 5 -> 3
    torch.testing.assert_close(layer.keys[0, 0, 0], keys[0, 0, [0, 1]].mean(0))
    torch.testing.assert_close(layer.keys[0, 0, 1], keys[0, 0, [2, 3, 4, 5]].mean(0))
    assert layer.positions[0, 0].tolist() == [0, 3]


def _naive_lookm(scores, is_image, heavy, recent):
    n = scores.shape[-1]
    pool = n - recent
    text = [j for j in range(pool) if not is_image[j]]
    images = sorted((j for j in range(pool) if is_image[j]), key=lambda j: -float(scores[j]))
    chosen = text + images[: max(0, heavy - len(text))]
    return sorted(chosen) + list(range(pool, n))


def test_lookm_keep_matches_naive_and_keeps_all_text():
    torch.manual_seed(5)
    n = 30
    flags = torch.zeros(n, dtype=torch.bool)
    flags[3:20] = True
    scores = torch.rand(1, 2, n)
    img = flags.view(1, 1, n).expand(1, 2, n)
    got = lookm_keep(scores, img, heavy=10, recent=5)
    for h in range(2):
        assert got[0, h].tolist() == _naive_lookm(scores[0, h], flags, 10, 5)
    many_text = lookm_keep(scores, torch.zeros(1, 2, n, dtype=torch.bool), heavy=4, recent=3)
    assert many_text.shape[-1] == n  # text alone exceeds the budget: everything stays, reported not hidden


@pytest.mark.parametrize("seed", [7, 8, 9])
@pytest.mark.parametrize("mode", ["pivotal", "average", "weighted"])
def test_lookm_merge_modes_match_naive(mode, seed):
    torch.manual_seed(seed)
    keys = torch.randn(1, 1, 6, 4)
    keep = torch.tensor([[[0, 2, 5]]])
    m = similarity_merge(keys, keep, mode)
    layer = TrackedLayer()
    layer.update(keys.clone(), keys.clone())
    layer.append_meta(torch.arange(6)[None], torch.zeros(1, 6, dtype=torch.bool), 1)
    cache = TrackedCache(1)
    cache.layers[0] = layer
    apply_plans(cache, [LayerPlan(merge=m)])  # as the engine applies it (the merge's own normaliser included)
    kn = torch.nn.functional.normalize(keys[0, 0], dim=-1)
    for j in (0, 2, 5):
        matched = [e for e in (1, 3, 4) if max((0, 2, 5), key=lambda t: float(kn[e] @ kn[t])) == j]
        kj = keys[0, 0, j]
        if mode == "average":
            expect = torch.stack([kj] + [keys[0, 0, e] for e in matched]).mean(0)
        elif mode == "pivotal":
            expect = torch.stack([kj] + [(keys[0, 0, e] + kj) / 2 for e in matched]).mean(0)
        else:  # LOOK-M's Eq. 12: similarities as weights, divided by the number of merged tokens + 1
            s = [float(kn[e] @ kn[j]) for e in matched]
            expect = (kj + sum(si * keys[0, 0, e] for si, e in zip(s, matched))) / (len(matched) + 1)
        torch.testing.assert_close(layer.keys[0, 0, j], expect, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values[0, 0, j], expect, atol=1e-5, rtol=1e-5)  # values follow the keys


def test_lookm_weighted_merge_keeps_a_negative_similarity():
    """Eq. 12 does not clamp: a token whose best match still points away is subtracted, weighted by its
    (negative) similarity, and the denominator counts it."""
    kept = torch.tensor([1.0, 0.0])
    evicted = torch.tensor([-1.0, 0.2])  # cosine with `kept` < 0, and `kept` is its only candidate
    keys = torch.stack([kept, evicted]).view(1, 1, 2, 2)
    m = similarity_merge(keys, torch.tensor([[[0]]]), "weighted")
    s = float(torch.nn.functional.cosine_similarity(kept, evicted, dim=0))
    assert s < 0 and float(m.src_weight.flatten()[0]) == pytest.approx(s)
    layer = TrackedLayer()
    layer.update(keys.clone(), keys.clone())
    layer.append_meta(torch.arange(2)[None], torch.zeros(1, 2, dtype=torch.bool), 1)
    layer.merge(m.src, m.dst, m.src_weight, m.self_weight, m.denominator)
    torch.testing.assert_close(layer.keys[0, 0, 0], (kept + s * evicted) / 2)


def test_fixed_point_elimination_freezes_the_prefix():
    cache = TrackedCache(1)
    cache.layers[0] = _layer(n=40, h=1)
    view = DecodeView(cache, true_len=41, prompt_len=35, step=1)
    plans = fixed_point_decode(view, targets=[38], anchors=[30])  # fp = 30 - 25 = 5, two entries over
    apply_plans(cache, plans)
    pos = cache.layers[0].positions[0, 0].tolist()
    assert pos == list(range(5)) + list(range(7, 40))
    plans = fixed_point_decode(view, targets=[38], anchors=[10])  # fp < 1 -> K // 2 = 5
    assert plans[0] is None  # already at target


@pytest.mark.parametrize("prompt_len, sinks", [(30, 4), (30, 1), (3, 4)])
def test_local_decode_drops_the_range_its_recency_ranking_drops(prompt_len, sinks):
    """Local's decode plan, said as the range right after the sinks (`RangeDrop`, no ranking), keeps exactly the
    entries its recency ranking keeps, step after step, and a follow-up's many tokens at once."""
    policy = make_policy("local", 0.3, sinks=sinks)
    cache = TrackedCache(2)
    for i in range(2):
        cache.layers[i] = _layer(n=prompt_len, h=2, seed=i)
    apply_plans(cache, policy.prefill(PrefillView(cache, {}, prompt_len, 0.3, 0)).plans)
    true_len = prompt_len
    for fed in [1] * 12 + [9] + [1] * 3:
        for layer in cache.layers:
            h = layer.n_kv
            layer.update(torch.randn(1, h, fed, 4), torch.randn(1, h, fed, 4))
            layer.append_meta(torch.arange(true_len, true_len + fed)[None], torch.zeros(1, fed, dtype=torch.bool), h)
        true_len += fed
        view = DecodeView(cache, true_len, prompt_len, 1)
        plans, ranked = policy.decode(view, PolicyState()), policy._plans(cache, true_len)
        for plan, want in zip(plans, ranked):
            assert (plan is None) == (want is None)
            if plan is not None:
                assert isinstance(plan, RangeDrop) and torch.equal(plan.keep.expand_as(want.keep), want.keep)
        apply_plans(cache, plans)


def test_zipvl_adaptive_ratio_and_probe():
    s = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    assert adaptive_count(s, 0.8) == 2 and adaptive_count(s, 0.81) == 3 and adaptive_count(s, 1.0) == 5
    q = probe_queries(100, 0.05, seed=0)
    assert q.tolist()[-5:] == [95, 96, 97, 98, 99] and len(q) == 10 and len(set(q.tolist())) == 10
    assert torch.equal(q, probe_queries(100, 0.05, seed=0))
    counts = visibility_counts(100, q)
    assert counts[0] == 10 and counts[99] == 1


def test_zipvl_quantised_layer_dequantises_within_bound():
    layer = _layer(n=50, h=2, d=16)
    keys, values = layer.keys.clone(), layer.values.clone()
    important = torch.zeros(1, 1, 50, dtype=torch.bool)
    important[..., :10] = True
    layer.quantize_fp_part(important, 4, 2, None)
    assert layer.get_seq_length() == 50 and layer.keys.shape[2] == 0
    order = layer.positions[0, 0]
    assert order[:10].tolist() == list(range(10))  # important first
    k_hat = layer.full_keys()[:, :, torch.argsort(order)]
    err = (k_hat - keys).abs()
    span = keys.amax(2, keepdim=True) - keys.amin(2, keepdim=True)
    assert bool((err <= span / 3 / 2 + 1e-2).all())  # 2-bit: half a step of (max - min) / 3 per channel
    v_hat = layer.full_values()[:, :, torch.argsort(order)]
    v_span = values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)
    assert bool(((v_hat - values).abs() <= v_span / 3 / 2 + 1e-2).all())  # values: per token, the same bound
    assert layer.nbytes() < 0.35 * (keys.numel() * 4 * 2)


# -- registry -----------------------------------------------------------------------------------------------
STAGE_OF = {
    "full": "none", "local": "KV eviction", "h2o": "KV eviction", "snapkv": "KV eviction", "adakv": "KV eviction",
    "pyramidkv": "KV eviction", "elastic": "KV merging", "lookm": "KV merging", "zipvl": "quantisation",
    "fastv": "prefill token reduction", "visionzip": "prefill token reduction", "prefixkv": "KV eviction",
    "random": "KV eviction", "downsample": "prefill token reduction",
    "dart": "prefill token reduction", "vlcache": "KV eviction", "random_drop": "prefill token reduction",
    "mixkv": "KV eviction", "sparsemm": "KV eviction", "pyramiddrop": "prefill token reduction",
    "vispruner": "prefill token reduction", "prumerge_plus": "prefill token reduction"}
CONTROL_OF = {
    **{m: "random" for m in ("local", "h2o", "snapkv", "adakv", "pyramidkv", "elastic", "lookm", "prefixkv",
                             "vlcache", "mixkv", "sparsemm")},
    **{m: "random_drop" for m in ("fastv", "dart", "visionzip", "pyramiddrop", "vispruner", "prumerge_plus")},
    **{m: None for m in ("full", "zipvl", "random", "downsample", "random_drop")}}


def test_registry_and_errors():
    assert resolve_methods("all") == list(METHODS) and len(set(METHODS)) == len(describe())
    assert resolve_methods("full, prefixkv") == ["full", "prefixkv"]
    with pytest.raises(PolicyError, match="no method"):
        resolve_methods([])
    with pytest.raises(PolicyError, match="accepted"):
        make_policy("streaming", 0.3)
    with pytest.raises(PolicyError):
        make_policy("prefixkv", 1.2)
    with pytest.raises(PolicyError, match="mode"):
        make_policy("prefixkv", 0.3, mode="sideways")
    names = [d["name"] for d in describe()]
    assert names == list(METHODS)
    assert {d["name"] for d in describe() if not d["uses_budget"]} == {"full", "zipvl"}
    stages = {d["name"]: d["stage"] for d in describe()}
    assert {name: stages[name] for name in STAGE_OF} == STAGE_OF
    controls = {d["name"]: d["control"] for d in describe()}
    # each method names the chance control of its own kind; the controls name none
    assert {name: controls[name] for name in CONTROL_OF} == CONTROL_OF
    assert all(controls[m] == ("random_drop" if stages[m] == "prefill token reduction" else "random")
               for m in METHODS if m not in CONTROL_OF and REGISTRY[m].uses_budget and not REGISTRY[m].is_control)
    assert {d["name"] for d in describe() if d["is_control"]} == {"random", "random_drop", "downsample"}


def test_a_method_declares_a_known_stage():
    from dataclasses import dataclass

    from prefixkv_core.policies import STAGES, Policy, register

    @dataclass(frozen=True)
    class Elsewhere(Policy):
        name = "elsewhere"
        label = "Elsewhere"
        summary = "Declares a stage the registry does not know."
        colour = "#123456"
        stage = "KV teleportation"

    with pytest.raises(PolicyError, match="stage must be one of"):
        register(Elsewhere)
    assert "elsewhere" not in METHODS and "prefill token reduction" in STAGES


def test_parse_knobs_types_and_errors():
    from prefixkv_core.policies import parse_knobs

    assert parse_knobs(["snapkv.window=16", "zipvl.tau=0.9", "lookm.merge=average", "h2o.x=false"]) == {
        "snapkv": {"window": 16}, "zipvl": {"tau": 0.9}, "lookm": {"merge": "average"}, "h2o": {"x": False}}
    for bad in ("snapkv", "window=3", "snapkv.=3", ".w=3"):
        with pytest.raises(ValueError, match="METHOD.KNOB=VALUE"):
            parse_knobs([bad])


# -- regressions -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.5])
def test_elastic_never_merges_into_protected_tokens(budget):
    from prefixkv_core.policies.base import PrefillView

    n, n_layers = 60, 3
    cache = TrackedCache(n_layers)
    stats = {}
    for i in range(n_layers):
        cache.layers[i] = _layer(n=n, h=2, seed=10 + i)
        colsum = torch.rand(1, 2, n, generator=torch.Generator().manual_seed(i)) ** 3
        colsum[..., 0] += 50.0  # the sink and the last token are also the most attended: they must still
        colsum[..., -1] += 50.0  # stay out of the merge destinations
        stats[i] = {"colsum": colsum}
    policy = make_policy("elastic", budget)
    plans, state = policy.prefill(PrefillView(cache, stats, n, budget, 8))
    assert state.anchors == [max(2, round(budget * n))] * n_layers
    for plan, layer in zip(plans, cache.layers):
        kept = plan.keep[0, 0].tolist()
        assert 0 in kept and n - 1 in kept and len(kept) == max(2, round(budget * n))
        assert plan.merge is not None
        dst = set(plan.merge.dst.flatten().tolist())
        assert dst and dst <= set(kept) - {0, n - 1}
        assert set(plan.merge.src.flatten().tolist()) == set(range(n)) - set(kept)


def test_elastic_merge_skips_protected_destinations_directly():
    keep = torch.tensor([[[0, 5, 9]]])
    protected = torch.zeros(10, dtype=torch.bool)
    protected[[0, 9]] = True
    m = merge_into_nearest(keep, 10, protected)
    assert m.src.flatten().tolist() == [1, 2, 3, 4, 6, 7, 8] and set(m.dst.flatten().tolist()) == {5}
    only_protected = merge_into_nearest(torch.tensor([[[0, 9]]]), 10, protected)
    assert only_protected is None  # no unprotected anchor: evicted entries are dropped, never merged into 0 or 9


def test_zipvl_adaptive_count_never_exceeds_the_tokens_at_tau_one():
    g = torch.Generator().manual_seed(0)
    short_of_one = 0
    for _ in range(500):
        n = int(torch.randint(2, 600, (1,), generator=g))
        scores = torch.rand(n, generator=g) ** float(torch.rand(1, generator=g) * 4)
        s = torch.sort(scores, descending=True).values
        short_of_one += float((torch.cumsum(s, 0) / s.sum())[-1]) < 1.0 - 1e-9
        count = adaptive_count(scores, 1.0)
        assert 1 <= count <= n
        torch.topk(scores, count)  # what ZipVL does with it
    assert short_of_one > 0  # the fp32 case that used to give N + 1 was exercised


def test_zipvl_prefill_runs_at_tau_one():
    from prefixkv_core.policies.base import PrefillView

    n = 97
    policy = make_policy("zipvl", 0.3, tau=1.0)
    cache = TrackedCache(2)
    stats = {}
    for i in range(2):
        cache.layers[i] = _layer(n=n, h=2, d=8, seed=i)
        stats[i] = {"subset": torch.rand(1, 2, n, generator=torch.Generator().manual_seed(i))}
    plans, state = policy.prefill(PrefillView(cache, stats, n, 0.3, 8))
    for plan, ratio in zip(plans, state.important_ratios):
        assert int(plan.quantise.important.sum()) == round(ratio * n) <= n
    assert torch.equal(state.probe_queries, probe_queries(n, policy.probe_fraction, policy.seed))


# -- every registered policy: frozen configuration, declared knobs, typed facts ---------------------------
def _knob_cases():
    from prefixkv_core.policies import REGISTRY
    from prefixkv_core.policies.knobs import knob_fields

    return [pytest.param(cls.name, name, default, info, id=f"{cls.name}.{name}")
            for cls in REGISTRY.values() for name, default, info in knob_fields(cls)]


def _refused_values(default, info):
    """Values that a knob declared like this must refuse."""
    if info.choices is not None:
        return ["not-a-choice", True, None]
    if isinstance(default, bool):
        return [1, "yes", None]
    if info.sequence:
        return ["0.1,0.2", [float("nan")]] + ([[info.high + 1]] if info.high is not None else [])
    out = [None, "3", float("nan"), float("inf")]
    if info.low is not None:
        out.append(info.low if info.low_open else info.low - 1)
    if info.high is not None:
        out.append(info.high if info.high_open else info.high + 1)
    if info.integer:
        out.append((info.low or 0) + 0.5)
    return out


@pytest.mark.parametrize("method,name,default,info", _knob_cases())
def test_every_knob_refuses_what_its_declaration_excludes(method, name, default, info):
    assert info.help  # every knob says what it does
    from prefixkv_core.policies import knob_value

    assert knob_value(make_policy(method, 0.3, **{name: default}), name) == default
    for bad in _refused_values(default, info):
        with pytest.raises(PolicyError) as err:
            make_policy(method, 0.3, **{name: bad})
        message = str(err.value)
        assert f"knob {name} must be" in message and repr(bad) in message, message
        assert info.accepted() in message or "true or false" in message, message


def test_named_bad_knobs_are_refused_with_their_range():
    with pytest.raises(PolicyError, match=r"PyramidKV knob beta must be a whole number in \[1, 1000\]; got 0"):
        make_policy("pyramidkv", 0.3, beta=0)
    for bad in (float("nan"), 5):
        with pytest.raises(PolicyError, match=r"H2O knob recent_fraction must be a number in \[0, 1\]"):
            make_policy("h2o", 0.3, recent_fraction=bad)
    with pytest.raises(PolicyError, match="kernel must be odd"):
        make_policy("snapkv", 0.3, kernel=4)
    assert make_policy("snapkv", 0.3, window=16.0).window == 16  # a whole float is taken as the integer


def _synthetic_prefill(n=40, n_layers=3, h=2, seed=0):
    cache = TrackedCache(n_layers)
    stats = {}
    g = torch.Generator().manual_seed(seed)
    for i in range(n_layers):
        cache.layers[i] = _layer(n=n, h=h, d=8, seed=seed + i)
        cache.layers[i].is_image[..., 5:25] = True
        stats[i] = {k: torch.rand(1, h, n, generator=g) for k in ("colsum", "window", "subset", "last_query")}
    for i, extra in synthetic_extra_stats(cache, 25, seed).items():
        stats[i].update(extra)
    return cache, stats


@pytest.mark.parametrize("window", [16, 60])
@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_observation_window_longer_than_the_prompt_is_clamped_with_a_note(method, window):
    from prefixkv_core.policies.base import PrefillView

    n = 12
    cache, stats = _synthetic_prefill(n=n)
    policy = make_policy(method, 1.0, window=window)
    assert policy.prefill_stats(n).window == n - 1  # the statistic recorded is the one used
    plans, state = policy.prefill(PrefillView(cache, stats, n, 1.0, n - 1))
    assert state.window == n - 1 and all(p.keep.shape[-1] <= n for p in plans)
    notes = [f.value for f in policy.facts(state) if f.kind == "note"]
    assert any(f"observation window {window} is not shorter than the prompt ({n} tokens)" in x for x in notes)
    assert make_policy(method, 0.5, window=4).prefill_stats(n).window == 4


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.3])
@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_observation_window_is_fitted_to_the_budget_with_a_note(method, budget):
    """The window and the sink must fit in round(r·N) entries: the method never holds more than its budget."""
    from prefixkv_core.policies.base import PrefillView

    n = 60
    cap = round(budget * n)  # 6, 12, 18
    cache, stats = _synthetic_prefill(n=n)
    policy = make_policy(method, budget, window=16)
    w = min(16, cap - 1)
    assert policy.prefill_stats(n).window == w
    plans, state = policy.prefill(PrefillView(cache, stats, n, budget, w))
    assert state.window == w
    assert sum(p.keep.shape[-1] for p in plans) / len(plans) == pytest.approx(cap, abs=0.5)
    for p in plans:  # the (fitted) window is kept whole, the sink too
        assert p.keep[0, :, -w:].tolist() == [list(range(n - w, n))] * 2 and (p.keep[0, :, 0] == 0).all()
    notes = [f.value for f in policy.facts(state) if f.kind == "note"]
    fitted = any(f"observation window 16 does not fit in the budget of {cap} entries per layer" in x for x in notes)
    assert fitted == (w < 16), notes


@pytest.mark.parametrize("method", list(METHODS))
def test_every_policy_is_frozen_and_reports_typed_facts(method):
    import dataclasses
    import json

    from prefixkv_core.policies import Fact, PolicyState, Prefilled, facts_from_extras
    from prefixkv_core.policies.base import PrefillView

    n = 40
    cache, stats = _synthetic_prefill(n=n)
    policy = make_policy(method, 0.3)
    before = dataclasses.replace(policy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.budget = 0.5
    result = policy.prefill(PrefillView(cache, stats, n, 0.3, policy.prefill_stats(n).window))
    assert isinstance(result, Prefilled) and isinstance(result.state, PolicyState)
    assert len(result.plans) == 3
    apply_plans(cache, result.plans)
    for layer in cache.layers:  # one decode step with the state prefill returned
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        layer.append_meta(torch.tensor([[n]]), torch.zeros(1, 1, dtype=torch.bool), 2)
    attention = {i: torch.rand(1, 2, layer.length) for i, layer in enumerate(cache.layers)}
    apply_plans(cache, policy.decode(DecodeView(cache, n + 1, n, 1, attention), result.state))
    assert policy == before  # the run changed the state, never the configuration
    facts = policy.facts(result.state)
    assert all(isinstance(f, Fact) for f in facts)
    extras = json.loads(json.dumps(policy.extras(result.state)))
    assert facts_from_extras(extras) == [Fact.from_dict(f.as_dict()) for f in facts]
    assert policy.extras(None) == {}


# -- Random: a uniform draw at the budget --------------------------------------------------------------------
def _naive_random(seed, n_layers, n, capacity, sinks, recent):
    """By hand: per layer, the forced positions, then the others in decreasing order of that layer's noise
    (row l of one CPU draw of [layers, n]) until `capacity` are kept."""
    noise = torch.rand(n_layers, n, generator=torch.Generator().manual_seed(seed))
    out = []
    for i in range(n_layers):
        forced = [j for j in range(n) if j < sinks or j >= n - recent]
        others = sorted((j for j in range(n) if j not in forced), key=lambda j: -float(noise[i, j]))
        out.append(sorted(forced + others[: capacity - len(forced)]))
    return out


@pytest.mark.parametrize("budget,knobs", [(0.3, {}), (0.5, {"sinks": 4, "recent": 3}), (0.1, {"sinks": 4, "recent": 8})])
@pytest.mark.parametrize("seed", [0, 7])
def test_random_keeps_a_uniform_draw_equal_to_the_naive_reference(budget, knobs, seed):
    from prefixkv_core.policies import ResolveContext
    from prefixkv_core.policies.base import PrefillView

    n, layers = 40, 3
    cache, stats = _synthetic_prefill(n=n, n_layers=layers)
    policy = make_policy("random", budget, **knobs).resolve(ResolveContext("m", "m", layers, budget, seed=seed))
    assert policy.seed == seed
    plans, state = policy.prefill(PrefillView(cache, stats, n, budget, 0))
    capacity = max(2, round(budget * n))
    sinks, recent = knobs.get("sinks", 1), knobs.get("recent", 1)
    if sinks + recent > capacity:  # fitted into the budget, sinks first, and said
        sinks, recent = min(sinks, capacity - 1), capacity - min(sinks, capacity - 1)
        assert any("do not fit in the budget" in x for x in state.notes)
    want = _naive_random(seed, layers, n, capacity, sinks, recent)
    for plan, kept in zip(plans, want):
        assert plan.keep.shape == (1, 1, capacity)  # one draw per layer, shared by the KV heads
        assert plan.keep[0, 0].tolist() == kept
    assert {f.key: f.value for f in policy.facts(state)}["seed"] == seed
    assert not policy.decode_needs_attention() and policy.schedule == "prompt only"


def test_random_draws_every_unprotected_entry_about_equally_often():
    from prefixkv_core.policies import ResolveContext
    from prefixkv_core.policies.base import PrefillView

    n, budget, runs = 30, 0.4, 300
    counts = torch.zeros(n)
    for seed in range(runs):
        cache, stats = _synthetic_prefill(n=n, n_layers=1)
        policy = make_policy("random", budget).resolve(ResolveContext("m", "m", 1, budget, seed=seed))
        counts[policy.prefill(PrefillView(cache, stats, n, budget, 0)).plans[0].keep[0, 0]] += 1
    assert counts[0] == runs and counts[n - 1] == runs  # the sink and the last prompt token, always
    share = counts[1:n - 1] / runs  # every other entry: (12 - 2) / 28 of the time
    expected = (round(budget * n) - 2) / (n - 2)
    assert float((share - expected).abs().max()) < 0.1, share
