"""What a method reports about one run (its chosen threshold, per-layer capacities, fallbacks), typed, so
listeners show and export them without knowing which method produced them.

Events carry facts in a JSON-able form (`facts_to_extras`): each fact's value under its key (the keys the
exports have always used: "threshold", "capacities", "mode", ...), notes under "notes", and the full list
under "facts" for display (`Fact.from_dict(d).text()`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Literal

FactKind = Literal["scalar", "per-layer", "note"]
KINDS: tuple[str, ...] = ("scalar", "per-layer", "note")


@dataclass(frozen=True)
class Fact:
    """One reported fact. `fmt` is a format spec for numbers (".3f", ".0%", "d"); `unit` follows the number."""

    key: str  # machine name, stable across releases (exports, the CLI's JSON)
    label: str  # what a reader sees
    value: Any  # a number or a string (scalar), a list of numbers (per-layer), a sentence (note)
    kind: FactKind = "scalar"
    fmt: str = ""
    unit: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fact kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def _number(self, x: Any) -> str:
        if isinstance(x, (int, float)) and not isinstance(x, bool) and self.fmt:
            return format(x, self.fmt)
        return str(x)

    def text(self) -> str:
        """One short phrase: "retention threshold p = 0.812", "capacity 8–120 entries over layers", or the note."""
        if self.kind == "note":
            return str(self.value)
        if self.kind == "per-layer":
            values = [v for v in self.value if isinstance(v, (int, float)) and math.isfinite(v)]
            if not values:
                return f"{self.label}: none"
            lo, hi = min(values), max(values)
            span = self._number(lo) if lo == hi else f"{self._number(lo)}–{self._number(hi)}"
            return f"{self.label} {span}{self.unit} over {len(self.value)} layers"
        if isinstance(self.value, str):
            return f"{self.label}: {self.value}"
        return f"{self.label} = {self._number(self.value)}{self.unit}"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if isinstance(self.value, tuple):
            d["value"] = list(self.value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Fact":
        return cls(key=str(d.get("key", "")), label=str(d.get("label", "")), value=d.get("value"),
                   kind=d.get("kind", "scalar"), fmt=str(d.get("fmt", "")), unit=str(d.get("unit", "")))


def note(text: str) -> Fact:
    return Fact("notes", "note", text, kind="note")


def facts_to_extras(facts: Iterable[Fact]) -> dict[str, Any]:
    """JSON-able extras for events and exports: {key: value, ..., "notes": [...], "facts": [...]}."""
    facts = list(facts)
    out: dict[str, Any] = {}
    for f in facts:
        if f.kind == "note":
            out.setdefault("notes", []).append(str(f.value))
        else:
            out[f.key] = list(f.value) if isinstance(f.value, tuple) else f.value
    if facts:
        out["facts"] = [f.as_dict() for f in facts]
    return out


def facts_from_extras(extras: dict[str, Any] | None) -> list[Fact]:
    """The facts an event carried (empty when it carried none)."""
    return [Fact.from_dict(d) for d in (extras or {}).get("facts", []) if isinstance(d, dict)]
