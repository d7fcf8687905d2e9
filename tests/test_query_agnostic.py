"""Query-agnostic compression: the image and any text before the question are prefilled and compressed first,
then the question is fed through every compressed cache and the answer decoded on it. The mode in the engine,
the CLI, the app and the benchmarks, and in what each of them writes."""
from __future__ import annotations

import json

import pytest
import torch

from prefixkv_core import Engine

from prefixkv_core import EngineError

from prefixkv_core import GenerationSettings

from prefixkv_core.decoding import runner
from prefixkv_core.kv.attention import StatRequest, tracked_attention_enabled
from prefixkv_core.models import encode, format_prompt
from prefixkv_core.policies import METHODS, REGISTRY, make_policy

PROMPT = "describe the picture in detail and name every object you can see in it"
FOLLOW_UP = "and what colour is the largest one"


def _context_tokens(loaded, image, prompt=PROMPT) -> int:
    """Naive: the tokens of the formatted prompt up to where the user's text starts."""
    text = format_prompt(loaded, prompt, with_image=image is not None)
    full = encode(loaded, image, text)["input_ids"][0].tolist()
    before = encode(loaded, image, text[: text.index(prompt)])["input_ids"][0].tolist()
    k = 0
    while k < len(before) and before[k] == full[k]:
        k += 1
    return k


def _greedy(session):
    out = {}
    for ev in session.run():
        if getattr(ev, "kind", None) == "done":
            out[ev.method] = list(session.states[ev.method].turn_ids)
    return out


# -- the engine --------------------------------------------------------------------------------------------------
def test_the_image_is_compressed_before_the_question_is_fed(tiny, noise_image):
    engine = Engine(tiny)
    budget = 0.3
    session = engine.new_session(noise_image, PROMPT, ["full", "snapkv", "pyramidkv", "lookm", "h2o"], budget,
                                 GenerationSettings(max_new_tokens=1), query_agnostic=True)
    list(session.run())
    pre = session.prefill
    split = _context_tokens(tiny, noise_image)
    n = pre.prompt_tokens
    assert 0 < split < n and pre.compressed_tokens == split
    assert pre.importance.shape == (tiny.num_layers, split) and pre.is_image.shape == (split,)
    assert pre.image_tokens == int(pre.is_image.sum())  # every image token is in the compressed part
    for name in ("snapkv", "pyramidkv", "lookm"):  # prompt-only: the compressed context, then the whole question
        state = session.states[name]
        assert state.prompt_len == split and state.true_len == n
        for layer in state.cache.layers:
            pos = layer.positions[0]
            context = (pos < split).sum(-1)
            assert (pos[:, -(n - split):] == torch.arange(split, n)).all(), name
            assert int(context.max()) <= max(2, round(budget * split)), name  # the budget is r·N_c of the context
    assert session.states["h2o"].cache.lengths() == [round(budget * n)] * tiny.num_layers  # every step: r·N_t
    assert session.states["full"].cache.lengths() == [n] * tiny.num_layers
    notes = session.results()["snapkv"]["extras"].get("notes", [])
    assert any("observation window 32" in x for x in notes)  # fitted to the 22-token context, and says so


def test_query_agnostic_equals_compressing_the_context_then_feeding_the_question(tiny_qwen2, noise_image):
    """Naive reference through the runner's pieces: prefill the context alone, compress it, feed the question,
    then greedy steps; the session gives the same tokens and the same kept entries."""
    loaded, budget, steps = tiny_qwen2, 0.3, 4
    engine = Engine(loaded)
    session = engine.new_session(noise_image, PROMPT, ["snapkv", "h2o"], budget,
                                 GenerationSettings(max_new_tokens=steps), query_agnostic=True)
    got = _greedy(session)
    inputs = encode(loaded, noise_image, format_prompt(loaded, PROMPT, with_image=True))
    ids = inputs["input_ids"]
    split = _context_tokens(loaded, noise_image)
    for name in ("snapkv", "h2o"):
        policy = make_policy(name, budget)
        with tracked_attention_enabled(loaded.model):
            shared = runner.prefill(loaded.model, ids[:, :split], ids[:, :split] == loaded.image_token_id,
                                    {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")},
                                    [policy], loaded.num_layers, loaded.device)
            cache = shared.cache
            state = runner.compress_prefill(policy, cache, runner.policy_stats(policy, shared.stats, split), split,
                                            budget)
            chunk, start, tokens = ids[:, split:], split, []
            for step in range(steps):
                needs = policy.decode_needs_attention()
                logits, stats = runner.forward_group(loaded.model, cache, chunk, start, StatRequest(last_query=needs))
                start += chunk.shape[1]
                runner.compress_decode(policy, state, cache, start, split, step,
                                       runner.last_query(stats) if needs else None)
                tokens.append(int(logits[0].argmax()))
                chunk = torch.tensor([[tokens[-1]]])
        assert got[name] == tokens, name
        for a, b in zip(session.states[name].cache.layers, cache.layers):  # the question + steps - 1 tokens fed
            assert torch.equal(a.positions, b.positions), name


def test_full_and_budget_one_give_the_same_tokens_in_both_modes(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    methods = ["full"] + [m for m in METHODS if REGISTRY[m].uses_budget]
    aware = _greedy(engine.new_session(noise_image, PROMPT, ["full"], 1.0, GenerationSettings(max_new_tokens=8)))
    agnostic = _greedy(engine.new_session(noise_image, PROMPT, methods, 1.0, GenerationSettings(max_new_tokens=8),
                                          query_agnostic=True))
    for name in methods:  # r = 1 keeps everything: splitting the prefill changes nothing
        assert agnostic[name] == aware["full"], name


def test_the_question_changes_what_query_aware_snapkv_keeps(tiny_llama, noise_image):
    """SnapKV's observation window: with the question in view it votes with the question's queries; without, with
    the end of the context. The kept image entries differ (which is why kvpress keeps such runs apart)."""
    engine = Engine(tiny_llama)
    kept = {}
    for agnostic in (False, True):
        session = engine.new_session(noise_image, PROMPT, ["snapkv"], 0.2, GenerationSettings(max_new_tokens=1),
                                     {"snapkv": {"window": 4}}, query_agnostic=agnostic)
        list(session.run())
        split = session.prefill.compressed_tokens
        kept[agnostic] = [set(h.tolist()) & set(range(split)) for layer in session.states["snapkv"].cache.layers
                          for h in layer.positions[0]]
    assert kept[False] != kept[True]


def test_follow_ups_and_batching_work_in_the_query_agnostic_mode(tiny, noise_image):
    engine = Engine(tiny)

    def turns(names):
        session = engine.new_session(noise_image, PROMPT, names, 0.3, GenerationSettings(max_new_tokens=5),
                                     query_agnostic=True)
        out = {name: [] for name in names}
        for ev in session.run():
            if getattr(ev, "kind", None) in ("done", "error"):
                out[ev.method].append((list(session.states[ev.method].turn_ids), ev.kept_per_layer, ev.error))
        for ev in session.follow_up(FOLLOW_UP):
            if ev.kind in ("done", "error"):
                out[ev.method].append((list(session.states[ev.method].turn_ids), ev.kept_per_layer, ev.error))
        assert session.record.to_dict()["query_agnostic"] is True
        return out

    together = turns(list(METHODS))
    for name in METHODS:
        assert len(together[name]) == 2 and all(t[2] is None for t in together[name]), (name, together[name])
        assert turns([name])[name] == together[name], name


def test_score_answer_in_the_query_agnostic_mode(tiny_qwen2, noise_image):
    engine = Engine(tiny_qwen2)
    answer = "a red square on the left"
    aware = engine.new_session(noise_image, PROMPT, ["full"], 0.3).score_answer(answer)
    agnostic = engine.new_session(noise_image, PROMPT, ["full", "snapkv"], 0.3,
                                  query_agnostic=True).score_answer(answer)
    assert agnostic["full"][1] == aware["full"][1]
    assert agnostic["full"][0] == pytest.approx(aware["full"][0], rel=1e-4)  # Full: same cache either way
    assert agnostic["snapkv"][1] == aware["full"][1]


def test_bad_query_agnostic_requests_are_refused(tiny_llama, noise_image):
    engine = Engine(tiny_llama)
    with pytest.raises(EngineError, match="query_agnostic must be True or False"):
        engine.new_session(noise_image, PROMPT, ["full"], 0.3, query_agnostic="yes")
    with pytest.raises(EngineError, match="plain-text prompt .* has no question"):
        engine.new_session(None, PROMPT, ["full"], 0.3, chat_template=False, query_agnostic=True)


def test_a_text_only_chat_prompt_compresses_the_template_opening(tiny_llama):
    session = Engine(tiny_llama).new_session(None, PROMPT, ["full", "local"], 0.5,
                                             GenerationSettings(max_new_tokens=3), query_agnostic=True)
    list(session.run())
    assert 0 < session.prefill.compressed_tokens == _context_tokens(tiny_llama, None) < session.prefill.prompt_tokens


# -- CLI, app, benchmarks -----------------------------------------------------------------------------------------
def test_cli_query_agnostic_flag(tmp_path, noise_image, capsys):
    from prefixkv_core.__main__ import main

    image = tmp_path / "img.png"
    noise_image.save(image)
    out = tmp_path / "out.json"
    args = ["compare", "--model", "tiny-llama", "--image", str(image), "--prompt", "Describe the image.",
            "--methods", "full,snapkv", "--budget", "0.3", "--max-new-tokens", "3", "--json", str(out)]
    assert main(args + ["--query-agnostic"]) == 0
    assert "query-agnostic: compressed before the question" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["query_agnostic"] is True
    assert data["prefill"]["compressed_tokens"] < data["prefill"]["prompt_tokens"]
    assert main(args + ["--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["query_agnostic"] is False and data["prefill"]["compressed_tokens"] == data["prefill"]["prompt_tokens"]


@pytest.fixture(scope="module")
def app_controller(tiny_llama):
    from ui.app_builder import build_app

    return build_app(Engine(tiny_llama), max_new_tokens_limit=8).controller


def test_app_switch_results_status_and_export_say_the_mode(app_controller, noise_image, tmp_path):
    import gradio as gr

    from ui.controller import SessionBox
    from ui.export import export_all

    ctl = app_controller
    box = SessionBox()
    outs = list(ctl.compare(noise_image, "Describe.", ["full", "snapkv"], 0.3, 3, box=box, query_agnostic=True))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert final["results"]["query_agnostic"] is True
    assert "query-agnostic" in final["status"] and "compressed before the question" in final["status"]
    more = list(ctl.follow_up("And the colours?", box=box))
    assert dict(zip(ctl.output_keys, more[-1]))["results"]["turn"] == 2
    res = export_all(ctl.figures(box.run, box), box.run.to_dict(), formats=["html"], out_root=str(tmp_path))
    folder = res.directory
    captions = open(f"{folder}/figures/captions.md").read().splitlines()
    assert captions and all(line.endswith("[published budgets, query-agnostic]") for line in captions)
    assert "published budgets, query-agnostic" in open(f"{folder}/table.tex").read()
    assert "- mode: published budgets, query-agnostic" in open(f"{folder}/transcript.md").read()
    with pytest.raises(gr.Error, match="query_agnostic must be true or false"):
        list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 2, box=SessionBox(), query_agnostic="yes"))
    plain = list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 2, box=SessionBox()))
    assert dict(zip(ctl.output_keys, plain[-1]))["results"]["query_agnostic"] is False


def test_app_offers_the_switch_with_one_line_of_help(tiny_llama):
    from ui.app_builder import QUERY_AGNOSTIC_INFO, build_app

    demo = build_app(Engine(tiny_llama), max_new_tokens_limit=4)
    switches = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "query-agnostic"]
    assert len(switches) == 1 and switches[0].label == "Query-agnostic" and switches[0].value is False
    assert switches[0].info == QUERY_AGNOSTIC_INFO and "\n" not in QUERY_AGNOSTIC_INFO



def test_quality_benchmark_query_agnostic_says_so(tmp_path, threads_restored):
    from benchmarks import quality

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "a", "image": "scene:2000000", "question": "What shapes are there?",
                                "answer": "a red square"}) + "\n")
    args = ["--model", "tiny-llama", "--data", str(data), "--methods", "snapkv", "--budgets", "0.3",
            "--max-new-tokens", "3", "--threads", "1", "--no-png", "--quiet"]
    out = tmp_path / "qa"
    assert quality.main(args + ["--query-agnostic", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["query_agnostic"] is True and res["settings"]["query_agnostic"] is True
    assert res["config"]["query_agnostic"] is True
    for table in ("ppl", "rouge_l", "kv_kept"):
        md = (out / f"{table}.md").read_text()
        assert "[published budgets, query-agnostic]" in md and "Query-agnostic: the image and any text" in md
    assert "query-agnostic" in (out / "quality.html").read_text()
    with pytest.raises(SystemExit, match="different configuration"):  # the folder keeps one mode's records
        quality.main(args + ["--out", str(out)])
    with pytest.raises(SystemExit, match="--query-agnostic .* text mode"):
        quality.main(["--model", "tiny-llama", "--text", "builtin", "--query-agnostic", "--out", str(tmp_path / "t")])


def test_speed_benchmark_query_agnostic_says_so(tmp_path, threads_restored, tiny_llama):
    from benchmarks import speed

    args = ["--model", "tiny-llama", "--settings", "40x4", "--budgets", "0.3", "--warmup-steps", "0", "--threads",
            "1", "--no-png", "--quiet", "--no-stock", "--methods", "full,snapkv", "--out", str(tmp_path)]
    assert speed.main(args + ["--query-agnostic"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["query_agnostic"] is True
    md = (tmp_path / "speed.md").read_text()
    assert "[published budgets, query-agnostic]" in md and "Mode: published budgets, query-agnostic" in md
    rows = {r["method"]: r for r in res["results"]}
    n_img = tiny_llama.image_seq_length  # the same model as --model tiny-llama
    context, question = 1 + n_img, 40 - 1 - n_img
    # SnapKV compressed BOS + the image block to r·N_c, then kept the question and the 3 decoded tokens whole
    assert rows["snapkv"]["kept_per_layer"] == [round(0.3 * context) + question + 3] * len(rows["snapkv"]["kept_per_layer"])
    assert rows["full"]["kept_per_layer"][0] == 40 + 3
