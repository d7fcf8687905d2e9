"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL read a video on their own path (`family/qwen_vl.py` re-exports these hooks).

Pixels. The frames are resized alike, rescaled and normalised, padded to a multiple of temporal_patch_size frames by
repeating the last one, and cut into patches of temporal_patch_size frames x patch x patch pixels, so one merged
token covers temporal_patch_size frames of a merge x merge cell (`video_grid_thw` [[t, h, w]] in patches). They come
from transformers' own video processor where it builds (it needs torchvision), else from the same steps on the PIL
backend of transformers' image processor, with the checkpoint's video_preprocessor_config.json settings. The resize
differs: Qwen2-VL and Qwen2.5-VL resize each frame as an image (smart_resize at the video processor's pixel limits);
Qwen3-VL bounds the whole clip (its video processor's smart_resize: the frames' count rounded to whole temporal
groups times each frame's pixels between the limits, each frame's pixels optionally capped where the processor says
`cap_pixels_per_frame`). Qwen3-VL's processor refuses fewer frames than a temporal group: a one-frame video is
given as that frame twice (what its patches would repeat anyway).

Prompt. Qwen2-VL and Qwen2.5-VL expand the chat template's `<|video_pad|>` to one run of t·h·w/merge² pads
(Qwen2.5-VL also gets `second_per_grid_ts`, the seconds one temporal group spans, which spaces the groups' temporal
positions). Qwen3-VL's processor expands it to one segment per temporal group: a timestamp "<t seconds>" (the mean
of the group's first and last frame times, one decimal; a last group padded with a repeated frame counts that frame
twice), then `<|vision_start|>`, the group's h·w/merge² pads and `<|vision_end|>`, all inside the template's own
vision span. Its rope index splits the video grid per group, so each group's tokens get their (t, h, w) after the
timestamp's text positions, and its forward adds the video's DeepStack features at the video tokens as at an
image's."""
from __future__ import annotations

import json

VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Qwen2VLVideoProcessor's class defaults (the video pixel limits at 14 px patches, OpenAI CLIP's mean and std)
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768
# Qwen3VLVideoProcessor's (bounds on the whole clip's pixels at 16 px patches, mean and std 0.5)
QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS = 128 * 32 * 32, 32 * 32 * 768
QWEN3_MAX_VIDEO_TOKENS = 768  # its per-frame token ceiling where it caps each frame's pixels
# the tiny Qwen3-VL's clip limits: a temporal group of the tiny image minimum, 16 frames of the tiny image maximum
TINY_QWEN3_CLIP = (2, 16)


def reads_video(config) -> bool:
    return getattr(config, "model_type", None) in VIDEO_MODEL_TYPES


def _qwen3(config) -> bool:
    return getattr(config, "model_type", None) == "qwen3_vl"


def video_settings(source: str | None, config, tiny: bool = False) -> dict:
    """The frames' preprocessing of a checkpoint: its video_preprocessor_config.json's pixel limits, mean and std
    (Qwen3-VL: and its per-frame cap) where it has one, else the video processor class's defaults (the tiny models':
    their image pixel limits, for Qwen3-VL scaled to a clip); patch, merge and temporal patch sizes from the vision
    config unless the file names them."""
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, \
        OPENAI_CLIP_STD

    from ..video import _settings_file
    from .qwen_vl_shape import TINY_MAX_PIXELS, TINY_MIN_PIXELS

    vc = config.vision_config
    qwen3 = _qwen3(config)
    if tiny:
        lo, hi = TINY_MIN_PIXELS, TINY_MAX_PIXELS
        if qwen3:
            lo, hi = lo * TINY_QWEN3_CLIP[0], hi * TINY_QWEN3_CLIP[1]
    else:
        lo, hi = (QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS) if qwen3 else (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    mean, std = (IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD) if qwen3 else (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    settings = {"min_pixels": lo, "max_pixels": hi, "image_mean": list(mean), "image_std": list(std),
                "patch_size": int(vc.patch_size), "merge_size": int(vc.spatial_merge_size),
                "temporal_patch_size": int(vc.temporal_patch_size)}
    if qwen3:
        settings.update(cap_pixels_per_frame=False, max_video_tokens=QWEN3_MAX_VIDEO_TOKENS)
    found = _settings_file(source) if source else None
    if found is not None:
        raw = json.loads(found.read_text())
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        for key, names in (("min_pixels", ("shortest_edge", "min_pixels")),
                           ("max_pixels", ("longest_edge", "max_pixels"))):
            for name in names:
                value = size.get(name, raw.get(name))
                if value is not None:
                    settings[key] = int(value)
                    break
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                settings[key] = [float(x) for x in raw[key]]
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            if raw.get(key) is not None:
                settings[key] = int(raw[key])
        if qwen3:
            settings["cap_pixels_per_frame"] = bool(raw.get("cap_pixels_per_frame") or False)
            if raw.get("max_video_tokens") is not None:
                settings["max_video_tokens"] = int(raw["max_video_tokens"])
    return settings


def video_preprocessor_config(settings: dict, model_type: str = "qwen2_vl") -> dict:
    """The video_preprocessor_config.json of these settings, as transformers' video processor of the family saves
    it (Qwen2VLVideoProcessor, or Qwen3VLVideoProcessor with its per-frame cap)."""
    out = {"video_processor_type": "Qwen3VLVideoProcessor" if model_type == "qwen3_vl" else "Qwen2VLVideoProcessor",
           "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
           "rescale_factor": 1 / 255,
           "size": {"shortest_edge": settings["min_pixels"], "longest_edge": settings["max_pixels"]},
           "image_mean": settings["image_mean"], "image_std": settings["image_std"],
           "patch_size": settings["patch_size"], "merge_size": settings["merge_size"],
           "temporal_patch_size": settings["temporal_patch_size"], "do_sample_frames": False}
    if "cap_pixels_per_frame" in settings:
        out.update(cap_pixels_per_frame=settings["cap_pixels_per_frame"],
                   max_video_tokens=settings["max_video_tokens"])
    return out


def attach_video(processor, config, source: str | None = None, tiny: bool = False):
    """A Qwen-VL processor gets its frames' preprocessing: transformers' own video processor where it can be built
    (it needs torchvision), else the settings of the same steps on the PIL backend (`video_inputs`). Returns the
    processor."""
    from .qwen_vl_shape import TINY_PATCH

    if not reads_video(config):
        return processor
    if getattr(processor, "video_processor", None) is not None:
        return processor
    if source is not None:
        try:
            from transformers import AutoVideoProcessor

            processor.video_processor = AutoVideoProcessor.from_pretrained(source)
            return processor
        except Exception:  # noqa: BLE001 - no torchvision (or no video processor saved): the PIL backend's steps
            pass
    tiny = tiny or int(config.vision_config.patch_size) == TINY_PATCH  # a tiny checkpoint saved without the file
    processor.prefixkv_video_settings = video_settings(source, config, tiny)
    return processor


def _video_steps(processor, config) -> dict:
    """(settings) of a processor's video preprocessing: its own video processor's, else the attached settings."""
    own = getattr(processor, "video_processor", None)
    if own is not None:
        size = own.size
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        steps = {"min_pixels": int(get("shortest_edge")), "max_pixels": int(get("longest_edge")),
                 "patch_size": int(own.patch_size), "merge_size": int(own.merge_size),
                 "temporal_patch_size": int(own.temporal_patch_size)}
        if _qwen3(config):
            steps.update(cap_pixels_per_frame=bool(getattr(own, "cap_pixels_per_frame", None) or False),
                         max_video_tokens=int(getattr(own, "max_video_tokens", None) or QWEN3_MAX_VIDEO_TOKENS))
        return steps
    settings = getattr(processor, "prefixkv_video_settings", None) if processor is not None else None
    return settings if settings is not None else video_settings(None, config)


def _read_frames(config, processor, n_frames: int) -> int:
    """How many frames the preprocessing reads: Qwen3-VL's at least one temporal group (a lone frame twice)."""
    if _qwen3(config):
        return max(int(n_frames), int(_video_steps(processor, config)["temporal_patch_size"]))
    return int(n_frames)


def frame_size(config, processor, n_frames: int, width: int, height: int) -> tuple[int, int]:
    """(height, width) in pixels every frame is resized to: Qwen2-VL's and Qwen2.5-VL's per frame, Qwen3-VL's over
    the whole clip (see the module doc)."""
    s = _video_steps(processor, config)
    factor = s["patch_size"] * s["merge_size"]
    if not _qwen3(config):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(int(height), int(width), factor=factor, min_pixels=s["min_pixels"],
                            max_pixels=s["max_pixels"])
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_resize

    frames = _read_frames(config, processor, n_frames)
    hi = s["max_pixels"]
    if s.get("cap_pixels_per_frame"):  # each frame's pixels capped, as Qwen3VLVideoProcessor.resize caps them
        per_frame = max(min(s["max_video_tokens"] * factor * factor, hi // frames), int(s["min_pixels"] * 1.05))
        hi = per_frame * frames
    return clip_resize(frames, int(height), int(width), temporal_factor=s["temporal_patch_size"], factor=factor,
                       min_pixels=s["min_pixels"], max_pixels=hi)


def video_grid(config, processor, n_frames: int, width: int, height: int) -> tuple[int, int, int]:
    """(t, h, w) of a video's patch grid (its `video_grid_thw`): t = ceil(frames / temporal_patch_size), the frames
    resized as the video processor resizes them, in patches."""
    s = _video_steps(processor, config)
    patch, temporal = s["patch_size"], s["temporal_patch_size"]
    h, w = frame_size(config, processor, n_frames, width, height)
    return -(-_read_frames(config, processor, n_frames) // temporal), h // patch, w // patch


def video_token_count(config, processor, n_frames: int, frame_size: tuple[int, int]) -> int:
    """The `<|video_pad|>` tokens of a video: t x h x w / merge² (Qwen3-VL's timestamps and per-group vision
    start and end are text around them)."""
    t, h, w = video_grid(config, processor, n_frames, *frame_size)
    merge = _video_steps(processor, config)["merge_size"]
    return t * h * w // (merge * merge)


def video_text_tokens(config, processor, n_frames: int, times=None, fps: float | None = None) -> int:
    """The text tokens a video's span adds around its pads: Qwen3-VL's timestamp and vision start and end per
    temporal group (the stamps as `video_span` writes them, counted by the processor's tokenizer; 8 tokens a stamp
    without one); none on Qwen2-VL and Qwen2.5-VL."""
    if not _qwen3(config):
        return 0
    stamps = group_times(n_frames, _video_steps(processor, config)["temporal_patch_size"], times, fps)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        return len(stamps) * (8 + 2)
    return sum(len(tokenizer(f"<{stamp:.1f} seconds>", add_special_tokens=False)["input_ids"]) + 2
               for stamp in stamps)


def frames_per_token(config, processor=None) -> int:
    """How many frames one video token covers (the temporal patch size)."""
    return int(_video_steps(processor, config)["temporal_patch_size"])


def video_layout(config, processor, n_frames: int, frame_size: tuple[int, int], first_index: int = 0):
    """Where each video token comes from: one merged grid per temporal group (its tokens cover temporal_patch_size
    frames: "frames 1-2"; a last group padded with a repeated frame names its one frame), no newline tokens."""
    from ..layout import GridView, ImageLayout

    t, h, w = video_grid(config, processor, n_frames, *frame_size)
    s = _video_steps(processor, config)
    merge, temporal = s["merge_size"], s["temporal_patch_size"]
    views = []
    for k in range(t):
        first, last = k * temporal + 1, min((k + 1) * temporal, n_frames)
        name = f"frames {first}-{last}" if last > first else f"frame {first}"
        views.append(GridView(name, h // merge, w // merge, image=first_index + k))
    return ImageLayout(tuple(views), tuple(frame_size), (tuple(frame_size),) * t)


def group_times(n_frames: int, temporal: int, times=None, fps: float | None = None) -> list[float]:
    """The seconds of each temporal group as Qwen3-VL's processor stamps it: the mean of its first and last frame's
    times, the last frame repeated up to a whole group. Frame times are `times` (where the frames sit in the
    stream), else k / `fps` (the sampled frames' rate, 1 fps when unknown)."""
    if times is None:
        rate = float(fps) if fps else 1.0
        times = [k / rate for k in range(int(n_frames))]
    times = [float(t) for t in times]
    times += [times[-1]] * (-len(times) % temporal)
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


def video_span(config, processor, grid, n_frames: int, times=None, fps: float | None = None) -> str | None:
    """The text that takes the place of the chat template's `<|video_pad|>`: Qwen3-VL's per-group segments (module
    doc); None for Qwen2-VL and Qwen2.5-VL, whose pads are one run."""
    if not _qwen3(config):
        return None
    from .qwen_vl_shape import VIDEO_PAD, VISION_END, VISION_START

    s = _video_steps(processor, config)
    t, h, w = (int(x) for x in grid)
    per_group = h * w // (s["merge_size"] ** 2)
    pad = getattr(processor, "video_token", None) or VIDEO_PAD
    stamps = group_times(n_frames, s["temporal_patch_size"], times, fps)
    if len(stamps) != t:
        raise ValueError(f"{len(stamps)} timestamps for a video of {t} temporal groups")
    return "".join(f"<{stamp:.1f} seconds>" + VISION_START + pad * per_group + VISION_END for stamp in stamps)


def _patchify(video, patch: int, merge: int, temporal: int):
    """[F, C, H, W] (F a multiple of `temporal`) -> [t·h·w, C·temporal·patch²], merged cells' patches together,
    the order the vision tower reads (row-major over merge x merge blocks, then within a block)."""
    frames, channels, height, width = video.shape
    t, h, w = frames // temporal, height // patch, width // patch
    cells = video.reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    # -> (t, h-blocks, w-blocks, row in block, col in block, C, temporal, patch rows, patch cols)
    cells = cells.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return cells.reshape(t * h * w, channels * temporal * patch * patch), (t, h, w)


def _pil_video(s: dict, frames: list, target: tuple[int, int]):
    """[patches, C·T·P·P] and the grid of `frames` through the PIL backend's steps at `target` (height, width)."""
    import numpy as np
    import torch
    from transformers import Qwen2VLImageProcessorPil
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import PILImageResampling, SizeDict

    temporal = s["temporal_patch_size"]
    pil = Qwen2VLImageProcessorPil(patch_size=s["patch_size"], merge_size=s["merge_size"],
                                   temporal_patch_size=temporal,
                                   size={"shortest_edge": s["min_pixels"], "longest_edge": s["max_pixels"]})
    size = SizeDict(height=int(target[0]), width=int(target[1]))
    arrays = []
    for frame in frames:  # every frame to the same size, as the video processor resizes a stacked video
        array = pil.process_image(frame, do_convert_rgb=True)  # [C, H, W] uint8
        array = PilBackend.resize(pil, array, size, resample=PILImageResampling.BICUBIC)
        array = pil.normalize(pil.rescale(array, 1 / 255), s["image_mean"], s["image_std"])
        arrays.append(np.asarray(array, dtype=np.float32))
    video = torch.from_numpy(np.stack(arrays))
    if pad := -video.shape[0] % temporal:  # the last frame repeated up to a whole temporal group
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    pixels, grid = _patchify(video, s["patch_size"], s["merge_size"], temporal)
    return pixels, torch.tensor([grid], dtype=torch.long)


def video_inputs(processor, config, frames: list, fps: float | None = None) -> dict:
    """pixel_values_videos [patches, C·T·P·P] and video_grid_thw [[t, h, w]] of a video's frames (and, for
    Qwen2.5-VL, second_per_grid_ts: temporal_patch_size / the sampled frames' rate, 1 fps when unknown), from
    transformers' video processor where it exists, else the same steps on the PIL backend."""
    import torch

    own = getattr(processor, "video_processor", None)
    s = _video_steps(processor, config)
    temporal = s["temporal_patch_size"]
    frames = list(frames)
    if _qwen3(config) and len(frames) < temporal:  # its processor takes no less than a temporal group
        frames += [frames[-1]] * (temporal - len(frames))
    if own is not None:
        extra = {}
        if _qwen3(config):  # the frames are sampled already; the cap as the processor is set (silences its warning)
            extra = dict(do_sample_frames=False, cap_pixels_per_frame=bool(s.get("cap_pixels_per_frame")))
        batch = own(videos=[frames], return_tensors="pt", **extra)
        out = {"pixel_values_videos": batch["pixel_values_videos"], "video_grid_thw": batch["video_grid_thw"]}
    else:
        width, height = frames[0].size
        pixels, grid = _pil_video(s, frames, frame_size(config, processor, len(frames), width, height))
        out = {"pixel_values_videos": pixels, "video_grid_thw": grid}
    if config.model_type == "qwen2_5_vl":
        rate = float(fps) if fps else 1.0
        out["second_per_grid_ts"] = torch.tensor([temporal / rate], dtype=torch.float32)
    return out


__all__ = ["VIDEO_MODEL_TYPES", "VIDEO_MIN_PIXELS", "VIDEO_MAX_PIXELS", "QWEN3_VIDEO_MIN_PIXELS",
           "QWEN3_VIDEO_MAX_PIXELS", "reads_video", "video_settings", "video_preprocessor_config", "attach_video",
           "frame_size", "video_grid", "video_token_count", "video_text_tokens", "frames_per_token", "video_layout",
           "group_times", "video_span", "video_inputs"]
