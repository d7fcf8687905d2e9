"""What a decode step launches, per method: aten operators and host round trips, counted, not timed.

On a GPU a decode step of a small cache is bound by the operators it launches (each costs about the same few
microseconds whatever its size) and by every wait for the device (a value read back to Python), not by the bytes of
the cache; both are deterministic, so they can be counted on the CPU and a regression shows without a GPU. Each
method runs through the batch runner the speed benchmark uses (`batched.py`: the engine's own decode path), and
`full-stock` (transformers' DynamicCache and sdpa, nothing tracked) is the floor.

Counted over `--steps` decode steps after `--warmup` (the first steps of an every-step method may not evict yet):
- operators: every aten operator dispatched (`TorchDispatchMode`), views included, per step;
- kernels: the operators that do device work, i.e. all but the views (a new shape over an input's memory: on a GPU
  a few microseconds of host time, no launch, and nothing at all once the step is captured as a CUDA graph);
- host round trips: every read of a tensor's value into Python (`item`, `tolist`, `bool`/`int`/`float` of a
  tensor), every operator whose output size depends on the data (`nonzero`, `masked_select`, `unique`, indexing
  with a boolean mask: the host waits for the device to know the size) and every explicit synchronisation, per
  step. On a GPU each one is a
  wait for the device.

    python benchmarks/step_ops.py --random-weights tiny --batch 1 16 --budget 0.2
    python benchmarks/step_ops.py --random-weights embedded --batch 1 16   # the embedded model's 30 layers

`--write FILE` saves the counts as JSON; `tests/test_step_ops.py` holds the tiny model to the shipped record
(`benchmarks/data/step_ops_tiny.json`), so a change that launches more per step fails there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.batched import STOCK, new_run, synthetic_batch  # noqa: E402
from prefixkv_core.decoding import runner  # noqa: E402
from prefixkv_core.kv.attention import tracked_attention_enabled  # noqa: E402
from prefixkv_core.models import RANDOM_KINDS, LoadedModel, build_random_model  # noqa: E402

SHAPE_FROM_DATA = ("nonzero", "masked_select", "unique", "_unique", "unique_consecutive", "_unique2")
MASK_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")  # with a boolean mask: sized by the data
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")
RECORD = Path(__file__).resolve().parent / "data" / "step_ops_tiny.json"


class _Operators(TorchDispatchMode):
    """Counts every aten operator; those that do device work (`kernels`: all but the views, which only make a new
    shape over an input's memory, no launch on a GPU); and those whose output size depends on the data."""

    def __init__(self):
        super().__init__()
        self.operators = 0
        self.kernels = 0
        self.data_shaped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += 1
        name = func.overloadpacket.__name__
        if name in SHAPE_FROM_DATA or (name in MASK_INDEXING and _bool_index(args)):
            self.data_shaped += 1
        out = func(*args, **(kwargs or {}))
        # a view makes a new shape over an input's memory; a "view" operator that copied (`to`, `reshape`) and an
        # in-place one (its output is its input) did device work
        if func._schema.is_mutable or not _aliases_an_input(out, args):
            self.kernels += 1
        return out


def _aliases_an_input(out, args) -> bool:
    """Whether `out` (a tensor, or the first of several) lies in the memory of a tensor among `args`."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor):
        return False
    ptr = first.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


def _bool_index(args) -> bool:
    """Whether an indexing operator was given a boolean mask (`x[mask]`: its size is the mask's count)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


class _HostReads(TorchFunctionMode):
    """Counts reads of a tensor's value into Python."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class _Syncs:
    """Counts the runner's explicit synchronisations (no-ops on the CPU, a wait on a GPU)."""

    def __init__(self):
        self.count = 0
        self._original = runner.sync

    def __enter__(self):
        def counted(device):
            self.count += 1
            return self._original(device)

        runner.sync = counted
        return self

    def __exit__(self, *exc):
        runner.sync = self._original
        return False


def count_steps(sm: LoadedModel, method: str, budget: float, batch: int, prompt_len: int, knobs: dict | None = None,
                warmup: int = 2, steps: int = 4) -> dict[str, Any]:
    """Operators and host round trips per decode step of `method` on a batch of `batch` prompts."""
    ids, is_image, pixels = synthetic_batch(sm, batch, prompt_len)
    run = new_run(sm, method, budget, knobs)
    attention = tracked_attention_enabled(sm.model) if method != STOCK else _Nothing()
    with torch.inference_mode(), attention:
        tokens = run.prefill(ids, is_image, pixels)
        for _ in range(warmup):
            tokens = run.step(tokens)
        ops, reads = _Operators(), _HostReads()
        with _Syncs() as syncs, reads, ops:
            for _ in range(steps):
                tokens = run.step(tokens)
    return {"operators": ops.operators / steps, "kernels": ops.kernels / steps,
            "round_trips": (reads.reads + ops.data_shaped + syncs.count) / steps,
            "cache_mode": run.mode}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cases(sm: LoadedModel, budget: float) -> dict[str, tuple[str, dict]]:
    """Row name -> (method, knobs): the floor, every registered method with its defaults, and PrefixKV's offline mode
    with ratios shared by every prompt (as its reference ships them)."""
    from prefixkv_core.policies import METHODS

    rows = {STOCK: (STOCK, {})}
    rows.update({m: (m, {}) for m in METHODS})
    rows["prefixkv-offline"] = ("prefixkv", {"mode": "offline", "ratios": [budget] * sm.num_layers})
    return rows


def measure(sm: LoadedModel, budget: float, batches: list[int], prompt_len: int, warmup: int, steps: int,
            only: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (method, knobs) in cases(sm, budget).items():
        if only and name not in only:
            continue
        row = {}
        for batch in batches:
            try:
                row[str(batch)] = count_steps(sm, method, budget, batch, prompt_len, knobs, warmup, steps)
            except Exception as exc:  # noqa: BLE001 - a method this model or input cannot run: reported, not fatal
                row[str(batch)] = {"error": f"{exc.__class__.__name__}: {exc}"[:200]}
        out[name] = row
    return out


def table(result: dict[str, Any], batches: list[int]) -> str:
    full = result.get("full", {})
    head = " | ".join(f"ops b={b} | ×Full b={b} | kernels b={b} | ×Full b={b} | trips b={b}" for b in batches)
    lines = [f"| method | {head} | cache |", "|---|" + "---|" * (5 * len(batches)) + "---|"]
    for name, row in result.items():
        cells, mode = [], ""
        for b in batches:
            r = row.get(str(b), {})
            if "error" in r:
                cells += ["error", "", "", "", ""]
                continue
            ref = full.get(str(b), {})
            cells += [f"{r['operators']:,.0f}", _ratio(r["operators"], ref.get("operators")),
                      f"{r['kernels']:,.0f}", _ratio(r["kernels"], ref.get("kernels")), f"{r['round_trips']:g}"]
            mode = r.get("cache_mode", "")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mode} |")
    return "\n".join(lines)


def _ratio(value: float, ref: float | None) -> str:
    return f"{value / ref:.2f}" if ref else ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-weights", default="tiny", choices=RANDOM_KINDS,
                   help="a randomly initialised model of this shape (default tiny)")
    p.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers (a shorter run)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default: the image block + 24)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--methods", nargs="+", default=None, help="rows to count (default every method)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--write", type=Path, default=None, help="save the counts as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    sm = build_random_model(args.random_weights, torch.device("cpu"), torch.float32, seed=0)
    if args.layers is not None:
        sm = truncated(sm, args.layers)
    prompt_len = args.prompt_len or sm.image_seq_length + 24
    result = measure(sm, args.budget, args.batch, prompt_len, args.warmup, args.steps, args.methods)
    print(f"{sm.name}: {sm.num_layers} layers, prompt {prompt_len} tokens, r = {args.budget}, per decode step")
    print(table(result, args.batch))
    if args.write:
        payload = {"model": args.random_weights, "layers": sm.num_layers, "prompt_len": prompt_len,
                   "budget": args.budget, "batches": args.batch, "warmup": args.warmup, "steps": args.steps,
                   "rows": {k: {b: {f: v for f, v in r.items() if f in ("operators", "kernels", "round_trips", "error")}
                                for b, r in row.items()} for k, row in result.items()}}
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def truncated(sm: LoadedModel, layers: int) -> LoadedModel:
    """The model with its first `layers` decoder layers only (the per-layer part of a count scales with the layers:
    counting a 32-layer shape at 4 shows what each layer costs)."""
    text = sm.model.get_decoder()
    text.layers = text.layers[:layers]
    sm.model.config.get_text_config().num_hidden_layers = layers
    return sm


if __name__ == "__main__":
    sys.exit(main())
