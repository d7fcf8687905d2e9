"""One forward pass over many rows, each with its own compressed cache, and the policy calls around it.

A row is one method's conversation (or, in the speed benchmark, one method on one sample). Every row owns a
batch-1 `TrackedCache` whose layers hold different numbers of entries, per layer and per row. `forward_rows`
feeds each row its next tokens in ONE model call:

- a decode step (one token per row) reads the rows where they live: per layer, the rows sit in shared stores
  (`StepBuffers`: one group, or two when one method keeps far more entries than the rest; row k of a group =
  its k-th row's entries, moved in once), each row's new entry is written after its entries in place, and
  attention reads a group's first T entries through a key mask of its rows' lengths. No step copies anything
  that grows with the cache;
- a multi-token step (a follow-up's tokens) lays the rows out as `[row's entries | padding | this step's
  tokens]` so bottom-right causal alignment holds; shorter chunks are left-padded, the padding tokens are
  masked as keys and never stored;
- the new entries join each row's own cache with their true positions, and the decode-time statistic (the
  last query's attention) is cut back to each row's own entries.

Decoding on a CPU, or a large model at small batch on a GPU, is bound by reading the weights, so nine rows
in one pass cost little more than one. A single row takes the plain path (no padding, no copies).

The prefills live here too: `prefill` is the one shared by the methods that compress its cache, `own_prefill`
that of a method changing the prefill itself (a prefill token reduction: FastV and DART cut their dropped image
tokens from the sequence at layer K, so the later layers never compute them nor cache their entries
(`token_drop`); VisionZip feeds a shorter prompt); its row then decodes in the same batch at its own true
positions. In a comparison both read one pass of the vision tower (`vision_tower.TurnImage`), fed as input
embeddings. So do the policy calls (`compress_prefill`, `compress_decode`), so the engine and the benchmarks run
methods the same way.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..kv.attention import (AttentionProbe, StatRequest, StepSubset, hidden_states_recorded, post_vision_queries,
                            raters_chosen)
from ..kv.cache import META_FIELDS, TrackedCache, TrackedLayer, per_head_meta, write_step_metadata
from ..kv.stores import SPARE_ENTRIES
from ..models.compat import cache_kwarg
from ..models.families import hooks_of, uses_mrope
from ..policies import Policy, PolicyState
from ..policies.base import DecodeView, LayerPlan, PrefillView, apply_plans, apply_plans_together
from ..policies.equal_memory import EqualMemoryHold
from .step_attention import RowAttention, StepAttention
from .step_buffers import StepBuffers
from .stopwatch import Elapsed, Stopwatch
from .token_drop import tokens_dropped
from .vision_tower import TurnImage


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """A timestamp after all queued device work has finished (honest CUDA timings)."""
    sync(device)
    return time.perf_counter()


class _InPlaceDecodeLayer(DynamicLayer):
    """One layer of a batched decode step (one new token per row): each row's new entry is written after its
    entries in the shared stores, in place, and attention reads all rows through their lengths."""

    def __init__(self, step: "_InPlaceDecodeCache", layer_idx: int):
        super().__init__()
        self.step, self.layer_idx = step, layer_idx
        self.is_initialized = True
        self.new_lengths: list[int] = []
        self.scores_home = None  # after `update`: the shared store of every row's scores, or None

    def get_seq_length(self) -> int:
        return max(c.layers[self.layer_idx].length for c in self.step.caches)

    def update(self, key_states, value_states, *args, **kwargs):
        step = self.step
        if self.layer_idx == 0 and not step.buffers.holds_batch(len(step.caches)):
            # a new batch (a method left it): every layer's stores at once, stacked where they can be
            step.buffers.form([[c.layers[i] for c in step.caches] for i in range(len(step.layers))])
        if self.layer_idx == 0:
            step.meta_written = step.write_every_layers_meta(key_states.shape[1])
        rows = [c.layers[self.layer_idx] for c in step.caches]
        # the first layer found every layer's groups already (nothing moves rows between layers of one step)
        groups = step.groups_by_layer[self.layer_idx] if step.groups_by_layer else \
            step.buffers.groups(self.layer_idx, rows)
        quantised = [r for r, layer in enumerate(rows) if layer.segments]
        for r in quantised:
            step.buffers.refresh_row(self.layer_idx, r, rows[r])
        self.new_lengths = [0] * len(rows)
        found = [self._append(g, rows, key_states, value_states) for g in groups]
        # where every row's scores live, in the step's order, when that is one shared store (`step_attention`)
        self.scores_home = groups[0].stores["scores"] if len(groups) == 1 and groups[0].whole else None
        for r in quantised:  # its own storage gets the new entry too (in place when it views the working copy)
            layer = rows[r]
            if step.buffers.took_step_entry(self.layer_idx, r, layer):
                continue
            self.scores_home = None  # this row's scores are its own
            layer.append(key_states[r:r + 1], value_states[r:r + 1])
            layer.append_meta_per_head(*step.row_meta(r, key_states.shape[1]), has_image=False)
            step.buffers.refreshed(self.layer_idx, r, layer)
        if len(found) == 1:
            keys, values, mask = found[0]
            if mask is not None:
                step.probe.key_masks[self.layer_idx] = mask
            return keys, values
        # rows in two groups: attention reads each group where it lives (the probe carries them)
        step.probe.row_groups[self.layer_idx] = [(g.index, *f) for g, f in zip(groups, found)]
        return found[0][0], found[0][1]

    def _append(self, group, rows, key_states, value_states):
        """Write the new entry of every row of `group` after its entries, in place; its keys and values as
        attention reads them (the first T entries, T its longest row) and their key mask (None: every entry)."""
        step, stores = self.step, group.stores
        if not group.whole:
            key_states, value_states = key_states.index_select(0, group.index), value_states.index_select(0, group.index)
        b, h = key_states.shape[:2]
        old = list(stores["keys"].lengths)
        ends = step.lengths_before(self.layer_idx) if group.whole else None
        known = ends is not None and step.row_lengths[self.layer_idx] == old  # the step's tensors hold them
        if not known:
            ends = torch.tensor(old, device=key_states.device)
        if max(old) + 1 > min(store.capacity for store in stores.values()):
            for store in stores.values():
                store.reserve(max(old) + 1)
        # row k's next slot in every head: one scatter per field for all rows (the metadata's done already when
        # the step wrote every layer's at once)
        if not (step.meta_written and group.whole):
            positions = step.positions[:, :1] if group.whole else step.positions.index_select(0, group.index)[:, :1]
            at = ends.view(b, 1, 1)
            stores["positions"].write_after_each_row(at.expand(b, h, 1), positions[:, :, None].expand(b, h, 1))
            stores["is_image"].write_after_each_row(at.expand(b, h, 1), False)  # steps feed text, never images
            stores["scores"].write_after_each_row(at.expand(b, h, 1), 0.0)
        d_k, d_v = key_states.shape[-1], value_states.shape[-1]
        at = step.append_index(self.layer_idx, h, d_k) if known else None
        if at is None or d_v != d_k:
            at = ends.view(b, 1, 1, 1)
            at_k, at_v = at.expand(b, h, 1, d_k), at.expand(b, h, 1, d_v)
        else:
            at_k = at_v = at
        stores["keys"].write_after_each_row(at_k, key_states)
        stores["values"].write_after_each_row(at_v, value_states)
        new = [n + 1 for n in old]
        for store in stores.values():
            store.set_row_lengths(new)
        for r, n in zip(group.rows, new):
            self.new_lengths[r] = n
        t = max(new)
        mask = None
        empty_slots = any(rows[r].has_empty_slots for r in group.rows)
        if empty_slots or min(old) != max(old):
            # [B, 1, T]: a row's entries and its new one
            mask = step.key_mask(self.layer_idx, t) if known else (step.slots(t) <= ends[:, None])[:, None, :]
            if empty_slots:
                mask = mask & (stores["positions"].leading(t) >= 0)
        return stores["keys"].leading(t), stores["values"].leading(t), mask


def _in_order(starts: torch.Tensor, order: list[int]) -> torch.Tensor:
    """A stack's slots [layers of the stack, ...] for the step's layers, which are these layers of it."""
    return starts if order == list(range(starts.shape[0])) else starts[order]


class _InPlaceDecodeCache(DynamicCache):
    """The cache object the model sees during one batched decode step over several row caches: one new token a row,
    appended in place into the rows' shared stores (`_PaddedChunkCache` takes chunks of several tokens)."""

    def __init__(self, caches: Sequence[TrackedCache], positions: torch.Tensor, probe: AttentionProbe,
                 buffers: StepBuffers):
        super().__init__()
        self.buffers, self.caches, self.positions, self.probe = buffers, list(caches), positions, probe
        self._row_meta: dict[tuple[int, int], tuple] = {}
        self._slots: torch.Tensor | None = None
        self.layer_class_to_replicate = None
        self.layers = [_InPlaceDecodeLayer(self, i) for i in range(len(self.caches[0].layers))]
        self.row_lengths: list[list[int]] = []  # per layer: each row's entries before this step
        self.meta_written = False  # every layer's new position, image flag and score written at the first layer
        self.groups_by_layer: list | None = None  # every layer's row groups, when the first layer found them

    def write_every_layers_meta(self, n_kv: int) -> bool:
        """At the step's first layer: every layer's new entries' positions, image flags (none: steps feed text) and
        zero scores written at once, three operators for the whole step instead of three a layer, when every
        layer holds all the rows in one group of stacked stores (`StepBuffers.form`; a quantised row's working copy
        too, which its own stores view or, unlinked, take the entry themselves). False, writing nothing: each layer
        writes its own."""
        layers = range(len(self.layers))
        rows = [[c.layers[i] for c in self.caches] for i in layers]
        groups = self.groups_by_layer = [self.buffers.groups(i, rows[i]) for i in layers]
        if any(len(g) != 1 or not g[0].whole for g in groups):
            return False
        stacks = {name: groups[0][0].stores[name].stack for name in META_FIELDS}
        if any(stack is None or any(g[0].stores[name].stack is not stack for g in groups)
               for name, stack in stacks.items()):
            return False
        self.lengths_before(0)
        for g, lengths in zip(groups, self.row_lengths):  # room for the new entry first, in every field alike
            for store in g[0].stores.values():
                store.reserve(max(lengths) + 1)
        positions = self.positions[:, 0]  # [B]
        made: dict[tuple, torch.Tensor] = {}  # the fields' stacks share a layout: their slots are made once
        slots: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for name in META_FIELDS:
                order = [g[0].stores[name].stack_layer for g in groups]
                layout = (tuple(stacks[name].capacities), tuple(order))
                if layout not in made:  # each row's next slot, every layer and head, as one index
                    made[layout] = self.buffers.step_lengths.meta_slots(
                        (*layout, stacks[name].rows, stacks[name].heads),
                        lambda stack=stacks[name], order=order: _in_order(stack.first_slots(positions.device), order))
                slots[name] = made[layout]
        write_step_metadata(stacks, slots, len(groups), positions)
        return True

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def lengths_before(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s row lengths before this step as a tensor [B], for every layer at once at the first
        layer (`StepLengths`: moved on from the last step's in place). `row_lengths` says what they hold."""
        if not self.row_lengths:
            self.row_lengths = [[c.layers[i].length for c in self.caches] for i in range(len(self.layers))]
            self.buffers.step_lengths.start(self.row_lengths, self.positions.device)
        return self.buffers.step_lengths.layer_ends(layer_idx)

    def key_mask(self, layer_idx: int, t: int) -> torch.Tensor:
        """[B, 1, t]: True up to and including each row's new entry, from `lengths_before`."""
        return self.buffers.step_lengths.key_mask(layer_idx, t)

    def append_index(self, layer_idx: int, heads: int, dim: int) -> torch.Tensor:
        """Layer `layer_idx`'s scatter index for the step's new keys ([B, heads, 1, dim]: each row's next slot, from
        `lengths_before`)."""
        return self.buffers.step_lengths.append_index(layer_idx, heads, dim)

    def slots(self, t: int) -> torch.Tensor:
        """0, 1, ..., t - 1 (made once per step, long enough for every layer)."""
        if self._slots is None or self._slots.shape[0] < t:
            self._slots = torch.arange(t + SPARE_ENTRIES, device=self.positions.device)
        return self._slots[:t]

    def row_meta(self, r: int, n_kv: int) -> tuple:
        """Row r's new entry as per-KV-head position, image flag and zero score (the same in every layer)."""
        found = self._row_meta.get((r, n_kv))
        if found is None:
            pos = self.positions[r:r + 1]
            found = self._row_meta[(r, n_kv)] = per_head_meta(pos, torch.zeros_like(pos, dtype=torch.bool), n_kv)
        return found


class _PaddedChunkLayer(DynamicLayer):
    """One layer of a batched step: appends each row's new entries to that row's own layer and returns the
    padded keys/values of all rows, registering the padding mask on the probe."""

    def __init__(self, step: "_PaddedChunkCache", layer_idx: int):
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


class _PaddedChunkCache(DynamicCache):
    """The cache object the model sees during one batched forward of a chunk of several tokens a row (a follow-up's
    prompt, a question fed after compression) over several row caches: rows of different lengths padded into one
    forward (`_InPlaceDecodeCache` is the one-token decode step's)."""

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
        self.layers = [_PaddedChunkLayer(self, i) for i in range(len(self.caches[0].layers))]

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
    attention: list[Mapping[int, torch.Tensor] | None]  # per row: layer -> last query's attention [1, Hkv, T_row]


def _row_attention(stats: dict[int, dict[str, torch.Tensor]], r: int, old_lengths: dict[int, list[int]],
                   chunk: int, q: int) -> dict[int, torch.Tensor]:
    """Row r's slice of the batched last-query statistic, aligned with its own entries (old + new)."""
    out = {}
    for layer, s in stats.items():
        row = s["last_query"][r:r + 1]
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
                  inputs_embeds: torch.Tensor | None = None, rope_inputs: VisionInputs = None,
                  given_positions: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
    """Feed `ids` [B, T] at true positions start..start+T-1 through ONE cache whose B rows share a layout (the
    plain path: no padding, no copies). Returns the last position's logits [B, V] and the statistics asked for
    (`probe`: what to record, and any key masks; a bare StatRequest when there are none).
    `vision_inputs`: see `vision_kwargs` (prefill only). `inputs_embeds` [B, T, H]: the input embeddings of
    `ids` already computed (a vision-side token reduction built them), fed instead of the ids. `rope_inputs`: the
    prompt's image tensors when `vision_inputs` is not fed (its image grids give a 3-D-position model its prompt's
    positions; see `model_positions`). `given_positions`: a prompt's 3-D positions [3, B, T] and rope deltas [B]
    already known (a vision-side reduction on Qwen keeps those of the unreduced prompt), used as they are."""
    b, t = ids.shape
    # a decode step's one position made by one operator (it runs every step), a prompt's by a range
    positions = torch.full((b, 1), start, device=ids.device) if t == 1 else \
        torch.arange(start, start + t, device=ids.device).unsqueeze(0).expand(b, -1)
    flags = image_flags if image_flags is not None else _no_image(b, t, ids.device)
    cache.set_pending(positions, flags, has_image=None if image_flags is not None else False, first_position=start)
    if given_positions is not None:
        model_pos, cache.rope_deltas = (x.to(ids.device) for x in given_positions)
    else:
        model_pos = model_positions(model, cache, ids, positions, start,
                                    vision_inputs if rope_inputs is None else rope_inputs)
    if isinstance(probe, StatRequest):
        probe = AttentionProbe(probe)
    if probe.request.post_vision is not None and probe.after_image is None:
        probe.after_image = post_vision_queries(flags)
    for layer, mask in cache.key_masks(t).items():  # heads that keep fewer entries: never attend to empty slots
        given = probe.key_masks.get(layer)
        probe.key_masks[layer] = mask if given is None else (mask & given)
    inputs = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {"input_ids": ids}
    with hidden_states_recorded(model, probe):
        out = model(**inputs, position_ids=model_pos, **cache_kwarg(cache), use_cache=True, logits_to_keep=1,
                    kv_probe=probe, **vision_kwargs(vision_inputs))
    return out.logits[:, -1], probe.stats


@functools.lru_cache(maxsize=32)
def _no_image(b: int, t: int, device: torch.device) -> torch.Tensor:
    """All-False image flags [b, t] (a step's text tokens), made once per shape: nothing writes into them."""
    with torch.inference_mode():
        return torch.zeros(b, t, dtype=torch.bool, device=device)


def model_positions(model, cache: TrackedCache, ids: torch.Tensor, positions: torch.Tensor, start: int,
                    rope_inputs: VisionInputs = None) -> torch.Tensor:
    """The position ids the model is given for tokens at true `positions` [B, T] of `cache`: the true ones, or for a
    model with 3-D rotary positions (Qwen-VL) the logical ones: a prompt's from the model's own rope index (its
    image grids from `rope_inputs`), which also sets the cache's rope deltas; every later text token's its true
    position plus the cache's delta, on all three axes; a later turn with images (`rope_inputs` holding their
    grids) the rope index of its own tokens from its first logical position, its delta added to the cache's.
    The cache keeps the true positions either way."""
    if not uses_mrope(model.config):
        return positions
    grids = rope_inputs is not None and not isinstance(rope_inputs, torch.Tensor) and \
        rope_inputs.get("image_grid_thw") is not None
    if start == 0 and cache.rope_deltas is None:
        logical, deltas = hooks_of(model.config).rope_index(model, ids, rope_inputs)
        cache.rope_deltas = deltas.to(positions.device)
        return logical.to(positions.device)
    if grids and start > 0:  # a follow-up's images: their grids from where the turn starts
        logical, deltas = hooks_of(model.config).rope_index(model, ids, rope_inputs)
        before = cache.rope_deltas if cache.rope_deltas is not None else torch.zeros(ids.shape[0], dtype=torch.long)
        logical = logical.to(positions.device) + (start + before.to(positions.device)).view(1, -1, 1)
        cache.rope_deltas = before.to(positions.device) + deltas.to(positions.device)
        return logical
    return logical_positions(positions, [cache])


def logical_positions(positions: torch.Tensor, caches: Sequence[TrackedCache]) -> torch.Tensor:
    """[3, B, T]: true positions [B, T] plus each row's rope delta (row r: caches[r], or the one cache's rows)."""
    if len(caches) == 1:
        deltas = caches[0].rope_deltas
    else:
        deltas = torch.cat([c.rope_deltas if c.rope_deltas is not None else torch.zeros(1, dtype=torch.long)
                            for c in caches])
    if deltas is not None:
        positions = positions + deltas.to(positions.device).view(-1, 1)
    return positions.unsqueeze(0).expand(3, -1, -1)


def last_query(stats: dict[int, dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {l: s["last_query"] for l, s in stats.items()}


def attention_wanted(policy: Policy, state: PolicyState | None):
    """What a row's decode step must record for `policy` (`forward_rows`' want_attention): False, True (every
    layer's attention) or the layers it reads (`Policy.decode_attention_layers`)."""
    if not policy.decode_needs_attention():
        return False
    layers = policy.decode_attention_layers(state)
    return True if layers is None else tuple(layers)


def _wants(want) -> bool:
    """Whether a row wants attention (`attention_wanted`): True, or a tuple of layers, even an empty one (a decode
    step then records no layer for it, a chunk of several tokens every layer)."""
    return want is True or isinstance(want, tuple)


@torch.inference_mode()
def forward_rows(model, caches: Sequence[TrackedCache], chunks: Sequence[Sequence[int]], starts: Sequence[int],
                 want_attention: Sequence[bool | tuple], device: torch.device,
                 buffers: StepBuffers | None = None, subsets: Sequence[Any] | None = None) -> StepOutput:
    """Feed row r the token ids `chunks[r]` at true positions starts[r]... through its own (batch-1) cache, all
    rows in one model call. `want_attention[r]`: return the last query's attention of row r (decode-time
    scoring), aligned with that row's entries: True for every layer's, a tuple of layers for those layers' only
    in a decode step (it then records the others for no row, when no row wants them all; an empty tuple: none; a
    chunk of several tokens records every layer for it; `attention_wanted`).
    `subsets[r]`: (L, choose) when, in a decode step, row r's layers from L on attend to a subset of its entries
    (`Policy.step_subset`; the row must want attention). Pass the same `buffers` to every step of a turn to reuse
    the padded tensors."""
    b = len(caches)
    if min(len(c) for c in chunks) < 1:
        raise ValueError("every row needs at least one token to feed")
    subsets = list(subsets) if subsets is not None else [None] * b
    if any(s is not None and not _wants(want) for s, want in zip(subsets, want_attention)):
        raise ValueError("a row that attends to a subset of its entries must want its attention")
    order = _row_order(want_attention)
    wanted = sum(map(_wants, want_attention))
    layers = None
    if wanted and not any(want is True for want in want_attention):
        layers = tuple(sorted({int(i) for want in want_attention if _wants(want) for i in want}))
    if order == list(range(b)):
        return _forward_ordered_rows(model, caches, chunks, starts, wanted, device, buffers, subsets, layers)
    out = _forward_ordered_rows(model, [caches[r] for r in order], [chunks[r] for r in order],
                                [starts[r] for r in order], wanted, device, buffers,
                                [subsets[r] for r in order], layers)
    at = {r: k for k, r in enumerate(order)}
    back = torch.tensor([at[r] for r in range(b)], device=out.logits.device)
    return StepOutput(out.logits.index_select(0, back), [out.attention[at[r]] for r in range(b)])


def _row_order(want_attention: Sequence[bool]) -> list[int]:
    """The order a batched step holds its rows in (stable): the rows that want attention first."""
    return sorted(range(len(want_attention)), key=lambda r: not _wants(want_attention[r]))


def form_batch(caches: Sequence[TrackedCache], want_attention: Sequence[bool], buffers: StepBuffers) -> None:
    """Move the rows of the coming decode steps into `buffers`' shared stores now, every layer, in the order
    `forward_rows` holds them (given the same `want_attention`), so that the steps only append
    (as a plain loop builds its batch cache before it decodes). Optional: a step moves in whatever row is not
    there yet."""
    if len(caches) < 2:
        return
    rows = [caches[r] for r in _row_order(want_attention)]
    with torch.inference_mode():
        buffers.form([[c.layers[i] for c in rows] for i in range(len(rows[0].layers))])


def _forward_ordered_rows(model, caches: Sequence[TrackedCache], chunks: Sequence[Sequence[int]],
                          starts: Sequence[int], wanted: int, device: torch.device,
                          buffers: StepBuffers | None, subsets: Sequence[Any] = (),
                          layers: tuple[int, ...] | None = None) -> StepOutput:
    """`forward_rows` with the rows that want attention first (the first `wanted` rows): the attention function
    then computes their statistic on a view of the batch."""
    b = len(caches)
    lengths = [len(c) for c in chunks]
    q = max(lengths)
    request = StatRequest(last_query=wanted > 0)
    if 0 < wanted < b:
        request.last_query_rows = wanted
    if q == 1:
        request.last_query_layers = layers
    probe = AttentionProbe(request)
    if q == 1 and any(s is not None for s in subsets):  # DyCoke's per-step subsets, from their layers on
        probe.subset = StepSubset([((r,), first, choose) for r, s in enumerate(subsets) if s is not None
                                   for first, choose in (s,)])
    # built as lists and made one tensor each: a step's operators do not grow with its rows
    ids = torch.tensor([[0] * (q - len(chunk)) + [int(t) for t in chunk] for chunk in chunks], device=device)
    # padding: masked as keys, never stored; any position will do
    positions = torch.tensor([[start] * (q - len(chunk)) + list(range(start, start + len(chunk)))
                              for chunk, start in zip(chunks, starts)], device=device)
    if b == 1:
        logits, stats = forward_group(model, caches[0], ids, starts[0], probe)
        return StepOutput(logits, [last_query(stats) if wanted else None])
    buffers = buffers if buffers is not None else StepBuffers()
    if q == 1:  # a decode step: rows append in place in the shared stores
        step = _InPlaceDecodeCache(caches, positions, probe, buffers)
    else:
        step = _PaddedChunkCache(caches, lengths, positions, probe, buffers)
    try:
        given = logical_positions(positions, caches) if uses_mrope(model.config) else positions
        out = model(input_ids=ids, position_ids=given, **cache_kwarg(step), use_cache=True, logits_to_keep=1,
                    kv_probe=probe)
        attention: list[Mapping[int, torch.Tensor] | None] = [None] * b
        if q == 1:  # row r's entries are the first ones of its row
            if wanted:
                recorded = {i: probe.stats[i]["last_query"] for i in range(len(step.layers)) if i in probe.stats}
                homes = {i: step.layers[i].scores_home for i in recorded if step.layers[i].scores_home is not None}
                new_lengths = {i: step.layers[i].new_lengths for i in recorded}
                attention[:wanted] = StepAttention(recorded, new_lengths, wanted, homes).rows()
        else:
            old_lengths = {i: layer.old_lengths for i, layer in enumerate(step.layers)}
            for r in range(wanted):
                attention[r] = _row_attention(probe.stats, r, old_lengths, lengths[r], q)
    finally:
        step.layers, step.caches = [], []  # the step and its layers point at each other: free the rows now, not
        # whenever the garbage collector next runs
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
            policies: Sequence[Policy], num_layers: int, device: torch.device,
            turn_image: TurnImage | None = None, inputs_embeds: torch.Tensor | None = None) -> Prefill:
    """One prefill (batch = prompts of equal length) recording every statistic the given policies asked for.
    `vision_inputs`: the pixel values, or every image tensor the processor made (see `vision_kwargs`).
    `turn_image`: the image already through the vision tower (or to be, by whichever prefill asks first): the
    language model is fed its input embeddings instead of the pixel values. `inputs_embeds` [B, N, H]: the
    prompts' input embeddings already made (several conversations' prompts stacked, `prefill_pool.py`)."""
    n = ids.shape[1]
    request = StatRequest.union([StatRequest(colsum=True)] + [p.prefill_stats(n) for p in policies])
    cache = TrackedCache(num_layers)
    t0 = now(device)
    embeds = inputs_embeds
    if embeds is None and turn_image is not None:
        embeds = turn_image.prompt_embeds(ids, is_image)
    pixels = vision_inputs if embeds is None else None
    logits, stats = forward_group(model, cache, ids, 0, request, is_image, pixels, inputs_embeds=embeds,
                                  rope_inputs=vision_inputs)
    seconds = now(device) - t0
    cache.add_scores({l: s["colsum"] for l, s in stats.items()})
    return Prefill(cache, stats, logits, n, seconds)


@torch.inference_mode()
def own_prefill(model, policy: Policy, ids: torch.Tensor, is_image: torch.Tensor, vision_inputs: VisionInputs,
                num_layers: int, device: torch.device, image_token_id: int | None = None,
                turn_image: TurnImage | None = None, frames=None) -> Prefill:
    """The prefill of a method that changes the prefill itself (stage "prefill token reduction"), run for it
    alone: a vision-side reduction (`policy.vision_plan`, VisionZip) feeds the language model a shorter prompt,
    and token drops decided during the forward (`policy.prefill_token_drops`, FastV; PyramidDrop's stages) leave
    tokens behind after a layer (`token_drop`). Records what the policy asked for; `reduction` says what was done.
    `turn_image`: the image already through the vision tower (see `prefill`), read instead of a pass of its own.
    `frames`: where a video's frames lie among the image tokens (`ImageLayout.frame_tokens`), for the token drops."""
    from . import vision_tokens

    t0 = now(device)
    embeds, reduction, given = None, None, None
    own_features = None  # Qwen3-VL's reduced features, read by the model's forward (DeepStack included)
    if vision_inputs is not None and image_token_id is not None and bool(is_image.any()):
        if turn_image is None and vision_tokens.has_vision_plan(policy):  # its one pass also feeds an unreduced image
            turn_image = TurnImage(model, vision_kwargs(vision_inputs), record=True)
        reduced = vision_tokens.reduce_image(model, policy, ids, is_image, vision_inputs, image_token_id, turn_image)
        if reduced is not None:  # the language model sees the reduced image block instead
            ids, is_image, embeds, reduction = reduced.ids, reduced.is_image, reduced.inputs_embeds, reduced.record
            if reduced.positions is not None:
                given = (reduced.positions, reduced.rope_deltas)
            if reduced.encoder_outputs is not None:
                own_features = {"mm_encoder_outputs": reduced.encoder_outputs}
    if embeds is None and own_features is None and turn_image is not None and _tower_shared(model):
        embeds = turn_image.prompt_embeds(ids, is_image)  # the image as the model's own path encodes it, once a turn
    rope_inputs = vision_inputs
    if embeds is not None or own_features is not None:
        vision_inputs = own_features
    n = ids.shape[1]
    sparse = policy.prefill_sparsity(n)
    # a sparse prefill records the probe queries' sums only: the column sums of every query would cost the dense
    # attention it saves
    request = StatRequest.union([StatRequest(colsum=sparse is None), policy.prefill_stats(n)])
    probe = AttentionProbe(request, sparse=sparse)
    cache = TrackedCache(num_layers)
    drops = policy.prefill_token_drops(n, is_image, num_layers, frames=frames)
    dropping = tokens_dropped(model, drops, cache, probe) if drops else contextlib.nullcontext()
    rating = raters_chosen(model, probe, policy.choose_raters, is_image) if request.rated else contextlib.nullcontext()
    with dropping, rating:
        logits, stats = forward_group(model, cache, ids, 0, probe, is_image, vision_inputs, inputs_embeds=embeds,
                                      rope_inputs=rope_inputs, given_positions=given)
    seconds = now(device) - t0
    cache.add_scores({l: s["colsum"] if "colsum" in s else s["subset"] for l, s in stats.items()})
    return Prefill(cache, stats, logits, n, seconds, reduction)


def _tower_shared(model) -> bool:
    """Whether the model's forward reads nothing of the images but their embeddings (not Qwen3-VL's DeepStack)."""
    from ..models.errors import ModelLoadError

    try:
        return hooks_of(model.config).tower_shared(model.config)
    except ModelLoadError:  # a model outside the registry's families: a LLaVA-style forward
        return True


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
    "last_query", "rated", "post_vision" and "post_vision_sparse", and "keys" and "hidden" in the layers that
    asked), cut to `row` when the prefill ran several prompts at once."""
    asked = policy.prefill_stats(prompt_len)
    out = {}
    for layer, s in stats.items():
        # "important": the tokens a sparse prefill attended with (a prefill of its own records no column sums)
        mine = {name: s[name] for name in ("colsum", "important") if name in s}
        if asked.window > 0:
            mine["window"] = s[f"window:{asked.window}"]
        if asked.query_subset is not None:
            mine["subset"] = s["subset"]
        if asked.last_query:
            mine["last_query"] = s["last_query"]
        if asked.rated and "rated" in s:
            mine["rated"] = s["rated"]
        if asked.post_vision is not None:
            mine["post_vision"], mine["post_vision_sparse"] = s["post_vision"], s["post_vision_sparse"]
        mine.update({name: s[name] for name, layers in (("keys", asked.keys), ("hidden", asked.hidden))
                     if layer in layers})
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
    # a second pass (the equal-memory hold: a prompt-only method starts at r·N too; LOOK-M's text may exceed it)
    apply_plans(cache, policy.after_plans(DecodeView(cache, prompt_len, prompt_len, 0, reduced_by=reduced_by), state))
    if policy.keeps_budget_while_decoding() or isinstance(policy, EqualMemoryHold):
        cache.stack_layers()  # it evicts every step: from every layer at once
    else:
        cache.stack_layers(META_FIELDS)  # a prompt-only cache only grows: its steps' metadata written at once
    return state


def compress_decode(policy: Policy, state: PolicyState, cache: TrackedCache, true_len: int, prompt_len: int,
                    step: int, attention: dict[int, torch.Tensor] | None, reduced_by: int = 0) -> None:
    """After new tokens were fed: accumulate their attention into the scores, then let `policy` compress (and,
    in equal-memory mode, hold a prompt-only method at r·N_t, N_t counting the `reduced_by` tokens an own
    prefill kept from the language model)."""
    row = DecodeRow(policy, state, cache, true_len, prompt_len, step, attention, reduced_by)
    apply_plans(cache, row.plans())
    row.hold()


@dataclass
class DecodeRow:
    """One row of a step, as its policy sees it after the step's tokens were fed (what `compress_decode` takes)."""

    policy: Policy
    state: PolicyState
    cache: TrackedCache
    true_len: int
    prompt_len: int
    step: int
    attention: Mapping[int, torch.Tensor] | None = None
    reduced_by: int = 0

    def view(self) -> DecodeView:
        return DecodeView(self.cache, self.true_len, self.prompt_len, self.step, self.attention, self.reduced_by)

    def plans(self) -> list[LayerPlan | None] | None:
        """Accumulate the step's attention into the scores (unless the step added every row's at once); the
        policy's plans for this step."""
        if self.attention is not None and not getattr(self.attention, "scores_added", False):
            self.cache.add_scores(self.attention)
        return self.policy.decode(self.view(), self.state)

    def hold(self) -> None:
        """The policy's second pass after its own plans were carried out (equal-memory mode: a prompt-only method
        brought back to r·N_t)."""
        apply_plans(self.cache, self.policy.after_plans(self.view(), self.state))


def compress_decode_rows(rows: Sequence[DecodeRow], device: torch.device) -> list[tuple[Elapsed, Exception | None]]:
    """`compress_decode` for every row of one batched step: each policy plans on its own, then every row's
    eviction is carried out together (`apply_plans_together`: one gather per layer and field for all rows).
    Returns per row its own policy time (its planning and holding, and its share of the joint eviction, split
    evenly among the rows that evicted), read when first asked for (`float`: after the step's tokens were read
    back, so timing waits for nothing; see `stopwatch.py`), and the error that stopped it, if any: a failing
    policy fails its own row only."""
    watch = Stopwatch(device)
    seconds = [Elapsed(watch) for _ in rows]
    errors: list[Exception | None] = [None] * len(rows)
    planned: list[tuple[int, list[LayerPlan | None]]] = []
    mark = watch.mark()
    steps = {id(row.attention.step): row.attention.step for row in rows if isinstance(row.attention, RowAttention)}
    if steps:  # every row's scores at once where they share stores (`step_attention`), its time shared by them
        for step in steps.values():
            step.add_to_scores()
        mark, before = watch.mark(), mark
        scored = [r for r, row in enumerate(rows) if getattr(row.attention, "scores_added", False)]
        for r in scored:
            seconds[r].add(before, mark, 1.0 / len(scored))
    for r, row in enumerate(rows):
        try:
            plans = row.plans()
            if plans and any(p is not None for p in plans):
                planned.append((r, plans))
        except Exception as exc:  # noqa: BLE001 - reported as the method's error
            errors[r] = exc
        mark, before = watch.mark(), mark
        seconds[r].add(before, mark)
    if planned:
        try:
            apply_plans_together([(rows[r].cache, plans) for r, plans in planned])
        except Exception as exc:  # noqa: BLE001
            for r, _ in planned:
                errors[r] = exc
        mark, before = watch.mark(), mark
        for r, _ in planned:
            seconds[r].add(before, mark, 1.0 / len(planned))
    for r, row in enumerate(rows):
        if errors[r] is not None:
            continue
        try:
            row.hold()
        except Exception as exc:  # noqa: BLE001
            errors[r] = exc
        mark, before = watch.mark(), mark
        seconds[r].add(before, mark)
    return list(zip(seconds, errors))
