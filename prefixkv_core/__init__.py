"""prefixkv_core: KV-cache compression methods for vision-language models, side by side.

The families it runs: LLaVA-1.5, LLaVA-Interleave, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL
and InternVL (`prefixkv_core.models.families`).

The engine never imports gradio. Typical use:

    from prefixkv_core import Engine, GenerationSettings, load_model
    engine = Engine(load_model("embedded"))
    session = engine.new_session(image, "Describe the image.", methods="all", budget=0.3)
    for event in session.run():
        ...
"""
from .session.engine import Engine, EngineError, GenerationSettings, Session
from .session.engine_process import EngineProcess, EngineProcessError, RemoteSession
from .report.events import MethodEvent, PrefillInfo
from .models import LoadedModel, ModelLoadError, load_model
from .policies import METHODS, PolicyError, describe, make_policy, resolve_methods

__all__ = ["Engine", "EngineError", "EngineProcess", "EngineProcessError", "RemoteSession", "GenerationSettings",
           "Session", "MethodEvent", "PrefillInfo", "LoadedModel",
           "ModelLoadError", "load_model", "METHODS", "PolicyError", "describe", "make_policy", "resolve_methods"]
