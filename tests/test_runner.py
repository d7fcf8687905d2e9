"""The batched runner: many rows with different per-layer cache lengths in one forward give exactly what each
row gives alone, and a session decoding every method as one batch equals each method run on its own."""
import pytest
import torch

from prefixkv_core import Engine, GenerationSettings
from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import METHODS
from prefixkv_core.decoding.step_buffers import split_by_length
from prefixkv_core.testing import wait_until

PROMPT = "describe the picture in detail and name every object you can see in it"
FOLLOW_UP = "and what colour is the largest one"
# knobs that make every method's special path run within a few tokens (ZipVL re-quantises while decoding)
KNOBS = {"zipvl": {"decode_block": 3}}


def _prefilled(loaded, image, count):
    """`count` caches of one prompt, each cut to a different random subset per layer (different lengths)."""
    inputs = encode(loaded, image, format_prompt(loaded, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    with tracked_attention_enabled(loaded.model):
        shared = runner.prefill(loaded.model, ids, ids == loaded.image_token_id, inputs["pixel_values"], [],
                                loaded.num_layers, loaded.device)
    n = ids.shape[1]
    g = torch.Generator().manual_seed(0)
    caches = []
    for r in range(count):
        cache = shared.cache.clone()
        for layer in cache.layers:
            k = int(torch.randint(n // 3, n + 1, (1,), generator=g))
            keep = torch.randperm(n, generator=g)[:k].sort().values
            keep[0] = 0
            layer.gather(keep.unique().view(1, 1, -1))
        caches.append(cache)
    return caches, n


@pytest.mark.parametrize("chunk_lengths", [(1, 1, 1), (1, 4, 3)])
def test_forward_rows_equals_each_row_alone(tiny, noise_image, chunk_lengths):
    caches, n = _prefilled(tiny, noise_image, len(chunk_lengths))
    alone = [c.clone() for c in caches]
    chunks = [list(range(5, 5 + q)) for q in chunk_lengths]
    starts = [n + 2 * r for r in range(len(chunks))]  # rows may sit at different true positions
    want = [True, False, True]
    with tracked_attention_enabled(tiny.model):
        batched = runner.forward_rows(tiny.model, caches, chunks, starts, want, tiny.device)
        singles = [runner.forward_rows(tiny.model, [c], [ch], [s], [w], tiny.device)
                   for c, ch, s, w in zip(alone, chunks, starts, want)]
    for r, single in enumerate(singles):
        torch.testing.assert_close(batched.logits[r], single.logits[0], atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(caches[r].layers, alone[r].layers):
            assert torch.equal(mine.positions, theirs.positions)
            assert torch.equal(mine.is_image, theirs.is_image)
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-4, rtol=1e-4)
        if want[r]:
            for layer, att in single.attention[0].items():
                assert batched.attention[r][layer].shape == att.shape
                torch.testing.assert_close(batched.attention[r][layer], att, atol=1e-6, rtol=1e-5)
        else:
            assert batched.attention[r] is None


def _turns(session):
    """Per method: (answer ids, kept per layer, image kept per layer, KV bytes) after each turn."""
    out = {name: [] for name in session.states}
    for ev in session.run():
        if getattr(ev, "kind", None) in ("done", "error"):
            out[ev.method].append((list(session.states[ev.method].turn_ids), ev.kept_per_layer,
                                   ev.kept_image_per_layer, ev.kv_bytes, ev.error))
    for ev in session.follow_up(FOLLOW_UP):
        if ev.kind in ("done", "error"):
            out[ev.method].append((list(session.states[ev.method].turn_ids), ev.kept_per_layer,
                                   ev.kept_image_per_layer, ev.kv_bytes, ev.error))
    return out


def test_all_methods_batched_equal_each_alone(tiny, noise_image):
    """Greedy, fp32: the all-method batch (own prefills included) gives each method exactly its own tokens,
    per-layer counts and bytes, over a first turn and a follow-up."""
    engine = Engine(tiny)
    settings = GenerationSettings(max_new_tokens=7)
    together = _turns(engine.new_session(noise_image, PROMPT, "all", 0.3, settings, KNOBS))
    assert set(together) == set(METHODS)
    for method in METHODS:
        alone = _turns(engine.new_session(noise_image, PROMPT, [method], 0.3, GenerationSettings(max_new_tokens=7),
                                          {k: v for k, v in KNOBS.items() if k == method}))
        assert together[method] == alone[method], method
        assert all(turn[4] is None for turn in alone[method]), alone[method]
        assert len(alone[method]) == 2


def test_methods_with_different_observation_windows_batched_equal_each_alone(tiny, noise_image):
    """One shared prefill records every window the methods declare (SnapKV's 32 fitted to the prompt and the
    budget, PyramidKV's 8, PrefixKV's window scorer at 3); each method reads its own, so the batch gives each
    exactly what it gives alone, over a first turn and a follow-up."""
    engine = Engine(tiny)
    knobs = {"prefixkv": {"scorer": "window", "window": 3}}
    methods = ["snapkv", "pyramidkv", "prefixkv"]
    budget = 0.7
    together = engine.new_session(noise_image, PROMPT, methods, budget, GenerationSettings(max_new_tokens=5), knobs)
    batched = _turns(together)
    n = together.prefill.prompt_tokens
    windows = {name: together.states[name].policy.prefill_stats(n).window for name in methods}
    assert windows == {"snapkv": min(32, round(budget * n) - 1), "pyramidkv": 8, "prefixkv": 3}, windows
    assert len(set(windows.values())) == 3  # the test needs three different windows on this prompt
    assert together.states["snapkv"].policy_state.window == windows["snapkv"]
    for name in methods:
        alone = _turns(engine.new_session(noise_image, PROMPT, [name], budget, GenerationSettings(max_new_tokens=5),
                                          {k: v for k, v in knobs.items() if k == name}))
        assert batched[name] == alone[name], name


def test_score_answer_batched_equals_alone(tiny_qwen2, noise_image):
    engine = Engine(tiny_qwen2)
    answer = "a red square on the left and a blue circle"
    together = engine.new_session(noise_image, PROMPT, "all", 0.3, knobs=KNOBS).score_answer(answer)
    for method in METHODS:
        alone = engine.new_session(noise_image, PROMPT, [method], 0.3,
                                   knobs={k: v for k, v in KNOBS.items() if k == method}).score_answer(answer)
        assert together[method][1] == alone[method][1]
        assert together[method][0] == pytest.approx(alone[method][0], rel=1e-4, abs=1e-3)


def test_events_report_the_batch(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, ["full", "snapkv", "h2o"], 0.3, GenerationSettings(4))
    sizes = {ev.batch_size for ev in session.run() if getattr(ev, "kind", None) == "token" and ev.step > 1}
    assert sizes == {3}



def test_methods_leave_the_batch_when_they_finish(tiny_llama, noise_image):
    """A method that stops early (an error here) leaves the batch; the others finish with their own tokens."""
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, PROMPT, ["full", "local", "h2o"], 0.3, GenerationSettings(6))
    events = session.run()
    for ev in events:
        if getattr(ev, "kind", None) == "token" and ev.step == 2:
            session.states["local"].error = "stopped by the test"
            session.states["local"].finished = True
            break
    rest, keys = [], None
    for ev in events:
        rest.append(ev)
        if keys is None and ev.kind == "token" and ev.step > 3:
            # the smaller batch got stores of its own, every layer's stacked in one tensor per field
            keys = [layer._stores["keys"] for layer in session.states["h2o"].cache.layers]
    assert all(ev.batch_size == 2 for ev in rest if ev.kind == "token" and ev.step > 3)
    assert keys[0].stack is not None and all(k.stack is keys[0].stack and len(k.lengths) == 2 for k in keys)
    # once the turn ended, its rows keep their entries in stores of their own and the batch's stores are gone
    layers = session.states["h2o"].cache.layers
    assert wait_until(lambda: engine.pool.nbytes() == 0
                      and all(layer._stores["keys"].stack is None for layer in layers))
    alone = engine.new_session(noise_image, PROMPT, ["h2o"], 0.3, GenerationSettings(6))
    list(alone.run())
    assert session.states["h2o"].turn_ids == alone.states["h2o"].turn_ids


def test_reused_step_buffers_give_the_same_step(tiny_qwen2, noise_image):
    """Padded tensors reused from a wider, longer earlier step (stale entries left in place) change nothing."""
    caches, n = _prefilled(tiny_qwen2, noise_image, 3)
    fresh = [c.clone() for c in caches[:2]]
    buffers = runner.StepBuffers()
    with tracked_attention_enabled(tiny_qwen2.model):
        runner.forward_rows(tiny_qwen2.model, [c.clone() for c in caches], [[7, 8], [9], [10, 11]],
                            [n, n, n], [True, False, False], tiny_qwen2.device, buffers)
        reused = runner.forward_rows(tiny_qwen2.model, caches[:2], [[5], [6]], [n, n], [True, True],
                                     tiny_qwen2.device, buffers)
        plain = runner.forward_rows(tiny_qwen2.model, fresh, [[5], [6]], [n, n], [True, True], tiny_qwen2.device)
    assert buffers.nbytes() > 0
    torch.testing.assert_close(reused.logits, plain.logits, atol=1e-6, rtol=1e-6)
    for a, b in zip(reused.attention, plain.attention):
        for layer in a:
            torch.testing.assert_close(a[layer], b[layer], atol=1e-7, rtol=1e-6)


def test_a_finished_session_frees_its_caches_without_the_garbage_collector(tiny_llama):
    """Nothing the batched step leaves behind keeps a row's cache alive (no reference cycle waiting for gc)."""
    import gc
    import weakref

    engine = Engine(tiny_llama)
    gc.collect()
    gc.disable()
    try:
        session = engine.new_session(None, PROMPT, "all", 0.3, GenerationSettings(max_new_tokens=4))
        list(session.run())
        caches = [weakref.ref(s.cache) for s in session.states.values()]
        del session
        # the rows that left the batch are let go on the model's thread, just after the turn
        assert wait_until(lambda: all(ref() is None for ref in caches))
    finally:
        gc.enable()


def test_rows_split_by_length_when_that_saves_enough():
    """One long row beside short ones gets a group of its own only when the saving is large (in bytes and in
    share); small caches and rows of similar lengths stay in one group."""
    assert split_by_length([700, 200, 210, 190], spare=64, entry_bytes=8192) == [[0], [1, 2, 3]]
    assert split_by_length([200, 700, 710, 190], spare=64, entry_bytes=16384) == [[1, 2], [0, 3]]
    assert split_by_length([700, 200, 210, 190], spare=64, entry_bytes=64) == [[0, 1, 2, 3]]  # saves < 8 MiB
    assert split_by_length([700, 650, 680, 690], spare=64, entry_bytes=8192) == [[0, 1, 2, 3]]  # saves < 30 %
    assert split_by_length([500], spare=64, entry_bytes=8192) == [[0]]


SPLIT_METHODS = ["full", "local", "h2o", "snapkv", "adakv", "zipvl", "fastv", "prefixkv"]


def test_rows_in_two_groups_equal_each_alone(tiny, noise_image, monkeypatch):
    """With every batch split in two groups by length (the long rows: Full, ZipVL's working copy, FastV), each
    method, the ones that score while decoding, keep empty slots or quantise included, gets exactly its own
    tokens, counts and bytes over a first turn and a follow-up."""
    from prefixkv_core.decoding import step_buffers

    monkeypatch.setattr(step_buffers, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(step_buffers, "SPLIT_SHARE", 1.0)
    made = []
    set_groups = step_buffers.StepBuffers._set_groups

    def recording(self, layer_idx, groups, *args):
        made.append((len(groups), groups[0][1]["keys"].stack is not None))
        return set_groups(self, layer_idx, groups, *args)

    monkeypatch.setattr(step_buffers.StepBuffers, "_set_groups", recording)
    engine = Engine(tiny)
    settings = GenerationSettings(max_new_tokens=7)
    together = _turns(engine.new_session(noise_image, PROMPT, SPLIT_METHODS, 0.3, settings, KNOBS))
    assert made and all(n == 2 for n, _ in made)
    assert any(stacked for _, stacked in made)  # layers that group their rows alike share stacked stores
    for method in SPLIT_METHODS:
        alone = _turns(engine.new_session(noise_image, PROMPT, [method], 0.3, GenerationSettings(max_new_tokens=7),
                                          {k: v for k, v in KNOBS.items() if k == method}))
        assert together[method] == alone[method], method


def test_zipvl_records_attention_only_when_a_block_fills(tiny, noise_image, monkeypatch):
    """ZipVL reads a decode step's attention only in the layers whose block of new entries fills that step: its
    steps ask for those layers (none on most steps), and it answers, packs and counts exactly as when every step
    records every layer's attention, over a first turn and a follow-up."""
    from prefixkv_core.policies.zipvl import ZipVLPolicy

    engine = Engine(tiny)
    asked = []
    wanted = runner.attention_wanted

    def recording(policy, state):
        found = wanted(policy, state)
        if policy.name == "zipvl":
            asked.append(found)
        return found

    def packs():
        session = engine.new_session(noise_image, PROMPT, ["full", "zipvl"], 0.3,
                                     GenerationSettings(max_new_tokens=8), KNOBS)
        turns = _turns(session)
        return turns, [len(layer.segments) for layer in session.states["zipvl"].cache.layers]

    monkeypatch.setattr(runner, "attention_wanted", recording)
    fast = packs()
    assert () in asked and any(found not in ((), True) and len(found) > 0 for found in asked), asked
    monkeypatch.setattr(ZipVLPolicy, "decode_attention_layers", lambda self, state: None)
    asked.clear()
    every = packs()
    assert set(asked) == {True}
    assert fast == every
    assert min(fast[1]) > 2  # blocks were packed while decoding, not the prompt's two alone


def test_offline_ratios_falling_to_the_last_layer_evict_at_batch_two(one_torch_thread):
    """PrefixKV offline with ratios that fall to the last layer (a layer keeping a few entries at the end of the
    stacked stores, as calibrated ratios do): the joint eviction of every row and layer stays within the stores,
    and the image counts it leaves are each layer's own."""
    from benchmarks.batched import new_run, synthetic_batch
    from prefixkv_core.models import build_random_model

    sm = build_random_model("tiny", torch.device("cpu"), torch.float32, seed=0)
    ids, is_image, pixels = synthetic_batch(sm, 2, sm.image_seq_length + 24)
    run = new_run(sm, "prefixkv", 0.2, {"mode": "offline", "ratios": [0.6, 0.3, 0.1, 0.02]})
    with torch.inference_mode(), tracked_attention_enabled(sm.model):
        tokens = run.prefill(ids, is_image, pixels)
        for _ in range(6):
            tokens = run.step(tokens)
    kept = run.kept_per_layer()
    assert kept == sorted(kept, reverse=True) and kept[-1] < kept[0] // 4, kept
    for layer in run.caches[0].layers:
        recounted = int(round(int(layer.is_image[0].sum()) / layer.is_image.shape[1]))
        assert layer.image_count() == recounted
