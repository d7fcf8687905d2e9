"""Random draws from the comparison's seed: the same seed keeps the same prompt entries (batched, alone, in both
budget and query modes), another seed keeps others; one draw per layer, shared by every KV head."""
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.policies.random_pruning import draw

PROMPT = "Describe the image in a few words."


def _run(loaded, image, seed, budget=0.4, **modes):
    settings = GenerationSettings(max_new_tokens=3, seed=seed)
    session = Engine(loaded).new_session(image, PROMPT, ["full", "random"], budget, settings, **modes)
    events = list(session.run())
    assert not [e.error for e in events if getattr(e, "error", None)]
    return session


def _prompt_kept(session, name="random") -> list[list[int]]:
    """Per layer, the prompt positions the method's cache holds (the same in every KV head)."""
    state = session.states[name]
    n = session.prefill.prompt_tokens
    out = []
    for layer in state.cache.layers:
        pos = layer.positions[0]  # [Hkv, T]
        assert bool((pos == pos[:1]).all()), "every KV head keeps the same entries"
        out.append([p for p in pos[0].tolist() if p < n])
    return out


def test_the_same_seed_draws_the_same_entries_and_another_seed_others(tiny_llama, noise_image):
    first, again, other = (_run(tiny_llama, noise_image, seed) for seed in (5, 5, 6))
    assert _prompt_kept(first) == _prompt_kept(again)
    assert _prompt_kept(first) != _prompt_kept(other)
    assert first.states["random"].turn_ids == again.states["random"].turn_ids
    assert first.states["random"].policy.seed == 5 and other.states["random"].policy.seed == 6
    n = first.prefill.prompt_tokens
    for kept in _prompt_kept(first):  # round(r·N) per layer, the sink and the last prompt token among them
        assert len(kept) == round(0.4 * n) and kept[0] == 0 and kept[-1] == n - 1
    state = first.states["random"]
    assert {f.key: f.value for f in state.policy.facts(state.policy_state)}["seed"] == 5  # shown in the panel


def test_the_draw_is_the_documented_one(tiny_llama, noise_image):
    """Layer l keeps the sink, the last prompt token and the others with the highest noise of row l of one
    CPU draw of [L, N] seeded with the comparison's seed."""
    session = _run(tiny_llama, noise_image, 11, budget=0.3)
    n, layers = session.prefill.prompt_tokens, tiny_llama.num_layers
    noise = draw(11, layers, n)
    capacity = round(0.3 * n)
    for i, kept in enumerate(_prompt_kept(session)):
        others = sorted(range(1, n - 1), key=lambda j: -float(noise[i, j]))[: capacity - 2]
        assert kept == sorted([0, n - 1] + others)


@pytest.mark.parametrize("modes", [{"time_alone": True}, {"budget_mode": "equal_memory", "time_alone": True},
                                   {"query_agnostic": True, "time_alone": True}])
def test_batched_equals_alone_in_every_mode(tiny_qwen2, noise_image, modes):
    session = _run(tiny_qwen2, noise_image, 3, **modes)
    record = session.results()["random"]
    assert record["status"] == "done"
    alone = Engine(tiny_qwen2).new_session(noise_image, PROMPT, ["random"], 0.4,
                                           GenerationSettings(max_new_tokens=3, seed=3), **modes)
    list(alone.run())
    assert alone.states["random"].turn_ids == session.states["random"].turn_ids
    assert _prompt_kept(alone) == _prompt_kept(session)
    if modes.get("budget_mode") == "equal_memory":  # held at about r·N_t, by the same draw
        state = session.states["random"]
        for length in state.cache.lengths():
            assert abs(length - 0.4 * state.true_len) <= 1.5


def test_the_seed_is_not_a_knob(tiny_llama):
    from prefixkv_core.policies import PolicyError, make_policy

    with pytest.raises(PolicyError, match="no knob"):
        make_policy("random", 0.3, seed=4)
    assert set(make_policy("random", 0.3).knobs()) == {"sinks", "recent"}
    assert torch.equal(draw(1, 2, 5), draw(1, 2, 5)) and not torch.equal(draw(1, 2, 5), draw(2, 2, 5))
