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
