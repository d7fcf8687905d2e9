"""Where the engine's shipped files are: the embedded model's trained vision and the calibrated PrefixKV ratios.

From a checkout they are the repository's `assets/`. A `pip install` of the repository copies the engine's share
of them (pyproject.toml's data files) to `<prefix>/share/prefixkv-lab/assets`, so an installed engine finds them
there."""
from __future__ import annotations

import sysconfig
from pathlib import Path

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"
INSTALLED_ASSETS = Path(sysconfig.get_paths()["data"]) / "share" / "prefixkv-lab" / "assets"


def assets_dir(checkout: Path = CHECKOUT_ASSETS, installed: Path = INSTALLED_ASSETS) -> Path:
    """The checkout's assets when the engine runs from one, else the installed copy (which may be absent: the
    callers then run without it, as they would without the files, and say so)."""
    if (checkout / "embedded_vision").is_dir() or not installed.is_dir():
        return checkout
    return installed


ASSETS = assets_dir()
