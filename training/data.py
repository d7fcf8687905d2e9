"""Training data from the synthetic scenes (scenes/): vision targets for stage A, token sequences for stages B/C.

Sequences are built from the same helpers the engine uses (format_prompt / format_followup, one
tokenizer call per segment, `<image>` expanded to the image tokens) so training sees exactly what the
engine feeds the model: the first user turn carries the image, later turns are text follow-ups.
"""
from __future__ import annotations

import random

import torch

from prefixkv_core.models import LoadedModel, format_followup, format_prompt
from scenes import COLOURS, SHAPES, WORDS, REGIONS, Scene, render_scene

COLOUR_IDS = {c: i + 1 for i, c in enumerate(COLOURS)}  # 0 = empty cell
SHAPE_IDS = {s: i + 1 for i, s in enumerate(SHAPES)}
SIZE_IDS = {"small": 1, "large": 2}
WORD_IDS = {w: i + 1 for i, w in enumerate(WORDS)}
DESCRIBE_PROMPTS = (
    "Describe the image.",
    "Describe this image in detail.",
    "Describe the image in detail.",
    "What is in this image?",
)
# Stage A renders at the app's default size (384) and lets the processor downscale, as at inference.
RENDER_SIZE = 384


def scene_seed(base: int, index: int) -> int:
    """Train-split seed for the index-th sample of a stage (stages use disjoint sub-ranges)."""
    return base + index


def vision_targets(scene: Scene) -> dict[str, torch.Tensor]:
    """Ground truth for the auxiliary heads: per 3x3 cell colour/shape/size, global counts and word."""
    colour = torch.zeros(9, dtype=torch.long)
    shape = torch.zeros(9, dtype=torch.long)
    size = torch.zeros(9, dtype=torch.long)
    for o in scene.objects:
        k = REGIONS.index(o.region)
        colour[k], shape[k], size[k] = COLOUR_IDS[o.colour], SHAPE_IDS[o.shape], SIZE_IDS[o.size]
    counts = torch.tensor([sum(o.shape == s for o in scene.objects) for s in SHAPES], dtype=torch.long)
    return {
        "colour": colour, "shape": shape, "size": size, "counts": counts,
        "total": torch.tensor(len(scene.objects)),
        "word": torch.tensor(WORD_IDS[scene.word] if scene.word else 0),
        "word_region": torch.tensor({None: 0, "top": 1, "bottom": 2}[scene.word_region]),
    }


def pixels(loaded: LoadedModel, images) -> torch.Tensor:
    """The model's own image processor (CLIP resize/crop/normalise), so train == inference."""
    return loaded.processor.image_processor(images=images, return_tensors="pt")["pixel_values"].float()


def _ids(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def first_turn_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    """Prompt ids with `<image>` expanded to the image tokens (what the processor produces)."""
    out: list[int] = []
    for t in _ids(loaded, format_prompt(loaded, prompt, with_image=True)):
        out.extend([t] * loaded.image_seq_length if t == loaded.image_token_id else [t])
    return out


def conversation(loaded: LoadedModel, turns: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [T], turn [T] long): turn k >= 1 marks the tokens of the k-th answer and its
    end-of-turn token (the supervised ones); 0 = prompt, not supervised."""
    eos = loaded.tokenizer.eos_token_id
    ids: list[int] = []
    sup: list[int] = []
    for i, (q, a) in enumerate(turns):
        if i == 0:
            p = first_turn_ids(loaded, q)
            ids += p
            sup += [0] * len(p)
        else:
            # The engine strips the answer's end-of-turn id and appends the follow-up text, which
            # starts with that end-of-turn token: supervise it there (it ends the previous answer).
            p = _ids(loaded, format_followup(loaded, q))
            ids += p
            sup += [i if p[0] == eos else 0] + [0] * (len(p) - 1)
        ans = _ids(loaded, a)
        ids += ans
        sup += [i + 1] * len(ans)
    ids.append(eos)
    sup.append(len(turns))
    return torch.tensor(ids), torch.tensor(sup)


def scene_turns(scene: Scene, rng: random.Random, with_description: bool, only_description: bool = False):
    """All QA pairs of a scene in a shuffled order (so every type gets to be the image turn), plus
    optionally the description at a random place."""
    desc = (rng.choice(DESCRIBE_PROMPTS), scene.description)
    if only_description:
        return [desc]
    turns = [(qa.question, qa.answer) for qa in scene.qa]
    rng.shuffle(turns)
    if with_description:
        turns.insert(rng.randint(0, len(turns)), desc)
    return turns


def render(seed: int) -> Scene:
    return render_scene(seed, RENDER_SIZE)


def tree_example(loaded: LoadedModel, branches: list[tuple[str, str]]):
    """One image prompt shared by many single-turn QA branches, as one sequence.

    Every branch sees the shared prefix (system turn, user turn opening, image tokens) and its own
    question and answer, never another branch: a 4D mask hides the other branches and each branch's
    positions continue from the prefix, so a branch computes exactly what the single-turn prompt
    `first_turn_ids(question)` + answer computes, while the 168-token prefix is paid once.
    Returns (input_ids [T], position_ids [T], mask [T, T] bool (True = may attend),
    sup [T] long: k >= 1 marks the answer tokens and end-of-turn token of branch k).
    """
    eos = loaded.tokenizer.eos_token_id
    first = first_turn_ids(loaded, branches[0][0])
    cut = max(i for i, t in enumerate(first) if t == loaded.image_token_id) + 1
    ids, pos, branch, sup = list(first[:cut]), list(range(cut)), [0] * cut, [0] * cut
    for k, (q, a) in enumerate(branches, start=1):
        full = first_turn_ids(loaded, q)
        if full[:cut] != ids[:cut]:
            raise ValueError("the prompt prefix depends on the question; cannot share it")
        tail = full[cut:]
        ans = _ids(loaded, a) + [eos]
        ids += tail + ans
        pos += list(range(cut, cut + len(tail) + len(ans)))
        branch += [k] * (len(tail) + len(ans))
        sup += [0] * len(tail) + [k] * len(ans)
    b = torch.tensor(branch)
    t = torch.arange(len(ids))
    mask = (t[None, :] <= t[:, None]) & ((b[None, :] == 0) | (b[None, :] == b[:, None]))
    return torch.tensor(ids), torch.tensor(pos), mask, torch.tensor(sup)
