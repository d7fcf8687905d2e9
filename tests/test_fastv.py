"""FastV: its own prefill, whose layers from K on compute the kept tokens only, equals a full forward whose layers
from K on have the dropped image tokens masked out; the dropped tokens are the ones layer K-1's last query attends
to least (a plain eager forward as reference), and the cache it decodes on holds exactly the kept tokens in those
layers."""
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine, GenerationSettings

from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import PrefillView, apply_plans
from prefixkv_core.policies.base import Fact, ResolveContext
from prefixkv_core.policies.fastv import EMBEDDED_NOTE, kept_image_tokens
from prefixkv_core.models.embedded import EMBEDDED_SLUG
from prefixkv_core.testing import held_positions, kept_entry_masks, masked_reference_cache

PROMPT = "describe the picture in detail and name every object you can see in it"


def _inputs(lm, image):
    inputs = encode(lm, image, format_prompt(lm, PROMPT, with_image=True))
    return inputs, inputs["input_ids"], inputs["input_ids"] == lm.image_token_id


def _eager_last_query(lm, inputs, layer):
    """The last prompt token's attention in `layer`, averaged over heads, from a plain eager forward."""
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = lm.model(**inputs, output_attentions=True)
    finally:
        lm.model.set_attn_implementation("sdpa")
    return out.attentions[layer][0, :, -1].float().mean(dim=0)


@pytest.mark.parametrize("layer,budget_of,budget", [(2, "image", 0.25), (1, "image", 0.5), (2, "cache", 0.9)])
def test_dropped_tokens_are_the_least_attended_by_the_last_query(tiny, noise_image, layer, budget_of, budget):
    inputs, ids, is_image = _inputs(tiny, noise_image)
    n, n_img = ids.shape[1], int(is_image.sum())
    policy = make_policy("fastv", budget, layer=layer, budget_of=budget_of)
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
    plans, state = policy.prefill(PrefillView(own.cache, runner.policy_stats(policy, own.stats, n), n, budget, 0))
    keep = kept_image_tokens(budget, n, n_img, tiny.num_layers, layer, budget_of)
    assert 0 < keep < n_img and state.image_kept == keep
    # naive: rank the image tokens by the eager attention of layer K-1's last query, keep the top `keep`
    attention = _eager_last_query(tiny, inputs, layer - 1)
    image_positions = is_image[0].nonzero().flatten().tolist()
    ranked = sorted(image_positions, key=lambda j: -float(attention[j]))
    expect = sorted(set(range(n)) - set(image_positions) | set(ranked[:keep]))
    # layers 0 … K-1 keep every token; the later ones never computed the dropped ones
    assert [layer.length for layer in own.cache.layers] == [n] * layer + [len(expect)] * (tiny.num_layers - layer)
    assert held_positions(own.cache, plans) == [list(range(n))] * layer + [expect] * (tiny.num_layers - layer)


def _eager_attention(lm, inputs, layer):
    """[N, N] one layer's attention, averaged over heads, from a plain eager forward."""
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = lm.model(**inputs, output_attentions=True)
    finally:
        lm.model.set_attn_implementation("sdpa")
    return out.attentions[layer][0].float().mean(dim=0)


@pytest.mark.parametrize("rank", ["mean_received", "random"])
def test_other_rankings_keep_the_naive_top_image_tokens(tiny, noise_image, rank):
    """mean_received: the attention each image token receives, summed over every prompt query and averaged over
    heads (eager forward); random: a uniform draw seeded with the comparison's seed. Both keep the top `keep`."""
    inputs, ids, is_image = _inputs(tiny, noise_image)
    n, n_img, layer, budget = ids.shape[1], int(is_image.sum()), 2, 0.3
    policy = make_policy("fastv", budget, layer=layer, budget_of="image", rank=rank).resolve(
        ResolveContext("tiny", "tiny", tiny.num_layers, budget, seed=7))
    assert policy.seed == 7 and not policy.prefill_stats(n).last_query
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
    view = PrefillView(own.cache, runner.policy_stats(policy, own.stats, n), n, budget, 0)
    plans, state = policy.prefill(view)
    assert EMBEDDED_NOTE not in state.notes  # the note is the embedded model's only
    assert EMBEDDED_NOTE in dataclasses.replace(policy, model_slug=EMBEDDED_SLUG).prefill(view).state.notes
    keep = kept_image_tokens(budget, n, n_img, tiny.num_layers, layer, "image")
    if rank == "mean_received":
        score = _eager_attention(tiny, inputs, layer - 1).sum(dim=0).tolist()
    else:
        score = torch.rand(n, generator=torch.Generator().manual_seed(7)).tolist()
    image_positions = is_image[0].nonzero().flatten().tolist()
    ranked = sorted(image_positions, key=lambda j: -score[j])
    expect = sorted(set(range(n)) - set(image_positions) | set(ranked[:keep]))
    assert held_positions(own.cache, plans)[layer:] == [expect] * (tiny.num_layers - layer)
    facts = {f.key: f.value for f in policy.facts(state)}
    assert facts["image_kept_share"] == pytest.approx(keep / n_img) and facts["rank"] == rank.replace("_", " ")


def test_facts_say_the_share_of_image_tokens_kept(tiny_llama, noise_image):
    """The panel shows R beside r: the share of the image tokens kept, and the share dropped (FastV's paper's R)."""
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["fastv"], 0.9, GenerationSettings(max_new_tokens=2))
    done = [e for e in session.run() if getattr(e, "kind", None) == "done"][0]
    n, n_img = done.full_len, done.kept_image_per_layer[0]
    keep = kept_image_tokens(0.9, n - 2, n_img, tiny_llama.num_layers, 2, "cache")
    assert done.extras["image_kept_share"] == pytest.approx(keep / n_img)
    texts = [Fact.from_dict(f).text() for f in done.extras["facts"]]
    assert f"R, the share of the image tokens kept = {keep / n_img:.0%} ({1 - keep / n_img:.0%} dropped, what FastV's paper calls R)" \
        in texts
    assert not any("embedded model" in t for t in texts)


@pytest.mark.parametrize("layer", [1, 2])
def test_own_prefill_equals_a_full_forward_masked_from_layer_k(tiny, noise_image, layer):
    inputs, ids, is_image = _inputs(tiny, noise_image)
    n = ids.shape[1]
    policy = make_policy("fastv", 0.4, layer=layer, budget_of="image")
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
        plans, _ = policy.prefill(PrefillView(own.cache, runner.policy_stats(policy, own.stats, n), n, 0.4, 0))
        kept = held_positions(own.cache, plans)[layer]
        logits, reference = masked_reference_cache(tiny, ids, is_image, inputs["pixel_values"], layer, kept)
        torch.testing.assert_close(own.logits, logits, atol=1e-5, rtol=1e-5)
        compressed = own.cache.clone()
        apply_plans(compressed, plans)
        for i, (mine, full) in enumerate(zip(compressed.layers, reference.layers)):
            assert mine.length == (n if i < layer else len(kept))
            torch.testing.assert_close(mine.keys, full.keys.gather(2, mine.positions[..., None].expand(
                -1, -1, -1, mine.keys.shape[-1])), atol=1e-5, rtol=1e-5)
        # decoding on the compressed cache == decoding on the masked full one
        token = torch.tensor([[9]])
        on_compressed, _ = runner.forward_group(tiny.model, compressed, token, n, AttentionProbe())
        on_masked, _ = runner.forward_group(tiny.model, reference, token, n,
                                            AttentionProbe(key_masks=kept_entry_masks(compressed, n)))
    torch.testing.assert_close(on_compressed, on_masked, atol=1e-4, rtol=1e-4)
    plain_layers = own.cache.layers[:layer]  # before K the own prefill is the plain one
    with tracked_attention_enabled(tiny.model):
        plain = runner.prefill(tiny.model, ids, is_image, inputs["pixel_values"], [], tiny.num_layers, tiny.device)
    for mine, theirs in zip(plain_layers, plain.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)


def test_cache_budget_sets_the_mean_over_layers(tiny_llama, noise_image):
    """budget_of = cache: the layers after K keep the text and as many image tokens as bring the mean to r·N."""
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["fastv", "full"], 0.9,
                                             GenerationSettings(max_new_tokens=3))
    events = list(session.run())
    pre = events[0]
    n, n_img, layers = pre.prompt_tokens, pre.image_tokens, tiny_llama.num_layers
    start = next(e for e in events if getattr(e, "method", None) == "fastv" and e.kind == "start")
    keep = kept_image_tokens(0.9, n, n_img, layers, 2, "cache")
    assert start.kept_per_layer == [n, n] + [n - n_img + keep] * (layers - 2)
    assert start.kept_image_per_layer == [n_img, n_img] + [keep] * (layers - 2)
    assert abs(sum(start.kept_per_layer) / layers - 0.9 * n) <= layers / 2
    assert start.full_len == n and start.kv_bytes < start.full_kv_bytes
    state = session.states["fastv"]
    assert state.prompt_len == n and state.reduced_by == 0
    assert "image tokens kept from layer 2 on" in str(start.extras["facts"])


def test_an_unreachable_budget_keeps_the_text_and_says_so(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["fastv"], 0.1, GenerationSettings(max_new_tokens=2))
    done = [e for e in session.run() if getattr(e, "kind", None) == "done"][0]
    assert done.kept_image_per_layer[2:] == [0] * (tiny_llama.num_layers - 2)
    assert any("not r = 10%" in n for n in done.extras["notes"])


def test_layer_k_past_the_model_drops_nothing(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["fastv", "full"], 0.3,
                                             GenerationSettings(max_new_tokens=4), {"fastv": {"layer": 64}})
    list(session.run())
    assert session.states["fastv"].turn_ids == session.states["full"].turn_ids
    assert any("nothing is dropped" in n for n in session.states["fastv"].policy.extras(
        session.states["fastv"].policy_state)["notes"])


def test_cli_lists_the_vlm_family_with_their_stages(capsys):
    from prefixkv_core.__main__ import main

    assert main(["methods"]) == 0
    blocks = {}
    for line in capsys.readouterr().out.splitlines():
        if not line.startswith(" "):
            name = line.split()[0]
            blocks[name] = line
        else:
            blocks[name] += "\n" + line
    expect = {"fastv": "prefill token reduction", "visionzip": "prefill token reduction", "adakv": "KV eviction",
              "full": "none", "lookm": "KV merging", "zipvl": "quantisation"}
    for name, stage in expect.items():
        assert f"stage: {stage};" in blocks[name], blocks[name]
    assert "--knob fastv.layer=2" in blocks["fastv"] and "--knob visionzip.budget_of=cache" in blocks["visionzip"]
    assert "--knob adakv.floor_alpha=0.2" in blocks["adakv"]


def test_the_plan_keeps_the_kept_tokens_entries_whatever_the_layer_holds():
    """From the entries' true positions: a layer that holds every token gets the kept ones' indices; a layer whose
    prefill left the others behind already holds exactly those, and needs no plan."""
    from prefixkv_core.policies.fastv import kept_tokens_plan

    kept = torch.tensor([[True, False, True, True, False, True]])
    plan = kept_tokens_plan(torch.arange(6)[None], kept)
    assert plan.keep.tolist() == [[[0, 2, 3, 5]]]
    assert kept_tokens_plan(torch.tensor([[0, 2, 3, 5]]), kept) is None
    assert kept_tokens_plan(torch.tensor([[0, 1, 2, 5]]), kept).keep.tolist() == [[[0, 2, 3]]]


@pytest.mark.parametrize("method", ["fastv", "dart"])
def test_rows_of_different_images_each_drop_their_own_tokens(tiny, noise_image, method):
    """Two prompts in one own prefill (the speed benchmark's batches): each row keeps the tokens its own image
    ranks, with the logits and the entries of that prompt's prefill alone."""
    other = Image.fromarray(255 - np.asarray(noise_image))
    policy = make_policy(method, 0.4, budget_of="image")
    prompts = [_inputs(tiny, image) for image in (noise_image, other)]
    with tracked_attention_enabled(tiny.model):
        alone = [runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                    tiny.device, tiny.image_token_id) for inputs, ids, is_image in prompts]
        _, ids, is_image = prompts[0]
        pixels = torch.cat([inputs["pixel_values"] for inputs, _, _ in prompts])
        both = runner.own_prefill(tiny.model, policy, ids.repeat(2, 1), is_image.repeat(2, 1), pixels,
                                  tiny.num_layers, tiny.device, tiny.image_token_id)
    torch.testing.assert_close(both.logits, torch.cat([a.logits for a in alone]), atol=1e-5, rtol=1e-5)
    for r, single in enumerate(alone):
        for mine, theirs in zip(both.cache.layers, single.cache.layers):
            assert mine.positions[r].tolist() == theirs.positions[0].tolist()
            torch.testing.assert_close(mine.keys[r], theirs.keys[0], atol=1e-5, rtol=1e-5)
    assert both.cache.layers[-1].positions[0].tolist() != both.cache.layers[-1].positions[1].tolist()
