"""What lmms-eval calls for the scene_qa task: the scene rendered from its seed, the question as asked, and the
grading of `scenes.grading` (the one benchmarks/vision_accuracy.py uses)."""
from functools import lru_cache

from scenes import render_scene
from scenes.grading import is_correct


@lru_cache(maxsize=64)
def _image(seed: int):
    return render_scene(int(seed)).image


def doc_to_visual(doc):
    return [_image(doc["seed"])]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    return {"accuracy": float(is_correct(results[0], doc["answer"]))}
