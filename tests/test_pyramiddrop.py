"""PyramidDrop: the stage layers and counts of the reference's LLaVA-1.5 setting, λ fitted to the budget, and an own
prefill whose every stage keeps the image tokens the last prompt token attends to most (a naive ranking of what
the forward recorded, and for the first stage a plain eager forward's attention). The staged forward equals a
masked one on every family (test_families, test_qwen_families, test_internvl, test_several_images,
test_qwen_video)."""
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import PrefillView
from prefixkv_core.policies.pyramiddrop import lambda_for, mean_cache, stage_counts, stage_layers

from test_fastv import _eager_last_query

PROMPT = "describe the picture in detail and name every object you can see in it"


def test_stages_follow_the_reference_setting():
    assert stage_layers(32, 4) == [8, 16, 24]  # LLaVA-1.5-7B: layer_list [8, 16, 24]
    assert stage_layers(40, 4) == [10, 20, 30]
    assert stage_layers(4, 4) == [1, 2, 3] and stage_layers(2, 4) == [1] and stage_layers(1, 4) == []
    assert stage_counts(576, 0.5, 3) == [288, 144, 72]  # the reference's int(576 · 0.5^s)


def _naive_mean(n, image, layers, num_layers, lam):
    per_layer = []
    for layer in range(num_layers):
        stage = sum(1 for k in layers if k <= layer)
        per_layer.append(n - image + int(image * lam ** stage))
    return sum(per_layer) / num_layers


@pytest.mark.parametrize("budget", [0.3, 0.55, 0.8, 0.97])
def test_lambda_is_the_largest_whose_pyramid_fits_the_budget(budget):
    n, image, layers, num_layers = 700, 576, [8, 16, 24], 32
    lam = lambda_for(budget, n, image, layers, num_layers)
    assert mean_cache(n, image, layers, num_layers, lam) == pytest.approx(_naive_mean(n, image, layers, num_layers, lam))
    fits = [x / 1000 for x in range(1001) if _naive_mean(n, image, layers, num_layers, x / 1000) <= budget * n]
    if fits:
        assert max(fits) - 1e-3 <= lam and _naive_mean(n, image, layers, num_layers, lam) <= budget * n
    else:
        assert lam == 0.0


def test_every_stage_keeps_the_image_tokens_the_last_query_attends_to_most(tiny, noise_image):
    inputs = encode(tiny, noise_image, format_prompt(tiny, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == tiny.image_token_id
    n, n_img = ids.shape[1], int(is_image.sum())
    policy = make_policy("pyramiddrop", 0.6, budget_of="image")
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
    stats = runner.policy_stats(policy, own.stats, n)
    layers = stage_layers(tiny.num_layers, 4)
    assert len(layers) == 3  # several stages on the tiny model
    counts = [int(n_img * 0.6 ** s) for s in (1, 2, 3)]
    assert 0 < counts[-1] < counts[0] < n_img
    image = set(is_image[0].nonzero().flatten().tolist())
    still_in = list(range(n))
    eager = _eager_last_query(tiny, inputs, layers[0] - 1)
    for stage, (layer, keep) in enumerate(zip(layers, counts)):
        # naive: the last query's attention in layer K_s - 1 over the tokens still in, averaged over heads
        recorded = stats[layer - 1]["last_query"][0].float().mean(dim=0).tolist()
        assert len(recorded) == len(still_in)
        if stage == 0:  # the first stage ranks what a plain forward's layer K_1 - 1 attends to
            torch.testing.assert_close(torch.tensor(recorded), eager, atol=1e-5, rtol=1e-4)
        ranked = sorted((j for j, p in enumerate(still_in) if p in image), key=lambda j: (-recorded[j], j))
        still_in = sorted({p for p in still_in if p not in image} | {still_in[j] for j in ranked[:keep]})
        for held in own.cache.layers[layer: (layers + [tiny.num_layers])[stage + 1]]:
            assert held.positions[0, 0].tolist() == still_in
    assert own.cache.layers[0].length == n
    plans, state = policy.prefill(PrefillView(own.cache, stats, n, 0.6, 0))
    assert plans == [None] * tiny.num_layers  # its own prefill already left the dropped tokens behind
    assert state.image_kept == counts and state.layers == layers


def test_planned_on_a_full_prefill_it_keeps_what_its_own_prefill_computes(tiny, noise_image):
    """Planned on a cache whose layers hold every token, the first stage keeps the tokens its own prefill keeps."""
    inputs = encode(tiny, noise_image, format_prompt(tiny, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == tiny.image_token_id
    n = ids.shape[1]
    policy = make_policy("pyramiddrop", 0.5, budget_of="image", stages=2)
    with tracked_attention_enabled(tiny.model):
        own = runner.own_prefill(tiny.model, policy, ids, is_image, inputs["pixel_values"], tiny.num_layers,
                                 tiny.device, tiny.image_token_id)
        shared = runner.prefill(tiny.model, ids, is_image, inputs["pixel_values"], [policy], tiny.num_layers,
                                tiny.device)
    plans, _ = policy.prefill(PrefillView(shared.cache, runner.policy_stats(policy, shared.stats, n), n, 0.5, 0))
    k = stage_layers(tiny.num_layers, 2)[0]
    for i in range(tiny.num_layers):
        if i < k:
            assert plans[i] is None
        else:
            kept = shared.cache.layers[i].positions[0, 0][plans[i].keep[0, 0]]
            assert kept.tolist() == own.cache.layers[i].positions[0, 0].tolist()


@pytest.mark.parametrize("budget", [0.86, 0.95])  # the tiny prompt is mostly text: 0.81 at the least
def test_the_cache_mode_holds_the_budget_and_one_is_full(tiny_llama, noise_image, budget):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "pyramiddrop"], budget,
                                             GenerationSettings(max_new_tokens=3))
    events = list(session.run())
    n = session.prefill.prompt_tokens
    start = next(e for e in events if getattr(e, "method", None) == "pyramiddrop" and e.kind == "start")
    assert sum(start.kept_per_layer) / len(start.kept_per_layer) <= budget * n
    assert start.kept_per_layer == sorted(start.kept_per_layer, reverse=True)  # a pyramid
    assert start.kept_per_layer[0] == n
    facts = session.states["pyramiddrop"].policy.extras(session.states["pyramiddrop"].policy_state)
    assert "lambda" in facts and 0 < facts["lambda"] < 1
    whole = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "pyramiddrop"], 1.0,
                                           GenerationSettings(max_new_tokens=3))
    list(whole.run())
    assert whole.states["pyramiddrop"].turn_ids == whole.states["full"].turn_ids
    assert whole.states["pyramiddrop"].cache.lengths() == whole.states["full"].cache.lengths()


def test_a_budget_below_its_reach_drops_every_image_token_and_says_so(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["pyramiddrop"], 0.5,
                                             GenerationSettings(max_new_tokens=2))
    list(session.run())
    state = session.states["pyramiddrop"]
    n = session.prefill.prompt_tokens
    image = int(session.prefill.is_image.sum()) if hasattr(session.prefill, "is_image") else None
    lengths = [layer.length - (state.true_len - n) for layer in state.cache.layers]  # the prompt's entries
    assert lengths[0] == n and len(set(lengths[1:])) == 1 and lengths[1] < n
    if image is not None:
        assert lengths[1] == n - image
    assert any("not r = 50%" in note for note in state.policy_state.notes)
