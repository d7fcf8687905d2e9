"""The built-in long text: the Python Language Reference that every CPython ships as `pydoc_data.topics` (the
pages `help()` shows), about 465,000 characters of English technical prose with some code and grammar, licensed
with Python's documentation under the PSF License Version 2. It is read from the interpreter, not copied into
this repository, so it needs no download; its exact text follows the Python version (runs record its digest).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LongText:
    text: str
    source: str  # for tables and notes
    path: Path | None  # the file read; None for the built-in text


def builtin_long_text() -> LongText:
    import platform

    from pydoc_data.topics import topics

    text = "\n\n".join(page.strip("\n") for page in topics.values()) + "\n"
    return LongText(text, f"the Python {platform.python_version()} Language Reference (pydoc_data.topics, "
                          "PSF License Version 2)", None)
