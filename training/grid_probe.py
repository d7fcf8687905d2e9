"""How well does a stage-W tower + projector say the word grid? Nearest grid token per image token, scored by
the kind of token it should be (fill, colour, shape, size, the rest: region words and the printed word).

    python -m training.grid_probe --vision runs/emb/vision_W.pt --layout anchored --scenes 64

The colour and shape tokens are the ones the answers need; a tower that gets the fill and the region words
right but not these has learnt where objects are, not what they are.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
import torch.nn.functional as F

from prefixkv_core.models import load_model
from scenes import COLOURS, SHAPES, SPLITS, render_scene

from . import data, word_grid
from .grid_stages import read_state
from .trainable import load_vision_state, patch_features


def token_kinds(tokenizer) -> dict[int, str]:
    kinds = {word_grid.fill_id(tokenizer): "fill"}
    for names, kind in ((COLOURS, "colour"), (SHAPES, "shape"), (("small", "large"), "size")):
        for n in names:
            kinds[tokenizer(" " + n, add_special_tokens=False)["input_ids"][0]] = kind
    return kinds


@torch.no_grad()
def probe(loaded, layout: str, seeds: list[int], batch: int = 16) -> dict[str, dict]:
    model = loaded.model.eval()
    tok = loaded.tokenizer
    vocab = word_grid.vocabulary(tok)
    emb = F.normalize(model.get_input_embeddings().weight[torch.tensor(vocab)], dim=-1)
    kinds = token_kinds(tok)
    hit, total = collections.Counter(), collections.Counter()
    for i in range(0, len(seeds), batch):
        scenes = [render_scene(s, data.RENDER_SIZE) for s in seeds[i:i + batch]]
        out = model.model.multi_modal_projector(patch_features(model, data.pixels(loaded, [s.image for s in scenes])))
        pred = (F.normalize(out, dim=-1) @ emb.T).argmax(-1)
        for b, scene in enumerate(scenes):
            for j, t in enumerate(word_grid.grid_ids(tok, scene, layout)):
                kind = kinds.get(t, "other")
                total[kind] += 1
                hit[kind] += vocab[int(pred[b, j])] == t
    return {k: {"accuracy": round(hit[k] / total[k], 4), "n": total[k]} for k in total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vision", required=True, help="vision_W.pt or a .safetensors of tower + projector")
    ap.add_argument("--layout", default="cell", choices=word_grid.LAYOUTS)
    ap.add_argument("--scenes", type=int, default=64, help="validation-split scenes")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model("embedded-base", device="cpu", dtype="float32")
    load_vision_state(loaded.model, read_state(args.vision))
    print(json.dumps(probe(loaded, args.layout, list(SPLITS["val"][:args.scenes]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
