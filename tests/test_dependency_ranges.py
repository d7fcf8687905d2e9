"""pyproject.toml's dependency ranges are the ones the tests cover: each starts at requirements.txt's pin (what
`make test` runs on) and is bounded above (`make wheel-check` installs both ends and runs them)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PINS = {m.group(1).lower(): Version(m.group(2)) for m in
        re.finditer(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", (ROOT / "requirements.txt").read_text(), re.M)}
REQUIREMENTS = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["app"]]


@pytest.mark.parametrize("req", REQUIREMENTS, ids=lambda r: r.name)
def test_each_range_starts_at_the_pin_and_is_bounded(req):
    pin = PINS.get(req.name.lower())
    assert pin is not None, f"{req.name} is not pinned in requirements.txt"
    lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert lower == [Version(pin.base_version)] or lower == [pin], f"{req}: its lowest version is not the pin {pin}"
    assert any(s.operator == "<" for s in req.specifier), f"{req}: no upper bound"
    assert req.specifier.contains(pin, prereleases=True)
