"""Prompt text and model inputs: the chat template of the models built here, one user turn, a follow-up
turn, and `encode` (processor -> tensors on the model's device)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import ModelLoadError
from .families import IMAGE_TOKEN

if TYPE_CHECKING:
    from .descriptor import LoadedModel


def chatml_template(default_system: str | None = None) -> str:
    """ChatML template; {"type": "image"} content items render as "<image>\\n"."""
    system = ""
    if default_system:
        system = (
            "{%- if loop.first and message['role'] != 'system' -%}"
            "{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
            "{%- endif -%}"
        )
    return (
        "{%- for message in messages -%}"
        + system
        + "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}"
        "{{ message['content'] }}"
        "{%- else -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'image' -%}{{ '<image>\\n' }}"
        "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


# The released checkpoints' conversation formats (their chat templates render exactly these strings):
#   llava-1.5 (llava-1.5-7b-hf):          "USER: <image>\n{q} ASSISTANT: {a} USER: {q2} ASSISTANT:"
#   llava-next (llava-v1.6-mistral-7b-hf): "[INST] <image>\n{q} [/INST] {a}</s> [INST] {q2} [/INST]"
#   llava-interleave (ChatML):            "<|im_start|>user\n<image>\n{q}<|im_end|>\n<|im_start|>assistant\n"
#                                          (images first, then "\n" + each text item)
#   llava-onevision (ChatML):             "<|im_start|>user\n<image>\n{q}<|im_end|>\n<|im_start|>assistant\n"
#                                          (each image as "<image>\n", then the text items)
_TEXT_ITEMS = "{%- for item in message['content'] if item['type'] == 'text' -%}"
_IMAGE_ITEMS = "{%- for item in message['content'] if item['type'] == 'image' -%}"

VICUNA_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'] | upper + ': ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] + ' ' }}{%- else -%}"
    + _IMAGE_ITEMS + "{{ '<image>\n' }}{%- endfor -%}"
    + _TEXT_ITEMS + "{{ item['text'] + ' ' }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

MISTRAL_INST_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else "
    "(message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) -%}"
    "{%- if message['role'] == 'user' -%}{{ '[INST] ' }}"
    "{%- if message['content'] is not string -%}" + _IMAGE_ITEMS + "{{ '<image>\n' }}{%- endfor -%}{%- endif -%}"
    "{{ text + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ ' ' + text + '</s> ' }}"
    "{%- elif message['role'] == 'system' -%}{{ '<<SYS>>\n' + text + '\n<</SYS>>\n\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _chatml(image: str, text_prefix: str) -> str:
    return (
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
        + _IMAGE_ITEMS + "{{ '" + image + "' }}{%- endfor -%}"
        + _TEXT_ITEMS + "{{ '" + text_prefix + "' + item['text'] }}{%- endfor -%}"
        "{%- endif -%}"
        "{{ '<|im_end|>\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
    )


INTERLEAVE_TEMPLATE = _chatml("<image>", "\\n")
ONEVISION_TEMPLATE = _chatml("<image>\\n", "")

FAMILY_TEMPLATES = {"llava-1.5": VICUNA_TEMPLATE, "llava-next": MISTRAL_INST_TEMPLATE,
                    "llava-interleave": INTERLEAVE_TEMPLATE, "llava-onevision": ONEVISION_TEMPLATE}


def _processor(loaded: LoadedModel):
    if loaded.processor is None:
        raise ModelLoadError(f"{loaded.name} has no processor (random weights): it cannot format or encode text")
    return loaded.processor


def image_markers(prompt: str) -> int:
    """How many `<image>` markers the user typed in `prompt` (each places one image there)."""
    return prompt.count(IMAGE_TOKEN)


def _user_message(prompt: str, images: int) -> dict:
    """A user turn with `images` images: where the prompt has `<image>` markers they stay in its text and place the
    images (the processor expands each marker); otherwise the images come first, as one image item each."""
    content: list[dict] = []
    if not image_markers(prompt):
        content += [{"type": "image"}] * images
    content.append({"type": "text", "text": prompt})
    return {"role": "user", "content": content}


def _render(loaded: LoadedModel, messages: list[dict], add_generation_prompt: bool) -> str:
    proc = _processor(loaded)
    if getattr(proc, "chat_template", None):
        text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        from .families import hooks

        family = hooks(loaded.family)
        marker = family.image_marker(proc)
        text = text if marker == IMAGE_TOKEN else text.replace(IMAGE_TOKEN, marker)  # the user's markers
        video_marker = getattr(family, "video_marker", None)
        if video_marker is not None and loaded.video_token_id is not None:  # a video read natively: its span
            from .video import VIDEO_TOKEN

            text = text.replace(VIDEO_TOKEN, video_marker(proc))
        return text
    # No template shipped with the checkpoint: the LLaVA-1.5 conversation format.
    out = []
    for m in messages:
        content = m["content"]
        if not isinstance(content, str):
            content = "".join(
                IMAGE_TOKEN + "\n" if c["type"] == "image" else c.get("text", "") for c in content
            )
        out.append(("USER: " if m["role"] == "user" else "ASSISTANT: ") + content + (" " if m["role"] == "user" else "</s>"))
    text = "".join(out)
    if add_generation_prompt:
        text += "ASSISTANT:"
    return text


def format_prompt(loaded: LoadedModel, prompt: str, with_image: bool | int) -> str:
    """One user turn through the chat template, generation prompt added. `with_image`: how many images the turn
    carries (True = one); they come before the text unless the prompt places them with `<image>` markers."""
    return _render(loaded, [_user_message(prompt, int(with_image))], add_generation_prompt=True)


_SENTINEL = "\u2063PREFIXKV_ANSWER\u2063"


def format_followup(loaded: LoadedModel, prompt: str, images: int = 0) -> str:
    """Text to append after the assistant's answer for a follow-up user turn (with `images` new images, placed
    as in `format_prompt`).

    It starts by closing the assistant turn (for ChatML: "<|im_end|>\\n"), then the new user turn and
    the generation prompt. So the caller appends it to the answer *without* the answer's end-of-turn
    token (strip a trailing eos id from the generated ids before appending these ids).
    """
    msgs = [
        _user_message("Q", 0),
        {"role": "assistant", "content": [{"type": "text", "text": _SENTINEL}]},
        _user_message(prompt, images),
    ]
    full = _render(loaded, msgs, add_generation_prompt=True)
    i = full.rfind(_SENTINEL)
    if i < 0:  # a template that rejects list content for the assistant role
        msgs[1] = {"role": "assistant", "content": _SENTINEL}
        full = _render(loaded, msgs, add_generation_prompt=True)
        i = full.rfind(_SENTINEL)
    if i < 0:
        raise ModelLoadError("the chat template drops assistant turns; cannot format a follow-up turn")
    return full[i + len(_SENTINEL):]


# the processor's token-level outputs; Qwen-VL's token types (mm_token_type_ids) follow from the ids, and the engine
# passes its positions itself (`decoding.runner.model_positions`)
TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


def as_image_list(image) -> list:
    """None, one image or a sequence of images -> a list of images (empty for None)."""
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]


def encode(loaded: LoadedModel, image, text: str, add_special_tokens: bool = True, video: list | None = None,
           video_fps: float | None = None, video_times=None) -> dict:
    """processor(...) -> dict of tensors on loaded.device: input_ids, attention_mask and, with images (one, or a
    list in the order their `<image>` tokens appear in `text`), every tensor the processor made for them
    (pixel_values in loaded.dtype; anyres families add image_sizes, OneVision batch_num_images).
    `add_special_tokens=False` for text that continues a conversation (no BOS). `video`: the frames of a video
    the model reads natively (OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL), whose one `<video>` token in `text`
    becomes the video's tokens, with their pixel_values_videos (Qwen: and video_grid_thw; Qwen2.5-VL's
    second_per_grid_ts from `video_fps`, the sampled frames' rate; Qwen3-VL's timestamps from `video_times`, the
    frames' seconds in the stream, else from `video_fps`)."""
    proc = _processor(loaded)
    images = [im.convert("RGB") if getattr(im, "mode", "RGB") != "RGB" else im for im in as_image_list(image)]
    image = images or None
    stand_in = None
    if video:  # the processor refuses video tokens without its video processor: one stand-in token holds the place
        from .video import VIDEO_TOKEN

        stand_in = _stand_in_token(proc.tokenizer, text, proc)
        text = text.replace(VIDEO_TOKEN, stand_in)
    if images:
        batch = proc(images=images if len(images) > 1 else images[0], text=text, return_tensors="pt",
                     **({} if add_special_tokens else {"add_special_tokens": False}))
    else:
        batch = proc.tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    out: dict[str, torch.Tensor] = {
        "input_ids": batch["input_ids"].to(loaded.device, torch.long),
        "attention_mask": batch["attention_mask"].to(loaded.device),
    }
    if image is not None:
        for key, value in batch.items():
            if key in TEXT_KEYS or not isinstance(value, torch.Tensor):
                continue
            floating = value.is_floating_point()
            out[key] = value.to(loaded.device, loaded.dtype) if floating else value.to(loaded.device)
    if stand_in is not None:
        out.update(_video_tokens(loaded, proc, out, stand_in, video, video_fps, video_times))
    return out


def _stand_in_token(tokenizer, text: str, processor=None) -> str:
    """A special token of the tokenizer that is not in `text` and is neither the image nor the video token."""
    from .video import VIDEO_TOKEN

    taken = {IMAGE_TOKEN, VIDEO_TOKEN, *(t for t in (getattr(owner, name, None) for owner in (tokenizer, processor)
                                                    for name in ("image_token", "video_token")) if t)}
    for token in tokenizer.all_special_tokens:
        if token not in taken and "vision" not in token and token not in text and \
                len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1:
            return token
    raise ModelLoadError("the tokenizer has no spare special token to place a video with")


def _video_tokens(loaded: LoadedModel, proc, out: dict, stand_in: str, frames: list,
                  fps: float | None = None, times=None) -> dict:
    """The encoded prompt with its stand-in token replaced by the video's tokens (Qwen3-VL: its span of timestamps
    and temporal groups, `video_span`), and the frames' pixels (and grid)."""
    from .video import video_inputs, video_span, video_token_count

    ids = out["input_ids"]
    stand_in_id = proc.tokenizer.convert_tokens_to_ids(stand_in)
    where = (ids[0] == stand_in_id).nonzero().flatten()
    if where.numel() != 1:
        raise ModelLoadError(f"a prompt takes one video; found {where.numel()} places for it")
    at = int(where[0])
    config = loaded.model.config
    tensors = video_inputs(proc, config, frames, fps)
    grid = tensors.get("video_grid_thw")
    if grid is not None:  # Qwen: t·h·w patches, merge² to a token
        merge = int(config.vision_config.spatial_merge_size)
        count = int(grid.prod(-1).sum()) // (merge * merge)
    else:
        count = video_token_count(config, len(frames))
    span = video_span(config, proc, grid[0].tolist(), len(frames), times, fps) if grid is not None else None
    if span is None:
        run = ids.new_full((1, count), int(loaded.video_token_id))
    else:  # special tokens split the text, so the span's pieces encode as they do in the whole prompt
        run = torch.tensor([proc.tokenizer(span, add_special_tokens=False)["input_ids"]], dtype=ids.dtype,
                           device=ids.device)
        if int((run == int(loaded.video_token_id)).sum()) != count:
            raise ModelLoadError("the video's span does not hold one token per video feature")
    ids = torch.cat([ids[:, :at], run, ids[:, at + 1:]], dim=1)
    mask = torch.ones_like(ids, dtype=out["attention_mask"].dtype)
    placed = {"input_ids": ids, "attention_mask": mask}
    for key, value in tensors.items():
        placed[key] = value.to(loaded.device, loaded.dtype) if value.is_floating_point() and key != \
            "second_per_grid_ts" else value.to(loaded.device)
    return placed


def vision_inputs(batch: dict) -> dict:
    """The image tensors of an `encode` result (what the model's forward takes besides the token ids)."""
    return {k: v for k, v in batch.items() if k not in TEXT_KEYS}
