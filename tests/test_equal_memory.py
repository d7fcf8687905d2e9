"""Equal-memory mode: the prompt-only methods (SnapKV, PyramidKV, LOOK-M, PrefixKV with decode = grow) held at
r·N_t while decoding, so every budgeted method holds the same memory at every step; the switch in the engine,
the CLI, the app and the benchmarks, and the mode in what each of them writes."""
from __future__ import annotations

import json

import pytest
import torch

from prefixkv_core import Engine, EngineError, GenerationSettings
from prefixkv_core.kv.cache import TrackedCache, TrackedLayer
from prefixkv_core.policies import METHODS, REGISTRY, EqualMemoryHold, PolicyError, make_policy
from prefixkv_core.policies.base import DecodeView, PrefillView, apply_plans
from prefixkv_core.policies.equal_memory import HoldRank, held_keep_across_heads, hold_plans, layer_shares
from prefixkv_core.policies.lookm import similarity_merge
from prefixkv_core.testing import synthetic_prompt_cache

PROMPT = "describe the picture in detail and name every object you can see in it"
BUDGETED = [m for m in METHODS if REGISTRY[m].uses_budget]
PROMPT_ONLY = [m for m in BUDGETED if REGISTRY[m].schedule == "prompt only"]


# -- the rule, on synthetic tensors --------------------------------------------------------------------------
def _held_layer(n_prompt_kept: int, generated: int, prompt_len: int, h: int = 2, seed: int = 0) -> TrackedLayer:
    """A layer after a head-wise prompt compression (different prompt entries per head) and some decoding."""
    g = torch.Generator().manual_seed(seed)
    layer = TrackedLayer()
    total = n_prompt_kept + generated
    layer.update(torch.randn(1, h, total, 4, generator=g), torch.randn(1, h, total, 4, generator=g))
    heads = []
    for _ in range(h):
        middle = torch.randperm(prompt_len - 2, generator=g)[: n_prompt_kept - 2] + 1
        heads.append(torch.cat([torch.tensor([0]), middle.sort().values, torch.tensor([prompt_len - 1]),
                                torch.arange(prompt_len, prompt_len + generated)]))
    layer.positions = torch.stack(heads)[None]
    layer.is_image = torch.zeros_like(layer.positions, dtype=torch.bool)
    layer.scores = torch.rand(1, h, total, generator=g)
    return layer


def _naive_hold(positions: list[int], prompt_len: int, target: int, score, tier, turns=()) -> list[int]:
    """The hold rule spelled out: always the sink, the last prompt token and the newest entry; then the fed
    turns, newest first; then the newest half of the target (the recent window), newest first; then the prompt
    entries by the method's own order (lower tier, then higher score); generated entries outside the window
    last, newest first. `score(p)` / `tier(p)`: the method's ranking of prompt position p. Returns the kept
    positions."""
    entries = sorted(positions)
    window = entries[-max(1, round(0.5 * target)):]
    always = [p for p in entries if p in (0, prompt_len - 1, entries[-1])]
    rest = [p for p in entries if p not in always]
    in_turn = sorted((p for p in rest if any(a <= p < b for a, b in turns)), reverse=True)
    rest = [p for p in rest if p not in in_turn]
    in_window = sorted((p for p in rest if p in window), reverse=True)
    prompt = sorted((p for p in rest if p not in window and p < prompt_len), key=lambda p: (tier(p), -score(p), p))
    generated = sorted((p for p in rest if p not in window and p >= prompt_len), reverse=True)
    order = always + in_turn + in_window + prompt + generated
    return sorted(order[: max(target, len(always))])


def _naive_held_run(prefill_kept: list[int], prompt_len: int, share: float, steps: int, score, tier) -> list[int]:
    """The naive rule applied after each of `steps` decoded tokens, as the engine applies it (an entry evicted
    once never comes back)."""
    kept, true_len = list(prefill_kept), prompt_len
    for _ in range(steps):
        kept.append(true_len)
        true_len += 1
        target = max(3, round(share * true_len))
        if len(kept) > target:
            kept = _naive_hold(kept, prompt_len, target, score, tier)
    return kept


def _random_rank(prompt_len: int, h: int, seed: int) -> HoldRank:
    g = torch.Generator().manual_seed(seed)
    return HoldRank(torch.rand(1, h, prompt_len, generator=g), torch.randint(0, 3, (1, h, prompt_len), generator=g))


@pytest.mark.parametrize("kept,generated,true_len,turns,share", [
    (12, 5, 45, [], 0.25), (12, 1, 41, [], 0.25), (20, 3, 43, [], 0.25), (6, 9, 49, [], 0.25),
    (12, 9, 49, [(41, 46)], 0.25), (20, 12, 52, [(40, 43), (47, 50)], 0.25), (8, 2, 42, [(40, 41)], 0.25),
    (6, 12, 52, [(40, 48)], 0.25), (6, 12, 52, [(40, 50)], 0.1)])
def test_held_layer_keeps_what_the_naive_rule_keeps(kept, generated, true_len, turns, share):
    prompt_len = 40
    cache = TrackedCache(1)
    cache.layers[0] = _held_layer(kept, generated, prompt_len, seed=kept + generated)
    before = cache.layers[0].positions.clone()
    rank = _random_rank(prompt_len, 2, seed=kept)
    target = max(3, round(share * true_len))
    apply_plans(cache, hold_plans(DecodeView(cache, true_len, prompt_len, 1), [share], [rank], turns))
    layer = cache.layers[0]
    for h in range(2):
        want = _naive_hold(before[0, h].tolist(), prompt_len, target, lambda p: float(rank.scores[0, h, p]),
                           lambda p: int(rank.tiers[0, h, p]), turns)
        assert layer.positions[0, h].tolist() == want
        assert layer.keys.shape[2] == layer.length
    assert layer.length == min(target, kept + generated)


@pytest.mark.parametrize("target,turns", [(8, []), (12, [(40, 44)]), (5, [(40, 47)]), (20, [])])
def test_held_layer_across_heads_keeps_what_the_naive_rule_keeps(target, turns):
    """AdaKV's hold: every head's entries ranked together (the rule's tiers, then its votes), the layer keeps
    Hkv · target in all; empty slots (position -1) are never kept."""
    prompt_len, generated = 40, 8
    g = torch.Generator().manual_seed(target)
    rows = []
    for count in (6, 14, 10):  # prompt entries per head (the sink and the last prompt token among them)
        middle = (torch.randperm(prompt_len - 2, generator=g)[: count - 2] + 1).sort().values.tolist()
        rows.append([0] + middle + [prompt_len - 1])
    longest = max(len(r) for r in rows)
    positions = torch.tensor([[-1] * (longest - len(r)) + r + list(range(prompt_len, prompt_len + generated))
                              for r in rows])[None]
    rank = _random_rank(prompt_len, 3, seed=target)
    keep, ragged = held_keep_across_heads(positions, prompt_len, target, rank, turns)
    # naive: per head the rule's tiers and scores, then one ranking of every real entry of the layer
    entries = []
    for h in range(3):
        real = [p for p in positions[0, h].tolist() if p >= 0]
        window = sorted(real)[-max(1, round(0.5 * target)):]
        for slot, p in enumerate(positions[0, h].tolist()):
            if p < 0:
                continue
            if p in (0, prompt_len - 1, max(real)):
                key = (0, -p)
            elif any(a <= p < b for a, b in turns):
                key = (1, -p)
            elif p in window:
                key = (2, -p)
            elif p < prompt_len:
                key = (3 + int(rank.tiers[0, h, p]), -float(rank.scores[0, h, p]))
            else:
                key = (10 ** 6, -p)
            entries.append((key, h * positions.shape[2] + slot, h, slot))
    always = sum(1 for e in entries if e[0][0] == 0)
    chosen = sorted(entries)[: min(len(entries), max(3 * target, always))]
    for h in range(3):
        want = sorted(slot for _, _, hh, slot in chosen if hh == h)
        got = [i for i in keep[0, h].tolist() if i >= 0]
        assert got == want, h
    counts = [len([i for i in keep[0, h].tolist() if i >= 0]) for h in range(3)]
    assert sum(counts) == min(sum(1 for p in positions.flatten().tolist() if p >= 0), max(3 * target, always))
    assert ragged == (min(counts) < max(counts))


def _steps(policy, cache, prompt_len, prefilled, steps, turn=0, seed=0):
    """Feed `steps` decoded tokens (and, first, a user turn of `turn` tokens) through a held policy's plans."""
    g = torch.Generator().manual_seed(seed)
    true_len = max(l.positions.max().item() for l in cache.layers) + 1
    chunks = ([turn] if turn else []) + [1] * steps
    for i, q in enumerate(chunks):
        for layer in cache.layers:
            h, d = layer.keys.shape[1], layer.keys.shape[3]
            layer.update(torch.randn(1, h, q, d, generator=g), torch.randn(1, h, q, d, generator=g))
            layer.append_meta(torch.arange(true_len, true_len + q)[None], torch.zeros(1, q, dtype=torch.bool), h)
        true_len += q
        step = 0 if (turn and i == 0) else i + 1
        view = DecodeView(cache, true_len, prompt_len, step)
        apply_plans(cache, policy.decode(view, prefilled.state))
        apply_plans(cache, policy.after_plans(view, prefilled.state))
    return true_len


def _synthetic(n=40, n_layers=3, h=2, seed=0):
    """Image tokens 4..27, every layer's column sums uniform with a sink."""
    return synthetic_prompt_cache(n, n_layers, h, seed, image=(4, 28), sink=3.0, skew=0.0)


def _held_run(method, budget, knobs=None, steps=8, turn=0, n=40):
    cache, stats = _synthetic(n)
    policy = make_policy(method, budget, "equal_memory", **(knobs or {}))
    w = policy.prefill_stats(n).window
    view = PrefillView(cache, {i: dict(s) for i, s in stats.items()}, n, budget, w)
    prefilled = policy.prefill(view)
    apply_plans(cache, prefilled.plans)
    apply_plans(cache, policy.after_plans(DecodeView(cache, n, n, 0), prefilled.state))
    kept_after_prefill = [l.positions.clone() for l in cache.layers]
    true_len = _steps(policy, cache, n, prefilled, steps, turn)
    return policy, cache, stats, prefilled.state, kept_after_prefill, true_len, w


def _naive_pool(votes: list[float], window: int, kernel: int) -> list[float]:
    n = len(votes)
    prefix = votes[: n - window]
    pooled = [max(prefix[max(0, j - kernel // 2): j + kernel // 2 + 1]) for j in range(len(prefix))]
    return pooled + votes[n - window:]


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_held_snapkv_and_pyramidkv_evict_by_their_window_votes(method, budget):
    n = 40
    policy, cache, stats, state, prefill_kept, true_len, w = _held_run(method, budget, {"window": 4})
    for i, layer in enumerate(cache.layers):
        target = max(3, round(state.shares[i] * true_len))
        assert layer.length == target
        for h in range(2):
            pooled = _naive_pool(stats[i]["window"][0, h].tolist(), w, policy.kernel)
            want = _naive_held_run(prefill_kept[i][0, h].tolist(), n, state.shares[i], true_len - n,
                                   lambda p: pooled[p], lambda p: 0 if p >= n - w else 1)
            assert layer.positions[0, h].tolist() == want, (i, h)
    if method == "pyramidkv":  # the held shares keep its per-layer capacities
        caps = state.inner.capacities
        assert [s / (sum(state.shares) / len(caps)) for s in state.shares] == pytest.approx(
            [c / (sum(caps) / len(caps)) for c in caps])


def test_held_lookm_ranks_text_first_and_merges_what_it_evicts():
    n, budget = 40, 0.4
    cache, stats = _synthetic(n)
    policy = make_policy("lookm", budget, "equal_memory")
    prefilled = policy.prefill(PrefillView(cache, stats, n, budget, 0))
    apply_plans(cache, prefilled.plans)
    state = prefilled.state
    assert policy.after_plans(DecodeView(cache, n, n, 0), state) == [None] * 3  # at r·N already
    prefill_kept = [l.positions.clone() for l in cache.layers]
    true_len = _steps(policy, cache, n, prefilled, 5)
    recent = max(1, round(0.5 * budget * n))
    image = set(range(4, 28))
    for i, layer in enumerate(cache.layers):
        target = max(3, round(state.shares[i] * true_len))
        for h in range(2):
            colsum = stats[i]["colsum"][0, h].tolist()
            want = _naive_held_run(prefill_kept[i][0, h].tolist(), n, state.shares[i], true_len - n,
                                   lambda p: colsum[p], lambda p: 0 if p >= n - recent else (2 if p in image else 1))
            assert len(want) == target
            assert layer.positions[0, h].tolist() == want, (i, h)
    # one more step: the plan merges every entry it evicts into its most similar kept key (LOOK-M's merge)
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        layer.append_meta(torch.tensor([[true_len]]), torch.zeros(1, 1, dtype=torch.bool), 2)
    plans = policy.after_plans(DecodeView(cache, true_len + 1, n, 6), state)
    for layer, plan in zip(cache.layers, plans):
        if plan is None:
            continue
        want = similarity_merge(layer.keys, plan.keep, policy.merge)
        assert torch.equal(plan.merge.src, want.src) and torch.equal(plan.merge.dst, want.dst)
        assert set(plan.merge.src[0, 0].tolist()) == set(range(layer.length)) - set(plan.keep[0, 0].tolist())


def test_held_prefixkv_grow_evicts_by_its_scorer_in_its_layer_counts():
    n, budget = 40, 0.3
    policy, cache, stats, state, prefill_kept, true_len, _ = _held_run("prefixkv", budget, {"decode": "grow"})
    for i, layer in enumerate(cache.layers):
        target = max(3, round(state.shares[i] * true_len))
        colsum = stats[i]["colsum"][0].mean(dim=0).tolist()  # its default scorer: the layer's column sums
        want = _naive_held_run(prefill_kept[i][0, 0].tolist(), n, state.shares[i], true_len - n,
                               lambda p: colsum[p], lambda p: 0)
        assert len(want) == target
        assert layer.positions[0, 0].tolist() == layer.positions[0, 1].tolist() == want, i
    assert [s / budget for s in state.shares] == pytest.approx(
        [r / (sum(state.inner.layer_ratios) / len(state.inner.layer_ratios)) for r in state.inner.layer_ratios])


@pytest.mark.parametrize("method", ["snapkv", "lookm"])
def test_a_fed_question_is_kept_whole_while_the_rest_is_held(method):
    n, budget, q = 40, 0.4, 6
    policy, cache, stats, state, _, true_len, _ = _held_run(method, budget, steps=10, turn=q)
    assert state.turns == [(n, n + q)]
    for layer in cache.layers:
        for h in range(2):
            kept = set(layer.positions[0, h].tolist())
            assert set(range(n, n + q)) <= kept  # the question, every token of it
            assert {0, n - 1, true_len - 1} <= kept


def test_layer_shares_keep_the_profile_and_average_the_budget():
    cache = TrackedCache(3)
    for i, kept in enumerate((20, 10, 6)):
        cache.layers[i] = _held_layer(kept, 0, 40, seed=i)
    shares = layer_shares(cache, 40, 0.3)
    assert sum(shares) / 3 == pytest.approx(0.3)
    assert shares[0] / shares[1] == pytest.approx(2.0) and shares[1] > shares[2]


def test_budget_mode_is_a_run_setting_not_a_knob():
    held = make_policy("snapkv", 0.3, "equal_memory")
    assert isinstance(held, EqualMemoryHold) and held.policy == make_policy("snapkv", 0.3)
    assert held.name == "snapkv" and held.window == 32  # everything but the hold is the wrapped policy's
    assert not isinstance(make_policy("snapkv", 0.3), EqualMemoryHold)
    for every_step in ("local", "h2o", "elastic", "prefixkv"):  # they hold it themselves
        assert not isinstance(make_policy(every_step, 0.3, "equal_memory"), EqualMemoryHold)
    for free in ("full", "zipvl"):
        assert not isinstance(make_policy(free, 0.3, "equal_memory"), EqualMemoryHold)
    assert all("budget_mode" not in REGISTRY[m].knobs() for m in METHODS)
    with pytest.raises(PolicyError, match="budget mode must be one of published, equal_memory"):
        make_policy("snapkv", 0.3, "equal")


# -- through the engine ----------------------------------------------------------------------------------------
def _kept_vs_budget(session, budget):
    """Per method: the largest |mean kept per layer - r·N_t| over every event that reported the cache."""
    worst = {}
    for ev in session.run():
        if getattr(ev, "kept_per_layer", None) and ev.method in BUDGETED:
            gap = abs(sum(ev.kept_per_layer) / len(ev.kept_per_layer) - budget * ev.full_len)
            worst[ev.method] = max(worst.get(ev.method, 0.0), gap)
    for ev in session.follow_up("and what colour is the largest one"):
        if ev.kept_per_layer and ev.method in BUDGETED:
            gap = abs(sum(ev.kept_per_layer) / len(ev.kept_per_layer) - budget * ev.full_len)
            worst[ev.method] = max(worst.get(ev.method, 0.0), gap)
    return worst


@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_equal_memory_holds_every_budgeted_method_at_r_nt_every_step(tiny, noise_image, budget):
    engine = Engine(tiny)
    knobs = {"lookm": {"text_prior": "keep_all"}}  # the paper's LOOK-M: its text exceeds the budget at first
    session = engine.new_session(noise_image, PROMPT, "all", budget, GenerationSettings(max_new_tokens=8), knobs,
                                 budget_mode="equal_memory")
    worst = _kept_vs_budget(session, budget)
    assert set(worst) == set(BUDGETED)
    assert all(gap <= 1.0 for gap in worst.values()), worst
    for name in PROMPT_ONLY:  # held: the sink, the last prompt token and the newest entry survive in every head
        state = session.states[name]
        for layer in state.cache.layers:
            pos = layer.positions[0]
            assert (pos == 0).any(-1).all() and (pos == state.prompt_len - 1).any(-1).all(), name
            assert (pos == state.true_len - 1).any(-1).all(), name
    results = session.record.to_dict()
    assert results["budget_mode"] == "equal_memory"
    for name in PROMPT_ONLY:
        notes = results["methods"][name]["extras"].get("notes", [])
        assert any(n.startswith("equal memory: held at r·N_t") for n in notes), (name, notes)
    assert not any(n.startswith("equal memory") for n in results["methods"]["local"]["extras"].get("notes", []))


def test_held_methods_keep_the_recent_window_and_the_follow_up_question(tiny_qwen2, noise_image):
    """Through the engine: after a first answer and a follow-up, every held layer whose budget can hold it keeps
    the follow-up's tokens and the newest half of its target, as H2O protects its recent window."""
    engine = Engine(tiny_qwen2)
    session = engine.new_session(noise_image, PROMPT, PROMPT_ONLY, 0.5, GenerationSettings(max_new_tokens=6,
                                                                                             ignore_eos=True),
                                 budget_mode="equal_memory")
    list(session.run())
    before = {name: s.true_len for name, s in session.states.items()}
    list(session.follow_up("and what colour is the largest one"))
    for name, state in session.states.items():
        turn = list(range(before[name], before[name] + (state.true_len - before[name] - 5)))  # fed, then 5 decoded
        assert state.policy_state.turns == [(before[name], turn[-1] + 1)], name
        checked = 0
        shares = state.policy_state.shares or [0.5] * len(state.cache.layers)  # AdaKV: r in every layer
        for layer, share in zip(state.cache.layers, shares):
            target = round(share * state.true_len)
            window = set(range(state.true_len - round(0.5 * target), state.true_len))
            for head in layer.positions[0]:
                kept = set(head.tolist())
                if target >= len(turn) + 3:  # room for the question beside the sink, last prompt token, newest
                    assert set(turn) <= kept, name
                    checked += 1
                if target >= len(set(turn) | window | {0, state.prompt_len - 1}):  # and for the window
                    assert window <= kept, name
                    checked += 1
        assert checked, name


def test_published_mode_lets_prompt_only_methods_grow(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, PROMPT_ONLY + ["local"], 0.3,
                                 GenerationSettings(max_new_tokens=10, ignore_eos=True))
    worst = _kept_vs_budget(session, 0.3)
    assert all(worst[m] > 3 for m in PROMPT_ONLY), worst  # the generated tokens all stay
    assert worst["local"] <= 1.0
    assert session.record.to_dict()["budget_mode"] == "published"


def test_prefixkv_decode_grow_is_held_in_equal_memory_mode(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    knobs = {"prefixkv": {"decode": "grow"}}
    grown = engine.new_session(noise_image, PROMPT, ["prefixkv"], 0.3, GenerationSettings(max_new_tokens=8), knobs)
    held = engine.new_session(noise_image, PROMPT, ["prefixkv"], 0.3, GenerationSettings(max_new_tokens=8), knobs,
                              budget_mode="equal_memory")
    assert _kept_vs_budget(grown, 0.3)["prefixkv"] > 3
    assert _kept_vs_budget(held, 0.3)["prefixkv"] <= 1.0
    # the per-layer profile PrefixKV chose survives the hold: layers keep their R_l
    ratios = held.results()["prefixkv"]["extras"]["layer_ratios"]
    kept = held.results()["prefixkv"]["kept_per_layer"]
    full_len = held.results()["prefixkv"]["full_len"]
    assert all(abs(k - r * full_len) <= 1 for k, r in zip(kept, ratios))


def test_equal_memory_batched_equals_each_method_alone(tiny_qwen2, noise_image):
    engine = Engine(tiny_qwen2)
    methods = PROMPT_ONLY + ["h2o"]
    knobs = {"lookm": {"text_prior": "rank"}}

    def answers(names):
        session = engine.new_session(noise_image, PROMPT, names, 0.3, GenerationSettings(max_new_tokens=6),
                                     {k: v for k, v in knobs.items() if k in names}, budget_mode="equal_memory")
        out = {}
        for ev in session.run():
            if getattr(ev, "kind", None) == "done":
                out[ev.method] = (list(session.states[ev.method].turn_ids), ev.kept_per_layer, ev.kv_bytes)
        return out

    together = answers(methods)
    for name in methods:
        assert answers([name])[name] == together[name], name


def test_engine_refuses_an_unknown_budget_mode(tiny_llama, noise_image):
    with pytest.raises(EngineError, match="budget_mode must be one of published, equal_memory"):
        Engine(tiny_llama).new_session(noise_image, PROMPT, ["snapkv"], 0.3, budget_mode="same")


def test_lorenz_curves_used_by_prefixkv_reach_the_prefill_event(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, ["full", "prefixkv"], 0.3,
                                 GenerationSettings(max_new_tokens=2),
                                 {"prefixkv": {"sink_in_curves": False, "scorer": "normalised"}})
    list(session.run())
    pre = session.prefill
    curves = pre.curves["prefixkv"]
    assert curves.shape == (tiny_llama.num_layers, pre.prompt_tokens - 1)
    n = pre.prompt_tokens
    expected = pre.importance[:, 1:] / (n - torch.arange(1, n).numpy())
    assert curves == pytest.approx(expected, rel=1e-5)
    assert session.record.curve_importance("prefixkv") is curves
    assert session.record.curve_importance("snapkv") is pre.importance  # none reported: the column sums


# -- CLI, app, benchmarks ----------------------------------------------------------------------------------------
def test_cli_equal_memory_flag(tmp_path, noise_image, capsys):
    from prefixkv_core.__main__ import main

    image = tmp_path / "img.png"
    noise_image.save(image)
    out = tmp_path / "out.json"
    args = ["compare", "--model", "tiny-llama", "--image", str(image), "--prompt", "Describe the image.",
            "--methods", "snapkv,lookm", "--budget", "0.3", "--max-new-tokens", "4", "--json", str(out),
            "--knob", "prefixkv.scorer=window"]
    assert main(args + ["--equal-memory"]) == 0
    assert "equal memory mode" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["budget_mode"] == "equal_memory"
    for r in data["methods"].values():
        assert abs(sum(r["kept_per_layer"]) / len(r["kept_per_layer"]) - 0.3 * r["full_len"]) <= 1.0
    assert main(args + ["--quiet"]) == 0
    assert json.loads(out.read_text())["budget_mode"] == "published"


def test_cli_lists_the_new_knobs(capsys):
    from prefixkv_core.__main__ import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for item in ("--knob prefixkv.scorer=colsum", "--knob prefixkv.window=8", "--knob prefixkv.sink_in_curves=true",
                 "--knob prefixkv.min_keep=2", "--knob prefixkv.decode=fixed_point", "--knob lookm.text_prior=rank",
                 "--knob snapkv.window=32", "--knob pyramidkv.window=8", "--knob local.sinks=4",
                 "--knob h2o.recent_fraction=0.5"):
        assert item in out, item


@pytest.fixture(scope="module")
def app_controller(tiny_llama):
    from ui.app_builder import build_app

    return build_app(Engine(tiny_llama), max_new_tokens_limit=8).controller


def test_app_offers_the_switch_and_the_knobs(app_controller, noise_image):
    import gradio as gr

    from ui.controller import SessionBox

    ctl = app_controller
    keys = {s.key: s for s in ctl.knob_specs}
    for key in ("prefixkv__scorer", "prefixkv__window", "prefixkv__sink_in_curves", "prefixkv__min_keep",
                "prefixkv__decode", "lookm__text_prior"):
        assert key in keys, key
    assert isinstance(keys["prefixkv__decode"].widget(), gr.Radio)
    assert keys["prefixkv__decode"].widget().value == "fixed_point"

    box = SessionBox()
    outs = list(ctl.compare(noise_image, "Describe.", ["full", "snapkv", "pyramidkv"], 0.3, 6, box=box,
                            equal_memory=True))
    final = dict(zip(ctl.output_keys, outs[-1]))["results"]
    assert final["budget_mode"] == "equal_memory"
    for name in ("snapkv", "pyramidkv"):
        r = final["methods"][name]
        assert abs(sum(r["kept_per_layer"]) / len(r["kept_per_layer"]) - 0.3 * r["full_len"]) <= 1.0
    with pytest.raises(gr.Error, match="equal_memory must be true or false"):
        list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 2, box=SessionBox(), equal_memory="yes"))
    plain = list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 2, box=SessionBox()))
    assert dict(zip(ctl.output_keys, plain[-1]))["results"]["budget_mode"] == "published"


def test_app_lorenz_chart_draws_the_curves_prefixkv_used(app_controller, noise_image):
    from prefixkv_core.report.lorenz import retention_curves
    from ui.controller import SessionBox

    ctl = app_controller
    box = SessionBox()
    list(ctl.compare(noise_image, "Describe.", ["full", "prefixkv"], 0.3, 2, box=box,
                     prefixkv__sink_in_curves=False, prefixkv__scorer="window"))
    comp = box.run
    used = comp.prefill.curves["prefixkv"]
    assert used.shape[1] == comp.prefill.prompt_tokens - 1
    fig = ctl.lorenz(comp, box)
    assert "PrefixKV's curves: observation-window votes, sink left out" in fig.layout.title.text
    layer_trace = next(t for t in fig.data if (t.name or "").startswith("layer 0 "))
    want = retention_curves(torch.as_tensor(used))[0].numpy()
    assert len(layer_trace.y) == used.shape[1] + 1 and layer_trace.y == pytest.approx(want, abs=1e-6)

    box2 = SessionBox()  # default knobs: the curves are the prefill's column sums, no note in the title
    list(ctl.compare(noise_image, "Describe.", ["full", "prefixkv"], 0.3, 2, box=box2))
    fig2 = ctl.lorenz(box2.run, box2)
    assert "PrefixKV's curves" not in fig2.layout.title.text
    assert box2.run.prefill.curves["prefixkv"] == pytest.approx(box2.run.prefill.importance)



def test_quality_benchmark_equal_memory_says_so(tmp_path, threads_restored):
    from benchmarks import quality

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "a", "image": "scene:2000000", "question": "What shapes are there?",
                                "answer": "a red square"}) + "\n")
    args = ["--model", "tiny-llama", "--data", str(data), "--methods", "snapkv,lookm", "--budgets", "0.3",
            "--max-new-tokens", "3", "--threads", "1", "--no-png", "--quiet"]
    out = tmp_path / "eq"
    assert quality.main(args + ["--equal-memory", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["budget_mode"] == "equal_memory" and res["settings"]["budget_mode"] == "equal_memory"
    assert res["config"]["budget_mode"] == "equal_memory"
    md = (out / "kv_kept.md").read_text()
    assert "[equal memory, query-aware]" in md and "Equal memory: every budgeted method holds" in md
    kept = res["tables"]["kv_kept_pct"]
    assert all(abs(kept[m]["0.30"] - 30) < 6 for m in ("snapkv", "lookm")), kept
    # the same folder refuses the other mode's records
    with pytest.raises(SystemExit, match="different configuration"):
        quality.main(args + ["--out", str(out)])
    pub = tmp_path / "pub"
    assert quality.main(args + ["--out", str(pub)]) == 0
    res_pub = json.loads((pub / "results.json").read_text())
    assert res_pub["budget_mode"] == "published" and "[published budgets, query-aware]" in (pub / "ppl.md").read_text()
    assert res_pub["tables"]["kv_kept_pct"]["lookm"]["0.30"] > kept["lookm"]["0.30"]


def test_speed_benchmark_equal_memory_says_so(tmp_path, threads_restored):
    from benchmarks import speed

    args = ["--model", "tiny-llama", "--settings", "40x6", "--budgets", "0.2", "--warmup-steps", "0", "--threads",
            "1", "--no-png", "--quiet", "--no-stock", "--methods", "full,snapkv,lookm", "--out", str(tmp_path)]
    assert speed.main(args + ["--equal-memory"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["budget_mode"] == "equal_memory"
    md = (tmp_path / "speed.md").read_text()
    assert "[equal memory, query-aware]" in md and "Mode: equal memory, query-aware" in md
    rows = {r["method"]: r for r in res["results"]}
    n_t = 40 + 6 - 1
    for m in ("snapkv", "lookm"):
        assert abs(sum(rows[m]["kept_per_layer"]) / len(rows[m]["kept_per_layer"]) - 0.2 * n_t) <= 1.0, rows[m]
