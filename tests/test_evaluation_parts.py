"""The lmms-eval bridge's parts that need no lmms-eval: model_args read with the engine's messages, generation
settings from a task's kwargs, stop strings, agreement with Full, leaderboard rows, and a sample over the model's
context skipped by id while the next one is answered."""
import pytest

from prefixkv_core import Engine
from prefixkv_core.evaluation.agreement import agreement, picked
from prefixkv_core.evaluation.answers import AnswerBank, Sample, cut_at_stop
from prefixkv_core.evaluation.gen_kwargs import generation_settings, stop_strings
from prefixkv_core.evaluation.leaderboard_rows import leaderboard_rows
from prefixkv_core.evaluation.model_args import parse_model_args
from prefixkv_core.method_args import MethodArgError


@pytest.mark.parametrize("args, message", [
    ({"method": "nosuch"}, "unknown method(s) 'nosuch'; accepted: full"),
    ({"method": "snapkv", "knobs": "snapkv.nosuch=1"}, "snapkv has no knob(s) nosuch; its knobs: window"),
    ({"method": "snapkv", "knobs": "snapkv.window=-3"}, "window must be a whole number in [1, 4096]"),
    ({"method": "snapkv", "budget": 1.5}, "budget must be a kept fraction in (0, 1], got 1.5"),
    ({"method": "snapkv", "budget_mode": "tight"}, "budget_mode must be one of published, equal_memory"),
    ({"colour": "red"}, "unknown colour; accepted: pretrained, method"),
])
def test_bad_model_args_get_the_engines_message(args, message):
    with pytest.raises(MethodArgError) as err:
        parse_model_args(args)
    assert message in str(err.value)


def test_sweep_model_args():
    s = parse_model_args({"pretrained": "embedded", "methods": "snapkv+zipvl", "budgets": "0.5+0.1",
                          "knobs": "snapkv.window=16;zipvl.tau=0.9", "query_agnostic": True, "batch_size": 1})
    assert s.is_sweep and s.reference == "full" and s.query_agnostic
    assert [float(b) for b in s.budgets] == [0.1, 0.5]
    assert s.knobs == {"snapkv": {"window": 16}, "zipvl": {"tau": 0.9}}
    # ZipVL sets its own share (no budget): asked once, in the first batch with Full
    assert [(m, float(b)) for m, b in s.runs()] == [("snapkv", 0.1), ("zipvl", 0.1), ("snapkv", 0.5)]
    assert s.batch(s.budgets[0]) == ["full", "snapkv", "zipvl"] and s.batch(s.budgets[1]) == ["snapkv"]
    one = parse_model_args({"method": "snapkv", "budget": 0.2})
    assert not one.is_sweep and one.reference is None


def test_generation_kwargs_and_stop_strings():
    greedy = generation_settings({"max_new_tokens": 8, "temperature": 0, "do_sample": False}, seed=3)
    assert (greedy.max_new_tokens, greedy.do_sample, greedy.seed) == (8, False, 3)
    sampled = generation_settings({"temperature": 0.2, "top_p": 0.5}, seed=0)
    assert sampled.do_sample and sampled.temperature == 0.2 and sampled.top_p == 0.5
    assert stop_strings({"until": "\n\n"}) == ["\n\n"] and stop_strings({}) == []
    assert cut_at_stop("red\n\nblue", ("\n\n",)) == "red"


def test_agreement_with_full():
    full = [{"doc_id": 0, "filtered_resps": ["Red."]}, {"doc_id": 1, "filtered_resps": ["circle"]}]
    method = [{"doc_id": 0, "filtered_resps": ["red"]}, {"doc_id": 1, "filtered_resps": ["square"]}]
    assert agreement(method, full) == 0.5
    # multiple choice: the option with the highest log-likelihood is the answer
    assert picked([[[-3.0, False], [-1.0, True], [-2.0, False]]]) == 1


def test_leaderboard_rows_from_a_sweep():
    payload = {"model": "embedded", "tasks": "scene_qa",
               "model_args": {"query_agnostic": True, "budget_mode": "published"},
               "kv_share": {"zipvl@0.1": 0.25},
               "runs": [{"method": "full", "budget": 0.1, "scores": {"a": 1.0}, "agreement": {"a": 1.0}},
                        {"method": "snapkv", "budget": 0.1, "scores": {"a": 0.5}, "agreement": {"a": 0.75}},
                        {"method": "zipvl", "budget": 0.1, "scores": {"a": 0.9}, "agreement": {"a": 0.8}}]}
    scores, agree = leaderboard_rows(payload)
    assert scores.splitlines()[0] == "dataset,data_dir,model,method,compression_ratio,score,a"
    assert "scene_qa,,embedded,snapkv,0.90,50.00,50.00" in scores  # query-agnostic: no suffix, as kvpress
    assert "scene_qa,,embedded,full,0.00,100.00,100.00" in scores
    assert "scene_qa,,embedded,zipvl,0.75,90.00,90.00" in scores  # measured share for a method without a budget
    assert "scene_qa,,embedded,snapkv,0.90,75.00,75.00" in agree


def _lmms_eval_output(folder, model_args, answers):
    """An lmms-eval output folder as `--log_samples` leaves it: results, and one samples file per task."""
    import json

    folder.mkdir(parents=True)
    (folder / "20261125_120000_results.json").write_text(json.dumps({
        "config": {"model": "prefixkv", "model_args": model_args},
        "results": {"scene_qa_colour": {"alias": "scene_qa_colour", "accuracy,none": sum(c for _, c in answers) / 2,
                                        "accuracy_stderr,none": 0.0}}}))
    (folder / "20261125_120000_samples_scene_qa_colour.jsonl").write_text("\n".join(
        json.dumps({"doc_id": i, "filtered_resps": [text], "accuracy": c}) for i, (text, c) in enumerate(answers)))


def test_leaderboard_rows_from_separate_lmms_eval_runs(tmp_path):
    from prefixkv_core.evaluation.collect import collect, split_model_args

    assert split_model_args('pretrained=embedded,knobs="snapkv.window=16;h2o.recent_fraction=0.5",query_agnostic=true') \
        == {"pretrained": "embedded", "knobs": "snapkv.window=16;h2o.recent_fraction=0.5", "query_agnostic": True}
    _lmms_eval_output(tmp_path / "full", "pretrained=embedded,method=full", [("red", 1), ("blue", 1)])
    _lmms_eval_output(tmp_path / "snapkv", "pretrained=embedded,method=snapkv,budget=0.2", [("red", 1), ("green", 0)])
    scores, agree = leaderboard_rows(collect([tmp_path / "full", tmp_path / "snapkv"]))
    assert "scene_qa_colour,,embedded,snapkv_query_aware,0.80,50.00,50.00" in scores
    assert "scene_qa_colour,,embedded,full_query_aware,0.00,100.00,100.00" in scores
    assert "scene_qa_colour,,embedded,snapkv_query_aware,0.80,50.00,50.00" in agree


def test_a_sample_over_the_context_is_skipped_by_id(tiny_llama):
    engine = Engine(tiny_llama)
    bank = AnswerBank(engine, parse_model_args({"pretrained": "tiny-llama", "methods": "snapkv", "budget": 0.5}))
    too_long = Sample("task/test/7", "word " * (tiny_llama.max_context + 8))
    assert bank.answer(too_long, ("snapkv", 0.5)) == ""
    assert "task/test/7" in bank.skipped and "over the model's context" in bank.skipped["task/test/7"]
    fine = Sample("task/test/8", "Describe the image.")
    assert isinstance(bank.answer(fine, ("snapkv", 0.5)), str) and "task/test/8" not in bank.skipped
