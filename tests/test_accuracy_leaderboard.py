"""benchmarks/accuracy_leaderboard.py: the headline's summary written in the leaderboard's layout reads back through
the app's store with each row's accuracy, agreement, budget, questions and measured KV share."""
import pytest

from benchmarks import accuracy_leaderboard as al
from prefixkv_core.report.leaderboard_store import load_leaderboard

SUMMARY = {
    "full@1": {"all": {"correct": 9, "n": 10, "accuracy": 0.9}, "kv_share": 1.0},
    "zipvl@1": {"all": {"correct": 8, "n": 10, "accuracy": 0.8}, "kv_share": 0.42,
                "agrees_with_full": {"n": 10, "accuracy": 0.7}},
    "snapkv@0.1": {"all": {"correct": 3, "n": 10, "accuracy": 0.3}, "kv_share": 0.17,
                   "agrees_with_full": {"n": 10, "accuracy": 0.2}},
    "dart[image]@0.1": {"all": {"correct": 4, "n": 10, "accuracy": 0.4}, "kv_share": 0.24, "image_kept_share": 0.1,
                        "agrees_with_full": {"n": 10, "accuracy": 0.5}},
    "random@0.1": {"all": {"correct": 10, "n": 50, "accuracy": 0.2}, "kv_share": 0.1,
                   "draws": {"draws": 5}, "agrees_with_full": {"n": 10, "accuracy": 0.1}},
    "h2o@0.1": {"describe_named_objects": {"n": 1, "accuracy": 0.5}},  # descriptions only: no row
}


@pytest.mark.parametrize("query_agnostic", [True, False])
def test_rows_read_back_at_their_measured_share(tmp_path, query_agnostic):
    folder = tmp_path / "scene_qa" / "run"
    al.write(folder, SUMMARY, model="embedded", budget_mode="equal_memory", query_agnostic=query_agnostic,
             command="python -m benchmarks.vision_accuracy --scenes 1", commit="abc1234")
    store = load_leaderboard(tmp_path)
    assert not store.problems
    points = {p.method: p for p in store.points}
    assert set(points) == {"full", "zipvl", "snapkv", "dart[image]", "random"}
    mode = "query_agnostic" if query_agnostic else "query_aware"
    assert {p.query_mode for p in store.points} == {mode} and {p.budget_mode for p in store.points} == {"equal_memory"}
    full, zipvl, snap, dart = points["full"], points["zipvl"], points["snapkv"], points["dart[image]"]
    assert full.compression_ratio == 0.0 and full.accuracy == pytest.approx(90.0) and full.agreement == 100.0
    assert zipvl.compression_ratio == pytest.approx(0.58) and zipvl.kv_share == pytest.approx(0.42)
    assert snap.compression_ratio == pytest.approx(0.9) and snap.budget == pytest.approx(0.1)
    assert snap.kv_share == pytest.approx(0.17) and snap.samples == 10 and snap.agreement == pytest.approx(20.0)
    assert dart.kv_share == pytest.approx(0.24) and dart.accuracy == pytest.approx(40.0)
    assert points["random"].samples == 50 and points["random"].accuracy == pytest.approx(20.0)
    assert snap.commit == "abc1234" and "vision_accuracy" in snap.command
    assert snap.produced_with.startswith("embedded")
