"""Writes the offline lmms-eval task `scene_qa` (benchmarks/lmms_tasks/scene_qa/): the questions of the first
--scenes seeds of the scenes' TEST split, one subtask per question type (`scene_qa_colour`, ...), each a YAML
beside a local JSON file (`dataset_path: json`). A record holds the scene's seed, not its pixels: the task's
`doc_to_visual` renders the scene from it, so the images are the ones `benchmarks/vision_accuracy.py` asks about.

    python -m benchmarks.scene_tasks --scenes 40

lmms-eval reads `data_files` relative to the working directory: run it from the repository root, with
`--include_path benchmarks/lmms_tasks`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from scenes import QTYPES, render_scene, split_seeds

TASK_DIR = Path(__file__).resolve().parent / "lmms_tasks" / "scene_qa"
GROUP = "scene_qa"
SPLIT = "test"
MAX_NEW_TOKENS = 8  # as benchmarks/vision_accuracy.py: the answers are a word or three

SUBTASK_YAML = """\
task: {task}
include: _default_template_yaml
dataset_kwargs:
  data_files:
    test: benchmarks/lmms_tasks/scene_qa/data/{qtype}.json
"""

TEMPLATE_YAML = f"""\
# Shared by every scene_qa subtask (written by benchmarks/scene_tasks.py).
dataset_path: json
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {MAX_NEW_TOKENS}
  do_sample: false
  temperature: 0
process_results: !function utils.process_results
metric_list:
  - metric: accuracy
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GROUP_YAML = """\
group: {group}
task:
{tasks}
aggregate_metric_list:
  - metric: accuracy
    aggregation: mean
    weight_by_size: true
metadata:
  version: 1.0
"""


def records(scenes: int) -> dict[str, list[dict]]:
    """qtype -> the questions of that type, scene by scene in seed order (as vision_accuracy asks them)."""
    out: dict[str, list[dict]] = {q: [] for q in QTYPES}
    for seed in split_seeds(SPLIT, scenes):
        for k, qa in enumerate(render_scene(seed).qa):
            out[qa.qtype].append({"id": f"{SPLIT}-{seed}-{k}", "seed": seed, "question": qa.question,
                                  "answer": qa.answer, "qtype": qa.qtype})
    return out


def write(scenes: int, task_dir: Path = TASK_DIR) -> dict[str, int]:
    (task_dir / "data").mkdir(parents=True, exist_ok=True)
    counts = {}
    for qtype, rows in records(scenes).items():
        (task_dir / "data" / f"{qtype}.json").write_text(json.dumps(rows, indent=0) + "\n")
        (task_dir / f"{GROUP}_{qtype}.yaml").write_text(SUBTASK_YAML.format(task=f"{GROUP}_{qtype}", qtype=qtype))
        counts[qtype] = len(rows)
    (task_dir / "_default_template_yaml").write_text(TEMPLATE_YAML)
    tasks = "\n".join(f"  - {GROUP}_{q}" for q in QTYPES)
    (task_dir / f"{GROUP}.yaml").write_text(GROUP_YAML.format(group=GROUP, tasks=tasks))
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", type=int, default=40, help="test-split scenes (seeds from the split's start)")
    args = ap.parse_args(argv)
    counts = write(args.scenes)
    print(f"{sum(counts.values())} questions: " + ", ".join(f"{q} {n}" for q, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
