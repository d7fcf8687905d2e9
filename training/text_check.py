"""Does the language-model adapter keep SmolLM2's text ability? Perplexity on the built-in long text
(texts/long_text.py: the Python Language Reference the interpreter ships, also the quality benchmark's text
mode), base weights against base + adapter.

    python -m training.text_check --lora runs/emb/lora_C.safetensors --windows 16

The windows are the first `--windows` non-overlapping `--tokens`-token windows spread evenly over the text,
each scored as plain text (no chat template), every token after the first predicted. The issue this guards
against: an adapter trained only on scene questions drifting away from ordinary text, which would change
what the text-mode quality benchmark measures.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def windows(tokenizer, text: str, n: int, length: int) -> list[list[int]]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    step = max(length, (len(ids) - length) // max(1, n))
    return [ids[i:i + length] for i in range(0, len(ids) - length, step)][:n]


@torch.no_grad()
def perplexity(lm, batches: list[list[int]], bos: int | None) -> float:
    nll, count = 0.0, 0
    for ids in batches:
        x = torch.tensor([([bos] if bos is not None else []) + ids])
        logits = lm(input_ids=x).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return math.exp(nll / count)


def main(argv=None) -> int:
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prefixkv_core.models import EMBEDDED_LORA_FILE, embedded_lora_config
    from prefixkv_core.models.embedded import find_gguf
    from texts.long_text import builtin_long_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lora", default=str(EMBEDDED_LORA_FILE), help="adapter safetensors (default: the shipped one)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    gguf = find_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    data = windows(tok, builtin_long_text().text, args.windows, args.tokens)
    base = perplexity(lm, data, tok.bos_token_id)
    state = {k: v.float() for k, v in load_file(args.lora).items()}
    rank = next(v.shape[0] for k, v in state.items() if ".lora_A." in k)
    peft_model = get_peft_model(lm.model, embedded_lora_config(rank))
    set_peft_model_state_dict(peft_model, state)
    lm.model = peft_model.merge_and_unload()
    adapted = perplexity(lm.eval(), data, tok.bos_token_id)
    res = {"windows": len(data), "tokens": args.tokens, "ppl_base": round(base, 3), "ppl_adapted": round(adapted, 3),
           "ratio": round(adapted / base, 4), "lora": Path(args.lora).name, "seconds": round(time.time() - t0, 1)}
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
