"""The operators and host round trips of a decode step, per method, on the tiny random model
(`benchmarks/step_ops.py`): counted, so deterministic, and held to the shipped record
(`benchmarks/data/step_ops_tiny.json`). A change that makes a step launch more fails here without a GPU;
one that makes it launch fewer (or a new method, held to one round trip until then) should rewrite the record:

    python benchmarks/step_ops.py --random-weights tiny --batch 1 4 --write benchmarks/data/step_ops_tiny.json
"""
import json
import os

import pytest
import torch

from benchmarks import step_ops


@pytest.fixture(scope="module")
def record():
    return json.loads(step_ops.RECORD.read_text())


@pytest.fixture(scope="module")
def counted(record, one_torch_thread):
    sm = step_ops.build_random_model(record["model"], torch.device("cpu"), torch.float32, seed=0)
    return step_ops.measure(sm, record["budget"], record["batches"], record["prompt_len"], record["warmup"],
                            record["steps"])


def test_every_method_is_counted_and_none_launches_more_than_its_record(record, counted):
    assert set(record["rows"]) <= set(counted), "a recorded method was removed: rewrite the record"
    for name, row in counted.items():
        for batch, got in row.items():
            assert "error" not in got, (name, batch, got)
            if name not in record["rows"]:  # a method newer than the record: no host round trip but the tokens'
                assert got["round_trips"] <= 1, f"{name} at batch {batch}: {got['round_trips']} host round trips"
                continue
            want = record["rows"][name][batch]
            assert got["operators"] <= want["operators"], f"{name} at batch {batch}: {got['operators']} operators a " \
                                                          f"step, {want['operators']} before"
            assert got["round_trips"] <= want["round_trips"], f"{name} at batch {batch}: {got['round_trips']} host " \
                                                              f"round trips a step, {want['round_trips']} before"
            assert got["kernels"] <= want["kernels"], f"{name} at batch {batch}: {got['kernels']} kernels a step, " \
                                                      f"{want['kernels']} before"


def test_the_counts_see_what_a_step_does(counted):
    """The floor is transformers' own step; a method that evicts every step launches more than one that does not
    (what the record holds is measured, not assumed)."""
    stock, full = counted[step_ops.STOCK]["1"], counted["full"]["1"]
    assert 0 < stock["operators"] < full["operators"] and stock["round_trips"] == 0
    assert counted["h2o"]["1"]["operators"] > full["operators"]
    assert counted["prefixkv"]["1"]["operators"] > full["operators"]
    assert counted["prefixkv-offline"]["4"]["operators"] == counted["prefixkv-offline"]["1"]["operators"]


def test_a_cache_per_prompt_costs_no_more_operators_for_more_rows(counted):
    """The rows that keep a cache each (online PrefixKV, Elastic, ZipVL, AdaKV, VL-Cache) step at batch 4 within 5 %
    of batch 1: their planning, evicting and holding are batched over rows, not repeated per row."""
    per_prompt = [name for name, row in counted.items() if row["4"].get("cache_mode") == "a cache per prompt"]
    assert {"prefixkv", "elastic", "zipvl", "adakv", "vlcache"} <= set(per_prompt)
    for name in per_prompt:
        one, four = counted[name]["1"]["operators"], counted[name]["4"]["operators"]
        assert four <= 1.05 * one, f"{name}: {four} operators a step at batch 4, {one} at batch 1"


def test_zipvl_packs_every_layer_with_two_waits_a_row(record, one_torch_thread):
    """ZipVL's packing step (every layer's block of new entries at once, here every 3 tokens) waits for the device
    twice a row, whatever the layers: once for every layer's adaptive count, once for every layer's split."""
    sm = step_ops.build_random_model(record["model"], torch.device("cpu"), torch.float32, seed=0)
    steps, rows = 6, 4  # two packing steps: the 3rd and the 6th
    got = step_ops.count_steps(sm, "zipvl", record["budget"], rows, record["prompt_len"], {"decode_block": 3},
                               warmup=0, steps=steps)
    tokens = steps  # a cache per prompt: the step's tokens read back
    assert got["round_trips"] * steps == tokens + 2 * rows * 2, got


def test_a_host_read_and_an_extra_operator_are_counted():
    ops, reads = step_ops._Operators(), step_ops._HostReads()
    x = torch.arange(6.0)
    with reads, ops:
        y = x + 1
        y.sum().item()
        torch.nonzero(y > 2)
    assert ops.operators >= 4 and ops.data_shaped == 1 and reads.reads == 1


def test_a_view_is_an_operator_but_no_kernel():
    """A view (a new shape over an input's memory) launches nothing; a "view" operator that had to copy does."""
    x = torch.arange(6.0)
    counted = []
    for make in (lambda: x.narrow(0, 1, 3), lambda: x.view(2, 3).t(), lambda: x.to(torch.float32),
                 lambda: x.to(torch.float16), lambda: x.view(2, 3).t().reshape(6), lambda: x.add_(1)):
        ops = step_ops._Operators()
        with torch.inference_mode(), ops:  # as a step runs
            make()
        counted.append((ops.operators, ops.kernels))
    assert counted == [(1, 0), (2, 0), (1, 0), (1, 1), (3, 1), (1, 1)]


def test_full_launches_about_the_kernels_of_transformers_own_step(counted):
    """Full's step does the device work of transformers' DynamicCache step but for the metadata it tracks (each
    new entry's position, image flag and score, and the slots they go to: a few kernels a step, not a layer)."""
    for batch in ("1", "4"):
        stock, full = counted[step_ops.STOCK][batch]["kernels"], counted["full"][batch]["kernels"]
        assert stock <= full <= stock + 6, (batch, stock, full)


def test_the_command_counts_a_shape_cut_to_its_first_layers(capsys, threads_restored):
    assert step_ops.main(["--random-weights", "tiny", "--batch", "1", "--layers", "2", "--methods", "full",
                          "h2o"]) == 0
    out = capsys.readouterr().out
    assert "2 layers" in out and "| full | " in out and "| h2o | " in out


def test_indexing_with_a_mask_is_a_round_trip_and_with_indices_is_not():
    ops = step_ops._Operators()
    x = torch.arange(6.0)
    with ops:
        x[x > 2]
        x[torch.tensor([0, 2])]
        x[x > 4] = 0.0
    assert ops.data_shaped == 2


def test_a_step_waits_for_the_device_at_most_once(counted):
    """No method's step reads a value back or synchronises, but for the tokens (what streaming needs): timing the
    policies marks the device's timeline instead of waiting for it, and an eviction leaves its counts on it."""
    for name, row in counted.items():
        for batch, got in row.items():
            assert got["round_trips"] <= 1, (name, batch, got)


class _HostWaits:
    """Counts, in every thread, what makes the host wait for the device: a tensor's value read into Python and
    indexing by a boolean mask (its size is the mask's count). The wrappers stay: it runs in a process of its own."""

    READS = ("tolist", "item", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch):
        self.count, self.on = 0, False
        for name in self.READS:
            self._wrap(name, lambda *a: True)
        self._wrap("__getitem__", lambda self_, index, *a: _has_mask(index))
        self._wrap("__setitem__", lambda self_, index, *a: _has_mask(index))
        monkeypatch.setattr(torch, "nonzero", self._counted(torch.nonzero, lambda *a, **k: True))

    def _counted(self, original, waits):
        def call(*args, **kwargs):
            if self.on and waits(*args, **kwargs):
                self.count += 1
            return original(*args, **kwargs)
        return call

    def _wrap(self, name, waits):
        setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name), waits))


def _has_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


ISOLATED = "PREFIXKV_STEP_WAITS_IN_A_PROCESS"  # set in the process the engine's waits are counted in


def test_the_engine_waits_for_the_device_once_a_step():
    """The counts below, in a process of their own: wrapping torch.Tensor.__getitem__ (to count indexing by a mask
    in every thread) cannot be undone in the process that did it (torch.tensor then takes 0-d tensors for
    sequences), so no other test may run after it there."""
    import os
    import subprocess
    import sys

    env = {**os.environ, ISOLATED: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"{__file__}",
                           "-k", "engine_waits_once"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout


@pytest.mark.skipif(not os.environ.get(ISOLATED), reason="runs in a process of its own "
                                                          "(test_the_engine_waits_for_the_device_once_a_step)")
@pytest.mark.parametrize("methods", ["all", "local", "h2o"])
def test_the_engine_waits_once(tiny_llama, noise_image, monkeypatch, methods, request):
    """A comparison of every method, decoded as one batch through the engine (its pool, its events), or one method
    evicting alone every step, reads the device back once a step: the tokens, the image counts its evictions kept
    read in the same transfer; timing the policies waits for nothing."""
    from prefixkv_core import Engine, GenerationSettings
    from prefixkv_core.policies import METHODS

    chosen = list(METHODS) if methods == "all" else [methods]
    waits = _HostWaits(monkeypatch)
    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, "describe the picture in detail", chosen, 0.3,
                                 GenerationSettings(max_new_tokens=12, ignore_eos=True))
    steps = 0
    for event in session.run():
        if getattr(event, "kind", None) == "token" and event.method == chosen[0]:
            steps += 1
            if steps == 4:  # every method has decoded a few steps, evicting where it does
                waits.on = True
            elif steps == 10:
                waits.on = False
                measured = waits.count
    session._settled()
    assert steps >= 10
    assert measured == 6, f"{measured} waits for the device over 6 decode steps of {len(chosen)} methods"
