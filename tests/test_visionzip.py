"""VisionZip on every LLaVA family (anyres included): the dominant tokens are the naive top-k of the CLS attention
(or, without a CLS token, of the attention received), the contextual tokens are the naive merge of the rest by
key similarity, the language model sees exactly those features in a shorter prompt at contiguous positions, and
the overlay places every fed token on the patches it stands for."""
import numpy as np
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core import models as M
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models.layout import crop_patches
from prefixkv_core.policies import make_policy
from prefixkv_core.testing import WIDE_PICTURE_SIZE
from prefixkv_core.decoding.vision_tokens import reduce_image
from prefixkv_core.decoding.vision_tower import feature_layer

PROMPT = "describe the picture in detail"


def _naive_tower(lm, inputs, crops):
    """The vision tower on its own, eager: per crop the feature layer's hidden states, its attention averaged over
    heads, and its keys (the k projection of the layer's input, read with a forward hook) averaged over heads."""
    model = lm.model
    vfl, layer = feature_layer(model.config)
    tower = model.model.vision_tower
    attn = [m for name, m in tower.named_modules() if name.endswith(f"layers.{layer}.self_attn")][0]
    keys = {}
    hook = attn.k_proj.register_forward_hook(lambda m, a, out: keys.setdefault("k", out))
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": "eager"})
    try:
        with torch.inference_mode():
            out = tower(inputs["pixel_values"].reshape(-1, *inputs["pixel_values"].shape[-3:])[:crops],
                        output_attentions=True, output_hidden_states=True)
    finally:
        model.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
        hook.remove()
    heads = model.config.vision_config.num_attention_heads
    k = keys["k"]
    k = k.view(k.shape[0], k.shape[1], heads, -1).mean(dim=2)
    return out.hidden_states[vfl], out.attentions[layer].float().mean(dim=1), k.float()


def _naive_plan(attention, keys, has_cls, dominant, contextual):
    """One crop, by hand: the CLS token, the top patches by the CLS row (or by attention received), then every
    max(1, R // c)-th remaining token as an anchor and each other remaining token merged into the anchor with the
    most similar key (cosine); a contextual token is its anchor plus the mean of its merged tokens."""
    t = attention.shape[0]
    first = 1 if has_cls else 0
    score = attention[0] if has_cls else attention.mean(dim=0)
    patches = sorted(range(first, t), key=lambda j: (-float(score[j]), j))[: dominant - first]
    picked = ([0] if has_cls else []) + sorted(patches)
    rest = [j for j in range(first, t) if j not in picked]
    step = max(1, len(rest) // contextual)
    anchors = rest[::step][:contextual]
    groups = {a: [] for a in anchors}
    for j in rest:
        if j in anchors:
            continue
        sims = [float(torch.dot(keys[j], keys[a]) / (keys[j].norm() * keys[a].norm())) for a in anchors]
        groups[anchors[int(np.argmax(sims))]].append(j)
    return picked, anchors, groups


def _inputs(lm, picture):
    inputs = M.encode(lm, picture, M.format_prompt(lm, PROMPT, with_image=True))
    return inputs, inputs["input_ids"], inputs["input_ids"] == lm.image_token_id


def reduced_beside_the_tower(lm, picture, policy):
    """A vision-side reduction of `picture` by `policy`, and what a naive read of the tower gives for its crops:
    (reduced, is_image, patches, hidden, attention, keys, has_cls)."""
    inputs, ids, is_image = _inputs(lm, picture)
    with tracked_attention_enabled(lm.model):
        reduced = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id)
    patches = crop_patches(lm.model.config, *WIDE_PICTURE_SIZE)
    hidden, attention, keys = _naive_tower(lm, inputs, len(patches.tokens))
    side = lm.model.config.vision_config.image_size // lm.model.config.vision_config.patch_size
    return reduced, is_image, patches, hidden, attention, keys, hidden.shape[1] == side * side + 1


def test_dominant_and_contextual_tokens_equal_the_naive_reference(lm, picture):
    """Every crop: which tokens are dominant, how the rest is merged, and the features the language model gets."""
    policy = make_policy("visionzip", 0.5, budget_of="image", contextual=0.3)
    reduced, is_image, patches, hidden, attention, keys, has_cls = reduced_beside_the_tower(lm, picture, policy)
    ids = _inputs(lm, picture)[1]
    assert has_cls == (lm.model.config.vision_config.model_type == "clip_vision_model")
    record = reduced.record
    n_img = int(is_image.sum())
    assert record.original_tokens == n_img and record.crops == len(patches.tokens)
    assert record.tokens == round(0.5 * n_img) < n_img
    # naive features of every fed token, in the order the language model sees them
    expected, kinds = [], []
    per_crop = [record.tokens // record.crops + (1 if c < record.tokens % record.crops else 0)
                for c in range(record.crops)]
    plans = []
    for c, k in enumerate(per_crop):
        contextual = int(round(0.3 * k)) if k > 1 else 0
        plans.append(_naive_plan(attention[c], keys[c], has_cls, k - contextual, contextual))
    for view in dict.fromkeys(patches.views):
        crops = [c for c, v in enumerate(patches.views) if v == view]
        if len(crops) == 1:
            picked, anchors, groups = plans[crops[0]]
            feats = hidden[crops[0]].float()
            expected += [feats[j] for j in picked]
            kinds += ["cls" if (has_cls and j == 0) else "dominant" for j in picked]
            expected += [feats[a] + (feats[groups[a]].mean(dim=0) if groups[a] else 0) for a in anchors]
            kinds += ["contextual"] * len(anchors)
            continue
        dominant = sorted((int(patches.raster[c][j - has_cls]), c, j) for c in crops
                          for j in plans[c][0] if not (has_cls and j == 0))
        expected += [hidden[c, j].float() for _, c, j in dominant]
        kinds += ["dominant"] * len(dominant)
        if has_cls:
            expected += [hidden[c, 0].float() for c in crops]
            kinds += ["cls"] * len(crops)
        for c in crops:
            _, anchors, groups = plans[c]
            feats = hidden[c].float()
            expected += [feats[a] + (feats[groups[a]].mean(dim=0) if groups[a] else 0) for a in anchors]
            kinds += ["contextual"] * len(anchors)
    assert record.kinds == kinds
    with torch.inference_mode():
        projected = lm.model.model.multi_modal_projector(torch.stack(expected)[None])[0]
    fed = reduced.inputs_embeds[0][reduced.is_image[0]]
    torch.testing.assert_close(fed, projected, atol=1e-4, rtol=1e-4)
    # the text around the image block is the prompt's own
    text = lm.model.get_input_embeddings()(ids[~is_image])
    torch.testing.assert_close(reduced.inputs_embeds[0][~reduced.is_image[0]], text)
    assert torch.equal(reduced.ids[0][~reduced.is_image[0]], ids[0][~is_image[0]])


def test_overlay_sources_place_every_fed_token(lm, picture):
    inputs, ids, is_image = _inputs(lm, picture)
    policy = make_policy("visionzip", 0.4, budget_of="image")
    with tracked_attention_enabled(lm.model):
        record = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id).record
    patches = crop_patches(lm.model.config, *WIDE_PICTURE_SIZE)
    layout = lm.image_layout(*WIDE_PICTURE_SIZE)
    assert layout.n_tokens == record.original_tokens
    covered = np.zeros(record.original_tokens, dtype=int)
    for kind, cells in zip(record.kinds, record.cells):
        assert cells.size == 0 or (cells.min() >= 0 and cells.max() < layout.n_tokens)
        if kind == "cls":
            assert cells.size == 0
        if kind == "dominant":
            assert cells.size <= 1  # its own patch (none when it lies in an anyres padding)
        covered[cells] += 1
    shown = np.unique(np.concatenate([t[t >= 0] for t in patches.tokens]))
    newline = np.setdiff1d(np.arange(layout.n_tokens), shown)  # anyres newline tokens: never fed, never covered
    assert covered[newline].sum() == 0
    kept, merged = record.project(np.ones(record.tokens))
    assert (kept > 0).sum() == sum(1 for k, c in zip(record.kinds, record.cells) if k == "dominant" and c.size)
    assert ((kept > 0) | (merged > 0)).sum() <= shown.size


def test_the_language_model_sees_a_shorter_prompt_at_contiguous_positions(lm, picture):
    engine = Engine(lm)
    settings = GenerationSettings(max_new_tokens=4)
    knobs = {"visionzip": {"budget_of": "image"}}
    session = engine.new_session(picture, PROMPT, ["full", "visionzip", "snapkv"], 0.5, settings, knobs)
    events = list(session.run())
    pre = events[0]
    n, n_img = pre.prompt_tokens, pre.image_tokens
    state = session.states["visionzip"]
    fed = state.policy_state.sources.tokens
    assert fed == round(0.5 * n_img) and state.prompt_len == n - n_img + fed and state.reduced_by == n_img - fed
    done = {e.method: e for e in events if getattr(e, "kind", None) == "done"}
    ev = done["visionzip"]
    t = len(state.turn_ids) - 1  # tokens fed after the prompt
    assert ev.kept_per_layer == [state.prompt_len + t] * lm.num_layers
    assert ev.kept_image_per_layer == [fed] * lm.num_layers
    assert ev.full_len == n + t  # shares are of the uncompressed conversation
    assert ev.kv_bytes == pytest.approx(ev.full_kv_bytes * (state.prompt_len + t) / (n + t), rel=1e-6)
    for layer in state.cache.layers:
        assert layer.positions[0, 0].tolist() == list(range(state.prompt_len + t))
    # its first token: a plain forward of the model on the reduced prompt's embeddings
    inputs, ids, is_image = _inputs(lm, picture)
    with tracked_attention_enabled(lm.model):
        reduced = reduce_image(lm.model, state.policy, ids, is_image, M.vision_inputs(inputs), lm.image_token_id)
    with torch.inference_mode():
        plain = lm.model(inputs_embeds=reduced.inputs_embeds).logits[0, -1]
    torch.testing.assert_close(state.first_logits, plain, atol=1e-4, rtol=1e-4)
    # a follow-up continues at its own true positions; batched with the others == alone
    list(session.follow_up("and the colours?"))
    alone = engine.new_session(picture, PROMPT, ["visionzip"], 0.5, settings, knobs)
    list(alone.run())
    list(alone.follow_up("and the colours?"))
    assert alone.states["visionzip"].turn_ids == state.turn_ids
    assert alone.states["visionzip"].answers == state.answers
    pos = state.cache.layers[0].positions[0, 0]
    assert bool((pos[1:] == pos[:-1] + 1).all()) and int(pos[-1]) == state.true_len - 1
    overlay_map = session.kept_image_map("visionzip", lm.num_layers - 1)
    assert overlay_map.n_tokens == n_img and overlay_map.kept_tokens() <= fed


@pytest.mark.parametrize("budget", [0.6, 0.8])
def test_cache_budget_feeds_r_n_tokens(family_models, picture, budget):
    lm = family_models["llava-next"]
    session = Engine(lm).new_session(picture, PROMPT, ["visionzip"], budget, GenerationSettings(max_new_tokens=1))
    pre = list(session.run())[0]
    state = session.states["visionzip"]
    assert state.prompt_len == round(budget * pre.prompt_tokens)
    assert state.policy_state.sources.crops == 5  # the base view and a 2 x 2 grid of tiles


def test_without_a_vision_plan_the_image_is_the_models_own(family_models, picture):
    """At r = 1 (or with nothing to cut) VisionZip feeds the image as the model does: Full's tokens."""
    lm = family_models["llava-onevision"]
    session = Engine(lm).new_session(picture, PROMPT, ["full", "visionzip"], 1.0, GenerationSettings(max_new_tokens=5))
    list(session.run())
    state = session.states["visionzip"]
    assert state.turn_ids == session.states["full"].turn_ids and state.reduced_by == 0
    assert state.policy_state.sources is None and "every image token is kept" in state.policy_state.notes[0]


def test_a_budget_below_one_token_per_crop_is_said(family_models, picture):
    lm = family_models["llava-next"]
    session = Engine(lm).new_session(picture, PROMPT, ["visionzip"], 0.1, GenerationSettings(max_new_tokens=1))
    list(session.run())
    state = session.states["visionzip"]
    assert state.policy_state.sources.tokens == 5  # one per crop: the base view and four tiles
    assert any("at least one image token per crop: 5 fed" in n for n in state.policy_state.notes)


def test_an_eager_vision_tower_gives_the_same_reduction(family_models, picture):
    """The capture delegates each output to the tower's own attention; an eager tower (no registered function to
    delegate to) is computed the eager way, with the same result."""
    lm = family_models["llava-1.5"]
    inputs, ids, is_image = _inputs(lm, picture)
    policy = make_policy("visionzip", 0.5, budget_of="image")
    out = {}
    for implementation in ("sdpa", "eager"):
        lm.model.set_attn_implementation({"text_config": "sdpa", "vision_config": implementation})
        try:
            out[implementation] = reduce_image(lm.model, policy, ids, is_image, M.vision_inputs(inputs),
                                               lm.image_token_id)
        finally:
            lm.model.set_attn_implementation({"text_config": "sdpa", "vision_config": "sdpa"})
        assert lm.model.config.vision_config._attn_implementation == "sdpa"
    assert out["eager"].record.kinds == out["sdpa"].record.kinds
    torch.testing.assert_close(out["eager"].inputs_embeds, out["sdpa"].inputs_embeds, atol=1e-5, rtol=1e-5)
