"""Multi-image samples and clips from the scene generator (scenes.multi, scenes.video), the lmms-eval tasks
scene_multi and scene_video written from them (benchmarks/scene_long_tasks.py), and the app's example assets."""

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import av
import numpy as np
import pytest
import yaml
from PIL import Image

from benchmarks import scene_long_tasks as writer
from scenes import (COLOURS, MULTI_SUBTASKS, PLURALS, SHAPES, SPLITS, VIDEO_SUBTASKS, multi_sample, multi_samples,
                    render_scene, video_sample, video_samples, write_clip)
from scenes.grading import is_correct, is_correct_image_number
from scenes.multi import candidate_seeds, grade, multi_seeds
from scenes.video import DIRECTIONS, cached_clip

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "benchmarks" / "lmms_tasks"
N = 12  # samples per subtask in the content checks
MIN_N, MAX_N = 2, 6


def _content(seeds):
    return [render_scene(s, 32) for s in seeds]


@pytest.fixture(scope="module")
def multi():
    return {sub: list(multi_samples("val", N, sub, images=False)) for sub in MULTI_SUBTASKS}


@pytest.fixture(scope="module")
def clips():
    return {sub: list(video_samples("val", 6, sub, frames=8, size=96)) for sub in VIDEO_SUBTASKS}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_utils_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decode(path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


# --- multi-image samples ---------------------------------------------------------------------------------------


def test_multi_deterministic_and_sized():
    a, b = multi_sample(2_000_004, size=64), multi_sample(2_000_004, size=64)
    assert a.record() == b.record()
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a.images, b.images))
    assert a.subtask == "which" and MIN_N <= a.n_images <= MAX_N and len(a.images) == a.n_images
    assert all(isinstance(im, Image.Image) and im.size == (64, 64) for im in a.images)
    assert multi_sample(2_000_004, images=False).record() == a.record()  # text independent of size and pixels
    assert multi_sample(2_000_004, n_images=2).n_images == 2
    with pytest.raises(ValueError):
        multi_sample(2_000_004, n_images=7)
    with pytest.raises(ValueError):
        multi_sample(5_000_000)  # in no split



def test_multi_splits_separated_and_subtasks_rotate():
    for split, rng_ in SPLITS.items():
        seeds = multi_seeds(split, 8)
        assert seeds == list(range(rng_.start, rng_.start + 8))
        assert [multi_sample(s, images=False).subtask for s in seeds[:4]] == list(MULTI_SUBTASKS)
        for s in seeds:
            assert all(x in rng_ for x in multi_sample(s, images=False).scene_seeds)
        it = candidate_seeds(seeds[0])
        assert all(next(it) in rng_ for _ in range(200))
    assert multi_seeds("test", 3, "needle") == [2_000_002, 2_000_006, 2_000_010]


def test_multi_which_exactly_one_image_matches(multi):
    for s in multi["which"]:
        assert s.question.startswith("Which image shows ")
        colour, shape = s.question[:-1].split()[-2:]
        scenes = _content(s.scene_seeds)
        matches = [k + 1 for k, sc in enumerate(scenes) if (colour, shape) in {(o.colour, o.shape) for o in sc.objects}]
        assert matches == [int(s.answer)] == [s.target]
        assert len(set(s.scene_seeds)) == s.n_images


def test_multi_colour_k_unique_shape_and_distractor(multi):
    for s in multi["colour_k"]:
        words = s.question[:-1].split()
        shape, k = words[4], int(words[-1])
        assert s.question == f"What colour is the {shape} in image {k}?" and k == s.target
        scenes = _content(s.scene_seeds)
        in_k = [o for o in scenes[k - 1].objects if o.shape == shape]
        assert len(in_k) == 1 and in_k[0].colour == s.answer and s.answer in COLOURS
        assert any(o.shape == shape and o.colour != s.answer
                   for j, sc in enumerate(scenes) if j != k - 1 for o in sc.objects)


def test_multi_needle_one_word(multi):
    for s in multi["needle"]:
        words = [sc.word for sc in _content(s.scene_seeds)]
        assert [w for w in words if w is not None] == [s.answer]
        assert words.index(s.answer) + 1 == s.target


def test_multi_count_totals(multi):
    for s in multi["count"]:
        shape = next(sh for sh in SHAPES if f" {PLURALS[sh]} " in s.question)
        total = sum(o.shape == shape for sc in _content(s.scene_seeds) for o in sc.objects)
        assert s.answer == str(total) and 1 <= total <= 9 and s.target is None


def test_multi_grading(multi):
    for sub, samples in multi.items():
        for s in samples:
            assert s.grade(s.answer) and s.grade(s.answer.lower() + ".")
            assert not s.grade("") and not s.grade("I do not know")
    assert grade("Image 2.", "2", "which") and grade("the image 2", "2", "which") and not grade("image 3", "2", "which")
    assert not grade("Image 2", "2", "count")  # only image numbers take the lead word
    assert is_correct_image_number("2", "2") and not is_correct_image_number("22", "2")
    assert is_correct("red", "red") and not is_correct("image red", "red")  # is_correct itself unchanged
    s = multi["which"][0]
    assert s.prompt == f"There are {s.n_images} images, numbered 1 to {s.n_images} in the order they are shown. " \
                       + s.question


# --- clips ------------------------------------------------------------------------------------------------------


def _mask(frame: np.ndarray, colour: str) -> np.ndarray:
    return np.abs(frame.astype(int) - np.array(COLOURS[colour])).max(axis=-1) < 30


def test_video_deterministic_and_sized():
    a, b = video_sample(2_000_001, frames=6, size=64), video_sample(2_000_001, frames=6, size=64)
    assert a.record() == b.record() and a.movers == b.movers
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a.frames, b.frames))
    assert len(a.frames) == 6 and all(f.size == (64, 64) and f.mode == "RGB" for f in a.frames)
    assert video_sample(2_000_001, frames=16, draw=False).question == a.question  # content independent of frames
    assert a.subtask == "direction" and a.fps == 4
    with pytest.raises(ValueError):
        video_sample(2_000_001, frames=2)


def test_video_splits_and_rotation():
    for split, rng_ in SPLITS.items():
        seeds = [s.seed for s in video_samples(split, 3, draw=False)]
        assert seeds == list(range(rng_.start, rng_.start + 3))
        assert [video_sample(s, draw=False).subtask for s in seeds] == list(VIDEO_SUBTASKS)
    assert [s.seed for s in video_samples("test", 2, "appears_last", draw=False)] == [2_000_002, 2_000_005]


def test_video_answers_match_the_pixels(clips):
    for s in clips["direction"]:
        colour = next(c for c in COLOURS if f"the {c} " in s.question)
        assert s.answer in DIRECTIONS
        seen = [np.argwhere(_mask(np.asarray(f), colour)) for f in s.frames]
        seen = [p for p in seen if len(p) > 20]
        (y0, x0), (y1, x1) = seen[0].mean(axis=0), seen[-1].mean(axis=0)
        moved = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}
        assert max(moved, key=moved.get) == s.answer and moved[s.answer] > 0.4 * 96
    for s in clips["appears_last"]:
        late = [m for m in s.movers if m.appears > 0]
        assert len(late) == 1 and late[0].shape == s.answer and len(s.movers) >= 2
        first, last = np.asarray(s.frames[0]), np.asarray(s.frames[-1])
        assert not _mask(first, late[0].colour).any() and _mask(last, late[0].colour).sum() > 20
        assert all(_mask(first, m.colour).sum() > 20 for m in s.movers if m.appears == 0)
    for s in clips["colour_seen"]:
        assert s.answer in {m.colour for m in s.movers} and len({m.colour for m in s.movers}) == len(s.movers)
        assert any(_mask(np.asarray(f), s.answer).sum() > 20 for f in s.frames)
        assert is_correct(s.answer, s.answer)


def test_write_clip_decodes_to_the_frames(tmp_path):
    s = video_sample(2_000_002, frames=8, size=96)
    path = write_clip(s, tmp_path / "c.mp4")
    frames = _decode(path)
    assert len(frames) == 8 and frames[0].shape == (96, 96, 3)
    for got, want in zip(frames, s.frames):
        assert np.abs(got.astype(int) - np.asarray(want, dtype=int)).mean() < 6
    with av.open(str(path)) as c:
        assert c.streams.video[0].average_rate == s.fps


# --- the lmms-eval tasks ----------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: ("function", loader.construct_scalar(node)))


@pytest.mark.parametrize("group", ["scene_multi", "scene_video"])
def test_writer_files_load_and_round_trip(group, tmp_path):
    counts = writer.write(group, 3, tmp_path)
    subtasks = writer.TASKS[group].subtasks
    assert counts == {s: 3 for s in subtasks}
    d = tmp_path / group
    template = yaml.load((d / "_default_template_yaml").read_text(), Loader=_Loader)
    assert template["generation_kwargs"]["max_new_tokens"] == 8
    assert template["doc_to_visual"] == ("function", "utils.doc_to_visual")
    assert yaml.safe_load((d / f"{group}.yaml").read_text())["task"] == [f"{group}_{s}" for s in subtasks]
    for sub in subtasks:
        cfg = yaml.safe_load((d / f"{group}_{sub}.yaml").read_text())
        assert cfg["dataset_kwargs"]["data_files"]["test"] == f"benchmarks/lmms_tasks/{group}/data/{sub}.json"
        rows = json.loads((d / "data" / f"{sub}.json").read_text())
        assert rows == writer.TASKS[group].records("test", 3, sub) and {r["subtask"] for r in rows} == {sub}
        sample = (multi_sample if group == "scene_multi" else video_sample)(rows[0]["seed"], **(
            {"n_images": rows[0]["n_images"], "images": False} if group == "scene_multi"
            else {"frames": rows[0]["frames"], "draw": False}))
        assert sample.record() == rows[0]


@pytest.mark.parametrize("group", ["scene_multi", "scene_video"])
def test_shipped_task_files_are_the_writers(group):
    d = TASKS / group
    for name in ("_default_template_yaml", f"{group}.yaml"):
        assert (d / name).is_file()
    assert (d / "_default_template_yaml").read_text() == writer.template_yaml(group)
    for sub in writer.TASKS[group].subtasks:
        rows = json.loads((d / "data" / f"{sub}.json").read_text())
        assert len(rows) == 40 and all(r["seed"] in SPLITS["test"] for r in rows)
        assert rows[:5] == writer.TASKS[group].records("test", 5, sub)


def test_multi_doc_to_visual_and_text():
    utils = _load(TASKS / "scene_multi" / "utils.py")
    doc = json.loads((TASKS / "scene_multi" / "data" / "colour_k.json").read_text())[0]
    images = utils.doc_to_visual(doc)
    assert isinstance(images, list) and len(images) == doc["n_images"]
    want = multi_sample(doc["seed"], doc["n_images"])
    assert all(isinstance(im, Image.Image) and np.array_equal(np.asarray(im), np.asarray(w))
               for im, w in zip(images, want.images))
    assert all(sc in SPLITS["test"] for sc in doc["scene_seeds"])
    text = utils.doc_to_text(doc)
    assert text.endswith(doc["question"]) and f"numbered 1 to {doc['n_images']}" in text
    assert utils.process_results(doc, [doc["answer"]]) == {"accuracy": 1.0}
    assert utils.process_results(doc, ["nothing"]) == {"accuracy": 0.0}


def test_video_doc_to_visual_writes_and_reuses_a_clip(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    utils = _load(TASKS / "scene_video" / "utils.py")
    doc = dict(json.loads((TASKS / "scene_video" / "data" / "direction.json").read_text())[0], frames=6)
    (path,) = utils.doc_to_visual(doc)
    assert isinstance(path, str) and Path(path).parent.parent == tmp_path and Path(path).is_file()
    assert len(_decode(path)) == 6
    mtime = os.stat(path).st_mtime_ns
    assert utils.doc_to_visual(doc) == [path] and os.stat(path).st_mtime_ns == mtime  # reused
    assert cached_clip(doc["seed"], 6) == Path(path)
    assert utils.doc_to_text(doc) == doc["question"]
    assert utils.process_results(doc, [doc["answer"] + "."]) == {"accuracy": 1.0}


# --- the app's example assets -------------------------------------------------------------------------------------


def test_shipped_multi_asset_is_the_generators():
    rec = json.loads((ROOT / "assets" / "multi" / "multi-0.json").read_text())
    assert rec == writer.multi_asset_record() and 3 <= rec["n_images"] <= 4
    sample = multi_sample(rec["seed"], rec["n_images"], size=rec["size"])
    for name, image in zip(rec["images"], sample.images):
        with Image.open(ROOT / "assets" / "multi" / name) as shipped:
            assert np.array_equal(np.asarray(shipped.convert("RGB")), np.asarray(image))
    assert sample.grade(rec["answer"]) and rec["prompt"] == sample.prompt


def test_shipped_clip_is_the_generators():
    rec = json.loads((ROOT / "assets" / "videos" / "clip-0.json").read_text())
    assert rec == writer.video_asset_record()
    path = ROOT / "assets" / "videos" / rec["file"]
    assert path.stat().st_size < 200_000
    frames = _decode(path)
    assert len(frames) == rec["frames"] and frames[0].shape == (rec["size"], rec["size"], 3)
    want = video_sample(rec["seed"], rec["frames"], size=rec["size"]).frames
    for got, w in zip(frames, want):
        assert np.abs(got.astype(int) - np.asarray(w, dtype=int)).mean() < 6
