"""`--model prefixkv`: the engine as an lmms-eval model (lmms-eval's `lmms` base class, a "simple" model: it
receives the task's context string and the document's visuals).

    lmms-eval --model prefixkv --model_args pretrained=embedded,method=snapkv,budget=0.2,query_agnostic=true \\
        --tasks scene_qa --include_path benchmarks/lmms_tasks

model_args: pretrained (a hub id, a local LLaVA directory, `embedded`), method (or methods=a+b for a sweep),
budget (or budgets=0.1+0.3), budget_mode (published | equal_memory), query_agnostic, knobs
(METHOD.KNOB=VALUE;...), device, dtype, seed, reference (true: Full decodes in the same batch, for agreement),
frames (a video sample's frames, sampled uniformly; default 8). A sample's visuals may be several images (in
order) and a video path; its frames follow the images.
A sweep answers every method and budget of a sample in one batched decode per budget; which one this model
reports is `select(method, budget)` (the sweep entry, `sweep.py`, drives it).

Data parallel: under `accelerate launch -m lmms_eval ...` lmms-eval gives each process its share of the samples;
each process loads the model on its own device (its GPU, or the CPU)."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from PIL import Image
from tqdm import tqdm

from ..models import load_model
from ..session.engine import Engine
from .answers import AnswerBank, Run, Sample
from .gen_kwargs import generation_settings, stop_strings
from .model_args import parse_model_args

log = logging.getLogger(__name__)


class PrefixKV(lmms):
    is_simple = True

    def __init__(self, pretrained: str = "embedded", **model_args: Any):
        super().__init__()
        # checked before anything loads: a bad method, knob or budget fails here with the engine's message
        self.settings = parse_model_args({"pretrained": pretrained, **model_args})
        world = int(os.environ.get("WORLD_SIZE", "1"))
        device = self.settings.device
        if world > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator()
            self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes
            if device in ("auto", "cuda") and torch.cuda.is_available():  # one GPU per process
                device = f"cuda:{self.accelerator.local_process_index}"
        self.engine = Engine(load_model(self.settings.pretrained, device=device, dtype=self.settings.dtype))
        self.bank = AnswerBank(self.engine, self.settings)
        self.current: Run = self.settings.runs()[0]

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "PrefixKV":
        """lmms-eval's --device (and --batch_size) arrive beside model_args; a device given in model_args wins
        instead of clashing with it."""
        from lmms_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
        return cls(**args, **extra)

    # -- what lmms-eval asks of a model ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.loaded.device)

    def select(self, method: str, budget: float) -> None:
        """The method and budget whose answers the next evaluation reports (one run of a sweep)."""
        run = (method, float(budget))
        known = {(m, float(b)) for m, b in self.settings.runs()}
        if self.settings.reference:  # decoded beside the others at every budget's first batch
            known |= {(self.settings.reference, float(b)) for b in self.settings.budgets}
        if run not in known:
            raise ValueError(f"{method}@{budget:g} is not in this model's sweep: "
                             + ", ".join(f"{m}@{b:g}" for m, b in self.settings.runs()))
        self.current = run

    def generate_until(self, requests: list[Instance]) -> list[str]:
        out = []
        for req in tqdm(requests, disable=self.rank != 0, desc=f"prefixkv {self._run_name()}"):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
            sample = self._sample(context, doc_to_visual, doc_id, task, split, gen_kwargs)
            out.append("" if sample is None else self.bank.answer(sample, self.current))
        return out

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, disable=self.rank != 0, desc=f"prefixkv {self._run_name()} (scoring)"):
            context, target, doc_to_visual, doc_id, task, split = req.args
            # multiple choice gives the option as text; a loglikelihood task gives its doc_to_target
            continuation = target if isinstance(target, str) else target(self.task_dict[task][split][doc_id])
            # inside the chat template the answer starts the assistant's turn: no separating space
            continuation = str(continuation).lstrip()
            sample = self._sample(context, doc_to_visual, doc_id, task, split, {})
            score = None if sample is None else self.bank.log_likelihood(sample, continuation, self.current)
            if score is None:
                out.append((float("-inf"), False))
                continue
            # is_greedy only counts for loglikelihood tasks (multiple choice compares the scores): decoded then
            greedy = not isinstance(target, str) and self.bank.greedy_matches(sample, continuation, self.current)
            out.append((score, greedy))
        return out

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError("prefixkv answers one turn per request; multi-round tasks are not supported")

    def clean(self):
        """lmms-eval calls this after every evaluation; the model stays loaded for the next run of a sweep."""

    # -- requests to engine samples --------------------------------------------------------------------
    def _sample(self, context: str, doc_to_visual, doc_id, task: str, split: str,
                gen_kwargs: dict[str, Any]) -> Sample | None:
        sample_id = f"{task}/{split}/{doc_id}"
        visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual is not None else []
        visuals = [v for v in (visuals or []) if v is not None]
        images = [v.convert("RGB") for v in visuals if isinstance(v, Image.Image)]
        videos = [v for v in visuals if isinstance(v, (str, os.PathLike))]
        other = len(visuals) - len(images) - len(videos)
        if other or len(videos) > 1:
            why = "it has an audio or other non-image input" if other else f"it has {len(videos)} videos"
            self.bank.skipped[sample_id] = f"{why}; the engine takes images and one video per conversation"
            log.warning("sample %s skipped: %s", sample_id, self.bank.skipped[sample_id])
            return None
        image = (images[0] if len(images) == 1 else tuple(images)) if images else None
        return Sample(sample_id, context, image, tuple(stop_strings(gen_kwargs)),
                      generation_settings(gen_kwargs, self.settings.seed), str(videos[0]) if videos else None,
                      self.settings.frames if videos else None)

    def _run_name(self) -> str:
        return f"{self.current[0]}@{self.current[1]:g}"
