"""Ordinary English text for keeping the language model's text ability while the adapter learns scenes.

The docstrings of a fixed list of standard-library modules (the module's own, then its public classes and
functions'): prose the interpreter ships, so no download, and disjoint from the benchmarks' built-in long
text (the Language Reference in pydoc_data), on which text_check.py measures the cost.
"""
from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "http.server",
    "imaplib", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "mimetypes", "multiprocessing",
    "numbers", "operator", "optparse", "os", "pathlib", "pickle", "platform", "pprint", "queue", "random", "re",
    "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "sqlite3", "ssl", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "wave", "xml.dom.minidom", "zipfile", "zoneinfo",
)


def _docs(module) -> list[str]:
    out = [inspect.getdoc(module) or ""]
    for name in sorted(getattr(module, "__all__", None) or dir(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == module.__name__:
            out.append(inspect.getdoc(obj) or "")
    return [d for d in out if len(d) > 200]  # one-liners are signatures, not prose


@lru_cache(maxsize=1)
def corpus() -> str:
    parts: list[str] = []
    for name in MODULES:
        try:
            parts += _docs(importlib.import_module(name))
        except Exception:  # noqa: BLE001 - a module missing on some platform only shortens the corpus
            continue
    return "\n\n".join(parts)


def windows(tokenizer, length: int) -> list[list[int]]:
    """The corpus as consecutive windows of `length` token ids."""
    ids: list[int] = []
    for doc in corpus().split("\n\n"):  # piecewise: one call over the whole corpus exceeds the model's context
        ids += tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"]
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
