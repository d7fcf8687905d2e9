"""The registry of KV-cache policies. Adding a built-in method = one new file in this package (its policy class:
knobs, colour, facts), found and registered here; from outside the package, a call to `register`."""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .adakv import AdaKVPolicy
from .base import (BUDGET_MODES, ROLES, STAGES, DecodeView, LayerPlan, Merge, Policy, PolicyError, PolicyState, Prefilled,
                   PrefillView, Quantise, ResolveContext)
from .budget import Budget, check_budget
from .downsample import DownsamplePolicy
from .dart import DARTPolicy
from .elastic import ElasticPolicy
from .equal_memory import EqualMemoryHold, hold_for
from .fastv import FastVPolicy
from .facts import Fact, facts_from_extras, facts_to_extras
from .full import FullPolicy
from .h2o import H2OPolicy
from .knobs import KnobInfo, knob, knob_attributes, knob_fields, knob_value
from .local import LocalPolicy
from .lookm import LookMPolicy
from .prefixkv import PrefixKVPolicy
from .pyramidkv import PyramidKVPolicy
from .random_drop import RandomDropPolicy
from .random_pruning import RandomPolicy
from .scored import ScoredPolicy
from .snapkv import SnapKVPolicy
from .visionzip import VisionZipPolicy
from .vlcache import VLCachePolicy
from .zipvl import ZipVLPolicy

REGISTRY: dict[str, type[Policy]] = {}
_NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")  # used in CSS classes and `<method>__<knob>` API names
_COLOUR = re.compile(r"^#[0-9A-Fa-f]{6}$")


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class to the registry (every listener reads it: engine, CLI, app, charts, benchmarks).
    Checks what listeners rely on: a frozen dataclass, a unique lowercase name, a label, a summary, a colour and
    a stage (one of STAGES)."""
    import dataclasses

    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"{cls!r} is not a Policy subclass")
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__dataclass_fields__" not in vars(cls):
        raise PolicyError(f"{cls.__name__} must be declared with @dataclass(frozen=True)")
    if not _NAME.match(cls.name or ""):
        raise PolicyError(f"{cls.__name__}.name must be lowercase letters/digits with single underscores, "
                          f"got {cls.name!r}")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise PolicyError(f"a method named {cls.name!r} is already registered ({REGISTRY[cls.name].__name__})")
    if not cls.label or not cls.summary:
        raise PolicyError(f"{cls.__name__} needs a label and a summary")
    if not _COLOUR.match(cls.colour or ""):
        raise PolicyError(f"{cls.__name__}.colour must be '#rrggbb', got {cls.colour!r}")
    if cls.stage not in STAGES:
        raise PolicyError(f"{cls.__name__}.stage must be one of {', '.join(map(repr, STAGES))}, got {cls.stage!r}")
    for role in cls.roles:
        if role not in ROLES:
            raise PolicyError(f"{cls.__name__}.roles: {role!r} is not one of {', '.join(map(repr, ROLES))}")
        holder = role_method(role)
        if holder is not None and holder != cls.name:
            raise PolicyError(f"{cls.__name__} plays the {role!r} role, which {holder} already plays")
    knobs = {name: info for name, _, info in knob_fields(cls)}
    for flag_knob in cls.flag_knobs:
        choices = knobs[flag_knob].choices if flag_knob in knobs else None
        if not choices or not all(isinstance(c, str) for c in choices):
            raise PolicyError(f"{cls.__name__}.flag_knobs: {flag_knob!r} is not one of its knobs with named choices")
    taken = {c.colour.lower(): n for n, c in REGISTRY.items() if n != cls.name}
    if cls.colour.lower() in taken:
        raise PolicyError(f"{cls.__name__}.colour {cls.colour} is already used by {taken[cls.colour.lower()]}")
    dataclasses.fields(cls)  # a dataclass: its knobs can be read
    REGISTRY[cls.name] = cls
    return cls


def role_method(role: str) -> str | None:
    """The registered method that plays `role` (one of ROLES), or None."""
    if role not in ROLES:
        raise PolicyError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    return next((name for name, cls in REGISTRY.items() if role in cls.roles), None)


def role_label(role: str, default: str | None = None) -> str | None:
    """The label of the method that plays `role` (e.g. "Full" for "reference"), for headers and captions that
    name it; `default` when no registered method plays it."""
    name = role_method(role)
    return REGISTRY[name].label if name is not None else default


def role_methods() -> dict[str, str]:
    """role -> the method that plays it, for every role some registered method plays."""
    return {role: name for role in ROLES if (name := role_method(role)) is not None}


def unregister(name: str) -> None:
    """Remove a method added with `register` (built-in methods stay)."""
    if name in _BUILT_IN_NAMES:
        raise PolicyError(f"{name!r} is a built-in method and cannot be removed")
    REGISTRY.pop(name, None)


# The order the methods are listed in (the app's checkboxes, tables, exports); a method not named here follows them,
# by name: a new built-in method needs no line anywhere but its own file.
_LISTED_FIRST = ("full", "local", "h2o", "snapkv", "adakv", "pyramidkv", "elastic", "lookm", "zipvl", "fastv",
                 "visionzip", "prefixkv", "random", "downsample", "dart", "vlcache", "random_drop")


def _built_in() -> list[type[Policy]]:
    """Every method defined in this package: each module's own Policy subclasses that carry a name (bases such
    as `scored.ScoredPolicy` carry none), listed as `_LISTED_FIRST` says."""
    import importlib
    import pkgutil

    found: dict[str, type[Policy]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Policy) and obj.__module__ == module.__name__ \
                    and "name" in vars(obj) and obj.name:
                found[obj.name] = obj
    order = {name: i for i, name in enumerate(_LISTED_FIRST)}
    return [found[n] for n in sorted(found, key=lambda n: (order.get(n, len(order)), n))]


_BUILT_IN = tuple(_built_in())
for _cls in _BUILT_IN:
    register(_cls)
_BUILT_IN_NAMES = frozenset(c.name for c in _BUILT_IN)


class _MethodNames(Sequence):
    """The registered method names, in registration order; always current (methods may be registered later)."""

    def __getitem__(self, i):
        return tuple(REGISTRY)[i]

    def __len__(self) -> int:
        return len(REGISTRY)

    def __iter__(self):
        return iter(tuple(REGISTRY))

    def __contains__(self, name) -> bool:
        return name in REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(REGISTRY))


METHODS: Sequence[str] = _MethodNames()


def method_colours() -> dict[str, str]:
    """Method name -> its '#rrggbb' colour, for every registered method."""
    return {name: cls.colour for name, cls in REGISTRY.items()}


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


def make_policy(name: str, budget: Budget | float, budget_mode: str = "published", **knobs: Any) -> Policy:
    """Build a validated policy. Unknown knobs and values out of range raise PolicyError with what is accepted.
    `budget_mode`: one of BUDGET_MODES, how the comparison treats memory (not a knob of the method). A plain
    number is checked as the policy is built (it becomes a `Budget`)."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise PolicyError(f"unknown method {name!r}; accepted: {', '.join(METHODS)}")
    allowed = knob_attributes(cls)
    bad = [k for k in knobs if k not in allowed]
    if bad:
        raise PolicyError(f"{name} has no knob(s) {', '.join(bad)}; its knobs: {', '.join(allowed) or 'none'}")
    return hold_for(cls(budget=budget, **{allowed[k]: v for k, v in knobs.items()}), budget_mode)


def held_in_equal_memory(method: str, budget_mode: str, knobs: dict | None = None) -> bool:
    """Whether a comparison in `budget_mode` holds the registered `method` (with `knobs`: method -> knob -> value)
    at r·N_t: a prompt-only method in equal-memory mode; PrefixKV with decode = grow too."""
    if budget_mode != "equal_memory" or method not in REGISTRY:
        return False
    try:
        return isinstance(make_policy(method, 0.5, budget_mode, **(knobs or {}).get(method, {})), EqualMemoryHold)
    except (PolicyError, TypeError):
        return REGISTRY[method].uses_budget and REGISTRY[method].schedule == "prompt only"


def parse_knobs(items) -> dict[str, dict[str, Any]]:
    """Command-line knobs, METHOD.KNOB=VALUE, -> {method: {knob: value}}; numbers, booleans and
    comma-separated lists of numbers (e.g. prefixkv.ratios=0.5,0.3,0.2) parsed.

    Raises ValueError on an item without METHOD.KNOB=; make_policy later rejects unknown knobs."""
    knobs: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = str(item).partition("=")
        method, dot, name = key.partition(".")
        if not sep or not dot or not method or not name:
            raise ValueError(f"a knob is METHOD.KNOB=VALUE (e.g. snapkv.window=16), got {item!r}")
        if raw.lower() in ("true", "false"):
            value: Any = raw.lower() == "true"
        elif "," in raw:
            parts = [_number(x.strip()) for x in raw.split(",")]
            value = parts if all(not isinstance(x, str) for x in parts) else raw
        else:
            value = _number(raw)
        knobs.setdefault(method, {})[name] = value
    return knobs


def _number(raw: str) -> Any:
    """'16' -> 16, '0.9' -> 0.9, anything else stays text."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            continue
    return raw


DRAW_MARK = "~"  # a row's name for another draw of a control: "random~2" is Random's third draw (draw 0 is "random")
MAX_DRAWS = 64  # the most draws of a control one comparison runs


def draw_row(method: str, draw: int) -> str:
    """The row name of a method's `draw`-th draw (0: the method's own name)."""
    return method if draw == 0 else f"{method}{DRAW_MARK}{draw}"


def split_draw(row: str) -> tuple[str, int]:
    """A row name -> (method, draw): "random~2" -> ("random", 2), "h2o" -> ("h2o", 0)."""
    method, mark, draw = row.rpartition(DRAW_MARK)
    if mark and method and draw.isdigit():
        return method, int(draw)
    return row, 0


def row_label(row: str, policy: Policy) -> str:
    """What a row is called in records and tables: its method's label, and which draw it is when not the first."""
    draw = split_draw(row)[1]
    return policy.label if draw == 0 else f"{policy.label} (draw {draw + 1})"


def describe() -> list[dict[str, Any]]:
    """Name, label, summary, schedule, stage, colour, whether the budget applies, and knobs (defaults and details:
    help, choices, range) of every method, in registry order (for the UI, the CLI and the benchmarks)."""
    return [cls.describe() for cls in REGISTRY.values()]


__all__ = ["ScoredPolicy", "EqualMemoryHold", "held_in_equal_memory", "BUDGET_MODES", "STAGES", "ROLES", "role_method", "role_methods", "role_label", "REGISTRY", "METHODS", "register", "unregister", "method_colours", "parse_knobs", "Policy",
           "PolicyError", "PolicyState", "Prefilled", "ResolveContext", "LayerPlan", "Merge", "Quantise", "PrefillView",
           "DecodeView", "Fact", "facts_to_extras", "facts_from_extras", "KnobInfo", "knob", "knob_value",
           "make_policy", "resolve_methods", "describe", "Budget", "check_budget", "DRAW_MARK", "MAX_DRAWS", "draw_row",
           "split_draw", "row_label"]
