"""MixKV: its per-head mix of importance and diversity against a naive reference written from the paper and the
reference's rule, the mix wrapping other scoring methods (AdaKV's head budgets stay the votes'), and the method
through the engine."""
import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import PrefillView
from prefixkv_core.policies.diversity import head_redundancy
from prefixkv_core.testing import synthetic_prompt_cache

N, W = 40, 4
PROMPT = "describe the picture in detail and name every object you can see in it"


def _naive_avg_pool(votes, kernel):
    """One head's votes before the window, average-pooled with zero padding, the sink's vote counted as zero and
    the sink keeping its own."""
    v = [0.0] + list(votes[1:])
    half = kernel // 2
    out = [sum(v[j + d] for d in range(-half, half + 1) if 0 <= j + d < len(v)) / kernel for j in range(len(v))]
    out[0] = votes[0]
    return out


def _naive_mixkv_keep(keys, values, votes, capacity, kernel=5):
    """One head: keys/values [N, D], votes [N] -> the kept positions, by hand."""
    n, m = len(keys), len(keys) - W
    unit = [[x / math.sqrt(sum(y * y for y in k)) for x in k] for k in keys]
    mean = [sum(u[d] for u in unit) / n for d in range(len(unit[0]))]
    rho = (n * sum(x * x for x in mean) - 1) / (n - 1)
    attn = _naive_avg_pool(votes[:m], kernel)
    finite = [max(attn[1:])] + attn[1:]  # the sink stands at the best score while the others are rescaled

    def minmax(xs):
        lo, hi = min(xs), max(xs)
        return [(x - lo) / (hi - lo + 1e-8) for x in xs]

    def to_scale(xs):
        scale = sum(finite) / m / (sum(xs) / m + 1e-8)
        return [x * scale for x in xs]

    diversity = to_scale(minmax([-sum(a * b for a, b in zip(unit[j], mean)) for j in range(m)]))
    vnorm = to_scale(minmax([math.sqrt(sum(x * x for x in values[j])) for j in range(m)]))
    mixed = [rho * diversity[j] + (1 - rho) * (finite[j] + vnorm[j]) for j in range(m)]
    order = sorted(range(1, m), key=lambda j: (-mixed[j], -votes[j], j))
    return sorted([0] + order[: capacity - W - 1]) + list(range(m, n))


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_mixkv_keeps_what_the_naive_mix_keeps(budget):
    cache, stats = synthetic_prompt_cache(n=N, n_layers=3, h=2, seed=3)
    policy = make_policy("mixkv", budget, window=W)
    plans, state = policy.prefill(PrefillView(cache, stats, N, budget, W))
    capacity = round(budget * N)
    for i, plan in enumerate(plans):
        layer = cache.layers[i]
        for h in range(2):
            expect = _naive_mixkv_keep(layer.keys[0, h].tolist(), layer.values[0, h].tolist(),
                                       stats[i]["window"][0, h].tolist(), capacity)
            assert plan.keep[0, h].tolist() == expect, (i, h)
    assert state.per_head == [capacity] * 3


def test_redundancy_is_the_mean_cosine_of_two_distinct_keys():
    keys = torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(0))
    unit = torch.nn.functional.normalize(keys, dim=-1)[0]
    for h in range(2):
        cos = unit[h] @ unit[h].T
        pairs = [float(cos[i, j]) for i in range(9) for j in range(9) if i != j]
        assert float(head_redundancy(keys)[0, h, 0]) == pytest.approx(sum(pairs) / len(pairs), abs=1e-5)


def test_the_mix_wraps_adakv_whose_head_budgets_stay_the_votes():
    cache, stats = synthetic_prompt_cache(n=N, n_layers=3, h=2, seed=4)
    plain = make_policy("adakv", 0.3, window=W)
    mixed = make_policy("adakv", 0.3, window=W, mix="mixkv")
    a = plain.prefill(PrefillView(cache, stats, N, 0.3, W))
    b = mixed.prefill(PrefillView(cache, stats, N, 0.3, W))
    assert a.state.head_counts == b.state.head_counts  # the budgets: the votes', as in the reference
    assert any(not torch.equal(p.keep, q.keep) for p, q in zip(a.plans, b.plans))  # the choice: the mix's
    snap = make_policy("snapkv", 0.3, window=W, kernel=5, pooling="avg", mix="mixkv")
    mix = make_policy("mixkv", 0.3, window=W)
    for p, q in zip(snap.prefill(PrefillView(cache, stats, N, 0.3, W)).plans,
                    mix.prefill(PrefillView(cache, stats, N, 0.3, W)).plans):
        assert torch.equal(p.keep, q.keep)  # MixKV is SnapKV's knobs set to the reference's


def test_mixkv_runs_through_the_engine_and_one_is_full(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "mixkv"], 0.4,
                                             GenerationSettings(max_new_tokens=3), {"mixkv": {"window": 4}})
    list(session.run())
    n = session.prefill.prompt_tokens
    assert session.states["mixkv"].error is None
    assert [layer.length - (session.states["mixkv"].true_len - n) for layer in
            session.states["mixkv"].cache.layers] == [round(0.4 * n)] * tiny_llama.num_layers
    whole = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "mixkv"], 1.0,
                                           GenerationSettings(max_new_tokens=3))
    list(whole.run())
    assert whole.states["mixkv"].turn_ids == whole.states["full"].turn_ids
