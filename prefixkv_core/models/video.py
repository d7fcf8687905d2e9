"""A video the way a family reads it natively: LLaVA-OneVision's, Qwen2-VL's and Qwen2.5-VL's video paths.

OneVision reads a video as its own kind of input: every sampled frame squashed to the tower's square, through the
vision tower and the projector, each frame's patch grid bilinearly pooled to half its side, and one image-newline
token after the last frame (`get_video_features`); its prompt holds one `<video>` token per pooled patch plus that
newline. Qwen2-VL, Qwen2.5-VL and Qwen3-VL cut the frames into patches of temporal_patch_size (2) frames, so one
`<|video_pad|>` token covers two frames of a merged cell (`family/qwen_vl_video.py`); Qwen3-VL's prompt puts a
timestamp and its own vision start and end around each temporal group's tokens (`video_span`). The other families
read a video's frames as a run of images (`session/visuals.py`).

The frames' pixels come from the checkpoint's own video processor where transformers can build it (it needs
torchvision). Where it cannot (PyPI's torchvision does not match the CPU torch wheel), the same preprocessing runs
on the PIL backend of transformers' image transforms: resize to the square (bicubic), rescale to [0, 1],
normalise with the video processor's mean and std (read from the checkpoint's video_preprocessor_config.json when
it has one, else the class defaults)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .layout import GridView, ImageLayout

NATIVE_VIDEO_MODEL_TYPES = ("llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN_VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VIDEO_TOKEN = "<video>"
SETTINGS_FILE = "video_preprocessor_config.json"


def reads_video_natively(config) -> bool:
    """Whether this model has a video path of its own (else a video's frames are read as images)."""
    return getattr(config, "model_type", "") in NATIVE_VIDEO_MODEL_TYPES and \
        getattr(config, "video_token_id", None) is not None


def pooled_side(config) -> int:
    """The side of a frame's patch grid after OneVision's pooling (ceil of half the tower's grid)."""
    vc = config.vision_config
    return math.ceil((int(vc.image_size) // int(vc.patch_size)) / 2)


def _qwen(config) -> bool:
    return getattr(config, "model_type", "") in QWEN_VIDEO_MODEL_TYPES


def _family(config):
    """The family module that reads this video natively (through the registry, as every family is reached)."""
    from .families import hooks_of

    return hooks_of(config)


def video_token_count(config, n_frames: int, frame_size: tuple[int, int] | None = None, processor=None) -> int:
    """The video tokens of a video of `n_frames` frames: OneVision's, every frame's pooled grid then one newline;
    Qwen's, its merged grid per temporal group (frames of `frame_size` (width, height) resized as its video
    processor resizes them)."""
    if _qwen(config):
        if frame_size is None:
            raise ValueError("a Qwen video's token count follows its frames' size")
        return _family(config).video_token_count(config, processor, n_frames, frame_size)
    return n_frames * pooled_side(config) ** 2 + 1


def video_text_tokens(config, n_frames: int, processor=None, times=None, fps: float | None = None) -> int:
    """The text tokens a video's span adds around its video tokens (Qwen3-VL's timestamps, from the frames' `times`
    or `fps`, and per-group vision start and end; 0 elsewhere): what the context check counts before anything is
    encoded."""
    if _qwen(config):
        return _family(config).video_text_tokens(config, processor, n_frames, times, fps)
    return 0


def video_span(config, processor, grid, n_frames: int, times=None, fps: float | None = None) -> str | None:
    """The text that takes the video placeholder's place where it is more than a run of video tokens (Qwen3-VL: a
    timestamp, vision start, the group's tokens and vision end per temporal group, `grid`: its video_grid_thw row;
    the frames' `times` in seconds, else spaced at `fps`); None where it is one run."""
    if _qwen(config):
        return _family(config).video_span(config, processor, grid, n_frames, times, fps)
    return None


def frames_per_token(config, processor=None) -> int:
    """How many frames one video token covers: 1 (OneVision pools each frame), Qwen's temporal patch size."""
    if _qwen(config):
        return _family(config).frames_per_token(config, processor)
    return 1


def video_layout(config, n_frames: int, frame_size: tuple[int, int], first_index: int = 0,
                 processor=None) -> ImageLayout:
    """Where each video token comes from. OneVision: one pooled grid per frame (over the whole frame: it is
    squashed to the square), then the newline token (a view with no patches). Qwen: one merged grid per temporal
    group ("frames 1-2"), each group one of the layout's images."""
    if _qwen(config):
        return _family(config).video_layout(config, processor, n_frames, frame_size, first_index)
    side = pooled_side(config)
    views = tuple(GridView(f"frame {k + 1}", side, side, image=first_index + k) for k in range(n_frames))
    newline = GridView("video newline", 1, 0, newline=True, image=first_index + max(n_frames - 1, 0))
    return ImageLayout(views + (newline,), frame_size, (frame_size,) * n_frames)


def video_settings(source: str | None, config) -> dict[str, Any]:
    """The video preprocessing of a checkpoint: its video_preprocessor_config.json's size, mean and std where the
    checkpoint (a local directory, or one in the Hugging Face cache) has one, else the processor class's
    defaults at the tower's resolution."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    side = int(config.vision_config.image_size)
    settings = {"size": side, "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD)}
    found = _settings_file(source) if source else None
    if found is not None:
        raw = json.loads(found.read_text())
        size = raw.get("size") or {}
        settings["size"] = int(size.get("height", side)) if isinstance(size, dict) else int(size)
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                settings[key] = [float(x) for x in raw[key]]
    return settings


def _settings_file(source: str) -> Path | None:
    local = Path(source) / SETTINGS_FILE
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, SETTINGS_FILE)
    except Exception:  # not a hub id, no cache: the defaults
        return None
    return Path(cached) if isinstance(cached, str) else None


def video_pixels(processor, frames: list) -> torch.Tensor:
    """[1, F, 3, S, S]: the frames as the checkpoint's video processor prepares them (its own where it exists,
    else the same steps on the PIL backend, `video_settings`)."""
    own = getattr(processor, "video_processor", None)
    if own is not None:
        return own(videos=[frames], return_tensors="pt")["pixel_values_videos"]
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.image_utils import ChannelDimension, PILImageResampling

    settings = getattr(processor, "prefixkv_video_settings", None)
    if settings is None:
        raise ValueError("this processor has no video preprocessing settings")
    side = settings["size"]
    out = []
    for frame in frames:
        array = np.asarray(frame.convert("RGB"))
        array = resize(array, (side, side), resample=PILImageResampling.BICUBIC,
                       input_data_format=ChannelDimension.LAST)
        array = rescale(array, 1 / 255, input_data_format=ChannelDimension.LAST)
        array = normalize(array, settings["image_mean"], settings["image_std"], data_format=ChannelDimension.FIRST,
                          input_data_format=ChannelDimension.LAST)
        out.append(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)))
    return torch.stack(out)[None]


def video_inputs(processor, config, frames: list, fps: float | None = None) -> dict:
    """The model inputs of a natively read video: OneVision's pixel_values_videos [1, F, 3, S, S]; Qwen's
    pixel_values_videos [patches, C·T·P·P] with video_grid_thw (and Qwen2.5-VL's second_per_grid_ts, from `fps`,
    the sampled frames' rate)."""
    if _qwen(config):
        return _family(config).video_inputs(processor, config, frames, fps)
    return {"pixel_values_videos": video_pixels(processor, frames)}
