"""The shipped embedded vision tower + projector see the synthetic scenes: colour questions on held-out
TEST scenes with the full cache.

The first run after a new vision file builds the assembled model in the cache (about a minute); the
questions themselves take a few seconds. Skipped only when the trained vision file is not shipped.

The seeds are the first TEST-split seeds, not hand-picked ones. The assertion is what a seeing model
must do: at least half right (chance is 1 in 8 colours). The first training run (v1, 2026-11-23) measured
10 % colour accuracy on 100 test scenes, so it was not shipped and this file skips until weights that see
are in assets/embedded_vision/.
"""
import json

import pytest

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.models import EMBEDDED_VISION_DIR, load_model
from scenes import SPLITS, render_scene, split_seeds

VISION_FILE = EMBEDDED_VISION_DIR / "vision.safetensors"
INFO_FILE = EMBEDDED_VISION_DIR / "info.json"
SEEDS = split_seeds("test", 10)  # never used in training: training draws from the train split only
MIN_CORRECT = 5  # of 10; chance is 1.25

pytestmark = pytest.mark.skipif(not VISION_FILE.is_file(), reason=f"no trained vision file at {VISION_FILE}")


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("embedded", device="cpu"))


def _colour_answer(engine, seed):
    assert seed in SPLITS["test"]
    scene = render_scene(seed)
    qa = next(q for q in scene.qa if q.qtype == "colour")
    session = engine.new_session(scene.image, qa.question, ["full"], 1.0, GenerationSettings(max_new_tokens=2))
    for _ in session.run():
        pass
    return qa, session.results()["full"]["text"]


@pytest.fixture(scope="module")
def answers(engine):
    return {seed: _colour_answer(engine, seed) for seed in SEEDS}


def test_info_json_and_flag(engine):
    info = json.loads(INFO_FILE.read_text())
    assert isinstance(info["notes"], list) and info["notes"]
    assert "synthetic" in info["description"]
    assert set(info["test_accuracy"]) >= {"colour", "shape", "count", "position"}
    assert engine.loaded.vision_trained is True
    assert any("photograph" in n for n in engine.loaded.notes)


def _right(qa, text):
    return text.strip().lower().startswith(qa.answer)


def test_colour_answers_far_above_chance(answers):
    right = [seed for seed, (qa, text) in answers.items() if _right(qa, text)]
    detail = {seed: (qa.question, qa.answer, text) for seed, (qa, text) in answers.items()}
    assert len(right) >= MIN_CORRECT, detail

