"""Training sequences for the embedded model's vision tower equal what the engine feeds the model, and
only answer tokens are supervised (checked on the tiny model: same helpers, any LLaVA)."""
import random

import torch

from prefixkv_core.models import encode, format_prompt
from prefixkv_core.scenes import render_scene
from training import data


def test_first_turn_matches_the_processor(tiny_llama, noise_image):
    prompt = "What colour is the square?"
    want = encode(tiny_llama, noise_image, format_prompt(tiny_llama, prompt, with_image=True))["input_ids"][0]
    got = torch.tensor(data.first_turn_ids(tiny_llama, prompt))
    assert torch.equal(got, want)
    assert int((got == tiny_llama.image_token_id).sum()) == tiny_llama.image_seq_length


def test_only_answers_are_supervised(tiny_llama):
    turns = [("What colour is the square?", "red"), ("How many circles are there?", "2")]
    ids, sup = data.conversation(tiny_llama, turns)
    assert ids.shape == sup.shape
    tok = tiny_llama.tokenizer
    for k, (_, answer) in enumerate(turns, start=1):
        marked = ids[sup == k].tolist()
        assert tok.decode(marked[: len(tok(answer, add_special_tokens=False)["input_ids"])]) == answer
        assert marked[-1] == tok.eos_token_id  # the end of each answer is learnt too
    assert not bool((sup[ids == tiny_llama.image_token_id] != 0).any())


def test_scene_turns_single_turn_and_targets():
    scene = render_scene(5)
    turns = data.scene_turns(scene, random.Random(0), with_description=True)
    assert len(turns) == len(scene.qa) + 1
    t = data.vision_targets(scene)
    assert int((t["colour"] > 0).sum()) == len(scene.objects) == int(t["total"])
    assert int(t["counts"].sum()) == len(scene.objects)
