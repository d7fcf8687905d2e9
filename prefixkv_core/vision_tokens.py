"""Vision-side token reduction: placeholder."""
from __future__ import annotations


def reduce_image(model, policy, ids, is_image, vision_inputs, image_token_id):
    return None
