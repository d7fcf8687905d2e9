"""Evaluation data: a loader for LLaVA-Description / MM-Vet style files and the built-in set.

Accepted files (`.jsonl`: one record per line; `.json`: a list of records or an object of id -> record):

* flat (MM-Vet style): ``{"id", "image", "question", "answer"}``; aliases ``imagename``/``image_path`` for
  the image, ``prompt``/``instruction`` for the question, ``reference``/``gpt_answer``/``caption`` for the answer.
* conversation (LLaVA style): ``{"id", "image", "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}]}``; the first human/gpt pair is used, the ``<image>`` tag is removed.

``image`` is a path relative to the image root (default: the data file's folder), an absolute path,
``scene:<seed>`` (rendered on the fly by ``scenes.render_scene``) or empty (text only).

The built-in set (``benchmarks/data/builtin.jsonl``, 45 samples, no download) is written by
``python benchmarks/data.py --write``: 20 rendered test-split scenes described in detail, 15 rendered scenes
with one short question each, and the five example photographs in ``assets/images`` with hand-written
descriptions and one question each. Records are interleaved by kind so any prefix (``--limit``) mixes them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image, UnidentifiedImageError  # noqa: E402

from texts.long_text import LongText, builtin_long_text  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = DATA_DIR / "builtin.jsonl"
DESCRIBE = "Describe the image in detail."
SCENE_PREFIX = "scene:"
SCENE_SIZE = 384

IMAGE_KEYS = ("image", "imagename", "image_path", "img")
QUESTION_KEYS = ("question", "prompt", "instruction")
ANSWER_KEYS = ("answer", "reference", "gpt_answer", "caption")


class DataError(ValueError):
    """A data file or record that cannot be read; the message names the file, the record and the fix."""


@dataclass
class Sample:
    id: str
    image: str | None  # reference as written in the file
    question: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "image": self.image, "question": self.question, "answer": self.answer, **self.extra}


def _strip_image_tag(text: str) -> str:
    return text.replace("<image>\n", "").replace("\n<image>", "").replace("<image>", "").strip()


def parse_record(raw: dict[str, Any], where: str) -> Sample:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    image = next((raw[k] for k in IMAGE_KEYS if raw.get(k)), None)
    if "conversations" in raw:
        conv = raw["conversations"]
        if not isinstance(conv, list):
            raise DataError(f"{where}: 'conversations' must be a list of {{from, value}} turns")
        human = next((t.get("value", "") for t in conv if isinstance(t, dict) and t.get("from") in ("human", "user")),
                     None)
        gpt = next((t.get("value", "") for t in conv if isinstance(t, dict) and t.get("from") in ("gpt", "assistant")),
                   None)
        if human is None or gpt is None:
            raise DataError(f"{where}: 'conversations' needs a human turn and a gpt turn")
        question, answer = _strip_image_tag(human), str(gpt).strip()
    else:
        question = next((raw[k] for k in QUESTION_KEYS if raw.get(k)), None)
        answer = next((raw[k] for k in ANSWER_KEYS if raw.get(k)), None)
        if question is None or answer is None:
            raise DataError(f"{where}: needs 'question' and 'answer' (flat format) or 'conversations' "
                            f"(LLaVA format); keys found: {', '.join(sorted(raw)) or 'none'}")
        question, answer = _strip_image_tag(str(question)), str(answer).strip()
    if not question or not answer:
        raise DataError(f"{where}: empty question or answer")
    known = set(IMAGE_KEYS) | set(QUESTION_KEYS) | set(ANSWER_KEYS) | {"id", "conversations"}
    extra = {k: v for k, v in raw.items() if k not in known and isinstance(v, (str, int, float, bool))}
    return Sample(id=str(raw.get("id", "")), image=str(image) if image else None, question=question,
                  answer=answer, extra=extra)


def load_dataset(path: str | Path, limit: int | None = None) -> list[Sample]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (use 'builtin' for the built-in set)")
    text = path.read_text()
    raws: list[tuple[str, Any]] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raws.append((f"{path.name}:{i}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path.name}:{i}: not valid JSON ({exc.msg})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path.name}: not valid JSON ({exc.msg}); use .jsonl for one record per line") from None
        if isinstance(data, dict):  # MM-Vet: {"v1_0": {...}, ...}
            data = [dict(v, id=v.get("id", k)) if isinstance(v, dict) else v for k, v in data.items()]
        if not isinstance(data, list):
            raise DataError(f"{path.name}: expected a list of records or an object of id -> record")
        raws = [(f"{path.name}[{i}]", r) for i, r in enumerate(data)]
    samples = []
    seen: set[str] = set()
    for i, (where, raw) in enumerate(raws):
        s = parse_record(raw, where)
        if not s.id:
            s.id = f"{path.stem}-{i}"
        if s.id in seen:
            raise DataError(f"{where}: duplicate id {s.id!r}; ids must be unique (they key the resumable records)")
        seen.add(s.id)
        samples.append(s)
    if not samples:
        raise DataError(f"{path.name}: no records")
    return samples[:limit] if limit else samples


@lru_cache(maxsize=64)
def _scene_image(seed: int) -> Image.Image:
    from scenes import render_scene

    return render_scene(seed, SCENE_SIZE).image


def resolve_image(ref: str | None, root: str | Path) -> Image.Image | None:
    """An image reference from a data file -> an RGB PIL image (None for text-only samples)."""
    if not ref:
        return None
    if ref.startswith(SCENE_PREFIX):
        try:
            seed = int(ref[len(SCENE_PREFIX):])
        except ValueError:
            raise DataError(f"bad scene reference {ref!r}; expected scene:<integer seed>") from None
        return _scene_image(seed)
    path = Path(ref)
    if not path.is_absolute():
        path = Path(root) / path
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"image {ref!r} not found under {root} (set --image-root)") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"image {path} is not readable ({exc.__class__.__name__})") from None


def dataset_spec(spec: str) -> tuple[Path, Path]:
    """'builtin' or a file path -> (data file, default image root)."""
    path = BUILTIN if spec == "builtin" else Path(spec)
    return path, path.resolve().parent


# -- the built-in set ------------------------------------------------------------------------------------------

# Hand-written reference answers for the example photographs (assets/images, licences in LICENSES.md).
PHOTOS = [
    {
        "file": "chelsea.jpg",
        "description": "A close-up of a tabby cat's face. The cat has large yellow-green eyes, brown and grey "
                       "striped fur, a pink-orange nose and long white whiskers, and it looks slightly to the "
                       "right of the camera. The background is soft and out of focus.",
        "question": "What animal is shown in the photo?",
        "answer": "A cat.",
    },
    {
        "file": "astronaut.jpg",
        "description": "A portrait of a smiling astronaut with short brown hair wearing an orange flight suit "
                       "with mission patches and a name tag. A white helmet with a dark visor is in the "
                       "bottom-right corner, an American flag hangs on the left and a model of the Space "
                       "Shuttle stands on the right in front of a grey background.",
        "question": "What colour is the astronaut's suit?",
        "answer": "Orange.",
    },
    {
        "file": "coffee.jpg",
        "description": "A cup of espresso seen from above at an angle. The small cup is white inside and red "
                       "outside, the coffee has a light brown crema, and the cup stands on a matching red "
                       "saucer with a silver teaspoon. Everything rests on a worn wooden table.",
        "question": "What drink is in the cup?",
        "answer": "Espresso coffee.",
    },
    {
        "file": "rocket.jpg",
        "description": "A tall white rocket stands on its launch pad at dusk under a deep blue sky. It is "
                       "flanked by tall steel lattice towers, and bright lights around the base of the pad "
                       "shine like small stars.",
        "question": "When was this photo taken: during the day or at dusk?",
        "answer": "At dusk.",
    },
    {
        "file": "retina.jpg",
        "description": "A medical photograph of the back of a human eye. The round retina is orange-red on a "
                       "black background, the bright yellowish optic disc is on the left, and dark red blood "
                       "vessels branch out from it across the retina. A darker spot, the macula, is near the "
                       "centre.",
        "question": "What kind of image is this?",
        "answer": "A photograph of the retina at the back of an eye.",
    },
]
N_SCENE_DESCRIPTIONS = 20
N_SCENE_QA = 15


def build_builtin() -> list[dict[str, Any]]:
    """The built-in records, in file order (deterministic: same seeds, same text)."""
    from scenes import scene_samples

    photo_root = "../../assets/images"  # relative to benchmarks/data/
    groups: list[list[dict[str, Any]]] = [[], [], [], []]
    scenes = list(scene_samples("test", N_SCENE_DESCRIPTIONS + N_SCENE_QA, size=SCENE_SIZE, per_scene=1))
    for rec in scenes[:N_SCENE_DESCRIPTIONS]:
        groups[0].append({"id": f"scene-{rec['seed']}-describe", "image": f"{SCENE_PREFIX}{rec['seed']}",
                          "question": DESCRIBE, "answer": rec["description"], "kind": "scene-description"})
    for rec in scenes[N_SCENE_DESCRIPTIONS:]:
        groups[1].append({"id": f"scene-{rec['seed']}-{rec['qtype']}", "image": f"{SCENE_PREFIX}{rec['seed']}",
                          "question": rec["question"], "answer": rec["answer"], "kind": f"scene-qa-{rec['qtype']}"})
    for p in PHOTOS:
        stem = p["file"].rsplit(".", 1)[0]
        groups[2].append({"id": f"photo-{stem}-describe", "image": f"{photo_root}/{p['file']}", "question": DESCRIBE,
                          "answer": p["description"], "kind": "photo-description"})
        groups[3].append({"id": f"photo-{stem}-qa", "image": f"{photo_root}/{p['file']}", "question": p["question"],
                          "answer": p["answer"], "kind": "photo-qa"})
    out: list[dict[str, Any]] = []
    while any(groups):
        for g in groups:
            if g:
                out.append(g.pop(0))
    return out


def builtin_text() -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build_builtin())


# -- long-context text -----------------------------------------------------------------------------------------
# The text mode of benchmarks/quality.py cuts (context, continuation) pairs from one long plain text. The built-in
# text, the Python Language Reference read from the interpreter, lives in texts/long_text.py (the training's
# text check reads it too).

BUILTIN_TEXT = "builtin"
CUT_SLACK = 32  # a window may move this many tokens forward to find cuts that re-tokenize exactly


def load_long_text(spec: str) -> LongText:
    """'builtin' or a UTF-8 plain-text file."""
    if spec == BUILTIN_TEXT:
        return builtin_long_text()
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"text file {path} does not exist (use 'builtin' for the built-in text)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path.name} is not UTF-8 text (byte {exc.start}); pass a plain-text file") from None
    if not text.strip():
        raise DataError(f"{path.name} is empty")
    return LongText(text, path.name, path)


def _round_trips(tokenizer, ids: list[int]) -> bool:
    """Decoding `ids` and encoding the text again gives `ids` back (no split word, no split UTF-8 byte)."""
    return tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids


def cut_text_pairs(tokenizer, text: str, context_tokens: int, continuation_tokens: int, pairs: int) -> list[Sample]:
    """`pairs` non-overlapping windows spread evenly over `text`, each cut into a context of `context_tokens`
    tokens (the sample's question) and the `continuation_tokens` tokens that follow it (the answer).

    Both pieces are fed as separate texts, so a window moves forward (at most CUT_SLACK tokens) until each piece
    encodes back to exactly its own tokens: context then continuation is then the text's own token sequence.
    Where no such place exists the window stays and `exact` is False in the sample's extras."""
    if context_tokens < 1 or continuation_tokens < 1 or pairs < 1:
        raise DataError("context tokens, continuation tokens and pairs must each be at least 1")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # longer than any context: no warning
    span = context_tokens + continuation_tokens
    step = span + CUT_SLACK
    if pairs * step > len(ids):
        raise DataError(f"the text has {len(ids)} tokens: room for {len(ids) // step} pairs of {context_tokens} + "
                        f"{continuation_tokens} tokens, not {pairs}; use a longer text, fewer pairs or shorter "
                        "pieces")
    stride = (len(ids) - step) // (pairs - 1) if pairs > 1 else 0
    samples = []
    for k in range(pairs):
        base = k * stride
        start, exact = base, False
        for s in range(base, base + CUT_SLACK + 1):
            if _round_trips(tokenizer, ids[s:s + context_tokens]) and \
                    _round_trips(tokenizer, ids[s + context_tokens:s + span]):
                start, exact = s, True
                break
        context = tokenizer.decode(ids[start:start + context_tokens])
        continuation = tokenizer.decode(ids[start + context_tokens:start + span])
        samples.append(Sample(id=f"text-{start}", image=None, question=context, answer=continuation,
                              extra={"kind": "text", "start_token": start, "context_tokens": context_tokens,
                                     "continuation_tokens": continuation_tokens, "exact": exact}))
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write or check the built-in evaluation set "
                                            f"({BUILTIN.relative_to(BUILTIN.parent.parent.parent)}).")
    p.add_argument("--write", action="store_true", help="(re)write builtin.jsonl from the generator")
    p.add_argument("--check", action="store_true", help="exit 1 if builtin.jsonl differs from the generator")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print the first N records")
    args = p.parse_args(argv)
    text = builtin_text()
    if args.write:
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        BUILTIN.write_text(text)
        print(f"wrote {BUILTIN} ({len(text.splitlines())} records)")
    if args.check:
        same = BUILTIN.is_file() and BUILTIN.read_text() == text
        print("builtin.jsonl is up to date" if same else "builtin.jsonl differs from the generator: run --write")
        if not same:
            return 1
    for s in load_dataset(BUILTIN)[: args.show]:
        print(json.dumps(s.as_dict(), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
