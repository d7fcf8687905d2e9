"""A new method is one file plus one registration line: the CLI, the app (method list, Advanced knobs,
panels), the charts and the engine pick it up with nothing else edited."""
import dataclasses
import importlib.util
import sys

import pytest

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.policies import METHODS, REGISTRY, PolicyError, make_policy, parse_knobs, register, unregister

# The whole method, as a user would write it in its own file.
NEWEST_SOURCE = '''
"""Newest only: keep the first tokens and the most recent ones (a throwaway method for a test)."""
from dataclasses import dataclass, field

from prefixkv_core.policies.base import (Fact, LayerPlan, Policy, PolicyState, Prefilled, budget_count,
                                         drop_range_keep, knob)


@dataclass
class NewestState(PolicyState):
    dropped: list = field(default_factory=list)  # entries dropped per step


@dataclass(frozen=True)
class NewestPolicy(Policy):
    name = "newest"
    label = "Newest only"
    summary = "Keeps the first tokens and the newest ones; drops everything in between."
    colour = "#123456"

    keep_first: int = knob(1, help="leading tokens always kept", low=1, high=8, integer=True)

    def _plans(self, cache, true_len, state):
        target = budget_count(self.budget, true_len, min_keep=self.keep_first + 1)
        plans, dropped = [], 0
        for layer in cache.layers:
            excess = layer.length - target
            if excess <= 0:
                plans.append(None)
                continue
            dropped += excess
            plans.append(LayerPlan(keep=drop_range_keep(layer.length, self.keep_first, excess,
                                                        layer.positions.device)))
        state.dropped.append(dropped)
        return plans

    def prefill(self, view):
        state = NewestState()
        return Prefilled(self._plans(view.cache, view.prompt_len, state), state)

    def decode(self, view, state):
        return self._plans(view.cache, view.true_len, state)

    def facts(self, state):
        return [Fact("dropped", "entries dropped", sum(state.dropped), fmt="d")] + super().facts(state)
'''


@pytest.fixture
def newest(tmp_path):
    """Write the method to its own file, import it, register it (the one line); unregister afterwards."""
    path = tmp_path / "newest_policy.py"
    path.write_text(NEWEST_SOURCE)
    spec = importlib.util.spec_from_file_location("newest_policy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["newest_policy"] = module
    spec.loader.exec_module(module)
    register(module.NewestPolicy)
    try:
        yield module.NewestPolicy
    finally:
        unregister("newest")
        sys.modules.pop("newest_policy", None)
    assert "newest" not in METHODS


def test_registered_method_is_validated_from_its_declaration(newest):
    assert "newest" in METHODS and REGISTRY["newest"] is newest
    assert make_policy("newest", 0.3, **parse_knobs(["newest.keep_first=3"])["newest"]).keep_first == 3
    with pytest.raises(PolicyError, match=r"keep_first must be a whole number in \[1, 8\]"):
        make_policy("newest", 0.3, keep_first=0)
    clash = dataclasses.dataclass(frozen=True)(type("Clash", (newest,), {"colour": "#654321"}))
    with pytest.raises(PolicyError, match="already registered"):
        register(clash)
    with pytest.raises(PolicyError, match="frozen"):
        register(type("Loose", (newest,), {"name": "loose", "colour": "#654321"}))
    with pytest.raises(PolicyError, match="already used by newest"):
        register(dataclasses.dataclass(frozen=True)(type("Twin", (newest,), {"name": "twin"})))


def test_registered_method_appears_in_the_cli_listing(newest, capsys):
    from prefixkv_core.__main__ import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "newest     Newest only" in out and "colour #123456" in out
    assert "--knob newest.keep_first=1: leading tokens always kept (a whole number in [1, 8])" in out


def test_registered_method_runs_through_the_engine(newest, tiny_llama, noise_image):
    session = Engine(tiny_llama).new_session(noise_image, "Describe the picture.", ["full", "newest"], 0.3,
                                             GenerationSettings(max_new_tokens=4), {"newest": {"keep_first": 2}})
    events = [e for e in session.run() if getattr(e, "method", None) == "newest"]
    result = session.results()["newest"]
    assert result["error"] is None and events[-1].kind == "done"
    n = session.prefill.prompt_tokens
    assert result["kept_per_layer"] == [round(0.3 * result["full_len"])] * tiny_llama.num_layers
    assert result["extras"]["dropped"] > 0 and result["extras"]["facts"][0]["label"] == "entries dropped"
    for layer in session.states["newest"].cache.layers:  # the declared knob reached the policy
        assert layer.positions[0, 0, :2].tolist() == [0, 1] and int(layer.positions[0, 0, -1]) == n + 2


def test_registered_method_appears_in_the_app_and_its_charts(newest, tiny_llama, noise_image):
    from ui import charts
    from ui.app_builder import build_app
    from ui.controller import SessionBox
    from ui.theme import colour, css

    ctl = build_app(Engine(tiny_llama), max_new_tokens_limit=8).controller
    assert "newest" in ctl.methods and ctl.labels["newest"] == "Newest only"
    spec = next(s for s in ctl.knob_specs if s.key == "newest__keep_first")  # Advanced knobs
    widget = spec.widget()
    assert widget.label == "keep_first" and "leading tokens always kept" in widget.info
    assert (widget.minimum, widget.maximum) == (1, 8)

    box = SessionBox()
    outs = list(ctl.compare(noise_image, "Describe.", ["full", "newest"], 0.3, 4, box=box, newest__keep_first=2))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert final["results"]["methods"]["newest"]["status"] == "done"
    assert final["results"]["knobs"] == {"newest": {"keep_first": 2}}
    assert "Newest only" in final["head:newest"] and "entries dropped = " in final["head:newest"]

    assert colour("newest") == "#123456" and ".method-panel.m-newest" in css()
    bars = charts.retained_bars(box.run.latest(), budget=0.3)
    assert any(getattr(t.marker, "color", None) == "#123456" for t in bars.data)
