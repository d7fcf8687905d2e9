"""benchmarks/gpu_suite.py: without a GPU it says so; with --tiny every part runs on tiny shapes on the CPU and the
report carries each part's figures (a check of the suite itself: the GPU numbers come from a GPU). No timings."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_suite


def test_without_a_gpu_it_says_so_and_measures_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_suite.main(["--out", str(tmp_path)]) == 2
    assert "No CUDA GPU is visible here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_unknown_part_is_a_message():
    with pytest.raises(SystemExit, match="unknown nope; accepted: table3, space"):
        gpu_suite.main(["--parts", "table3,nope", "--tiny"])


@pytest.mark.parametrize("tiny", [False, True], ids=["gpu", "tiny"])
@pytest.mark.parametrize("short", [False, True], ids=["whole", "short"])
def test_every_parts_arguments_are_its_scripts(tmp_path, tiny, short):
    """The GPU arguments never run here: each part's command must at least be one its script accepts."""
    from benchmarks import app_visitors, interactive, speed

    parsers = {"speed.py": speed.build_parser, "interactive.py": interactive.build_parser,
               "app_visitors.py": app_visitors.build_parser}
    for part in gpu_suite.PARTS:
        argv = gpu_suite.part_command(part, tiny, tmp_path, short)[2:]
        args = parsers[part.script]().parse_args(argv)
        assert args.device == ("cpu" if tiny else "cuda")
        assert args.random_weights.startswith("tiny") == tiny


def test_parts_run_on_tiny_shapes_and_land_in_one_report(tmp_path):
    """Two parts, one of each kind of output (a speed folder, a JSON with a printed report); the others' scripts
    run on tiny shapes in their own tests."""
    assert gpu_suite.main(["--tiny", "--parts", "table3,app", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert summary["tiny"] and list(summary["parts"]) == ["table3", "app"]
    parts = summary["parts"]
    assert all(p["status"] == "ok" for p in parts.values()), {k: p["status"] for k, p in parts.items()}
    # Table 3's rows: full through the engine and PrefixKV at each budget, plus the plain-transformers baseline
    rows = {(r["method"], r["budget"]) for r in parts["table3"]["result"]["results"]}
    assert {("full", None), ("prefixkv", 0.2), ("prefixkv", 0.8), ("full-stock", None)} <= rows
    assert parts["table3"]["result"]["batch"] == 2
    app = parts["app"]["result"]
    assert app["clients"] == 2 and app["same_as_engine_alone"] and app["same_as_engine_together"]
    assert all(v["first_token_s"] is not None for v in app["together"]["visitors"])
    report = (tmp_path / "gpu_suite.md").read_text()
    assert "Tiny shapes on the CPU" in report and "## table3:" in report and "## app:" in report
    assert "| prefixkv @ 0.2 |" in report and "at once: last" in report and "[app_visitors]" not in report


def test_short_keeps_prefixkvs_lowest_and_highest_budget_and_times_nothing_alone():
    table3, space = gpu_suite.PARTS[0], gpu_suite.PARTS[1]
    args = gpu_suite.shortened(table3.gpu_args)
    assert args[args.index("--budgets") + 1] == "0.2,0.8"
    assert "--time-alone" in space.gpu_args and "--time-alone" not in gpu_suite.shortened(space.gpu_args)
