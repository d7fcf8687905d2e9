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


def test_each_subtask_is_a_column_of_both_scores(tmp_path):
    """A long-cache task's own subtasks (not the single-image question types) become the columns, of the accuracy
    and of the agreement with Full alike; Full agrees with itself in every column."""
    by_sub = {"needle": {"correct": 1, "n": 4, "accuracy": 0.25}, "count": {"correct": 3, "n": 4, "accuracy": 0.75}}
    summary = {
        "full@1": {"all": {"correct": 7, "n": 8, "accuracy": 0.875}, "needle": by_sub["count"], "count": by_sub["count"]},
        "h2o@0.1": {"all": {"correct": 4, "n": 8, "accuracy": 0.5}, **by_sub, "kv_share": 0.1,
                    "agrees_with_full": {"n": 8, "accuracy": 0.5},
                    "agrees_with_full_by_type": {"needle": {"n": 4, "accuracy": 0.0}, "count": {"n": 4, "accuracy": 1.0}}},
    }
    folder = tmp_path / "scene_multi" / "run"
    al.write(folder, summary, model="embedded", budget_mode="published", query_agnostic=True, task="scene_multi",
             qtypes=["needle", "count"], command="python -m benchmarks.long_accuracy", commit="abc1234")
    assert (folder / "leaderboard.csv").read_text().splitlines()[0].endswith("score,scene_multi_needle,scene_multi_count")
    assert (folder / "leaderboard-agreement.csv").read_text().splitlines()[0].endswith(
        "score,scene_multi_needle,scene_multi_count")
    points = {p.method: p for p in load_leaderboard(tmp_path).points}
    h2o, full = points["h2o"], points["full"]
    assert h2o.task_accuracy == {"scene_multi_needle": 25.0, "scene_multi_count": 75.0} and h2o.accuracy == 50.0
    assert h2o.task_agreement == {"scene_multi_needle": 0.0, "scene_multi_count": 100.0} and h2o.agreement == 50.0
    assert full.task_agreement == {"scene_multi_needle": 100.0, "scene_multi_count": 100.0}


def test_the_device_and_dtype_recorded_are_those_the_model_ran_on():
    import torch
    from types import SimpleNamespace

    ran = al.ran_on(SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16))
    assert ran == {"device": "cpu", "dtype": "bfloat16"}
