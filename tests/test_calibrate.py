"""Offline PrefixKV calibration: files, interpolation, and the offline mode end to end."""
import json

import numpy as np
import pytest

from prefixkv_core import Engine, EngineError, GenerationSettings
from prefixkv_core.calibrate import CONFIG_ROOT, calibrate, load_ratios, rescale_to_budget, write_config


def test_shipped_embedded_configs_are_valid():
    folder = CONFIG_ROOT / "embedded-smollm2-135m"
    files = sorted(folder.glob("budget-*.json"))
    assert len(files) == 9
    for path in files:
        data = json.loads(path.read_text())
        assert len(data["ratios"]) == 30 and data["num_samples"] >= 10
        assert np.mean(data["ratios"]) == pytest.approx(data["budget"], abs=1e-4)
        assert max(data["ratios"]) - min(data["ratios"]) > 0.1  # layers really differ


def test_calibrate_writes_and_loads(tiny_llama, noise_image, tmp_path):
    engine = Engine(tiny_llama)
    samples = [(noise_image, "describe it"), (noise_image.rotate(90), "what colours are there")]
    found = calibrate(engine, samples, budgets=(0.2, 0.6), progress=False)
    for budget, result in found.items():
        assert np.mean(result["ratios"]) == pytest.approx(budget, abs=1e-6)
        write_config("tiny-llama", "tiny-llama", budget, result["ratios"], len(samples), root=tmp_path)
    exact = load_ratios("tiny-llama", 0.2, 4, root=tmp_path)
    assert exact.ratios == pytest.approx(found[0.2]["ratios"], abs=1e-5)
    between = load_ratios("tiny-llama", 0.4, 4, root=tmp_path)
    assert "interpolated" in between.source and np.mean(between.ratios) == pytest.approx(0.4, abs=1e-6)
    assert load_ratios("nobody", 0.4, 4, root=tmp_path) is None
    with pytest.raises(ValueError, match="layers"):
        load_ratios("tiny-llama", 0.2, 7, root=tmp_path)


def test_rescale_respects_bounds():
    r = rescale_to_budget(np.array([1.0, 0.9, 0.1, 0.1]), 0.8)
    assert max(r) <= 1.0 and np.mean(r) == pytest.approx(0.8, abs=1e-6)


def test_offline_mode_without_config_says_how_to_fix(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    with pytest.raises(EngineError, match="calibrate"):
        engine.new_session(noise_image, "hi there", ["prefixkv"], 0.3, knobs={"prefixkv": {"mode": "offline"}})
    session = engine.new_session(noise_image, "hi there", ["prefixkv"], 0.3, GenerationSettings(max_new_tokens=2),
                                 knobs={"prefixkv": {"mode": "offline", "ratios": [0.6, 0.2, 0.2, 0.2]}})
    events = [e for e in session.run() if getattr(e, "kind", None) == "done"]
    assert events and events[0].extras["mode"] == "offline"


def _image_key(ref: str, root) -> str:
    """A comparable name for an image reference: the scene seed, or the resolved file path."""
    from pathlib import Path

    if ref.startswith("scene:"):
        return f"scene:{int(ref[len('scene:'):])}"
    path = Path(ref)
    return str((path if path.is_absolute() else Path(root) / path).resolve())


def test_calibration_samples_are_disjoint_from_every_evaluation_set():
    from benchmarks.data import BUILTIN, dataset_spec, load_dataset
    from prefixkv_core.calibrate import ASSETS, default_samples
    from scenes import SPLITS

    # benchmarks/quality.py's default data and the built-in set: scene seeds and photo files
    data_path, root = dataset_spec("builtin")
    assert data_path == BUILTIN
    evaluated = {_image_key(s.image, root) for s in load_dataset(data_path) if s.image}
    # every shipped photo and example image counts as evaluation material too
    evaluated |= {str(p.resolve()) for p in (ASSETS / "images").iterdir()}
    shipped = sorted((CONFIG_ROOT / "embedded-smollm2-135m").glob("budget-*.json"))
    assert shipped
    for path in shipped:
        data = json.loads(path.read_text())
        samples = data["calibration_samples"]
        assert len(samples) == data["num_samples"] >= 10
        assert samples == default_samples(len(samples))  # the files say what the code calibrates on
        for sample in samples:
            ref = sample["image"]
            assert _image_key(ref, CONFIG_ROOT) not in evaluated, (path.name, ref)
            # benchmarks/vision_accuracy.py evaluates a prefix of the test or the val split
            seed = int(ref.split(":", 1)[1])
            assert seed in SPLITS["train"] and seed not in SPLITS["test"] and seed not in SPLITS["val"]


def test_default_samples_come_from_the_tail_of_the_train_split():
    from prefixkv_core.calibrate import default_samples, load_sample
    from scenes import SPLITS

    samples = default_samples(4)
    assert [s["image"] for s in samples] == [f"scene:{SPLITS['train'][-4 + i]}" for i in range(4)]
    image, prompt = load_sample(samples[0])
    assert image.size == (384, 384) and prompt == samples[0]["prompt"]
    with pytest.raises(ValueError):
        default_samples(0)
