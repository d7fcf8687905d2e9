"""Input side of the app: the image component that refuses bad files politely, the per-method knob
widgets built from the engine's registry, and the checks run before a request reaches the engine."""
from __future__ import annotations

import os
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

MAX_UPLOAD_BYTES = 10 * 1024 * 1024  # 10 MB
MAX_UPLOAD = "10mb"  # the same limit for gradio's upload route
MAX_PROMPT_CHARS = 2000
MAX_DISPLAY_SIDE = 2048  # larger uploads are downscaled before anything else sees them
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")



def checked_image(**kwargs) -> gr.Image:
    """A gr.Image (type="pil") whose preprocessing turns an oversized or non-image upload into a short
    gr.Error instead of a server exception, and downscales huge images.

    The check wraps this one instance's `preprocess` (a Component subclass would make gradio write a
    .pyi stub next to this file at import time)."""
    kwargs.setdefault("type", "pil")
    component = gr.Image(**kwargs)
    original = component.preprocess

    def preprocess(payload):
        if payload is None:
            return None
        path = getattr(payload, "path", None)
        name = Path(getattr(payload, "orig_name", None) or path or "upload").name
        if path and os.path.exists(path) and os.path.getsize(path) > MAX_UPLOAD_BYTES:
            raise gr.Error(f"{name} is {os.path.getsize(path) / 2**20:.1f} MB; the limit is 10 MB",
                           print_exception=False)
        try:
            image = original(payload)
        except gr.Error:
            raise
        except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
            raise gr.Error(f"{name} is not a readable image ({exc.__class__.__name__}); "
                           "accepted: PNG, JPEG, WebP, BMP, GIF", print_exception=False) from None
        return downscale(image) if isinstance(image, Image.Image) else image

    component.preprocess = preprocess
    return component


def downscale(image: Image.Image | None, side: int = MAX_DISPLAY_SIDE) -> Image.Image | None:
    if image is None:
        return None
    image = image.convert("RGB")
    if max(image.size) > side:
        image = image.copy()
        image.thumbnail((side, side))
    return image


@dataclass
class KnobSpec:
    method: str
    knob: str
    default: Any
    # the policy's declaration, as prefixkv_core.describe() gives it: label, help, accepted, choices, low, high, ...
    details: dict[str, Any] = dataclass_field(default_factory=dict)

    @property
    def key(self) -> str:  # the keyword name in the API
        return f"{self.method}__{self.knob}"

    def widget(self) -> gr.components.Component:
        """The input for this knob, from the policy's declaration (choices, type, range, help)."""
        d = self.details
        label = d.get("label") or self.knob
        info = d.get("help")
        choices = d.get("choices")
        if choices:
            return gr.Radio(list(choices), value=self.default, label=label, info=info)
        if isinstance(self.default, bool):
            return gr.Checkbox(value=self.default, label=label, info=info)
        low, high = d.get("low"), d.get("high")
        if d.get("accepted"):
            info = f"{info} ({d['accepted']})" if info else d["accepted"]
        if isinstance(self.default, int):
            return gr.Number(value=self.default, precision=0, label=label, info=info, minimum=low, maximum=high)
        if isinstance(self.default, float):
            if low is not None and high is not None:
                step = 0.005
                lo = low + step if d.get("low_open") else low
                hi = high - step if d.get("high_open") else high
                return gr.Slider(lo, hi, value=self.default, step=step, label=label, info=info)
            return gr.Number(value=self.default, label=label, info=info, minimum=low, maximum=high)
        return gr.Textbox(value=str(self.default), label=label, info=info)

    def coerce(self, value: Any) -> Any:
        if value is None:
            return self.default
        if isinstance(self.default, bool):
            return bool(value)
        if isinstance(self.default, int):
            return int(round(float(value)))
        if isinstance(self.default, float):
            return float(value)
        return str(value)


def knob_specs(described: list[dict[str, Any]], methods: list[str]) -> list[KnobSpec]:
    """Editable knobs of the offered methods, as their policies declare them (knobs a policy marks as not
    editable, like offline PrefixKV's calibrated ratios, are set by code)."""
    out = []
    for d in described:
        if d["name"] not in methods:
            continue
        for detail in d["knob_details"]:
            if detail["editable"]:
                out.append(KnobSpec(d["name"], detail["name"], detail["default"], dict(detail)))
    return out


def collect_knobs(specs: list[KnobSpec], values: dict[str, Any], methods: list[str]) -> dict[str, dict[str, Any]]:
    """Only knobs that differ from their defaults, for the selected methods."""
    knobs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if spec.method not in methods or spec.key not in values:
            continue
        try:
            value = spec.coerce(values[spec.key])
        except (TypeError, ValueError):
            raise gr.Error(f"{spec.method} knob {spec.knob}: {values[spec.key]!r} is not a valid value") from None
        if value != spec.default:
            knobs.setdefault(spec.method, {})[spec.knob] = value
    return knobs


def check_request(prompt: Any, methods: Any, budget: Any, max_new_tokens: Any, limit: int) -> tuple[str, list[str], float, int]:
    """UI-level checks with messages a user can act on (the engine re-checks everything)."""
    if isinstance(prompt, (list, tuple)):
        raise gr.Error("one prompt at a time, please")
    prompt = prompt if isinstance(prompt, str) else ""
    if not prompt.strip():
        raise gr.Error("the prompt is empty: type a question or instruction")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise gr.Error(f"the prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = list(methods or [])
    if not methods:
        raise gr.Error("no method selected: tick at least one method")
    try:
        budget = float(budget)
    except (TypeError, ValueError):
        raise gr.Error(f"budget must be a number in (0, 1], got {budget!r}") from None
    if not (0.0 < budget <= 1.0):
        raise gr.Error(f"budget must be a kept fraction in (0, 1], got {budget:g}")
    try:
        max_new = int(max_new_tokens)
    except (TypeError, ValueError):
        raise gr.Error(f"max new tokens must be a whole number, got {max_new_tokens!r}") from None
    if not (1 <= max_new <= limit):
        raise gr.Error(f"max new tokens must be between 1 and {limit}, got {max_new}")
    return prompt, methods, budget, max_new


def example_images(folder: Path) -> list[str]:
    """Image files in the examples folder at startup (sorted; photographs first, then rendered scenes)."""
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    return [str(p) for p in sorted(files, key=lambda p: (p.name.startswith("scene"), p.name))]
