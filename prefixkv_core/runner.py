"""One forward pass over many rows, each with its own compressed cache, and the policy calls around it.

A row is one method's conversation (or, in the speed benchmark, one method on one sample). Every row owns a
batch-1 `TrackedCache` whose layers hold different numbers of entries, per layer and per row. `forward_rows`
feeds each row its next tokens in ONE model call:

- per layer, the rows' keys/values are laid out as `[row's entries | padding | this step's tokens]` and the
  padding is masked through the attention function's key masks, so each row attends exactly to its own
  cache (bottom-right causal alignment keeps holding for multi-token chunks);
- rows whose chunks are shorter are left-padded; the padding tokens are masked as keys and never stored;
- the new entries are appended to each row's own cache with their true positions, and the decode-time
  statistic (the last query's attention) is cut back to each row's own entries.

Decoding on a CPU, or a large model at small batch on a GPU, is bound by reading the weights, so nine rows
in one pass cost little more than one. A single row takes the plain path (no padding, no copies).

The prefills live here too: `prefill` is the one shared by the methods that compress its cache, `own_prefill`
that of a method changing the prefill itself (a prefill token reduction: FastV's masked later layers,
VisionZip's shorter prompt); its row then decodes in the same batch at its own true positions. So do the policy
calls (`compress_prefill`, `compress_decode`), so the engine and the benchmarks run methods the same way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .attention import AttentionProbe, StatRequest
from .cache import TrackedCache, TrackedLayer, per_head_meta
from .policies import Policy, PolicyState
from .policies.base import DecodeView, PrefillView, apply_plans


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """A timestamp after all queued device work has finished (honest CUDA timings)."""
    sync(device)
    return time.perf_counter()


# -- the padded step cache ---------------------------------------------------------------------------------

class StepBuffers:
    """The padded keys/values of batched steps, reused from one step to the next (one pair per layer), so a step
    neither allocates nor zeroes a fresh tensor per layer. Reuse without zeroing is exact: a row attends only
    to its own entries and this step's tokens (the key mask), and the rest only ever holds earlier finite
    keys/values, which the mask turns into exact zeros. Keep one for a turn; drop it afterwards (it is as
    large as every row padded to the longest)."""

    def __init__(self):
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H, t, D] views shaped like `keys`/`values` ([B, H, *, D]) with room for t entries."""
        b, h, _, d = keys.shape
        found = self._layers.get(layer_idx)
        if (found is None or found[0].shape[0] < b or found[0].shape[2] < t or found[0].shape[1] != h
                or found[0].shape[3] != d or found[0].dtype != keys.dtype or found[0].device != keys.device):
            grown = t if found is None else max(t, found[0].shape[2] + found[0].shape[2] // 2)
            rows = b if found is None else max(b, found[0].shape[0])
            found = (keys.new_zeros(rows, h, grown + 16, d), values.new_zeros(rows, h, grown + 16, values.shape[-1]))
            self._layers[layer_idx] = found
        return found[0][:b, :, :t], found[1][:b, :, :t]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._layers.values())


class _StepLayer(DynamicLayer):
    """One layer of a batched step: appends each row's new entries to that row's own layer and returns the
    padded keys/values of all rows, registering the padding mask on the probe."""

    def __init__(self, step: "_StepCache", layer_idx: int):
        super().__init__()
        self.step, self.layer_idx = step, layer_idx
        self.is_initialized = True
        self.old_lengths = [c.layers[layer_idx].length for c in step.caches]

    def get_seq_length(self) -> int:
        return max(self.old_lengths)

    def update(self, key_states, value_states, *args, **kwargs):
        step = self.step
        b, h, q, _ = key_states.shape
        t_old = max(self.old_lengths)
        # rows whose heads keep different counts (empty slots) need a per-head mask over their own entries
        slots = [c.layers[self.layer_idx].key_mask() for c in step.caches]
        uniform = step.uniform and len(set(self.old_lengths)) == 1 and all(s is None for s in slots)
        keys, values = step.buffers.get(self.layer_idx, key_states, value_states, t_old + q)
        for r, (cache, meta) in enumerate(zip(step.caches, step.row_meta(h))):
            layer: TrackedLayer = cache.layers[self.layer_idx]
            n_old, q_r = self.old_lengths[r], step.chunk_lengths[r]
            row_keys, row_values = layer.update(key_states[r:r + 1, :, q - q_r:], value_states[r:r + 1, :, q - q_r:])
            layer.append_meta_per_head(*meta, has_image=False)  # steps feed text: image tokens come with the prompt
            keys[r, :, :n_old] = row_keys[0, :, :n_old]
            values[r, :, :n_old] = row_values[0, :, :n_old]
        keys[:, :, t_old:] = key_states
        values[:, :, t_old:] = value_states
        if not uniform:
            # row r may attend to its own entries [0, n_old) and its real new tokens (the last q_r)
            idx = torch.arange(t_old + q, device=key_states.device)
            n_old = torch.tensor(self.old_lengths, device=key_states.device)[:, None]
            first_new = t_old + q - step.chunk_tensor[:, None]
            mask = ((idx < n_old) | (idx >= first_new)).unsqueeze(1)
            if any(s is not None for s in slots):
                mask = mask.expand(b, h, -1).clone()
                for r, s in enumerate(slots):
                    if s is not None:
                        mask[r, :, :s.shape[-1]] &= s[0]
            step.probe.key_masks[self.layer_idx] = mask
        return keys, values


class _StepCache(DynamicCache):
    """The cache object the model sees during one batched step over several row caches."""

    def __init__(self, caches: Sequence[TrackedCache], chunk_lengths: list[int], positions: torch.Tensor,
                 probe: AttentionProbe, buffers: StepBuffers):
        super().__init__()
        self.buffers = buffers
        self.caches, self.chunk_lengths = list(caches), chunk_lengths
        self.positions, self.probe = positions, probe
        self._row_meta: tuple[int, list] | None = None
        self.uniform = len(set(chunk_lengths)) == 1
        self.chunk_tensor = torch.tensor(chunk_lengths, device=positions.device)
        self.layer_class_to_replicate = None
        self.layers = [_StepLayer(self, i) for i in range(len(self.caches[0].layers))]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def row_meta(self, n_kv: int) -> list:
        """Per row: the new entries' per-KV-head positions, image flags and zero scores (same in every layer)."""
        if self._row_meta is None or self._row_meta[0] != n_kv:
            q = self.positions.shape[1]
            rows = []
            for r, q_r in enumerate(self.chunk_lengths):
                pos = self.positions[r:r + 1, q - q_r:]
                rows.append(per_head_meta(pos, torch.zeros_like(pos, dtype=torch.bool), n_kv))
            self._row_meta = (n_kv, rows)
        return self._row_meta[1]


# -- one forward over rows -----------------------------------------------------------------------------------

@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, V]: each row's last token
    attention: list[dict[int, torch.Tensor] | None]  # per row: layer -> last query's attention [1, Hkv, T_row]


def _row_attention(stats: dict[int, dict[str, torch.Tensor]], r: int, k: int, old_lengths: dict[int, list[int]],
                   chunk: int, q: int) -> dict[int, torch.Tensor]:
    """Row r's slice (the statistic's k-th row) of the batched last-query statistic, aligned with its own
    entries (old + new)."""
    out = {}
    for layer, s in stats.items():
        row = s["last_query"][k:k + 1]
        olds = old_lengths[layer]
        t_old = max(olds)
        out[layer] = torch.cat([row[..., :olds[r]], row[..., t_old + q - chunk:]], dim=-1)
    return out


VisionInputs = Union[torch.Tensor, Mapping[str, torch.Tensor], None]


def vision_kwargs(vision_inputs) -> dict[str, torch.Tensor]:
    """The image inputs of a forward as keyword arguments: pixel values alone (a tensor), or every image tensor
    the processor made (a mapping: pixel_values, and image_sizes / batch_num_images for the anyres families)."""
    if vision_inputs is None:
        return {}
    if isinstance(vision_inputs, torch.Tensor):
        return {"pixel_values": vision_inputs}
    return dict(vision_inputs)


@torch.inference_mode()
def forward_group(model, cache: TrackedCache, ids: torch.Tensor, start: int, probe: AttentionProbe | StatRequest,
                  image_flags: torch.Tensor | None = None, vision_inputs: VisionInputs = None,
                  inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
    """Feed `ids` [B, T] at true positions start..start+T-1 through ONE cache whose B rows share a layout (the
    plain path: no padding, no copies). Returns the last position's logits [B, V] and the statistics asked for
    (`probe`: what to record, and any key masks; a bare StatRequest when there are none).
    `vision_inputs`: see `vision_kwargs` (prefill only). `inputs_embeds` [B, T, H]: the input embeddings of
    `ids` already computed (a vision-side token reduction built them), fed instead of the ids."""
    b, t = ids.shape
    positions = torch.arange(start, start + t, device=ids.device).unsqueeze(0).expand(b, -1)
    flags = image_flags if image_flags is not None else torch.zeros_like(ids, dtype=torch.bool)
    cache.set_pending(positions, flags)
    if isinstance(probe, StatRequest):
        probe = AttentionProbe(probe)
    for layer, mask in cache.key_masks(t).items():  # heads that keep fewer entries: never attend to empty slots
        given = probe.key_masks.get(layer)
        probe.key_masks[layer] = mask if given is None else (mask & given)
    inputs = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {"input_ids": ids}
    out = model(**inputs, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1,
                kv_probe=probe, **vision_kwargs(vision_inputs))
    return out.logits[:, -1], probe.stats


def last_query(stats: dict[int, dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {l: s["last_query"] for l, s in stats.items()}


@torch.inference_mode()
def forward_rows(model, caches: Sequence[TrackedCache], chunks: Sequence[Sequence[int]], starts: Sequence[int],
                 want_attention: Sequence[bool], device: torch.device,
                 buffers: StepBuffers | None = None) -> StepOutput:
    """Feed row r the token ids `chunks[r]` at true positions starts[r]... through its own (batch-1) cache, all
    rows in one model call. `want_attention[r]`: return the last query's attention of row r (decode-time
    scoring), aligned with that row's entries. Pass the same `buffers` to every step of a turn to reuse the
    padded tensors."""
    b = len(caches)
    lengths = [len(c) for c in chunks]
    if min(lengths) < 1:
        raise ValueError("every row needs at least one token to feed")
    q = max(lengths)
    wanted = [r for r in range(b) if want_attention[r]]
    request = StatRequest(last_query=bool(wanted))
    if wanted and len(wanted) < b:
        request.last_query_rows = torch.tensor(wanted, device=device)
    probe = AttentionProbe(request)
    ids = torch.zeros(b, q, dtype=torch.long)
    positions = torch.zeros(b, q, dtype=torch.long)
    for r, (chunk, start) in enumerate(zip(chunks, starts)):
        pad = q - len(chunk)
        ids[r, pad:] = torch.as_tensor(list(chunk), dtype=torch.long)
        positions[r, :pad] = start  # padding: masked as keys, never stored; any position will do
        positions[r, pad:] = torch.arange(start, start + len(chunk))
    ids, positions = ids.to(device), positions.to(device)
    if b == 1:
        logits, stats = forward_group(model, caches[0], ids, starts[0], request)
        return StepOutput(logits, [last_query(stats) if want_attention[0] else None])
    step = _StepCache(caches, lengths, positions, probe, buffers if buffers is not None else StepBuffers())
    old_lengths = {i: layer.old_lengths for i, layer in enumerate(step.layers)}
    try:
        out = model(input_ids=ids, position_ids=positions, past_key_values=step, use_cache=True, logits_to_keep=1,
                    kv_probe=probe)
    finally:
        step.layers, step.caches = [], []  # the step and its layers point at each other: free the rows now, not
        # whenever the garbage collector next runs
    attention: list[dict[int, torch.Tensor] | None] = [None] * b
    for k, r in enumerate(wanted):
        attention[r] = _row_attention(probe.stats, r, k, old_lengths, lengths[r], q)
    return StepOutput(out.logits[:, -1], attention)


# -- the shared prefill -------------------------------------------------------------------------------------

@dataclass
class Prefill:
    cache: TrackedCache  # after the prompt, uncompressed, scores = prefill column sums
    stats: dict[int, dict[str, torch.Tensor]]  # layer -> every statistic recorded
    logits: torch.Tensor  # [B, V]: the last prompt position
    prompt_len: int  # tokens the language model saw (fewer than the prompt's after a vision-side reduction)
    seconds: float
    reduction: Any = None  # what a prefill token reduction did (own prefills), for the policy's plans and facts


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs: VisionInputs,
            policies: Sequence[Policy], num_layers: int, device: torch.device) -> Prefill:
    """One prefill (batch = prompts of equal length) recording every statistic the given policies asked for.
    `vision_inputs`: the pixel values, or every image tensor the processor made (see `vision_kwargs`)."""
    n = ids.shape[1]
    request = StatRequest.union([StatRequest(colsum=True)] + [p.prefill_stats(n) for p in policies])
    cache = TrackedCache(num_layers)
    t0 = now(device)
    logits, stats = forward_group(model, cache, ids, 0, request, is_image, vision_inputs)
    seconds = now(device) - t0
    cache.add_scores({l: s["colsum"] for l, s in stats.items()})
    return Prefill(cache, stats, logits, n, seconds)


@torch.inference_mode()
def own_prefill(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs: VisionInputs,
                num_layers: int, device: torch.device, image_token_id: int | None = None) -> Prefill:
    """The prefill of a method that changes the prefill itself (stage "prefill token reduction"), run for it
    alone: a vision-side reduction (`policy.vision_plan`, VisionZip) feeds the language model a shorter prompt,
    and key masks decided during the forward (`policy.prefill_key_masks`, FastV) keep later layers from
    attending to dropped tokens. Records what the policy asked for; `reduction` says what was done."""
    from . import vision_tokens

    t0 = now(device)
    embeds, reduction = None, None
    if vision_inputs is not None and image_token_id is not None and bool(is_image.any()):
        reduced = vision_tokens.reduce_image(model, policy, ids, is_image, vision_inputs, image_token_id)
        if reduced is not None:  # the language model sees the reduced image block instead
            ids, is_image, embeds, reduction = reduced.ids, reduced.is_image, reduced.inputs_embeds, reduced.record
            vision_inputs = None
    n = ids.shape[1]
    request = StatRequest.union([StatRequest(colsum=True), policy.prefill_stats(n)])
    probe = AttentionProbe(request, mask_rule=policy.prefill_key_masks(n, is_image, num_layers))
    cache = TrackedCache(num_layers)
    logits, stats = forward_group(model, cache, ids, 0, probe, is_image, vision_inputs, inputs_embeds=embeds)
    seconds = now(device) - t0
    cache.add_scores({l: s["colsum"] for l, s in stats.items()})
    return Prefill(cache, stats, logits, n, seconds, reduction)


def prefill_for(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs: VisionInputs,
                num_layers: int, device: torch.device, image_token_id: int | None = None) -> Prefill:
    """The prefill `policy` compresses when it runs alone: its own (a prefill token reduction), else a plain one
    recording the statistics it asks for."""
    if policy.own_prefill():
        return own_prefill(model, policy, ids, is_image, vision_inputs, num_layers, device, image_token_id)
    return prefill(model, ids, is_image, vision_inputs, [policy], num_layers, device)


def policy_stats(policy: Policy, stats: dict[int, dict[str, torch.Tensor]], prompt_len: int,
                 row: slice | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """The statistics `policy` asked for, under the names it reads ("colsum", "window", "subset",
    "last_query"), cut to `row` when the prefill ran several prompts at once."""
    asked = policy.prefill_stats(prompt_len)
    out = {}
    for layer, s in stats.items():
        mine = {"colsum": s["colsum"]}
        if asked.window > 0:
            mine["window"] = s[f"window:{asked.window}"]
        if asked.query_subset is not None:
            mine["subset"] = s["subset"]
        if asked.last_query:
            mine["last_query"] = s["last_query"]
        out[layer] = {k: v[row] for k, v in mine.items()} if row is not None else mine
    return out


# -- policy calls: the one place the runner talks to policies ------------------------------------------------

def compress_prefill(policy: Policy, cache: TrackedCache, stats: dict[int, dict[str, torch.Tensor]],
                     prompt_len: int, budget: float, reduction: Any = None, reduced_by: int = 0) -> PolicyState:
    """Let `policy` compress the prompt's cache in place; returns the policy's per-run state (what this run
    found; `compress_decode` and `policy.facts` take it). `reduction`, `reduced_by`: what an own prefill did
    and how many prompt tokens it kept from the language model (`Prefill.reduction`, N - prompt_len)."""
    window = policy.prefill_stats(prompt_len).window
    plans, state = policy.prefill(PrefillView(cache, stats, prompt_len, budget, window, reduction))
    apply_plans(cache, plans)
    # equal-memory mode: a prompt-only method starts at r·N too (LOOK-M's text may exceed it)
    apply_plans(cache, policy.equal_memory_plans(DecodeView(cache, prompt_len, prompt_len, 0,
                                                            reduced_by=reduced_by), state))
    return state


def compress_decode(policy: Policy, state: PolicyState, cache: TrackedCache, true_len: int, prompt_len: int,
                    step: int, attention: dict[int, torch.Tensor] | None, reduced_by: int = 0) -> None:
    """After new tokens were fed: accumulate their attention into the scores, then let `policy` compress (and,
    in equal-memory mode, hold a prompt-only method at r·N_t, N_t counting the `reduced_by` tokens an own
    prefill kept from the language model)."""
    if attention is not None:
        cache.add_scores(attention)
    view = DecodeView(cache, true_len, prompt_len, step, attention, reduced_by)
    apply_plans(cache, policy.decode(view, state))
    apply_plans(cache, policy.equal_memory_plans(view, state))
