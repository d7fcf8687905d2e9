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


# -- the LLaVA families' processors ------------------------------------------------------------------------------
# Image preprocessing as released (the PIL backends need no torchvision):
#   llava-1.5, llava-next: CLIP (resize the short side, centre crop, OpenAI CLIP mean/std, bicubic)
#   llava-interleave, llava-onevision: SigLIP (resize to the square, mean = std = 0.5, bicubic)
# llava-next / llava-onevision add their grid pinpoints (the model config's) for the high-resolution tiles.
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
BICUBIC = 3


def _siglip_image_processor(size: int):
    try:
        from transformers import SiglipImageProcessorPil as _Cls
    except ImportError:  # pragma: no cover - older layouts
        from transformers import SiglipImageProcessor as _Cls
    return _Cls(size={"height": size, "width": size}, image_mean=list(SIGLIP_MEAN), image_std=list(SIGLIP_STD),
                resample=BICUBIC, do_resize=True, do_rescale=True, do_normalize=True)


def image_only_onevision_processor_class():
    """LlavaOnevisionProcessor without its video processor.

    transformers builds a LlavaOnevisionProcessor only together with a video processor, which needs torchvision.
    The engine feeds images only, so the OneVision checkpoints load with this subclass, whose image and text
    handling is LlavaOnevisionProcessor's own."""
    from transformers import LlavaOnevisionProcessor

    class ImageOnlyOnevisionProcessor(LlavaOnevisionProcessor):
        def __init__(self, image_processor=None, tokenizer=None, num_image_tokens=None,
                     vision_feature_select_strategy=None, chat_template=None, image_token="<image>",
                     video_token="<video>", vision_aspect_ratio="anyres_max_9", **kwargs):
            # ProcessorMixin takes its parts from this signature: image_processor and tokenizer only
            LlavaOnevisionProcessor.__init__(
                self, image_processor, tokenizer, None, num_image_tokens=num_image_tokens,
                vision_feature_select_strategy=vision_feature_select_strategy, chat_template=chat_template,
                image_token=image_token, video_token=video_token, vision_aspect_ratio=vision_aspect_ratio)

    return ImageOnlyOnevisionProcessor


def attach_video_preprocessing(processor, config, source: str | None = None):
    """A model with a video path of its own (OneVision) gets its frames' preprocessing: the checkpoint's video
    processor where transformers can build it (torchvision present), else its settings for the PIL-backend
    steps of `video.video_pixels`. Returns the processor."""
    from .video import reads_video_natively, video_settings

    if not reads_video_natively(config) or getattr(config, "model_type", None) != "llava_onevision":
        return processor  # Qwen's: `family/qwen_vl.attach_video`
    if source is not None:
        try:
            from transformers import AutoVideoProcessor

            processor.video_processor = AutoVideoProcessor.from_pretrained(source)
            return processor
        except Exception:  # no torchvision (or no video processor saved): the same steps on the PIL backend
            pass
    processor.prefixkv_video_settings = video_settings(source, config)
    return processor


def family_processor(config, tokenizer, chat_template: str):
    """The processor of a LLaVA family model built in code, set up as the released checkpoint's (its vision
    tower's resolution and patch size, feature strategy, pinpoints); another family's from its module."""
    if config.model_type not in ("llava", "llava_next", "llava_onevision"):
        from .families import hooks_of

        return hooks_of(config).processor(config, tokenizer, chat_template)
    vc = config.vision_config
    size, patch = int(vc.image_size), int(vc.patch_size)
    strategy = config.vision_feature_select_strategy
    siglip = vc.model_type == "siglip_vision_model"
    if config.model_type == "llava":
        from transformers import LlavaProcessor

        image_processor = _siglip_image_processor(size) if siglip else _pil_image_processor(size)
        return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                              vision_feature_select_strategy=strategy,
                              num_additional_image_tokens=0 if siglip else 1,  # CLIP's CLS token
                              chat_template=chat_template, image_token=IMAGE_TOKEN)
    pins = [list(p) for p in config.image_grid_pinpoints]
    if config.model_type == "llava_next":
        from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

        image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": size},
                                                     crop_size={"height": size, "width": size},
                                                     image_grid_pinpoints=pins, resample=BICUBIC)
        return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                                  vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
                                  chat_template=chat_template, image_token=IMAGE_TOKEN)
    if config.model_type == "llava_onevision":
        from transformers import LlavaOnevisionImageProcessorPil

        image_processor = LlavaOnevisionImageProcessorPil(size={"height": size, "width": size},
                                                          image_grid_pinpoints=pins, resample=BICUBIC,
                                                          image_mean=list(SIGLIP_MEAN), image_std=list(SIGLIP_STD))
        return attach_video_preprocessing(image_only_onevision_processor_class()(
            image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=(size // patch) ** 2,
            vision_feature_select_strategy=strategy, chat_template=chat_template, image_token=IMAGE_TOKEN,
            vision_aspect_ratio=config.vision_aspect_ratio), config)
    raise ValueError(f"no processor for model_type {config.model_type!r}")
