"""Downsample as the benchmark draws it (`where = image`, the default where a family's token count follows the image
size: LLaVA-NeXT, OneVision, Qwen-VL): every image resized before the vision tower so that the processor makes
the most tokens not above its share; the method's prefill is the model's own forward of the resized prompt; the
record maps each fed token onto the original image tokens it covers. On fixed-resolution towers (LLaVA-1.5) the
default stays grid pooling after the projector, and `projector_in` pools the tower's features before it."""
import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.decoding.image_resize import SCALE_STEPS, scaled_size
from prefixkv_core.decoding.vision_tokens import reduce_image
from prefixkv_core.decoding.vision_tower import feature_layer
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models.families import FAMILY_INFO
from prefixkv_core.policies import make_policy
from prefixkv_core.policies.base import ResolveContext
from prefixkv_core.policies.downsample import pool_weights, where_for
from prefixkv_core.testing import save_tiny_family

PROMPT = "describe the picture in detail"
KNOBS = {"downsample": {"budget_of": "image"}}
# a picture large enough that every tiny family's processor makes more than its fewest tokens for it
PICTURE_SIZE = (150, 96)
BUDGET = 0.7  # of the image tokens: above the fewest tokens any scale of the picture takes on every tiny family


@pytest.fixture(scope="module")
def big_picture():

    rng = np.random.RandomState(3)
    return Image.fromarray(rng.randint(0, 256, (PICTURE_SIZE[1], PICTURE_SIZE[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen_models(tmp_path_factory):
    return {f: M.load_model(save_tiny_family(tmp_path_factory.mktemp(f), f), device="cpu")
            for f in ("qwen2-vl", "qwen3-vl")}


@pytest.fixture(params=["llava-next", "llava-onevision", "qwen2-vl", "qwen3-vl"])
def resizing(request, family_models, qwen_models):
    return (qwen_models if request.param.startswith("qwen") else family_models)[request.param]


def _forward(lm, image, text: str) -> torch.Tensor:
    """The model's own forward of the prompt with `image`: the last position's logits."""
    inputs = M.encode(lm, image, text)
    extra = {}
    if lm.family.startswith("qwen"):
        extra["mm_token_type_ids"] = (inputs["input_ids"] == lm.image_token_id).int()
    with torch.inference_mode():
        return lm.model(**inputs, **extra).logits[0, -1]


def test_the_scale_search():
    """The largest count not above the wanted, the larger scale on a tie; the fewest tokens when none is that few."""
    def count(w, h):
        return (w // 10) * (h // 10)

    assert scaled_size(count, 100, 50, 50) == (100, 50)
    w, h = scaled_size(count, 100, 50, 20)
    assert count(w, h) == 18 and (w, h) == max((w2, h2) for w2, h2 in
                                               ((round(100 * k / SCALE_STEPS), round(50 * k / SCALE_STEPS))
                                                for k in range(1, SCALE_STEPS + 1)) if count(w2, h2) == 18)
    assert count(*scaled_size(lambda w, h: 5 + count(w, h), 100, 50, 2)) == 0


def test_the_default_follows_the_family():
    for key, info in FAMILY_INFO.items():
        want = "image" if info.anyres else "projector_out"
        assert where_for(key) == want, key
        policy = make_policy("downsample", 0.5).resolve(ResolveContext("s", "n", 2, 0.5, family=key))
        assert policy.where == want and policy.resizes_image == (want == "image")
    assert where_for("") == "projector_out"
    assert make_policy("downsample", 0.5, where="projector_in").resolve(
        ResolveContext("s", "n", 2, 0.5, family="llava-next")).where == "projector_in"


def test_the_resized_image_takes_the_most_tokens_not_above_the_wanted(resizing, big_picture):
    lm = resizing
    session = Engine(lm).new_session(big_picture, PROMPT, ["downsample"], BUDGET,
                                     GenerationSettings(max_new_tokens=3), KNOBS)
    pre = list(session.run())[0]
    state = session.states["downsample"]
    assert state.error is None, state.error
    n_img = pre.image_tokens
    wanted = round(BUDGET * n_img)
    (size,) = state.policy_state.resized
    count = lm.image_tokens(*size)
    w, h = big_picture.size
    counts = [lm.image_tokens(max(1, round(w * k / SCALE_STEPS)), max(1, round(h * k / SCALE_STEPS)))
              for k in range(1, SCALE_STEPS + 1)]
    assert count <= wanted and count == max(c for c in counts if c <= wanted)
    assert count >= 0.5 * wanted  # close to it on these grids
    sources = state.policy_state.sources
    assert sources.tokens == count and sources.original_tokens == n_img and state.reduced_by == n_img - count
    assert state.prompt_len == pre.prompt_tokens - n_img + count
    facts = {f.key: f.value for f in state.policy.facts(state.policy_state)}
    assert facts["image_fed"] == count and "x" in facts["grid"]


def test_the_own_prefill_is_the_models_forward_of_the_resized_image(resizing, big_picture):
    lm = resizing
    session = Engine(lm).new_session(big_picture, PROMPT, ["full", "downsample"], 0.4,
                                     GenerationSettings(max_new_tokens=2), KNOBS)
    list(session.run())
    state = session.states["downsample"]
    (size,) = state.policy_state.resized
    text = M.format_prompt(lm, PROMPT, with_image=True)
    own = _forward(lm, big_picture.resize(size, Image.BICUBIC), text)
    torch.testing.assert_close(state.first_logits, own, atol=1e-4, rtol=1e-4)
    full = _forward(lm, big_picture, text)
    assert not torch.allclose(own, full, atol=1e-4)
    # contiguous positions: the cache holds 0 .. true_len - 1
    assert state.cache.layers[0].positions[0, 0].tolist() == list(range(state.true_len))


def test_batched_equals_alone(resizing, big_picture):
    settings = GenerationSettings(max_new_tokens=4)
    batched = Engine(resizing).new_session(big_picture, PROMPT, ["full", "random", "downsample", "snapkv"], 0.5,
                                           settings, KNOBS)
    list(batched.run())
    list(batched.follow_up("and the colours?"))
    alone = Engine(resizing).new_session(big_picture, PROMPT, ["downsample"], 0.5, settings, KNOBS)
    list(alone.run())
    list(alone.follow_up("and the colours?"))
    assert batched.states["downsample"].error is None, batched.states["downsample"].error
    assert alone.states["downsample"].turn_ids == batched.states["downsample"].turn_ids


def test_the_record_covers_the_original_tokens(resizing, big_picture):
    lm = resizing
    session = Engine(lm).new_session(big_picture, PROMPT, ["downsample"], 0.5, GenerationSettings(max_new_tokens=2),
                                     KNOBS)
    list(session.run())
    sources = session.states["downsample"].policy_state.sources
    layout = lm.image_layout(*big_picture.size)
    patches, at = [], 0
    for view in layout.views:  # every patch token of the original layout (its newline tokens stand for no patch)
        for r in range(view.rows):
            patches += range(at + r * (view.cols + int(view.newline)), at + r * (view.cols + int(view.newline))
                             + view.cols)
        at += view.n_tokens
    covered = np.unique(np.concatenate(sources.cells))
    assert covered.tolist() == sorted(patches)
    assert set(sources.kinds) == {"pooled"} and np.all(sources.images == 0)
    overlay = session.kept_image_map("downsample", lm.num_layers - 1)
    assert overlay.n_tokens == layout.n_tokens and overlay.merged_tokens() == len(patches)
    record = session.record.to_dict()["methods"]["downsample"]
    assert len(record["kept_per_image"]) == 1 and 0 < record["kept_per_image"][0] < 1


def test_several_images_each_resized_with_its_share(family_models, big_picture):
    lm = family_models["llava-onevision"]
    images = [big_picture, big_picture.resize((96, 96))]
    session = Engine(lm).new_session(images, "<image> and <image>: which is brighter?", ["downsample"], 0.5,
                                     GenerationSettings(max_new_tokens=2), KNOBS)
    list(session.run())
    state = session.states["downsample"]
    assert state.error is None, state.error
    sources = state.policy_state.sources
    counts = [lm.image_tokens(*im.size) for im in images]
    wanted = round(0.5 * sum(counts))
    for i, (size, count) in enumerate(zip(state.policy_state.resized, counts)):
        fed = lm.image_tokens(*size)
        assert fed <= round(wanted * count / sum(counts)) and int((sources.images == i).sum()) == fed
    for i, (start, stop) in enumerate(session.image_layout.image_ranges()):
        cells = np.concatenate([c for c, im in zip(sources.cells, sources.images) if im == i])
        assert cells.size and np.all((cells >= start) & (cells < stop))


def test_qwen_downsample_no_longer_fails(qwen_models, big_picture):
    for lm in qwen_models.values():
        session = Engine(lm).new_session(big_picture, PROMPT, ["downsample"], 0.3,
                                         GenerationSettings(max_new_tokens=2))
        list(session.run())
        state = session.states["downsample"]
        assert state.error is None and state.policy.where == "image" and state.reduced_by > 0


# -- fixed-resolution towers: the grid pooled, before or after the projector ----------------------------------------

def _pooled_by_hand(lm, inputs, out: int, before_projector: bool) -> torch.Tensor:
    model = lm.model
    vfl, _ = feature_layer(model.config)
    with torch.inference_mode():
        hidden = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states[vfl][0]
        vc = model.config.vision_config
        side = vc.image_size // vc.patch_size
        has_cls = hidden.shape[0] == side * side + 1
        weights = pool_weights(side, out, has_cls)
        if before_projector:
            return model.model.multi_modal_projector((weights @ hidden.float()).to(hidden.dtype)[None])[0].float()
        return weights @ model.model.multi_modal_projector(hidden[None])[0].float()


@pytest.mark.parametrize("where", ["projector_in", "projector_out"])
def test_llava_15_pools_before_or_after_the_projector(family_models, big_picture, where):
    lm = family_models["llava-1.5"]
    inputs = M.encode(lm, big_picture, M.format_prompt(lm, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    is_image = ids == lm.image_token_id
    policy = make_policy("downsample", 0.5, budget_of="image", where=where)
    with tracked_attention_enabled(lm.model):
        reduced = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id)
        default = reduce_image(lm.model, make_policy("downsample", 0.5, budget_of="image"), ids, is_image,
                               M.vision_inputs(inputs), lm.image_token_id)
    out = int(round(np.sqrt(reduced.record.tokens)))
    assert out * out == reduced.record.tokens < int(is_image.sum())
    fed = reduced.inputs_embeds[0][reduced.is_image[0]]
    torch.testing.assert_close(fed, _pooled_by_hand(lm, inputs, out, where == "projector_in"), atol=1e-4, rtol=1e-4)
    same = torch.allclose(default.inputs_embeds, reduced.inputs_embeds, atol=1e-5)
    assert same == (where == "projector_out")  # the unresolved default pools after the projector, as before
    session = Engine(lm).new_session(big_picture, PROMPT, ["downsample"], 0.5, GenerationSettings(max_new_tokens=2),
                                     {"downsample": {"budget_of": "image", "where": where}})
    list(session.run())
    state = session.states["downsample"]
    assert state.policy_state.pooled == out and not state.policy_state.resized
    assert any("before the projector" in f.text() for f in state.policy.facts(state.policy_state)) == \
        (where == "projector_in")
