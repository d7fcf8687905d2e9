"""The Gradio Blocks: two tabs. Compare: inputs, one streaming panel per method (3 per row), live charts, the
patch overlay, follow-up chat and export; Leaderboard: the stored results (leaderboard_tab.py). Both are wired to
the Controller.

    demo = build_app(Engine(build_tiny_model("llama")))        # tests: no model download
    demo.launch(**launch_kwargs("127.0.0.1", 7860))

`build_app` never loads a model itself unless it is given a factory (a callable returning an Engine).
Every input is checked before a handler sees it (inputs.py), request bodies are bounded (http_limits.py)
and the limits in prefixkv_core.limits apply; `limits` defaults to `server_limits(engine.loaded)`.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import gradio as gr

from prefixkv_core import Engine, describe, resolve_methods
from prefixkv_core.limits import MB, Limits, process_memory_bytes, server_limits
from prefixkv_core.models import EMBEDDED_SLUG
from prefixkv_core.policies import role_label
from prefixkv_core.report.leaderboard_store import LeaderboardStore

from .controller import ENGINE_QUEUE, BoxReaper, Controller, SessionBox
from .export import ALL_FORMATS
from .export_store import ExportStore
from .http_limits import BodySizeLimit, body_limit_for, upload_limit_for
from .inputs import DEFAULT_LIMITS, MAX_SEED, example_images, guard_input, guard_requests, knob_specs, upload_folder
from .leaderboard_tab import leaderboard_tab
from .panels import status_line
from .sessions import SessionRegistry
from .theme import css, gradio_theme
from .visual_panel import MULTI_ASSETS, PROMPT_INFO, VIDEO_ASSETS, visual_inputs, wire_visual_inputs

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets" / "images"
TITLE = "PrefixKV Lab · KV-cache compression, side by side"
FILE_CACHE = (600, 3600)  # every 10 minutes, delete uploads and outputs Gradio cached over an hour ago
QUEUE_SIZE = 64
DEFAULT_PROMPT = "Describe this image in detail."

HELP = """
**Panels.** Every method answers the same prompt from the same prefill, each on its own compressed KV
cache (FastV and VisionZip, prefill token reductions, run a prefill of their own). Under each name: where
the method saves memory (its stage) and when it compresses. All methods decode together, one batched
forward per token; that forward is shared, so it is shown once, in the line above the panels; each panel
shows what is the method's own: its KV-cache size (MB, and % of an uncompressed cache of the same length),
its policy's time per token (planning, merging, quantising) and its compression of the prompt, and, once
both answers are complete, ROUGE-L F1 against the Full answer. With **Time each method alone**, every
method is then decoded again on its own (its own prefill, the same settings; a follow-up from a copy of its
cache): the panel adds its time to first token, tokens/s and speed-up over Full, all measured alone. The
answers are the same either way.

**Retained KV entries per layer.** One small chart per method: bar height = entries kept in that layer /
entries an uncompressed cache would hold; the solid part is image tokens, the hatched part text tokens.
The dotted line is the budget r. Uniform methods give flat profiles; PyramidKV a staircase; PrefixKV a
profile shaped by each layer's importance distribution. ZipVL keeps every entry (quantised), so its bars
are full while its KV size is small.

**Importance retained vs tokens kept** (PrefixKV paper, Fig. 2). For one layer, sort the prompt tokens by
prefill attention importance; the curve gives the share of total importance (y) held by the top x share
of tokens. A curve near the diagonal means importance is spread out (Gini near 0); a curve that rises
steeply means a few tokens hold most of it (Gini near 1). The dashed vertical line keeps the same ratio r
in every layer (what uniform methods do): each layer then retains a different amount of importance (open
circles). PrefixKV instead keeps the same importance p in every layer (dashed horizontal line): each layer
gets its own ratio (diamonds), found by bisection so that the ratios average to r. Moving the budget
slider previews the threshold for the new budget.

**Kept image patches.** The image as the vision tower sees it, with each patch lit in proportion to the
share of KV heads that still hold it at the chosen layer (dark = evicted everywhere). VisionZip feeds the
language model fewer image tokens: its dominant patches are lit, the patches merged into its contextual
tokens half lit and hatched; Downsample's pooled tokens draw every patch they average half lit and hatched.
With several images, each is drawn with its own views, and a video's frames as a strip of small tiles; the
bar under each tile is filled to the share of that image's (that frame's) tokens held at the layer, and the
caption lists every share.

**KV-cache size while decoding / per-token latency.** Per generated token over all turns: cache
megabytes; and the latency: in the batched run the shared forward once, over each method's own policy time;
timed alone, one line per method (its forward + its policy), with the batched step dotted for reference.

**Answer quality vs KV-cache size.** Final KV share of uncompressed (x) against ROUGE-L to Full (y): up and
to the left is better.
"""


def _methods_help(methods: list[str]) -> str:
    rows = ["| Method | Stage | Compresses | How |", "|---|---|---|---|"]
    for d in describe():
        if d["name"] in methods:
            rows.append(f"| **{d['label']}** | {d['stage']} | {d['schedule']} | {d['summary']} |")
    return "\n".join(rows)


def _budget_info(described: list[dict[str, Any]]) -> str:
    """Which offered methods compress without the budget (they say how in their own summary and knobs)."""
    free = [d["label"] for d in described if not d["uses_budget"] and d["schedule"] != "none"]
    if not free:
        return "every offered method keeps this share"
    return f"not used by {', '.join(free)}: see their own knobs under Advanced"


def _equal_memory_info(described: list[dict[str, Any]]) -> str:
    """One line under the switch: which offered methods it changes."""
    grow = [d["label"] for d in described if d["uses_budget"] and d["schedule"] == "prompt only"]
    held = ", ".join(grow) if grow else "prompt-only methods"
    return (f"on: {held} are also held at r·N_t while decoding, so every budgeted method uses the same memory; "
            "off: each as published (they compress the prompt once, then the cache grows)")


FOLLOW_UP_INFO = ("text only: the methods keep the images and video of the comparison; images or a video "
                  "chosen since are not sent (press Compare to start over with them)")
QUERY_AGNOSTIC_INFO = ("on: the image is compressed before the question is read, then the question is fed and "
                      "answered on the compressed cache, as in a chat about one image; off: compressed with the "
                      "question in view (favours query-aware methods such as SnapKV)")


def build_app(engine_or_factory: Engine | Callable[[], Engine], *, methods: Any = "all",
              default_methods: Any = None, max_new_tokens_limit: int = 256, examples_dir: Path | str | None = None,
              title: str = TITLE, limits: Limits | None = None, queue_size: int = QUEUE_SIZE,
              leaderboard: LeaderboardStore | None = None) -> gr.Blocks:
    """Blocks for one loaded model. `methods` are the methods offered (registry order), all selected unless
    `default_methods` says otherwise. Up to `limits.max_batch_users` engine requests run at once (their
    methods decoded in one batch); at most `queue_size` more wait in line. `leaderboard`: the stored results the Leaderboard tab shows (default: the repository's
    `benchmarks/leaderboard/`, read once here). The engine may be an `Engine` or an `EngineProcess` (the model in a
    process of its own; its `memory_bytes()` then counts both processes against the memory ceiling)."""
    engine = engine_or_factory if hasattr(engine_or_factory, "new_session") else engine_or_factory()
    limits = limits or server_limits(engine.loaded)
    offered = resolve_methods(methods)
    chosen = [m for m in (resolve_methods(default_methods) if default_methods else offered) if m in offered]
    limit = max(1, int(max_new_tokens_limit))
    described = [d for d in describe() if d["name"] in offered]
    specs = knob_specs(described, offered)
    examples_folder = Path(examples_dir) if examples_dir else ASSETS
    registry = SessionRegistry(limits, memory=getattr(engine, "memory_bytes", process_memory_bytes))
    ctl = Controller(engine, offered, limit, specs, limits=limits, registry=registry,
                     exports=ExportStore(),
                     image_roots=lambda: [upload_folder(), str(examples_folder), str(MULTI_ASSETS), str(VIDEO_ASSETS)],
                     leaderboard=leaderboard)
    examples = example_images(examples_folder, scenes_first=engine.loaded.slug == EMBEDDED_SLUG)

    with gr.Blocks(title=title, analytics_enabled=False, delete_cache=FILE_CACHE) as demo:
        gr.Markdown(f"## {title}")
        gr.Markdown(ctl.banner(), elem_id="banner")
        page = SimpleNamespace()
        # a plain instance, deep-copied for every session (a callable default would add a public load endpoint);
        # when gradio deletes a closed session's state, whatever it still holds goes too
        page.box = gr.State(SessionBox(overlay_layer=ctl.num_layers // 2), delete_callback=BoxReaper(ctl))
        with gr.Tabs(elem_id="tabs"):
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                _request_inputs(page, ctl, limits, described, specs, chosen, limit, examples)
                _method_panels(page, ctl, limits, chosen)
                _charts(page, ctl)
                _export_and_help(page, offered)
            with gr.Tab("Leaderboard", id="leaderboard", elem_id="tab-leaderboard"):
                page.leaderboard = leaderboard_tab(ctl)
        _wire_events(page, ctl)
        demo.unload(ctl.disconnected)  # a closed tab or client: its caches and exports go at once

    guard_requests(demo)
    demo.queue(default_concurrency_limit=1, max_size=max(1, int(queue_size)))
    demo.controller = ctl  # for tests and app.py
    demo.limits = limits
    ctl.blocks = demo
    return demo


def _request_inputs(page: SimpleNamespace, ctl: Controller, limits: Limits, described: list[dict[str, Any]],
                    specs: list, chosen: list[str], limit: int, examples: list) -> None:
    """The top row: the image, the prompt, the methods, the budget and switches, sampling, each method's knobs
    and the Compare / Stop / Clear buttons."""
    page.prompt = gr.Textbox(label="Prompt", value=DEFAULT_PROMPT, lines=3, max_lines=8, info=PROMPT_INFO,
                             max_length=limits.max_prompt_chars, elem_id="prompt", render=False)
    with gr.Row(equal_height=False):
        with gr.Column(scale=4, min_width=300):
            visual_inputs(page, limits, ctl.image_roots, examples)
        with gr.Column(scale=5, min_width=340):
            page.prompt.render()
            page.method_box = gr.CheckboxGroup(choices=[(ctl.labels[m], m) for m in ctl.methods], value=chosen,
                                               label="Methods", elem_id="methods")
            page.budget = gr.Slider(0.05, 1.0, value=0.3, step=0.05, elem_id="budget",
                                    label="KV budget r: kept share of the cache, applied to every method",
                                    info=_budget_info(described))
            page.equal_memory = gr.Checkbox(False, label="Equal memory", elem_id="equal-memory",
                                            info=_equal_memory_info(described))
            page.query_agnostic = gr.Checkbox(False, label="Query-agnostic", elem_id="query-agnostic",
                                              info=QUERY_AGNOSTIC_INFO)
            page.time_alone = gr.Checkbox(False, label="Time each method alone", elem_id="time-alone",
                                          info="after the batched run, decode every method again on its own: its "
                                               "own TTFT, tokens/s, latency curve and speed-up over "
                                               f"{role_label('reference', 'the reference')}")
            page.max_new = gr.Slider(1, limit, value=min(48, limit), step=1, label="Max new tokens",
                                     elem_id="max-new")
            with gr.Accordion("Sampling", open=False):
                with gr.Row():
                    page.do_sample = gr.Checkbox(False, label="Sample (greedy when off)")
                    page.seed = gr.Number(0, precision=0, label="Seed", minimum=0, maximum=MAX_SEED,
                                        info="for sampling, and for the methods that draw at random")
                with gr.Row():
                    page.temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
                    page.top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
            page.knob_widgets = _knob_widgets(described, specs)
            with gr.Row():
                page.run_btn = gr.Button("Compare", variant="primary", elem_id="run")
                page.stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                page.clear_btn = gr.Button("Clear", elem_id="clear")


def _knob_widgets(described: list[dict[str, Any]], specs: list) -> dict[str, gr.components.Component]:
    """The Advanced accordion: one titled row of widgets per method that has knobs."""
    widgets: dict[str, gr.components.Component] = {}
    with gr.Accordion("Advanced: per-method knobs", open=False):
        for d in described:
            mine = [s for s in specs if s.method == d["name"]]
            if not mine:
                continue
            gr.Markdown(f"**{d['label']}**", elem_classes=["knob-title"])
            with gr.Row():
                for spec in mine:
                    widgets[spec.key] = spec.widget()
    return widgets


def _method_panels(page: SimpleNamespace, ctl: Controller, limits: Limits, chosen: list[str]) -> None:
    """The status line, one panel per method (its header and its conversation) and the follow-up box."""
    page.status = gr.Markdown(status_line(None), elem_id="status-line")
    page.heads, page.chats, page.cols = {}, {}, []
    with gr.Row(elem_id="panels", elem_classes=["panel-grid"]):
        for m in ctl.methods:
            with gr.Column(visible=m in chosen, elem_id=f"panel-{m}", min_width=260,
                           elem_classes=["method-panel", f"m-{m}"]) as col:
                page.heads[m] = gr.HTML(ctl.head(m, None), elem_id=f"head-{m}")
                page.chats[m] = gr.Chatbot(height=240, show_label=False, elem_id=f"chat-{m}", buttons=["copy"],
                                           feedback_options=None, placeholder="…", autoscroll=True)
            page.cols.append(col)
    with gr.Row(equal_height=True):
        page.followup = gr.Textbox(label="Follow-up question: every method continues on its own compressed cache",
                                   scale=5, max_length=limits.max_prompt_chars, elem_id="followup",
                                   placeholder="e.g. What colours stand out?", info=FOLLOW_UP_INFO)
        page.ask_btn = gr.Button("Ask every method", scale=1, elem_id="ask")


def _charts(page: SimpleNamespace, ctl: Controller) -> None:
    """The charts, the kept-patch overlay with its layer slider, and the metrics table."""
    n_layers = ctl.num_layers
    page.bars_plot = gr.Plot(ctl.bars(None), show_label=False, elem_id="chart-bars")
    empty = ctl.figures(None, SessionBox())
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            page.lorenz_plot = gr.Plot(empty["lorenz"], show_label=False, elem_id="chart-lorenz")
            page.lorenz_layers = gr.Dropdown(choices=list(range(n_layers)), multiselect=True,
                                             value=_default_layers(n_layers), label="Layers shown",
                                             elem_id="lorenz-layers")
        with gr.Column(scale=2):
            page.quality_plot = gr.Plot(empty["quality-vs-memory"], show_label=False, elem_id="chart-quality")
    page.gallery = gr.Gallery(label="Kept image patches at one layer (bright = kept by every KV head, "
                                    "dark = evicted)", columns=min(5, len(ctl.methods)), height="auto",
                              object_fit="contain", elem_id="overlay", buttons=["download", "fullscreen"],
                              allow_preview=True, format="jpeg")  # 0.5 ms an image to encode; WebP 15
    page.overlay_layer = gr.Slider(0, max(n_layers - 1, 0), value=n_layers // 2, step=1,
                                   label="Layer of the overlay", elem_id="overlay-layer")
    with gr.Row(equal_height=False):
        page.memory_plot = gr.Plot(empty["kv-memory"], show_label=False, elem_id="chart-memory")
        page.latency_plot = gr.Plot(empty["latency"], show_label=False, elem_id="chart-latency")
    page.table = gr.Dataframe(headers=list(_table_headers()), value=[],
                              label="Metrics (last turn): policy = the method's own time in the run; TTFT, tok/s "
                                    f"and × {role_label('reference', 'reference')} = the method decoded alone "
                                    "(Time each method alone)",
                              interactive=False, wrap=True, elem_id="metrics-table")


def _export_and_help(page: SimpleNamespace, offered: list[str]) -> None:
    """Export for papers, the raw results and the reading guide."""
    with gr.Accordion("Export for papers", open=True):
        with gr.Row(equal_height=True):
            page.formats = gr.CheckboxGroup([("PNG ×3", "png"), ("SVG", "svg"), ("PDF", "pdf"), ("HTML", "html")],
                                            value=list(ALL_FORMATS), label="Figure formats", scale=3,
                                            elem_id="export-formats")
            page.export_btn = gr.Button("Export figures, tables and transcript", scale=2, elem_id="export")
        page.export_msg = gr.Markdown(elem_id="export-msg")
        page.export_files = gr.File(label="Exported files (zip first)", file_count="multiple", interactive=False,
                                    visible=False, elem_id="export-files")
    with gr.Accordion("Raw results (JSON, as the API returns them)", open=False):
        page.results = gr.JSON(elem_id="results")
    with gr.Accordion("How to read the panels and charts", open=False):
        gr.Markdown(HELP)
        gr.Markdown(_methods_help(offered))


def _wire_events(page: SimpleNamespace, ctl: Controller) -> None:
    """Every event, its inputs checked under the name the API gives them; Compare and follow-ups share one
    queue that runs one at a time."""
    p = page
    outputs = [p.status, *p.heads.values(), *p.chats.values(), p.bars_plot, p.lorenz_plot, p.memory_plot,
               p.latency_plot, p.quality_plot, p.gallery, p.table, p.results, p.box]
    assert len(outputs) == len(ctl.output_keys)
    compare_inputs = [p.image, p.prompt, p.method_box, p.budget, p.max_new, p.do_sample, p.temperature, p.top_p,
                      p.seed, p.box]
    wire_visual_inputs(p)
    for field, component in [("prompt", p.prompt), ("methods", p.method_box), ("budget", p.budget),
                             ("max_new_tokens", p.max_new), ("do_sample", p.do_sample),
                             ("temperature", p.temperature), ("top_p", p.top_p), ("seed", p.seed),
                             ("question", p.followup), ("formats", p.formats), ("layer", p.overlay_layer),
                             ("layers", p.lorenz_layers), ("equal_memory", p.equal_memory),
                             ("query_agnostic", p.query_agnostic), ("time_alone", p.time_alone),
                             ("frames", p.frames), *p.knob_widgets.items()]:
        guard_input(component, field)
    engine_queue = dict(concurrency_id=ENGINE_QUEUE, concurrency_limit=ctl.limits.max_batch_users,
                        show_progress="minimal",
                        show_progress_on=[p.status])

    p.method_box.change(ctl.visibility, [p.method_box], p.cols, queue=False, api_visibility="private")
    run_events = []
    for trigger in (p.run_btn.click, p.prompt.submit):
        run_events.append(
            trigger(ctl.prepare, [p.box], [p.status, p.box], queue=False, api_visibility="private")
            .then(ctl.compare, compare_inputs, outputs,
                  inputs_kwargs={"equal_memory": p.equal_memory, "query_agnostic": p.query_agnostic,
                                 "time_alone": p.time_alone, "images": p.images, "video": p.video,
                                 "frames": p.frames, **p.knob_widgets},
                  api_name="compare" if not run_events else False, **engine_queue))
    ask_events = []
    for trigger in (p.ask_btn.click, p.followup.submit):
        ev = (trigger(ctl.prepare, [p.box], [p.status, p.box], queue=False, api_visibility="private")
              .then(ctl.follow_up, [p.followup, p.box], outputs, api_name="follow_up" if not ask_events else False,
                    **engine_queue))
        ev.success(lambda: "", None, p.followup, queue=False, api_visibility="private")
        ask_events.append(ev)
    p.stop_btn.click(ctl.stop, [p.box], [p.status], queue=False, api_name="stop")
    p.clear_btn.click(ctl.clear, [p.box], [*outputs, p.followup, p.export_files, p.export_msg],
                      cancels=[*run_events, *ask_events], concurrency_limit=None, api_name="clear")
    p.overlay_layer.release(ctl.set_overlay_layer, [p.overlay_layer, p.box], [p.gallery], concurrency_limit=None,
                            api_visibility="private")
    p.lorenz_layers.input(ctl.set_lorenz_layers, [p.lorenz_layers, p.box], [p.lorenz_plot], concurrency_limit=None,
                          api_visibility="private")
    p.budget.release(ctl.set_view_budget, [p.budget, p.box], [p.lorenz_plot], concurrency_limit=None,
                     api_visibility="private")
    p.export_btn.click(ctl.export, [p.formats, p.box], [p.export_files, p.export_msg], concurrency_id="export",
                       concurrency_limit=1, api_name="export")


def _default_layers(n: int) -> list[int]:
    from .charts import default_layers

    return default_layers(n)


def _table_headers() -> list[str]:
    from .controller import table_headers

    return table_headers()


def launch_kwargs(host: str = "127.0.0.1", port: int = 7860, *, limits: Limits = DEFAULT_LIMITS,
                  **extra: Any) -> dict[str, Any]:
    """The launch settings the app always uses: no share link, offline-safe theme, uploads up to the larger of
    the image and video limits (each input then holds its files to its own), and every request body bounded (an
    image sent inside an API call as a data URL included; the upload route: a video or a selection of images)."""
    from starlette.middleware import Middleware

    size = max(limits.max_image_bytes, limits.max_video_bytes)
    bodies = Middleware(BodySizeLimit, max_bytes=body_limit_for(limits.max_image_bytes),
                        upload_max_bytes=upload_limit_for(limits.max_image_bytes, limits.max_video_bytes))
    kwargs = dict(server_name=host, server_port=port, share=False,
                  max_file_size=f"{size // MB}mb" if size % MB == 0 else size,
                  theme=gradio_theme(), css=css(), ssr_mode=False, show_error=False, allowed_paths=[str(ASSETS)],
                  app_kwargs={"middleware": [bodies]})
    kwargs.update(extra)
    return kwargs


# The interpreter's switch interval in the app's process. The model's thread takes the GIL back after every
# operator, and with gradio's threads busy it waits up to this long for it each time: at the default 5 ms, four
# visitors at once on the embedded model waited 4-9 % longer (benchmarks/reports/2026-11-26-app-visitors-rounds.md).
SWITCH_INTERVAL_S = 0.001


def hand_the_interpreter_back_sooner() -> None:
    """Set the process's switch interval for serving (SWITCH_INTERVAL_S); the app's launchers call it."""
    import sys

    sys.setswitchinterval(SWITCH_INTERVAL_S)


def free_loopback_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the system's choice)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_locally(engine: Engine, **build: Any) -> tuple[gr.Blocks, str]:
    """`build_app(engine, **build)` launched on a free loopback port without blocking (the tests, the benchmarks
    that drive the app and the screenshot script run it so); returns (the app, its URL). Close it with .close()."""
    port = free_loopback_port()
    demo = build_app(engine, **build)
    hand_the_interpreter_back_sooner()
    demo.launch(**launch_kwargs("127.0.0.1", port, limits=demo.limits, prevent_thread_lock=True, quiet=True))
    return demo, f"http://127.0.0.1:{port}/"

