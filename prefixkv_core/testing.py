"""What the tests build on: the tiny random LLaVA models (`models.tiny`: CLIP vision with a Llama (MHA) or Qwen2 (GQA)
language model, and a tiny model of every LLaVA family) built in memory or saved as checkpoints, and the
reference masks of the eviction == masking tests, and synthetic prompt caches for the policy planners. The models' outputs are meaningless; they build in about a
second."""
from __future__ import annotations

import os
import time

import numpy as np
import torch
from PIL import Image

from .models import LLAVA_FAMILIES, TINY_VARIANTS, LoadedModel, describe_model
from .models.families import FAMILY_INFO
from .models.tiny import (TINY_NOTE, build_family_tokenizer, build_tiny_tokenizer, save_tiny_family,
                          tiny_family_parts, tiny_model_parts)

__all__ = ["build_tiny_model", "save_tiny_model", "tiny_model_parts", "build_tiny_tokenizer", "TINY_VARIANTS",
           "LLAVA_FAMILIES", "QWEN_FAMILIES", "build_tiny_family", "save_tiny_family", "tiny_family_parts", "build_family_tokenizer",
           "kept_entry_masks", "moving_dot_frames", "prefill_and_compress", "synthetic_prompt_cache", "synthetic_extra_stats", "WIDE_PICTURE_SIZE",
           "wide_noise_picture", "wait_until"]

# The families with 3-D rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), tested beside the LLaVA ones (LLAVA_FAMILIES).
QWEN_FAMILIES = tuple(key for key, f in FAMILY_INFO.items() if f.mrope)

# Not square, so that anyres pads and unpads it and CLIP centre-crops it.
WIDE_PICTURE_SIZE = (80, 48)


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


def build_tiny_family(family: str, seed: int = 0) -> LoadedModel:
    """A tiny random model of a LLaVA family in memory (CPU float32), without the save/load round trip."""
    model, processor = tiny_family_parts(family, seed)
    return describe_model(model, processor, name=f"tiny-{family}", slug=f"tiny-{family}",
                          device=torch.device("cpu"), dtype=torch.float32, vision_trained=False, notes=[TINY_NOTE])


def wide_noise_picture(seed: int = 1) -> Image.Image:
    """A noise image of `WIDE_PICTURE_SIZE` (width, height): the picture of the every-family tests."""
    width, height = WIDE_PICTURE_SIZE
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def wait_until(predicate, timeout: float = 30.0, every: float = 0.01) -> bool:
    """Polls `predicate` until it holds or `timeout` seconds pass; its last value (tests of threads and servers)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


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


def held_positions(prefilled, plans) -> list[list[int]]:
    """Per layer, the true positions a prefilled cache holds (first row, first KV head) once `plans` are applied
    (to a copy): what a method keeps, whether its prefill already left tokens behind or its plans drop them."""
    from .policies.base import apply_plans

    compressed = prefilled.clone()
    apply_plans(compressed, plans)
    return [layer.positions[0, 0].tolist() for layer in compressed.layers]


def prefill_and_compress(loaded, policy, inputs: dict, budget: float):
    """One tracked prefill of an encoded prompt for `policy` and its cache compressed by the policy's prefill plans:
    (the prefill, the compressed copy of its cache, the prompt length). The prefill's own cache stays whole (the
    masked side of an eviction == masking test)."""
    from .decoding import runner
    from .kv.attention import tracked_attention_enabled
    from .models import vision_inputs
    from .policies.base import PrefillView, apply_plans

    ids = inputs["input_ids"]
    with tracked_attention_enabled(loaded.model):
        shared = runner.prefill_for(loaded.model, policy, ids, loaded.visual_mask(ids), vision_inputs(inputs),
                                    loaded.num_layers, loaded.device, loaded.image_token_id)
    n = shared.prompt_len
    compressed = shared.cache.clone()
    plans, _ = policy.prefill(PrefillView(compressed, runner.policy_stats(policy, shared.stats, n), n, budget,
                                          policy.prefill_stats(n).window))
    apply_plans(compressed, plans)
    return shared, compressed, n


def masked_reference_cache(loaded, ids, is_image, vision_inputs, drop_layer: int, kept_positions):
    """The cache of a plain forward of the prompt in which every token goes through every layer and, from layer
    `drop_layer` on, attention sees only the tokens at `kept_positions`: what a token drop (FastV, DART) computes
    for the kept tokens, with the dropped ones masked instead of cut. Its scores are the column sums, as a
    prefill's. Returns (logits [1, V], cache)."""
    kept = torch.as_tensor(kept_positions)
    return layered_reference_cache(loaded, ids, is_image, vision_inputs,
                                   {i: kept for i in range(drop_layer, loaded.num_layers)})


def layered_reference_cache(loaded, ids, is_image, vision_inputs, kept_by_layer):
    """`masked_reference_cache` for tokens dropped in stages (PyramidDrop): attention in layer l sees only the
    tokens at `kept_by_layer[l]` (prompt positions; a layer not in it sees every token). `kept_by_layer` may be a
    token drop's own cache, each of whose layers holds the tokens that layer computed. Returns (logits, cache)."""
    from .decoding import runner
    from .kv.attention import AttentionProbe, StatRequest
    from .kv.cache import TrackedCache

    n = ids.shape[1]
    if isinstance(kept_by_layer, TrackedCache):
        kept_by_layer = {i: layer.positions[0, 0] for i, layer in enumerate(kept_by_layer.layers)
                         if layer.length < n}
    masks = {}
    for i, positions in kept_by_layer.items():
        masks[i] = torch.zeros(1, 1, n, dtype=torch.bool)
        masks[i][0, 0, torch.as_tensor(positions).cpu()] = True
    cache = TrackedCache(loaded.num_layers)
    probe = AttentionProbe(StatRequest(colsum=True), key_masks=masks)
    logits, stats = runner.forward_group(loaded.model, cache, ids, 0, probe, is_image, vision_inputs)
    cache.add_scores({layer: s["colsum"] for layer, s in stats.items()})
    return logits, cache


def synthetic_prompt_cache(n: int = 40, n_layers: int = 3, h: int = 2, seed: int = 0, image: tuple[int, int] = (5, 25),
                           sink: float = 6.0, skew: float = 3.0):
    """(TrackedCache, prefill statistics) of an `n`-entry prompt whose entries image[0]:image[1] came from the
    image: random keys and values (dim 8), column sums that grow more concentrated with depth (raised to
    1 + skew·layer) with `sink` added to the first entry, kept as the layers' scores, and window votes."""
    from .kv.cache import TrackedCache, TrackedLayer

    g = torch.Generator().manual_seed(seed)
    cache = TrackedCache(n_layers)
    stats = {}
    for i in range(n_layers):
        layer = TrackedLayer()
        layer.update(torch.randn(1, h, n, 8, generator=g), torch.randn(1, h, n, 8, generator=g))
        flags = torch.zeros(1, n, dtype=torch.bool)
        flags[:, image[0]:image[1]] = True
        layer.append_meta(torch.arange(n)[None], flags, h)
        colsum = torch.rand(1, h, n, generator=g) ** (1 + skew * i)
        colsum[..., 0] += sink
        layer.scores = colsum.clone()
        stats[i] = {"colsum": colsum, "window": torch.rand(1, h, n, generator=g)}
        cache.layers[i] = layer
    for i, extra in synthetic_extra_stats(cache, image[1], seed).items():
        stats[i].update(extra)
    return cache, stats


def synthetic_extra_stats(cache, image_end: int, seed: int = 0) -> dict:
    """The prefill statistics the synthetic caches add for the methods that read more than column sums and window
    votes, drawn from a generator of their own (the others' draws stay as they were): per layer the post-vision
    queries' attention sums ("post_vision") and sparse counts ("post_vision_sparse", at most the number of
    post-vision queries: the tokens after `image_end`, or the last one), the layer's keys ("keys") and hidden
    states of width 8 ("hidden")."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = {}
    for i, layer in enumerate(cache.layers):
        b, h, n = layer.positions.shape
        post = max(1, n - image_end)
        out[i] = {"post_vision": torch.rand(b, h, n, generator=g) * post,
                  "post_vision_sparse": torch.randint(0, post + 1, (b, h, n), generator=g).float(),
                  "keys": layer.keys.float().clone(), "hidden": torch.randn(b, n, 8, generator=g)}
    return out


def moving_dot_frames(n: int = 4, size: tuple[int, int] = (64, 48)) -> list[Image.Image]:
    """A clip's frames for the video tests: frame i shows a red dot at x = 6 i over a noisy background."""
    from PIL import ImageDraw

    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        im = Image.fromarray(rng.integers(0, 90, (size[1], size[0], 3), dtype=np.uint8))
        ImageDraw.Draw(im).ellipse((6 * i, 16, 6 * i + 12, 28), fill=(230, 40, 40))
        out.append(im)
    return out
