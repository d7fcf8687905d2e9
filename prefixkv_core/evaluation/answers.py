"""Every answer a sweep needs for one sample, from as few engine sessions as possible: at each budget, all the
sweep's methods decode together as one batch (the reference, Full, and the methods without a budget only at the
first), and the answers are kept, so the sweep's runs (one lmms-eval pass per method and budget) each read them
instead of decoding again.

No lmms-eval here: a sample is a prompt, its images (or a video) and the generation settings."""
from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import EngineError
from ..policies import REGISTRY
from ..report.events import MethodEvent
from ..session.engine import Engine
from ..session.generation import GenerationSettings
from .model_args import EvalSettings

log = logging.getLogger(__name__)

Run = tuple[str, float]  # (method, budget)


@dataclass(frozen=True)
class Sample:
    """One request as the engine takes it. `sample_id` names it in messages (task/split/doc id)."""

    sample_id: str
    prompt: str
    image: Any = None  # a PIL image, a tuple of them (several, in order) or None (text only)
    until: tuple[str, ...] = ()
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    video: Any = None  # a video file's path, sampled to `frames` frames after the images
    frames: int | None = None

    def images(self) -> list:
        return [] if self.image is None else list(self.image) if isinstance(self.image, tuple) else [self.image]

    def key(self) -> str:
        """What the answers depend on: the prompt, the images' pixels, the video and the generation settings."""
        h = hashlib.sha1(self.prompt.encode())
        for image in self.images():
            h.update(f"{image.size}{image.mode}".encode())
            h.update(image.tobytes())
        if self.video is not None:
            h.update(f"video:{self.video}:{self.frames}".encode())
        h.update(repr((self.until, self.generation)).encode())
        return h.hexdigest()

    def media(self) -> dict[str, Any]:
        """The engine's `new_session` arguments for the images and the video."""
        images = self.images()
        return {"image": (images[0] if len(images) == 1 else images) if images else None, "video": self.video,
                "frames": self.frames}


def cut_at_stop(text: str, until: tuple[str, ...]) -> str:
    """The answer up to the first stop string (lmms-eval's `until`)."""
    for stop in until:
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text


class AnswerBank:
    """The sweep's answers per sample, decoded in batches and kept (in memory) for the runs that read them."""

    def __init__(self, engine: Engine, settings: EvalSettings):
        self.engine = engine
        self.settings = settings
        self.answers: dict[str, dict[Run, str]] = {}
        self.scores: dict[tuple, float | None] = {}  # teacher-forced log-likelihoods, per method
        self.skipped: dict[str, str] = {}  # sample id -> why it has no answer (over the context, ...)
        self.kv: dict[Run, list[float]] = {}  # each answer's final KV bytes over an uncompressed cache's
        self.sessions = 0  # engine sessions run (the sweep's cost, against one per method and budget)

    def answer(self, sample: Sample, run: Run) -> str:
        key = sample.key()
        if key not in self.answers:
            self.answers[key] = self._decode(sample)
        return self.answers[key].get(run, "")

    def _decode(self, sample: Sample) -> dict[Run, str]:
        s = self.settings
        out: dict[Run, str] = {}
        for budget in s.budgets:
            methods = s.batch(budget)
            try:
                texts = self._session_texts(sample, methods, budget)
            except EngineError as exc:  # e.g. the prompt is over the model's context: this sample only
                self._skip(sample, str(exc))
                return {}
            for m, text in texts.items():
                out[(m, float(budget))] = text
                if m == s.reference or not _uses_budget(m):  # no budget: the same answer at every budget
                    for b in s.budgets:
                        out[(m, float(b))] = text
        return out

    def _session_texts(self, sample: Sample, methods: list[str], budget: float) -> dict[str, str]:
        s = self.settings
        media = sample.media()
        session = self.engine.new_session(media.pop("image"), sample.prompt, methods, budget, sample.generation,
                                          s.knobs, budget_mode=s.budget_mode, query_agnostic=s.query_agnostic, **media)
        self.sessions += 1
        cancel = threading.Event()
        stopped: set[str] = set()
        for event in session.run(cancel):
            # every method past a stop string: the rest of the tokens would be cut anyway
            if sample.until and isinstance(event, MethodEvent) and cut_at_stop(event.text, sample.until) != event.text:
                stopped.add(event.method)
                if stopped >= set(methods):
                    cancel.set()
        record = session.record.to_dict()
        if record.get("error"):
            raise EngineError(record["error"])
        texts = {}
        for m, r in record["methods"].items():
            if r["error"]:
                log.warning("sample %s: %s failed: %s", sample.sample_id, m, r["error"])
            texts[m] = cut_at_stop(r["text"] or "", sample.until)
            if r["full_kv_bytes"]:
                self.kv.setdefault((m, float(budget)), []).append(r["kv_bytes"] / r["full_kv_bytes"])
        return texts

    def kv_share(self) -> dict[str, float]:
        """'method@budget' -> the mean final KV share of its answers (what a method without a budget keeps)."""
        return {f"{m}@{b:g}": sum(v) / len(v) for (m, b), v in self.kv.items() if v}

    def _skip(self, sample: Sample, why: str) -> None:
        self.skipped[sample.sample_id] = why
        log.warning("sample %s skipped: %s", sample.sample_id, why)

    # -- teacher forcing (lmms-eval's loglikelihood) ------------------------------------------------------
    def log_likelihood(self, sample: Sample, continuation: str, run: Run) -> float | None:
        """Sum of log-probabilities of `continuation` after the prompt, fed through the method's compressed
        cache by teacher forcing (`Session.score_answer`); None when the sample cannot run (reported)."""
        method, budget = run
        key = (sample.key(), continuation, float(budget) if _uses_budget(method) else None)
        if (*key, method) not in self.scores:
            tok = self.engine.loaded.processor.tokenizer
            n_answer = max(1, len(tok(continuation, add_special_tokens=False)["input_ids"]))
            methods = self.settings.batch(budget) if _uses_budget(method) else [method]
            s = self.settings
            try:
                media = sample.media()
                session = self.engine.new_session(
                    media.pop("image"), sample.prompt, methods, budget, GenerationSettings(max_new_tokens=n_answer),
                    s.knobs, budget_mode=s.budget_mode, query_agnostic=s.query_agnostic, **media)
                self.sessions += 1
                scored = session.score_answer(continuation)
            except EngineError as exc:
                self._skip(sample, str(exc))
                scored = {}
            for m in methods:
                at = float(budget) if _uses_budget(m) else None
                self.scores[(sample.key(), continuation, at, m)] = -scored[m][0] if m in scored else None
        return self.scores[(*key, method)]

    def greedy_matches(self, sample: Sample, continuation: str, run: Run) -> bool:
        """Whether greedy decoding through the method's cache gives `continuation` (lmms-eval's is_greedy)."""
        tok = self.engine.loaded.processor.tokenizer
        n = max(1, len(tok(continuation, add_special_tokens=False)["input_ids"]))
        greedy = Sample(sample.sample_id, sample.prompt, sample.image, (),
                        GenerationSettings(max_new_tokens=n, seed=self.settings.seed), sample.video, sample.frames)
        return self.answer(greedy, run).strip() == continuation.strip()


def _uses_budget(method: str) -> bool:
    return REGISTRY[method].uses_budget
