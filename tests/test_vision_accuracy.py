"""benchmarks/vision_accuracy.py end to end on the tiny model: records, the methods without a budget (Full,
ZipVL) asked once, the tables."""
import json

from benchmarks import vision_accuracy as va


def test_scoring_takes_whole_words_only():
    assert va.is_correct("Red.", "red")
    assert va.is_correct("a blue circle in the corner", "a blue circle")
    assert not va.is_correct("reddish", "red")
    assert not va.is_correct("", "red")


def test_methods_by_budgets_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(va, "figure", lambda *a: "figure skipped in tests")
    out = tmp_path / "va"
    assert va.main(["--model", "tiny-llama", "--device", "cpu", "--scenes", "1", "--methods",
                    "full,prefixkv,snapkv,zipvl", "--budgets", "0.3,0.6", "--max-new-tokens", "2", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    keys = set(res["summary"])
    assert keys == {"full@1", "zipvl@1", "prefixkv@0.3", "prefixkv@0.6", "snapkv@0.3", "snapkv@0.6"}
    n_questions = len({r["question"] for r in res["records"]})
    for method in ("full", "zipvl"):  # no budget (Full keeps everything, ZipVL follows tau): asked once
        assert len([r for r in res["records"] if r["method"] == method]) == n_questions, method
    assert res["accuracy"] is not None and set(res["accuracy"]) >= {"colour", "all"}
    md = out.with_suffix(".md").read_text()
    assert "| method | 0.3 | 0.6 | 1 |" in md and "| full |" in md and "| prefixkv@0.3 |" in md


def test_controls_and_budget_mode(tmp_path, monkeypatch):
    """--controls adds the blank-image and freeform checks (full cache); --equal-memory is recorded."""
    monkeypatch.setattr(va, "figure", lambda *a: "figure skipped in tests")
    out = tmp_path / "va"
    assert va.main(["--model", "tiny-llama", "--device", "cpu", "--scenes", "1", "--methods", "full,snapkv",
                    "--budgets", "0.5", "--max-new-tokens", "2", "--controls", "2", "--equal-memory",
                    "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["budget_mode"] == "equal_memory"
    sets = {r["set"] for r in res["control_records"]}
    assert sets == {"blank", "freeform"}
    assert set(res["controls"]["blank"]) <= {"colour", "shape"}
    assert res["controls"]["freeform"]["colour"]["n"] == 2
    questions = [r["question"] for r in res["control_records"] if r["set"] == "freeform"]
    assert all("What colour is the" not in q for q in questions)  # not the templates' wording
    assert "Controls (full cache)" in out.with_suffix(".md").read_text()
