"""DART: its selection against a naive reference (plain Python: norms, cosine similarities, each pivot's share),
its own prefill equals a full forward with the dropped image tokens masked from layer K on, and the tokens it
drops are the ones the naive reference picks from a plain eager forward's hidden states and the keys of layer K-1."""
import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import PolicyError, make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.policies.dart import dart_keep, dart_row
from prefixkv_core.policies.fastv import kept_image_tokens
from prefixkv_core.testing import held_positions, kept_entry_masks, masked_reference_cache

PROMPT = "describe the picture in detail and name every object you can see in it"


def _naive_dart(keys, hidden, image, keep, image_pivots, text_pivots, rule):
    """The image tokens DART keeps in one row, written out: norms and cosines by hand, pivots in token order."""
    n = hidden.shape[0]
    k, x = keys.tolist(), hidden.tolist()

    def norm(j):
        flat = [v for head in k for v in head[j]]
        return sum(abs(v) for v in flat) if rule == "key_l1" else math.sqrt(sum(v * v for v in flat))

    def cos(a, b):
        dot = sum(p * q for p, q in zip(x[a], x[b]))
        return dot / (math.sqrt(sum(p * p for p in x[a])) * math.sqrt(sum(q * q for q in x[b])))

    images = [j for j in range(n) if image[j]]
    keep = min(keep, len(images))
    top = lambda pool, count: sorted(sorted(pool, key=lambda j: (-norm(j), j))[:count])
    image_piv = top(images, min(image_pivots, keep))
    pivots = image_piv + top(range(images[-1] + 1, n), text_pivots)
    rest = keep - len(image_piv)
    kept, candidates = set(image_piv), [j for j in images if j not in image_piv]
    for i, p in enumerate(pivots):
        quota = rest // len(pivots) + (1 if i < rest % len(pivots) else 0)
        chosen = sorted(candidates, key=lambda j: (cos(j, p), j))[:quota]
        kept |= set(chosen)
        candidates = [j for j in candidates if j not in chosen]
    return sorted(kept)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rule", ["key_l1", "key_l2"])
@pytest.mark.parametrize("keep,image_pivots,text_pivots", [(12, 4, 4), (3, 4, 4), (9, 2, 0), (30, 1, 8), (40, 4, 4)])
def test_dart_row_matches_naive(seed, rule, keep, image_pivots, text_pivots):
    g = torch.Generator().manual_seed(seed)
    n = 44
    keys, hidden = torch.randn(2, n, 6, generator=g), torch.randn(n, 10, generator=g)
    image = torch.zeros(n, dtype=torch.bool)
    image[3:35] = True
    kept, used_image, used_text = dart_row(keys, hidden, image, keep, image_pivots, text_pivots, rule)
    want = _naive_dart(keys, hidden, image, keep, image_pivots, text_pivots, rule)
    assert kept.nonzero().flatten().tolist() == want
    assert len(want) == min(keep, 32) and used_image == min(image_pivots, keep) and used_text == text_pivots


def test_dart_keep_keeps_all_text_the_first_token_and_as_many_image_tokens_per_row():
    g = torch.Generator().manual_seed(5)
    keys, hidden = torch.randn(2, 2, 30, 4, generator=g), torch.randn(2, 30, 8, generator=g)
    image = torch.zeros(2, 30, dtype=torch.bool)
    image[:, 4:28] = True
    kept, (image_piv, text_piv) = dart_keep(keys, hidden, image, 7, 4, 4, "key_l1")
    assert (kept | image).all() and kept[:, 0].all() and (image_piv, text_piv) == (4, 2)  # 2 tokens after the image
    assert (kept & image).sum(dim=1).tolist() == [7, 7]
    for b in range(2):
        assert (kept[b] & image[b]).nonzero().flatten().tolist() == _naive_dart(keys[b], hidden[b], image[b], 7, 4, 4,
                                                                                "key_l1")
    assert not (dart_keep(keys, hidden, image, 0, 4, 4, "key_l1")[0] & image).any()


def _inputs(lm, image):
    inputs = encode(lm, image, format_prompt(lm, PROMPT, with_image=True))
    return inputs, inputs["input_ids"], inputs["input_ids"] == lm.image_token_id


def _eager_hidden(lm, inputs, layer):
    """Layer `layer`'s output hidden states through the final norm, from a plain forward."""
    with torch.inference_mode():
        out = lm.model(**inputs, output_hidden_states=True)
        return lm.model.get_decoder().norm(out.hidden_states[layer + 1]).float()


@pytest.mark.parametrize("layer,budget_of,budget,rule", [(2, "image", 0.25, "key_l1"), (1, "image", 0.5, "key_l2"),
                                                         (2, "cache", 0.9, "key_l1")])
def test_dropped_tokens_match_the_naive_reference_on_a_plain_forward(tiny, noise_image, layer, budget_of, budget,
                                                                     rule):
    inputs, ids, is_image = _inputs(tiny, noise_image)
    n, n_img = ids.shape[1], int(is_image.sum())
    policy = make_policy("dart", budget, layer=layer, budget_of=budget_of, pivot_rule=rule)
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
        plain = runner.prefill(tiny.model, ids, is_image, inputs["pixel_values"], [], tiny.num_layers, tiny.device)
    plans, state = policy.prefill(PrefillView(own.cache, runner.policy_stats(policy, own.stats, n), n, budget, 0))
    keep = kept_image_tokens(budget, n, n_img, tiny.num_layers, layer, budget_of)
    assert 0 < keep < n_img and state.image_kept == keep
    hidden = _eager_hidden(tiny, inputs, layer - 1)
    torch.testing.assert_close(own.stats[layer - 1]["hidden"], hidden, atol=1e-5, rtol=1e-5)
    keys = plain.cache.layers[layer - 1].keys  # layers before K: the plain prefill's keys
    torch.testing.assert_close(own.stats[layer - 1]["keys"], keys.float())
    kept_image = _naive_dart(keys[0], hidden[0], is_image[0], keep, 4, 4, rule)
    expect = sorted(set(range(n)) - set(is_image[0].nonzero().flatten().tolist()) | set(kept_image))
    assert [layer.length for layer in own.cache.layers] == [n] * layer + [len(expect)] * (tiny.num_layers - layer)
    assert held_positions(own.cache, plans) == [list(range(n))] * layer + [expect] * (tiny.num_layers - layer)
    assert any(f.key == "pivots" and "4 image + 4 text" in f.value for f in policy.facts(state))


def test_own_prefill_equals_a_full_forward_masked_from_layer_k(tiny, noise_image):
    inputs, ids, is_image = _inputs(tiny, noise_image)
    n, layer = ids.shape[1], 2
    policy = make_policy("dart", 0.4, budget_of="image")
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
        plans, _ = policy.prefill(PrefillView(own.cache, runner.policy_stats(policy, own.stats, n), n, 0.4, 0))
        logits, reference = masked_reference_cache(tiny, ids, is_image, inputs["pixel_values"], layer,
                                                   held_positions(own.cache, plans)[layer])
        torch.testing.assert_close(own.logits, logits, atol=1e-5, rtol=1e-5)
        compressed = own.cache.clone()
        apply_plans(compressed, plans)
        token = torch.tensor([[9]])
        on_compressed, _ = runner.forward_group(tiny.model, compressed, token, n, AttentionProbe())
        on_masked, _ = runner.forward_group(tiny.model, reference, token, n,
                                            AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    torch.testing.assert_close(on_compressed, on_masked, atol=1e-4, rtol=1e-4)


def test_cache_budget_and_facts_through_the_engine(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["dart", "full"], 0.9,
                                             GenerationSettings(max_new_tokens=3))
    events = list(session.run())
    pre = events[0]
    n, n_img, layers = pre.prompt_tokens, pre.image_tokens, tiny_llama.num_layers
    start = next(e for e in events if getattr(e, "method", None) == "dart" and e.kind == "start")
    keep = kept_image_tokens(0.9, n, n_img, layers, 2, "cache")
    assert start.kept_image_per_layer == [n_img, n_img] + [keep] * (layers - 2)
    assert abs(sum(start.kept_per_layer) / layers - 0.9 * n) <= layers / 2
    assert "image tokens kept from layer 2 on" in str(start.extras["facts"]) and "pivots" in start.extras


def test_missing_statistics_are_refused():
    policy = make_policy("dart", 0.3)
    with pytest.raises(PolicyError, match="keys and hidden states of layer K-1"):
        policy.choose({}, torch.ones(1, 5, dtype=torch.bool), 2)
