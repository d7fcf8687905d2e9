"""The long-context text mode of benchmarks/quality.py on the tiny model: pairs cut from a plain text re-tokenize to
the text's own tokens, the engine's plain-text prompts feed exactly the text (Full's teacher-forced NLL equals the
model's own on the whole sequence), and the quality tables, records and resume work as in the image mode."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import quality
from benchmarks.common import RecordStore
from benchmarks.data import DataError, builtin_long_text, cut_text_pairs, load_long_text
from prefixkv_core import Engine
from prefixkv_core.session.engine import EngineError
from prefixkv_core.policies import METHODS, REGISTRY

BUDGETS = ["0.10", "0.50"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """6,000 characters of the built-in text in a file, as a user would pass one (--text FILE)."""
    path = tmp_path_factory.mktemp("text") / "story.txt"
    builtin = builtin_long_text().text
    path.write_text(builtin[20000:26000], encoding="utf-8")
    return path


def test_builtin_text_ships_with_python():
    text = builtin_long_text()
    assert len(text.text) > 100_000 and "assignment statement" in text.text.lower()
    assert "PSF License" in text.source and text.path is None
    assert load_long_text("builtin").text == text.text


def test_pairs_are_the_texts_own_tokens(tiny_llama, text_file):
    tok = tiny_llama.tokenizer
    text = text_file.read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pairs = cut_text_pairs(tok, text, 120, 24, 4)
    assert len(pairs) == 4 and len({p.id for p in pairs}) == 4
    starts = [p.extra["start_token"] for p in pairs]
    assert starts == sorted(starts) and starts[0] == pairs[0].extra["start_token"] < 1 + 32
    for p, nxt in zip(starts, starts[1:]):
        assert nxt - p >= 120 + 24  # no overlap
    for p in pairs:
        assert p.image is None and p.extra["exact"]
        s = p.extra["start_token"]
        context = tok(p.question, add_special_tokens=False)["input_ids"]
        continuation = tok(p.answer, add_special_tokens=False)["input_ids"]
        assert context == ids[s:s + 120] and continuation == ids[s + 120:s + 144]
    # the same request cuts the same pairs
    assert [q.as_dict() for q in cut_text_pairs(tok, text, 120, 24, 4)] == [p.as_dict() for p in pairs]


def test_text_errors_are_messages(tiny_llama, text_file, tmp_path):
    tok = tiny_llama.tokenizer
    with pytest.raises(DataError, match=r"room for \d+ pairs"):
        cut_text_pairs(tok, text_file.read_text(), 1000, 200, 50)
    with pytest.raises(DataError, match="does not exist"):
        load_long_text(str(tmp_path / "missing.txt"))
    binary = tmp_path / "bytes.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(DataError, match="not UTF-8"):
        load_long_text(str(binary))


def test_plain_text_prompt_feeds_exactly_the_text(tiny_llama, noise_image):
    """Full's teacher-forced NLL through the engine with chat_template=False equals the model's own loss on the
    context and continuation as one sequence: nothing but the text is fed."""
    engine = Engine(tiny_llama)
    tok = tiny_llama.tokenizer
    context, continuation = "The boat is sailing on the calm blue sea. Birds fly over", " the mountains and the lake."
    scorer = engine.new_session(None, context, ["full"], 1.0, chat_template=False)
    nll, n = scorer.score_answer(continuation)["full"]
    ctx_ids = tok(context)["input_ids"]
    cont_ids = tok(continuation, add_special_tokens=False)["input_ids"]
    assert scorer.prefill.prompt_tokens == len(ctx_ids) and n == len(cont_ids)
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        logits = tiny_llama.model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx_ids) - 1:-1], dim=-1)
    expected = -float(logp.gather(1, torch.tensor(cont_ids)[:, None]).sum())
    assert nll == pytest.approx(expected, rel=1e-4)
    # the chat template wraps the same text in turn markup: a longer prompt
    chat = engine.new_session(None, context, ["full"], 1.0)
    chat.score_answer(continuation)
    assert chat.prefill.prompt_tokens > scorer.prefill.prompt_tokens
    with pytest.raises(EngineError, match="takes no image"):
        engine.new_session(noise_image, context, ["full"], 1.0, chat_template=False)
    run = engine.new_session(None, context, ["full"], 1.0, chat_template=False)
    list(run.run())
    with pytest.raises(EngineError, match="no turns to follow up"):
        list(run.follow_up("And then?"))


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, text_file):
    out = tmp_path_factory.mktemp("quality_text")
    args = ["--model", "tiny-llama", "--text", str(text_file), "--context-tokens", "96", "--continuation-tokens", "12",
            "--pairs", "2", "--budgets", "0.1,0.5", "--max-new-tokens", "3", "--threads", "1", "--out", str(out),
            "--no-png", "--quiet"]
    assert quality.main(args) == 0
    return out, args


def test_text_mode_tables_and_records(text_run):
    out, _ = text_run
    res = json.loads((out / "results.json").read_text())
    assert res["methods"] == list(METHODS)
    assert len(res["samples"]) == 2 and all(s.startswith("text-") for s in res["samples"])
    assert res["config"]["data"].startswith("text:") and res["config"]["chat_template"] is False
    assert (res["config"]["context_tokens"], res["config"]["continuation_tokens"]) == (96, 12)
    assert res["settings"]["max_answer_tokens"] == 0
    assert [p["id"] for p in res["text_mode"]["pairs"]] == res["samples"]
    for name in ("ppl", "rouge_l", "kv_kept"):
        assert (out / f"{name}.csv").is_file() and (out / f"{name}.md").is_file()
    assert (out / "quality.html").is_file()
    assert "pairs of 96 context + 12 continuation tokens" in (out / "ppl.md").read_text()
    n_fixed = sum(1 for m in METHODS if not REGISTRY[m].uses_budget)
    assert len(res["records"]) == 2 * (n_fixed + (len(METHODS) - n_fixed) * len(BUDGETS))
    for r in res["records"]:
        assert r["error"] is None and r["n_tokens"] == 12  # every continuation scored whole
        assert r["prompt_tokens"] == 96  # the context alone: no turn markup, the tiny tokenizer adds no BOS
    ppl = res["tables"]["ppl"]
    for b in BUDGETS:
        assert all(isinstance(ppl[m][b], float) and ppl[m][b] > 1 for m in METHODS)
        assert res["tables"]["rouge_l"]["full"][b] == 1.0
    kept = res["tables"]["kv_kept_pct"]["local"]
    assert kept["0.10"] < kept["0.50"] < 60


def test_text_mode_resumes_and_refuses_another_cut(text_run):
    out, args = text_run
    before = [p.read_text() for p in RecordStore(out).shards()]
    first = json.loads((out / "results.json").read_text())
    assert quality.main(args) == 0
    second = json.loads((out / "results.json").read_text())
    assert [p.read_text() for p in RecordStore(out).shards()] == before
    assert second["new_records"] == 0 and second["tables"] == first["tables"]
    with pytest.raises(SystemExit, match="different configuration"):
        quality.main([a if a != "96" else "80" for a in args])


def test_text_mode_cli_errors(text_file, tmp_path):
    base = ["--model", "tiny-llama", "--threads", "1", "--out", str(tmp_path), "--no-png", "--quiet"]
    with pytest.raises(SystemExit, match="alternatives"):
        quality.main(base + ["--text", str(text_file), "--data", "other.jsonl"])
    with pytest.raises(SystemExit, match="room for"):
        quality.main(base + ["--text", str(text_file), "--context-tokens", "900", "--pairs", "20"])
    with pytest.raises(SystemExit, match="over the model's context"):
        quality.main(base + ["--text", "builtin", "--context-tokens", "4000"])
    with pytest.raises(SystemExit, match="at least 1"):
        quality.main(base + ["--text", str(text_file), "--pairs", "0"])
