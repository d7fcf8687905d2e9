"""A real browser (Debian's chromium via Playwright) drives the app on a tiny model."""
import os
import socket
from pathlib import Path

import pytest

from prefixkv_core import Engine

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed")]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_browser_compare_slider_export_and_error(tiny_llama, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from ui.app_builder import ASSETS, build_app
    from ui.theme import gradio_theme

    demo = build_app(Engine(tiny_llama), max_new_tokens_limit=8, default_methods=["full", "local", "prefixkv"])
    demo.queue(default_concurrency_limit=1)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                theme=gradio_theme())
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
            page.wait_for_selector("input[type=file]", state="attached", timeout=60000)
            page.set_input_files("input[type=file]", str(sorted(ASSETS.glob("scene-*.png"))[0]))
            page.wait_for_timeout(1000)
            page.get_by_role("button", name="Compare", exact=True).click()
            for name in ("full", "local", "prefixkv"):
                expect(page.locator(f"#panel-{name}")).to_contain_text("of full", timeout=60000)
            expect(page.locator("#panel-prefixkv")).to_contain_text("ROUGE-L", timeout=60000)
            expect(page.locator("#panel-h2o")).to_contain_text("not selected")
            expect(page.locator(".js-plotly-plot")).to_have_count(4, timeout=60000)
            # the budget slider moves and a new run uses it
            slider = page.locator("input[type=range]").first
            slider.fill("0.5")
            expect(slider).to_have_value("0.5")
            # export
            page.get_by_role("button", name="Export for papers", exact=False).click()
            expect(page.get_by_text("results.json").first).to_be_visible(timeout=90000)
            # bad input: an empty prompt gives a message, not a traceback
            page.get_by_label("Prompt").fill("   ")
            page.get_by_role("button", name="Compare", exact=True).click()
            expect(page.get_by_text("the prompt is empty").first).to_be_visible(timeout=30000)
            assert "Traceback" not in page.content()
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            browser.close()
    finally:
        demo.close()
