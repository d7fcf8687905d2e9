"""Input side of the app: the checks between a client and the engine, and the per-method knob widgets built
from the engine's registry.

Every value a client sends passes a check here before anything else sees it. A value of the wrong type
or shape is refused with the field's name and what it accepts; an image is taken only as uploaded bytes,
a data URL, or a file in Gradio's upload folder or the shipped examples. A refusal is a gr.Error for
the client and one line in the log (rate-limited), never a traceback.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Any, Callable, Iterable

import gradio as gr
from PIL import Image

from prefixkv_core.limits import (IMAGE_REFUSED, LimitError, Limits, as_rgb, decode_data_url, is_inside,
                                  read_image_file)
from prefixkv_core.policies import Budget, PolicyError

log = logging.getLogger(__name__)

DEFAULT_LIMITS = Limits()
MAX_PROMPT_CHARS = DEFAULT_LIMITS.max_prompt_chars
MAX_DISPLAY_SIDE = 2048  # larger uploads are downscaled before anything else sees them
MAX_SEED = 2**32 - 1
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


# -- refusals ------------------------------------------------------------------------------------------------

class _LogBudget:
    """At most `per_minute` refusal lines a minute; the rest are counted and reported in one line."""

    def __init__(self, per_minute: int = 30):
        self.per_minute = per_minute
        self.window_start = time.monotonic()
        self.used = 0
        self.dropped = 0
        self.lock = threading.Lock()

    def log(self, message: str) -> None:
        with self.lock:
            now = time.monotonic()
            if now - self.window_start >= 60:
                if self.dropped:
                    log.info("refused: %d more requests in the last minute (not logged)", self.dropped)
                self.window_start, self.used, self.dropped = now, 0, 0
            if self.used >= self.per_minute:
                self.dropped += 1
                return
            self.used += 1
        log.info("refused: %s", message[:300])


_REFUSAL_LOG = _LogBudget()


def refuse(message: str) -> gr.Error:
    """An expected rejection: a short message for the client, one log line, no traceback."""
    _REFUSAL_LOG.log(message)
    return gr.Error(message, print_exception=False)


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


# -- images --------------------------------------------------------------------------------------------------

def upload_folder() -> str:
    """Where Gradio keeps uploaded files (and its cached copies of examples and outputs)."""
    from gradio.utils import get_upload_folder

    return get_upload_folder()


def checked_image(limits: Limits = DEFAULT_LIMITS, roots: Callable[[], Iterable[str]] | None = None,
                  **kwargs) -> gr.Image:
    """A gr.Image (type="pil") that takes an image only as a data URL or a file inside `roots()` (default:
    Gradio's upload folder), within the limits, and downscales huge ones.

    Gradio's own preprocessing would open any path a client names when the file object lacks Gradio's
    marker; this one never does. The check wraps this one instance's `preprocess` (a Component subclass
    would make gradio write a .pyi stub next to this file at import time)."""
    kwargs.setdefault("type", "pil")
    component = gr.Image(**kwargs)
    allowed = roots or (lambda: [upload_folder()])

    def preprocess(payload):
        if payload is None:
            return None
        try:
            image = image_from_payload(payload, limits, allowed())
        except LimitError as exc:
            raise refuse(f"image: {exc}") from None
        return downscale(image)

    component.preprocess = preprocess
    component.refusal = f"image: {IMAGE_REFUSED}"  # guard_requests' answer for a path that was not uploaded
    return component


def image_from_payload(payload: Any, limits: Limits, roots: Iterable[str]) -> Image.Image:
    """An image file object as a client sent it (a data URL, or a path inside `roots`) -> RGB image, within the
    limits (bytes and pixels checked before decoding). Raises LimitError."""
    url, path = getattr(payload, "url", None), getattr(payload, "path", None)
    if isinstance(url, str) and url.startswith("data:"):
        return decode_data_url(url, max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels)
    if isinstance(path, str) and path:
        return read_image_file(path, list(roots), max_bytes=limits.max_image_bytes,
                               max_pixels=limits.max_image_pixels)
    raise LimitError(IMAGE_REFUSED)


def downscale(image: Image.Image | None, side: int = MAX_DISPLAY_SIDE) -> Image.Image | None:
    if image is None:
        return None
    image = as_rgb(image)
    if max(image.size) > side:
        image = image.copy()
        image.thumbnail((side, side))
    return image


# -- every other input ---------------------------------------------------------------------------------------

def _choice_values(component) -> list[Any]:
    return [c[1] if isinstance(c, (list, tuple)) else c for c in (component.choices or [])]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def accepted_values(component) -> str:
    """What one input accepts, in words, for refusal messages."""
    if isinstance(component, (gr.Slider, gr.Number)):
        whole = getattr(component, "precision", None) == 0 or (isinstance(component, gr.Slider)
                                                                 and float(component.step or 0).is_integer()
                                                                 and float(component.minimum).is_integer())
        kind = "a whole number" if whole else "a number"
        lo, hi = component.minimum, component.maximum
        if lo is not None and hi is not None:
            return f"{kind} from {_num(lo)} to {_num(hi)}"
        if lo is not None:
            return f"{kind} of at least {_num(lo)}"
        return kind
    if isinstance(component, gr.Checkbox):
        return "true or false"
    if isinstance(component, (gr.CheckboxGroup, gr.Dropdown)) and (
            isinstance(component, gr.CheckboxGroup) or component.multiselect):
        return "a list of any of: " + ", ".join(map(str, _choice_values(component)))
    if isinstance(component, (gr.Radio, gr.Dropdown)):
        return "one of: " + ", ".join(map(str, _choice_values(component)))
    if isinstance(component, gr.Textbox):
        return f"text of at most {component.max_length} characters" if component.max_length else "text"
    return "a value of this field's type"


def _precheck(component, field: str, payload: Any) -> Any:
    """Type and shape of one payload before gradio's own preprocessing; returns it (lists normalised)."""
    if payload is None:
        return None
    accepts = accepted_values(component)

    def bad() -> gr.Error:
        return refuse(f"{field} must be {accepts}, got {_short(payload)}")

    if isinstance(component, (gr.Slider, gr.Number)):
        if not _is_number(payload) or (accepts.startswith("a whole number") and not float(payload).is_integer()):
            raise bad()
    elif isinstance(component, gr.Checkbox):
        if not isinstance(payload, bool):
            raise bad()
    elif isinstance(component, (gr.CheckboxGroup, gr.Dropdown)) and (
            isinstance(component, gr.CheckboxGroup) or component.multiselect):
        if isinstance(payload, str):  # "full, prefixkv" for a list of names
            payload = [p.strip() for p in payload.split(",") if p.strip()]
        if not isinstance(payload, (list, tuple)):
            raise bad()
        choices = _choice_values(component)
        unknown = [p for p in payload if not isinstance(p, (str, int, float)) or p not in choices]
        if unknown:
            raise refuse(f"{field}: {_short(unknown)} not accepted; {field} must be {accepts}")
        payload = list(payload)
    elif isinstance(component, (gr.Radio, gr.Dropdown)):
        if not isinstance(payload, (str, int, float)) or payload not in _choice_values(component):
            raise bad()
    elif isinstance(component, gr.Textbox):
        if isinstance(payload, (list, tuple)):
            raise refuse(f"{field}: one text at a time, please (got a list)")
        if not isinstance(payload, str):
            raise bad()
        if component.max_length and len(payload) > component.max_length:
            raise refuse(f"{field} is {len(payload)} characters; the limit is {component.max_length}")
    return payload


def guard_input(component, field: str):
    """Wrap one input's `preprocess`: a value of the wrong type or shape, or one gradio itself rejects, is
    refused with the field's name and what it accepts (gradio would answer an anonymous error and log a
    traceback). `field` is the name the API gives the value."""
    original = component.preprocess

    def preprocess(payload):
        payload = _precheck(component, field, payload)
        if payload is None and isinstance(component, (gr.Slider, gr.CheckboxGroup, gr.Dropdown)):
            return None  # the handler applies its default (or refuses with its own message)
        try:
            return original(payload)
        except Exception:  # noqa: BLE001 - gradio's own checks (bounds, choices) or any failure of its processing
            raise refuse(f"{field} must be {accepted_values(component)}, got {_short(payload)}") from None

    component.preprocess = preprocess
    return component


def _file_objects(value: Any) -> Iterable[dict]:
    """Every dict with a string `path` in a payload, at any depth and in every item of every list, as Gradio's own
    walk finds them (the request body's size limit bounds the walk; a stack, not recursion, so nesting cannot
    exhaust it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("path"), str):
                yield item
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _names_remote_file(value: Any) -> bool:
    """A file object whose path is a URL (gradio downloads those into its cache)."""
    return any(obj["path"].strip().lower().startswith(("http://", "https://")) for obj in _file_objects(value))


def _marked_paths(value: Any) -> Iterable[str]:
    """The paths of the file objects in a payload that carry Gradio's marker (those gradio itself reads)."""
    for obj in _file_objects(value):
        meta = obj.get("meta")
        if isinstance(meta, dict) and meta.get("_type") == "gradio.FileData":
            yield obj["path"]


def _not_uploaded(value: Any) -> bool:
    """A marked file object whose path lies outside Gradio's upload folder (gradio would refuse it anonymously)."""
    return any(not path.strip().lower().startswith(("http://", "https://")) and not is_inside(path, [upload_folder()])
               for path in _marked_paths(value))


def _refusal(block_fn, inputs: list[Any], bad: Callable[[Any, Any], bool]) -> str | None:
    """The refusal of the first input for which `bad(component, value)`: its component's own sentence (the visual
    inputs carry one), else the image's; None when no input is bad."""
    for block, value in zip(block_fn.inputs, inputs or []):
        if bad(block, value):
            return getattr(block, "refusal", None) or f"image: {IMAGE_REFUSED}"
    return None


def _check_list_lengths(block_fn, inputs: list[Any]) -> None:
    """A list input holding more items than its component takes (`max_items`, with the sentence `too_many` makes)
    is refused before Gradio walks its items."""
    for block, value in zip(block_fn.inputs, inputs or []):
        limit = getattr(block, "max_items", None)
        if limit is not None and isinstance(value, (list, tuple)) and len(value) > limit:
            raise refuse(block.too_many(len(value)))


def _unmarked_file(block, value: Any) -> bool:
    """A file object without Gradio's marker sent to an input whose data model insists on it (the video): a
    server path like any other, answered as such rather than as a malformed value."""
    from gradio.data_classes import FileData

    return getattr(block, "data_model", None) is FileData and isinstance(value, dict) and \
        isinstance(value.get("path"), str)


# what a value gradio could not even parse should have been, by the data model that failed
SHAPE_MESSAGES = {
    "GalleryData": 'images must be null or a list of {"image": a file object from the upload route or '
                   '{"url": "data:image/...;base64,..."}}',
    "ImageData": 'image must be null, a file object from the upload route or {"url": "data:image/...;base64,..."}',
    "FileData": "video must be null or a file object from the upload route",
}


def guard_requests(blocks) -> None:
    """What gradio does with a request before any input's own check runs, made safe: a request with fewer
    values than the endpoint takes, and a file object naming a server path that was not uploaded, are
    answered in one line each (not an anonymous error and a traceback in the log; the path answered like
    every other refused image, saying nothing about the disk); a file object naming a URL is refused
    before gradio would download it. Any other malformed value is refused the same way."""
    from gradio.exceptions import InvalidPathError

    check_count, preprocess_data = blocks.validate_inputs, blocks.preprocess_data

    def validate_inputs(block_fn, inputs):
        try:
            check_count(block_fn, inputs)
        except ValueError:
            name = f"/{block_fn.api_name}" if block_fn.api_name else "this event"
            raise refuse(f"{name} takes {len(block_fn.inputs)} values, got {len(inputs)}: send every input "
                         "(gradio_client fills in the defaults; see /gradio_api/info)") from None

    async def checked_preprocess_data(block_fn, inputs, state, explicit_call=False):
        for bad in (_names_remote_file, _not_uploaded):  # a URL gradio would fetch, unbounded, before any check
            refusal = _refusal(block_fn, inputs, lambda block, value: bad(value))
            if refusal:
                raise refuse(refusal)
        _check_list_lengths(block_fn, inputs)
        try:
            return await preprocess_data(block_fn, inputs, state, explicit_call)
        except gr.Error:
            raise
        except InvalidPathError:  # a path this walk did not see: named after the input that holds one
            raise refuse(_refusal(block_fn, inputs, lambda block, value: any(True for _ in _marked_paths(value)))
                         or f"image: {IMAGE_REFUSED}") from None
        except Exception as exc:  # noqa: BLE001 - a value gradio could not even parse
            title, refusal = str(getattr(exc, "title", "")), _refusal(block_fn, inputs, _unmarked_file)
            if title == "FileData" and refusal:
                raise refuse(refusal) from None
            for model, message in SHAPE_MESSAGES.items():
                if model in title:
                    raise refuse(message) from None
            raise refuse(f"a value of this request has the wrong shape ({exc.__class__.__name__}): "
                         "see /gradio_api/info for what each input accepts") from None

    blocks.validate_inputs = validate_inputs
    blocks.preprocess_data = checked_preprocess_data


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
        """The client's value as the knob's type (None: the default). Raises ValueError saying what the
        knob accepts; ranges are the policy's to check."""
        if value is None:
            return self.default
        if isinstance(self.default, bool):
            if isinstance(value, bool):
                return value
            raise ValueError("true or false")
        if isinstance(self.default, int):
            if _is_number(value) and float(value).is_integer() and abs(value) < 2**53:
                return int(value)
            raise ValueError("a whole number")
        if isinstance(self.default, float):
            if _is_number(value):
                return float(value)
            raise ValueError("a finite number")
        if isinstance(value, str) and len(value) <= 100:
            return value
        raise ValueError("text of at most 100 characters")


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
        except (TypeError, ValueError) as exc:
            raise refuse(f"{spec.key} must be {exc}, got {_short(values[spec.key])}") from None
        if value != spec.default:
            knobs.setdefault(spec.method, {})[spec.knob] = value
    return knobs


def check_request(prompt: Any, methods: Any, budget: Any, max_new_tokens: Any, limit: int,
                  max_chars: int = MAX_PROMPT_CHARS) -> tuple[str, list[str], Budget, int]:
    """Types and ranges of a Compare request, with messages a user can act on (token limits are checked once
    the model's tokenizer is at hand). The budget comes back a `Budget`, which the engine takes as it is."""
    if isinstance(prompt, (list, tuple)):
        raise refuse("prompt: one prompt at a time, please")
    if prompt is not None and not isinstance(prompt, str):
        raise refuse(f"prompt must be text, got {_short(prompt)}")
    prompt = prompt or ""
    if not prompt.strip():
        raise refuse("the prompt is empty: type a question or instruction")
    if len(prompt) > max_chars:
        raise refuse(f"the prompt is {len(prompt)} characters; the limit is {max_chars}")
    if methods is None:
        raise refuse("no method selected: methods must be a list of method names, e.g. [\"full\", \"prefixkv\"]")
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    if not isinstance(methods, (list, tuple)) or not all(isinstance(m, str) for m in methods):
        raise refuse(f"methods must be a list of method names, got {_short(methods)}")
    methods = list(methods)
    if not methods:
        raise refuse("no method selected: tick at least one method")
    try:
        budget = Budget(budget)  # the one range check of the app's budget; typed from here on
    except PolicyError as exc:
        raise refuse(str(exc)) from None
    if not _is_number(max_new_tokens):
        raise refuse(f"max new tokens (max_new_tokens) must be a whole number from 1 to {limit}, "
                     f"got {_short(max_new_tokens)}")
    max_new = int(max_new_tokens)
    if not (1 <= max_new <= limit):
        raise refuse(f"max new tokens (max_new_tokens) must be between 1 and {limit}, got {max_new}")
    return prompt, methods, budget, max_new


def check_budget_mode(equal_memory: Any) -> str:
    """The equal-memory switch -> the engine's budget mode ("equal_memory" or "published")."""
    if equal_memory is None:
        return "published"
    if not isinstance(equal_memory, bool):
        raise refuse(f"equal_memory must be true or false, got {_short(equal_memory)}")
    return "equal_memory" if equal_memory else "published"


def check_query_agnostic(query_agnostic: Any) -> bool:
    """The query-agnostic switch: True compresses before the question is fed."""
    if query_agnostic is None:
        return False
    if not isinstance(query_agnostic, bool):
        raise refuse(f"query_agnostic must be true or false, got {_short(query_agnostic)}")
    return query_agnostic


def check_switch(field: str, value: Any) -> bool:
    """An on/off switch of a request (None is off)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise refuse(f"{field} must be true or false, got {_short(value)}")
    return value


def check_choice(field: str, value: Any, choices: Iterable[str], default: str | None = None) -> str | None:
    """One of a fixed list of names (None: `default`); anything else is refused with the list."""
    allowed = list(choices)
    if value is None:
        return default
    if not isinstance(value, str) or value not in allowed:
        listed = ", ".join(allowed) if allowed else "nothing (no stored values)"
        raise refuse(f"{field} must be one of: {listed}; got {_short(value)}")
    return value


def check_sampling(do_sample: Any, temperature: Any, top_p: Any, seed: Any) -> tuple[bool, float, float, int]:
    """Sampling settings of a request; None takes the default."""
    do_sample = False if do_sample is None else do_sample
    if not isinstance(do_sample, bool):
        raise refuse(f"do_sample must be true or false, got {_short(do_sample)}")
    out = []
    for name, value, default in (("temperature", temperature, 0.7), ("top_p", top_p, 0.9)):
        value = default if value is None else value
        if not _is_number(value) or not (0 < value <= (2.0 if name == "temperature" else 1.0)):
            raise refuse(f"{name} must be a number in (0, {2 if name == 'temperature' else 1}], got {_short(value)}")
        out.append(float(value))
    seed = 0 if seed is None else seed
    if not _is_number(seed) or not float(seed).is_integer() or not (0 <= seed <= MAX_SEED):
        raise refuse(f"seed must be a whole number from 0 to {MAX_SEED}, got {_short(seed)}")
    return do_sample, out[0], out[1], int(seed)


def example_images(folder: Path, scenes_first: bool = False) -> list[str]:
    """Image files in the examples folder at startup, sorted: photographs first, then rendered scenes, or the
    scenes first for a model that was trained on them only (the embedded default)."""
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    return [str(p) for p in sorted(files, key=lambda p: (p.name.startswith("scene") != scenes_first, p.name))]
