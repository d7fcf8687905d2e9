"""SparseMM: per-head budgets from visual-head scores against a naive reference of the reference's rule (a uniform
floor, the rest of the model's pool by normalised scores), SnapKV's average-pooled votes within each head, the
scores read from a calibration file through `resolve`, the calibration's hit rule on a scene, and the method through
the engine (without scores it says so and keeps every head the same count)."""
import json
import math

import numpy as np
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.calibrate_heads import head_hits, named_object, object_tokens
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import EMPTY_SLOT, PrefillView, ResolveContext
from prefixkv_core.policies.sparsemm import NO_SCORES
from prefixkv_core.policies import visual_heads
from prefixkv_core.testing import synthetic_prompt_cache

N, W, LAYERS, HEADS = 40, 4, 3, 2
PROMPT = "describe the picture in detail and name every object you can see in it"


def _naive_counts(scores, budget, share=0.1):
    """The reference's per-head capacities, with the rounding spread so the model's total is exact."""
    per_head = round(budget * N) - W
    floor = int(per_head * share)
    total = per_head * LAYERS * HEADS
    pool = total - floor * LAYERS * HEADS
    flat = [x / sum(scores) for x in scores]
    raw = [floor + pool * x for x in flat]
    counts = [math.floor(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))[: total - sum(counts)]:
        counts[i] += 1
    return [counts[l * HEADS:(l + 1) * HEADS] for l in range(LAYERS)]


def _naive_pooled(votes, kernel=5):
    v = [0.0] + list(votes[1:])
    half = kernel // 2
    out = [sum(v[j + d] for d in range(-half, half + 1) if 0 <= j + d < len(v)) / kernel for j in range(len(v))]
    out[0] = math.inf
    return out


@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_head_counts_and_kept_entries_follow_the_reference_rule(budget):
    cache, stats = synthetic_prompt_cache(n=N, n_layers=LAYERS, h=HEADS, seed=5)
    scores = [3.0, 1.0, 0.5, 0.5, 2.0, 1.0]
    policy = make_policy("sparsemm", budget, window=W, head_scores=scores)
    plans, state = policy.prefill(PrefillView(cache, stats, N, budget, W))
    expect = _naive_counts(scores, budget)
    assert state.head_counts == expect
    assert sum(map(sum, state.head_counts)) == (round(budget * N) - W) * LAYERS * HEADS
    for i, plan in enumerate(plans):
        for h in range(HEADS):
            pooled = _naive_pooled(stats[i]["window"][0, h, : N - W].tolist())
            raw = stats[i]["window"][0, h].tolist()
            order = sorted(range(N - W), key=lambda j: (-pooled[j], -raw[j], j))
            want = sorted(order[: expect[i][h]]) + list(range(N - W, N))
            got = [p for p in plan.keep[0, h].tolist() if p != EMPTY_SLOT]
            assert got == want, (i, h)


def test_scores_come_from_the_calibration_file(tmp_path, monkeypatch):
    monkeypatch.setattr(visual_heads, "HEADS_ROOT", tmp_path)
    import prefixkv_core.policies.sparsemm as sparsemm

    monkeypatch.setattr(sparsemm, "load_head_scores",
                        lambda slug, layers: visual_heads.load_head_scores(slug, layers, root=tmp_path))
    visual_heads.write_head_scores("some-model", "Some model", [[1.0, 2.0], [0.0, 3.0]], {"num_samples": 2},
                                   root=tmp_path)
    policy = make_policy("sparsemm", 0.3).resolve(ResolveContext("some-model", "Some model", 2, 0.3))
    assert policy.head_scores == (1.0, 2.0, 0.0, 3.0)
    assert make_policy("sparsemm", 0.3).resolve(ResolveContext("other", "Other", 2, 0.3)).head_scores == ()
    with pytest.raises(ValueError, match="the model has 3 layers"):
        visual_heads.load_head_scores("some-model", 3, root=tmp_path)
    saved = json.loads((tmp_path / "some-model.json").read_text())
    assert saved["layers"] == 2 and saved["kv_heads"] == 2 and saved["num_samples"] == 2


def test_the_embedded_model_ships_its_scores():
    from prefixkv_core.models.embedded import EMBEDDED_SLUG

    found = visual_heads.load_head_scores(EMBEDDED_SLUG, 30)
    assert found is not None and len(found.scores) == 30
    flat = np.asarray(found.scores).ravel()
    assert (flat >= 0).all() and flat.max() > 0 and flat.std() > 0  # measured, not uniform


def test_a_naming_word_makes_its_object_the_target_of_a_hit():
    from scenes import render_scene

    from prefixkv_core.models.layout import GridView, ImageLayout

    scene = render_scene(3)
    layout = ImageLayout((GridView("patches", 4, 4),), scene.image.size)
    targets = object_tokens(layout, scene.objects, torch.arange(10, 26))
    for obj, target in zip(scene.objects, targets):
        assert target and all(10 <= p < 26 for p in target)
        cell = min(range(16), key=lambda k: math.hypot((k % 4 + 0.5) / 4 - obj.cx, (k // 4 + 0.5) / 4 - obj.cy))
        assert 10 + cell in target  # the patch nearest the object's centre is on it
    first = scene.objects[0]
    assert named_object(" " + first.shape.capitalize(), scene.objects) in (
        0, None)  # None when another object has the same shape
    assert named_object("a", scene.objects) is None
    scores = np.zeros((2, 2))
    stats = {0: {"last_query": torch.tensor([[[0.1, 0.9, 0.0], [0.9, 0.1, 0.0]]])},
             1: {"last_query": torch.tensor([[[0.0, 0.2, 0.8], [0.2, 0.7, 0.1]]])}}
    head_hits(stats, {1}, 0.5, scores)
    assert scores.tolist() == [[0.5, 0.0], [0.0, 0.5]]


def test_without_scores_it_says_so_and_runs_as_snapkv_with_average_pooling(tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["sparsemm", "snapkv"], 0.4,
                                             GenerationSettings(max_new_tokens=3),
                                             {"sparsemm": {"window": 4},
                                              "snapkv": {"window": 4, "kernel": 5, "pooling": "avg"}})
    list(session.run())
    mm, snap = session.states["sparsemm"], session.states["snapkv"]
    assert NO_SCORES in mm.policy_state.notes
    for a, b in zip(mm.cache.layers, snap.cache.layers):
        assert torch.equal(a.positions, b.positions)
    assert mm.turn_ids == snap.turn_ids


def test_calibration_writes_what_sparsemm_reads(tiny_llama, tmp_path):
    from prefixkv_core.__main__ import build_parser
    from prefixkv_core.calibrate_heads import calibrate_heads

    path = calibrate_heads(tiny_llama, samples=2, max_new_tokens=6, progress=False, root=tmp_path)
    saved = json.loads(path.read_text())
    assert saved["num_samples"] == 2 and saved["calibration_samples"][0].startswith("scene:")
    found = visual_heads.load_head_scores(tiny_llama.slug, tiny_llama.num_layers, root=tmp_path)
    assert found is not None and len(found.scores) == tiny_llama.num_layers
    assert all(x >= 0 for row in found.scores for x in row)
    args = build_parser().parse_args(["calibrate-heads", "--model", "embedded", "--samples", "3"])
    assert args.samples == 3 and args.func.__name__ == "cmd_calibrate_heads"
