"""Export in kvpress's leaderboard layout: one row per method and compression ratio, `dataset, data_dir, model,
method, compression_ratio, score`, then a score column per task; from the quality benchmark and the app."""
from __future__ import annotations

import csv
import io
import json

import pytest

from prefixkv_core.policies import held_in_equal_memory
from prefixkv_core.report.leaderboard import (COLUMNS, LeaderboardRow, compression_ratio, 
                                       method_name, ratio_text, to_csv)
from prefixkv_core.report.metrics import rouge_l


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_the_csv_has_the_leaderboard_columns_then_a_column_per_task():
    rows = [LeaderboardRow("builtin", "", "m", "snapkv", 0.7, {"qa": 50.0, "describe": 30.0}),
            LeaderboardRow("builtin", "", "m", "full", 0.0, {"qa": 100.0, "describe": 100.0}),
            LeaderboardRow("builtin", "", "m", "snapkv", 0.875, {"qa": None, "describe": 20.0}),
            LeaderboardRow("builtin", "", "m", "h2o", 0.5, {"qa": None, "describe": None})]
    text = to_csv(rows, ["qa", "describe"])
    header = text.splitlines()[0].split(",")
    assert header == ["dataset", "data_dir", "model", "method", "compression_ratio", "score", "qa", "describe"]
    assert tuple(header[:6]) == COLUMNS
    got = [(r["method"], r["compression_ratio"], r["score"], r["qa"], r["describe"]) for r in _rows(text)]
    assert got == [("full", "0.00", "100.00", "100.00", "100.00"), ("h2o", "0.50", "", "", ""),
                   ("snapkv", "0.70", "40.00", "50.00", "30.00"), ("snapkv", "0.875", "20.00", "", "20.00")]


def test_names_and_ratios_follow_kvpress():
    assert method_name("snapkv", query_aware=True) == "snapkv_query_aware"
    assert method_name("snapkv", query_aware=False) == "snapkv"
    assert method_name("snapkv", query_aware=True, held=True) == "snapkv_equal_memory_query_aware"
    assert compression_ratio(0.3) == pytest.approx(0.7) and compression_ratio(1.0) == 0.0
    assert compression_ratio(None, 0.2) == pytest.approx(0.8)  # budget-free: the measured share removed
    assert [ratio_text(x) for x in (0.7, 0.0, 0.875)] == ["0.70", "0.00", "0.875"]
    assert held_in_equal_memory("snapkv", "equal_memory") and not held_in_equal_memory("snapkv", "published")
    assert not held_in_equal_memory("h2o", "equal_memory")  # it holds its budget itself: the mode changes nothing
    assert held_in_equal_memory("prefixkv", "equal_memory", {"prefixkv": {"decode": "grow"}})
    assert not held_in_equal_memory("prefixkv", "equal_memory")



@pytest.mark.parametrize("flags,suffix", [([], "_query_aware"), (["--query-agnostic"], ""),
                                          (["--equal-memory"], "_equal_memory_query_aware")])
def test_quality_benchmark_writes_the_leaderboard(tmp_path, threads_restored, flags, suffix):
    from benchmarks import quality

    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "a", "image": "scene:2000000", "question": "What shapes are there?", "answer": "a red square",
         "kind": "scene-qa"},
        {"id": "b", "image": "scene:2000001", "question": "Describe the image.", "answer": "two shapes",
         "kind": "scene-description"},
        {"id": "c", "image": "scene:2000002", "question": "How many?", "answer": "three", "kind": "scene-qa"})))
    out = tmp_path / "out"
    assert quality.main(["--model", "tiny-llama", "--data", str(data), "--methods", "snapkv,h2o,zipvl", "--budgets",
                         "0.3,0.5", "--max-new-tokens", "4", "--threads", "1", "--no-png", "--quiet", "--out",
                         str(out), *flags]) == 0
    res = json.loads((out / "results.json").read_text())
    text = (out / "leaderboard.csv").read_text()
    assert text.splitlines()[0] == "dataset,data_dir,model,method,compression_ratio,score,scene-qa,scene-description"
    rows = {(r["method"], r["compression_ratio"]): r for r in _rows(text)}
    aware = "" if "--query-agnostic" in flags else "_query_aware"
    assert set(rows) == {("full" + aware, "0.00"), ("snapkv" + suffix, "0.70"), ("snapkv" + suffix, "0.50"),
                         ("h2o" + aware, "0.70"), ("h2o" + aware, "0.50"), ("zipvl" + aware, rows_ratio(rows))}
    # the scores, naively: mean ROUGE-L of the samples of each task against Full's outputs, × 100
    recs = {(r["sample"], r["method"], r["budget"]): r for r in res["records"]}
    kinds = {"a": "scene-qa", "b": "scene-description", "c": "scene-qa"}
    for (method, budget, ratio) in (("snapkv", 0.3, "0.70"), ("h2o", 0.5, "0.50")):
        row = rows[(method + (suffix if method == "snapkv" else aware), ratio)]
        want = {}
        for kind in ("scene-qa", "scene-description"):
            vals = [rouge_l(recs[(s, method, budget)]["text"], recs[(s, "full", None)]["text"])
                    for s, k in kinds.items() if k == kind]
            want[kind] = round(100 * sum(vals) / len(vals), 2)
            assert float(row[kind]) == pytest.approx(want[kind], abs=0.006)
        assert float(row["score"]) == pytest.approx(sum(want.values()) / 2, abs=0.011)
        assert row["dataset"] == "two" and row["model"] == res["config"]["model"]
    assert float(rows[("full" + aware, "0.00")]["score"]) == 100.0
    zipvl_share = res["tables"]["kv_kept_pct"]["zipvl"]["0.30"] / 100
    assert float(rows_ratio(rows)) == pytest.approx(1 - zipvl_share, abs=0.006)


def rows_ratio(rows) -> str:
    """The compression ratio ZipVL's row was written with (it has no budget: its measured one)."""
    return next(ratio for method, ratio in rows if method.startswith("zipvl"))


def test_text_mode_leaderboard_has_no_question_suffix(tmp_path, threads_restored):
    from benchmarks import quality

    out = tmp_path / "text"
    assert quality.main(["--model", "tiny-llama", "--text", "builtin", "--context-tokens", "48",
                         "--continuation-tokens", "4", "--pairs", "2", "--methods", "local", "--budgets", "0.5",
                         "--max-new-tokens", "3", "--threads", "1", "--no-png", "--quiet", "--out", str(out)]) == 0
    rows = _rows((out / "leaderboard.csv").read_text())
    assert [(r["dataset"], r["data_dir"], r["method"], r["compression_ratio"]) for r in rows] == [
        ("text-builtin", "48", "full", "0.00"), ("text-builtin", "48", "local", "0.50")]
    assert "continuation" in rows[0]


def test_app_export_writes_the_leaderboard(tiny_llama, noise_image, tmp_path):
    from prefixkv_core import Engine
    from ui.app_builder import build_app
    from ui.controller import SessionBox
    from ui.export import export_all

    ctl = build_app(Engine(tiny_llama), max_new_tokens_limit=8).controller
    box = SessionBox()
    list(ctl.compare(noise_image, "Describe.", ["full", "snapkv", "zipvl"], 0.4, 4, box=box))
    list(ctl.follow_up("And the colours?", box=box))
    results = box.run.to_dict()
    res = export_all({}, results, formats=[], out_root=str(tmp_path))
    assert any(f.endswith("leaderboard.csv") for f in res.files)
    text = open(f"{res.directory}/leaderboard.csv").read()
    assert text.splitlines()[0] == "dataset,data_dir,model,method,compression_ratio,score,turn_1,turn_2"
    rows = {r["method"]: r for r in _rows(text)}
    assert set(rows) == {"full_query_aware", "snapkv_query_aware", "zipvl_query_aware"}
    snap = results["methods"]["snapkv"]
    assert rows["snapkv_query_aware"]["compression_ratio"] == "0.60"
    for i, turn in enumerate(("turn_1", "turn_2")):
        assert float(rows["snapkv_query_aware"][turn]) == pytest.approx(100 * snap["rouge_l_per_turn"][i], abs=0.006)
        assert float(rows["full_query_aware"][turn]) == 100.0
    assert float(rows["zipvl_query_aware"]["compression_ratio"]) == pytest.approx(
        1 - results["methods"]["zipvl"]["kv_ratio"], abs=0.006)
    # the same comparison in the query-agnostic, equal-memory modes is named apart
    box2 = SessionBox()
    list(ctl.compare(noise_image, "Describe.", ["full", "snapkv"], 0.4, 3, box=box2, query_agnostic=True,
                     equal_memory=True))
    from ui.export import results_leaderboard_csv

    names = {r["method"] for r in _rows(results_leaderboard_csv(box2.run.to_dict()))}
    assert names == {"full", "snapkv_equal_memory"}
