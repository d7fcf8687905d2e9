"""VisPruner on every LLaVA family (anyres included): the important tokens are the naive top-k of the CLS attention
(or, without a CLS token, of the attention received), the diverse ones the reference's rounds of duplicate removal
written out by hand, the language model sees exactly those patches' features in raster order, and it runs on
Qwen's and InternVL's towers beside the other methods."""
import math

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.vispruner import diverse_tokens
from prefixkv_core.testing import build_tiny_family

from test_visionzip import reduced_beside_the_tower

PROMPT = "describe the picture in detail"


def _naive_diverse(candidates, keys, count):
    """The reference's loop, one token at a time in plain Python."""
    unit = [[x / math.sqrt(sum(y * y for y in k)) for x in k] for k in keys.tolist()]
    residual = list(candidates)
    while count > 0:
        drop = min(8, len(residual) - count)
        if drop <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        score = [max((sum(p * q for p, q in zip(unit[i], unit[j])) for j in b), default=0.0) for i in a]
        order = sorted(range(len(a)), key=lambda i: (-score[i], i))
        residual = [a[i] for i in order[drop:]] + b
    return residual[:count]


@pytest.mark.parametrize("n,count", [(40, 5), (41, 12), (9, 8), (6, 0)])
def test_duplicate_removal_is_the_references_loop(n, count):
    keys = torch.randn(n + 3, 6, generator=torch.Generator().manual_seed(n))
    candidates = torch.randperm(n + 3, generator=torch.Generator().manual_seed(1))[:n]
    assert diverse_tokens(candidates, keys, count).tolist() == _naive_diverse(candidates.tolist(), keys, count)


def test_fed_tokens_are_the_naive_important_and_diverse_patches(lm, picture):
    policy = make_policy("vispruner", 0.5, budget_of="image", important=0.4)
    reduced, is_image, patches, hidden, attention, keys, has_cls = reduced_beside_the_tower(lm, picture, policy)
    record = reduced.record
    n_img = int(is_image.sum())
    assert record.tokens == round(0.5 * n_img)
    per_crop = [record.tokens // record.crops + (1 if c < record.tokens % record.crops else 0)
                for c in range(record.crops)]
    chosen = []
    for c, k in enumerate(per_crop):
        first = 1 if has_cls else 0
        score = attention[c][0] if has_cls else attention[c].mean(dim=0)
        ranked = sorted(range(first, attention.shape[1]), key=lambda j: (-float(score[j]), j))
        important = ranked[: int(k * 0.4)]
        diverse = _naive_diverse(ranked[len(important):], keys[c], k - len(important))
        chosen.append(sorted(important + diverse))
    expected = []
    for view in dict.fromkeys(patches.views):  # the order the language model sees them: raster order per view
        crops = [c for c, v in enumerate(patches.views) if v == view]
        order = sorted((int(patches.raster[c][j - has_cls]) if len(crops) > 1 else j, c, j)
                       for c in crops for j in chosen[c])
        expected += [hidden[c, j].float() for _, c, j in order]
    assert set(record.kinds) <= {"dominant", "diverse"} and record.kinds.count("diverse") > 0
    with torch.inference_mode():
        projected = lm.model.model.multi_modal_projector(torch.stack(expected)[None])[0]
    fed = reduced.inputs_embeds[0][reduced.is_image[0]]
    torch.testing.assert_close(fed, projected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl", "internvl"])
def test_it_runs_on_qwen_and_internvl_towers(family, picture):
    lm = build_tiny_family(family)
    session = Engine(lm).new_session(picture, PROMPT, ["full", "vispruner", "h2o"], 0.5,
                                     GenerationSettings(max_new_tokens=2), {"vispruner": {"budget_of": "image"}})
    pre = list(session.run())[0]
    state = session.states["vispruner"]
    assert state.error is None and state.finished
    sources = state.policy.image_token_sources(state.policy_state)
    assert sources.tokens < pre.image_tokens and sources.counts["diverse"] > 0
    kept, _ = sources.project([1.0] * sources.tokens)
    assert int((kept > 0).sum()) > 0  # the overlay marks the patches it kept
