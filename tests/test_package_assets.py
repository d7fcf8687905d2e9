"""The engine finds its shipped files from a checkout and from an installed copy (pyproject.toml's data files)."""
from __future__ import annotations

import tomllib
from pathlib import Path

from prefixkv_core.models.assets import CHECKOUT_ASSETS, assets_dir

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkout_uses_its_own_assets_even_when_an_installed_copy_exists(tmp_path):
    checkout, installed = tmp_path / "checkout", tmp_path / "installed"
    (checkout / "embedded_vision").mkdir(parents=True)
    (installed / "embedded_vision").mkdir(parents=True)
    assert assets_dir(checkout, installed) == checkout


def test_an_installed_engine_uses_the_installed_copy(tmp_path):
    installed = tmp_path / "share" / "prefixkv-lab" / "assets"
    (installed / "embedded_vision").mkdir(parents=True)
    assert assets_dir(tmp_path / "site-packages" / "assets", installed) == installed
    # neither there: the checkout's path, whose absence the callers report (untrained vision, no calibration)
    assert assets_dir(tmp_path / "nowhere", tmp_path / "absent") == tmp_path / "nowhere"


def test_the_data_files_carry_every_shipped_file_the_engine_reads():
    """Every file of the embedded vision and of the calibrated configurations is in pyproject.toml's data files,
    at the place `assets_dir` looks for it."""
    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    shipped = {}
    for dest, patterns in data_files.items():
        assert dest.startswith("share/prefixkv-lab/assets/")
        for pattern in patterns:
            for path in ROOT.glob(pattern):
                shipped[path.relative_to(ROOT / "assets")] = Path(dest).relative_to("share/prefixkv-lab/assets")
    needed = [p for folder in ("embedded_vision", "prefix_configs") for p in (CHECKOUT_ASSETS / folder).rglob("*")
              if p.is_file()]
    assert needed
    for path in needed:
        rel = path.relative_to(CHECKOUT_ASSETS)
        assert rel in shipped, f"{rel} is not shipped in pyproject.toml's data files"
        assert shipped[rel] == rel.parent, f"{rel} is installed under {shipped[rel]}, not {rel.parent}"
