"""Where a result came from: the checkout's commit, recorded beside benchmark, training and evaluation results."""
from __future__ import annotations

import subprocess
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = CHECKOUT, short: bool = True) -> str:
    """The commit of the checkout at `root` (short, or the full hash), with '+dirty' when tracked files differ
    from it; 'unknown' outside git (an installed copy)."""
    rev_args = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        rev = subprocess.run(rev_args, cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev + ("+dirty" if dirty else "")) if rev else "unknown"
