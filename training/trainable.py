"""The parts of the embedded model that training changes, shared by every stage and the export: the vision
tower + projector (their patch features, their weights under the loader's keys) and the LoRA adapter on the
language model."""
from __future__ import annotations

import torch

VISION_PARTS = ("vision_tower", "multi_modal_projector")


def patch_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """The features LlavaModel feeds the projector (vision_feature_layer=-1, 'default' drops CLS)."""
    out = model.model.vision_tower(pixel_values=pixel_values, output_hidden_states=True)
    return out.hidden_states[model.config.vision_feature_layer][:, 1:]


def vision_state(model) -> dict[str, torch.Tensor]:
    """Vision tower + projector weights under the keys the loader expects (no leading 'model.')."""
    out = {}
    for name in VISION_PARTS:
        for k, v in getattr(model.model, name).state_dict().items():
            out[f"{name}.{k}"] = v.detach().clone()
    return out


def load_vision_state(model, state: dict[str, torch.Tensor]) -> None:
    for name in VISION_PARTS:
        sub = {k[len(name) + 1:]: v.float() for k, v in state.items() if k.startswith(name + ".")}
        if sub:
            getattr(model.model, name).load_state_dict(sub, strict=True)


def add_lora(model, rank: int):
    """LoRA adapters (peft) on every linear layer of the language model's decoder, in place; the base
    weights stay frozen and are never saved. Returns the PeftModel (for its adapter state dict)."""
    from peft import get_peft_model

    from prefixkv_core.models import embedded_lora_config

    return get_peft_model(model.model.language_model, embedded_lora_config(rank))


def lora_state(peft_model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
