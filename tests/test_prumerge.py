"""PruMerge+ on every LLaVA family (anyres included): the interquartile outliers, the spatial samples and the
merges written out by hand from the paper and the reference's rule, the features the language model gets equal to
those sums of the tower's own features, the adaptive count, and the method on Qwen's and InternVL's towers."""
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.prumerge import prumerge_crop
from prefixkv_core.testing import build_tiny_family

from test_visionzip import reduced_beside_the_tower

PROMPT = "describe the picture in detail"


def _percentile(xs, p):
    s = sorted(xs)
    rank = p / 100 * (len(s) - 1)
    lo = int(rank)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (rank - lo)


def _naive_rows(scores, keys, has_cls, keep, neighbours=32):
    """One crop by hand -> the output rows as {token: weight} dicts, in the order fed."""
    first = 1 if has_cls else 0
    a = [float(x) for x in scores[first:]]
    n = len(a)
    q1, q3 = _percentile(a, 25), _percentile(a, 75)
    outliers = max(1, sum(x > q3 + 1.5 * (q3 - q1) for x in a))
    ranked = sorted(range(n), key=lambda j: (-a[j], j))
    if keep is None:
        chosen = ranked[:outliers]
        stride = int(int(1 / (outliers / n)) / 3)
        chosen += [j for j in range(0, n - 1, max(1, stride)) if j not in chosen]
    else:
        chosen = ranked[: min(outliers, keep)]
        need = keep - len(chosen)
        if need > 0:
            chosen += [j for j in range(0, n - 1, max(1, (n - 1) // need)) if j not in chosen][:need]
            chosen += [j for j in ranked if j not in chosen][: keep - len(chosen)]
    k = keys[first:].float()
    unit = [v / v.norm() for v in k]
    rows = []
    for i in chosen:
        sims = sorted((j for j in range(n) if j != i), key=lambda j: -float(unit[i] @ unit[j]))[:neighbours]
        row = {first + j: a[j] for j in sims}
        row[first + i] = row.get(first + i, 0.0) + 1.0
        rows.append(row)
    pruned = [j for j in range(n) if j not in chosen]
    if pruned:
        rows.append({first + j: a[j] for j in pruned})
    return rows


@pytest.mark.parametrize("keep", [None, 3, 7])
def test_a_crop_is_the_naive_outliers_samples_and_merges(keep):
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(17, generator=g) ** 4  # a few strong patches
    scores[5] = 3.0
    keys = torch.randn(17, 6, generator=g)
    merge = prumerge_crop(scores, keys, True, keep, neighbours=4, mean=False)
    want = _naive_rows(scores, keys, True, keep, neighbours=4)
    assert len(merge.kinds) == len(want)
    for row, expect in zip(merge.weights, want):
        got = {int(j): float(row[j]) for j in row.nonzero().flatten()}
        assert got.keys() == expect.keys()
        for j in got:
            assert got[j] == pytest.approx(expect[j], rel=1e-5)
    if keep is not None:
        assert len(merge.kinds) == keep + 1  # the kept patches and the token of the pruned ones


def test_fed_tokens_are_the_naive_merges_of_the_towers_features(lm, picture):
    policy = make_policy("prumerge_plus", 0.5, budget_of="image", neighbours=6)
    reduced, is_image, patches, hidden, attention, keys, has_cls = reduced_beside_the_tower(lm, picture, policy)
    record = reduced.record
    n_img = int(is_image.sum())
    assert record.tokens == round(0.5 * n_img)
    kept = max(record.crops, record.tokens - record.crops)
    per_crop = [kept // record.crops + (1 if c < kept % record.crops else 0) for c in range(record.crops)]
    expected = []
    for c, k in enumerate(per_crop):  # contextual tokens: each crop's in turn, in the order the plan made them
        score = attention[c][0] if has_cls else attention[c].mean(dim=0)
        for row in _naive_rows(score, keys[c], has_cls, k, neighbours=6):
            expected.append(sum(w * hidden[c, j].float() for j, w in row.items()))
    with torch.inference_mode():
        projected = lm.model.model.multi_modal_projector(torch.stack(expected)[None])[0]
    fed = reduced.inputs_embeds[0][reduced.is_image[0]]
    torch.testing.assert_close(fed, projected, atol=1e-3, rtol=1e-3)


def test_the_adaptive_count_follows_the_image_not_the_budget(tiny_llama, noise_image):
    fed = []
    for budget in (0.2, 0.6):
        session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["prumerge_plus"], budget,
                                                 GenerationSettings(max_new_tokens=2),
                                                 {"prumerge_plus": {"budget_of": "adaptive"}})
        list(session.run())
        state = session.states["prumerge_plus"]
        fed.append(state.policy.image_token_sources(state.policy_state).tokens)
    assert fed[0] == fed[1]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl", "internvl"])
def test_it_runs_on_qwen_and_internvl_towers(family, picture):
    lm = build_tiny_family(family)
    session = Engine(lm).new_session(picture, PROMPT, ["full", "prumerge_plus", "h2o"], 0.5,
                                     GenerationSettings(max_new_tokens=2), {"prumerge_plus": {"budget_of": "image"}})
    pre = list(session.run())[0]
    state = session.states["prumerge_plus"]
    assert state.error is None and state.finished
    sources = state.policy.image_token_sources(state.policy_state)
    assert sources.tokens < pre.image_tokens
    _, merged = sources.project([1.0] * sources.tokens)
    assert int((merged > 0).sum()) > 0  # the overlay marks the patches merged in
