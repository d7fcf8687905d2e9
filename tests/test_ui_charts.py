"""Pure UI pieces on synthetic data: chart builders, overlay, panels, run state, export tables."""
import json
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
from PIL import Image

from prefixkv_core.report.events import MethodEvent, PrefillInfo
from prefixkv_core.policies import role_methods
from prefixkv_core.policies import METHODS, REGISTRY, method_colours
from prefixkv_core.report.record import BatchSteps
from ui import charts
from ui.lorenz_np import gini, retention_curves
from ui.theme import colour


def _ev(method, label, kept, img, full_len, kind="done", turn=0, step=5, text="a cat", kv=100, full_kv=400, **kw):
    return MethodEvent(method, label, kind, turn=turn, step=step, text=text, kept_per_layer=kept,
                       kept_image_per_layer=img, full_len=full_len, kv_bytes=kv, full_kv_bytes=full_kv, **kw)


def _importance(layers=8, n=60, seed=0):
    rng = np.random.RandomState(seed)
    # deeper layers more concentrated: higher powers
    return np.stack([rng.rand(n) ** (1 + 2 * l) for l in range(layers)]).astype(np.float32)


def test_retained_bars_stack_image_and_text_per_method():
    latest = {"h2o": _ev("h2o", "H2O", [50, 30], [40, 10], 100),
              "prefixkv": _ev("prefixkv", "PrefixKV", [70, 20], [20, 5], 100),
              "lookm": None}
    fig = charts.retained_bars(latest, budget=0.3)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["H2O · image"].y) == pytest.approx([0.4, 0.1])
    assert list(by_name["H2O · text"].y) == pytest.approx([0.1, 0.2])
    assert list(by_name["PrefixKV · text"].y) == pytest.approx([0.5, 0.15])
    # same colour per method, text hatched, image solid
    assert by_name["H2O · image"].marker.color == colour("h2o")
    assert by_name["H2O · text"].marker.pattern.shape == "/" and not by_name["H2O · image"].marker.pattern.shape
    assert {"image tokens", "text tokens", "budget r = 0.30"} <= set(by_name)
    assert fig.layout.barmode == "stack"
    assert len(fig.layout.shapes) == 2 and fig.layout.shapes[0].y0 == 0.3  # budget line in each small chart
    assert "H2O" in fig.layout.annotations[0].text and fig.layout.annotations[0].font.color == colour("h2o")
    assert fig.layout.yaxis.title.text == "retained ratio" and fig.layout.xaxis.title.text == "layer"


def test_retained_bars_without_data_is_a_placeholder():
    fig = charts.retained_bars({})
    assert len(fig.data) == 0 and "Run a comparison" in fig.layout.annotations[0].text


def test_lorenz_figure_layers_gini_threshold_and_uniform_lines():
    imp = _importance()
    fig = charts.lorenz_figure(imp, threshold=0.8, budget=0.3)
    layer_traces = [t for t in fig.data if t.name and t.name.startswith("layer ")]
    assert [t.name.split(" (")[0] for t in layer_traces] == [f"layer {l}" for l in charts.default_layers(8)]
    g = gini(imp)
    for t in layer_traces:
        l = int(t.name.split()[1])
        assert f"Gini {g[l]:.2f}" in t.name
        assert t.y[0] == pytest.approx(0) and t.y[-1] == pytest.approx(1)
        assert np.all(np.diff(t.y) >= -1e-6)  # monotone
    names = [t.name for t in fig.data if t.name]
    assert "uniform importance (Gini 0)" in names
    assert any(n.startswith("PrefixKV threshold p = 0.800") for n in names)
    assert any("same ratio r = 0.30" in n for n in names)
    assert fig.layout.xaxis.title.text.startswith("tokens kept") and "importance" in fig.layout.yaxis.title.text
    # concentrated (deep) layers have larger Gini than the flat first layer
    assert g[-1] > g[0]


def test_lorenz_figure_selected_layers_and_thinning():
    imp = _importance(layers=30, n=2000)
    assert charts.default_layers(30) == [0, 6, 12, 17, 23, 29]
    fig = charts.lorenz_figure(imp, layers=[3, 29], max_points=200)
    layer_traces = [t for t in fig.data if t.name and t.name.startswith("layer ")]
    assert [t.name.split(" (")[0] for t in layer_traces] == ["layer 3", "layer 29"]
    assert len(layer_traces[0].x) <= 200 and layer_traces[0].x[-1] == pytest.approx(1.0)


def test_preview_threshold_matches_the_retention_curves():
    imp = _importance()
    p = charts.preview_threshold(imp, 0.3)
    curves = retention_curves(imp)
    kept = (np.argmax(curves >= p - 1e-7, axis=1)).mean() / imp.shape[1]
    assert 0 < p < 1 and kept == pytest.approx(0.3, abs=0.05)


def test_memory_and_latency_figures():
    s1 = charts.Series("H2O", steps=[1, 2, 3], kv_bytes=[1e6, 1.1e6, 1.1e6], full_kv_bytes=[3e6, 3.1e6, 3.2e6],
                       latency_s=[0.0, 0.02, 0.03], policy_s=[0.0, 0.001, 0.001], turn=[1, 1, 1])
    s2 = charts.Series("PrefixKV", steps=[1, 2], kv_bytes=[0.9e6, 0.95e6], full_kv_bytes=[3e6, 3.1e6],
                       latency_s=[0.0, 0.01], policy_s=[0.0, 0.002], turn=[1, 1])
    mem = charts.memory_figure({"h2o": s1, "prefixkv": s2})
    names = [t.name for t in mem.data]
    assert names == ["uncompressed", "H2O", "PrefixKV"]  # reference line when Full is not selected
    assert list(mem.data[1].y) == pytest.approx([1.0, 1.1, 1.1])
    assert mem.data[1].line.color == colour("h2o") and mem.layout.yaxis.title.text == "KV cache (MB)"
    assert charts.memory_figure({}).layout.annotations  # placeholder


def test_latency_figure_shows_the_shared_forward_once_and_each_methods_own_time():
    s1 = charts.Series("H2O", steps=[1, 2, 3], kv_bytes=[1, 1, 1], full_kv_bytes=[3, 3, 3],
                       latency_s=[0.0, 0.02, 0.03], policy_s=[0.0, 0.001, 0.001], turn=[1, 1, 1])
    s2 = charts.Series("PrefixKV", steps=[1, 2, 3], kv_bytes=[1, 1, 1], full_kv_bytes=[3, 3, 3],
                       latency_s=[0.0, 0.02, 0.03], policy_s=[0.0, 0.004, 0.002], turn=[1, 1, 1])
    batch = BatchSteps()
    for step, forward in ((2, 0.02), (3, 0.03)):
        batch.add(0, step, forward, 2)
        batch.add(0, step, forward, 2)  # the second method of the same step adds nothing
    # batched only: the forward once (top), each method's own policy time (bottom)
    lat = charts.latency_figure({"h2o": s1, "prefixkv": s2}, batch)
    assert [t.name for t in lat.data] == ["shared forward", "H2O", "PrefixKV"]
    assert list(lat.data[0].y) == pytest.approx([20.0, 30.0]) and list(lat.data[0].customdata) == [2, 2]
    assert list(lat.data[1].x) == [2, 3]  # the prefill-made first token has no step
    assert list(lat.data[2].y) == pytest.approx([4.0, 2.0]) and lat.data[2].yaxis == "y2"
    assert "shared forward" in lat.layout.title.text and "own policy time" in lat.layout.title.text
    # timed alone: one line per method, its forward + its policy, and the batched step for reference
    a1 = charts.Series("H2O", steps=[1, 2, 3], kv_bytes=[1, 1, 1], full_kv_bytes=[3, 3, 3],
                       latency_s=[0.0, 0.010, 0.012], policy_s=[0.0, 0.001, 0.001], turn=[1, 1, 1])
    a2 = charts.Series("PrefixKV", steps=[1, 2, 3], kv_bytes=[1, 1, 1], full_kv_bytes=[3, 3, 3],
                       latency_s=[0.0, 0.008, 0.009], policy_s=[0.0, 0.004, 0.002], turn=[1, 1, 1])
    lat = charts.latency_figure({"h2o": s1, "prefixkv": s2}, batch, {"h2o": a1, "prefixkv": a2})
    assert [t.name for t in lat.data] == ["batched run: one forward, shared", "H2O", "PrefixKV"]
    assert list(lat.data[1].y) == pytest.approx([11.0, 13.0]) and list(lat.data[2].y) == pytest.approx([12.0, 11.0])
    assert lat.data[1].line.color == colour("h2o") and "decoded alone" in lat.layout.title.text
    assert lat.layout.yaxis.title.text == "latency per token (ms)"
    assert charts.latency_figure({}).layout.annotations  # placeholder


def test_quality_figure():
    fig = charts.quality_figure({"h2o": ("H2O", 0.3, 0.7), "zipvl": ("ZipVL", 0.25, None)})
    assert [t.name for t in fig.data] == ["H2O"] and fig.data[0].x[0] == 0.3 and fig.data[0].y[0] == 0.7


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_colour_comes_from_its_policy(method):
    from ui.theme import css

    assert colour(method) == REGISTRY[method].colour
    assert f".method-panel.m-{method} {{ border-top: 4px solid {REGISTRY[method].colour}" in css()


def test_palette_is_consistent_and_complete():
    colours = method_colours()
    assert set(colours) == set(METHODS)
    assert len({c.lower() for c in colours.values()}) == len(colours)  # no two methods look alike
    assert colour("unknown-method") == colour("unknown-method") and colour("unknown-method") not in colours.values()


def test_overlay_dims_evicted_patches():
    from ui.overlay import caption, model_view, overlay

    img = Image.new("RGB", (80, 40), (200, 50, 50))
    assert model_view(img, crop=True, side=64).size == (64, 64)
    share = np.array([[1.0, 0.0], [0.5, 1.0]])
    out = np.asarray(overlay(img, share, "prefixkv", crop=False, side=64))
    kept, evicted = out[8:24, 8:24].mean(), out[8:24, 40:56].mean()
    assert kept > 2 * evicted  # the evicted top-right patch is dark
    assert "3 of 4 patches kept" in caption("PrefixKV", share, 5)


def _comparison():
    from prefixkv_core.report.record import ComparisonRecord
    from ui.runstate import Comparison

    # the app reads the record the engine session feeds: here the events are fed to it by hand
    comp = Comparison(ComparisonRecord(["full", "h2o"], {"full": "Full", "h2o": "H2O"}, "What is this?", 0.3,
                                       {"max_new_tokens": 4}, {}, model={"name": "tiny", "device": "cpu"},
                                       roles=role_methods()))
    comp.record.apply(PrefillInfo(10, 4, 2, _importance(2, 10), np.arange(10) < 4, (2, 2), 0, 0.1))
    for method, label, kv, stage in (("full", "Full", 400, "none"), ("h2o", "H2O", 120, "KV eviction")):
        comp.record.apply(_ev(method, label, [10, 10], [4, 4], 10, kind="start", step=1, text="A", kv=kv, stage=stage))
        comp.record.apply(_ev(method, label, [10, 10], [4, 4], 11, kind="token", step=2, text="A cat",
                       kv=kv, step_latency_s=0.01, policy_s=0.002, batch_size=2, compress_s=0.004, stage=stage))
        comp.record.apply(_ev(method, label, [10, 10], [4, 4], 12, kind="done", step=3,
                       text="A cat sits" if method == "full" else "A cat", kv=kv, step_latency_s=0.01,
                       policy_s=0.002, tokens_per_s=50.0, ttft_s=0.2, batch_size=2, compress_s=0.004, stage=stage))
    return comp


def test_runstate_series_rouge_and_json():
    comp = _comparison()
    assert comp.finished
    assert comp.tracks["h2o"].series.steps == [1, 2, 3]
    assert comp.rouge("h2o") == pytest.approx(0.8)
    data = comp.to_dict()
    json.dumps(data)
    assert data["methods"]["h2o"]["kv_ratio"] == pytest.approx(0.3)
    assert data["methods"]["h2o"]["rouge_l_vs_full"] == pytest.approx(0.8)
    comp.begin_turn("And then?")
    assert [t.status for t in comp.tracks["h2o"].turns] == ["done", "waiting"] and comp.rouge("h2o") is None
    comp.rollback_turn()
    assert len(comp.prompts) == 1 and len(comp.tracks["h2o"].turns) == 1


def _timed_alone(comp):
    """The same turn decoded again, each method on its own (the events of the time-alone pass)."""
    comp.alone = True
    for method, label, kv, speed in (("full", "Full", 400, 50.0), ("h2o", "H2O", 120, 40.0)):
        comp.record.apply(_ev(method, label, [10, 10], [4, 4], 10, kind="start", step=1, text="A", kv=kv, alone=True,
                       ttft_s=0.15))
        comp.record.apply(_ev(method, label, [10, 10], [4, 4], 12, kind="done", step=3, kv=kv, step_latency_s=0.02,
                       policy_s=0.001, text="A cat sits" if method == "full" else "A cat", tokens_per_s=speed,
                       ttft_s=0.15, alone=True))
    return comp


def test_panels_badges_and_chat():
    from ui.panels import chat_messages, clean, header_html, status_line

    comp = _comparison()
    head = header_html(comp.tracks["h2o"], "every step", comp)
    for text in ("H2O", "KV 0.1 kB · 30% of full", "policy 2.00 ms/token", "compress 4.00 ms",
                 "ROUGE-L 0.800 vs Full"):
        assert text in head, text
    # batched: the shared forward is not any method's; it is in the status line once
    assert "tok/s" not in head and "TTFT" not in head
    assert "2 methods share one forward of 10 ms per token" in status_line(comp)
    head = header_html(_timed_alone(comp).tracks["h2o"], "every step", comp)
    assert "alone 40.0 tok/s · 0.80× Full" in head and "TTFT alone 150 ms" in head
    assert "× Full" not in header_html(comp.tracks["full"], "none", comp)
    assert "ROUGE-L reference" in header_html(comp.tracks["full"], "none", comp)
    msgs = chat_messages(comp.tracks["h2o"])
    assert msgs == [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A cat"}]
    comp.tracks["h2o"].turns[-1].status, comp.tracks["h2o"].turns[-1].error = "error", "RuntimeError: boom"
    assert "RuntimeError: boom" in header_html(comp.tracks["h2o"], "every step", comp)
    assert clean("a\x00b\x1fc\nd") == "abc\nd"


def test_panel_shows_any_methods_facts_without_knowing_the_method():
    from prefixkv_core.policies import Fact, facts_to_extras
    from ui.panels import facts_note, header_html

    extras = facts_to_extras([Fact("threshold", "retention threshold p", 0.8123, fmt=".3f"),
                              Fact("capacities", "capacity", (120, 60, 8), kind="per-layer", fmt="d", unit=" entries"),
                              Fact("mode", "mode", "offline"), Fact("notes", "note", "fell back", kind="note")])
    # the keys exports have always read stay at the top level
    assert extras["threshold"] == 0.8123 and extras["capacities"] == [120, 60, 8] and extras["notes"] == ["fell back"]
    extras = json.loads(json.dumps(extras))  # what crosses the API
    expected = "retention threshold p = 0.812 · capacity 8–120 entries over 3 layers · mode: offline · fell back"
    assert facts_note(extras) == expected
    comp = _comparison()
    comp.tracks["h2o"].last.extras = extras  # any method may report any fact
    assert expected in header_html(comp.tracks["h2o"], "every step", comp)
    assert facts_note({}) == "" and facts_note(None) == ""


def test_export_tables_and_files(tmp_path):
    from ui.export import export_all, results_csv, results_latex, transcript_markdown

    comp = _comparison()
    data = comp.to_dict()
    csv_text = results_csv(data)
    assert csv_text.splitlines()[0].startswith("method,label,stage,status") and "h2o,H2O,KV eviction,done" in csv_text
    assert data["methods"]["h2o"]["stage"] == "KV eviction"  # each method's stage, as its policy declares it
    tex = results_latex(data)
    assert r"\toprule" in tex and "H2O & KV eviction & " in tex and r"\bottomrule" in tex
    assert "Policy (ms/token)" in tex and "alone" not in tex.split(r"\midrule")[0].split("Policy")[1]
    assert "shared by 2 methods" in tex  # the caption says how the figures were timed
    md = transcript_markdown(data)
    assert "## Turn 1" in md and "What is this?" in md and "A cat sits" in md and "| H2O | KV eviction |" in md
    # timed alone: the table adds each method's own TTFT, throughput and speed-up over Full
    alone = _timed_alone(_comparison()).to_dict()
    header, *rows = results_csv(alone).splitlines()
    row = dict(zip(header.split(","), next(r for r in rows if r.startswith("h2o")).split(",")))
    assert row["timing"] == "batched" and row["alone_tokens_per_s"] == "40.0" and row["speedup_vs_full_alone"] == "0.8"
    assert row["policy_ms_per_token"] == "2.0" and row["alone_same_answer"] == "True"
    tex = results_latex(alone)
    assert r"Speed-up alone" in tex and r"0.80$\times$" in tex and "decoded alone" in tex
    assert "| 0.8x |" in transcript_markdown(alone)
    fig = charts.memory_figure(comp.series())
    latency = charts.latency_figure(comp.series(), comp.batch, comp.alone_series())
    res = export_all({"kv-memory": fig, "latency": latency}, data, formats=["html"], out_root=str(tmp_path),
                     images={"overlay": Image.new("RGB", (8, 8))})
    captions = (Path(res.directory) / "figures" / "captions.md").read_text().splitlines()
    assert "shared by 2 methods" in captions[1] and "shared by" not in captions[0]  # the latency chart's timing
    names = {p.rsplit("/", 1)[-1] for p in res.files}
    assert {"results.json", "results.csv", "table.tex", "transcript.md", "figures.html", "overlay.png"} <= names
    assert res.files[0].endswith(".zip")
    import zipfile

    with zipfile.ZipFile(res.files[0]) as zf:
        assert any(n.endswith("table.tex") for n in zf.namelist())


def test_paper_figure_is_a_clean_copy():
    from ui.export import paper_figure

    fig = charts.memory_figure({"h2o": charts.Series("H2O", [1, 2], [1, 2], [2, 4], [0, 0.1], [0, 0], [1, 1])})
    paper = paper_figure(fig)
    assert isinstance(paper, go.Figure) and paper.layout.title.text is None and fig.layout.title.text
    assert paper.layout.width == 720 and paper.layout.plot_bgcolor == "white"


def test_quality_figure_labels_coinciding_points_once():
    fig = charts.quality_figure({"local": ("Local", 0.30, 0.80), "snapkv": ("SnapKV", 0.31, 0.81),
                                 "h2o": ("H2O", 0.30, 0.40)})
    texts = {t.name: t.text[0] for t in fig.data}
    assert texts == {"Local": "Local · SnapKV", "SnapKV": "", "H2O": "H2O"}
    assert [t.x[0] for t in fig.data] == [0.30, 0.31, 0.30]  # every marker still drawn where it is


def test_a_method_still_in_its_own_prefill_says_so():
    """After the shared prefill, a method that runs a prefill of its own joins later: its panel says it is in its
    prefill (before the shared prefill every panel is waiting)."""
    from prefixkv_core.report.record import ComparisonRecord
    from ui.panels import header_html
    from ui.runstate import Comparison

    comp = Comparison(ComparisonRecord(["full", "fastv"], {"full": "Full", "fastv": "FastV"}, "What is this?", 0.3,
                                       {"max_new_tokens": 4}, {}, roles=role_methods()))
    assert "waiting" in header_html(comp.tracks["fastv"], "prompt only", comp)
    comp.record.apply(PrefillInfo(10, 4, 2, _importance(2, 10), np.arange(10) < 4, (2, 2), 0, 0.1))
    comp.record.apply(_ev("full", "Full", [10, 10], [4, 4], 10, kind="start", step=1, text="A", kv=400, stage="none"))
    assert "in its own prefill" in header_html(comp.tracks["fastv"], "prompt only", comp)
    assert "in its own prefill" not in header_html(comp.tracks["full"], "none", comp)


def test_a_static_render_that_hangs_is_given_up_and_the_figures_left_go_to_a_fresh_one(tmp_path, monkeypatch):
    """Kaleido's browser now and then never answers: a render that writes nothing for `stall_s` is left behind and
    the figures it did not write are rendered again; one that keeps failing ends with a message, in bounded time."""
    import threading

    from ui import export

    jobs = [(go.Figure(), tmp_path / f"chart-{i}.png", "png") for i in range(3)]
    asked, hung = [], threading.Event()

    def first_hangs_after_one(todo):
        asked.append([path.name for _, path, _ in todo])
        if len(asked) == 1:
            todo[0][1].write_bytes(b"png")  # one figure, then silence
            hung.wait(30)
            return
        for _, path, _ in todo:
            path.write_bytes(b"png")

    monkeypatch.setattr(export, "_write_static", first_hangs_after_one)
    assert export.write_static(jobs, timeout=20, stall_s=0.5) is None
    assert asked == [["chart-0.png", "chart-1.png", "chart-2.png"], ["chart-1.png", "chart-2.png"]]
    assert all(path.exists() for _, path, _ in jobs)

    asked.clear()
    monkeypatch.setattr(export, "_write_static", lambda todo: asked.append(len(todo)) or hung.wait(30))
    again = [(go.Figure(), tmp_path / "again.png", "png")]
    message = export.write_static(again, timeout=20, stall_s=0.3)
    assert message == f"static export stalled: the browser wrote no figure for 0 s, {export.STATIC_ATTEMPTS} times"
    assert asked == [1] * export.STATIC_ATTEMPTS
    asked.clear()
    assert export.write_static(again, timeout=0.5, stall_s=5) == "static export timed out after 0 s"
    assert asked == [1]
    monkeypatch.setattr(export, "_write_static", lambda todo: 1 / 0)
    assert export.write_static(again, timeout=20, stall_s=0.3).startswith("static export failed (ZeroDivisionError")
    hung.set()
