"""The Leaderboard tab's layout and events (app_builder.py calls it inside the page's gr.Tabs): the filters, the
figure, the table and the downloads, wired to the Controller's leaderboard handlers (its LeaderboardView). The events are API endpoints named
`leaderboard` and `leaderboard_export`; every input is checked under the name the API gives it."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from .export import find_browser
from .inputs import guard_input
from .leaderboard_view import FIGURE_FORMATS, TABLE_HEADERS, TABLE_WIDTHS

INTRO = """
**Stored results** of the compression methods in [kvpress's leaderboard layout](https://huggingface.co/spaces/nvidia/kvpress-leaderboard),
read from the repository's `benchmarks/leaderboard/` (written by `python -m benchmarks.vision_accuracy --leaderboard`
and `python -m prefixkv_core.evaluation.sweep`). x is the share of Full's KV cache each row really held, measured
from the tensors where the run recorded it (an `[image]` row, r of the image tokens kept, holds more than r of the
cache), else the budget r (1 − compression_ratio); 100% for Full. y is the accuracy (each task's metric × 100) or
the agreement with Full (the share of answers equal to the uncompressed model's, right or wrong). Random and Random
drop are the controls: their rows are the mean over their draws. Hover a point for the command, commit and model
that produced it. **The embedded model sees synthetic scenes only**: its rows are on the project's own scene tasks
(`scene_qa`: colours, shapes, counts, positions, words, yes/no about rendered scenes; `scene_multi` and
`scene_video`: several scenes and clips of moving shapes), not on a public benchmark.
"""


def leaderboard_tab(ctl) -> SimpleNamespace:
    """The tab's widgets (built inside the caller's gr.Tab) and their events, wired to the Controller `ctl`;
    returns the widgets."""
    choices, d = ctl.leaderboard.choices(), ctl.leaderboard.defaults()
    figure, rows, note = ctl.show_leaderboard()
    t = SimpleNamespace()
    gr.Markdown(INTRO, elem_id="leaderboard-intro")
    with gr.Row():
        t.task = gr.Dropdown(choices["task"], value=d.task, label="Task", elem_id="lb-task")
        t.model = gr.Dropdown(choices["model"], value=d.model, label="Model", elem_id="lb-model")
        t.query_mode = gr.Radio(choices["query_mode"], value=d.query_mode, label="Query mode", elem_id="lb-query")
        t.budget_mode = gr.Radio(choices["budget_mode"], value=d.budget_mode, label="Budget mode",
                                 elem_id="lb-budget")
        t.metric = gr.Radio(choices["metric"], value=d.metric, label="Metric", elem_id="lb-metric")
    t.plot = gr.Plot(figure, show_label=False, elem_id="lb-chart")
    t.note = gr.Markdown(note, elem_id="lb-note")
    t.table = gr.Dataframe(headers=TABLE_HEADERS, value=rows, label="Rows shown", interactive=False, wrap=True,
                           column_widths=TABLE_WIDTHS, elem_id="lb-table")
    with gr.Accordion("Download: CSV, JSON and the figure for papers", open=False):
        with gr.Row(equal_height=True):
            t.formats = gr.CheckboxGroup([("PNG ×3", "png"), ("PDF", "pdf")], value=list(FIGURE_FORMATS),
                                         label="Figure formats", scale=3, elem_id="lb-formats")
            t.export_btn = gr.Button("Download these rows", scale=2, elem_id="lb-export")
        t.export_msg = gr.Markdown("" if find_browser() else "*No Chromium or Chrome on this server: downloads "
                                   "carry the CSV and JSON, not the PNG/PDF figure.*", elem_id="lb-export-msg")
        t.files = gr.File(label="Downloads", file_count="multiple", interactive=False, visible=False,
                          elem_id="lb-files")
    _wire(t, ctl)
    return t


def _wire(t: SimpleNamespace, ctl) -> None:
    filters = [t.task, t.model, t.query_mode, t.budget_mode, t.metric]
    for field, component in [("task", t.task), ("model", t.model), ("query_mode", t.query_mode),
                             ("budget_mode", t.budget_mode), ("metric", t.metric), ("figure_formats", t.formats)]:
        guard_input(component, field)
    for i, component in enumerate(filters):
        component.input(ctl.show_leaderboard, filters, [t.plot, t.table, t.note], concurrency_limit=None,
                        api_name="leaderboard" if i == 0 else False)
    t.export_btn.click(ctl.export_leaderboard, [*filters, t.formats], [t.files, t.export_msg], concurrency_id="leaderboard-export",
                       concurrency_limit=1, api_name="leaderboard_export")
