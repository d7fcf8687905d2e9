"""Random draws from the comparison's seed and the request: the same seed and request keep the same prompt entries
(batched, alone, in both budget and query modes), another seed or another question keeps others; one draw per
layer, shared by every KV head. The image-token control (random_drop) draws the same way."""
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.policies.base import draw_seed
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
    shown = {f.key: f.value for f in state.policy.facts(state.policy_state)}["seed"]  # shown in the panel
    assert shown == draw_seed(5, first.visuals.fingerprint()) == state.policy.draw_seed


def test_every_question_gets_a_draw_of_its_own(tiny_llama, noise_image):
    """The draw depends on the request (prompt and pixels): two questions about one image, or one question about
    two images, keep different entries at the same seed; the fingerprint of one request is stable."""
    settings = GenerationSettings(max_new_tokens=1, seed=5)
    engine = Engine(tiny_llama)

    def kept(image, prompt):
        session = engine.new_session(image, prompt, ["random"], 0.4, settings)
        list(session.run())
        return _prompt_kept(session), session.visuals.fingerprint()

    base, key = kept(noise_image, PROMPT)
    assert kept(noise_image, PROMPT) == (base, key)
    assert kept(noise_image, PROMPT.replace("few", "couple of"))[0] != base
    other = noise_image.transpose(0)
    assert kept(other, PROMPT)[0] != base


def test_the_draw_is_the_documented_one(tiny_llama, noise_image):
    """Layer l keeps the sink, the last prompt token and the others with the highest noise of row l of one
    CPU draw of [L, N] seeded with the comparison's seed mixed with the request's fingerprint."""
    session = _run(tiny_llama, noise_image, 11, budget=0.3)
    n, layers = session.prefill.prompt_tokens, tiny_llama.num_layers
    noise = draw(draw_seed(11, session.visuals.fingerprint()), layers, n)
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


def test_random_drop_draws_image_tokens_only_once_for_every_later_layer(tiny_llama, noise_image):
    """random_drop: layers 0 … K-1 hold every token; layers K and later the text and one drawn set of image tokens
    (the same in every later layer), drawn from the seed and the request; budget_of=image keeps r of them."""
    from prefixkv_core.policies.random_drop import image_draw

    settings = GenerationSettings(max_new_tokens=2, seed=9)
    session = Engine(tiny_llama).new_session(noise_image, PROMPT, ["random_drop"], 0.5, settings,
                                             knobs={"random_drop": {"budget_of": "image"}})
    list(session.run())
    state = session.states["random_drop"]
    assert state.error is None
    pre = session.prefill
    n, image = pre.prompt_tokens, [i for i, f in enumerate(pre.is_image) if f]
    kept = _prompt_kept(session, "random_drop")
    layer = state.policy.layer
    assert all(k == list(range(n)) for k in kept[:layer])
    later = {tuple(k) for k in kept[layer:]}
    assert len(later) == 1
    held = set(later.pop())
    assert set(range(n)) - set(image) <= held  # every text token stays
    noise = image_draw(draw_seed(9, session.visuals.fingerprint()), n)
    chosen = sorted(image, key=lambda i: -float(noise[i]))[: round(0.5 * len(image))]
    assert held & set(image) == set(chosen)
    assert state.policy.control is None and state.policy.is_control
    from prefixkv_core.policies import REGISTRY

    assert REGISTRY["fastv"].control == REGISTRY["dart"].control == REGISTRY["visionzip"].control == "random_drop"
    assert REGISTRY["snapkv"].control == "random" and REGISTRY["random"].is_control


@pytest.mark.parametrize("query_agnostic", [False, True])
def test_several_draws_in_one_comparison_are_the_comparisons_of_the_next_seeds(tiny_llama, noise_image,
                                                                              query_agnostic):
    """draws=N runs each control that draws at random N times as rows "random", "random~1" …, with the same knobs;
    row k keeps what a comparison with seed + k keeps and answers as it does; the other methods run once."""
    from prefixkv_core.policies import row_label, split_draw

    knobs = {"random_drop": {"budget_of": "image"}}
    settings = GenerationSettings(max_new_tokens=3, seed=5)
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, ["h2o", "random", "random_drop"], 0.4, settings, knobs,
                                 query_agnostic=query_agnostic, draws=3)
    assert list(session.states) == ["h2o", "random", "random~1", "random~2", "random_drop", "random_drop~1",
                                    "random_drop~2"]
    list(session.run())
    results = session.results()
    assert results["random~2"]["label"] == row_label("random~2", session.states["random"].policy) == "Random (draw 3)"
    for k in (1, 2):
        alone = engine.new_session(noise_image, PROMPT, ["random", "random_drop"], 0.4,
                                   GenerationSettings(max_new_tokens=3, seed=5 + k), knobs,
                                   query_agnostic=query_agnostic)
        list(alone.run())
        for method in ("random", "random_drop"):
            row = f"{method}~{k}"
            assert split_draw(row) == (method, k)
            assert session.states[row].policy == alone.states[method].policy  # its seed, knobs and request
            assert _prompt_kept(session, row) == _prompt_kept(alone, method)
            assert session.states[row].turn_ids == alone.states[method].turn_ids
    assert _prompt_kept(session, "random") != _prompt_kept(session, "random~1")


@pytest.mark.parametrize("draws", [0, 65, 2.0, True, "3"])
def test_draws_out_of_range_are_refused(tiny_llama, noise_image, draws):
    from prefixkv_core import EngineError

    with pytest.raises(EngineError, match="draws must be a whole number from 1 to 64"):
        Engine(tiny_llama).new_session(noise_image, PROMPT, ["random"], 0.4, draws=draws)


def test_row_names_of_draws():
    from prefixkv_core.policies import draw_row, split_draw

    assert draw_row("random", 0) == "random" and draw_row("random", 4) == "random~4"
    assert split_draw("random_drop~12") == ("random_drop", 12) and split_draw("h2o") == ("h2o", 0)
    assert split_draw("odd~name") == ("odd~name", 0)


def test_the_cli_runs_several_draws(tmp_path, noise_image, capsys):
    import json

    from prefixkv_core.__main__ import main

    image = tmp_path / "img.png"
    noise_image.save(image)
    out = tmp_path / "out.json"
    assert main(["compare", "--model", "tiny-llama", "--image", str(image), "--prompt", PROMPT, "--methods",
                 "h2o,random", "--budget", "0.4", "--max-new-tokens", "2", "--draws", "3", "--quiet",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["methods"]) == ["h2o", "random", "random~1", "random~2"]
    assert data["methods"]["random~1"]["label"] == "Random (draw 2)"
    assert main(["compare", "--model", "tiny-llama", "--prompt", PROMPT, "--methods", "random", "--draws", "0",
                 "--quiet"]) != 0
    assert "draws must be a whole number" in capsys.readouterr().err
