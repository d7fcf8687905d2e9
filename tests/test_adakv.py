"""AdaKV: head-wise budgets over SnapKV's window votes, against naive references, and a cache whose KV heads hold
different numbers of entries (empty slots masked from attention, bytes counted from the entries kept)."""
import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.kv.cache import TrackedCache, TrackedLayer
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.selection import floored_counts
from prefixkv_core.policies.base import PrefillView, apply_plans

N, HEADS, DIM, LAYERS = 48, 4, 8, 3
PROMPT = "describe the picture in detail and name every object you can see in it"


def _synthetic(seed=0, heads=HEADS):
    """A prompt of N tokens whose KV heads vote very differently (some concentrated, some spread)."""
    g = torch.Generator().manual_seed(seed)
    cache, stats = TrackedCache(LAYERS), {}
    for i in range(LAYERS):
        layer = TrackedLayer()
        layer.update(torch.randn(1, heads, N, DIM, generator=g), torch.randn(1, heads, N, DIM, generator=g))
        layer.append_meta(torch.arange(N)[None], torch.zeros(1, N, dtype=torch.bool), heads)
        sharpness = torch.tensor([1.0, 4.0, 12.0, 30.0][:heads]).view(1, heads, 1)
        window = torch.rand(1, heads, N, generator=g) ** sharpness
        stats[i] = {"colsum": torch.rand(1, heads, N, generator=g), "window": window}
        cache.layers[i] = layer
    return cache, stats


def _naive_votes(window_votes, window, kernel):
    """Per head, (pooled, raw) votes of the tokens before the window: max pooling with the sink's (position 0) vote
    left out of every neighbourhood, the sink itself at +inf."""
    pooled, raw = [], []
    for h in range(window_votes.shape[0]):
        r = window_votes[h, : window_votes.shape[1] - window].tolist()
        p = [math.inf] + [max(r[i] for i in range(max(1, j - kernel // 2), min(len(r), j + kernel // 2 + 1)))
                          for j in range(1, len(r))]
        pooled.append(p)
        raw.append(r)
    return pooled, raw


def _naive_flattened_counts(pooled, raw, total):
    """Rank every (head, token) pair of a layer together, one by one, by (pooled, raw, head, position); count each
    head's among the best `total`."""
    pairs = sorted(((pooled[h][j], raw[h][j], h, j) for h in range(len(pooled)) for j in range(len(pooled[h]))),
                   key=lambda p: (-p[0], -p[1], p[2], p[3]))
    counts = [0] * len(pooled)
    for _, _, h, _ in pairs[:total]:
        counts[h] += 1
    return counts


@pytest.mark.parametrize("budget", [0.2, 0.35, 0.6])
@pytest.mark.parametrize("floor_alpha", [0.0, 0.2, 0.5])
def test_head_counts_are_the_flattened_top_k_and_sum_to_the_layer_budget(budget, floor_alpha):
    window, kernel = 6, 7
    cache, stats = _synthetic()
    policy = make_policy("adakv", budget, window=window, kernel=kernel, floor_alpha=floor_alpha)
    plans, state = policy.prefill(PrefillView(cache, stats, N, budget, window))
    capacity = round(budget * N)  # per KV head on average, window included
    for i, plan in enumerate(plans):
        pooled, raw = _naive_votes(stats[i]["window"][0], window, kernel)
        total = HEADS * (capacity - window)
        adaptive = _naive_flattened_counts(pooled, raw, total)
        expect = adaptive if floor_alpha == 0 else floored_counts(adaptive, total, floor_alpha, high=N - window)
        assert state.head_counts[i] == expect
        assert sum(expect) == total  # the layer's total is SnapKV's
        assert len(set(expect)) > 1  # heads voting differently keep different counts
        keep = plan.keep[0]
        for h in range(HEADS):  # each head: its own top c_h by its votes, then the window; padding first
            row = keep[h]
            real = row[row >= 0]
            assert int((row < 0).sum()) == keep.shape[-1] - (expect[h] + window)
            assert real[-window:].tolist() == list(range(N - window, N))
            naive = sorted(sorted(range(N - window), key=lambda j: (-pooled[h][j], -raw[h][j], j))[: expect[h]])
            assert real[:-window].tolist() == naive


def test_floor_keeps_every_head_above_the_safeguard():
    counts = floored_counts([40, 0, 0, 0], 40, 0.2, high=100)
    assert sum(counts) == 40 and min(counts) >= int(0.2 * 10)
    assert floored_counts([40, 0, 0, 0], 40, 0.0, high=100, low=0) == [40, 0, 0, 0]


def test_padded_cache_counts_kept_entries_and_masks_empty_slots():
    cache, stats = _synthetic()
    policy = make_policy("adakv", 0.3, window=6, floor_alpha=0.0)
    plans, state = policy.prefill(PrefillView(cache, stats, N, 0.3, 6))
    full = [layer.keys.clone() for layer in cache.layers]
    apply_plans(cache, plans)
    capacity = round(0.3 * N)
    assert cache.lengths() == [capacity] * LAYERS  # entries per KV head on average
    per_entry = 2 * DIM * 4
    assert cache.nbytes() == LAYERS * HEADS * capacity * per_entry  # the entries kept, not the padded tensors
    assert cache.stored_nbytes() > cache.nbytes()
    for layer, keys in zip(cache.layers, full):
        mask = layer.key_mask()
        assert mask is not None and torch.equal(mask, layer.positions >= 0)
        held = layer.positions >= 0
        assert torch.all(layer.keys[~held] == 0) and not layer.is_image[~held].any()
        # every held entry is the key computed for its position
        expect = keys.gather(2, layer.positions.clamp_min(0)[..., None].expand(-1, -1, -1, DIM))
        torch.testing.assert_close(layer.keys[held], expect[held])
    masks = cache.key_masks(2)
    assert set(masks) == set(range(LAYERS)) and masks[0].shape[-1] == cache.layers[0].length + 2


def test_budget_one_keeps_everything_without_empty_slots():
    cache, stats = _synthetic()
    plans, _ = make_policy("adakv", 1.0, window=6).prefill(PrefillView(cache, stats, N, 1.0, 6))
    assert all(p is None for p in plans)


def test_engine_reports_per_head_counts_and_bytes(tiny_qwen2, noise_image):
    """On a model with grouped KV heads: the event's per-layer count is the mean over heads, its bytes the kept
    entries; a follow-up appends to every head; a batched run equals the method alone."""
    engine = Engine(tiny_qwen2)
    knobs = {"adakv": {"window": 8}}
    together = engine.new_session(noise_image, PROMPT, ["full", "snapkv", "adakv"], 0.3,
                                  GenerationSettings(max_new_tokens=5), knobs)
    done = {ev.method: ev for ev in together.run() if getattr(ev, "kind", None) == "done"}
    cache = together.states["adakv"].cache
    bytes_per_entry = 2 * tiny_qwen2.head_dim * 4
    held = sum(int((layer.positions >= 0).sum()) for layer in cache.layers)
    assert done["adakv"].kv_bytes == held * bytes_per_entry
    assert done["adakv"].kept_per_layer == done["snapkv"].kept_per_layer  # the same total per layer
    counts = [(layer.positions[0] >= 0).sum(-1).tolist() for layer in cache.layers]
    assert any(len(set(c)) > 1 for c in counts), counts  # heads hold different counts
    alone = engine.new_session(noise_image, PROMPT, ["adakv"], 0.3, GenerationSettings(max_new_tokens=5), knobs)
    list(alone.run())
    assert alone.states["adakv"].turn_ids == together.states["adakv"].turn_ids
    before = [(layer.positions[0] >= 0).sum(-1) for layer in cache.layers]
    list(together.follow_up("and the colours?"))
    after = [(layer.positions[0] >= 0).sum(-1) for layer in together.states["adakv"].cache.layers]
    grown = [a - b for a, b in zip(after, before)]
    assert all(len(set(g.tolist())) == 1 and int(g[0]) > 0 for g in grown)  # every head grew alike


def test_equal_memory_holds_the_layer_total(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["adakv"], 0.3, GenerationSettings(max_new_tokens=8),
                                             {"adakv": {"window": 8}}, budget_mode="equal_memory")
    events = [ev for ev in session.run() if getattr(ev, "kind", None) in ("token", "done")]
    for ev in events:
        assert ev.kept_per_layer == [round(0.3 * ev.full_len)] * tiny_llama.num_layers, (ev.step, ev.kept_per_layer)
    n = session.prefill.prompt_tokens
    for layer in session.states["adakv"].cache.layers:
        pos = layer.positions[0]
        assert ((pos == 0).any(-1) & (pos == n - 1).any(-1)).all()  # sink and last prompt token in every head
        assert (pos == session.states["adakv"].true_len - 1).any(-1).all()  # the newest token too
