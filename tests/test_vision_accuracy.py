"""benchmarks/vision_accuracy.py end to end on the tiny model: records, the methods without a budget (Full,
ZipVL) asked once, the tables."""
import json

import pytest

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


def test_query_agnostic_run_resumes_from_its_checkpoint_and_names_who_does_not_beat_random(tmp_path, monkeypatch):
    """--query-agnostic reaches the engine; a run stopped after some scenes resumes from --checkpoint without
    asking them again and gives the same records as one run; each budget gets a line naming the methods whose
    accuracy is not above Random's."""
    monkeypatch.setattr(va, "figure", lambda *a: "figure skipped in tests")
    asked_modes, asked = [], []
    real = va.ask_with_share

    def spy(engine, image, prompt, methods, budget, max_new, budget_mode="published", knobs=None,
            query_agnostic=False):
        asked_modes.append(query_agnostic)
        asked.append((prompt, budget))
        return real(engine, image, prompt, methods, budget, max_new, budget_mode, knobs, query_agnostic)

    monkeypatch.setattr(va, "ask_with_share", spy)
    args = ["--model", "tiny-llama", "--device", "cpu", "--methods", "full,random,snapkv", "--budgets", "0.3,0.6",
            "--max-new-tokens", "2", "--query-agnostic"]
    one = tmp_path / "one"
    assert va.main(args + ["--scenes", "2", "--out", str(one)]) == 0
    assert asked_modes and all(asked_modes)
    whole = json.loads(one.with_suffix(".json").read_text())
    assert whole["query_agnostic"] is True

    checkpoint = tmp_path / "run.jsonl"
    part = tmp_path / "part"
    assert va.main(args + ["--scenes", "1", "--checkpoint", str(checkpoint), "--out", str(part)]) == 0
    before = len(asked)
    assert va.main(args + ["--scenes", "2", "--checkpoint", str(checkpoint), "--out", str(part)]) == 0
    seeds = sorted({r["seed"] for r in whole["records"]}, key=[r["seed"] for r in whole["records"]].index)
    second = {r["question"] for r in whole["records"] if r["seed"] == seeds[1]}
    assert len(asked) - before == 2 * len(second)  # only the second scene, at both budgets
    resumed = json.loads(part.with_suffix(".json").read_text())
    key = lambda r: (r["seed"], r["question"], r["method"], r["budget"], r["output"])  # noqa: E731
    assert sorted(map(key, resumed["records"])) == sorted(map(key, whole["records"]))

    md = one.with_suffix(".md").read_text()
    assert "Methods that do not beat random" in md
    for budget in ("0.3", "0.6"):
        assert f"- r = {budget}: random " in md
    lines = va.not_above_control(whole["summary"], "random")
    assert set(lines) == {0.3, 0.6}
    for budget, (acc, names) in lines.items():
        snap = whole["summary"][f"snapkv@{budget:g}"]["all"]["accuracy"]
        assert ("snapkv" in names) == (snap <= acc)
        assert "full" not in names  # no budget: not compared
    assert "above it but not clearly (p >= 0.05)" in md


def test_the_sign_test_against_brute_force():
    import itertools

    for wins, losses in [(0, 0), (3, 0), (5, 0), (4, 4), (7, 2), (2, 9), (12, 5)]:
        n = wins + losses
        tosses = list(itertools.product([0, 1], repeat=n))
        brute = sum(sum(t) >= wins for t in tosses) / len(tosses)
        assert va.sign_test_p(wins, losses) == pytest.approx(brute)
    assert va.sign_test_p(5, 0) == pytest.approx(1 / 32)


def test_methods_are_paired_with_the_control_on_the_same_questions():
    def rec(method, budget, seed, question, correct):
        return {"method": method, "budget": budget, "seed": seed, "question": question, "correct": correct}

    records = [rec("random", 0.1, 1, "a", True), rec("random", 0.1, 1, "b", False), rec("random", 0.1, 2, "a", False),
               rec("snapkv", 0.1, 1, "a", False), rec("snapkv", 0.1, 1, "b", True), rec("snapkv", 0.1, 2, "a", True),
               rec("snapkv", 0.1, 3, "a", True),  # no control answer for this question: left out
               rec("snapkv", 0.3, 1, "a", True),  # no control at this budget: left out
               rec("full", 1.0, 1, "a", True)]  # no budget: never compared
    assert va.paired_against_control(records, "random") == {("snapkv", 0.1): (2, 1)}
