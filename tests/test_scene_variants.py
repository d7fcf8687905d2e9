"""The scenes beyond the generator's own style: questions as people type them, freeform images for checking
generalisation, looser training scenes, and the word-grid targets of the embedded model's training."""
import random

import numpy as np
import pytest

from scenes import COLOURS, REGIONS, render_scene, split_seeds
from scenes.freeform import render_freeform
from scenes.phrasings import HELD_OUT, TRAIN, casual_qa
from training import word_grid
from training.loose_scenes import render_loose


def test_train_and_held_out_phrasings_are_disjoint():
    for qtype in HELD_OUT:
        assert not set(TRAIN[qtype]) & set(HELD_OUT[qtype]), qtype


@pytest.mark.parametrize("held_out", [False, True])
def test_casual_questions_have_the_scene_answers(held_out):
    for seed in split_seeds("test", 20):
        scene = render_scene(seed, 64)
        by_colour = {o.colour: o for o in scene.objects}
        for qa in casual_qa(scene, random.Random(seed), held_out=held_out):
            if qa.qtype == "shape":
                colour = next(c for c in by_colour if c in qa.question)
                assert qa.answer == by_colour[colour].shape
            elif qa.qtype == "colour":
                assert any(o.colour == qa.answer and o.shape in qa.question for o in scene.objects)
            elif qa.qtype == "word":
                assert qa.answer == scene.word
            elif qa.qtype == "yesno":
                said = {(c, s) for c in COLOURS for s in (o.shape for o in scene.objects)}
                assert qa.answer in ("yes", "no") and said


def test_freeform_images_are_deterministic_and_drawn_as_described():
    a, b = render_freeform(7), render_freeform(7)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    for seed in range(12):
        f = render_freeform(seed)
        px = np.asarray(f.image).astype(int)
        cx, cy = (int(v * px.shape[1]) for v in f.centre)
        if f.shape not in ("cross", "star", "triangle"):  # the centre of these is filled too, but keep it simple
            assert np.abs(px[cy, cx] - np.array(COLOURS[f.colour])).max() <= 3
        corner = px[0, 0]
        assert np.abs(corner - np.array(f.background)).max() <= 3


def test_loose_scenes_give_one_object_per_region_by_its_centre():
    for seed in range(30):
        s = render_loose(seed)
        assert 1 <= len(s.objects) <= 2 and len({o.region for o in s.objects}) == len(s.objects)
        for o in s.objects:
            assert REGIONS[min(2, int(o.cy * 3)) * 3 + min(2, int(o.cx * 3))] == o.region


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from prefixkv_core.models.embedded import find_gguf

    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_word_grid_places_each_phrase_in_its_cell(embedded_tokenizer):
    tok = embedded_tokenizer
    scene = next(render_scene(s, 64) for s in range(100) if render_scene(s, 64).word)
    grid = np.array(word_grid.grid_ids(tok, scene)).reshape(word_grid.SIDE, word_grid.SIDE)
    fill = word_grid.fill_id(tok)
    phrases = word_grid.cell_phrases(scene)
    assert len(phrases) == len(scene.objects) + 1
    for cell in range(9):
        r, c = divmod(cell, 3)
        block = grid[4 * r:4 * r + 4, 4 * c:4 * c + 4].reshape(-1).tolist()
        if cell in phrases:
            ids = tok(phrases[cell], add_special_tokens=False)["input_ids"]
            assert block[:len(ids)] == ids and set(block[len(ids):]) <= {fill}
        else:
            assert set(block) == {fill}
    assert set(grid.reshape(-1).tolist()) <= set(word_grid.vocabulary(tok))


def test_anchored_layout_starts_each_phrase_under_its_object(embedded_tokenizer):
    tok = embedded_tokenizer
    for seed in range(20):
        scene = render_scene(seed, 64)
        grid = np.array(word_grid.grid_ids(tok, scene, "anchored")).reshape(word_grid.SIDE, word_grid.SIDE)
        cell_layout = word_grid.grid_ids(tok, scene, "cell")
        assert sorted(grid.reshape(-1).tolist()) == sorted(cell_layout)  # the same tokens, placed elsewhere
        for o in scene.objects:
            colour = tok(f" {o.colour}", add_special_tokens=False)["input_ids"][0]
            assert grid[int(o.cy * word_grid.SIDE), int(o.cx * word_grid.SIDE)] == colour
    with pytest.raises(ValueError):
        word_grid.grid_ids(tok, render_scene(0, 64), "spiral")
