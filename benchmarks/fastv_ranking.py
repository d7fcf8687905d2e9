"""Which image tokens FastV's rankings keep, against the patches that show the scene's objects.

    python -m benchmarks.fastv_ranking --scenes 10 --keep 47

For every question of the first --scenes test-split scenes, one eager forward of the full prompt; at each K of
--layers, the image tokens are ranked from layer K-1 by each of FastV's rankings (`policies.fastv.rank_scores`:
last_query, mean_received, random with the scene's seed) and the top --keep are compared with the object
patches: the image tokens (a 12 x 12 grid on the embedded model) at least --cover of whose pixels an object of
the scene covers. Prints, per K, the mean number of object patches each ranking keeps, what a uniform draw
keeps on average (keep x objects / image tokens), and the share of the last query's image attention that falls
on object patches.

--query-agnostic ranks as that mode prefills: only the prompt before the question (the image and the chat
template's tokens up to it), so the last query is the template's newline after the image, and every question of a
scene shares one ranking (one forward per scene).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import torch
from PIL import Image, ImageDraw

from prefixkv_core.method_args import add_model_args
from prefixkv_core.models import encode, format_prompt, load_model
from prefixkv_core.policies.fastv import RANKS, rank_scores
from prefixkv_core.session.prompt_layout import question_start
from prefixkv_core.session.visuals import TurnVisuals
from scenes import render_scene, split_seeds
from scenes.drawing import draw_object

BLANK = (1, 2, 3)  # a canvas colour outside the scenes' palette


def object_patches(scene, grid: int, cover: float) -> torch.Tensor:
    """bool [grid * grid] (raster order): patches at least `cover` of whose pixels an object covers."""
    side = scene.image.size[0]
    mask = np.zeros((side, side), dtype=bool)
    for obj in scene.objects:
        canvas = Image.new("RGB", (side, side), BLANK)
        draw_object(ImageDraw.Draw(canvas), obj, side)
        mask |= np.any(np.asarray(canvas) != BLANK, axis=-1)
    p = side // grid
    return torch.tensor(mask[: p * grid, : p * grid].reshape(grid, p, grid, p).mean(axis=(1, 3)).flatten() >= cover)


def prompt_inputs(lm, image, question: str, query_agnostic: bool) -> dict:
    """The model inputs a FastV prefill ranks from: the whole prompt, or (query-agnostic) its part before the
    question, cut where the engine's query-agnostic mode cuts it."""
    text = format_prompt(lm, question, with_image=True)
    inputs = encode(lm, image, text)
    if not query_agnostic:
        return inputs
    visuals = TurnVisuals(images=[image], prompt=question, n_images=1)
    ids = inputs["input_ids"]
    split = question_start(lm, visuals, text, ids, lm.visual_mask(ids))
    return {k: (v[:, :split] if k in ("input_ids", "attention_mask") else v) for k, v in inputs.items()}


def query_text(lm, inputs: dict) -> str:
    """The last query's token, as text (what ranks in the query-agnostic mode)."""
    return lm.tokenizer.decode(inputs["input_ids"][0, -1:])


def measure(lm, seeds: list[int], layers: list[int], keep: int, cover: float, query_agnostic: bool = False) -> dict:
    totals: dict = defaultdict(lambda: defaultdict(float))
    was = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("eager")  # the attention probabilities; the caller's setting comes back after
    try:
        _measure(lm, seeds, layers, keep, cover, query_agnostic, totals)
    finally:
        lm.model.set_attn_implementation(was)
    return {k: {name: v / t["prompts"] if name != "prompts" else v for name, v in t.items()} for k, t in totals.items()}


def _measure(lm, seeds, layers, keep, cover, query_agnostic, totals) -> None:
    for seed in seeds:
        scene = render_scene(seed)
        for qa in scene.qa[:1] if query_agnostic else scene.qa:  # query-agnostic: one prefix for every question
            inputs = prompt_inputs(lm, scene.image, qa.question, query_agnostic)
            image = (inputs["input_ids"] == lm.image_token_id)[0].nonzero().flatten()
            objects = object_patches(scene, int(round(len(image) ** 0.5)), cover)
            with torch.inference_mode():
                attentions = lm.model(**inputs, output_attentions=True).attentions
            for k in layers:
                a = attentions[k - 1].float()  # [1, H, N, N]
                stats = {"last_query": a[:, :, -1], "colsum": a.sum(dim=2)}
                t = totals[k]
                t["prompts"] += 1
                t["objects"] += int(objects.sum())
                t["chance"] += keep * int(objects.sum()) / len(image)
                for rank in RANKS:
                    top = torch.argsort(rank_scores(stats, rank, seed)[0, image], descending=True, stable=True)[:keep]
                    t[rank] += int(objects[top].sum())
                last = stats["last_query"][0].mean(dim=0)[image]
                t["last_query_mass_on_objects"] += float(last[objects].sum() / last.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--scenes", type=int, default=10)
    ap.add_argument("--keep", type=int, default=47, help="image tokens kept (47 of 144: r = 0.5 on a scene question)")
    ap.add_argument("--layers", default="1,2,3,4,6,8,12,16,20,25", help="the K values (layer K-1 ranks)")
    ap.add_argument("--cover", type=float, default=0.25, help="share of a patch's pixels an object must cover")
    ap.add_argument("--query-agnostic", action="store_true",
                    help="rank from the prompt before the question, as the query-agnostic mode prefills it")
    args = ap.parse_args(argv)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    layers = [int(x) for x in args.layers.split(",")]
    seeds = split_seeds("test", args.scenes)
    if args.query_agnostic:
        first = render_scene(seeds[0])
        print(f"last query: {query_text(lm, prompt_inputs(lm, first.image, first.qa[0].question, True))!r}")
    res = measure(lm, seeds, layers, args.keep, args.cover, args.query_agnostic)
    cols = ["objects", "chance", *RANKS, "last_query_mass_on_objects"]
    print("| K | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for k in layers:
        print(f"| {k} | " + " | ".join(f"{res[k][c]:.2f}" for c in cols) + " |")
    print(json.dumps({"prompts": res[layers[0]]["prompts"], "keep": args.keep, "cover": args.cover,
                      "query_agnostic": args.query_agnostic}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
