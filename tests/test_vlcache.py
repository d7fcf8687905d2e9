"""VL-Cache: its sparsity, per-layer budgets and kept tokens against a naive reference on synthetic statistics, its
post-vision statistics against a plain eager forward's attention, and its allocation reaching the charts' curves
and its facts through the engine."""
import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.policies.vlcache import density_counts
from prefixkv_core.testing import synthetic_prompt_cache

PROMPT = "describe the picture in detail and name every object you can see in it"


def _naive_counts(sparsity, budget, n):
    """Largest remainders, written out (no clamping needed for the cases below)."""
    total = round(budget * n * len(sparsity))
    density = [1 - s for s in sparsity]
    raw = [d / sum(density) * total for d in density]
    counts = [math.floor(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _naive_plan(stats, n, post, budget, window=0.0):
    """Per layer: (sparsity, count, kept positions) by hand: the sink and last token first, then the last
    int(window * budget * n) positions (at least one), then the best post-vision scores."""
    layers = sorted(stats)
    seen = sum(i + 1 for i in post)
    sparsity = []
    for l in layers:
        below = stats[l]["post_vision_sparse"][0]
        sparsity.append(sum(float(below[h].sum()) for h in range(below.shape[0])) / below.shape[0] / seen)
    counts = _naive_counts(sparsity, budget, n)
    width = max(1, int(window * budget * n)) if window else 0
    kept = []
    for l, k in zip(layers, counts):
        score = stats[l]["post_vision"][0].mean(dim=0).tolist()
        order = sorted(range(n), key=lambda j: (0 if j in (0, n - 1) else 1 if j >= n - width else 2, -score[j], j))
        kept.append(sorted(order[:k]))
    return sparsity, counts, kept


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [0.2, 0.5])
@pytest.mark.parametrize("window", [0.0, 0.1, 0.5])
def test_budgets_and_kept_tokens_match_naive(seed, budget, window):
    n = 40
    cache, stats = synthetic_prompt_cache(n, 4, 2, seed, image=(5, 25))
    policy = make_policy("vlcache", budget, recent_window=window)
    plans, state = policy.prefill(PrefillView(cache, stats, n, budget, 0))
    sparsity, counts, kept = _naive_plan(stats, n, list(range(25, n)), budget, window)
    assert state.sparsity == pytest.approx(sparsity, abs=1e-6) and state.capacities == counts
    assert sum(counts) == round(budget * n * 4) and state.post_vision == 15
    for plan, want in zip(plans, kept):
        assert plan.keep.shape[1] == 1 and plan.keep[0, 0].tolist() == want
    assert state.importance.shape == (4, n) and torch.equal(policy.allocation_importance(state)[0],
                                                            stats[0]["post_vision"][0].mean(dim=0))
    facts = {f.key: f for f in policy.facts(state)}
    assert facts["capacities"].value == counts and facts["capacities"].kind == "per-layer"
    assert facts["sparsity"].value == [round(s, 4) for s in sparsity]
    assert facts["recent"].value == (max(1, int(window * budget * n)) if window else 0)


def test_the_recent_window_is_kept_whatever_it_scores_and_evicted_last():
    n, budget = 40, 0.5
    cache, stats = synthetic_prompt_cache(n, 4, 2, 0, image=(5, 25))
    for layer in stats.values():
        layer["post_vision"][..., n - 5 : n - 1] = 0.0  # the window below every other token
    policy = make_policy("vlcache", budget)  # the default: 10 % of r·N = 2 recent tokens
    plans, state = policy.prefill(PrefillView(cache, stats, n, budget, 0))
    assert state.recent == 2
    for plan in plans:
        assert {0, n - 2, n - 1} <= set(plan.keep[0, 0].tolist()) and n - 3 not in plan.keep[0, 0].tolist()
    bare, _ = make_policy("vlcache", budget, recent_window=0.0).prefill(PrefillView(cache, stats, n, budget, 0))
    assert all(n - 2 not in plan.keep[0, 0].tolist() for plan in bare)
    order = policy.eviction_order(PrefillView(cache, stats, n, budget, 0), state)
    assert order[0].tiers[0, 0, n - 2:].tolist() == [0, 0] and int(order[0].tiers[0, 0, n - 3]) == 1


def test_denser_layers_keep_more_and_counts_stay_in_bounds():
    counts = density_counts([0.9, 0.5, 0.1], 0.3, 100)
    assert counts[0] < counts[1] < counts[2] and sum(counts) == 90
    tiny = density_counts([0.99, 0.0, 0.0], 0.02, 50)  # 3 entries to share: the floor of 2 per layer wins
    assert min(tiny) >= 2 and max(tiny) <= 50
    full = density_counts([0.0, 0.9, 0.9], 0.9, 20)  # a layer's share would pass N: clamped, the rest spread
    assert max(full) == 20 and sum(full) == 54


def _eager_attentions(lm, inputs):
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return lm.model(**inputs, output_attentions=True).attentions
    finally:
        lm.model.set_attn_implementation("sdpa")


def test_post_vision_statistics_match_a_plain_eager_forward(tiny, noise_image):
    inputs = encode(tiny, noise_image, format_prompt(tiny, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == tiny.image_token_id
    n = ids.shape[1]
    policy = make_policy("vlcache", 0.3)
    with tracked_attention_enabled(tiny.model):
        pre = runner.prefill(tiny.model, ids, is_image, inputs["pixel_values"], [policy], tiny.num_layers,
                             tiny.device)
    stats = runner.policy_stats(policy, pre.stats, n)
    post = list(range(int(is_image[0].nonzero().max()) + 1, n))
    assert post
    attentions = _eager_attentions(tiny, inputs)
    for layer, attention in enumerate(attentions):
        a = attention[0].float()  # [H, N, N]
        hkv = stats[layer]["post_vision"].shape[1]
        group = a.shape[0] // hkv
        want = a[:, post].sum(dim=1).view(hkv, group, n).mean(dim=1)
        torch.testing.assert_close(stats[layer]["post_vision"][0], want, atol=1e-4, rtol=1e-4)
        rows = a[:, post]  # [H, P, N]
        visible = torch.arange(n)[None, :] <= torch.tensor(post)[:, None]
        below = ((rows < 0.01 * rows.amax(dim=-1, keepdim=True)) & visible).float().sum(dim=1)
        torch.testing.assert_close(stats[layer]["post_vision_sparse"][0], below.view(hkv, group, n).mean(dim=1))
    plans, state = policy.prefill(PrefillView(pre.cache, stats, n, 0.3, 0))
    assert all(0.0 <= s < 1.0 for s in state.sparsity)
    apply_plans(pre.cache, plans)
    assert pre.cache.lengths() == state.capacities


def test_engine_reports_budgets_and_feeds_the_curves(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["vlcache", "full"], 0.4,
                                             GenerationSettings(max_new_tokens=3))
    events = list(session.run())
    pre = events[0]
    n, layers = pre.prompt_tokens, tiny_llama.num_layers
    start = next(e for e in events if getattr(e, "method", None) == "vlcache" and e.kind == "start")
    assert start.kept_per_layer == start.extras["capacities"]
    assert sum(start.kept_per_layer) == round(0.4 * n * layers)
    assert len(start.extras["sparsity"]) == layers
    assert pre.curves["vlcache"].shape == (layers, n)
