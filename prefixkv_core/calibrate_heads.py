"""SparseMM's offline visual-head scores, measured on the generated scenes (the embedded model reads no text, so
SparseMM's OCR retrieval becomes naming the scene's objects): the model describes each scene greedily; whenever the
word it generates names exactly one object (its colour or its shape), the image tokens over that object are the
target, and every KV head of every layer whose strongest attention (the generating query's, over the whole cache)
lands on one of them scores 1 / (tokens in the target), SparseMM's hit rule. A head's score is its mean over the
scenes. Written to assets/visual_heads/<model-slug>.json (`policies/visual_heads.py`) for SparseMM to read."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .calibrate import calibration_seeds
from .policies.visual_heads import write_head_scores

HEAD_PROMPT = "Describe the image in detail."
MIN_WORD = 3  # shorter generated pieces name nothing on their own


def object_tokens(layout, objects, image_positions: torch.Tensor) -> list[list[int]]:
    """Per object, the prompt positions of the image tokens whose patch centre lies on its disc (the nearest patch
    when none does). `image_positions`: the prompt positions of the image tokens, in layout order."""
    views, rows, cols = layout.token_cells()
    token, xs, ys = [], [], []
    for i, (view, row, col) in enumerate(zip(views, rows, cols)):
        v = layout.views[int(view)]
        if col >= v.cols:  # an image-newline token covers no patch
            continue
        left, top, right, bottom = v.box
        token.append(i)
        xs.append(left + (col + 0.5) / v.cols * (right - left))
        ys.append(top + (row + 0.5) / v.rows * (bottom - top))
    xs, ys = np.asarray(xs), np.asarray(ys)
    out = []
    for obj in objects:
        distance = np.hypot(xs - obj.cx, ys - obj.cy)
        inside = np.flatnonzero(distance <= max(obj.radius, 1e-6))
        if inside.size == 0:
            inside = np.asarray([int(np.argmin(distance))])
        out.append(sorted(int(image_positions[token[i]]) for i in inside))
    return out


def named_object(word: str, objects) -> int | None:
    """The one object whose colour or shape the generated `word` is part of (None: none, or several)."""
    word = "".join(ch for ch in word.strip().lower() if ch.isalpha())
    if len(word) < MIN_WORD:
        return None
    named = [i for i, obj in enumerate(objects) if word in obj.colour.lower() or word in obj.shape.lower()]
    return named[0] if len(named) == 1 else None


def head_hits(stats: dict[int, dict[str, torch.Tensor]], target: set[int], weight: float,
              scores: np.ndarray) -> None:
    """Add `weight` to every (layer, KV head) whose last query's strongest key is in `target`."""
    for layer, s in stats.items():
        best = s["last_query"][0].float().argmax(dim=-1).tolist()  # [Hkv]
        for head, key in enumerate(best):
            if key in target:
                scores[layer, head] += weight


def scene_scores(loaded, seed: int, prompt: str = HEAD_PROMPT, max_new_tokens: int = 48) -> tuple[np.ndarray, int]:
    """One scene: [L, Hkv] the heads' hit scores and the number of naming words generated."""
    from scenes import render_scene

    from .decoding import runner
    from .kv.attention import AttentionProbe, StatRequest, tracked_attention_enabled
    from .kv.cache import TrackedCache
    from .models import encode, format_prompt
    from .models.chat import vision_inputs

    scene = render_scene(seed)
    inputs = encode(loaded, scene.image, format_prompt(loaded, prompt, with_image=True))
    ids = inputs["input_ids"]
    is_image = loaded.visual_mask(ids)
    image_positions = is_image[0].nonzero().flatten()
    targets = object_tokens(loaded.image_layout(*scene.image.size), scene.objects, image_positions)
    eos = {int(x) for x in np.atleast_1d(loaded.processor.tokenizer.eos_token_id or [])}
    named = 0
    with torch.inference_mode(), tracked_attention_enabled(loaded.model):
        cache = TrackedCache(loaded.num_layers)
        logits, stats = runner.forward_group(loaded.model, cache, ids, 0, StatRequest(last_query=True), is_image,
                                             vision_inputs(inputs))
        heads = stats[0]["last_query"].shape[1]
        scores = np.zeros((loaded.num_layers, heads))
        at = ids.shape[1]
        for _ in range(max_new_tokens):
            token = int(logits[0].argmax())
            if token in eos:
                break
            obj = named_object(loaded.processor.tokenizer.decode([token]), scene.objects)
            if obj is not None:  # the query that generated the word looked where?
                named += 1
                head_hits(stats, set(targets[obj]), 1.0 / len(targets[obj]), scores)
            logits, stats = runner.forward_group(loaded.model, cache, torch.tensor([[token]], device=ids.device), at,
                                                 AttentionProbe(StatRequest(last_query=True)))
            at += 1
    return scores, named


def visual_head_scores(loaded, samples: int = 100, max_new_tokens: int = 48, progress: bool = True
                       ) -> tuple[np.ndarray, dict[str, Any]]:
    """[L, Hkv] each head's mean hit score over `samples` scenes from the end of the train split (disjoint from
    every evaluation set), and what produced them."""
    from tqdm.auto import tqdm

    seeds = calibration_seeds(samples)
    per_scene, named = [], 0
    for seed in tqdm(seeds, desc="visual heads", disable=not progress):
        scores, words = scene_scores(loaded, seed, max_new_tokens=max_new_tokens)
        per_scene.append(scores)
        named += words
    mean = np.mean(per_scene, axis=0)
    return mean, {"num_samples": len(seeds), "naming_words": named, "prompt": HEAD_PROMPT,
                  "max_new_tokens": max_new_tokens, "calibration_samples": [f"scene:{s}" for s in seeds],
                  "rule": "per generated word naming exactly one object: +1/|object tokens| to each KV head whose "
                          "top-1 attention lands on the object"}


def calibrate_heads(loaded, samples: int = 100, max_new_tokens: int = 48, progress: bool = True, root=None):
    """Measure and write the model's visual-head scores (to `root`, default assets/visual_heads); returns the file."""
    scores, extra = visual_head_scores(loaded, samples, max_new_tokens, progress)
    if root is None:
        return write_head_scores(loaded.slug, loaded.name, scores.tolist(), extra)
    return write_head_scores(loaded.slug, loaded.name, scores.tolist(), extra, root=root)
