"""Random weights in every family's released shape (the benchmarks' `--random-weights <family>`): configs built
in code on the meta device, and the benchmarks run end to end on the tiny shape of each family."""
import json

import pytest
import torch

from benchmarks import interactive, speed
from prefixkv_core.models import RANDOM_FAMILIES, build_random_model

FAMILIES = ("llava-1.5", "llava-interleave", "llava-next", "llava-onevision")


def test_every_family_has_a_released_and_a_tiny_random_shape():
    assert set(RANDOM_FAMILIES) == set(FAMILIES) | {f"tiny-{f}" for f in FAMILIES}


def test_the_space_default_shape_on_meta():
    """llava-interleave-qwen-0.5b: SigLIP so400m/14-384 (729 image tokens) + Qwen1.5-0.5B with its full vocabulary."""
    sm = build_random_model("llava-interleave", device="meta", dtype=torch.float16)
    text, vision = sm.model.config.get_text_config(), sm.model.config.vision_config
    assert (sm.family, sm.random_weights, sm.image_seq_length) == ("llava-interleave", True, 729)
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (152000, 1024, 24, 16)
    assert (vision.model_type, vision.hidden_size, vision.num_hidden_layers, vision.image_size) == (
        "siglip_vision_model", 1152, 26, 384)
    assert sm.model.get_input_embeddings().weight.shape == (152000, 1024)
    assert sm.processor is not None and sm.processor.tokenizer.convert_tokens_to_ids("<image>") == sm.image_token_id


@pytest.mark.parametrize("kind, layers, kv_heads", [("llava-next", 32, 8), ("llava-onevision", 24, 2)])
def test_anyres_family_shapes_on_meta(kind, layers, kv_heads):
    sm = build_random_model(kind, device="meta", dtype=torch.float16)
    assert (sm.family, sm.anyres, sm.num_layers, sm.num_kv_heads) == (kind, True, layers, kv_heads)


@pytest.mark.parametrize("family", ["llava-interleave", "llava-next", "llava-onevision"])
def test_speed_takes_every_family(tmp_path, family):
    """speed.py --random-weights: the image inputs come from the family's processor (an anyres family's views
    and image sizes), the batch decodes in one forward per step, every configuration ends ok."""
    assert speed.main(["--random-weights", f"tiny-{family}", "--batch", "2", "--settings", "230x3", "--budgets", "0.4",
                       "--methods", "full,h2o,elastic", "--warmup-steps", "0", "--threads", "1", "--quiet", "--no-png",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    statuses = [r["status"] for r in rows.values()] if isinstance(rows, dict) else [r["status"] for r in rows]
    assert statuses and set(statuses) == {"ok"}


def test_interactive_takes_a_family_and_measures_the_ceiling(tmp_path, capsys):
    out = tmp_path / "interactive.json"
    assert interactive.main(["--random-weights", "tiny-llava-interleave", "--methods", "full,h2o,zipvl",
                             "--new-tokens", "3", "--repeats", "1", "--no-sequential", "--threads", "1",
                             "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "random-tiny-llava-interleave" and report["ceiling_batch"] == 3
    assert report["ceiling"] == pytest.approx(report["plain_batch_b_tokens_per_s"] / report["plain_batch_1_tokens_per_s"])
    assert report["efficiency"] == pytest.approx(report["throughput_ratio"] / report["ceiling"], rel=1e-9)
    assert "runner efficiency" in capsys.readouterr().out


def test_interactive_refuses_a_shape_without_a_processor():
    with pytest.raises(SystemExit):
        interactive.main(["--random-weights", "llava-1.5-7b"])


@pytest.mark.parametrize("benchmark", ["interactive", "several_users", "app_visitors", "long_context"])
@pytest.mark.parametrize("kind", ["qwen2.5-vl-3b", "internvl3-1b"])
def test_random_weights_takes_the_released_shapes_with_a_processor(monkeypatch, benchmark, kind):
    """--random-weights of every benchmark that shares the argument takes the released shapes their family module
    builds (`RANDOM_MROPE`) and hands the kind to `build_random_model` (stubbed here: the 3B model is not built)."""
    import importlib

    from prefixkv_core.models import RANDOM_MROPE

    assert kind in RANDOM_MROPE and kind in interactive.RANDOM_WITH_PROCESSOR
    built = []

    class Built(Exception):
        pass

    def build(k, device, dtype):
        built.append((k, str(device)))
        raise Built

    monkeypatch.setattr(interactive, "build_random_model", build)
    with pytest.raises(Built):
        importlib.import_module(f"benchmarks.{benchmark}").main(["--random-weights", kind, "--device", "cpu"])
    assert built == [(kind, "cpu")]


def test_the_plain_loop_calls_a_qwen_vl_model_as_generate_does():
    """interactive's batching ceiling on a Qwen-VL model: the prompt gets the processor's token types (with them
    the model's M-RoPE positions), every new token its position plus the rope delta, so the plain loop's greedy
    tokens are `generate`'s on the processor's own output, at batch 1 and in every row of a batch."""
    from prefixkv_core import Engine
    from prefixkv_core.models import encode, format_prompt, load_model

    lm = load_model("tiny-qwen2.5-vl")
    image = Engine.load_image(str(interactive.REPO_ROOT / "assets/images/scene-0.png"))
    text = format_prompt(lm, "Describe the image in detail.", with_image=True)
    inputs = encode(lm, image, text)
    assert "mm_token_type_ids" not in inputs
    given = interactive.generation_inputs(lm, inputs)
    processed = lm.processor(images=image, text=text, return_tensors="pt")
    assert torch.equal(given["mm_token_type_ids"].cpu(), processed["mm_token_type_ids"].to(torch.int))
    assert int(given["mm_token_type_ids"].sum()) == int((inputs["input_ids"] == lm.image_token_id).sum()) > 0
    new = 6
    with torch.inference_mode():
        reference = lm.model.generate(**given, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    reference = reference[:, inputs["input_ids"].shape[1]:]
    one, _ = interactive.plain_greedy(lm, inputs, new, 1)
    three, _ = interactive.plain_greedy(lm, inputs, new, 3)
    assert torch.equal(one, reference)
    assert torch.equal(three, reference.expand(3, -1))


def test_interactive_measures_the_ceiling_on_a_qwen_vl_model(tmp_path):
    out = tmp_path / "interactive.json"
    assert interactive.main(["--model", "tiny-qwen2.5-vl", "--methods", "full,h2o,prefixkv", "--new-tokens", "3",
                             "--repeats", "1", "--no-sequential", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ceiling_batch"] == 3 and not report["errors"]
    assert 0 < report["image_tokens"] < report["prompt_tokens"]
    assert report["efficiency"] == pytest.approx(report["throughput_ratio"] / report["ceiling"], rel=1e-9)


def test_pauses_leave_the_stopped_stretches_out_of_a_timed_span():
    """common.Pauses: the seconds of [t0, t1] that fell in a stretch the process was stopped are left out (stretches
    given here; the stamping thread finds them from its gaps)."""
    from benchmarks.common import Pauses

    pauses = Pauses()
    pauses.stretches = [(10.0, 12.0), (20.0, 25.0)]
    assert pauses.within(0.0, 9.0) == 0.0
    assert pauses.within(11.0, 21.0) == pytest.approx(2.0)
    assert pauses.active(0.0, 30.0) == pytest.approx(23.0)
    assert interactive.span(None, 11.0, 21.0) == 10.0 and interactive.span(pauses, 11.0, 21.0) == pytest.approx(8.0)
    pauses.start()
    pauses.stop()
