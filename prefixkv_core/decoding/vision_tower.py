"""The vision tower's pass over a prompt's image, and the first turn's image encoded once for every prefill.

`vision_features` runs the model's own image path once (`get_image_features`, a public method of every LLaVA
family) and returns what a prefill reads of it: the image features the model scatters into the image tokens
and, for a vision-side reduction (`vision_tokens`), the feature layer's hidden states, attention probabilities and
keys. Those two are recorded through one public extension point: an attention function registered for the vision
config (transformers' `AttentionInterface`) that records the feature layer's probabilities and keys, averaged over
heads, while the tower's own implementation computes every output. Qwen's towers (no single feature layer, patches
merged 2x2) are recorded by `qwen_vision.tower_pass` instead: a hook on one full-attention block. InternVL's
(its projector reads the patches pixel-shuffled) records the feature layer the same way and the projector's input
through a hook, pooled over each pixel-shuffle group (`internvl_vision`).

`TurnImage`: in a comparison every prefill of the first turn reads the same image (the shared prefill and every
own prefill: FastV, DART, VisionZip, Downsample), so the tower runs once, when the first prefill asks, and the
language model is fed input embeddings built exactly as the model's forward builds them (the text's embeddings
with the image features scattered into the image tokens)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

VISION_ATTN_NAME = "prefixkv_vision_probe"


@dataclass
class VisionFeatures:
    """One pass of the vision tower over a prompt's images (every crop it encoded)."""

    image: torch.Tensor  # [image tokens, H]: the model's own image features, in its image tokens' order
    hidden: torch.Tensor | None = None  # [C, T, Hv]: the feature layer's hidden states, CLS included (the
    # images' crops, then a natively read video's frames)
    attention: torch.Tensor | None = None  # [C, T, T] fp32: the feature layer's attention averaged over heads
    keys: torch.Tensor | None = None  # [C, T, D] fp32: its keys averaged over heads
    per_image: tuple[int, ...] = ()  # the image features of each image, in order (their sum: image's rows)
    video: torch.Tensor | None = None  # [video tokens, H]: a video read natively (OneVision), every frame pooled
    video_frames: int = 0  # its frames: the last crops of hidden/attention/keys when recorded (Qwen: its temporal
    # groups)
    qwen: object | None = None  # Qwen's towers: the recorded pass (`qwen_vision.QwenTower`) instead of the above
    internvl: object | None = None  # InternVL's: the recorded pass pooled over each pixel-shuffle group
    # (`internvl_vision.InternVLTower`) instead of hidden/attention/keys

    @property
    def recorded(self) -> bool:
        return self.attention is not None or self.qwen is not None or self.internvl is not None

    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in (self.image, self.hidden, self.attention, self.keys,
                                                          self.video) if t is not None)
        return held + sum(tower.nbytes() for tower in (self.qwen, self.internvl) if tower is not None)


def feature_layer(config) -> tuple[int, int]:
    """(index into the tower's hidden states, index of the encoder layer that produced them) of the single vision
    feature layer; ValueError for towers that concatenate several layers."""
    from ..models.families import uses_mrope

    if uses_mrope(config):
        raise ValueError(f"{config.model_type}'s tower has no single feature layer: its 2x2-merged patches are read "
                         "per merged token (`qwen_vision`)")
    vfl = getattr(config, "vision_feature_layer", -1)
    if not isinstance(vfl, int):
        raise ValueError(f"a vision-side reduction needs one vision feature layer; this model concatenates {vfl}")
    n = int(config.vision_config.num_hidden_layers)
    hidden = vfl % (n + 1)  # hidden_states[0] is the embedding output, [i] the output of layer i - 1
    if hidden == 0:
        raise ValueError("the vision feature layer is the patch embedding: it has no attention to rank tokens by")
    return vfl, hidden - 1


def _probabilities(query, key, mask, scale) -> torch.Tensor:
    """Softmax attention probabilities in fp32 for one crop ([1, H, T, D] each) under the tower's mask."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1)


class _FeatureLayerProbe:
    """The vision config's attention function during one capture: counts the calls (one per encoder layer) and,
    at the feature layer, records the attention probabilities and keys, averaged over heads, in fp32 (one crop
    at a time, so at most one crop's [heads, T, T] probabilities exist at once)."""

    def __init__(self, layer: int, implementation: str):
        self.layer, self.calls = layer, 0
        self.delegate = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation != "eager" else None
        self.attention: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        index, self.calls = self.calls, self.calls + 1
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        crops = range(query.shape[0])

        def mask(c):
            if attention_mask is None or attention_mask.shape[0] == 1:
                return attention_mask
            return attention_mask[c:c + 1]

        if index == self.layer:
            self.attention = torch.cat([_probabilities(query[c:c + 1], key[c:c + 1], mask(c), scale).mean(dim=1)
                                        for c in crops])  # [C, T, T]
            self.keys = key.float().mean(dim=1)  # [C, T, D]
        if self.delegate is not None:
            return self.delegate(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        # eager towers: the same arithmetic as their own eager attention
        out = torch.cat([torch.matmul(_probabilities(query[c:c + 1], key[c:c + 1], mask(c), scale).to(value.dtype),
                                      value[c:c + 1]) for c in crops])
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _vision_attention(model, probe: _FeatureLayerProbe):
    cfg = model.config
    previous = {"text_config": cfg.get_text_config()._attn_implementation or "sdpa",
                "vision_config": cfg.vision_config._attn_implementation or "sdpa"}
    AttentionInterface.register(VISION_ATTN_NAME, probe)
    try:
        model.set_attn_implementation({"text_config": previous["text_config"], "vision_config": VISION_ATTN_NAME})
        yield probe
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(VISION_ATTN_NAME, None)


def _vision_implementation(model) -> str:
    return model.config.vision_config._attn_implementation or "sdpa"


VIDEO_KEY = "pixel_values_videos"
# a natively read video's other inputs (Qwen: its patch grid and the seconds one temporal group spans)
VIDEO_EXTRA_KEYS = ("video_grid_thw", "second_per_grid_ts")


def _video_pass(model, pixels: torch.Tensor, record: bool, grid: torch.Tensor | None = None):
    """A natively read video through the model's `get_video_features` -> (its features [video tokens, H], and with
    `record` the feature layer of every frame as crops: hidden states, attention and keys, else Nones).
    OneVision's pools every frame and adds one newline; Qwen's (`grid`: video_grid_thw) merges each temporal
    group's patches, and its tower is recorded on its own (`qwen_vision.tower_pass`)."""
    cfg = model.config
    if grid is not None:
        out = model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grid, return_dict=True)
        pooled = out.pooler_output
        features = torch.cat(list(pooled)) if isinstance(pooled, (tuple, list)) else pooled
        return features, None, None, None
    kwargs = dict(pixel_values_videos=pixels, vision_feature_layer=cfg.vision_feature_layer,
                  vision_feature_select_strategy=cfg.vision_feature_select_strategy, return_dict=True)
    if not record:
        out = model.get_video_features(**kwargs)
        return out.pooler_output.reshape(-1, out.pooler_output.shape[-1]), None, None, None
    hidden_index, layer = feature_layer(cfg)
    probe = _FeatureLayerProbe(layer, _vision_implementation(model))
    with _vision_attention(model, probe):
        out = model.get_video_features(**kwargs)
    features = out.pooler_output.reshape(-1, out.pooler_output.shape[-1])
    return features, out.hidden_states[hidden_index], probe.attention, probe.keys


def _joined(*parts: torch.Tensor | None) -> torch.Tensor | None:
    found = [p for p in parts if p is not None]
    return torch.cat(found) if found else None


@torch.inference_mode()
def vision_features(model, vision_inputs: dict, record: bool = True) -> VisionFeatures:
    """The model's own image path once over every crop the tower encodes (and its video path over a video's
    frames); with `record`, the feature layer's hidden states, attention and keys too, the images' crops then the
    video's frames (ValueError when the tower has no single feature layer to record). Qwen's towers record one
    full-attention block per image and temporal group instead (`qwen_vision`)."""
    vision_inputs = dict(vision_inputs)
    if record and _is_qwen(model):
        return _qwen_features(model, vision_inputs)
    if record and _pixel_shuffled(model) and vision_inputs.get("pixel_values") is not None:
        return _internvl_features(model, vision_inputs)
    pixels_videos = vision_inputs.pop(VIDEO_KEY, None)
    extra = {key: vision_inputs.pop(key) for key in VIDEO_EXTRA_KEYS if key in vision_inputs}
    grid = extra.get("video_grid_thw")
    video, v_hidden, v_attention, v_keys = (_video_pass(model, pixels_videos, record, grid)
                                            if pixels_videos is not None else (None, None, None, None))
    if pixels_videos is None:
        frames = 0
    elif grid is not None:  # Qwen: its temporal groups
        frames = int(grid[:, 0].sum())
    else:
        frames = int(pixels_videos.shape[0] * pixels_videos.shape[1])
    if vision_inputs.get("pixel_values") is None:  # a video alone
        empty = torch.zeros(0, video.shape[-1], dtype=video.dtype, device=video.device)
        return VisionFeatures(empty, v_hidden, v_attention, v_keys, (), video, frames)
    if not record:
        out = model.get_image_features(**vision_inputs, return_dict=True)
        return VisionFeatures(torch.cat(list(out.pooler_output)), per_image=_per_image(out), video=video,
                              video_frames=frames)
    hidden_index, layer = feature_layer(model.config)
    probe = _FeatureLayerProbe(layer, _vision_implementation(model))
    with _vision_attention(model, probe):
        out = model.get_image_features(**vision_inputs, return_dict=True)
    if probe.attention is None or probe.calls != int(model.config.vision_config.num_hidden_layers):
        raise RuntimeError("the vision tower's attention was not recorded at its feature layer")
    # only the feature layer's hidden states are kept, not the tuple of every layer's
    return VisionFeatures(torch.cat(list(out.pooler_output)), _joined(out.hidden_states[hidden_index], v_hidden),
                          _joined(probe.attention, v_attention), _joined(probe.keys, v_keys), _per_image(out), video,
                          frames)


def _is_qwen(model) -> bool:
    from ..models.families import uses_mrope

    return uses_mrope(model.config)


def _qwen_features(model, vision_inputs: dict) -> VisionFeatures:
    from .qwen_vision import tower_pass

    tower = tower_pass(model, vision_inputs)
    merge2 = int(model.config.vision_config.spatial_merge_size) ** 2
    image_grid, video_grid = vision_inputs.get("image_grid_thw"), vision_inputs.get("video_grid_thw")
    per_image = tuple((image_grid.prod(-1) // merge2).tolist()) if image_grid is not None else ()
    image = tower.image
    if image is None:
        image = torch.zeros(0, tower.video.shape[-1], dtype=tower.video.dtype, device=tower.video.device)
    frames = int(video_grid[:, 0].sum()) if tower.video is not None else 0
    return VisionFeatures(image, per_image=per_image, video=tower.video, video_frames=frames, qwen=tower)


def _pixel_shuffled(model) -> bool:
    """Whether the model's projector reads the tower's patches pixel-shuffled (InternVL; its family module says so:
    `pixel_shuffled`)."""
    from ..models.errors import ModelLoadError
    from ..models.families import hooks_of

    try:
        says = getattr(hooks_of(model.config), "pixel_shuffled", None)
    except ModelLoadError:
        return False
    return bool(says(model.config)) if says is not None else False


def _internvl_features(model, vision_inputs: dict) -> VisionFeatures:
    """The model's own image path with the feature layer recorded (as on the LLaVA towers) and the projector's
    input, pooled over each pixel-shuffle group (`internvl_vision`)."""
    from .internvl_vision import pooled_tower, projector_input

    _, layer = feature_layer(model.config)
    probe = _FeatureLayerProbe(layer, _vision_implementation(model))
    with _vision_attention(model, probe), projector_input(model) as seen:
        out = model.get_image_features(**vision_inputs, return_dict=True)
    if probe.attention is None or probe.calls != int(model.config.vision_config.num_hidden_layers):
        raise RuntimeError("the vision tower's attention was not recorded at its feature layer")
    image = torch.cat(list(out.pooler_output))
    tower = pooled_tower(model, image, seen["shuffled"], probe.attention, probe.keys)
    return VisionFeatures(image, per_image=_per_image(out), internvl=tower)


def _per_image(out) -> tuple[int, ...]:
    return tuple(int(f.shape[0]) for f in out.pooler_output)


def prompt_embeds(model, ids: torch.Tensor, is_image: torch.Tensor, image: torch.Tensor,
                  video: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N, H]: what the model's forward feeds its language model for `ids` and these features: the tokens'
    embeddings, the image features scattered into the image tokens and a video's into its video tokens (the same
    arithmetic as the forward's). `is_image` flags both kinds."""
    embeds = model.get_input_embeddings()(ids)
    video_id = getattr(model.config, "video_token_id", None) if video is not None else None
    is_video = (ids == video_id) & is_image if video_id is not None else torch.zeros_like(is_image)
    for mask, features, what in ((is_image & ~is_video, image, "image"), (is_video, video, "video")):
        n = int(mask.sum())
        found = 0 if features is None else features.shape[0]
        if n != found:
            raise ValueError(f"{what} features and {what} tokens do not match: {found} features, {n} tokens")
        if n:
            embeds = embeds.masked_scatter(mask.unsqueeze(-1).to(embeds.device), features.to(embeds.device,
                                                                                               embeds.dtype))
    return embeds


class TurnImage:
    """The first turn's image through the vision tower once, for every prefill of a batched comparison (see the
    module docstring). The tower runs when a prefill first asks (its time counts in that prefill's); with
    `record`, that pass also records the feature layer for the vision-side reductions (only when the tower's own
    attention computes its outputs, so the model's own features are exactly a plain pass's). Only what the
    prefills read is kept, until the session drops it."""

    def __init__(self, model, vision_inputs: dict, record: bool):
        self.model, self.vision_inputs = model, dict(vision_inputs)
        # a LLaVA tower records through its attention function (not an eager one's); Qwen's through a hook
        self.record = record and (_is_qwen(model) or _vision_implementation(model) != "eager")
        self.passes = 0  # tower passes run (one, or two when an eager tower had to record on its own)
        self._features: VisionFeatures | None = None
        self._recorded: VisionFeatures | None = None
        self._embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, their prompt embeddings)

    def features(self) -> VisionFeatures:
        """The tower's pass (run on the first call); recorded when asked for and possible."""
        if self._features is None:
            try:
                self._features = vision_features(self.model, self.vision_inputs, record=self.record)
            except ValueError:  # no single feature layer: the reductions fail on their own (`recorded`)
                self._features = vision_features(self.model, self.vision_inputs, record=False)
            self.passes += 1
        return self._features

    def recorded(self) -> VisionFeatures:
        """The pass with the feature layer recorded: the shared one when it recorded, else one of its own (kept)."""
        if self.features().recorded:
            return self._features
        if self._recorded is None:
            self._recorded = vision_features(self.model, self.vision_inputs, record=True)
            self.passes += 1
        return self._recorded

    def prompt_embeds(self, ids: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        """The language model's input embeddings for `ids` (made once for the turn's prompt, then reused)."""
        if self._embeds is None or not torch.equal(self._embeds[0], ids):
            found = self.features()
            self._embeds = (ids, prompt_embeds(self.model, ids, is_image, found.image, found.video))
        return self._embeds[1]

    def nbytes(self) -> int:
        held = [f.nbytes() for f in (self._features, self._recorded) if f is not None]
        if self._embeds is not None:
            held.append(self._embeds[1].numel() * self._embeds[1].element_size())
        return sum(held)
