"""Prefill + decode of a batch of prompts for the speed benchmark, through the engine's own runner
(`prefixkv_core.decoding.runner`, the same code the app's comparisons run on). Models are `LoadedModel`s: loaded ones,
or randomly initialised ones with exact released shapes (`prefixkv_core.models.build_random_model`).

B prompts of equal length and equal layout (BOS, image block, text) decode as one batch for every method: a
method whose plan does not depend on the sample keeps them in one cache; the others (Elastic Cache, ZipVL,
online PrefixKV) get a cache per prompt, padded and masked into the same forward by the runner.
`full-stock` (transformers' own DynamicCache and sdpa, no tracking) is the engine-free baseline.
Query-agnostic runs prefill and compress BOS + the image block first, then feed the text as one chunk (the
question) through the compressed caches; the time to first token includes that feed.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import AttentionProbe, StatRequest, StepSubset, tracked_attention_enabled
from prefixkv_core.kv.cache import TrackedCache
from prefixkv_core.models import LoadedModel
from prefixkv_core.models.compat import cache_kwarg
from prefixkv_core.policies import Policy, make_policy

STOCK = "full-stock"  # plain DynamicCache + stock sdpa attention: the engine-free baseline
sync = runner.sync


# -- inputs ----------------------------------------------------------------------------------------------------

def synthetic_batch(sm: LoadedModel, batch: int, prompt_len: int, seed: int = 0):
    """B prompts of exactly `prompt_len` tokens: BOS, the image block, random text ids. Same layout in every row.
    Returns input_ids [B, N], is_image [B, N] (bool) and the image inputs: pixel_values [B, 3, S, S] in the
    model's dtype; for a random-weight family model (which has a processor), every image tensor its processor
    makes of a noise image of the vision tower's side (an anyres family's views and image sizes), one per row."""
    if sm.processor is not None and sm.random_weights:
        return _processed_batch(sm, batch, prompt_len, seed)
    n_img = sm.image_seq_length
    if prompt_len < n_img + 2:
        raise ValueError(f"prompt length {prompt_len} is shorter than the image block ({n_img} tokens) + BOS + 1 "
                         f"text token; use at least {n_img + 2}")
    g = torch.Generator().manual_seed(seed)
    hi = sm.image_token_id if sm.image_token_id > sm.vocab_size // 2 else sm.vocab_size
    ids = torch.randint(3, hi, (batch, prompt_len), generator=g)
    ids[ids == sm.image_token_id] = 3
    ids[:, 0] = sm.bos_id
    ids[:, 1:1 + n_img] = sm.image_token_id
    is_image = ids == sm.image_token_id
    pixels = torch.randn(batch, 3, sm.image_size, sm.image_size, generator=g)
    return ids.to(sm.device), is_image.to(sm.device), pixels.to(sm.device, sm.dtype)


def _processed_batch(sm: LoadedModel, batch: int, prompt_len: int, seed: int):
    import numpy as np
    from PIL import Image

    from prefixkv_core.models import vision_inputs
    from prefixkv_core.models.families import hooks

    rng = np.random.default_rng(seed)
    side = sm.image_size
    image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    placeholder = hooks(sm.family).image_placeholder(sm.processor)  # what the family's processor expands
    encoded = sm.processor(images=image, text=placeholder, return_tensors="pt")
    n_img = int((encoded["input_ids"][0] == sm.image_token_id).sum())
    if prompt_len < n_img + 2:
        raise ValueError(f"prompt length {prompt_len} is shorter than the image block ({n_img} tokens for a "
                         f"{side}x{side} image) + BOS + 1 text token; use at least {n_img + 2}")
    g = torch.Generator().manual_seed(seed)
    special = {sm.image_token_id, *sm.processor.tokenizer.all_special_ids}
    ids = torch.randint(0, len(sm.processor.tokenizer), (batch, prompt_len), generator=g)
    for token in special:
        ids[ids == token] = max(special) + 1
    ids[:, 0] = sm.bos_id
    ids[:, 1:1 + n_img] = sm.image_token_id
    images = {}
    for name, value in vision_inputs(encoded).items():
        value = value.repeat(batch, *([1] * (value.dim() - 1))) if value.dim() else value
        images[name] = value.to(sm.device, sm.dtype) if value.is_floating_point() else value.to(sm.device)
    return ids.to(sm.device), (ids == sm.image_token_id).to(sm.device), images


# -- runners ---------------------------------------------------------------------------------------------------

class MethodRun:
    """One method on a batch of prompts through the engine's runner (`prefixkv_core.decoding.runner`): one prefill of all
    prompts, then greedy decode steps, each followed by the policy's decode-time compression.

    When the policy's plan serves every row (its kept counts do not depend on the sample), the prompts share
    one cache; otherwise every prompt gets its own cache and the runner pads and masks them into the same
    forward. Either way the whole batch decodes in one model call per step."""

    def __init__(self, sm: LoadedModel, policy: Policy, budget: float, query_agnostic: bool = False):
        self.sm, self.policy, self.budget = sm, policy, budget
        self.query_agnostic = query_agnostic
        self.caches: list[TrackedCache] = []
        self.states: list[Any] = []
        self.prompt_len = 0
        self.true_len = 0
        self.reduced_by = 0  # prompt tokens an own prefill kept from the language model (VisionZip)
        self.step_no = 0
        self.shared_plan = True
        self.buffers = runner.StepBuffers()  # padded step tensors, reused for the whole run

    @property
    def mode(self) -> str:
        return "one shared cache" if self.shared_plan else "a cache per prompt"

    def prefill(self, ids, is_image, pixel_values) -> torch.Tensor:
        sm, policy = self.sm, self.policy
        question = None
        if self.query_agnostic:  # compress BOS + the image block, then feed the text after it
            split = int(is_image[0].nonzero()[-1]) + 1
            ids, is_image, question = ids[:, :split], is_image[:, :split], ids[:, split:]
        # a prefill token reduction (FastV, VisionZip) runs its own prefill; VisionZip's is shorter
        shared = runner.prefill_for(sm.model, policy, ids, is_image, pixel_values, sm.num_layers, sm.device,
                                    sm.image_token_id)
        n = shared.prompt_len
        self.reduced_by = ids.shape[1] - n
        self.shared_plan = ids.shape[0] == 1 or policy.plans_rows_together()
        # a cache per prompt: each row compressed before the next is split off (one uncompressed copy at a time)
        rows = [shared.cache] if self.shared_plan else shared.cache.each_row()
        self.caches = []
        for r, cache in enumerate(rows):  # one policy, a state per cache
            stats = runner.policy_stats(policy, shared.stats, n, None if self.shared_plan else slice(r, r + 1))
            self.states.append(runner.compress_prefill(policy, cache, stats, n, self.budget, shared.reduction,
                                                       self.reduced_by))
            self.caches.append(cache)
        self.prompt_len = self.true_len = n
        if question is not None and question.shape[1] > 0:
            return self._feed(question, step=0).argmax(dim=-1)
        return shared.logits.argmax(dim=-1)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.step_no += 1
        return self._feed(tokens.view(-1, 1), self.step_no).argmax(dim=-1)

    def _feed(self, chunk: torch.Tensor, step: int) -> torch.Tensor:
        """Feed chunk [B, T] (row r to prompt r) at the next positions, then let the policy compress; logits [B, V]."""
        sm, policy = self.sm, self.policy
        needs = policy.decode_needs_attention()
        decoding = chunk.shape[1] == 1
        if self.shared_plan:  # every row in one cache: the step's request and key subsets (DyCoke's) for all rows
            wanted = runner.attention_wanted(policy, self.states[0])
            layers = wanted if decoding and isinstance(wanted, tuple) else None
            probe = AttentionProbe(StatRequest(last_query=needs, last_query_layers=layers))
            subset = policy.step_subset(self.states[0], self.caches[0]) if decoding else None
            if subset is not None:
                probe.subset = StepSubset([(tuple(range(chunk.shape[0])), *subset)])
            logits, stats = runner.forward_group(sm.model, self.caches[0], chunk, self.true_len, probe)
            attention = [runner.last_query(stats) if needs else None]
        else:
            chunks = chunk.tolist()
            wants = [runner.attention_wanted(policy, state) for state in self.states]
            out = runner.forward_rows(sm.model, self.caches, chunks, [self.true_len] * len(chunks), wants, sm.device,
                                      self.buffers, [policy.step_subset(state, cache)
                                                     for state, cache in zip(self.states, self.caches)])
            logits, attention = out.logits, out.attention
        self.true_len += chunk.shape[1]
        rows = [runner.DecodeRow(policy, state, cache, self.true_len, self.prompt_len, step, att, self.reduced_by)
                for cache, state, att in zip(self.caches, self.states, attention)]
        for _, error in runner.compress_decode_rows(rows, sm.device):
            if error is not None:
                raise error
        return logits

    def kv_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)

    def kept_per_layer(self) -> list[int]:
        """Entries per layer of the first prompt's cache (every row's, when they share one)."""
        return self.caches[0].lengths()

    def extras(self) -> dict[str, Any]:
        """The facts of the first prompt's run (every row's, when they share one cache)."""
        return self.policy.extras(self.states[0] if self.states else None)


class StockRun:
    """Full cache through transformers' own DynamicCache and stock sdpa attention (no tracking at all)."""

    def __init__(self, sm: LoadedModel):
        from transformers import DynamicCache

        self.sm = sm
        self.cache = DynamicCache()
        self.true_len = 0

    @torch.inference_mode()
    def prefill(self, ids, is_image, pixel_values) -> torch.Tensor:
        b, n = ids.shape
        pos = torch.arange(n, device=ids.device).unsqueeze(0).expand(b, -1)
        out = self.sm.model(input_ids=ids, position_ids=pos, **cache_kwarg(self.cache), use_cache=True,
                            logits_to_keep=1, **runner.vision_kwargs(pixel_values))
        self.true_len = n
        return out.logits[:, -1].argmax(dim=-1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        pos = torch.full((b, 1), self.true_len, device=tokens.device)
        out = self.sm.model(input_ids=tokens.view(-1, 1), position_ids=pos, **cache_kwarg(self.cache),
                            use_cache=True, logits_to_keep=1)
        self.true_len += 1
        return out.logits[:, -1].argmax(dim=-1)

    def kv_bytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None:
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total

    def kept_per_layer(self) -> list[int]:
        return [int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else 0
                for layer in self.cache.layers]

    def extras(self) -> dict[str, Any]:
        return {}

    mode = "transformers' DynamicCache"


class IdealRun(StockRun):
    """What a cache of given per-layer lengths costs with nothing but transformers: its DynamicCache and stock
    sdpa stepping a cache whose layer l starts at `lengths[l]` entries (random keys and values, the model's
    dtype) and grows by one entry a step. A method holding those lengths can at best decode this fast; speed.py's
    `--ideal` reports each method against it."""

    def __init__(self, sm: LoadedModel, lengths: list[int]):
        super().__init__(sm)
        self.lengths = lengths

    @torch.inference_mode()
    def prefill(self, ids, is_image, pixel_values) -> torch.Tensor:
        text = self.sm.model.config.get_text_config()
        heads = text.num_key_value_heads
        dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        b = ids.shape[0]
        g = torch.Generator(device="cpu").manual_seed(0)
        for layer, n in enumerate(self.lengths):
            keys, values = (torch.randn(b, heads, n, dim, generator=g).to(self.sm.device, self.sm.dtype)
                            for _ in range(2))
            self.cache.update(keys, values, layer)
        self.true_len = ids.shape[1]
        return ids[:, -1]


def new_run(sm: LoadedModel, method: str, budget: float, knobs: dict[str, Any] | None,
            budget_mode: str = "published", query_agnostic: bool = False):
    if method == STOCK:  # nothing is compressed: the same run in both modes
        return StockRun(sm)
    return MethodRun(sm, make_policy(method, budget, budget_mode, **(knobs or {})), budget, query_agnostic)


@torch.inference_mode()
def run_timed(sm: LoadedModel, method: str, budget: float, knobs: dict | None, ids, is_image, pixels,
              gen_len: int, budget_mode: str = "published", query_agnostic: bool = False) -> dict[str, Any]:
    """Prefill (timed: TTFT = forward + compression, + the question's feed when query-agnostic), then
    gen_len - 1 decode steps, each synchronised and timed (forward + the policy's compression). Rows of `ids` run
    as one batch. `budget_mode`: see prefixkv_core.policies.BUDGET_MODES."""
    return _timed(sm, new_run(sm, method, budget, knobs, budget_mode, query_agnostic), ids, is_image, pixels,
                  gen_len)


@torch.inference_mode()
def run_ideal(sm: LoadedModel, lengths: list[int], ids, gen_len: int) -> dict[str, Any]:
    """`run_timed` of `IdealRun`: transformers alone stepping a cache of these per-layer lengths (the batch of
    `ids`), gen_len - 1 steps."""
    return _timed(sm, IdealRun(sm, lengths), ids, None, None, gen_len)


def _timed(sm: LoadedModel, run, ids, is_image, pixels, gen_len: int) -> dict[str, Any]:
    ctx = tracked_attention_enabled(sm.model) if isinstance(run, MethodRun) else _null()
    with ctx:
        sync(sm.device)
        t0 = time.perf_counter()
        tokens = run.prefill(ids, is_image, pixels)
        sync(sm.device)
        ttft = time.perf_counter() - t0
        kept_after_prefill = run.kept_per_layer()
        generated = [tokens]
        steps = []
        for _ in range(gen_len - 1):
            t1 = time.perf_counter()
            tokens = run.step(tokens)
            sync(sm.device)
            steps.append(time.perf_counter() - t1)
            generated.append(tokens)
    return {"ttft_s": ttft, "step_s": steps, "tokens": torch.stack(generated, dim=1).tolist(),
            "kv_bytes": run.kv_bytes(), "kept_per_layer": run.kept_per_layer(), "kept_after_prefill": kept_after_prefill,
            "true_len": ids.shape[1] + gen_len - 1, "extras": run.extras(), "cache_mode": run.mode}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
