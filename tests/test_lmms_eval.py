"""The lmms-eval model `prefixkv` through lmms-eval itself, on the offline scene_qa task (test-split scenes, one
subtask per question type): Full gives the answers and accuracy of benchmarks/vision_accuracy.py on the same
questions, SnapKV at r = 0.1 query-agnostic gives that method's, two processes (accelerate, CPU) give what one
gives, a sweep reads every method from one batched decode per budget, bad model_args fail at construction
with the engine's message, and the multi-image and video tasks (scene_multi, scene_video) are answered as the
engine answers them.

The single-process runs are one lmms-eval process given a list of runs (its `--config` file takes a list, each
run with its own model_args and output folder, a failed run logged and the next one started), as a user sweeping
configurations by hand would: lmms-eval's start-up (about ten seconds of imports and task indexing) is paid once.

lmms-eval lives in its own venv, .venv-eval (`make eval-setup`, which `make test` runs); the tests drive it as
a subprocess and are skipped without it. PREFIXKV_EVAL_PYTHON names another interpreter that has it."""
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import vision_accuracy as va
from benchmarks.scene_tasks import MAX_NEW_TOKENS  # the task's max_new_tokens, vision_accuracy's default too
from scenes import render_scene

ROOT = Path(__file__).resolve().parents[1]
EVAL_PY = Path(os.environ.get("PREFIXKV_EVAL_PYTHON", ROOT / ".venv-eval" / "bin" / "python"))
TASKS = "scene_qa"
TASK_DATA = ROOT / "benchmarks" / "lmms_tasks" / "scene_qa" / "data"

pytestmark = pytest.mark.skipif(not EVAL_PY.exists(), reason=f"no lmms-eval venv at {EVAL_PY} (make eval-setup)")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _samples_and_results(out: Path):
    """lmms-eval's output folder -> ({task: {doc_id: sample}}, the results JSON)."""
    samples = {}
    for path in out.rglob("*_samples_*.jsonl"):
        task = path.stem.split("_samples_", 1)[1]
        samples[task] = {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}
    results = json.loads(next(out.rglob("*_results.json")).read_text())
    return samples, results


def launched_lmms_eval(out: Path, model_args: str, processes: int):
    """`accelerate launch --cpu --num_processes N -m lmms_eval --model prefixkv ...` on scene_qa's first doc of each
    task; -> lmms-eval's output: {task: {doc_id: sample}} and the results JSON."""
    cmd = [str(EVAL_PY), "-m", "accelerate.commands.launch", "--cpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "lmms_eval", "--model", "prefixkv", "--model_args", model_args, "--tasks", TASKS,
           "--include_path", "benchmarks/lmms_tasks", "--limit", "1", "--log_samples", "--output_path", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _samples_and_results(out)


# The runs of the one lmms-eval process: name -> (model_args, tasks); each asks the first doc of every task.
RUNS = {
    "full": ("pretrained=embedded,method=full", TASKS),
    "snapkv": ("pretrained=embedded,method=snapkv,budget=0.1,query_agnostic=true,frames=4",
               f"{TASKS},scene_multi_which,scene_video_direction"),
    "bad_knob": ("pretrained=embedded,method=snapkv,knobs=snapkv.nosuch=1", TASKS),  # last: it fails
}


@dataclass
class ConfigRuns:
    log: str  # the process's stdout and stderr
    outputs: dict[str, Path]  # run name -> its output folder

    def read(self, name: str):
        return _samples_and_results(self.outputs[name])


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory) -> ConfigRuns:
    root = tmp_path_factory.mktemp("runs")
    outputs = {name: root / name for name in RUNS}
    config = [{"model": "prefixkv", "model_args": model_args, "tasks": tasks, "include_path": "benchmarks/lmms_tasks",
               "limit": 1, "log_samples": True, "output_path": str(outputs[name])}
              for name, (model_args, tasks) in RUNS.items()]
    path = root / "runs.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    proc = subprocess.run([str(EVAL_PY), "-m", "lmms_eval", "--config", str(path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ConfigRuns(proc.stdout + proc.stderr, outputs)


def docs(task: str) -> list[dict]:
    return json.loads((TASK_DATA / f"{task.removeprefix('scene_qa_')}.json").read_text())


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    from prefixkv_core import Engine, load_model

    return Engine(load_model("embedded", device="cpu"))


def benchmark_answers(engine, samples, method: str, budget: float, query_agnostic: bool = False):
    """What benchmarks/vision_accuracy.py answers (its `ask`, its grading) for the docs lmms-eval asked."""
    out = {}
    for task, by_id in samples.items():
        rows = docs(task)
        for doc_id in by_id:
            row = rows[doc_id]
            text = va.ask(engine, render_scene(row["seed"]).image, row["question"], [method], budget,
                          MAX_NEW_TOKENS, query_agnostic=query_agnostic)[method]
            out[(task, doc_id)] = (text, va.is_correct(text, row["answer"]))
    return out


def assert_same_as_benchmark(samples, results, expected):
    from scenes.grading import normalise

    for (task, doc_id), (text, correct) in expected.items():
        got = samples[task][doc_id]
        assert normalise(got["filtered_resps"][0] if isinstance(got["filtered_resps"], list) else got["filtered_resps"]) \
            == normalise(text), (task, doc_id)
        assert got["accuracy"] == float(correct), (task, doc_id)
    for task in samples:  # the accuracy lmms-eval reports is the benchmark's on these questions
        mine = [c for (t, _), (_, c) in expected.items() if t == task]
        assert results["results"][task]["accuracy,none"] == pytest.approx(sum(mine) / len(mine))


@pytest.fixture(scope="module")
def full_run(config_runs):
    return config_runs.read("full")


def test_full_gives_the_vision_benchmarks_accuracy(full_run, engine):
    samples, results = full_run
    assert set(samples) == {f"scene_qa_{q}" for q in ("colour", "shape", "count", "position", "word", "yesno")}
    assert_same_as_benchmark(samples, results, benchmark_answers(engine, samples, "full", 1.0))
    assert "accuracy,none" in results["results"]["scene_qa"]  # the group's pooled accuracy


def test_a_method_at_r_01_query_agnostic_gives_its_benchmark_figure(config_runs, engine):
    samples, results = config_runs.read("snapkv")
    samples = {task: by_id for task, by_id in samples.items() if task.startswith("scene_qa_")}
    assert len(samples) == 6
    assert_same_as_benchmark(samples, results,
                             benchmark_answers(engine, samples, "snapkv", 0.1, query_agnostic=True))


def test_two_processes_match_one(full_run, tmp_path):
    samples, results = launched_lmms_eval(tmp_path, "pretrained=embedded,method=full", processes=2)
    one, _ = full_run
    assert set(samples) == set(one)
    for task in one:
        assert sorted(samples[task]) == sorted(one[task])
        for doc_id, s in one[task].items():
            assert samples[task][doc_id]["filtered_resps"] == s["filtered_resps"], (task, doc_id)
        assert results["results"][task]["accuracy,none"] == full_run[1]["results"][task]["accuracy,none"]


def test_bad_model_args_fail_at_construction_with_the_engines_message(config_runs):
    # lmms-eval's CLI logs a failed run and still exits 0: the message and the missing outputs tell
    assert "snapkv has no knob(s) nosuch; its knobs: window" in config_runs.log
    assert not list(config_runs.outputs["bad_knob"].rglob("*_samples_*.jsonl"))


def test_a_sweep_decodes_each_sample_once_per_budget(tmp_path, engine):
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [str(EVAL_PY), "-m", "prefixkv_core.evaluation.sweep", "--model", "embedded", "--device", "cpu",
         "--methods", "snapkv,h2o", "--budgets", "0.1,0.5", "--tasks", "scene_qa_colour,scene_qa_count",
         "--include_path", "benchmarks/lmms_tasks", "--limit", "1", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    runs = {(r["method"], r["budget"]): r for r in res["runs"]}
    assert set(runs) == {("full", 0.1), ("snapkv", 0.1), ("h2o", 0.1), ("snapkv", 0.5), ("h2o", 0.5)}
    assert res["sessions"] == 2 * 2  # 2 samples x 2 budgets, against 2 x 5 for one run per method and budget
    for (method, budget), run in runs.items():  # each run's answers are the engine's for that method
        assert set(run["agreement"]) == {"scene_qa_colour", "scene_qa_count"}
        for task, answers in run["answers"].items():
            row = docs(task)[0]
            text = va.ask(engine, render_scene(row["seed"]).image, row["question"], [method], budget,
                          MAX_NEW_TOKENS)[method]
            assert answers["0"][0].strip() == text.strip(), (method, budget, task)
    assert runs[("full", 0.1)]["agreement"] == {"scene_qa_colour": 1.0, "scene_qa_count": 1.0}
    board = (out / "leaderboard.csv").read_text().splitlines()
    assert board[0] == "dataset,data_dir,model,method,compression_ratio,score,scene_qa_colour,scene_qa_count"
    assert len(board) == 1 + 5
    assert len((out / "leaderboard-agreement.csv").read_text().splitlines()) == 1 + 5


def test_a_device_in_model_args_and_on_the_command_line_do_not_clash():
    code = ("from prefixkv_core.evaluation.lmms_model import PrefixKV\n"
            "from prefixkv_core.method_args import MethodArgError\n"
            "try:\n"
            "    PrefixKV.create_from_arg_string('method=snapkv,device=cpu,knobs=snapkv.nosuch=1',"
            " {'device': 'cuda', 'batch_size': 1})\n"
            "except MethodArgError as exc:\n"
            "    print('refused:', exc)\n")
    proc = subprocess.run([str(EVAL_PY), "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert "refused: knobs: snapkv has no knob(s) nosuch" in proc.stdout, proc.stderr[-2000:]


def test_several_images_and_a_video_are_answered_as_the_engine_answers(config_runs, engine):
    """scene_multi's samples (a list of images) and scene_video's (an mp4 path, sampled to `frames`) are answered,
    not skipped: each answer is the engine's own for the same images (or clip) and prompt."""
    from prefixkv_core import GenerationSettings
    from scenes.grading import normalise
    from scenes.multi import multi_prompt, multi_sample
    from scenes.video import cached_clip

    samples, _ = config_runs.read("snapkv")  # SnapKV at r = 0.1, query-agnostic, 4 frames
    multi = json.loads((ROOT / "benchmarks/lmms_tasks/scene_multi/data/which.json").read_text())[0]
    video = json.loads((ROOT / "benchmarks/lmms_tasks/scene_video/data/direction.json").read_text())[0]
    asks = {"scene_multi_which": (list(multi_sample(multi["seed"], multi["n_images"]).images),
                                  multi_prompt(multi["question"], multi["n_images"]), {}),
            "scene_video_direction": (None, video["question"],
                                      {"video": str(cached_clip(video["seed"], video["frames"])), "frames": 4})}
    for task, (images, prompt, media) in asks.items():
        session = engine.new_session(images, prompt, ["snapkv"], 0.1, GenerationSettings(max_new_tokens=MAX_NEW_TOKENS),
                                     query_agnostic=True, **media)
        list(session.run())
        got = samples[task][0]
        resp = got["filtered_resps"][0] if isinstance(got["filtered_resps"], list) else got["filtered_resps"]
        assert normalise(resp) == normalise(session.states["snapkv"].text), task
        assert session.prefill.image_tokens == 144 * (len(images) if images else 4)
