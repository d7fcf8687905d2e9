"""The word grid: what each image token of the embedded model should say, in the language model's own words.

The tower sees 12 x 12 patches; the scenes are a 3 x 3 grid of cells, so each cell owns 4 x 4 patches. The
target of a cell's patches, read in raster order inside the cell, is the tokens of one short phrase about
what the cell holds, then the fill token "." on the patches left over:

    an object:  " red circle small top left"      (colour and shape first: most questions bind those two)
    the word:   " word STOP top"                  (it spans its row; the phrase sits in the row's middle cell)
    empty:      "." on every patch

Stage W trains tower + projector to emit the input embeddings of these tokens (no language-model forward);
stage L teaches a LoRA adapter to answer questions from exactly these embeddings laid out as image tokens.
Then the two halves meet in a short end-to-end stage on rendered images.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from scenes import COLOURS, REGIONS, SHAPES, WORDS, Scene

SIDE = 12  # patches per image side (192 px / 16 px)
CELL = SIDE // 3  # patches per cell side
FILL = "."


def region_words(region: str) -> str:
    return region.replace("-", " ")


def cell_phrases(scene: Scene) -> dict[int, str]:
    """Cell index (raster order of the 3 x 3 grid) -> the phrase its patches carry (leading space)."""
    out: dict[int, str] = {}
    for o in scene.objects:
        out[REGIONS.index(o.region)] = f" {o.colour} {o.shape} {o.size} {region_words(o.region)}"
    if scene.word:
        out[REGIONS.index(scene.word_region)] = f" word {scene.word} {scene.word_region}"
    return out


@lru_cache(maxsize=4096)
def _phrase_ids(tokenizer, phrase: str) -> tuple[int, ...]:
    return tuple(tokenizer(phrase, add_special_tokens=False)["input_ids"])


def fill_id(tokenizer) -> int:
    return _phrase_ids(tokenizer, FILL)[0]


def grid_ids(tokenizer, scene: Scene) -> list[int]:
    """The 144 target token ids of `scene` in the image tokens' raster order."""
    grid = [[fill_id(tokenizer)] * SIDE for _ in range(SIDE)]
    for cell, phrase in cell_phrases(scene).items():
        r, c = divmod(cell, 3)
        ids = _phrase_ids(tokenizer, phrase)
        if len(ids) > CELL * CELL:
            raise ValueError(f"phrase {phrase!r} needs {len(ids)} tokens; a cell has {CELL * CELL}")
        for k, t in enumerate(ids):
            grid[CELL * r + k // CELL][CELL * c + k % CELL] = t
    return [t for row in grid for t in row]


def vocabulary(tokenizer) -> list[int]:
    """Every token id a grid can hold (the classes stage W tells apart), fill first."""
    ids = {fill_id(tokenizer)}
    phrases = [f" {c} {s} {z} {region_words(r)}" for c in COLOURS for s in SHAPES for z in ("small", "large")
               for r in REGIONS]
    phrases += [f" word {w} {where}" for w in WORDS for where in ("top", "bottom")]
    for p in phrases:
        ids.update(_phrase_ids(tokenizer, p))
    rest = sorted(ids - {fill_id(tokenizer)})
    return [fill_id(tokenizer)] + rest


def grid_embeddings(embed: torch.nn.Embedding, tokenizer, scene: Scene) -> torch.Tensor:
    """[144, D]: the input embeddings the image tokens should carry for `scene`."""
    return embed.weight[torch.tensor(grid_ids(tokenizer, scene))]
