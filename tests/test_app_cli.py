"""app.py's flags: defaults, environment overrides, bad values, and what main() hands to launch()."""
import importlib

import gradio as gr
import pytest


@pytest.fixture
def app_module(monkeypatch):
    for name in ("PREFIXKV_MODEL", "PREFIXKV_DEVICE", "PREFIXKV_DTYPE", "PREFIXKV_HOST", "PORT", "PREFIXKV_METHODS",
                 "PREFIXKV_MAX_NEW_TOKENS_LIMIT", "PREFIXKV_ENGINE_PROCESS", "PREFIXKV_SERVER_NICE"):
        monkeypatch.delenv(name, raising=False)
    import app

    return importlib.reload(app)


def test_defaults_and_environment(app_module, monkeypatch):
    args = app_module.parse_args([])
    assert (args.model, args.device, args.dtype, args.host, args.port, args.methods, args.max_new_tokens_limit) == (
        "embedded", "auto", "auto", "127.0.0.1", 7860, "all", 256)
    assert args.engine_process is True and args.server_nice == 10
    assert app_module.parse_args(["--no-engine-process"]).engine_process is False
    monkeypatch.setenv("PREFIXKV_ENGINE_PROCESS", "0")
    assert app_module.parse_args([]).engine_process is False
    monkeypatch.setenv("PREFIXKV_MODEL", "llava-hf/llava-interleave-qwen-0.5b-hf")
    monkeypatch.setenv("PREFIXKV_HOST", "0.0.0.0")
    monkeypatch.setenv("PORT", "7999")
    args = app_module.parse_args(["--methods", "full,prefixkv"])
    assert (args.model, args.host, args.port, args.methods) == (
        "llava-hf/llava-interleave-qwen-0.5b-hf", "0.0.0.0", 7999, "full,prefixkv")


def test_bad_flags_fail_before_loading_a_model(app_module, capsys):
    assert app_module.main(["--methods", "full,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert app_module.main(["--max-new-tokens-limit", "0"]) == 2
    assert app_module.main(["--server-nice", "20"]) == 2
    assert app_module.main(["--model", "/nonexistent/dir", "--no-engine-process"]) == 1
    assert app_module.main(["--model", "/nonexistent/dir"]) == 1  # the engine's process says why, then ends
    assert "/nonexistent/dir" in capsys.readouterr().err


@pytest.mark.parametrize("own_process", [True, False])
def test_main_builds_and_launches_without_share(app_module, monkeypatch, own_process):
    seen, niced = {}, []

    def fake_launch(self, **kwargs):
        seen.update(kwargs, blocks=self)

    monkeypatch.setattr(gr.Blocks, "launch", fake_launch)
    monkeypatch.setattr(app_module.os, "nice", niced.append)  # the test process keeps its priority
    flags = [] if own_process else ["--no-engine-process"]
    assert app_module.main(["--model", "tiny-llama", "--port", "7901", "--methods", "full,h2o,prefixkv",
                            "--max-new-tokens-limit", "16", *flags]) == 0
    assert seen["server_name"] == "127.0.0.1" and seen["server_port"] == 7901 and seen["share"] is False
    assert seen["max_file_size"] == "64mb"  # the larger of the image (10 MB) and video (64 MB) limits
    assert seen["blocks"].controller.methods == ["full", "h2o", "prefixkv"]
    assert seen["blocks"].controller.limit == 16
    engine = seen["blocks"].controller.engine
    assert type(engine).__name__ == ("EngineProcess" if own_process else "Engine")
    assert niced == ([10] if own_process else [])
    if own_process:
        assert engine.alive
        engine.close()
