"""Writes the offline lmms-eval tasks whose prompts make long caches, from the scene generator's TEST split:

- `scene_multi` (benchmarks/lmms_tasks/scene_multi/): several images per question, MileBench-like (the setting of
  LOOK-M): `scene_multi_which`, `scene_multi_colour_k`, `scene_multi_needle`, `scene_multi_count`;
- `scene_video` (benchmarks/lmms_tasks/scene_video/): a clip per question, Video-MME-like (the setting of ZipVL):
  `scene_video_colour_seen`, `scene_video_direction`, `scene_video_appears_last`.

Each subtask is a YAML beside a local JSON file (`dataset_path: json`) of the first --samples seeds of that
subtask. A record holds the sample's seed: the task's `doc_to_visual` rebuilds the images (a list of PIL
images) or writes the clip (a cached mp4 path) from it. `--assets` rewrites the app's example set and clip
(assets/multi/, assets/videos/).

    python -m benchmarks.scene_long_tasks --samples 40
    python -m benchmarks.scene_long_tasks --assets

lmms-eval reads `data_files` relative to the working directory: run it from the repository root, with
`--include_path benchmarks/lmms_tasks`.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.scene_tasks import GROUP_YAML, TEMPLATE_YAML
from scenes.multi import MULTI_SUBTASKS, multi_records, multi_sample
from scenes.video import VIDEO_SUBTASKS, video_records, video_sample, write_clip

ROOT = Path(__file__).resolve().parent.parent
TASKS_ROOT = ROOT / "benchmarks" / "lmms_tasks"
ASSETS = ROOT / "assets"
SPLIT = "test"

# the example set and clip of the app (train-split seeds, as assets/images/scene-*.png)
MULTI_ASSET = {"seed": 0, "n_images": 4, "size": 384}
VIDEO_ASSET = {"seed": 5, "frames": 16, "size": 384, "name": "clip-0"}

SUBTASK_YAML = """\
task: {task}
include: _default_template_yaml
dataset_kwargs:
  data_files:
    test: benchmarks/lmms_tasks/{group}/data/{subtask}.json
"""


@dataclass(frozen=True)
class LongTask:
    group: str
    subtasks: tuple[str, ...]
    records: Callable[[str, int, str], list[dict]]  # (split, n, subtask) -> flat records


TASKS = {
    "scene_multi": LongTask("scene_multi", MULTI_SUBTASKS, multi_records),
    "scene_video": LongTask("scene_video", VIDEO_SUBTASKS, video_records),
}


def template_yaml(group: str) -> str:
    """scene_qa's shared settings (generation, metric), under this writer's header."""
    body = TEMPLATE_YAML.split("\n", 1)[1]
    return f"# Shared by every {group} subtask (written by benchmarks/scene_long_tasks.py).\n" + body


def records(task: LongTask, samples: int) -> dict[str, list[dict]]:
    """subtask -> the records of its first ``samples`` test-split seeds."""
    return {sub: task.records(SPLIT, samples, sub) for sub in task.subtasks}


def write(group: str, samples: int, tasks_root: Path = TASKS_ROOT) -> dict[str, int]:
    """Write ``group``'s YAMLs and data files (its utils.py is kept as it is) and return the counts."""
    task = TASKS[group]
    task_dir = tasks_root / group
    (task_dir / "data").mkdir(parents=True, exist_ok=True)
    counts = {}
    for sub, rows in records(task, samples).items():
        (task_dir / "data" / f"{sub}.json").write_text(json.dumps(rows, indent=0) + "\n")
        (task_dir / f"{group}_{sub}.yaml").write_text(
            SUBTASK_YAML.format(task=f"{group}_{sub}", group=group, subtask=sub))
        counts[sub] = len(rows)
    (task_dir / "_default_template_yaml").write_text(template_yaml(group))
    listed = "\n".join(f"  - {group}_{s}" for s in task.subtasks)
    (task_dir / f"{group}.yaml").write_text(GROUP_YAML.format(group=group, tasks=listed))
    return counts


def multi_asset_record() -> dict:
    s = multi_sample(MULTI_ASSET["seed"], MULTI_ASSET["n_images"], images=False)
    files = [f"multi-{s.seed}-{k}.png" for k in range(1, s.n_images + 1)]
    return {**s.record(), "size": MULTI_ASSET["size"], "prompt": s.prompt, "images": files}


def video_asset_record() -> dict:
    s = video_sample(VIDEO_ASSET["seed"], VIDEO_ASSET["frames"], draw=False)
    return {**s.record(), "size": VIDEO_ASSET["size"], "background": s.background, "file": f"{VIDEO_ASSET['name']}.mp4"}


def write_assets(assets: Path = ASSETS) -> list[Path]:
    """The app's example image set (assets/multi/) and clip (assets/videos/), each with a JSON sidecar."""
    written = []
    rec = multi_asset_record()
    sample = multi_sample(rec["seed"], rec["n_images"], size=rec["size"])
    folder = assets / "multi"
    folder.mkdir(parents=True, exist_ok=True)
    for name, image in zip(rec["images"], sample.images):
        image.save(folder / name)
        written.append(folder / name)
    written.append(folder / f"multi-{rec['seed']}.json")
    written[-1].write_text(json.dumps(rec, indent=1) + "\n")

    rec = video_asset_record()
    folder = assets / "videos"
    folder.mkdir(parents=True, exist_ok=True)
    written.append(write_clip(video_sample(rec["seed"], rec["frames"], size=rec["size"]), folder / rec["file"]))
    written.append(folder / f"{VIDEO_ASSET['name']}.json")
    written[-1].write_text(json.dumps(rec, indent=1) + "\n")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=[*TASKS, "all"], default="all")
    ap.add_argument("--samples", type=int, default=40, help="test-split samples per subtask")
    ap.add_argument("--assets", action="store_true", help="rewrite assets/multi/ and assets/videos/ instead")
    args = ap.parse_args(argv)
    if args.assets:
        for path in write_assets():
            print(path.relative_to(ROOT))
        return 0
    for group in (TASKS if args.task == "all" else [args.task]):
        counts = write(group, args.samples)
        print(f"{group}: {sum(counts.values())} questions: " + ", ".join(f"{s} {n}" for s, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
