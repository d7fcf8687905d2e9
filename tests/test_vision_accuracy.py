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
            query_agnostic=False, draws=1):
        asked_modes.append(query_agnostic)
        asked.append((prompt, budget))
        return real(engine, image, prompt, methods, budget, max_new, budget_mode, knobs, query_agnostic, draws=draws)

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

    # two shards, each with a checkpoint of its own, joined: the same answers as one run
    shards = [tmp_path / f"shard{i}.jsonl" for i in (0, 1)]
    for i, path in enumerate(shards):
        assert va.main(args + ["--scenes", "2", "--shard", f"{i}/2", "--checkpoint", str(path), "--out",
                               str(tmp_path / f"s{i}")]) == 0
        assert {json.loads(line)["seed"] for line in path.read_text().splitlines()} == {seeds[i]}
    joined = tmp_path / "joined.jsonl"
    joined.write_text("".join(path.read_text() for path in shards))
    before = len(asked)
    assert va.main(args + ["--scenes", "2", "--checkpoint", str(joined), "--out", str(part)]) == 0
    assert len(asked) == before  # nothing asked again
    assert sorted(map(key, json.loads(part.with_suffix(".json").read_text())["records"])) == \
        sorted(map(key, whole["records"]))
    with pytest.raises(SystemExit):
        va.main(args + ["--shard", "2/2"])

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


def test_chance_rates_and_the_test_against_them():
    from benchmarks import chance

    def rec(method, draw, seed, question, correct, budget=0.1):
        return {"method": method, "budget": budget, "seed": seed, "question": question, "correct": correct,
                "draw": draw}

    records = [rec("random", d, 1, q, c) for d, answers in enumerate([(1, 0, 0, 1), (1, 0, 1, 0), (1, 0, 0, 0)])
               for q, c in zip("abcd", answers)]
    rates = chance.chance_rates(records, "random", 0.1)
    assert rates == {(1, "a"): 1.0, (1, "b"): 0.0, (1, "c"): pytest.approx(1 / 3), (1, "d"): pytest.approx(1 / 3)}
    assert chance.draw_accuracies(records, "random", 0.1) == [0.5, 0.5, 0.25]
    d = chance.spread([0.5, 0.5, 0.25])
    assert d["mean"] == pytest.approx(5 / 12) and d["sd"] == pytest.approx(0.1443, abs=1e-4) and d["draws"] == 3
    right, expected, p = chance.beats_chance({(1, q): True for q in "abcd"}, rates)
    variance = 2 * (1 / 3) * (2 / 3)
    assert (right, expected) == (4, pytest.approx(1 + 2 / 3))
    assert p == pytest.approx(chance.normal_sf((4 - (1 + 2 / 3)) / variance ** 0.5))
    assert chance.beats_chance({(1, "a"): True, (1, "b"): False}, rates)[2] == 1.0  # no variance, no excess
    assert chance.at_equal_memory([(0.1, 0.2), (0.3, 0.6)], 0.2) == pytest.approx(0.4)
    assert chance.at_equal_memory([(0.1, 0.2), (0.3, 0.6)], 0.5) is None  # never extrapolated
    assert chance.at_equal_memory([(0.1, 0.2), (0.4997, 0.6)], 0.5) == pytest.approx(0.6)  # r = 0.5's whole entries
    assert chance.at_equal_memory([(0.1, 0.2), (0.49, 0.6)], 0.5) is None


def test_controls_drawn_with_several_seeds_and_rows_at_their_real_memory(tmp_path, monkeypatch):
    """--control-seeds asks Random and Random drop with every seed (the others once), reports their spread,
    tests each method against the control of its own kind, records every answer's measured KV share and compares
    the methods at equal real memory."""
    monkeypatch.setattr(va, "figure", lambda *a: "figure skipped in tests")
    out = tmp_path / "va"
    assert va.main(["--model", "tiny-llama", "--device", "cpu", "--scenes", "1", "--methods",
                    "full,random,random_drop,snapkv,fastv", "--budgets", "0.3,0.6", "--max-new-tokens", "2",
                    "--query-agnostic", "--control-seeds", "3", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    draws = {m: {r["draw"] for r in res["records"] if r["method"] == m} for m in ("random", "random_drop", "snapkv")}
    assert draws == {"random": {0, 1, 2}, "random_drop": {0, 1, 2}, "snapkv": {0}}
    summary = res["summary"]
    assert summary["random@0.3"]["draws"]["draws"] == 3 and len(summary["random@0.3"]["draws"]["accuracies"]) == 3
    assert all(0 < r["kv_share"] <= 1.01 for r in res["records"] if r["method"] != "full")
    assert 0 < summary["snapkv@0.3"]["kv_share"] < summary["snapkv@0.6"]["kv_share"]
    md = out.with_suffix(".md").read_text()
    assert "Chance, per budget" in md and "random 3 draws" not in md and "(3 draws: sd" in md
    assert "At equal real memory" in md and "| snapkv |" in md
    for budget in ("0.3", "0.6"):
        assert f"- r = {budget}: random " in md
    assert "fastv vs random_drop" in md or "not clearly above chance (p >= 0.05): none" in md


def test_loyalty_counts_agreement_with_full_right_or_wrong():
    def rec(method, question, output, budget=0.5, draw=0):
        return {"seed": 1, "question": question, "method": method, "budget": budget, "output": output, "draw": draw,
                "qtype": "count" if question == "q2" else "colour"}

    res = {"records": [rec("full", "q1", "Red."), rec("full", "q2", "three"), rec("full", "q3", "circle"),
                       rec("h2o", "q1", "red"), rec("h2o", "q2", "two"), rec("h2o", "q3", "circle"),
                       rec("random", "q1", "blue"), rec("random", "q1", "red", draw=1)],
           "descriptions": [{"seed": 1, "method": "full", "budget": 1.0, "output": "a red circle and a blue square"},
                            {"seed": 1, "method": "h2o", "budget": 0.5, "output": "a red circle and a blue square"},
                            {"seed": 1, "method": "random", "budget": 0.5, "output": "nothing"}]}
    out = va.loyalty(res, "full")
    assert out["h2o@0.5"]["agrees_with_full"] == {"n": 3, "accuracy": 2 / 3}  # "two" differs, right or wrong
    assert out["random@0.5"]["agrees_with_full"] == {"n": 1, "accuracy": 0.0}  # its first draw only
    assert out["h2o@0.5"]["agrees_with_full_by_type"] == {"colour": {"n": 2, "accuracy": 1.0},
                                                          "count": {"n": 1, "accuracy": 0.0}}
    assert out["h2o@0.5"]["describe_rouge_l_vs_full"]["accuracy"] == pytest.approx(1.0)
    assert out["random@0.5"]["describe_rouge_l_vs_full"]["accuracy"] == pytest.approx(0.0)
    assert "full@1" not in out


def test_the_report_has_a_loyalty_table(tmp_path, monkeypatch):
    monkeypatch.setattr(va, "figure", lambda *a: "figure skipped in tests")
    out = tmp_path / "va"
    assert va.main(["--model", "tiny-llama", "--device", "cpu", "--scenes", "1", "--methods", "full,h2o",
                    "--budgets", "0.4", "--max-new-tokens", "2", "--describe", "1", "--out", str(out),
                    "--leaderboard", str(tmp_path / "lb" / "scene_qa" / "run")]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert 0.0 <= res["summary"]["h2o@0.4"]["agrees_with_full"]["accuracy"] <= 1.0
    assert res["summary"]["h2o@0.4"]["describe_rouge_l_vs_full"]["n"] == 1
    md = out.with_suffix(".md").read_text()
    assert "Agreement with Full's own answers" in md and "Descriptions against Full's (ROUGE-L F1)" in md
    from prefixkv_core.report.leaderboard_store import load_leaderboard

    h2o = next(p for p in load_leaderboard(tmp_path / "lb").points if p.method == "h2o")
    assert h2o.accuracy == pytest.approx(100 * res["summary"]["h2o@0.4"]["all"]["accuracy"])
    assert h2o.kv_share == pytest.approx(res["summary"]["h2o@0.4"]["kv_share"], abs=1e-4)


def test_a_run_with_more_methods_asks_only_the_new_ones_and_keeps_the_rows_there(tmp_path, monkeypatch):
    """The headline files grow by a method without asking the others again: a line of the earlier run keeps its
    rows, the new method is asked beside the reference (the KV shares are measured against it), and the records
    are those of one run with every method."""
    monkeypatch.setattr(va, "figure", lambda *a: "figure skipped in tests")
    asked = []
    real = va.ask_with_share

    def spy(engine, image, prompt, methods, budget, max_new, budget_mode="published", knobs=None,
            query_agnostic=False, draws=1):
        asked.append(list(methods))
        return real(engine, image, prompt, methods, budget, max_new, budget_mode, knobs, query_agnostic, draws=draws)

    monkeypatch.setattr(va, "ask_with_share", spy)
    base = ["--model", "tiny-llama", "--device", "cpu", "--scenes", "1", "--budgets", "0.4", "--max-new-tokens", "2"]
    checkpoint = tmp_path / "run.jsonl"
    assert va.main(base + ["--methods", "full,snapkv", "--checkpoint", str(checkpoint), "--out",
                           str(tmp_path / "a")]) == 0
    first = checkpoint.read_text()
    asked.clear()
    assert va.main(base + ["--methods", "full,snapkv,mixkv", "--checkpoint", str(checkpoint), "--out",
                           str(tmp_path / "b")]) == 0
    assert asked and all(methods == ["full", "mixkv"] for methods in asked)
    assert checkpoint.read_text().startswith(first)  # the earlier rows stay as they were
    grown = json.loads((tmp_path / "b").with_suffix(".json").read_text())
    asked.clear()
    assert va.main(base + ["--methods", "full,snapkv,mixkv", "--out", str(tmp_path / "c")]) == 0
    whole = json.loads((tmp_path / "c").with_suffix(".json").read_text())
    key = lambda r: (r["seed"], r["question"], r["method"], r["budget"], r["output"])  # noqa: E731
    assert sorted(map(key, grown["records"])) == sorted(map(key, whole["records"]))
    asked.clear()
    assert va.main(base + ["--methods", "full,snapkv,mixkv", "--checkpoint", str(checkpoint), "--out",
                           str(tmp_path / "d")]) == 0
    assert not asked  # every method of every line there: nothing asked
