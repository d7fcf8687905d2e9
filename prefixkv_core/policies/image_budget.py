"""What the budget r means to a method that drops image tokens (`budget_of`), shared by the prefill token reductions."""
from __future__ import annotations

BUDGET_OF = ("cache", "image")  # cache: r of the prompt's KV cache, as for every method; image: r of the image tokens


def fed_image_tokens(budget: float, budget_of: str, prompt_len: int, image_tokens: int) -> int:
    """Image tokens a vision-side reduction feeds the language model: `cache`, r·N minus the text; `image`, r of the
    image tokens."""
    if budget_of == "image":
        return int(round(budget * image_tokens))
    return int(round(budget * prompt_len)) - (prompt_len - image_tokens)
