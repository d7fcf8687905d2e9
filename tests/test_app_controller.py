"""The app's event handlers called directly (no server): errors in one method, stop, a closed stream,
follow-ups, the overlay / Lorenz / export handlers."""

import gradio as gr
import pytest

from prefixkv_core import METHODS, Engine
from prefixkv_core.policies import role_methods
from prefixkv_core.testing import wait_until

ALL = list(METHODS)


@pytest.fixture(scope="module")
def app(tiny_llama):
    from ui.app_builder import build_app

    return build_app(Engine(tiny_llama), max_new_tokens_limit=64)


@pytest.fixture
def ctl(app):
    return app.controller


def _run(ctl, box, image, methods, max_new=6, prompt="Describe the picture.", **kw):
    outs = list(ctl.compare(image, prompt, methods, 0.3, max_new, box=box, **kw))
    return outs, box.run


def _wait_unlocked(engine) -> bool:
    return wait_until(lambda: not engine.lock.locked(), timeout=10)


def test_compare_fills_every_output(ctl, noise_image):
    from ui.controller import SessionBox

    box = SessionBox()
    outs, comp = _run(ctl, box, noise_image, ["full", "h2o", "prefixkv"])
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "Done" in final["status"]
    assert final["results"]["methods"]["h2o"]["status"] == "done"
    assert final["results"]["methods"]["h2o"]["rouge_l_vs_full"] is not None
    assert final["chat:prefixkv"][0] == {"role": "user", "content": "Describe the picture."}
    assert "of full" in final["head:prefixkv"] and "ROUGE-L" in final["head:prefixkv"]
    assert len(final["gallery"]) == 3 and "patches kept" in final["gallery"][0][1]
    assert len(final["table"]) == 3 and final["box"] is box
    assert comp.threshold() is not None  # PrefixKV's online threshold reached the Lorenz chart
    assert any("PrefixKV threshold p" in (t.name or "") for t in final["lorenz"].data)
    assert _wait_unlocked(ctl.engine)


def test_error_in_one_method_leaves_the_others(ctl, noise_image, monkeypatch):
    from prefixkv_core.policies.h2o import H2OPolicy
    from ui.controller import SessionBox

    def boom(self, view):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(H2OPolicy, "prefill", boom)
    box = SessionBox()
    outs, comp = _run(ctl, box, noise_image, ["full", "h2o", "snapkv"])
    final = dict(zip(ctl.output_keys, outs[-1]))
    status = {m: comp.tracks[m].turn.status for m in comp.methods}
    assert status == {"full": "done", "h2o": "error", "snapkv": "done"}
    assert "synthetic failure" in final["head:h2o"] and "Traceback" not in final["head:h2o"]
    assert "Done" in final["status"]


def test_bad_inputs_raise_user_messages(ctl, noise_image):
    from ui.controller import SessionBox

    cases = [("  ", ["full"], 0.3, 4, "prompt is empty"), ("hi", [], 0.3, 4, "no method selected"),
             ("hi", ["full"], 0.0, 4, "budget"), ("hi", ["full"], 1.5, 4, "budget"),
             ("hi", ["nope"], 0.3, 4, "unknown"), ("x" * 5000, ["full"], 0.3, 4, "limit is 2000"),
             ("hi", ["full"], 0.3, 0, "max new tokens")]
    for prompt, methods, budget, max_new, message in cases:
        with pytest.raises(gr.Error, match=message):
            list(ctl.compare(noise_image, prompt, methods, budget, max_new, box=SessionBox()))
    with pytest.raises(gr.Error, match="calibrated PrefixKV"):
        list(ctl.compare(noise_image, "hi", ["prefixkv"], 0.3, 4, box=SessionBox(), prefixkv__mode="offline"))
    with pytest.raises(gr.Error, match="run a comparison first"):
        list(ctl.follow_up("and?", SessionBox()))
    with pytest.raises(gr.Error, match="nothing to export"):
        ctl.export(["html"], SessionBox())


def test_stop_cancels_every_method_within_a_token(ctl, noise_image):
    from ui.controller import SessionBox

    box = SessionBox()
    gen = ctl.compare(noise_image, "Describe.", ALL, 0.3, 64, box=box)
    outs = [next(gen), next(gen)]  # first render, then the prefill
    assert "Stopping" in ctl.stop(box)
    outs += list(gen)
    comp = box.run
    assert "Stopped" in outs[-1][0]
    states = comp.session.states
    assert all(s.finished for s in states.values())
    # each method that had started stopped within one token of the others, well before 64; a method still waiting
    # for its own prefill (they join the batch one at a time) ends without having run, and says so
    started = [s for s in states.values() if s.cache is not None]
    steps = [len(s.turn_ids) for s in started]
    assert started and max(steps) - min(steps) <= 1 and max(steps) < 64
    assert all("stopped before its own prefill" in s.error for s in states.values() if s.cache is None)
    assert {t.turn.status for m, t in comp.tracks.items() if states[m].cache is not None} <= {"stopped", "done"}
    assert {t.turn.status for m, t in comp.tracks.items() if states[m].cache is None} <= {"error"}
    assert _wait_unlocked(ctl.engine)


def test_closing_the_stream_releases_the_engine(ctl, noise_image):
    from ui.controller import SessionBox

    box = SessionBox()
    gen = ctl.compare(noise_image, "Describe.", ALL, 0.3, 64, box=box)
    next(gen)
    next(gen)
    gen.close()  # what gradio does when the tab closes or Clear cancels the event
    assert box.run.cancel.is_set()
    assert _wait_unlocked(ctl.engine)
    assert max(len(s.turn_ids) for s in box.run.session.states.values()) < 64


def test_follow_up_overlay_lorenz_budget_export_clear(ctl, noise_image):
    from ui.controller import SessionBox

    box = SessionBox()
    _run(ctl, box, noise_image, ["full", "prefixkv"], max_new=4)
    outs = list(ctl.follow_up("And the colours?", box))
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert final["results"]["prompts"] == ["Describe the picture.", "And the colours?"]
    chat = final["chat:prefixkv"]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert chat[2]["content"] == "And the colours?"
    assert max(box.run.tracks["prefixkv"].series.steps) >= 5  # the series continues over turns

    gallery = ctl.set_overlay_layer(1, box)
    assert len(gallery) == 2 and "layer 1" in gallery[0][1]
    fig = ctl.set_lorenz_layers([0, 2], box)
    assert [t.name.split(" (")[0] for t in fig.data if (t.name or "").startswith("layer")] == ["layer 0", "layer 2"]
    fig = ctl.set_view_budget(0.6, box)
    assert any("preview" in (t.name or "") for t in fig.data)

    update, message = ctl.export(["html"], box)
    files = update["value"]
    assert update["visible"] is True
    names = {f.rsplit("/", 1)[-1] for f in files}
    assert {"results.json", "results.csv", "table.tex", "transcript.md", "figures.html"} <= names
    assert "Exported" in message

    cleared = ctl.clear(box)
    assert box.run is None and "Upload an image" in cleared[0]


@pytest.mark.parametrize("equal_memory", [False, True])
def test_token_reduction_and_head_wise_methods_fill_every_chart(ctl, noise_image, equal_memory):
    """FastV, VisionZip and AdaKV beside Full in the app, in both budget modes: each panel names its stage, every
    chart and the overlay are drawn, and the results carry the stage."""
    from ui.controller import SessionBox

    box = SessionBox()
    methods = ["full", "fastv", "visionzip", "adakv"]
    knobs = {"fastv__budget_of": "image", "visionzip__budget_of": "image", "adakv__window": 8}
    outs, comp = _run(ctl, box, noise_image, methods, equal_memory=equal_memory, **knobs)
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "Done" in final["status"], final["status"]
    results = final["results"]["methods"]
    assert {m: r["status"] for m, r in results.items()} == {m: "done" for m in methods}
    assert {m: r["stage"] for m, r in results.items()} == {
        "full": "none", "fastv": "prefill token reduction", "visionzip": "prefill token reduction",
        "adakv": "KV eviction"}
    assert "prefill token reduction · prompt only" in final["head:visionzip"]
    assert "KV eviction · prompt only" in final["head:adakv"] and "no compression" in final["head:full"]
    assert results["visionzip"]["kv_ratio"] < 1 and results["fastv"]["kv_ratio"] < 1
    assert len(final["bars"].data) > 0 and len(final["lorenz"].data) > 0
    captions = {cap.split(" · ")[0]: cap for _, cap in final["gallery"]}
    assert set(captions) == {"Full", "FastV", "VisionZip", "AdaKV"}
    assert "patches kept" in captions["VisionZip"]
    if not equal_memory:  # (held at r·N_t, its prompt may lose the contextual tokens too)
        assert "merged into pooled or contextual tokens" in captions["VisionZip"]  # the patches its language model sees


@pytest.mark.parametrize("equal_memory,query_agnostic", [(False, False), (True, True)])
def test_the_control_methods_fill_every_chart(ctl, noise_image, equal_memory, query_agnostic):
    """Random and Downsample beside Full and PrefixKV: their panels name their stage and say what they did (the
    seed, the pooled grid), the bars, the Lorenz chart and the overlay are drawn, in both budget and query modes."""
    from ui.controller import SessionBox

    box = SessionBox()
    methods = ["full", "random", "downsample", "prefixkv"]
    outs, comp = _run(ctl, box, noise_image, methods, equal_memory=equal_memory, query_agnostic=query_agnostic,
                      seed=4, downsample__budget_of="image")
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "Done" in final["status"], final["status"]
    results = final["results"]["methods"]
    assert {m: r["status"] for m, r in results.items()} == {m: "done" for m in methods}
    assert "KV eviction · prompt only" in final["head:random"] and "seed 4 and this request" in final["head:random"]
    assert "prefill token reduction · prompt only" in final["head:downsample"]
    assert "grid pooling" in final["head:downsample"] and "share of the image tokens kept" in final["head:downsample"]
    assert results["random"]["kv_ratio"] < 1 and results["downsample"]["kv_ratio"] < 1
    assert len(final["bars"].data) > 0 and len(final["lorenz"].data) > 0
    captions = {cap.split(" · ")[0]: cap for _, cap in final["gallery"]}
    assert {"Random", "Downsample"} <= set(captions)
    if not equal_memory:  # the pooled tokens stand for every patch they average
        assert "merged into pooled or contextual tokens" in captions["Downsample"]


def test_time_each_method_alone(ctl, noise_image):
    """The switch: after the batched run every method is decoded on its own; the phase says so while it runs,
    the table and the latency chart then show each method's own figures; a follow-up is timed alone too."""
    from ui.controller import TABLE_HEADERS, SessionBox
    from ui.run_stream import phase

    box = SessionBox()
    outs, comp = _run(ctl, box, noise_image, ["full", "h2o", "snapkv"], max_new=4, time_alone=True)
    final = dict(zip(ctl.output_keys, outs[-1]))
    assert "Done" in final["status"] and "also timed alone" in final["status"]
    table = {row[0]: dict(zip(TABLE_HEADERS, row)) for row in final["table"]}
    assert table["Full"]["× Full (alone)"] == "1.00" and table["H2O"]["tok/s alone"] != "–"
    assert table["SnapKV"]["Policy (ms/token)"] != "–" and table["SnapKV"]["TTFT alone (ms)"] != "–"
    latency = final["latency"]
    assert "decoded alone" in latency.layout.title.text
    assert [t.name for t in latency.data][1:] == ["Full", "H2O", "SnapKV"]
    for r in final["results"]["methods"].values():
        assert r["alone"]["same_answer"] is True and r["speedup_vs_full"] is not None
    comp.tracks["snapkv"].turn.alone.status = "streaming"  # as while the last method is timed alone
    assert phase(comp) == "Timing each method alone: 2 of 3 measured"
    comp.tracks["snapkv"].turn.alone.status = "done"
    outs = list(ctl.follow_up("And the colours?", box))
    results = dict(zip(ctl.output_keys, outs[-1]))["results"]
    for r in results["methods"].values():
        assert r["alone"]["same_answer"] is True and len(r["answers"]) == 2
    assert box.run.session.timing == []
    with pytest.raises(gr.Error, match="time_alone must be true or false"):
        list(ctl.compare(noise_image, "Describe.", ["full"], 0.3, 2, box=SessionBox(), time_alone="yes"))
    assert _wait_unlocked(ctl.engine)


# -- the controller's pieces, each built from its explicit dependencies (fakes here, no model) ----------------
class _FakeRegistry:
    def __init__(self):
        self.calls = []

    def begin(self, owner):
        self.calls.append(("begin", owner))

    def end(self, owner):
        self.calls.append(("end", owner))

    def running(self):
        return sum(1 if c[0] == "begin" else -1 for c in self.calls if c[0] in ("begin", "end"))

    def release_owner(self, owner, reason=None):
        self.calls.append(("release", owner, reason))


class _FakeExports:
    def __init__(self):
        self.forgotten = []

    def forget(self, owner):
        self.forgotten.append(owner)


class _FakeRenderer:
    """Records what it was asked to draw and draws it as (phase, parts)."""

    def __init__(self):
        self.drawn = []

    def render(self, comp, box, phase, **parts):
        self.drawn.append(phase)
        return [phase]

    def empty(self, box, phase=None):
        return ["empty"]

    def as_list(self, values):
        return [values.get("status")]

    def lorenz(self, comp, box):
        return ("lorenz", box.lorenz_layers)


def _plain_comparison():
    from prefixkv_core.report.record import ComparisonRecord
    from ui.runstate import Comparison

    return Comparison(ComparisonRecord(["full"], {"full": "Full"}, "What is this?", 0.3, {"max_new_tokens": 2}, {}, roles=role_methods()))


def test_tab_lifecycle_uses_only_what_it_is_given():
    from types import SimpleNamespace

    from ui.lifecycle import TabLifecycle
    from ui.runstate import SessionBox

    registry, exports, waiting = _FakeRegistry(), _FakeExports(), {"tab-1": 1}
    tabs = TabLifecycle(registry, exports, _FakeRenderer(), engine_busy=lambda: True,
                        queue_waiting=lambda session: waiting.get(session, 0))
    status, box = tabs.prepare(None)
    assert status.startswith("Queued") and box.pending
    box.pending = False  # the click's own flag gone: only the queue says a request still waits
    assert "will not start" in tabs.stop(box, SimpleNamespace(session_hash="tab-1"))
    assert box.stop_requested
    assert tabs.stop(SessionBox(), SimpleNamespace(session_hash="tab-2")).startswith("Nothing to stop")
    cleared = tabs.clear(box, SimpleNamespace(session_hash="tab-1"))
    assert cleared[0] == "empty" and box.owner == "tab-1" and ("release", "tab-1", None) in registry.calls
    tabs.disconnected(SimpleNamespace(session_hash="tab-1"))
    assert ("release", "tab-1", "closed") in registry.calls and exports.forgotten == ["tab-1"]


def test_run_streamer_draws_a_run_with_a_fake_renderer_and_registry():
    from ui.overlay_sampler import OverlaySampler
    from ui.run_stream import RunStreamer
    from ui.runstate import SessionBox

    renderer, registry = _FakeRenderer(), _FakeRegistry()
    streamer = RunStreamer(renderer, registry, OverlaySampler(num_layers=2))
    box, comp = SessionBox(), _plain_comparison()
    box.owner = "tab"
    outs = list(streamer.stream(box, comp, lambda cancel: iter(()), first_turn=True))
    assert outs[0] == ["Prefill: encoding the image and prompt once for every method…"]
    assert outs[-1][0].startswith("✓ Done") and box.run is comp and not comp.active
    assert registry.calls == [("begin", "tab"), ("end", "tab")]  # busy in the registry only while it ran
    assert streamer.not_started(box) == ["■ Stopped before it started."] and not box.pending


def test_the_engine_starts_before_the_first_redraw_is_sent():
    """gradio resumes a handler only once it has sent what the handler yielded, so the run's worker must be going
    by the time the first redraw (the placeholders) is handed over, not after it was sent."""
    import threading

    from ui.overlay_sampler import OverlaySampler
    from ui.run_stream import RunStreamer
    from ui.runstate import SessionBox

    started, release = threading.Event(), threading.Event()

    def events(cancel):
        started.set()
        release.wait(5)
        return iter(())

    streamer = RunStreamer(_FakeRenderer(), _FakeRegistry(), OverlaySampler(num_layers=2))
    box, comp = SessionBox(), _plain_comparison()
    box.owner = "tab"
    stream = streamer.stream(box, comp, events, first_turn=True)
    next(stream)  # the first redraw, not yet sent: the generator waits here until gradio asks again
    assert started.wait(5)
    release.set()
    assert list(stream)[-1][0].startswith("✓ Done")


def test_redraws_are_spaced_by_what_they_cost_and_how_many_runs_stream():
    """Every stream keeps its redraws within a share of the server's time, all streams together: alone and cheap,
    the usual pace; costly, or beside other streams, further apart (the final state is drawn regardless)."""
    from ui import run_stream
    from ui.run_stream import _Pace

    streams = [1]
    pace = _Pace(_plain_comparison(), lambda: streams[0])
    assert pace.text_interval() == run_stream.TEXT_EVERY_S and pace.chart_interval() == run_stream.CHART_EVERY_S
    pace.drew("panels", 0.01)
    pace.drew("charts", 0.05)
    assert pace.text_interval() == run_stream.TEXT_EVERY_S and pace.chart_interval() == run_stream.CHART_EVERY_S
    pace.drew("charts", 0.3)  # the charts of a real model on a CPU
    assert pace.chart_interval() == pytest.approx(0.3 / run_stream.CHART_SHARE)
    streams[0] = 4
    assert pace.chart_interval() == pytest.approx(4 * 0.3 / run_stream.CHART_SHARE)
    assert pace.text_interval() == pytest.approx(max(run_stream.TEXT_EVERY_S, 4 * 0.01 / run_stream.TEXT_SHARE))
    pace.drew("lorenz", 5.0)  # the Lorenz chart alone: neither pace moves
    assert pace.chart_interval() == pytest.approx(4 * 0.3 / run_stream.CHART_SHARE)


def test_view_controls_check_layers_against_the_given_count():
    from ui.overlay_sampler import OverlaySampler
    from ui.runstate import SessionBox
    from ui.view_controls import ViewControls

    views = ViewControls(_FakeRenderer(), OverlaySampler(num_layers=4), num_layers=4)
    box = SessionBox()
    assert views.set_lorenz_layers([3, 9, -1, 0], box) == ("lorenz", [0, 3])
    assert isinstance(views.set_lorenz_layers(["x"], box), type(gr.skip()))
    views.set_overlay_layer(99, box)
    assert box.overlay_layer == 3


def test_a_misspelt_comparison_attribute_raises():
    comp = _plain_comparison()
    comp.active = True  # a field of the record the app writes: it lands in the one record
    assert comp.record.active is True
    with pytest.raises(AttributeError):
        comp.activ = False
    with pytest.raises(AttributeError):
        comp.eror = "typo"
    assert not hasattr(comp.record, "activ") and not hasattr(comp.record, "eror")
    with pytest.raises(AttributeError):
        comp.no_such_field  # noqa: B018 - reading an unknown name fails too


def test_ui_keeps_classes_and_functions_small():
    """No class over 250 lines and no function over 80 lines in ui/; the UI never imports transformers."""
    import ast
    from pathlib import Path

    too_long = []
    for path in sorted((Path(__file__).resolve().parent.parent / "ui").glob("*.py")):
        source = path.read_text()
        assert "import transformers" not in source and "from transformers" not in source, path.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = 250 if isinstance(node, ast.ClassDef) else 80
                if node.end_lineno - node.lineno + 1 > limit:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}")
    assert not too_long


def test_exporter_refuses_before_a_run_without_touching_the_store():
    from ui.exporting import Exporter
    from ui.runstate import SessionBox

    exports = _FakeExports()  # has no new_folder: a refused export must not ask for one
    with pytest.raises(gr.Error, match="nothing to export"):
        Exporter(_FakeRenderer(), exports).export(["html"], SessionBox())


def test_a_click_is_queued_only_when_every_batch_place_is_taken(ctl):
    """Up to `max_batch_users` runs go at once (decoded in one batch); the next click says it waits."""
    from ui.runstate import SessionBox

    places = ctl.limits.max_batch_users
    assert places > 1 and ctl.prepare(SessionBox())[0] == "Starting…"
    owners = [f"running-{i}" for i in range(places)]
    try:
        for i, owner in enumerate(owners):
            ctl.registry.add(owner, _IdleSession())  # added as running
            queued = ctl.prepare(SessionBox())[0].startswith("Queued")
            assert queued == (i + 1 == places), i
    finally:
        for owner in owners:
            ctl.registry.release_owner(owner)


class _IdleSession:
    released = False

    def cache_bytes(self) -> int:
        return 0

    def release(self) -> None:
        self.released = True


def test_a_redraw_builds_again_only_the_charts_whose_data_changed(ctl, noise_image):
    """Redraws share the server's interpreter with the model: a chart whose data is as it was is the figure built
    last time; one more event of the run builds the ones that draw it anew, and every chart still shows the run."""
    from prefixkv_core.report.events import MethodEvent
    from ui.controller import SessionBox

    box = SessionBox()
    _, comp = _run(ctl, box, noise_image, ["full", "h2o"], max_new=4)
    first, again = ctl.renderer.figures(comp, box), ctl.renderer.figures(comp, box)
    assert all(again[name] is first[name] for name in first)
    assert ctl.renderer.gallery(comp) is ctl.renderer.gallery(comp)
    # two comparisons never share a chart, however alike
    _, other = _run(ctl, SessionBox(), noise_image, ["full", "h2o"], max_new=4)
    assert ctl.renderer.figures(other, box)["retained-per-layer"] is not first["retained-per-layer"]
    # an event that extends the telemetry: the charts drawing it are built again, the Lorenz chart (the prefill's)
    # is not, and the bars show the new event
    last = comp.tracks["h2o"].last
    grown = MethodEvent(**{**last.__dict__, "step": last.step + 1, "text": last.text + " more",
                           "kept_per_layer": [k + 1 for k in last.kept_per_layer]})
    comp.record.apply(grown)  # as the session feeds it
    now = ctl.renderer.figures(comp, box)
    assert now["lorenz"] is first["lorenz"]
    assert now["retained-per-layer"] is not first["retained-per-layer"]
    assert now["kv-memory"] is not first["kv-memory"] and now["latency"] is not first["latency"]
    heights = [max(trace.y) for trace in now["retained-per-layer"].data if trace.y is not None and len(trace.y)
               and trace.y[0] is not None]
    assert heights  # the bars are drawn from the data
    # another view of the same run (other Lorenz layers) is its own figure
    box.lorenz_layers = [0]
    assert ctl.renderer.lorenz(comp, box) is not now["lorenz"]
