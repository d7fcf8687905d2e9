"""The registry of KV-cache policies. Adding a method = one new file + one line here."""
from __future__ import annotations

from typing import Any

from .base import DecodeView, LayerPlan, Merge, Policy, PolicyError, PrefillView, Quantise, check_budget
from .elastic import ElasticPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .local import LocalPolicy
from .lookm import LookMPolicy
from .prefixkv import PrefixKVPolicy
from .pyramidkv import PyramidKVPolicy
from .snapkv import SnapKVPolicy
from .zipvl import ZipVLPolicy

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FullPolicy, LocalPolicy, H2OPolicy, SnapKVPolicy, PyramidKVPolicy, ElasticPolicy, LookMPolicy,
                ZipVLPolicy, PrefixKVPolicy)
}
METHODS: tuple[str, ...] = tuple(REGISTRY)


def resolve_methods(names) -> list[str]:
    """'all', a comma-separated string or a list -> validated registry names (order kept, no duplicates)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names or [])
    if names == ["all"]:
        return list(METHODS)
    if not names:
        raise PolicyError(f"no method selected; choose from: {', '.join(METHODS)}")
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise PolicyError(f"unknown method(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(METHODS)} or 'all'")
    return list(dict.fromkeys(names))


def make_policy(name: str, budget: float, **knobs: Any) -> Policy:
    cls = REGISTRY.get(name)
    if cls is None:
        raise PolicyError(f"unknown method {name!r}; accepted: {', '.join(METHODS)}")
    check_budget(budget)
    allowed = cls.knobs()
    bad = [k for k in knobs if k not in allowed]
    if bad:
        raise PolicyError(f"{name} has no knob(s) {', '.join(bad)}; its knobs: {', '.join(allowed) or 'none'}")
    return cls(budget=budget, **knobs)


def parse_knobs(items) -> dict[str, dict[str, Any]]:
    """Command-line knobs, METHOD.KNOB=VALUE, -> {method: {knob: value}}; numbers and booleans parsed.

    Raises ValueError on an item without METHOD.KNOB=; make_policy later rejects unknown knobs."""
    knobs: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = str(item).partition("=")
        method, dot, name = key.partition(".")
        if not sep or not dot or not method or not name:
            raise ValueError(f"a knob is METHOD.KNOB=VALUE (e.g. snapkv.window=16), got {item!r}")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    continue
        knobs.setdefault(method, {})[name] = value
    return knobs


def describe() -> list[dict[str, Any]]:
    """Name, label, summary, schedule and knobs of every method (for the UI and `--help`)."""
    return [
        {"name": c.name, "label": c.label, "summary": c.summary, "schedule": c.schedule,
         "uses_budget": c.uses_budget, "knobs": c.knobs()}
        for c in REGISTRY.values()
    ]


__all__ = ["REGISTRY", "METHODS", "parse_knobs", "Policy", "PolicyError", "LayerPlan", "Merge", "Quantise", "PrefillView",
           "DecodeView", "make_policy", "resolve_methods", "describe"]
