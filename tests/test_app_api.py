"""The app's main event through gradio_client, on a tiny model, plus chart builders on synthetic data."""
import socket

import numpy as np
import pytest

from prefixkv_core import Engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tiny_llama):
    from ui.app_builder import build_app

    demo = build_app(Engine(tiny_llama), max_new_tokens_limit=16)
    demo.queue(default_concurrency_limit=1)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def test_compare_streams_every_selected_method(app_url, tmp_path, noise_image):
    from gradio_client import Client, handle_file

    path = tmp_path / "img.png"
    noise_image.save(path)
    client = Client(app_url, verbose=False)
    job = client.submit(handle_file(str(path)), "describe the picture", ["full", "local", "prefixkv"], 0.3, 6,
                        api_name="/compare")
    outputs = list(job)
    assert len(outputs) >= 1
    final = job.result()
    panels = {p.split("\n")[0]: p for p in final[:9]}
    for title in ("### Full", "### Local (StreamingLLM)", "### PrefixKV"):
        assert "KV" in panels[title] and "of full" in panels[title]
    assert "ROUGE-L vs Full" in panels["### PrefixKV"]
    assert "_not selected_" in panels["### H2O"]


def test_bad_input_is_a_message_not_a_crash(app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    with pytest.raises(Exception, match="prompt is empty"):
        client.predict(None, "   ", ["full"], 0.3, 4, api_name="/compare")
    with pytest.raises(Exception, match="at least one method"):
        client.predict(None, "hello", [], 0.3, 4, api_name="/compare")
    # still serving
    out = client.predict(None, "hello there", ["full"], 0.5, 3, api_name="/compare")
    assert "### Full" in out[0]


def test_lorenz_chart_has_gini_in_legend_and_threshold():
    from ui.charts import lorenz_figure

    imp = np.random.RandomState(0).rand(8, 50).astype("float32") ** 3
    fig = lorenz_figure(imp, threshold=0.8, budget=0.3)
    names = [t.name for t in fig.data]
    assert sum("Gini" in n for n in names) == 6 and "uniform importance" in names
    for t in fig.data:
        assert t.y[0] == pytest.approx(0) and t.y[-1] == pytest.approx(1)


def test_retained_bars_split_image_and_text():
    from prefixkv_core.events import MethodEvent
    from ui.charts import retained_bars

    ev = MethodEvent("prefixkv", "PrefixKV", "done", kept_per_layer=[50, 30], kept_image_per_layer=[40, 10],
                     full_len=100)
    fig = retained_bars({"prefixkv": ev})
    assert [t.name for t in fig.data] == ["PrefixKV · image", "PrefixKV · text"]
    assert list(fig.data[0].y) == [0.4, 0.1] and list(fig.data[1].y) == pytest.approx([0.1, 0.2])


def test_export_writes_every_format(tiny_llama, noise_image, tmp_path):
    from prefixkv_core import GenerationSettings
    from ui.app_builder import _outputs
    from ui.export import export_all, find_browser

    engine = Engine(tiny_llama)
    session = engine.new_session(noise_image, "describe it", ["full", "prefixkv"], 0.3,
                                 GenerationSettings(max_new_tokens=3))
    state = {"session": session, "events": {}, "trace": {}, "history": {}, "budget": 0.3}
    for ev in session.run():
        if hasattr(ev, "importance"):
            state["prefill"] = ev
        else:
            state["events"][ev.method] = ev
            state["trace"].setdefault(ev.method, []).append((ev.step, ev.kv_bytes, 0.01))
    figs = dict(zip(["bars", "lorenz", "memory", "latency"], _outputs(state, 0.3)[-4:]))
    archive, notes = export_all(state, {"lorenz": figs["lorenz"]}, tmp_path / "out", session.user_turns)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"results.json", "results.csv", "table.tex", "transcript.md", "lorenz.html"} <= names
    assert archive.exists() and r"\toprule" in (tmp_path / "out" / "table.tex").read_text()
    if find_browser():
        assert {"lorenz.png", "lorenz.svg", "lorenz.pdf"} <= names, notes
    else:
        assert any("no chromium" in n for n in notes)
