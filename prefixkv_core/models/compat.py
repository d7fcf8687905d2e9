"""What differs between the transformers releases the package supports (see pyproject.toml's range).

transformers 5.24 renamed the forward argument `past_key_values` to `cache` (the old name warns on every call
and goes in 5.40); 5.23 knows only the old one. Every forward the engine and the benchmarks make passes its cache
through `cache_kwarg`, so one code path runs on every release in the range."""
from __future__ import annotations

from typing import Any

import transformers
from packaging.version import Version

# the name of the forward argument that carries the KV cache in the installed transformers
CACHE_ARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def cache_kwarg(cache: Any) -> dict[str, Any]:
    """`{CACHE_ARG: cache}`: splice into a model call, `model(input_ids=..., **cache_kwarg(cache))`."""
    return {CACHE_ARG: cache}
