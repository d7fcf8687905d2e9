"""A task's `generation_kwargs` (lmms-eval) as the engine's generation settings and stop strings."""
from __future__ import annotations

from typing import Any

from ..session.generation import GenerationSettings

DEFAULT_MAX_NEW_TOKENS = 256  # when a task sets none


def stop_strings(gen_kwargs: dict[str, Any]) -> list[str]:
    until = gen_kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def generation_settings(gen_kwargs: dict[str, Any], seed: int) -> GenerationSettings:
    """Sampling when do_sample is set or the temperature is above 0 (lmms-eval's convention), greedy otherwise;
    max_new_tokens as the task says."""
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    sample = bool(gen_kwargs.get("do_sample", False)) or temperature > 0
    top_p = gen_kwargs.get("top_p")
    settings = GenerationSettings(max_new_tokens=int(gen_kwargs.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                                  do_sample=sample, seed=seed)
    if sample and temperature > 0:
        settings.temperature = temperature
    if sample and top_p:
        settings.top_p = float(top_p)
    return settings
