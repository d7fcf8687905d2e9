"""benchmarks/fastv_ranking.py: the query-agnostic prefix it ranks from is the one the engine prefills before the
question, and its counts stay within what each ranking can keep."""
from benchmarks.fastv_ranking import measure, prompt_inputs
from prefixkv_core.policies.fastv import RANKS
from prefixkv_core.session.prefill import encode_prompt
from prefixkv_core.session.visuals import TurnVisuals
from scenes import render_scene, split_seeds


def test_query_agnostic_prefix_is_the_engines(tiny_llama):
    scene = render_scene(split_seeds("test", 1)[0])
    question = scene.qa[0].question
    cut = prompt_inputs(tiny_llama, scene.image, question, query_agnostic=True)
    whole = prompt_inputs(tiny_llama, scene.image, question, query_agnostic=False)
    engine = encode_prompt(tiny_llama, TurnVisuals(images=[scene.image], prompt=question, n_images=1),
                           chat_template=True, query_agnostic=True, max_new_tokens=4)
    assert cut["input_ids"].shape[1] == engine.split < whole["input_ids"].shape[1]
    assert cut["input_ids"][0].tolist() == whole["input_ids"][0, : engine.split].tolist()
    assert int((cut["input_ids"] == tiny_llama.image_token_id).sum()) == engine.n_image


def test_measure_counts_are_bounded(tiny_llama):
    was = tiny_llama.model.config._attn_implementation
    seeds = split_seeds("test", 2)
    for agnostic in (False, True):
        res = measure(tiny_llama, seeds, [1, 2], keep=5, cover=0.25, query_agnostic=agnostic)
        prompts = 2 if agnostic else sum(len(render_scene(s).qa) for s in seeds)
        for k in (1, 2):
            assert res[k]["prompts"] == prompts
            for rank in RANKS:
                assert 0 <= res[k][rank] <= min(5, res[k]["objects"]) + 1e-9
            assert 0 <= res[k]["last_query_mass_on_objects"] <= 1 + 1e-6
    assert tiny_llama.model.config._attn_implementation == was  # the shared model is left as it was
