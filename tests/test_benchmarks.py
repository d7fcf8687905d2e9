"""The benchmark harnesses (benchmarks/quality.py, benchmarks/speed.py) on the tiny model: table shapes, the
Full reference row, resumability, batched speed runs, OOM reporting, LLaVA-1.5 shapes on the meta device,
and the data-parallel run under `accelerate launch` (2 CPU processes) against a single-process run.
No timing assertions."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import quality, speed
from benchmarks.batched import run_timed, synthetic_batch
from benchmarks.common import RecordStore, Table
from benchmarks.data import BUILTIN, DataError, load_dataset, parse_record, resolve_image
from prefixkv_core.models import ModelLoadError, build_random_model, format_prompt, random_config
from prefixkv_core.policies import METHODS, REGISTRY, make_policy

ROOT = Path(__file__).resolve().parent.parent
QBUDGETS = ["0.10", "0.50"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_csv(path: Path) -> list[list[str]]:
    with open(path) as fh:
        return list(csv.reader(fh))


# -- data ----------------------------------------------------------------------------------------------------

def test_builtin_set_and_both_formats(tmp_path):
    samples = load_dataset(BUILTIN)
    assert len(samples) >= 40
    kinds = {s.extra["kind"] for s in samples}
    assert {"scene-description", "photo-description", "photo-qa"} <= kinds
    assert any(k.startswith("scene-qa") for k in kinds)
    for s in samples[:4]:  # scenes render, photos resolve relative to the data file
        assert resolve_image(s.image, BUILTIN.parent).mode == "RGB"
    conv = parse_record({"id": "a", "image": "x.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}, "t")
    flat = parse_record({"id": "b", "imagename": "x.png", "question": "What is it?", "answer": "A cat."}, "t")
    assert (conv.image, conv.question, conv.answer) == (flat.image, flat.question, flat.answer) == \
        ("x.png", "What is it?", "A cat.")
    mmvet = tmp_path / "mmvet.json"
    mmvet.write_text(json.dumps({"v1_0": {"imagename": "v1_0.png", "question": "Q?", "answer": "A"}}))
    assert load_dataset(mmvet)[0].id == "v1_0"
    with pytest.raises(DataError, match="needs 'question' and 'answer'"):
        parse_record({"id": "c", "image": "x.png"}, "t")


def test_table_formats():
    t = Table("PPL", "method \\ budget", ["full", "local_1"], ["0.10"], {("full", "0.10"): 2.0,
                                                                          ("local_1", "0.10"): "OOM"}, best="min")
    assert "| local_1 | OOM |" in t.to_markdown()
    assert read_csv_text(t.to_csv()) == [["method \\ budget", "0.10"], ["full", "2.000"], ["local_1", "OOM"]]
    tex = t.to_latex()
    assert r"\begin{tabular}{lr}" in tex and r"local\_1 & OOM \\" in tex


def read_csv_text(text: str) -> list[list[str]]:
    return list(csv.reader(text.splitlines()))


# -- quality -------------------------------------------------------------------------------------------------

def full_greedy_words(engine, image, question: str, n: int) -> str:
    """Full's greedy answer restricted to whole-word tokens (" word") that survive decode -> encode, so the
    reference answer re-tokenises to exactly the ids Full chose (byte-level pieces of a random model do not)."""
    from prefixkv_core import GenerationSettings
    from prefixkv_core.kv.attention import tracked_attention_enabled

    tok = engine.loaded.processor.tokenizer
    safe = torch.zeros(len(tok), dtype=torch.bool)
    for t in range(len(tok)):
        text = tok.decode([t])
        if len(text) > 2 and text[0] == " " and text[1:].isalpha() and tok(text, add_special_tokens=False)[
                "input_ids"] == [t]:
            safe[t] = True
    session = engine.new_session(image, question, ["full"], 1.0, GenerationSettings(max_new_tokens=n))
    state = session.states["full"]
    ids = []
    with engine.lock, tracked_attention_enabled(engine.loaded.model):
        session.turn = 0
        session.prefill_first_turn(alone=False)
        logits = state.first_logits
        for step in range(n):
            ids.append(int(torch.where(safe, logits.float(), float("-inf")).argmax()))
            batch_logits, _, _ = session.stepper.advance([state], [[ids[-1]]], step=step + 1)
            logits = batch_logits[0]
    answer = tok.decode(ids)
    assert tok(answer, add_special_tokens=False)["input_ids"] == ids
    return answer


@pytest.fixture(scope="module")
def self_ref_data(tmp_path_factory, tiny_llama):
    """Three scene questions whose reference answers are Full's own greedy choices: every answer token is
    Full's favourite, so Full's teacher-forced PPL is the lowest, even on random weights."""
    from prefixkv_core import Engine

    engine = Engine(tiny_llama)
    root = tmp_path_factory.mktemp("data")
    lines = []
    for i, seed in enumerate((2000000, 2000001, 2000021)):
        question = ["Describe the image in detail.", "What shapes are there?", "Where is the circle?"][i]
        answer = full_greedy_words(engine, resolve_image(f"scene:{seed}", root), question, 8)
        lines.append(json.dumps({"id": f"s{i}", "image": f"scene:{seed}", "question": question, "answer": answer}))
    path = root / "selfref.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory, self_ref_data):
    out = tmp_path_factory.mktemp("quality")
    args = ["--model", "tiny-llama", "--data", str(self_ref_data), "--budgets", ",".join(QBUDGETS),
            "--max-new-tokens", "4", "--max-answer-tokens", "0", "--threads", "1", "--out", str(out), "--no-png",
            "--quiet"]
    assert quality.main(args) == 0
    return out, args


def test_quality_tables(quality_run):
    out, _ = quality_run
    res = json.loads((out / "results.json").read_text())
    assert res["methods"] == list(METHODS)
    assert res["samples"] == ["s0", "s1", "s2"]
    for name in ("ppl", "rouge_l", "kv_kept"):
        for ext in ("md", "csv", "tex"):
            assert (out / f"{name}.{ext}").is_file()
        rows = read_csv(out / f"{name}.csv")
        assert rows[0] == ["method \\ budget"] + QBUDGETS
        assert [r[0] for r in rows[1:]] == list(METHODS)
        assert all(len(r) == 1 + len(QBUDGETS) and all(r[1:]) for r in rows)
    assert (out / "quality.html").is_file()
    md = (out / "rouge_l.md").read_text()
    assert "| full | 1.000 | 1.000 |" in md
    ppl, rouge = res["tables"]["ppl"], res["tables"]["rouge_l"]
    for b in QBUDGETS:
        assert rouge["full"][b] == 1.0
        others = {m: ppl[m][b] for m in METHODS if m != "full"}
        assert all(isinstance(v, float) for v in others.values()), others
        assert ppl["full"][b] < min(others.values()), (b, ppl["full"][b], others)
        assert res["tables"]["kv_kept_pct"]["full"][b] == 100.0
    # every raw number is there: one record per (sample, method, budget); budget-free methods once
    n_fixed = sum(1 for m in METHODS if not REGISTRY[m].uses_budget)
    assert len(res["records"]) == 3 * (n_fixed + (len(METHODS) - n_fixed) * len(QBUDGETS))
    assert all(r["error"] is None and r["nll"] is not None for r in res["records"])
    assert res["counts"]["prefixkv"]["0.10"]["samples"] == 3
    assert res["prefixkv_mode"] == "online"  # the tiny model has no calibrated configuration
    # the budget is honoured: about 10% / 50% of Full's KV kept (sinks and the last prompt token on top)
    assert res["tables"]["kv_kept_pct"]["local"]["0.10"] < res["tables"]["kv_kept_pct"]["local"]["0.50"] < 60


def test_quality_resume_does_no_new_work(quality_run, capsys):
    out, args = quality_run
    store = RecordStore(out)
    before = [p.read_text() for p in store.shards()]
    first = json.loads((out / "results.json").read_text())
    assert quality.main(args) == 0
    second = json.loads((out / "results.json").read_text())
    assert [p.read_text() for p in store.shards()] == before  # nothing appended
    assert second["new_records"] == 0 and second["resumed_records"] == len(first["records"])
    assert second["tables"] == first["tables"]
    # a different configuration in the same folder is refused, not mixed in; new weights are one
    with pytest.raises(SystemExit, match="different configuration"):
        quality.main([a if a != "4" else "5" for a in args])
    from prefixkv_core.testing import build_tiny_model

    assert json.loads((out / "config.json").read_text())["weights"] == quality.weights_digest(
        build_tiny_model("llama", seed=0).model) != quality.weights_digest(build_tiny_model("llama", seed=1).model)


def test_quality_errored_records_are_retried(tmp_path, self_ref_data):
    args = ["--model", "tiny-llama", "--data", str(self_ref_data), "--limit", "1", "--methods", "full,local",
            "--budgets", "0.3", "--max-new-tokens", "2", "--max-answer-tokens", "3", "--threads", "1",
            "--out", str(tmp_path), "--no-png", "--quiet"]
    assert quality.main(args) == 0
    shard = RecordStore(tmp_path).shards()[0]
    recs = [json.loads(x) for x in shard.read_text().splitlines()]
    recs[-1]["error"] = "OutOfMemoryError: simulated"
    shard.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert quality.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["new_records"] == 1 and all(r["error"] is None for r in res["records"])


# -- data parallel under accelerate --------------------------------------------------------------------------

def test_accelerate_two_processes_match_one(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (torchrun underneath; on CPU the script asks accelerate
    for gloo) splits the samples and gathers the records; the tables equal a single-process run's.
    (`accelerate launch --cpu` starts one process unless MPI is configured, so it cannot test the split.)"""
    common = ["benchmarks/quality.py", "--model", "tiny-llama", "--device", "cpu", "--limit", "4", "--methods", "local,prefixkv",
              "--budgets", "0.3", "--max-new-tokens", "3", "--max-answer-tokens", "4", "--threads", "1",
              "--no-png", "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    one, two = tmp_path / "one", tmp_path / "two"
    assert quality.main(common[1:] + ["--out", str(one)]) == 0  # the single-process run, in this process
    launched = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
        + common + ["--out", str(two)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    r1 = json.loads((one / "results.json").read_text())
    r2 = json.loads((two / "results.json").read_text())
    assert r1["processes"] == 1 and r2["processes"] == 2
    # both processes did work and wrote their own shard
    assert sorted(p.name for p in RecordStore(two).shards()) == ["records.rank0.jsonl", "records.rank1.jsonl"]
    assert r2["tables"] == r1["tables"] and r2["counts"] == r1["counts"]
    for name in ("ppl", "rouge_l", "kv_kept"):
        assert (two / f"{name}.csv").read_text() == (one / f"{name}.csv").read_text()
    assert r2["records"] == r1["records"]  # every raw number, in the same order


# -- speed ---------------------------------------------------------------------------------------------------

SPEED_ARGS = ["--model", "tiny-llama", "--settings", "40x4", "--budgets", "0.2", "--warmup-steps", "0",
              "--threads", "1", "--no-png", "--quiet"]


def test_tensor_peak_is_the_most_the_tensors_held_at_once():
    """40 MB, then 20 MB beside it, then the 40 freed and 20 more made: 60 MB at most, above the start (and a few
    bytes of the operators' own)."""
    from benchmarks.common import TensorPeak

    before = torch.ones(1_000_000)  # held from before the block: not counted
    with TensorPeak() as held:
        a = torch.empty(10_000_000)
        b = before.repeat(5)
        del a
        c = b + 1
    assert 60_000_000 <= held.peak_over < 60_000_000 + 4096 and c.numel() == 5_000_000


def test_speed_tensor_peak_counts_each_configurations_own_tensors(tmp_path):
    """--tensor-peak: an untimed pass under the profiler per configuration; its tensors' peak holds at least the
    cache it ends with, and each row says it against Full's."""
    assert speed.main(SPEED_ARGS + ["--methods", "full,snapkv", "--no-stock", "--tensor-peak", "--out",
                                    str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    for r in rows.values():
        assert r["tensor_peak_over_bytes"] >= r["kv_bytes"] > 0
    md = (tmp_path / "speed.md").read_text()
    assert "| tensors +MiB | x full's |" in md


def test_speed_batch2_every_method_batches(tmp_path):
    assert speed.main(SPEED_ARGS + ["--batch", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in res["results"]}
    assert set(rows) == {speed.STOCK, *METHODS}
    assert all(r["status"] == "ok" for r in rows.values()), {m: r.get("error") for m, r in rows.items()}
    # per-sample plans keep a cache per prompt: the policies that say so (PrefixKV: online on the uncalibrated
    # tiny model, whose mode the policy only picks when resolved)
    per_prompt = {m for m, r in rows.items() if r["mode"] == "batched x2, a cache per prompt"}
    assert per_prompt == {m for m in METHODS if not make_policy(m, 0.2, **(
        {"mode": "online"} if m == "prefixkv" else {})).plans_rows_together()}
    assert rows["full"]["mode"] == "batched x2, one shared cache" and rows[speed.STOCK]["mode"] == "batched x2"
    md = (tmp_path / "speed.md").read_text()
    assert "Every method decodes its 2 prompts in one forward per step" in md
    assert rows["full"]["kv_pct"] == pytest.approx(100.0)
    assert rows["local"]["kv_pct"] < 40
    for r in rows.values():  # batch 2 x 3 decode steps, each timed; peak memory next to KV bytes
        assert len(r["step_s"]) == 3
        assert r["peak_bytes"] > r["kv_bytes"] > 0
    rows_csv = read_csv(tmp_path / "speed.csv")
    assert len(rows_csv) == 1 + 1 + len(METHODS) and rows_csv[0][0] == "method @ budget"
    assert res["flag_knobs"] == {"prefixkv 40x4@0.2": "mode online"}  # auto: the tiny model is not calibrated


def test_speed_ideal_steps_transformers_on_each_methods_lengths(tmp_path, monkeypatch):
    """`--ideal` times transformers alone on a cache of the lengths each method kept after its prefill, and the
    table reads each method against it."""
    from benchmarks import batched

    seen = []
    real = batched.IdealRun.prefill

    def recorded(self, ids, is_image, pixel_values):
        token = real(self, ids, is_image, pixel_values)
        seen.append(([layer.keys.shape[2] for layer in self.cache.layers], ids.shape[0]))
        return token

    monkeypatch.setattr(batched.IdealRun, "prefill", recorded)
    assert speed.main(SPEED_ARGS + ["--batch", "2", "--methods", "full,local", "--ideal", "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert rows[speed.STOCK]["ideal_tokens_per_s"] is None  # the stock run is its own ideal
    for m in ("full", "local"):
        assert rows[m]["ideal_tokens_per_s"] > 0
    local = rows["local"]["kept_after_prefill"]  # the ideal starts where the method's decoding started
    assert (local, 2) in seen and ([40] * len(local), 2) in seen and max(local) < 40
    header = read_csv(tmp_path / "speed.csv")[0]
    assert {"ideal tok/s", "x ideal", "ideal x stock"} <= set(header)


def test_speed_also_adds_a_row_of_a_method_with_a_knob_set(tmp_path):
    """`--also prefixkv.mode=online`: a second PrefixKV row beside the one its flags chose (offline where
    calibrated), each with its own claim line; a memory cap off CUDA says it has no effect."""
    args = ["--model", "embedded", "--settings", "160x3", "--budgets", "0.2", "--warmup-steps", "0", "--threads", "1",
            "--no-png", "--quiet", "--methods", "full,prefixkv", "--also", "prefixkv.mode=online", "--no-stock",
            "--memory-cap-gib", "40", "--out", str(tmp_path)]
    assert speed.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in res["results"]}
    assert set(rows) == {"full", "prefixkv", "prefixkv[mode=online]"}
    assert rows["prefixkv"]["extras"]["mode"] == "offline" and rows["prefixkv[mode=online]"]["extras"]["mode"] == "online"
    md = (tmp_path / "speed.md").read_text()
    assert "PrefixKV @ 0.2 decodes at" in md and "PrefixKV[mode=online] @ 0.2 decodes at" in md
    assert "--memory-cap-gib 40 has no effect on cpu" in md
    with pytest.raises(SystemExit, match="unknown method"):
        speed.variant_rows(["nosuch.mode=online"])


def test_speed_knob_flags_are_the_shared_ones(tmp_path):
    """--prefixkv-mode is the flag the policy declares (as in quality.py), resolved per budget by the policy's own
    hooks: offline on a model without calibrated ratios stops with the policy's message."""
    assert "--prefixkv-mode" in speed.build_parser().format_help()
    with pytest.raises(SystemExit, match="no calibrated PrefixKV configuration for model 'tiny-llama'"):
        speed.main(SPEED_ARGS + ["--methods", "full,prefixkv", "--prefixkv-mode", "offline", "--out", str(tmp_path)])


def test_speed_runs_prefixkv_offline_with_the_calibrated_ratios(tmp_path):
    """On a calibrated model, auto is offline and the policy's resolve hook fills in its ratios (only those)."""
    args = ["--model", "embedded", "--settings", "160x3", "--budgets", "0.2", "--methods", "full,prefixkv",
            "--warmup-steps", "0", "--threads", "1", "--no-png", "--quiet", "--out", str(tmp_path)]
    assert speed.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in res["results"]}
    assert rows["prefixkv"]["status"] == "ok", rows["prefixkv"].get("error")
    assert res["flag_knobs"] == {"prefixkv 160x3@0.2": "mode offline (ratios filled in for this model)"}


@pytest.mark.parametrize("method,knobs", [(m, {}) for m in METHODS]
                         + [("prefixkv", {"mode": "offline", "ratios": [0.1, 0.2, 0.3, 0.2]})])
def test_batched_rows_equal_single_runs(tiny_llama, method, knobs):
    """A batch of prompts computes what batch-1 runs compute, row by row (same greedy tokens, same kept counts),
    whether the prompts share one cache or keep one each."""
    sm = tiny_llama
    ids, is_image, pixels = synthetic_batch(sm, 2, 40, seed=3)
    both = run_timed(sm, method, 0.25, knobs, ids, is_image, pixels, 5)
    rows = [run_timed(sm, method, 0.25, knobs, ids[i:i + 1], is_image[i:i + 1], pixels[i:i + 1], 5) for i in range(2)]
    assert both["tokens"] == [r["tokens"][0] for r in rows]
    assert both["kept_per_layer"] == rows[0]["kept_per_layer"]
    assert both["kv_bytes"] == sum(r["kv_bytes"] for r in rows)


def test_speed_reports_oom_in_the_table(tmp_path, monkeypatch):
    real = speed.run_timed

    def fake(sm, method, *a, **k):
        if method == "local":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real(sm, method, *a, **k)

    monkeypatch.setattr(speed, "run_timed", fake)
    assert speed.main(SPEED_ARGS + ["--batch", "1", "--methods", "full,local,prefixkv", "--no-stock",
                                    "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in res["results"]}
    assert rows["local"]["status"] == "OOM" and "OutOfMemoryError" in rows["local"]["error"]
    assert rows["full"]["status"] == rows["prefixkv"]["status"] == "ok"
    md = (tmp_path / "speed.md").read_text()
    assert any(line.startswith("| local @ 0.2 |") and line.rstrip().endswith("| OOM |") for line in md.splitlines())
    assert read_csv(tmp_path / "speed.csv")[2][-1] == "OOM"


def test_speed_cli_errors_are_messages():
    with pytest.raises(SystemExit, match="PROMPTxGEN"):
        speed.main(SPEED_ARGS + ["--settings", "40"])
    with pytest.raises(SystemExit, match="budgets"):
        speed.main(SPEED_ARGS + ["--budgets", "1.5"])


# -- random weights with the papers' shapes ----------------------------------------------------------------

def test_random_llava_1_5_7b_shapes_on_meta():
    """LLaVA-1.5-7B's exact shapes, built on the meta device: no 7B weights are allocated."""
    cfg = random_config("llava-1.5-7b")
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
            text.intermediate_size, text.vocab_size) == (4096, 32, 32, 32, 11008, 32064)
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads, vision.image_size,
            vision.patch_size) == (1024, 24, 16, 336, 14)
    assert cfg.image_seq_length == (336 // 14) ** 2 == 576 and cfg.image_token_id == 32000
    assert cfg.vision_feature_layer == -2 and cfg.vision_feature_select_strategy == "default"

    sm = build_random_model("llava-1.5-7b", device="meta", dtype=torch.float16)
    assert {p.device.type for p in sm.model.parameters()} == {"meta"}
    assert sm.param_count() == 7_063_427_072  # llava-hf/llava-1.5-7b-hf
    shapes = {n: tuple(p.shape) for n, p in sm.model.named_parameters()}
    assert shapes["lm_head.weight"] == (32064, 4096)
    assert shapes["model.language_model.embed_tokens.weight"] == (32064, 4096)
    assert shapes["model.vision_tower.embeddings.position_embedding.weight"] == (577, 1024)  # 576 patches + CLS
    assert shapes["model.multi_modal_projector.linear_1.weight"] == (4096, 1024)
    assert (sm.num_layers, sm.image_seq_length, sm.kv_bytes_per_token()) == (32, 576, 2 * 32 * 32 * 128 * 2)

    big = random_config("llava-1.5-13b").text_config
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.vocab_size) == (5120, 40, 40, 32064)


def _shape(cfg) -> tuple:
    t, v = cfg.get_text_config(), cfg.vision_config
    return (type(t).__name__, t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers,
            t.num_attention_heads, t.num_key_value_heads, t.max_position_embeddings, t.bos_token_id,
            v.image_size, v.patch_size, v.hidden_size, v.num_hidden_layers, cfg.image_token_id, cfg.image_seq_length)


def test_random_tiny_model_is_the_test_model_shape_without_processor(tiny_llama):
    """`--random-weights tiny` builds from the same factory as the tiny test model, and runs through the runner."""
    sm = build_random_model("tiny", seed=1)
    assert _shape(sm.model.config) == _shape(tiny_llama.model.config)
    assert (sm.random_weights, sm.processor, tiny_llama.random_weights) == (True, None, False)
    assert (sm.image_size, sm.vocab_size, sm.bos_id, sm.max_context) == (32, 512, 1, 2048)
    assert (sm.image_grid, sm.kv_bytes_per_token()) == ((4, 4), tiny_llama.kv_bytes_per_token())
    with pytest.raises(ModelLoadError, match="random weights"):
        format_prompt(sm, "Hi", True)
    ids, is_image, pixels = synthetic_batch(sm, 2, 24, seed=0)
    assert (ids[:, 0] == sm.bos_id).all() and int(is_image.sum()) == 2 * sm.image_seq_length
    out = run_timed(sm, "full", 1.0, {}, ids, is_image, pixels, 3)
    assert len(out["tokens"]) == 2 and len(out["tokens"][0]) == 3


def test_interactive_time_alone_reports_each_methods_own_cost(tmp_path, capsys):
    """benchmarks/interactive.py --time-alone: the batched run's forward once, each method's own policy time,
    and each method decoded alone (TTFT, tokens/s, speed-up over Full) with the batched answer."""
    from benchmarks import interactive

    out = tmp_path / "interactive.json"
    assert interactive.main(["--model", "tiny-llama", "--methods", "full,h2o,zipvl", "--new-tokens", "3",
                             "--repeats", "1", "--time-alone", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "shared by all 3 methods" in printed and "speed-up vs Full (alone)" in printed
    report = json.loads(out.read_text())
    assert report["time_alone"] and report["batch_forward_ms_per_step"] > 0
    rows = report["per_method"]
    assert set(rows) == {"full", "h2o", "zipvl"} and rows["full"]["alone_speedup_vs_full"] == 1.0
    for m, r in rows.items():
        assert r["same_answer"] is True, m
        assert r["alone_tokens_per_s"] > 0 and r["alone_ttft_s"] > 0 and r["batched_policy_ms_per_token"] is not None
        low, high = r["alone_speedup_range"]
        assert low <= r["alone_speedup_vs_full"] <= high
    assert report["sequential_wall_s"] == report["runs"]["each_alone"][0]["total_s"]


def test_interactive_reports_the_first_token_waits(tmp_path, capsys):
    """benchmarks/interactive.py times each method's first token from the request: Full alone's, the last of the
    methods that share the prefill and the last of those with a prefill of their own (which join the batch
    later, so theirs comes after the sharing methods')."""
    from benchmarks import interactive

    out = tmp_path / "interactive.json"
    assert interactive.main(["--model", "tiny-llama", "--methods", "full,h2o,fastv,visionzip", "--new-tokens", "3",
                             "--repeats", "1", "--no-sequential", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "first token, the last of the methods that share the prefill" in printed
    waits = json.loads(out.read_text())["first_token"]
    assert 0 < waits["full_alone_s"] and 0 < waits["sharing_s"] < waits["own_prefill_s"]
    assert waits["sharing_over_full"] == pytest.approx(waits["sharing_s"] / waits["full_alone_s"])
    firsts = json.loads(out.read_text())["runs"]["together"][0]["first_token_s"]
    assert set(firsts) == {"full", "h2o", "fastv", "visionzip"}


def test_several_users_reports_the_last_users_wait_and_checks_every_answer(tmp_path, capsys):
    """benchmarks/several_users.py: N users at once against one alone and one after another, every answer equal to
    the same request alone (the exit code says so), what bounds the wait, and the peak memory."""
    from benchmarks import several_users

    out = tmp_path / "users.json"
    assert several_users.main(["--model", "tiny-llama", "--users", "3", "--methods", "full,h2o", "--new-tokens", "3",
                               "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 users at once: the last one's wait" in printed
    report = json.loads(out.read_text())
    assert report["same_answers_as_alone"] and report["largest_batch"] <= 3 * 2
    assert report["last_over_one"] == pytest.approx(report["last_of_n_at_once_s"] / report["one_user_s"])
    assert report["peak_rss_bytes"] > 0 and report["ceiling"] > 0 and report["prefill_ceiling"] > 0
    assert "prefill ceiling" in printed
    assert report["hardware_bound_s"] == pytest.approx(several_users.hardware_bound_s(
        3, report["one_prefill_s"], report["one_user_s"], report["prefill_ceiling"], report["ceiling"]))
    assert len(report["runs"]["together"][0]["each_s"]) == 3


def test_several_users_with_one_prompt_share_their_prefills(tmp_path, capsys):
    """--prompt: one prompt for every user, so their first-turn prefills share a forward (counted per repeat);
    --prefills-alone-too: the same users at once with every prefill alone, every answer the same."""
    from benchmarks import several_users

    out = tmp_path / "users.json"
    assert several_users.main(["--model", "tiny-llama", "--users", "3", "--methods", "full,h2o", "--new-tokens", "3",
                               "--repeats", "1", "--prompt", "describe the picture", "--prefills-alone-too",
                               "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "every prefill alone" in printed
    report = json.loads(out.read_text())
    assert report["same_answers_as_alone"]
    assert max(int(k) for k in report["prefill_forwards"][0]) > 1  # users' prompts shared a forward
    alone = report["runs"]["together_prefills_alone"][0]["prefill_forwards"]
    assert set(alone) == {"1"} and alone["1"] == 3
    assert report["shared_over_alone_prefills"][0] > 0


def test_the_hardware_bound_counts_batched_prefills_then_one_batched_decode():
    from benchmarks.several_users import hardware_bound_s

    # free batching: the last user waits what one user waits
    assert hardware_bound_s(4, prefill_s=1.0, alone_s=3.0, prefill_ceiling=4.0, ceiling=4.0) == pytest.approx(3.0)
    # no batching at all: four users one after another
    assert hardware_bound_s(4, prefill_s=1.0, alone_s=3.0, prefill_ceiling=1.0, ceiling=1.0) == pytest.approx(12.0)
    assert hardware_bound_s(4, prefill_s=0.5, alone_s=2.0, prefill_ceiling=1.0, ceiling=2.0) == pytest.approx(5.0)
    # batching slower than taking turns: taking turns is the bound
    assert hardware_bound_s(4, prefill_s=1.0, alone_s=3.0, prefill_ceiling=0.9, ceiling=0.5) == pytest.approx(12.0)


def test_long_context_reports_each_methods_kv_share_of_a_native_video(tmp_path, capsys):
    """benchmarks/long_context.py on a tiny OneVision: the video read on its own path (F pooled grids + a
    newline), each method's KV bytes over Full's from the record (the tensors' bytes), the comparison's wall time
    over Full alone's, and a prefill peak (or n/a where the platform cannot say)."""
    from benchmarks import long_context

    out = tmp_path / "long.json"
    assert long_context.main(["--random-weights", "tiny-llava-onevision", "--frames", "3", "--methods",
                              "full,h2o,snapkv,fastv", "--new-tokens", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "whole comparison / Full alone" in printed and "| h2o |" in printed
    result = json.loads(out.read_text())["results"][0]
    assert result["frames"] == 3 and result["video_tokens"] == 3 * 2 * 2 + 1
    assert result["methods"]["full"]["kv_share"] == 1.0
    assert all(0 < result["methods"][m]["kv_share"] < 1 for m in ("h2o", "snapkv", "fastv"))
    assert result["comparison_over_full"] == pytest.approx(
        result["comparison_s"][0] / result["full_alone_s"][0])


def test_the_bare_app_streams_the_engines_answers(tiny_llama, noise_image, tmp_path, one_torch_thread):
    """app_visitors' floor (`--engine-process floor`): the bare Gradio app streams every method's answer of the
    engine's session, and a visitor reads its stream as it reads the app's (first token, last token, the texts)."""
    from benchmarks.app_visitors import BareApp, engine_alone, visit
    from prefixkv_core import Engine

    engine = Engine(tiny_llama)
    image = tmp_path / "noise.png"
    noise_image.save(image)
    demo, url = BareApp(engine, concurrency=2).launch()
    try:
        seen = visit(url, str(image), "Describe the image.", ["full", "snapkv"], 0.5, 4)
    finally:
        demo.close()
    expected = engine_alone(engine, str(image), "Describe the image.", ["full", "snapkv"], 0.5, 4)["texts"]
    assert seen["finished"] and not seen["errors"]
    assert seen["texts"] == expected and all(expected.values())
    assert set(seen["method_first_token_s"]) == {"full", "snapkv"}
    assert 0 < seen["first_token_s"] <= seen["last_token_s"] <= seen["last_s"]
    assert seen["updates"] >= 2  # streamed, not only the result


def test_layer_allocation_reads_each_methods_entries_per_layer(tmp_path, capsys):
    """benchmarks/layer_allocation.py on a tiny model: every layer's entries once the prompt was compressed, per
    method; H2O holds the same count in every layer, PrefixKV moves entries between layers and keeps about r of
    the prompt over all of them."""
    from benchmarks import layer_allocation

    out = tmp_path / "alloc.json"
    assert layer_allocation.main(["--model", "tiny-llama", "--device", "cpu", "--tasks", "scene_qa,scene_multi",
                                  "--samples", "1", "--methods", "prefixkv,h2o", "--budgets", "0.3",
                                  "--frames", "2", "--query-agnostic", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| scene_qa | prefixkv | 0.3 |" in printed and "| scene_multi | h2o | 0.3 |" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {r["task"] for r in rows} == {"scene_qa", "scene_multi"}
    assert len(rows) == 2 * (1 + 4)  # two methods; one scene, one sample of each of scene_multi's four subtasks
    for row in rows:
        per_layer, n = row["per_layer"], row["prompt_len"]
        assert len(per_layer) == 4 and all(0 < c < n for c in per_layer)  # tiny-llama: 4 layers
        assert row["min_share"] == min(per_layer) / n and row["max_share"] == max(per_layer) / n
        if row["method"] == "h2o":
            assert len(set(per_layer)) == 1 and row["at_floor"] == 0 and row["under_quarter"] == 0
        assert sum(per_layer) / len(per_layer) == pytest.approx(0.3 * n, abs=2)
