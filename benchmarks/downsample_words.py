"""What Downsample's pooled image tokens still say on the embedded model.

    python -m benchmarks.downsample_words --scenes 20 --grids 12,8,6,4 --where projector_out,projector_in

The embedded model's tower and projector were trained to give each of its 12 x 12 image tokens the input
embedding of one word of its cell's phrase (" red circle small top left", or the fill "."; training/README.md,
the word grid), and its language model reads the image as those words. Downsample average-pools that grid
(`policies.downsample.pool_weights`, the weights the method itself uses), so a pooled token is the mean of
several words' embeddings (`--where projector_out`, the method's default on this fixed-resolution tower), or the
projector's output for the mean of the tower's features (`projector_in`). For the first --scenes test-split scenes this reads every token, unpooled and pooled
to each --grids side, as the grid word nearest to it (cosine over the grid's vocabulary) and prints, per side:
the tokens fed, the mean cosine to the nearest word, the share of tokens nearest to the fill, and the share of the
scene's colour, shape and printed words that are still the nearest word of at least one token.
"""
from __future__ import annotations

import argparse
import json

import torch

from prefixkv_core.decoding.vision_tower import feature_layer, vision_features
from prefixkv_core.method_args import add_model_args
from prefixkv_core.models import encode, format_prompt, load_model, vision_inputs
from prefixkv_core.policies.downsample import pool_weights
from scenes import COLOURS, SHAPES, WORDS, render_scene, split_seeds
from training.word_grid import fill_id, grid_ids, vocabulary

SHIPPED_LAYOUT = "anchored"  # the word-grid layout the shipped tower was trained on (training/README.md)


def content_words(tokenizer) -> dict[int, str]:
    """token id -> word, for the words a scene's answers need: colours, shapes, printed words."""
    out = {}
    for word in [*COLOURS, *SHAPES, *WORDS]:
        ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        out[ids[0]] = word  # the first token is the one a grid phrase starts the word with
    return out


def _pooled_before_projector(lm, inputs, side: int, g: int) -> torch.Tensor:
    """The tower's feature grid (its CLS token dropped) pooled to g x g, then projected: Downsample's
    `projector_in`."""
    model = lm.model
    index, _ = feature_layer(model.config)
    pixels = vision_inputs(inputs)["pixel_values"]
    hidden = model.model.vision_tower(pixels.reshape(-1, *pixels.shape[-3:]), output_hidden_states=True
                                      ).hidden_states[index][0]
    weights = pool_weights(side, g, has_cls=hidden.shape[0] == side * side + 1).to(hidden.device)
    pooled = (weights @ hidden.float()).to(hidden.dtype)
    return model.model.multi_modal_projector(pooled[None])[0].float()


@torch.inference_mode()
def measure(lm, seeds: list[int], grids: list[int], where: str = "projector_out") -> dict:
    tokenizer = lm.processor.tokenizer
    vocab = torch.tensor(vocabulary(tokenizer))
    words = torch.nn.functional.normalize(lm.model.get_input_embeddings().weight[vocab].float(), dim=-1)
    fill, wanted = fill_id(tokenizer), content_words(tokenizer)
    totals = {g: {"tokens": 0, "cosine": 0.0, "fill": 0, "words_in_scene": 0, "words_kept": 0} for g in grids}
    for seed in seeds:
        scene = render_scene(seed)
        inputs = encode(lm, scene.image, format_prompt(lm, "Describe the image.", with_image=True))
        image = vision_features(lm.model, vision_inputs(inputs), record=False).image.float()
        side = int(round(image.shape[0] ** 0.5))
        in_scene = set(grid_ids(tokenizer, scene, SHIPPED_LAYOUT)) & wanted.keys()  # the words its grid spells
        for g in grids:
            if g >= side:
                tokens = image
            elif where == "projector_in":
                tokens = _pooled_before_projector(lm, inputs, side, g)
            else:
                tokens = pool_weights(side, g, has_cls=False).to(image.device) @ image
            cos = torch.nn.functional.normalize(tokens, dim=-1) @ words.T
            best, nearest = cos.max(dim=-1)
            nearest = vocab[nearest]
            t = totals[g]
            t["tokens"] += tokens.shape[0]
            t["cosine"] += float(best.sum())
            t["fill"] += int((nearest == fill).sum())
            t["words_in_scene"] += len(in_scene)
            t["words_kept"] += len(in_scene & {int(n) for n in nearest})
    out = {}
    for g, t in totals.items():
        out[g] = {"tokens_per_image": t["tokens"] / len(seeds), "mean_cosine": t["cosine"] / t["tokens"],
                  "nearest_fill": t["fill"] / t["tokens"],
                  "scene_words_kept": t["words_kept"] / max(1, t["words_in_scene"])}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.set_defaults(model="embedded")
    ap.add_argument("--scenes", type=int, default=20)
    ap.add_argument("--grids", default="12,8,6,4", help="pooled grid sides (12: the tokens as the model feeds them)")
    ap.add_argument("--where", default="projector_out",
                    help="comma-separated: projector_out (the projected grid pooled, the method's default here), "
                         "projector_in (the tower's features pooled, then projected)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    grids = [int(g) for g in args.grids.split(",")]
    every = {}
    print("| where | grid | tokens fed | mean cosine to the nearest grid word | nearest word is the fill | the "
          "scene's colour, shape and printed words still nearest to some token |")
    print("|---|---|---|---|---|---|")
    for where in args.where.split(","):
        res = every[where] = measure(lm, split_seeds("test", args.scenes), grids, where)
        for g, r in res.items():
            print(f"| {where} | {g}x{g} | {r['tokens_per_image']:.0f} | {r['mean_cosine']:.2f} | "
                  f"{r['nearest_fill']:.0%} | {r['scene_words_kept']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({w: {str(g): r for g, r in res.items()} for w, res in every.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
