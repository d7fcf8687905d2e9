"""What lmms-eval calls for the scene_video task: the path of the clip's mp4 (written from the record's seed on
first use into a folder under the system temp dir, `scenes.video.clip_cache_dir()`, and reused after), the
question, and the grading of `scenes.grading`."""
from scenes.grading import is_correct
from scenes.video import cached_clip


def doc_to_visual(doc):
    return [str(cached_clip(int(doc["seed"]), int(doc["frames"])))]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    return {"accuracy": float(is_correct(results[0], doc["answer"]))}
