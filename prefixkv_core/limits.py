"""Limits for serving the engine to clients that may be hostile: text counted in tokens as well as
characters, image files confined to known folders and bounded in bytes and pixels, and the memory KV
caches take.

No gradio here. The app (ui/) turns a `LimitError` into a message for the user; the CLI and library
callers may use the same checks.

    limits = Limits()
    tokens = check_prompt(limits, loaded, "Describe the image.", with_image=True, max_new_tokens=48)
    image = open_image_file(path, roots=[upload_dir], max_bytes=limits.max_image_bytes,
                            max_pixels=limits.max_image_pixels)
"""
from __future__ import annotations

import base64
import functools
import binascii
import io
import math
import os
import sys
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from PIL import Image, ImageOps, UnidentifiedImageError

MB = 2**20

# Decoders PIL may use (JPEG covers multi-picture JPEGs too). Everything else is never tried on client
# data: EPS, for one, runs Ghostscript.
Image.init()
IMAGE_FORMATS = tuple(f for f in ("PNG", "JPEG", "WEBP", "BMP", "GIF") if f in Image.OPEN)
ACCEPTED_IMAGES = "PNG, JPEG, WebP, BMP or GIF"

# The one answer for an image the server will not use: outside the allowed folders, missing, a folder, a
# device, unreadable or not an image all read the same, so the answer says nothing about the disk.
IMAGE_REFUSED = f"not a readable image: send the image itself ({ACCEPTED_IMAGES}) as an upload or a data URL"


class LimitError(ValueError):
    """An input over a limit, or a server at capacity; the message names the limit and the value."""


@dataclass(frozen=True)
class Limits:
    """Every bound a server applies. The first five and the video fields bound one request; the five between
    them bound what all conversations together may hold (the app's session registry enforces them) and how many
    decode at once."""

    max_prompt_chars: int = 2000
    max_prompt_tokens: int = 1024  # the user's text of one turn, without the chat template or the image
    max_run_tokens: int = 3072  # a whole conversation: template, image tokens, every turn and answer
    max_image_bytes: int = 10 * MB  # uploads, data URLs and files named in API calls alike
    max_image_pixels: int = 40_000_000  # checked before decoding (a small PNG can decode to gigabytes)
    max_sessions: int = 6  # conversations that keep their KV caches for follow-ups
    idle_s: float = 600.0  # caches of a conversation untouched this long are dropped
    cache_limit_bytes: int | None = None  # KV caches of all conversations + the next run; None: no limit
    memory_limit_bytes: int | None = None  # resident memory of the process; None: no limit
    max_batch_users: int = 4  # conversations whose turns run at once, decoded in one batch; more wait in the queue
    max_video_bytes: int = 64 * MB  # a video file (uploads only), checked before it is opened
    max_video_pixels: int = 100_000_000  # the sampled frames together (frames × width × height), before decoding
    max_frame_pixels: int = 4096 * 4096  # every decoded frame of a video, not only the size its header states
    max_video_decode_pixels: int = 4_000_000_000  # frames decoded to reach the sampled ones (about 2,000 at 1080p)
    max_video_decode_s: float = 20.0  # the decoder's time for one video

    def __post_init__(self):
        for name in ("max_prompt_chars", "max_prompt_tokens", "max_run_tokens", "max_image_bytes",
                     "max_image_pixels", "max_sessions", "max_batch_users", "max_video_bytes", "max_video_pixels",
                     "max_frame_pixels", "max_video_decode_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        for name in ("idle_s", "max_video_decode_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("cache_limit_bytes", "memory_limit_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of bytes or None, got {value!r}")

    @property
    def image_limit_text(self) -> str:
        return f"{self.max_image_bytes / MB:g} MB and {self.max_image_pixels / 1e6:g} megapixels"


# -- tokens ------------------------------------------------------------------------------------------------

def text_tokens(loaded, text: str) -> int:
    """Tokens of `text` alone (no special tokens, no template)."""
    return len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def image_tokens(loaded, image_size: tuple[int, int] | None) -> int:
    """Tokens one image takes in a prompt: counted for its size (anyres families tile by size), else the most it
    can take; with the text tokens its family's processor wraps each image in (InternVL's <img> and </img>)."""
    wrap = _wrap_tokens(loaded)
    if image_size is None:
        return int(loaded.image_seq_length) + wrap
    return int(loaded.image_tokens(*image_size)) + wrap


def _wrap_tokens(loaded) -> int:
    """The text tokens the processor adds around each image's tokens (`image_wrap_tokens` of its family module; 0
    where the chat template writes them or there are none)."""
    from .models.families import FAMILY_INFO, hooks

    family = getattr(loaded, "family", None)
    if family not in FAMILY_INFO or getattr(loaded, "processor", None) is None:
        return 0
    says = getattr(hooks(family), "image_wrap_tokens", None)
    return int(says(loaded.processor)) if says is not None else 0


def prompt_tokens(loaded, prompt: str, with_image: bool | int, image_size: tuple[int, int] | None = None,
                  image_sizes: list[tuple[int, int]] | None = None) -> int:
    """Tokens of a first turn as the engine feeds it: chat template, the images' tokens, the prompt.
    `with_image`: how many images (True = one); `image_sizes` (width, height) each, else `image_size` for all."""
    from .models import format_prompt

    count = int(with_image)
    sizes = list(image_sizes) if image_sizes is not None else [image_size] * count
    # special tokens as the processor adds them (BOS for Llama-style tokenizers)
    n = len(loaded.tokenizer(format_prompt(loaded, prompt, with_image=count))["input_ids"])
    return n - count + sum(image_tokens(loaded, size) for size in sizes)  # each <image> expands to its patches


def followup_tokens(loaded, question: str) -> int:
    """Tokens a follow-up turn adds before the answer (+1: the previous answer's last token is fed then)."""
    from .models import format_followup

    return len(loaded.tokenizer(format_followup(loaded, question), add_special_tokens=False)["input_ids"]) + 1


def run_token_limit(limits: Limits, loaded) -> int:
    return min(int(limits.max_run_tokens), int(loaded.max_context))


def check_text(limits: Limits, loaded, text: str, what: str = "the prompt") -> int:
    """Characters first (cheap, bounds the tokenizer's work), then tokens. Returns the token count."""
    if len(text) > limits.max_prompt_chars:
        raise LimitError(f"{what} is {len(text)} characters; the limit is {limits.max_prompt_chars}")
    n = text_tokens(loaded, text)
    if n > limits.max_prompt_tokens:
        raise LimitError(f"{what} is {n} tokens ({len(text)} characters); the limit is {limits.max_prompt_tokens} "
                         "tokens: shorten it (unusual characters take several tokens each)")
    return n


def check_prompt(limits: Limits, loaded, prompt: str, *, with_image: bool, max_new_tokens: int,
                 image_size: tuple[int, int] | None = None) -> int:
    """A first turn within the limits; returns the tokens the run may reach (prompt + new tokens).
    `image_size` (width, height) counts the image's own tokens (anyres families: they depend on its size)."""
    check_text(limits, loaded, prompt)
    total = prompt_tokens(loaded, prompt, with_image, image_size) + int(max_new_tokens)
    limit = run_token_limit(limits, loaded)
    if total > limit:
        image = f", {image_tokens(loaded, image_size)} of them for the image," if with_image else ""
        raise LimitError(f"this run would reach {total} tokens (prompt{image} + {int(max_new_tokens)} new tokens); "
                         f"the limit is {limit}: shorten the prompt or lower max new tokens")
    return total


def check_followup(limits: Limits, loaded, question: str, *, conversation_tokens: int, max_new_tokens: int) -> int:
    """A follow-up within the limits; returns the tokens it adds (question + new tokens)."""
    check_text(limits, loaded, question, what="the question")
    added = followup_tokens(loaded, question) + int(max_new_tokens)
    limit = run_token_limit(limits, loaded)
    if conversation_tokens + added > limit:
        raise LimitError(f"the conversation would reach {conversation_tokens + added} tokens; the limit is {limit}: "
                         "run Compare again to start a new one")
    return added


# -- memory ------------------------------------------------------------------------------------------------

def kv_bytes_per_token(loaded) -> int:
    """Bytes one uncompressed token takes in one method's cache: keys and values of every layer and KV
    head, plus the bookkeeping kept per entry (position, image flag, score)."""
    import torch

    element = torch.tensor([], dtype=loaded.dtype).element_size()
    per_head = 2 * int(loaded.head_dim) * element + 8 + 1 + 4
    return int(loaded.num_layers) * int(loaded.num_kv_heads) * per_head


def estimate_run_bytes(loaded, tokens: int, n_methods: int, budget: float) -> int:
    """A generous estimate of the cache memory one comparison reaches: the shared prefill cache, one
    uncompressed copy being compressed, and every method's share of the budget (at least a quarter, as
    quantised or merging methods keep more than r)."""
    full = kv_bytes_per_token(loaded) * max(int(tokens), 1)
    share = max(float(budget), 0.25)
    return int(full * min(n_methods + 1, 2 + n_methods * share))


def process_memory_bytes() -> int | None:
    """Resident memory of this process (None where it cannot be read)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil missing or the platform refuses; fall back to /proc
        pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_memory_bytes() -> int | None:
    """This process's resident-memory high-water mark (None where it cannot be read)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB on Linux


def return_free_memory() -> None:
    """Hand memory freed by dropped caches back to the system (glibc keeps freed heap pages otherwise, so
    the process's resident size, which the memory ceiling reads, would not come down). No-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, loaded once (each load makes objects only the garbage collector frees), or None."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - absent outside glibc
        return libc
    except (OSError, AttributeError):
        return None


def machine_memory_bytes() -> int | None:
    """Memory this process may use: physical memory, or the container's cgroup limit when lower."""
    candidates = []
    try:
        candidates.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            candidates.append(int(text))
    return min(candidates) if candidates else None


def default_memory_limit() -> int | None:
    """90 % of what the machine (or container) allows: refuse a run before the kernel kills the server."""
    total = machine_memory_bytes()
    return int(total * 0.9) if total else None


def default_cache_limit(loaded) -> int:
    """KV-cache memory for all conversations together: half the GPU memory left after loading the model,
    or a quarter of the machine's memory on CPU (4 GB when that cannot be read)."""
    import torch

    device = getattr(loaded, "device", None)
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return max(int(free * 0.5), 256 * MB)
    total = machine_memory_bytes()
    return max(int(total * 0.25), 256 * MB) if total else 4096 * MB


def server_limits(loaded, **overrides) -> Limits:
    """Limits for a server of `loaded`: the defaults, both memory ceilings set from the machine (see
    default_cache_limit / default_memory_limit), then `overrides`."""
    values = {"cache_limit_bytes": default_cache_limit(loaded), "memory_limit_bytes": default_memory_limit()}
    values.update(overrides)
    return Limits(**values)


# -- images ------------------------------------------------------------------------------------------------

def is_inside(path: str | os.PathLike, roots: Iterable[str | os.PathLike]) -> bool:
    """True when `path`, with every symlink resolved, lies in one of `roots` (also resolved)."""
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return False
    for root in roots:
        try:
            if real.is_relative_to(Path(os.path.realpath(root))):
                return True
        except (OSError, ValueError):
            continue
    return False


def _too_big(size: int, max_bytes: int) -> LimitError:
    return LimitError(f"the image is {size / MB:.1f} MB; the limit is {max_bytes / MB:g} MB")


def decode_image_bytes(data: bytes, *, max_pixels: int) -> Image.Image:
    """Bytes of a PNG/JPEG/WebP/BMP/GIF -> RGB image (EXIF rotation applied, high bit depths scaled to 8 bits). The
    pixel count is checked from the header, before anything is decoded. Raises LimitError."""
    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        w, h = im.size
        if w * h > max_pixels:
            raise _too_many_pixels(w, h, max_pixels)
        im.load()
        im = ImageOps.exif_transpose(im) or im
        return as_rgb(im)
    except LimitError:
        raise
    except Image.DecompressionBombError:  # Pillow's own guard, far above ours: say which limit it is over
        size = _header_size(data)
        raise (_too_many_pixels(*size, max_pixels) if size else LimitError(
            f"the image is over {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels; the limit is "
            f"{max_pixels / 1e6:g} megapixels")) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, TypeError, IndexError, KeyError,
            ZeroDivisionError):
        raise LimitError(IMAGE_REFUSED) from None


def _too_many_pixels(w: int, h: int, max_pixels: int) -> LimitError:
    return LimitError(f"the image is {w}×{h} pixels ({w * h / 1e6:.1f} megapixels); "
                      f"the limit is {max_pixels / 1e6:g} megapixels")


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as the header states them, read by the decoder's own header parser without Pillow's
    decompression-bomb check (which refuses to say the size); None when no allowed format reads it."""
    for fmt in IMAGE_FORMATS:
        factory, accept = Image.OPEN[fmt]
        if accept is not None and not accept(data[:16]):
            continue
        try:
            return tuple(factory(io.BytesIO(data), "").size)
        except Exception:  # noqa: BLE001 - not this format after all
            continue
    return None


HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def as_rgb(image: Image.Image) -> Image.Image:
    """An image in 8-bit RGB. Pillow's own conversion clips 16-bit and 32-bit greyscale to 255 (a 16-bit PNG turns
    white), so those are scaled: 16-bit samples by 1/257, integer images whose values fit 8 or 16 bits as such, any
    other range (and floating point outside 0-1) stretched over 0-255."""
    if image.mode not in HIGH_DEPTH_MODES:
        return image.convert("RGB")
    import numpy as np

    values = np.asarray(image).astype(np.float64)
    if image.mode.startswith("I;16"):
        values = values / 257.0
    else:
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if image.mode == "F" and low >= 0.0 and high <= 1.0:
            values = values * 255.0
        elif image.mode == "I" and low >= 0 and high <= 255:
            pass
        elif image.mode == "I" and low >= 0 and high <= 65535:
            values = values / 257.0
        else:
            values = (values - low) * (255.0 / (high - low)) if high > low else np.zeros_like(values)
    grey = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")
    grey.info = dict(image.info)
    return grey.convert("RGB")


def decode_data_url(url: str, *, max_bytes: int, max_pixels: int) -> Image.Image:
    """A base64 `data:` URL -> RGB image. The size is checked on the encoded text, before decoding."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or ";base64" not in header:
        raise LimitError(IMAGE_REFUSED)
    encoded = "".join(payload.split())
    size = len(encoded) * 3 // 4 - encoded[-2:].count("=")
    if size > max_bytes:
        raise _too_big(size, max_bytes)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise LimitError(IMAGE_REFUSED) from None
    return decode_image_bytes(data, max_pixels=max_pixels)


def open_regular_file(path: str | os.PathLike, roots: Iterable[str | os.PathLike] | None, *, refused: str,
                      hint: str = "") -> tuple[int, os.stat_result, str]:
    """(a read-only file descriptor, its stat, the file's name) once `path` is a regular file. With `roots` (a
    server): it must resolve inside one of them (a symlink at the end is not followed), else LimitError(refused),
    the same answer whatever the reason. Without `roots` (a local user's own path): errors say why (`hint` ends
    them, e.g. ": pass a video file"). Opened non-blocking: a FIFO must not hang the server. The caller closes it."""
    confined = roots is not None
    if not isinstance(path, (str, os.PathLike)) or "\x00" in os.fspath(path):
        raise LimitError(refused)
    if confined and not is_inside(path, roots):
        raise LimitError(refused)
    real = os.path.realpath(path) if confined else os.fspath(path)
    name = Path(real).name
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if confined else 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise LimitError(refused if confined else f"cannot open {name}: {exc.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise LimitError(refused if confined else f"{name} is {kind}{hint}")
    return fd, info, name


def read_image_file(path: str | os.PathLike, roots: Iterable[str | os.PathLike] | None, *, max_bytes: int | None,
                    max_pixels: int | None) -> Image.Image:
    """A file -> RGB image.

    With `roots` (a server): the file must resolve inside one of them and be a regular file, else
    LimitError(IMAGE_REFUSED) — the same answer whatever the reason. Only then is its size reported when
    over `max_bytes`. Without `roots` (a local user's own path): any readable file, and errors say why."""
    confined = roots is not None
    fd, info, name = open_regular_file(path, roots, refused=IMAGE_REFUSED)
    try:
        if max_bytes is not None and info.st_size > max_bytes:
            raise _too_big(info.st_size, max_bytes)
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1 if max_bytes is not None else -1)
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:  # grew after the check
        raise _too_big(len(data), max_bytes)
    try:
        return decode_image_bytes(data, max_pixels=max_pixels if max_pixels is not None else 2**62)
    except LimitError as exc:
        if confined or str(exc) != IMAGE_REFUSED:
            raise
        raise LimitError(f"{name} is not a readable image ({ACCEPTED_IMAGES})") from None
