"""benchmarks/long_accuracy.py end to end on a tiny model: every answer records the KV share it held, the controls
are asked with several draws, the [image] rows run, and the headline per task reads them as the single-image one
does; a resumed run asks nothing again."""
import json

import pytest

from benchmarks import long_accuracy as la
from benchmarks import vision_accuracy as va

ARGS = ["--model", "tiny-llama", "--device", "cpu", "--samples", "1", "--subtasks", "which,colour_seen",
        "--methods", "full,h2o,random,fastv", "--budgets", "0.3,0.6", "--max-new-tokens", "2", "--query-agnostic",
        "--budget-of-image", "--control-seeds", "2", "--frames", "2"]


def test_headline_records_and_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(va, "figure", lambda *a, **k: "figure skipped in tests")
    ckpt, out = tmp_path / "long.jsonl", tmp_path / "long"
    assert la.main([*ARGS, "--checkpoint", str(ckpt), "--json", str(tmp_path / "long.json"), "--out", str(out),
                    "--leaderboard", str(tmp_path / "lb")]) == 0
    res = json.loads((tmp_path / "long.json").read_text())
    recs = [r for r in res["records"] if r["condition"] == "images"]
    assert {r["task"] for r in recs} == {"scene_multi", "scene_video"}
    assert {r["method"] for r in recs} == {"full", "h2o", "random", "fastv", "fastv[image]"}
    for r in recs:
        assert 0 < r["kv_share"] <= 1.0 + 1e-6, r
    full = [r for r in recs if r["method"] == "full"]
    assert all(r["kv_share"] == pytest.approx(1.0) for r in full) and len(full) == 2  # asked once per sample
    draws = {(r["task"], r["budget"], r["draw"]) for r in recs if r["method"] == "random"}
    assert draws == {(t, b, d) for t in ("scene_multi", "scene_video") for b in (0.3, 0.6) for d in (0, 1)}
    assert all(r["draw"] == 0 for r in recs if r["method"] != "random")
    h2o = [r["kv_share"] for r in recs if r["method"] == "h2o" and r["budget"] == 0.3]
    assert all(s < 0.6 for s in h2o)
    md = out.with_suffix(".md").read_text()
    assert "### scene_multi" in md and "### scene_video" in md and "Chance, per budget" in md
    assert "| fastv[image] |" in md and "KV " in md

    summary = la.task_summary(res["records"], "scene_video")
    assert set(summary) == {"full@1", "h2o@0.3", "h2o@0.6", "random@0.3", "random@0.6", "fastv@0.3", "fastv@0.6",
                            "fastv[image]@0.3", "fastv[image]@0.6"}
    assert summary["random@0.3"]["all"]["n"] == 2 and summary["random@0.3"]["draws"]["draws"] == 2

    from prefixkv_core.report.leaderboard_store import load_leaderboard

    store = load_leaderboard(tmp_path / "lb")
    assert not store.problems and store.values("task") == ["scene_multi", "scene_video"]
    # each task's rows in <task>/<model>-<query mode>, where a rerun of the same setting replaces them
    assert sorted(str(f.relative_to(tmp_path / "lb")) for f in (tmp_path / "lb").rglob("leaderboard.csv")) == [
        "scene_multi/tiny-llama-query-agnostic/leaderboard.csv", "scene_video/tiny-llama-query-agnostic/leaderboard.csv"]
    h2o = next(p for p in store.select(task="scene_video") if p.method == "h2o" and p.budget == 0.3)
    assert h2o.kv_share == pytest.approx(summary["h2o@0.3"]["kv_share"], abs=1e-4)
    assert h2o.query_mode == "query_agnostic" and "long_accuracy" in h2o.command

    asked = []
    monkeypatch.setattr(la, "ask", lambda *a, **k: asked.append(a) or {})
    assert la.main([*ARGS, "--checkpoint", str(ckpt), "--no-blank"]) == 0
    assert asked == []  # every sample and budget was in the checkpoint


def test_two_shards_joined_ask_what_one_run_asks(tmp_path, monkeypatch):
    """--shard I/N: each process asks every N-th sample into a checkpoint of its own; the files joined, a run
    without --shard asks nothing again and has every answer one run has."""
    monkeypatch.setattr(va, "figure", lambda *a, **k: "figure skipped in tests")
    args = [*ARGS, "--no-blank", "--budgets", "0.3", "--control-seeds", "1", "--methods", "full,h2o"]
    whole = tmp_path / "whole.json"
    assert la.main([*args, "--json", str(whole)]) == 0
    shards = [tmp_path / f"shard{i}.jsonl" for i in (0, 1)]
    for i, path in enumerate(shards):
        assert la.main([*args, "--shard", f"{i}/2", "--checkpoint", str(path)]) == 0
    def asked_in(path):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        return {(line["task"], line["records"][0]["subtask"], line["seed"]) for line in lines}

    seen = [asked_in(path) for path in shards]
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    joined = tmp_path / "joined.jsonl"
    joined.write_text("".join(path.read_text() for path in shards))
    asked = []
    real = la.ask
    monkeypatch.setattr(la, "ask", lambda *a, **k: asked.append(a) or real(*a, **k))
    again = tmp_path / "again.json"
    assert la.main([*args, "--checkpoint", str(joined), "--json", str(again)]) == 0
    assert asked == []
    key = lambda r: (r["task"], r["seed"], r["method"], r["budget"], r["output"])  # noqa: E731
    assert sorted(map(key, json.loads(again.read_text())["records"])) == \
        sorted(map(key, json.loads(whole.read_text())["records"]))


def test_more_methods_ask_only_what_the_lines_lack(tmp_path, monkeypatch):
    """A run naming a method the checkpoint's lines lack asks only that one (Full answers beside it for the KV
    shares, not recorded again), appends lines that name it, and its tables read every line together."""
    monkeypatch.setattr(va, "figure", lambda *a, **k: "figure skipped in tests")
    args = [*ARGS, "--budgets", "0.3", "--control-seeds", "1", "--tasks", "scene_multi"]
    ckpt = tmp_path / "long.jsonl"
    assert la.main([*args, "--methods", "full,h2o", "--checkpoint", str(ckpt)]) == 0
    first = ckpt.read_text().splitlines()
    asked = []
    real = la.ask
    monkeypatch.setattr(la, "ask", lambda *a, **k: asked.append(a[3]) or real(*a, **k))
    out = tmp_path / "more.json"
    assert la.main([*args, "--methods", "full,h2o,snapkv", "--checkpoint", str(ckpt), "--json", str(out)]) == 0
    assert asked == [["full", "snapkv"]]  # the one sample; its blank baseline is there
    lines = [json.loads(raw) for raw in ckpt.read_text().splitlines()]
    assert ckpt.read_text().splitlines()[:len(first)] == first
    new = lines[len(first):]
    assert len(new) == 1 and new[0]["methods"] == ["snapkv"]
    assert {r["method"] for line in new for r in line["records"]} == {"snapkv"}
    recs = [r for r in json.loads(out.read_text())["records"] if r["condition"] == "images"]
    per = {m: sum(r["method"] == m for r in recs) for m in ("full", "h2o", "snapkv")}
    assert per == {"full": 1, "h2o": 1, "snapkv": 1}
    assert all(0 < r["kv_share"] < 1 for r in recs if r["method"] == "snapkv")
    asked.clear()
    assert la.main([*args, "--methods", "full,h2o,snapkv", "--checkpoint", str(ckpt)]) == 0
    assert asked == []


@pytest.mark.parametrize("model, expected", [("embedded", "embedded-query-agnostic"),
                                             ("llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
                                              "llava-onevision-qwen2-0.5b-ov-hf-query-agnostic"),
                                             ("/models/my model/", "my-model-query-agnostic")])
def test_leaderboard_folder_names_the_model_and_mode(tmp_path, model, expected):
    assert la.leaderboard_folder(tmp_path, "scene_video", model, True) == tmp_path / "scene_video" / expected
    aware = la.leaderboard_folder(tmp_path, "scene_video", model, False)
    assert aware.name == expected.replace("query-agnostic", "query-aware")
