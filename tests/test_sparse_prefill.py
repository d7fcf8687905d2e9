"""ZipVL's sparse prefill attention: the probe sums, the important tokens and the attention over them against naive
loops on small tensors; with every token important it is the dense prefill; through the engine its panel says what
share of each layer attended."""
import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.kv.sparse_prefill import SparsePrefill, sparse_attention, visibility_counts

PROMPT = "describe the picture in detail and name every object you can see in it"


def _naive(query, key, value, scale, queries, tau):
    """By hand: per probe query and head, softmax over the keys it sees; sums per KV head (mean of its query heads);
    the fewest tokens holding tau of the head-mean, picked by sum / visible probes; causal attention among them."""
    _, h, n, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    sums = torch.zeros(hkv, n)
    for head in range(h):
        for i in queries.tolist():
            logits = [float(query[0, head, i] @ key[0, head // g, j]) * scale for j in range(i + 1)]
            top = max(logits)
            z = sum(math.exp(x - top) for x in logits)
            for j in range(i + 1):
                sums[head // g, j] += math.exp(logits[j] - top) / z / g
    score = sums.mean(dim=0)
    ordered = sorted(score.tolist(), reverse=True)
    total, acc, p = sum(ordered), 0.0, 0
    while p < n and acc < tau * total - 1e-6:
        acc += ordered[p]
        p += 1
    seen = visibility_counts(n, queries).clamp_min(1)
    ranked = sorted(range(n), key=lambda j: -float(score[j] / seen[j]))[:p]
    chosen = sorted(set(ranked) | {n - 1})
    out = torch.zeros_like(query)
    for head in range(h):
        for a, i in enumerate(chosen):
            keys = chosen[: a + 1]
            w = torch.softmax(torch.tensor([float(query[0, head, i] @ key[0, head // g, j]) * scale for j in keys]), 0)
            out[0, head, i] = sum(w[b] * value[0, head // g, j] for b, j in enumerate(keys))
    return out, sums, chosen


@pytest.mark.parametrize("tau", [0.6, 0.9])
def test_sparse_attention_equals_the_naive_loops(tau):
    g = torch.Generator().manual_seed(0)
    query, key, value = torch.randn(1, 4, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), \
        torch.randn(1, 2, 12, 8, generator=g)
    queries = torch.tensor([3, 7, 10, 11])
    out, stats = sparse_attention(query, key, value, 8 ** -0.5, SparsePrefill(tau, queries))
    want_out, want_sums, chosen = _naive(query, key, value, 8 ** -0.5, queries, tau)
    assert stats["important"][0].tolist() == chosen and len(chosen) < 12
    # two rows at once: each its own important tokens, as alone
    both, two = sparse_attention(torch.cat([query, query.flip(2)]), torch.cat([key, key.flip(2)]),
                                 torch.cat([value, value.flip(2)]), 8 ** -0.5, SparsePrefill(tau, queries))
    torch.testing.assert_close(both[:1], out)
    flipped, alone = sparse_attention(query.flip(2), key.flip(2), value.flip(2), 8 ** -0.5, SparsePrefill(tau, queries))
    torch.testing.assert_close(both[1:], flipped)
    assert [x for x in two["important"][1].tolist() if x >= 0] == alone["important"][0].tolist()
    torch.testing.assert_close(stats["subset"][0], want_sums, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)


def test_with_every_token_important_it_is_the_dense_prefill(tiny_llama, noise_image):
    whole = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "zipvl"], 0.5,
                                           GenerationSettings(max_new_tokens=1), {"zipvl": {"tau": 1.0}})
    list(whole.run())
    zipvl = whole.states["zipvl"]
    assert zipvl.policy.extras(zipvl.policy_state)["attended"] == [1.0] * tiny_llama.num_layers
    torch.testing.assert_close(zipvl.first_logits, whole.states["full"].first_logits, atol=1e-4, rtol=1e-4)


def test_a_sparse_prefill_attends_with_fewer_tokens_and_says_so(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "zipvl"], 0.5,
                                             GenerationSettings(max_new_tokens=3), {"zipvl": {"tau": 0.8}})
    list(session.run())
    zipvl = session.states["zipvl"]
    assert zipvl.error is None and len(zipvl.turn_ids) == 3
    attended = zipvl.policy.extras(zipvl.policy_state)["attended"]
    assert all(0 < a < 1 for a in attended)
    n = session.prefill.prompt_tokens
    assert [layer.length for layer in zipvl.cache.layers] == [zipvl.true_len] * tiny_llama.num_layers  # all kept
    assert zipvl.true_len == n + 2
    dense = Engine(tiny_llama).new_session(noise_image, PROMPT, ["zipvl"], 0.5, GenerationSettings(max_new_tokens=3),
                                           {"zipvl": {"tau": 0.8, "sparse_prefill": False}})
    list(dense.run())
    assert "attended" not in dense.states["zipvl"].policy.extras(dense.states["zipvl"].policy_state)


def test_the_ttft_benchmark_times_the_rows_asked_for(tiny_llama):
    """`benchmarks/sparse_prefill.py` times Full, ZipVL's two prefills and the `--also` methods at their budget on
    one clip, each from the same prompt; an unknown method is refused."""
    from benchmarks import sparse_prefill as bench

    timed = bench.rows_timed(["fastv", "zipvl"], 0.5)
    assert list(timed) == ["full", "zipvl-sparse", "zipvl-dense", "fastv r=0.5"]
    assert timed["fastv r=0.5"] == ("fastv", {}, 0.5) and timed["full"][2] == 1.0
    rows = bench.measure(Engine(tiny_llama), [4], 1, 2, 0, ["fastv"], 0.5)
    assert [r["row"] for r in rows] == list(timed)[:3] + ["fastv r=0.5"]
    assert all(r["ttft_s"] > 0 and r["frames"] == 4 and r["prompt_tokens"] == rows[0]["prompt_tokens"] for r in rows)
    assert "fastv r=0.5" in bench.table(rows)
    with pytest.raises(SystemExit):
        bench.main(["--model", "tiny-llama", "--also", "nosuch"])
