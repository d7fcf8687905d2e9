"""SparseVLM: the reference's pruning layers and counts, its raters, its density-peak clusters against naive loops,
and an own prefill whose every stage keeps what a naive re-run of the rule over the recorded statistics keeps,
with each recycled token's hidden state the mean of its cluster's. Without recycling, its staged forward equals
a masked one."""
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.sparsevlm import (density_peak_clusters, mean_cache, pruning_layers, recycled_count,
                                              setting_for, stage_shares, stages_for, text_raters)
from prefixkv_core.testing import layered_reference_cache
from test_fastv import _eager_attention

PROMPT = "describe the picture in detail and name every object you can see in it"


def test_the_reference_layers_and_counts():
    assert pruning_layers(32) == [2, 6, 15]  # LLaVA-1.5-7B's pruning_loc
    assert pruning_layers(4) == [0, 1, 2] and pruning_layers(1) == []
    for tokens, counts in {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}.items():
        assert [round(s * 576) for s in stage_shares(tokens / 576)] == list(counts)
    # "192": 300 kept of 576, 83 of the 276 others recycled into 9 clusters; then 200 + 4, 110 + 3
    stages = stages_for(576, 192 / 576, [2, 6, 15])
    assert [(s.kept, s.recycled, s.clusters) for s in stages] == [(300, 83, 9), (200, 33, 4), (110, 29, 3)]
    assert [s.image_out for s in stages] == [309, 204, 113]
    assert recycled_count(0) == (0, 0) and recycled_count(1) == (1, 1) and recycled_count(276) == (83, 9)
    assert stage_shares(1.0) == [1.0, 1.0, 1.0] and stage_shares(0.0) == [0.0, 0.0, 0.0]


def _naive_mean(n, image, stages, num_layers):
    per_layer = []
    for layer in range(num_layers):
        held = image
        for s in stages:
            if s.after_layer < layer:
                held = s.image_out
        per_layer.append(n - image + held)
    return sum(per_layer) / num_layers


@pytest.mark.parametrize("budget", [0.3, 0.5, 0.8, 0.97])
def test_the_setting_is_the_largest_whose_layers_fit_the_budget(budget):
    n, image, layers, num_layers = 700, 576, [2, 6, 15], 32
    x = setting_for(budget, n, image, layers, num_layers)
    stages = stages_for(image, x, layers)
    assert mean_cache(n, image, stages, num_layers) == pytest.approx(_naive_mean(n, image, stages, num_layers))
    fits = [k / 500 for k in range(501) if _naive_mean(n, image, stages_for(image, k / 500, layers), num_layers)
            <= budget * n]
    assert max(fits, default=0.0) <= x + 1e-9 and _naive_mean(n, image, stages, num_layers) <= budget * n


def _naive_raters(embeds, is_image):
    image = [i for i in range(len(is_image)) if is_image[i]]
    text = [j for j in range(image[0], len(is_image)) if not is_image[j]]
    shares = torch.zeros(len(text))
    for i in image:
        sims = torch.tensor([float(embeds[i] @ embeds[j]) for j in text])
        shares += torch.exp(sims - sims.max()) / torch.exp(sims - sims.max()).sum()
    shares /= len(image)
    return {text[k] for k in range(len(text)) if shares[k] > shares.mean()}


def test_raters_are_the_text_after_the_image_its_tokens_find_most_relevant():
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(30, 6, generator=g)
    is_image = torch.zeros(30, dtype=torch.bool)
    is_image[4:16] = True
    got = text_raters(embeds, is_image)
    assert set(got.nonzero().flatten().tolist()) == _naive_raters(embeds, is_image)
    assert not got[:16].any()  # the text before the image never rates
    is_image[16:] = True  # no text after the image: the last token rates alone
    assert text_raters(embeds, is_image).nonzero().flatten().tolist() == [29]


def _naive_dpc(x, c):
    m = x.shape[0]
    d = [[float(torch.dist(x[i], x[j])) / x.shape[1] ** 0.5 for j in range(m)] for i in range(m)]
    density = [torch.exp(-torch.tensor(sorted(row)[:c]) .pow(2).mean()).item() for row in d]
    higher = lambda j, i: density[j] > density[i] or (density[j] == density[i] and j < i)  # noqa: E731
    top = max(max(row) for row in d)
    sep = [min([d[i][j] for j in range(m) if higher(j, i)], default=top) for i in range(m)]
    score = [sep[i] * density[i] for i in range(m)]
    centres = sorted(range(m), key=lambda i: (-score[i], i))[:c]
    assign = [centres.index(i) if i in centres else min(range(c), key=lambda k: (d[i][centres[k]], k))
              for i in range(m)]
    return centres, assign


@pytest.mark.parametrize("m,c", [(12, 2), (30, 4), (7, 7), (5, 1)])
def test_density_peak_clusters_equal_naive_loops(m, c):
    x = torch.randn(m, 5, generator=torch.Generator().manual_seed(m + c))
    centres, assignment = density_peak_clusters(x, c)
    want_centres, want_assign = _naive_dpc(x, c)
    assert centres.tolist() == want_centres and assignment.tolist() == want_assign


def _inputs(lm, image):
    inputs = encode(lm, image, format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    return inputs, ids, ids == lm.image_token_id


def _run_own(lm, policy, inputs, ids, is_image):
    with tracked_attention_enabled(lm.model):
        return runner.own_prefill(lm.model, policy, ids, is_image, inputs["pixel_values"], lm.num_layers, lm.device,
                                  lm.image_token_id)


@pytest.mark.parametrize("budget", [0.4, 0.7])
def test_every_stage_keeps_what_the_rule_keeps_and_recycles_cluster_means(tiny, noise_image, budget):
    inputs, ids, is_image = _inputs(tiny, noise_image)
    n = ids.shape[1]
    policy = make_policy("sparsevlm", budget, budget_of="image")
    layers = tiny.model.get_decoder().layers
    seen_in, seen_out, handles = {}, {}, []
    for i, layer in enumerate(layers):  # what each layer computed (its first norm's input: after the stage's cut)
        handles.append(layer.input_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: seen_in.__setitem__(i, a[0].float())))
        handles.append(layer.register_forward_hook(
            lambda m, a, o, i=i: seen_out.__setitem__(i, (o[0] if isinstance(o, tuple) else o).float())))
    try:
        own = _run_own(tiny, policy, inputs, ids, is_image)
    finally:
        for h in handles:
            h.remove()
    state = policy.plan(n, is_image, tiny.num_layers)
    assert [s.after_layer for s in state.stages] == pruning_layers(tiny.num_layers)
    assert any(s.clusters for s in state.stages)
    raters = text_raters(seen_in[0][0], is_image[0])
    assert raters.any()
    # the first stage's ranking: the raters' rows of a plain eager forward's attention, summed, heads averaged
    eager = _eager_attention(tiny, inputs, state.stages[0].after_layer)
    torch.testing.assert_close(own.stats[state.stages[0].after_layer]["rated"][0].float().mean(dim=0),
                               eager[raters].sum(dim=0), atol=1e-5, rtol=1e-4)
    image = is_image[0].clone()
    still_in = list(range(n))
    for stage in state.stages:
        k = stage.after_layer
        rated = own.stats[k]["rated"][0].float().mean(dim=0)
        assert rated.shape[0] == len(still_in)
        flags = [bool(image[p]) for p in still_in]
        ranked = sorted((j for j in range(len(still_in)) if flags[j]), key=lambda j: (-float(rated[j]), j))
        kept, others = ranked[:stage.kept], ranked[stage.kept:stage.kept + stage.recycled]
        centres, assign = _naive_dpc(seen_out[k][0, others], stage.clusters) if others else ([], [])
        going = sorted({j for j in range(len(still_in)) if not flags[j]} | set(kept) | {others[c] for c in centres})
        new_positions = [still_in[j] for j in going]
        assert own.cache.layers[k + 1].positions[0, 0].tolist() == new_positions
        for c, centre in enumerate(centres):  # a recycled token: its cluster's mean, at its centre's place
            members = [others[i] for i, a in enumerate(assign) if a == c]
            mean = seen_out[k][0, members].mean(dim=0)
            torch.testing.assert_close(seen_in[k + 1][0, going.index(others[centre])], mean, atol=1e-4, rtol=1e-4)
        still_in = new_positions
    assert own.cache.layers[0].length == n


def test_without_recycling_the_staged_forward_equals_a_masked_one(tiny_llama, noise_image):
    lm = tiny_llama
    inputs, ids, is_image = _inputs(lm, noise_image)
    policy = make_policy("sparsevlm", 0.4, budget_of="image", recycle=False)
    own = _run_own(lm, policy, inputs, ids, is_image)
    with tracked_attention_enabled(lm.model):
        logits, reference = layered_reference_cache(lm, ids, is_image, inputs["pixel_values"], own.cache)
    torch.testing.assert_close(own.logits, logits, atol=1e-4, rtol=1e-4)
    assert [layer.length for layer in own.cache.layers][-1] < ids.shape[1]


@pytest.mark.parametrize("budget", [0.86, 0.95])
def test_the_cache_mode_holds_the_budget_and_one_is_full(tiny_llama, noise_image, budget):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "sparsevlm"], budget,
                                             GenerationSettings(max_new_tokens=3))
    events = list(session.run())
    n = session.prefill.prompt_tokens
    start = next(e for e in events if getattr(e, "method", None) == "sparsevlm" and e.kind == "start")
    assert sum(start.kept_per_layer) / len(start.kept_per_layer) <= budget * n
    assert start.kept_per_layer[0] == n and start.kept_per_layer[-1] < n
    facts = session.states["sparsevlm"].policy.extras(session.states["sparsevlm"].policy_state)
    assert facts["recycled"] > 0 and 0 < facts["setting"] < 1
    whole = Engine(tiny_llama).new_session(noise_image, PROMPT, ["full", "sparsevlm"], 1.0,
                                           GenerationSettings(max_new_tokens=3))
    list(whole.run())
    assert whole.states["sparsevlm"].turn_ids == whole.states["full"].turn_ids
    assert whole.states["sparsevlm"].cache.lengths() == whole.states["full"].cache.lengths()
