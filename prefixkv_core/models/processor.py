"""The LlavaProcessor of the models assembled here (tiny test models, the embedded model)."""
from __future__ import annotations

from .chat import IMAGE_TOKEN


def _pil_image_processor(size: int):
    """CLIP preprocessing (resize shortest edge, centre crop, CLIP mean/std) on the PIL backend.

    In transformers 5.x `CLIPImageProcessor` is the torchvision backend; the PIL one needs no torchvision.
    """
    try:
        from transformers import CLIPImageProcessorPil as _Cls
    except ImportError:  # pragma: no cover - older layouts
        from transformers import CLIPImageProcessor as _Cls
    return _Cls(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def make_processor(tokenizer, vision_config, chat_template: str):
    """Tokenizer + CLIP image preprocessing at the vision tower's resolution, `<image>` expanded per patch."""
    from transformers import LlavaProcessor

    return LlavaProcessor(
        image_processor=_pil_image_processor(int(vision_config.image_size)),
        tokenizer=tokenizer,
        patch_size=int(vision_config.patch_size),
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token, dropped again by the "default" strategy
        chat_template=chat_template,
        image_token=IMAGE_TOKEN,
    )
