"""What the page offers, fixed for the server's life: the offered methods with their declarations and labels,
and the loaded model's facts (for the banner and every result record)."""
from __future__ import annotations

from typing import Any

from prefixkv_core import describe


class MethodCatalog:
    """The offered methods (registry order kept) and every registered method's declaration (`describe()`)."""

    def __init__(self, methods: list[str]):
        self.methods = list(methods)
        self.described = {d["name"]: d for d in describe()}
        self.labels = {m: self.described[m]["label"] for m in self.methods}

    def summary(self, method: str) -> str:
        """The method's stage (where it saves memory) and schedule (when), from its declaration."""
        d = self.described[method]
        return "no compression" if d["stage"] == "none" else f"{d['stage']} · {d['schedule']}"

    def shows_budget_note(self, method: str) -> bool:
        """Does the method's header speak of the budget? Not for one that compresses without it; a method
        that never compresses has no note either way."""
        d = self.described[method]
        return d["uses_budget"] or d["schedule"] == "none"


def model_facts(loaded) -> dict[str, Any]:
    """The loaded model as the banner and the result records describe it (plain values only)."""
    return {"name": loaded.name, "slug": loaded.slug, "device": str(loaded.device),
            "dtype": str(loaded.dtype).replace("torch.", ""), "num_layers": loaded.num_layers,
            "image_tokens": loaded.image_seq_length, "max_context": loaded.max_context,
            "vision_trained": loaded.vision_trained, "notes": list(loaded.notes)}
