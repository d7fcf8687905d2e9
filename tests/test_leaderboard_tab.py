"""The Leaderboard tab: its figure (a pure function) on synthetic points, its handlers through the Controller, and
its API endpoints (`/leaderboard`, `/leaderboard_export`) through gradio_client, hostile filter values included."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import gradio as gr
import pytest

from prefixkv_core import Engine
from prefixkv_core.policies import method_colours
from prefixkv_core.report.leaderboard_store import DEFAULT_ROOT, LeaderboardPoint, LeaderboardStore, load_leaderboard
from ui.leaderboard_chart import X_TITLE, leaderboard_figure


def _point(method, ratio, accuracy, agreement=None, **kw):
    defaults = dict(task="task", model="m", name=method, query_mode="query_aware", budget_mode="published",
                    command="python -m prefixkv_core.evaluation.sweep --out <this folder>", commit="abc1234",
                    produced_with="m (on cpu)", source="task/m")
    return LeaderboardPoint(method=method, compression_ratio=ratio, accuracy=accuracy, agreement=agreement,
                            **{**defaults, **kw})


# -- the figure ------------------------------------------------------------------------------------------------

def test_figure_draws_a_line_per_method_at_the_share_it_held():
    points = [_point("snapkv", 0.5, 80.0, 70.0), _point("snapkv", 0.9, 30.0, 20.0, budget=0.1),
              _point("dart[image]", 0.9, 40.0, 30.0, budget=0.1, kv_share=0.24),
              _point("full", 0.0, 100.0, 100.0), _point("prefixkv", 0.7, 60.0, None)]
    fig = leaderboard_figure(points, "accuracy", {"full": "Full", "snapkv": "SnapKV", "prefixkv": "PrefixKV"})
    names = [t.name for t in fig.data]
    assert names == ["Full", "SnapKV", "PrefixKV", "dart[image]"]  # the labels' order, then unlabelled ones
    assert list(fig.data[3].x) == [pytest.approx(0.24)]  # its measured share, not 1 - compression_ratio
    snap = fig.data[1]
    assert list(snap.x) == [pytest.approx(0.1), pytest.approx(0.5)] and list(snap.y) == [30.0, 80.0]
    assert snap.mode == "lines+markers" and fig.data[0].mode == "markers"
    colours = method_colours()
    assert snap.line.color == colours["snapkv"] and fig.data[0].marker.color == colours["full"]
    assert fig.layout.xaxis.title.text == X_TITLE and "accuracy" in fig.layout.yaxis.title.text
    custom = snap.customdata[0]
    assert custom[0] == "0.90" and "r = 0.1" in custom[2]
    assert "abc1234" in custom[4] and "m (on cpu)" in custom[3]
    assert "&lt;this folder&gt;" in custom[5] and "<this" not in custom[5]  # hover text is escaped
    assert "command" in snap.hovertemplate and "commit" in snap.hovertemplate and "model" in snap.hovertemplate

    agree = leaderboard_figure(points, "agreement")
    assert [t.name for t in agree.data] == ["dart[image]", "full", "snapkv"]  # PrefixKV has none; no labels: names
    assert "agreement" in agree.layout.yaxis.title.text


def test_figure_without_points_is_a_placeholder_and_an_unknown_metric_is_refused():
    empty = leaderboard_figure([], "accuracy", title="nothing")
    assert len(empty.data) == 0 and "No stored results" in empty.layout.annotations[0].text
    with pytest.raises(ValueError, match="metric must be one of"):
        leaderboard_figure([_point("snapkv", 0.5, 1.0)], "loss")


# -- the handlers through the Controller --------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(tiny_llama):
    from ui.app_builder import build_app

    return build_app(Engine(tiny_llama), max_new_tokens_limit=8)


@pytest.fixture
def ctl(app):
    return app.controller


def test_the_page_has_a_compare_and_a_leaderboard_tab(app):
    tabs = [b.label for b in app.blocks.values() if isinstance(b, gr.Tab)]
    assert tabs == ["Compare", "Leaderboard"]
    assert app.controller.leaderboard.store.points  # the shipped results, read by the server


def _sitting(ctl, query_mode, budget_mode):
    """The shipped points of one scene-question sitting of the embedded model."""
    return ctl.leaderboard.store.select(task="scene_qa", query_mode=query_mode, budget_mode=budget_mode)


def test_show_filters_the_shipped_rows(ctl):
    fig, rows, note = ctl.show_leaderboard("scene_qa", "embedded", "query_agnostic", "published", "agreement")
    sitting = _sitting(ctl, "query_agnostic", "published")
    # the headline's rows: every method and control, [image] rows, a line each
    assert len(rows) == len(sitting) >= 102 and len(fig.data) == len({p.name for p in sitting}) >= 22
    assert {r[-2] for r in rows} == {"scene_qa/embedded-query-agnostic"}
    assert "synthetic scenes only" in note and "343 samples per task" in note and "by 0.29 points" in note
    snapkv = next(t for t in fig.data if t.name == "SnapKV")
    held = sorted(p.kv_share for p in ctl.leaderboard.store.select(task="scene_qa", query_mode="query_agnostic",
                                                                  budget_mode="published") if p.method == "snapkv")
    assert list(snapkv.x) == pytest.approx(held)  # at the share it measured, not at r
    default = ctl.show_leaderboard()  # every filter left out: the defaults
    assert len(default[1]) == len(_sitting(ctl, "query_aware", "published")) >= 102
    assert "query-aware" in default[0].layout.title.text
    fig, rows, note = ctl.show_leaderboard("scene_multi", "embedded", "query_aware", "published", "accuracy")
    assert rows == [] and "No stored results" in note and "query-agnostic, published" in note  # what there is
    # the equal-memory sittings: the same rows, every budgeted one at the r it holds at every step
    for mode in ("query_agnostic", "query_aware"):
        fig, rows, note = ctl.show_leaderboard("scene_qa", "embedded", mode, "equal_memory", "accuracy")
        sitting = _sitting(ctl, mode, "equal_memory")
        assert len(rows) == len(sitting) >= 102 and len(fig.data) == len({p.name for p in sitting})
        assert {r[-2] for r in rows} == {f"scene_qa/embedded-{mode.replace('_', '-')}-equal-memory"}
        snapkv = next(t for t in fig.data if t.name == "SnapKV")
        assert list(snapkv.x) == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.5], abs=0.005)


@pytest.mark.parametrize("values,message", [
    (("../../etc/passwd",), "task must be one of: {tasks}; got '../../etc/passwd'"),
    ((None, "<script>alert(1)</script>"), "model must be one of: embedded"),
    ((None, None, "both"), "query_mode must be one of: query_aware, query_agnostic"),
    ((None, None, None, ["published"]), "budget_mode must be one of: published, equal_memory"),
    ((None, None, None, None, "loss"), "metric must be one of: accuracy, agreement"),
])
def test_unknown_filter_values_are_refused_with_the_list(ctl, values, message):
    with pytest.raises(gr.Error) as err:
        ctl.show_leaderboard(*values)
    tasks = ", ".join(ctl.leaderboard.store.values("task"))  # the shipped tasks, scene_qa among them
    assert "scene_qa" in tasks and message.format(tasks=tasks) in err.value.message
    assert len(ctl.show_leaderboard()[1]) == len(_sitting(ctl, "query_aware", "published"))  # the next is served


def test_export_writes_csv_json_and_the_figure_or_says_why_not(ctl, monkeypatch):
    import ui.leaderboard_view as view

    monkeypatch.setattr(view, "find_browser", lambda: None)
    update, message = ctl.export_leaderboard("scene_qa", "embedded", "query_aware", "published", "accuracy",
                                             ["png", "pdf"])
    files = [Path(p) for p in update["value"]]
    assert [p.suffix for p in files] == [".csv", ".json", ".md"]
    assert "No Chromium or Chrome found" in message
    rows = list(csv.DictReader(io.StringIO(files[0].read_text())))
    assert len(rows) == len(_sitting(ctl, "query_aware", "published")) and {r["query_mode"] for r in rows} == {
        "query_aware"}
    assert json.loads(files[1].read_text())["query_mode"] == "query_aware"
    assert "synthetic scenes only" in files[2].read_text()
    with pytest.raises(gr.Error, match="figure_formats must be a list"):
        ctl.export_leaderboard(None, None, None, None, None, ["../x.png"])
    with pytest.raises(gr.Error, match="nothing to download"):
        ctl.export_leaderboard("scene_multi", None, "query_aware", None, None, [])


def test_export_renders_the_paper_figure_with_chromium(ctl):
    from ui.export import find_browser

    if find_browser() is None:
        pytest.skip("no Chromium or Chrome for kaleido")
    update, message = ctl.export_leaderboard(None, None, "query_agnostic", None, "agreement", ["png"])
    png = [Path(p) for p in update["value"] if p.endswith(".png")]
    assert len(png) == 1 and png[0].stat().st_size > 20_000, message


def test_a_store_of_its_own_and_an_empty_one(tiny_llama, tmp_path):
    from ui.controller import Controller

    empty = Controller(Engine(tiny_llama), ["full"], 8, [], leaderboard=LeaderboardStore())
    fig, rows, note = empty.show_leaderboard()
    assert rows == [] and len(fig.data) == 0 and "No stored results" in note
    with pytest.raises(gr.Error, match="task must be one of: nothing"):
        empty.show_leaderboard("scene_qa")
    other = Controller(Engine(tiny_llama), ["full"], 8, [], leaderboard=load_leaderboard(tmp_path / "absent"))
    assert "Not read: no leaderboard folder" in other.show_leaderboard()[2]


# -- the API ---------------------------------------------------------------------------------------------------

def test_the_leaderboard_endpoints_through_gradio_client(tiny_llama, serve_app, api_client):
    client = api_client(serve_app(Engine(tiny_llama), max_new_tokens_limit=8))
    try:
        api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
        names = [p["parameter_name"] for p in api["/leaderboard"]["parameters"]]
        assert names == ["task", "model", "query_mode", "budget_mode", "metric"]
        figure, table, note = client.predict("scene_qa", "embedded", "query_aware", "published", "accuracy",
                                             api_name="/leaderboard")
        store = load_leaderboard(DEFAULT_ROOT)
        count = {mode: len(store.select(task="scene_qa", query_mode=mode, budget_mode="published"))
                 for mode in ("query_aware", "query_agnostic")}
        assert len(table["data"]) == count["query_aware"] >= 102 and "synthetic scenes only" in note
        shipped = DEFAULT_ROOT / "scene_qa" / "embedded-query-aware"
        assert json.loads((shipped / "results.json").read_text())["commit"] in json.dumps(figure)  # in the hover
        for hostile, field in [("../../../etc/passwd", "task"), ("x" * 5000, "task")]:
            with pytest.raises(Exception, match=f"{field} must be one of: .*scene_qa"):
                client.predict(hostile, "embedded", "query_aware", "published", "accuracy", api_name="/leaderboard")
        with pytest.raises(Exception, match="metric must be one of"):
            client.predict("scene_qa", "embedded", "query_aware", "published", {"a": 1}, api_name="/leaderboard")
        with pytest.raises(Exception, match="figure_formats: .* not accepted"):
            client.predict("scene_qa", "embedded", "query_aware", "published", "accuracy", ["svg"],
                           api_name="/leaderboard_export")
        again = client.predict("scene_qa", "embedded", "query_agnostic", "published", "agreement",
                               api_name="/leaderboard")
        assert len(again[1]["data"]) == count["query_agnostic"]  # the app is still up
    finally:
        client.close()


def test_the_view_uses_only_what_it_is_given(tmp_path):
    from types import SimpleNamespace

    from ui.export_store import ExportStore
    from ui.leaderboard_view import LeaderboardView

    store = LeaderboardStore([_point("snapkv", 0.5, 80.0, 70.0), _point("snapkv", 0.8, 40.0, 30.0),
                              _point("h2o", 0.5, 60.0, 50.0, query_mode="query_agnostic")])
    exports = ExportStore(max_folders=2)
    view = LeaderboardView(store, exports, {"snapkv": "SnapKV"})
    fig, rows, note = view.show()
    assert [r[0] for r in rows] == ["SnapKV", "SnapKV"] and [t.name for t in fig.data] == ["SnapKV"]
    assert "synthetic scenes" not in note  # not the embedded model
    fig, rows, _ = view.show(query_mode="query_agnostic")
    assert [r[0] for r in rows] == ["h2o"]
    request = SimpleNamespace(session_hash="tab-1")
    update, _ = view.export(formats=[], request=request)
    assert exports.folders() and all(Path(p).exists() for p in update["value"])
    view.forget(request)
    assert exports.folders() == [] and not any(Path(p).exists() for p in update["value"])
    exports.close()
