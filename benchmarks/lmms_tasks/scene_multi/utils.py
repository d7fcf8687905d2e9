"""What lmms-eval calls for the scene_multi task: the sample's images rebuilt from its seed (a list of PIL images,
in the order they are numbered), the question after a note saying how the images are numbered, and the grading
of `scenes.multi.grade` (`scenes.grading`'s, with "Image 2" counting as "2" for the `which` questions)."""
from functools import lru_cache

from scenes.multi import grade, multi_prompt, multi_sample


@lru_cache(maxsize=16)
def _images(seed: int, n_images: int):
    return list(multi_sample(int(seed), int(n_images)).images)


def doc_to_visual(doc):
    return list(_images(doc["seed"], doc["n_images"]))


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return multi_prompt(doc["question"], int(doc["n_images"]))


def process_results(doc, results):
    return {"accuracy": float(grade(results[0], doc["answer"], doc["subtask"]))}
