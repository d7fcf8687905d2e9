"""The start of a first turn: the prompt encoded, every method's cache prefilled and compressed, and its first
answer token sampled.

A method's prefill comes from one of three sources (`Prefiller.source`): the prefill SHARED by every method that
compresses its cache (one model pass, which also gives the importance charts), the method's OWN prefill (prefill
token reduction: FastV, VisionZip change the prefill itself), or, when the methods are run each ALONE, a prefill
of its own that records only what its policy asks for (its time to first token is then all its own).

The shared prefill and the own prefills of one comparison read one pass of the vision tower (`share_image`: the
prompt's `TurnImage`, run by whichever prefill asks first, dropped once every method is prefilled); a prefill run
ALONE encodes the image itself."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..decoding import runner
from ..decoding.vision_tokens import has_vision_plan
from ..decoding.vision_tower import TurnImage
from ..errors import EngineError
from ..models import ImageLayout, LoadedModel, encode, format_prompt, vision_inputs
from ..policies import Budget, Policy
from ..report.events import PrefillInfo
from .method_state import MethodState
from .prefill_pool import PrefillPool, PrefillTicket
from .prompt_layout import image_token_layout, question_start
from .visuals import TurnVisuals
from .stepping import RowStepper


@dataclass
class EncodedPrompt:
    """The first turn's prompt as the model reads it, and where its parts are."""

    ids: torch.Tensor  # [1, N]
    is_image: torch.Tensor  # [1, N] bool
    inputs: Any  # the processor's output (pixel values and sizes for the vision tower)
    split: int  # the tokens compressed at once: N, or (query-agnostic) the tokens before the question
    image_offset: int | None
    image_layout: ImageLayout | None
    shared_image: TurnImage | None = None  # the image through the tower once for every prefill (`share_image`)
    images: list = field(default_factory=list)  # the images encoded, in prompt order (none for a native video)
    text: str = ""  # the prompt text the processor expanded
    video: bool = False  # a video read natively is in the prompt
    frames: list = field(default_factory=list)  # its frames
    frames_at: int = 0  # how many of `images` come before it
    video_fps: float | None = None  # its sampled frames' rate
    video_times: tuple | None = None  # its frames' seconds in the stream
    # [F, P]: each video frame's patch tokens among the image tokens (`ImageLayout.frame_tokens`), for the methods
    # that compare frames (DyCoke); None without two or more frames of one size
    frame_tokens: Any = None

    @property
    def n(self) -> int:
        return self.ids.shape[1]

    @property
    def n_image(self) -> int:
        return int(self.is_image.sum())

    @property
    def question(self) -> list[int]:
        """The tokens fed after compression (query-agnostic); empty otherwise."""
        return self.ids[0, self.split:].tolist()


def encode_prompt(loaded: LoadedModel, visuals: TurnVisuals, *, chat_template: bool, query_agnostic: bool,
                  max_new_tokens: int) -> EncodedPrompt:
    """Encode the first turn (its images and video in prompt order); EngineError when it and its answer would
    not fit the model's context."""
    images = visuals.images
    text = format_prompt(loaded, visuals.prompt, with_image=len(images)) if chat_template else visuals.prompt
    inputs = encode(loaded, images or None, text, video=visuals.frames or None, video_fps=visuals.video_fps,
                    video_times=visuals.video_times)
    ids = inputs["input_ids"]
    n = ids.shape[1]
    is_image = loaded.visual_mask(ids)
    n_image = int(is_image.sum())
    if n + max_new_tokens > loaded.max_context:
        what = "the image" if visuals.count == 1 else f"{visuals.count} images and frames"
        raise EngineError(
            f"the prompt is {n} tokens ({n_image} for {what}) + {max_new_tokens} new tokens, "
            f"over the model's context of {loaded.max_context}: shorten the prompt, send fewer images or frames, "
            "or lower max new tokens")
    split = question_start(loaded, visuals, text, ids, is_image) if query_agnostic else n
    layout = image_token_layout(loaded, visuals, ids[0], is_image[0])
    is_frame = [kind == "frame" for kind, _, _ in visuals.layout_order()]
    frame_tokens = layout.frame_tokens(is_frame) if layout is not None and len(is_frame) == layout.n_images else None
    return EncodedPrompt(ids, is_image, inputs, split, int(is_image[0].nonzero()[0]) if n_image else None,
                         layout, images=list(images), text=text,
                         video=bool(visuals.frames), frames=list(visuals.frames), frames_at=visuals.frames_at,
                         video_fps=visuals.video_fps, video_times=visuals.video_times, frame_tokens=frame_tokens)


def shared_prefill_ticket(prompt: EncodedPrompt, states: list[MethodState]) -> PrefillTicket | None:
    """The ticket for a first turn's shared prefill in the engine's pool; None when no method shares it, or when
    its image is read as pixels (no shared pass of the tower)."""
    sharing = [s.policy for s in states if not s.policy.own_prefill()]
    pixels = vision_inputs(prompt.inputs)
    if not sharing or (pixels and prompt.shared_image is None):
        return None
    return PrefillTicket(prompt.ids[:, :prompt.split], prompt.is_image[:, :prompt.split], prompt.shared_image,
                         pixels, sharing)


def share_image(loaded: LoadedModel, prompt: EncodedPrompt, policies: list[Policy]) -> None:
    """From now on the prompt's prefills (not those run alone) read one pass of the vision tower, which records
    the feature layer when one of `policies` may shrink the image in the tower. Nothing for a prompt without one,
    nor for a family whose model adds more than the image features' embeddings (`tower_shared`: Qwen3-VL's
    DeepStack), whose prefills read the pixels."""
    from ..models.families import hooks

    pixels = vision_inputs(prompt.inputs)
    if prompt.n_image and pixels and hooks(loaded.family).tower_shared(loaded.model.config):
        pools = [p for p in policies if has_vision_plan(p) and not getattr(p, "resizes_image", False)]
        prompt.shared_image = TurnImage(loaded.model, pixels, record=bool(pools))


@dataclass
class Analysis:
    """The prefill whose statistics the charts show, and what the methods' allocations used."""

    importance: torch.Tensor  # [L, N_c]: each layer's column sums, heads averaged
    curves: dict[str, np.ndarray]  # method -> the importance its per-layer allocation used (its Lorenz curves)
    prefill_s: float  # the shared prefill's seconds, or the first alone prefill's
    bytes_per_token: float  # an uncompressed cache's bytes per token


class Prefiller:
    """Prefills and compresses the caches of a first turn's methods (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, stepper: RowStepper, prompt: EncodedPrompt, budget: Budget,
                 seed: int, pool: PrefillPool | None = None, ticket: PrefillTicket | None = None):
        self.loaded = loaded
        self.pool, self.ticket = pool, ticket  # the shared prefill, perhaps in one forward with other turns'
        self.stepper = stepper
        self.prompt = prompt
        self.budget = budget
        self.seed = seed
        self.bytes_per_token: float | None = None  # an uncompressed cache's, known after the first shared-kind prefill
        self.image: TurnImage | None = None  # what this run's prefills read of the image (None: each its own pass)

    def run(self, states: list[MethodState], alone: bool, analysis: bool = True) -> Analysis | None:
        """Prefill and compress each state's cache and sample its first token. `alone`: each state gets its own
        prefill; else one is shared (the last state to share it takes its cache, the others a copy). Returns the
        charts' analysis; None without `analysis` (a method timed alone again)."""
        self.image = None if alone else self.prompt.shared_image  # run alone: each prefill encodes the image itself
        sharing = [s for s in states if not s.policy.own_prefill()]
        shared = self._shared_prefill([s.policy for s in sharing]) if sharing and not alone else None
        analysed = shared  # the prefill whose column sums the importance charts show
        curves: dict[str, np.ndarray] = {}
        for state in states:
            state.generator = torch.Generator(device="cpu").manual_seed(self.seed)
            try:
                prefilled = self.source(state, shared, sharing)
                if alone and analysed is None and analysis and not state.policy.own_prefill():
                    analysed = prefilled
                self._compress(state, prefilled, curves)
            except Exception as exc:  # one method failing must not stop the others
                state.fail(exc)
        if self.prompt.split < self.prompt.n:  # query-agnostic: each method alone is fed the question on its own
            for group in ([[s] for s in states] if alone else [states]):
                self.stepper.feed_question(self.prompt.question, group)
        for state in states:
            if state.error is None:
                self.stepper.start_answer(state, state.first_logits)
        if not analysis:
            return None
        if analysed is None:  # every method ran a prefill of its own: the charts' analysis is still wanted
            analysed = self._prefill([])
        importance = torch.stack([analysed.stats[l]["colsum"][0].mean(dim=0)
                                  for l in range(self.loaded.num_layers)])
        return Analysis(importance, curves, analysed.seconds, self.bytes_per_token)

    def source(self, state: MethodState, shared: runner.Prefill | None,
               sharing: list[MethodState]) -> runner.Prefill:
        """The prefill this state starts from, its cache set: its own (prefill token reduction), one of its own
        (run alone: `shared` is None), or the shared one."""
        p = self.prompt
        policy = state.policy
        resizes = bool(getattr(policy, "resizes_image", False) and p.n_image)
        from ..models.families import uses_mrope

        frames_resized = p.video and uses_mrope(self.loaded.model.config)  # Qwen's video: its frames resized
        if resizes and (p.video or not p.images) and not frames_resized:  # OneVision's video frames: pooled instead
            policy, resizes = policy.pooling_instead(), False
        resized = self._resized(policy) if resizes else None
        if resized is not None:  # the images resized before the tower: the model's own path reads the new prompt
            split = p.split - (p.n_image - int(resized.is_image.sum()))
            prefilled = runner.own_prefill(self.loaded.model, policy, resized.ids[:, :split],
                                           resized.is_image[:, :split], vision_inputs(resized.inputs),
                                           self.loaded.num_layers, self.loaded.device)
            prefilled.reduction = resized.record
            state.cache = prefilled.cache
        elif resizes:  # no image gets smaller: the prompt as the model's own path encodes it
            prefilled = runner.own_prefill(self.loaded.model, policy, p.ids[:, :p.split],
                                           p.is_image[:, :p.split], vision_inputs(p.inputs), self.loaded.num_layers,
                                           self.loaded.device, None, self.image)
            state.cache = prefilled.cache
        elif policy.own_prefill():
            prefilled = runner.own_prefill(self.loaded.model, policy, p.ids[:, :p.split],
                                           p.is_image[:, :p.split], vision_inputs(p.inputs), self.loaded.num_layers,
                                           self.loaded.device, self.loaded.image_token_id, self.image,
                                           frames=p.frame_tokens)
            state.cache = prefilled.cache
        elif shared is None:
            prefilled = self._prefill([state.policy])
            state.cache = prefilled.cache
        else:  # the last method to share the prefill takes its cache, the others a copy
            prefilled = shared
            state.cache = shared.cache if state is sharing[-1] else shared.cache.clone()
        return prefilled

    def _resized(self, policy: Policy):
        """The prompt with its images resized for a policy that resizes them before the tower (Downsample's
        `where = image`), None when no image gets smaller. (A prompt with OneVision's native video is not resized:
        its frames are no images the processor resizes; it is pooled after the projector instead. Qwen's native
        video is: every frame scaled alike, `resized_prompt`.)"""
        from ..decoding.image_resize import resized_prompt

        p = self.prompt
        if p.split < p.n and bool(p.is_image[0, p.split:].any()):
            raise EngineError("an image after the held-back question cannot be resized with the prompt")
        wanted = policy.kept_image_tokens(p.split, p.n_image)
        return resized_prompt(self.loaded, p.images, p.text, wanted, p.n_image, p.frames if p.video else None,
                              p.frames_at, p.video_fps, p.video_times)

    def _shared_prefill(self, policies) -> runner.Prefill:
        """The prefill every sharing method starts from: from the pool when the turn holds a ticket (perhaps one
        forward with other conversations' prompts, `prefill_pool.py`), else one of this turn's own."""
        if self.pool is None or self.ticket is None:
            return self._prefill(policies)
        return self._noted(self.pool.prefill(self.ticket))

    def _prefill(self, policies) -> runner.Prefill:
        """One prefill of the compressed context recording what `policies` ask for (the uncompressed cache's bytes
        per token noted before any policy compresses it)."""
        p = self.prompt
        return self._noted(runner.prefill(self.loaded.model, p.ids[:, :p.split], p.is_image[:, :p.split],
                                          vision_inputs(p.inputs), policies, self.loaded.num_layers,
                                          self.loaded.device, self.image))

    def _noted(self, prefilled: runner.Prefill) -> runner.Prefill:
        """The uncompressed cache's bytes per token, noted from the first shared-kind prefill (the same for every
        prefill of this context) before any policy compresses it."""
        if self.bytes_per_token is None:
            self.bytes_per_token = prefilled.cache.nbytes() / self.prompt.split
        return prefilled

    def _compress(self, state: MethodState, prefilled: runner.Prefill, curves: dict[str, np.ndarray]) -> None:
        """The state's policy compresses its prefilled cache; its first logits and timings are set."""
        own_n = prefilled.prompt_len
        state.prompt_len = state.true_len = own_n
        state.reduced_by = self.prompt.split - own_n
        state.first_logits = prefilled.logits[0]
        t1 = runner.now(self.loaded.device)
        stats = runner.policy_stats(state.policy, prefilled.stats, own_n)
        state.policy_state = runner.compress_prefill(state.policy, state.cache, stats, own_n, self.budget,
                                                     prefilled.reduction, state.reduced_by)
        used = state.policy.allocation_importance(state.policy_state)
        if used is not None:
            curves[state.name] = used.float().cpu().numpy()
        state.compress_s = runner.now(self.loaded.device) - t1
        state.ttft_s = prefilled.seconds + state.compress_s


def prefill_info(loaded: LoadedModel, prompt: EncodedPrompt, analysis: Analysis) -> PrefillInfo:
    """What the listeners are told once the first turn's prefill is done."""
    first = prompt.image_layout.views[0] if prompt.image_layout is not None else None
    return PrefillInfo(
        prompt_tokens=prompt.n, image_tokens=prompt.n_image, num_layers=loaded.num_layers,
        importance=analysis.importance.float().cpu().numpy(), is_image=prompt.is_image[0, :prompt.split].cpu().numpy(),
        image_grid=(first.rows, first.cols) if first is not None else None, image_offset=prompt.image_offset,
        prefill_s=analysis.prefill_s, image_layout=prompt.image_layout, curves=analysis.curves,
        compressed_tokens=prompt.split)
