"""The word grid: what each image token of the embedded model should say, in the language model's own words.

The tower sees 12 x 12 patches; the scenes are a 3 x 3 grid of cells, so each cell owns 4 x 4 patches. The
target of a cell's patches, read in raster order inside the cell, is the tokens of one short phrase about
what the cell holds, then the fill token "." on the patches left over:

    an object:  " red circle small top left"      (colour and shape first: most questions bind those two)
    the word:   " word STOP top"                  (it spans its row; the phrase sits in the row's middle cell)
    empty:      "." on every patch

The "anchored" layout puts the same phrase on the patch under the object's centre and the patches after it
(raster order inside the cell, wrapping), so the patch that must say the colour is one that sees it; the
printed word starts on the cell's second patch row. "cell" (above) is the layout of the first runs.

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


LAYOUTS = ("cell", "anchored")


def _first_patch(scene: Scene, cell: int, layout: str) -> int:
    """Index (raster order inside the cell) of the patch where the cell's phrase starts."""
    if layout == "cell":
        return 0
    r, c = divmod(cell, 3)
    for o in scene.objects:
        if REGIONS.index(o.region) == cell:
            i = min(CELL - 1, max(0, int(o.cy * SIDE) - CELL * r))
            j = min(CELL - 1, max(0, int(o.cx * SIDE) - CELL * c))
            return i * CELL + j
    return CELL  # the printed word: the cell's second row


def grid_ids(tokenizer, scene: Scene, layout: str = "cell") -> list[int]:
    """The 144 target token ids of `scene` in the image tokens' raster order."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    grid = [[fill_id(tokenizer)] * SIDE for _ in range(SIDE)]
    for cell, phrase in cell_phrases(scene).items():
        r, c = divmod(cell, 3)
        ids = _phrase_ids(tokenizer, phrase)
        if len(ids) > CELL * CELL:
            raise ValueError(f"phrase {phrase!r} needs {len(ids)} tokens; a cell has {CELL * CELL}")
        start = _first_patch(scene, cell, layout)
        for k, t in enumerate(ids):
            at = (start + k) % (CELL * CELL)
            grid[CELL * r + at // CELL][CELL * c + at % CELL] = t
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


def grid_embeddings(embed: torch.nn.Embedding, tokenizer, scene: Scene, layout: str = "cell") -> torch.Tensor:
    """[144, D]: the input embeddings the image tokens should carry for `scene`."""
    return embed.weight[torch.tensor(grid_ids(tokenizer, scene, layout))]
