"""One pass of the vision tower per comparison: the shared prefill and every own prefill of the first turn (FastV,
DART, VisionZip, Downsample) read the same image features, on every LLaVA family, and every method's answer is the
one it gives run alone (`batched=False`: each method's prefill encodes the image itself, as before). Downsample
on the anyres families resizes the image before the tower: its smaller image is one more pass, its own."""
import contextlib

import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding.vision_tower import TurnImage, prompt_embeds

PROMPT = "describe the picture in detail"
OWN = ["fastv", "dart", "visionzip", "downsample"]  # the methods with a prefill of their own
METHODS = ["full", "snapkv", *OWN]
SETTINGS = dict(max_new_tokens=5, ignore_eos=True)


@contextlib.contextmanager
def tower_passes(lm):
    """Counts the vision tower's forward calls while the block runs."""
    calls = []
    handle = lm.model.model.vision_tower.register_forward_hook(lambda *args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def _resized(session) -> int:
    """1 when Downsample encoded a resized image of its own (a pass of the tower on it), else 0."""
    state = session.states.get("downsample")
    return int(bool(state is not None and state.policy_state is not None and state.policy_state.resized))


def _run(lm, picture, methods, budget, **how):
    session = Engine(lm).new_session(picture, PROMPT, methods, budget, GenerationSettings(**SETTINGS), **how)
    with tower_passes(lm) as calls:
        list(session.run())
    return session, len(calls)


@pytest.mark.parametrize("budget", [0.5, 1.0])
def test_one_tower_pass_and_the_answers_alone(lm, picture, one_torch_thread, budget):
    """At 0.5 every own prefill reduces the image; at 1.0 VisionZip and Downsample feed it as the model does."""
    batched, passes = _run(lm, picture, METHODS, budget)
    assert passes == 1 + _resized(batched)
    alone, alone_passes = _run(lm, picture, METHODS, budget, batched=False)
    assert alone_passes == len(METHODS)  # each method's own prefill encodes the image itself
    for name in METHODS:
        mine, ref = batched.states[name], alone.states[name]
        assert mine.error is None and ref.error is None, (name, mine.error, ref.error)
        assert mine.turn_ids == ref.turn_ids, name
        assert mine.prompt_len == ref.prompt_len and mine.reduced_by == ref.reduced_by, name
        assert torch.equal(mine.first_logits, ref.first_logits), name  # the same embeddings, to the bit
    assert batched.encoded.shared_image is None  # dropped once every method was prefilled


def test_timed_alone_each_method_encodes_the_image_itself(family_models, picture, one_torch_thread):
    lm = family_models["llava-interleave"]
    session = Engine(lm).new_session(picture, PROMPT, ["full", "fastv", "visionzip"], 0.5,
                                     GenerationSettings(**SETTINGS), time_alone=True)
    with tower_passes(lm) as calls:
        done = [ev for ev in session.run() if getattr(ev, "kind", None) == "done"]
    assert len(calls) == 1 + 3  # the comparison's one pass, then one per method timed alone
    batched = {ev.method: ev.text for ev in done if not ev.alone}
    alone = {ev.method: ev.text for ev in done if ev.alone}
    assert batched == alone and len(alone) == 3


def test_the_features_live_until_the_last_own_prefill(family_models, picture, one_torch_thread):
    """The own prefills run between decode steps: the shared pass is held (and counted in the session's memory)
    until the last of them, then dropped."""
    lm = family_models["llava-next"]
    session = Engine(lm).new_session(picture, PROMPT, ["full", "fastv", "visionzip"], 0.5,
                                     GenerationSettings(**SETTINGS))
    held = []
    for ev in session.run():
        if getattr(ev, "kind", None) == "token":
            image = session.encoded.shared_image
            held.append((ev.method, image is not None))
            if image is not None:
                assert session.cache_bytes() >= image.nbytes() > 0
    assert held[0] == ("full", True)  # Full streams before the own prefills ran
    assert not held[-1][1] and session.encoded.shared_image is None


def test_query_agnostic_shares_the_pass_too(family_models, picture, one_torch_thread):
    lm = family_models["llava-onevision"]
    batched, passes = _run(lm, picture, METHODS, 0.5, query_agnostic=True)
    alone, _ = _run(lm, picture, METHODS, 0.5, query_agnostic=True, batched=False)
    assert passes == 1 + _resized(batched) and _resized(batched)
    for name in METHODS:
        assert batched.states[name].turn_ids == alone.states[name].turn_ids, name


def test_an_eager_tower_records_on_its_own(family_models, picture, one_torch_thread):
    """An eager tower's recording computes its outputs itself: the model's own features then come from a plain
    pass, and the reductions read a recorded pass of their own (two passes, the same answers as alone)."""
    lm = family_models["llava-1.5"]
    lm.model.set_attn_implementation({"text_config": "sdpa", "vision_config": "eager"})
    try:
        batched, passes = _run(lm, picture, ["full", "fastv", "visionzip", "downsample"], 0.5)
        alone, _ = _run(lm, picture, ["full", "fastv", "visionzip", "downsample"], 0.5, batched=False)
    finally:
        lm.model.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
    assert passes == 2
    for name in batched.states:
        assert batched.states[name].turn_ids == alone.states[name].turn_ids, name


def test_prompt_embeds_are_the_models_own(lm, picture):
    """What the language model is fed equals what the model's forward builds from the ids and pixel values."""
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    image = TurnImage(lm.model, M.vision_inputs(inputs), record=True)
    seen = {}

    def record(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]

    handle = lm.model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.inference_mode():
            lm.model(**inputs)
    finally:
        handle.remove()
    mine = image.prompt_embeds(ids, ids == lm.image_token_id)
    assert torch.equal(mine, seen["embeds"])
    assert image.passes == 1 and image.features().recorded
    assert image.prompt_embeds(ids, ids == lm.image_token_id) is mine  # made once for the turn
    with pytest.raises(ValueError, match="do not match"):
        prompt_embeds(lm.model, ids, ids == lm.image_token_id, image.features().image[:-1])
