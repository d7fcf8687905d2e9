"""The stored leaderboard read back (prefixkv_core/report/leaderboard_store.py): the shipped folders under
benchmarks/leaderboard/, and folders written here, one point per (task, model, method, query mode, budget mode,
compression ratio) with accuracy, agreement and how it was produced."""
from __future__ import annotations

import csv
import io
import json
import re

import pytest

from prefixkv_core.report.leaderboard import LeaderboardRow, method_name, split_method_name, to_csv
from prefixkv_core.report.leaderboard_store import (DEFAULT_ROOT, EXPORT_COLUMNS, load_leaderboard, points_csv,
                                                     points_json)

SHIPPED = DEFAULT_ROOT / "scene_qa"


@pytest.fixture(scope="module")
def shipped():
    return load_leaderboard()


def test_method_names_split_back_into_method_and_modes():
    for method in ("snapkv", "full", "ada_kv"):
        for query_aware in (True, False):
            for held in (True, False):
                name = method_name(method, query_aware=query_aware, held=held)
                assert split_method_name(name) == (method, query_aware, held)


def test_every_shipped_csv_row_is_one_point_with_both_scores(shipped):
    assert shipped.problems == []
    for mode in ("query-aware", "query-agnostic"):
        folder = SHIPPED / f"embedded-{mode}"
        rows = list(csv.DictReader(io.StringIO((folder / "leaderboard.csv").read_text())))
        agree = {(r["method"], r["compression_ratio"]): r for r in
                 csv.DictReader(io.StringIO((folder / "leaderboard-agreement.csv").read_text()))}
        points = [p for p in shipped.points if p.source == f"scene_qa/embedded-{mode}"]
        assert len(points) == len(rows)
        by_key = {(p.name, f"{p.compression_ratio:.4f}"): p for p in points}
        for row in rows:
            p = by_key[(row["method"], f"{float(row['compression_ratio']):.4f}")]
            assert p.accuracy == pytest.approx(float(row["score"]))
            assert p.agreement == pytest.approx(float(agree[(row["method"], row["compression_ratio"])]["score"]))
            assert p.task == "scene_qa" and p.model == "embedded" and p.budget_mode == "published"
            assert p.query_mode == mode.replace("-", "_")
            assert p.task_accuracy["scene_qa_colour"] == pytest.approx(float(row["scene_qa_colour"]))
    keys = [p.key() for p in shipped.points]
    assert len(keys) == len(set(keys))
    assert shipped.values("query_mode") == ["query_agnostic", "query_aware"]


def test_shipped_points_say_how_they_were_produced(shipped):
    payload = json.loads((SHIPPED / "embedded-query-aware" / "results.json").read_text())
    points = {(p.method, p.kept_share): p for p in shipped.select(query_mode="query_aware", budget_mode="published")}
    snap = points[("snapkv", 0.3)]
    assert snap.command == payload["command"] and snap.commit == payload["commit"]
    assert snap.produced_with.startswith("embedded") and "cpu" in snap.produced_with
    assert snap.budget == pytest.approx(0.3) and snap.samples == 343  # the headline's test scenes
    assert snap.kv_share == pytest.approx(round(payload["kv_share"]["snapkv@0.3"], 4))
    full = points[("full", 1.0)]  # the headline reports Full at r = 1
    assert full.compression_ratio == 0.0 and full.budget == 1.0 and full.accuracy > 95.0
    zipvl = next(p for p in shipped.select(query_mode="query_aware", budget_mode="published") if p.method == "zipvl")
    assert zipvl.budget is None  # budget-free: its ratio is the measured KV share
    assert zipvl.kept_share == pytest.approx(zipvl.kv_share, abs=1e-4)


def _write(folder, rows, agreement=None, payload=None, tasks=("t_a", "t_b")):
    folder.mkdir(parents=True)
    (folder / "leaderboard.csv").write_text(to_csv(rows, list(tasks)))
    if agreement is not None:
        (folder / "leaderboard-agreement.csv").write_text(to_csv(agreement, list(tasks)))
    if payload is not None:
        (folder / "results.json").write_text(json.dumps(payload))


def _row(method, ratio, a, b, model="m"):
    return LeaderboardRow("task", "", model, method, ratio, {"t_a": a, "t_b": b})


def test_a_folder_written_here_with_equal_memory_and_without_results(tmp_path):
    held = method_name("snapkv", query_aware=True, held=True)
    _write(tmp_path / "task" / "m-equal",
           [_row(held, 0.8, 50.0, 70.0), _row("full_query_aware", 0.0, 100.0, 100.0),
            _row("zipvl_query_aware", 0.85, 90.0, None)],
           agreement=[_row(held, 0.8, 40.0, 60.0), _row("full_query_aware", 0.0, 100.0, 100.0)],
           payload={"model": "m", "model_args": {"budget_mode": "equal_memory", "query_agnostic": False,
                                                 "device": "cuda", "dtype": "float16"},
                    "command": "python -m prefixkv_core.evaluation.sweep --model m --equal-memory", "commit": "abc1234",
                    "kv_share": {"snapkv@0.2": 0.21, "full@0.2": 1.0, "zipvl@0.2": 0.15},
                    "runs": [{"method": "full", "budget": 0.2, "n": {"t_a": 8, "t_b": 8}},
                             {"method": "snapkv", "budget": 0.2, "n": {"t_a": 8, "t_b": 6}},
                             {"method": "zipvl", "budget": 0.2, "n": {"t_a": 8}}]})
    # the app's export: only leaderboard.csv, query-agnostic, no results.json
    _write(tmp_path / "chat" / "app", [_row("snapkv", 0.7, 60.0, 20.0, model="tiny"),
                                       _row("h2o_equal_memory", 0.7, 10.0, 30.0, model="tiny")])
    store = load_leaderboard(tmp_path)
    assert store.problems == []
    assert store.values("source") == ["chat/app", "task/m-equal"]
    snap = store.select(model="m", budget_mode="equal_memory")
    assert [(p.method, p.kept_share) for p in snap] == [("full", 1.0), ("snapkv", 0.2), ("zipvl", 0.15)]
    full, snapkv, zipvl = snap
    assert snapkv.name == held and snapkv.accuracy == 60.0 and snapkv.agreement == 50.0
    assert snapkv.budget == 0.2 and snapkv.samples == 6 and snapkv.commit == "abc1234"
    assert snapkv.produced_with == "m (on cuda, dtype float16)"
    assert full.budget is None and full.kv_share == 1.0
    assert zipvl.agreement is None and zipvl.accuracy == 90.0 and zipvl.kv_share == 0.15
    app = store.select(model="tiny")
    assert [(p.method, p.query_mode, p.budget_mode) for p in app] == [
        ("h2o", "query_agnostic", "equal_memory"), ("snapkv", "query_agnostic", "published")]
    assert all(p.command is None and p.commit is None and p.agreement is None for p in app)


def test_broken_folders_are_skipped_and_named(tmp_path):
    _write(tmp_path / "good", [_row("snapkv", 0.5, 10.0, 20.0)])
    (tmp_path / "bad-header").mkdir()
    (tmp_path / "bad-header" / "leaderboard.csv").write_text("a,b\n1,2\n")
    (tmp_path / "bad-ratio").mkdir()
    (tmp_path / "bad-ratio" / "leaderboard.csv").write_text(
        "dataset,data_dir,model,method,compression_ratio,score\ntask,,m,h2o,7,1\n")
    _write(tmp_path / "bad-json", [_row("h2o", 0.5, 1.0, 2.0)])
    (tmp_path / "bad-json" / "results.json").write_text("{not json")
    _write(tmp_path / "z-duplicate", [_row("snapkv", 0.5, 99.0, 99.0)])
    store = load_leaderboard(tmp_path)
    assert [(p.source, p.accuracy) for p in store.points] == [("good", 15.0)]
    text = "\n".join(store.problems)
    for name in ("bad-header", "bad-ratio", "bad-json", "z-duplicate"):
        assert name in text
    assert load_leaderboard(tmp_path / "absent").points == []


def test_points_download_as_csv_and_json(shipped):
    points = shipped.select(query_mode="query_aware", budget_mode="published")
    rows = list(csv.DictReader(io.StringIO(points_csv(points))))
    assert tuple(rows[0]) == EXPORT_COLUMNS and len(rows) == len(points)
    commit = json.loads((SHIPPED / "embedded-query-aware" / "results.json").read_text())["commit"]
    assert re.fullmatch(r"[0-9a-f]{7,40}", commit)  # shipped rows come from a committed tree
    assert {r["commit"] for r in rows} == {commit}
    data = json.loads(points_json(points, metric="accuracy"))
    assert data["metric"] == "accuracy" and len(data["points"]) == len(points)
    assert "scene_qa_colour" in data["points"][0]["task_agreement"] and "kept_share" in data["points"][0]
