"""A method's knobs: declared once, as dataclass fields with their help text, choices and range.

    window: int = knob(8, help="observation window: last prompt queries that vote", low=1, high=1024,
                       integer=True)

The CLI, the app's Advanced section and the benchmarks read these declarations; the policy validates
itself against them when it is built (`validate_knobs`), so a bad value is refused with a message that
names the method, the knob and what it accepts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

KNOB = "knob"  # the dataclass field metadata key


class PolicyError(ValueError):
    """A bad method name or knob; the message lists what is accepted."""


@dataclass(frozen=True)
class KnobInfo:
    """What a knob accepts. Numbers: `low`/`high` bounds (inclusive unless `low_open`/`high_open`)."""

    help: str
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    sequence: bool = False  # a list of numbers (each within the bounds), e.g. calibrated per-layer ratios
    editable: bool = True  # offered as a widget in the app (False: set by code, e.g. by `resolve`)
    label: str | None = None  # display name; the field name when None
    # the knob's name for users (CLI, app, API, docs) when the field needs another one (a field may not share
    # the name of a policy method, e.g. PrefixKV's `decode` knob lives in the field `decode_rule`)
    name: str | None = None

    def accepted(self) -> str:
        """What the knob accepts, in words (used in error messages, the CLI and the app)."""
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        kind = "whole numbers" if self.integer and self.sequence else "numbers" if self.sequence else \
            "a whole number" if self.integer else "a number"
        if self.low is None and self.high is None:
            return kind
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '≥'} {_num(self.low)}"
        if self.low is None:
            return f"{kind} {'<' if self.high_open else '≤'} {_num(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"{kind} in {left}{_num(self.low)}, {_num(self.high)}{right}"

    def within(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        if self.high is not None and (x >= self.high if self.high_open else x > self.high):
            return False
        return True


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def knob(default: Any, *, help: str, choices: Sequence[Any] | None = None, low: float | None = None,
         high: float | None = None, low_open: bool = False, high_open: bool = False, integer: bool = False,
         sequence: bool = False, editable: bool = True, label: str | None = None, name: str | None = None) -> Any:
    """A policy field that is a user-facing knob (default, help text, accepted values)."""
    info = KnobInfo(help=help, choices=tuple(choices) if choices is not None else None, low=low, high=high,
                    low_open=low_open, high_open=high_open, integer=integer, sequence=sequence,
                    editable=editable, label=label, name=name)
    return dataclasses.field(default=default, metadata={KNOB: info})


def knob_fields(cls) -> list[tuple[str, Any, KnobInfo]]:
    """(name, default, info) of every knob of a policy class, in declaration order (the names users type)."""
    return [(f.metadata[KNOB].name or f.name, f.default, f.metadata[KNOB]) for f in dataclasses.fields(cls)
            if KNOB in f.metadata]


def knob_attributes(cls) -> dict[str, str]:
    """Knob name -> the dataclass field that holds it (the same, unless the knob declares its own name)."""
    return {f.metadata[KNOB].name or f.name: f.name for f in dataclasses.fields(cls) if KNOB in f.metadata}


def knob_value(policy, name: str) -> Any:
    """The value of knob `name` of a policy."""
    return getattr(policy, knob_attributes(type(policy))[name])


def check_value(method: str, name: str, default: Any, info: KnobInfo, value: Any) -> Any:
    """`value` checked against `info` -> the value to store (ints as ints, floats as floats, lists as tuples).
    Raises PolicyError naming the method, the knob and what it accepts."""

    def refuse() -> PolicyError:
        return PolicyError(f"{method} knob {name} must be {_expected(default, info)}; got {value!r}")

    if value is None:
        if default is None:
            return None
        raise refuse()
    if info.choices is not None:
        if isinstance(value, bool) or value not in info.choices:
            raise refuse()
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise refuse()
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise refuse()
        return value
    if info.sequence:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise refuse()
        return tuple(_number(x, info, refuse) for x in value)
    return _number(value, info, refuse)


def _number(x: Any, info: KnobInfo, refuse) -> int | float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise refuse()
    if info.integer:
        if isinstance(x, float) and not (math.isfinite(x) and x.is_integer()):
            raise refuse()
        x = int(x)
    else:
        x = float(x)
    if not info.within(float(x)):
        raise refuse()
    return x


def _expected(default: Any, info: KnobInfo) -> str:
    if isinstance(default, bool) and info.choices is None:
        return "true or false"
    return info.accepted()


def validate_knobs(policy) -> None:
    """Check every knob of a (frozen) policy and store the normalised values."""
    attributes = knob_attributes(type(policy))
    for name, default, info in knob_fields(type(policy)):
        attr = attributes[name]
        value = check_value(policy.label or policy.name, name, default, info, getattr(policy, attr))
        object.__setattr__(policy, attr, value)  # frozen: normalising during construction only
