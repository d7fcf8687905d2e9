"""What Qwen-VL's family module (`qwen_vl`) and its video module (`qwen_vl_video`) both read: the special tokens of
the prompt and the tiny test models' patch, merge and image pixel sizes."""
from __future__ import annotations

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

TINY_PATCH, TINY_MERGE = 8, 2
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 16 * 16, 64 * 64  # 1 to 16 merged tokens an image
