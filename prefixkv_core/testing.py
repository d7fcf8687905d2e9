"""Tiny randomly initialised LLaVA models for tests (and `--model tiny-llama|tiny-qwen2`): CLIP vision with a
Llama (MHA) or Qwen2 (GQA) language model, shapes from `models.tiny_config`, and a byte-level BPE tokenizer
trained in code on a small built-in corpus. Their outputs are meaningless; they build in about a second."""
from __future__ import annotations

import os

import torch

from .models import (
    FAMILIES,
    IMAGE_TOKEN,
    META_KEY,
    TINY_VARIANTS,
    LoadedModel,
    ModelLoadError,
    chatml_template,
    describe_model,
    family_config,
    make_processor,
    tiny_config,
)
from .models.chat import FAMILY_TEMPLATES
from .models.families import FAMILY_INFO
from .models.loading import TINY_NOTE
from .models.processor import family_processor

__all__ = ["build_tiny_model", "save_tiny_model", "tiny_model_parts", "build_tiny_tokenizer", "TINY_VARIANTS",
           "FAMILIES", "build_tiny_family", "save_tiny_family", "tiny_family_parts", "build_family_tokenizer"]

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

# Added first, so their ids are 0..4 (the defaults of models.tiny_config).
_TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", IMAGE_TOKEN]


def build_tiny_tokenizer(vocab_size: int = 512):
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


def tiny_model_parts(variant: str, seed: int):
    """(LlavaForConditionalGeneration in float32 eval mode, LlavaProcessor) of a tiny model."""
    from transformers import LlavaForConditionalGeneration

    if variant not in TINY_VARIANTS:
        raise ModelLoadError(f"unknown tiny variant {variant!r}; accepted: {', '.join(TINY_VARIANTS)}")
    tok = build_tiny_tokenizer()
    config = tiny_config(
        variant,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        **{META_KEY: {"kind": "tiny", "variant": variant, "vision_trained": False, "slug": f"tiny-{variant}"}},
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.to(torch.float32).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    processor = make_processor(tok, config.vision_config, chat_template=chatml_template())
    return model, processor


def build_tiny_model(variant: str = "llama", seed: int = 0) -> LoadedModel:
    """A randomly initialised LLaVA (CLIP vision, Llama/Qwen2 text) in memory, CPU float32."""
    model, processor = tiny_model_parts(variant, seed)
    return describe_model(
        model,
        processor,
        name=f"tiny-{variant}",
        slug=f"tiny-{variant}",
        device=torch.device("cpu"),
        dtype=torch.float32,
        vision_trained=False,
        notes=[TINY_NOTE],
    )


def save_tiny_model(path, variant: str = "llama", seed: int = 0) -> str:
    """Save a tiny model (weights + processor) to `path`; `load_model(path)` loads it back."""
    model, processor = tiny_model_parts(variant, seed)
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# -- tiny models of the LLaVA families -----------------------------------------------------------------------------
# Each is its family's released structure scaled down (`models.family_config(family, tiny=True)`), with a
# tokenizer of the same kind as the released one: SentencePiece-style specials with BOS added (Llama, Mistral) or
# ChatML specials without BOS (Qwen). `save_tiny_family` writes it as a checkpoint that `load_model` reads like
# a real one.
_FAMILY_SPECIAL = {
    "llama": ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN],
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN, "<video>"],
}


def build_family_tokenizer(kind: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer with the special tokens of a "llama" or "qwen" style checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = _FAMILY_SPECIAL[kind]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [ln.strip() for ln in _CORPUS.strip().splitlines() if ln.strip()]
    tk.train_from_iterator(lines * 4, trainer=trainer)
    if kind == "llama":  # Llama / Mistral tokenizers put BOS before every encoded text
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", special.index("<s>"))])
        return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                       unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN},
                                       model_max_length=2048)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>",
                                   extra_special_tokens={"image_token": IMAGE_TOKEN, "video_token": "<video>"},
                                   model_max_length=2048)


def tiny_family_parts(family: str, seed: int = 0):
    """(model in float32 eval mode, processor) of a tiny random model of a LLaVA family."""
    if family not in FAMILIES:
        raise ModelLoadError(f"unknown LLaVA family {family!r}; accepted: {', '.join(FAMILIES)}")
    info = FAMILY_INFO[family]
    tok = build_family_tokenizer(info.tokenizer)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if tok.bos_token_id is not None:
        ids["bos_token_id"] = tok.bos_token_id
    video = tok.convert_tokens_to_ids("<video>") if info.tokenizer == "qwen" else None
    slug = f"tiny-{family}"
    config = family_config(family, tiny=True, image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                           video_token_id=video, meta={"kind": "tiny", "family": family, "vision_trained": False,
                                                       "slug": slug}, **ids)
    from .models.families import model_class

    torch.manual_seed(seed)
    model = model_class(config)(config)
    model.to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    if tok.bos_token_id is not None:
        gen.bos_token_id = tok.bos_token_id
    return model, family_processor(config, tok, FAMILY_TEMPLATES[family])


def build_tiny_family(family: str, seed: int = 0) -> LoadedModel:
    """A tiny random model of a LLaVA family in memory (CPU float32), without the save/load round trip."""
    model, processor = tiny_family_parts(family, seed)
    return describe_model(model, processor, name=f"tiny-{family}", slug=f"tiny-{family}",
                          device=torch.device("cpu"), dtype=torch.float32, vision_trained=False, notes=[TINY_NOTE])


def save_tiny_family(path, family: str, seed: int = 0) -> str:
    """Write a tiny model of a LLaVA family as a checkpoint directory (weights, config, processor, tokenizer, chat
    template) laid out as the released one, so `load_model(path)` takes the same path as for a hub checkpoint."""
    import json

    model, processor = tiny_family_parts(family, seed)
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    if family == "llava-onevision":  # saved by our image-only subclass: name the released processor class
        for name in ("processor_config.json", "tokenizer_config.json"):
            file = os.path.join(path, name)
            with open(file) as fh:
                data = json.load(fh)
            data["processor_class"] = "LlavaOnevisionProcessor"
            with open(file, "w") as fh:
                json.dump(data, fh, indent=2)
    return path


def kept_entry_masks(compressed, prompt_len: int) -> dict:
    """Key masks over an uncompressed cache of `prompt_len` entries (+ the next token) that allow exactly the
    entries `compressed` still holds, per layer and KV head: the reference of the eviction == masking tests."""
    masks = {}
    for layer_idx, layer in enumerate(compressed.layers):
        held = torch.zeros(1, layer.n_kv, prompt_len + 2, dtype=torch.long)
        # the next token (position prompt_len) is appended by then; empty slots (position -1) hold nothing
        held.scatter_add_(2, layer.positions.clamp_min(-1) + 1, torch.ones_like(layer.positions))
        masks[layer_idx] = held[..., 1:] > 0
    return masks

