"""Prompt text and model inputs: the chat template of the models built here, one user turn, a follow-up
turn, and `encode` (processor -> tensors on the model's device)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import ModelLoadError

if TYPE_CHECKING:
    from .descriptor import LoadedModel

IMAGE_TOKEN = "<image>"


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


def _processor(loaded: LoadedModel):
    if loaded.processor is None:
        raise ModelLoadError(f"{loaded.name} has no processor (random weights): it cannot format or encode text")
    return loaded.processor


def _user_message(prompt: str, with_image: bool) -> dict:
    content: list[dict] = []
    if with_image:
        content.append({"type": "image"})
    content.append({"type": "text", "text": prompt})
    return {"role": "user", "content": content}


def _render(loaded: LoadedModel, messages: list[dict], add_generation_prompt: bool) -> str:
    proc = _processor(loaded)
    if getattr(proc, "chat_template", None):
        return proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
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


def format_prompt(loaded: LoadedModel, prompt: str, with_image: bool) -> str:
    """One user turn (image first when `with_image`) through the chat template, generation prompt added."""
    return _render(loaded, [_user_message(prompt, with_image)], add_generation_prompt=True)


_SENTINEL = "\u2063PREFIXKV_ANSWER\u2063"


def format_followup(loaded: LoadedModel, prompt: str) -> str:
    """Text to append after the assistant's answer for a follow-up user turn.

    It starts by closing the assistant turn (for ChatML: "<|im_end|>\\n"), then the new user turn and
    the generation prompt. So the caller appends it to the answer *without* the answer's end-of-turn
    token (strip a trailing eos id from the generated ids before appending these ids).
    """
    msgs = [
        _user_message("Q", False),
        {"role": "assistant", "content": [{"type": "text", "text": _SENTINEL}]},
        _user_message(prompt, False),
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


def encode(loaded: LoadedModel, image, text: str) -> dict:
    """processor(...) -> dict of tensors on loaded.device (pixel_values in loaded.dtype)."""
    proc = _processor(loaded)
    if image is not None:
        if getattr(image, "mode", "RGB") != "RGB":
            image = image.convert("RGB")
        batch = proc(images=image, text=text, return_tensors="pt")
    else:
        batch = proc.tokenizer(text, return_tensors="pt")
    out: dict[str, torch.Tensor] = {
        "input_ids": batch["input_ids"].to(loaded.device, torch.long),
        "attention_mask": batch["attention_mask"].to(loaded.device),
    }
    if image is not None:
        out["pixel_values"] = batch["pixel_values"].to(loaded.device, loaded.dtype)
        for k in ("image_sizes",):
            if k in batch:
                out[k] = batch[k].to(loaded.device)
    return out
