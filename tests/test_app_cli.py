"""app.py's flags: defaults, environment overrides, bad values, and what main() hands to launch()."""
import importlib

import gradio as gr
import pytest


@pytest.fixture
def app_module(monkeypatch):
    for name in ("PREFIXKV_MODEL", "PREFIXKV_DEVICE", "PREFIXKV_DTYPE", "PREFIXKV_HOST", "PORT", "PREFIXKV_METHODS",
                 "PREFIXKV_MAX_NEW_TOKENS_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    import app

    return importlib.reload(app)


def test_defaults_and_environment(app_module, monkeypatch):
    args = app_module.parse_args([])
    assert (args.model, args.device, args.dtype, args.host, args.port, args.methods, args.max_new_tokens_limit) == (
        "embedded", "auto", "auto", "127.0.0.1", 7860, "all", 256)
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
    assert app_module.main(["--model", "/nonexistent/dir"]) == 1


def test_main_builds_and_launches_without_share(app_module, monkeypatch):
    seen = {}

    def fake_launch(self, **kwargs):
        seen.update(kwargs, blocks=self)

    monkeypatch.setattr(gr.Blocks, "launch", fake_launch)
    assert app_module.main(["--model", "tiny-llama", "--port", "7901", "--methods", "full,h2o,prefixkv",
                            "--max-new-tokens-limit", "16"]) == 0
    assert seen["server_name"] == "127.0.0.1" and seen["server_port"] == 7901 and seen["share"] is False
    assert seen["max_file_size"] == "64mb"  # the larger of the image (10 MB) and video (64 MB) limits
    assert seen["blocks"].controller.methods == ["full", "h2o", "prefixkv"]
    assert seen["blocks"].controller.limit == 16
