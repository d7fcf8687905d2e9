"""The tiny random LLaVA models `load_model` accepts ("tiny-llama", "tiny-qwen2", "tiny-<family>"): their shapes
come from `configs` (`tiny_config`, `family_config(..., tiny=True)`), their byte-level BPE tokenizers are trained
here on a small built-in corpus. Their outputs are meaningless; they build in about a second. Tests build them in
memory through `prefixkv_core.testing`."""
from __future__ import annotations

import json
import os

import torch

from .chat import FAMILY_TEMPLATES, IMAGE_TOKEN, chatml_template
from .configs import LLAVA_FAMILIES, META_KEY, TINY_VARIANTS, family_config, tiny_config
from .errors import ModelLoadError
from .families import FAMILY_INFO, model_class
from .processor import family_processor, make_processor

TINY_NOTE = "tiny random model for tests: its outputs are meaningless"
TINY_MODEL_SPECS = ("tiny", *(f"tiny-{v}" for v in TINY_VARIANTS))  # built in memory
TINY_FAMILY_SPECS = tuple(f"tiny-{f}" for f in FAMILY_INFO)  # saved and loaded like a checkpoint

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


# -- tiny models of the LLaVA families -----------------------------------------------------------------------------
# Each is its family's released structure scaled down (`models.family_config(family, tiny=True)`), with a
# tokenizer of the same kind as the released one: SentencePiece-style specials with BOS added (Llama, Mistral) or
# ChatML specials without BOS (Qwen). `save_tiny_family` writes it as a checkpoint that `load_model` reads like
# a real one.
_FAMILY_SPECIAL = {
    "llama": ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN],
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN, "<video>"],
    # Qwen-VL's: ChatML, the vision span's start and end, the image and video pads
    "qwen-vl": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"],
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
    image, video = (IMAGE_TOKEN, "<video>") if kind == "qwen" else ("<|image_pad|>", "<|video_pad|>")
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>",
                                   extra_special_tokens={"image_token": image, "video_token": video},
                                   model_max_length=2048)


def tiny_family_parts(family: str, seed: int = 0):
    """(model in float32 eval mode, processor) of a tiny random model of a family (a LLaVA one here, another from
    its family module)."""
    if family not in LLAVA_FAMILIES and family in FAMILY_INFO:
        from .families import hooks

        return hooks(family).tiny_parts(family, seed)
    if family not in LLAVA_FAMILIES:
        raise ModelLoadError(f"unknown LLaVA family {family!r}; accepted: {', '.join(LLAVA_FAMILIES)}")
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
    torch.manual_seed(seed)
    model = model_class(config)(config)
    model.to(torch.float32).eval()
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tok.pad_token_id, tok.eos_token_id
    if tok.bos_token_id is not None:
        gen.bos_token_id = tok.bos_token_id
    return model, family_processor(config, tok, FAMILY_TEMPLATES[family])


def save_tiny_family(path, family: str, seed: int = 0) -> str:
    """Write a tiny model of a LLaVA family as a checkpoint directory (weights, config, processor, tokenizer, chat
    template) laid out as the released one, so `load_model(path)` takes the same path as for a hub checkpoint."""
    if family not in LLAVA_FAMILIES and family in FAMILY_INFO:
        from .families import hooks

        return hooks(family).save_tiny(path, family, seed)
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
