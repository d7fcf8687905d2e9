"""Can the embedded language model answer the scene questions when it is *told* the scene in text?

    python -m training.text_ceiling --scenes 10 --context sentences

The image is replaced by a perfect text account of the scene (no vision involved), placed where the
image tokens would be, and the frozen SmolLM2-135M-Instruct answers each test-split question greedily.
This bounds what any vision tower + projector can reach while the language model stays frozen: the
image tokens can at best tell the model what the text tells it. Contexts:
  description  the generator's own description ("The image shows two shapes on ...")
  grid         one line per 3x3 cell ("top-left: small red square"), the word, the counts
  sentences    one sentence per question pattern ("The square on the left is red. ...")
Reports strict accuracy (the vision_accuracy rule: the answer first) and lenient accuracy (the
reference answer appears anywhere as whole words), per question type.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict

import torch
from tqdm import tqdm

from prefixkv_core.models import format_prompt, load_model
from scenes import PLURALS, REGION_PHRASES, REGIONS, Scene, render_scene, split_seeds
from scenes.grading import is_correct, normalise


def grid_text(scene: Scene) -> str:
    cells = {o.region: o for o in scene.objects}
    lines = [f"{r}: " + (f"{cells[r].size} {cells[r].colour} {cells[r].shape}" if r in cells else "empty")
             for r in REGIONS]
    if scene.word:
        lines.append(f"word at the {scene.word_region}: {scene.word}")
    counts = Counter(o.shape for o in scene.objects)
    lines.append(f"{len(scene.objects)} objects: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return "\n".join(lines)


def sentence_text(scene: Scene) -> str:
    out = [f"The {o.shape} {REGION_PHRASES[o.region]} is {o.colour}. The {o.colour} object is a {o.shape}."
           for o in scene.objects]
    out += [f"There are {n} {PLURALS[k]}." for k, n in Counter(o.shape for o in scene.objects).items()]
    out.append(f"There are {len(scene.objects)} objects.")
    if scene.word:
        out.append(f"The word is {scene.word}.")
    return " ".join(out)


CONTEXTS = {"description": lambda s: s.description, "grid": grid_text, "sentences": sentence_text}


def lenient(output: str, answer: str) -> bool:
    return f" {normalise(answer)} " in f" {normalise(output)} "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", type=int, default=10)
    ap.add_argument("--context", choices=sorted(CONTEXTS), default="sentences")
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model("embedded-base", device="cpu", dtype="float32")
    tok = loaded.tokenizer
    strict, loose = defaultdict(list), defaultdict(list)
    for seed in tqdm(split_seeds("test", args.scenes), desc="scenes", file=sys.stderr):
        scene = render_scene(seed)
        context = CONTEXTS[args.context](scene)
        for qa in scene.qa:
            text = format_prompt(loaded, f"{context}\n\n{qa.question}", with_image=False)
            ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                out = loaded.model.generate(input_ids=ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            strict[qa.qtype].append(is_correct(answer, qa.answer))
            loose[qa.qtype].append(lenient(answer, qa.answer))
    report = {kind: {t: f"{sum(v)}/{len(v)}" for t, v in res.items()} for kind, res in
              (("strict", strict), ("lenient", loose))}
    print(json.dumps({"context": args.context, "scenes": args.scenes, **report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
