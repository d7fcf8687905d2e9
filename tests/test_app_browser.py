"""A real browser (Debian's chromium through Playwright) drives the app on a tiny model in a process of its own (as
app.py serves it): upload an example image, run three methods, wait for every panel and chart, move the budget
slider, export a figure, and trigger a bad-input message."""
import os
from pathlib import Path

import pytest

from prefixkv_core import EngineProcess

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                 reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")]
ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--no-first-run"]
METHODS = ["full", "h2o", "prefixkv"]


@pytest.fixture(scope="module")
def url(serve_app):
    """The app as app.py serves it by default: the model in a process of its own."""
    engine = EngineProcess("tiny-llama", threads=1)
    yield serve_app(engine, default_methods=METHODS, max_new_tokens_limit=16)
    engine.close()


def test_browser_run_charts_slider_export_and_error(url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from ui.app_builder import ASSETS

    example = sorted(ASSETS.glob("*.jpg"))[0]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        try:
            page.goto(url, wait_until="domcontentloaded")
            expect(page.locator("#run")).to_be_visible(timeout=60_000)
            expect(page.locator("#banner")).to_contain_text("tiny-llama")
            page.locator("#image-input input[type=file]").set_input_files(str(example))
            expect(page.locator("#image-input img").first).to_be_visible(timeout=20_000)
            page.locator("#max-new input[type=number]").fill("8")
            page.locator("#max-new input[type=number]").press("Enter")
            for m in ("local", "snapkv"):
                expect(page.locator(f"#panel-{m}")).to_be_hidden()

            page.locator("#run").click()
            expect(page.locator("#status-line")).to_contain_text("Done", timeout=90_000)
            for m in METHODS:
                panel = page.locator(f"#panel-{m}")
                expect(panel).to_contain_text("done")
                expect(panel).to_contain_text("of full")
                expect(panel.locator("[data-testid='bot']").first).to_be_visible()
            expect(page.locator("#panel-prefixkv")).to_contain_text("ROUGE-L")
            for chart in ("bars", "lorenz", "memory", "latency", "quality"):
                plot = page.locator(f"#chart-{chart} .js-plotly-plot")
                expect(plot).to_have_count(1, timeout=30_000)
                assert plot.locator(".trace").count() > 0, chart
            expect(page.locator("#chart-bars")).to_contain_text("PrefixKV")
            expect(page.locator("#chart-lorenz")).to_contain_text("Gini")
            gallery = page.locator("#overlay")
            gallery.scroll_into_view_if_needed()
            expect(gallery.locator("img")).to_have_count(3, timeout=30_000)

            # the budget slider: a new position moves the Lorenz chart's lines (a preview of PrefixKV)
            slider = page.locator("#budget input[type=range]")
            slider.scroll_into_view_if_needed()
            box = slider.bounding_box()
            page.mouse.click(box["x"] + box["width"] * 0.63, box["y"] + box["height"] / 2)
            expect(page.locator("#budget input[type=number]")).not_to_have_value("0.3")
            expect(page.locator("#chart-lorenz")).to_contain_text("preview", timeout=30_000)

            # export: PNG (and the always-cheap tables) only, to keep the test short
            formats = page.locator("#export-formats")
            for label in ("SVG", "PDF", "HTML"):
                formats.get_by_label(label).uncheck()
            page.locator("#export").click()
            files = page.locator("#export-files")
            for name in ("retained-per-layer.png", "lorenz.png", "table.tex", "results.csv"):
                expect(files.locator(f"a[href$='/{name}']")).to_have_count(1, timeout=180_000)
            expect(files.locator("a[href$='.zip']")).to_have_count(1)

            # bad input: an empty prompt gives a message, never a traceback
            page.locator("#prompt textarea").fill("")
            page.locator("#run").click()
            expect(page.get_by_text("the prompt is empty").first).to_be_visible(timeout=30_000)
            assert "Traceback" not in page.content()

            shot = Path(tmp_path) / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 50_000
        finally:
            browser.close()


def test_browser_several_images_and_a_video(url):
    """The video input and the gallery are on the page; the clip example shows the Frames slider; the image-set
    example fills the gallery, and a comparison over it draws every image in the overlay."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        try:
            page.goto(url, wait_until="domcontentloaded")
            expect(page.locator("#video-input")).to_be_visible(timeout=60_000)
            expect(page.locator("#images-input")).to_be_visible()
            expect(page.locator("#frames")).to_be_hidden()
            sets = page.get_by_text("Several images · a video clip").locator("xpath=..")
            sets.scroll_into_view_if_needed()
            sets.locator("tbody tr, .gallery-item, button").last.click()  # the clip
            expect(page.locator("#frames")).to_be_visible(timeout=20_000)
            expect(page.locator("#prompt textarea")).to_have_value("What shape appears last?")
            sets.locator("tbody tr, .gallery-item, button").first.click()  # the image set
            expect(page.locator("#images-input img")).to_have_count(4, timeout=20_000)
            expect(page.locator("#frames")).to_be_hidden(timeout=20_000)
            page.locator("#max-new input[type=number]").fill("3")
            page.locator("#max-new input[type=number]").press("Enter")
            page.locator("#run").click()
            expect(page.locator("#status-line")).to_contain_text("Done", timeout=90_000)
            gallery = page.locator("#overlay")
            gallery.scroll_into_view_if_needed()
            expect(gallery.locator("img")).to_have_count(3, timeout=30_000)
            expect(gallery).to_contain_text("image 4")
            assert "Traceback" not in page.content()
        finally:
            browser.close()
