"""The README's pictures, made again from the running app: launches the app in this process on the embedded
model, drives it with Playwright in Debian's chromium, runs one comparison and saves cropped PNGs into assets/.

    HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False .venv/bin/python docs/screenshots.py

One comparison: scene-2 of assets/images, "Describe the image.", six methods at r = 0.1. Writes
assets/screenshot-compare.png (the status line and the method panels), assets/screenshot-charts.png (the
retained-per-layer bars, the Lorenz curves and answer quality vs KV size of the same run)
and assets/screenshot-leaderboard.png (the Leaderboard tab: filters and figure). Rerun it when the UI changes. Needs
/usr/bin/chromium (`apt-get install chromium`, as `make test` does) and the venv's playwright package; takes a
few minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--no-first-run"]
METHODS = ["full", "snapkv", "pyramidkv", "prefixkv", "fastv", "visionzip"]
IMAGE = ROOT / "assets" / "images" / "scene-2.png"
PROMPT = "Describe the image."
BUDGET = "0.1"
VIEWPORT = 1100  # Gradio's page column is then about 1000 px wide: the README's column, read at its own size


def serve(model: str) -> tuple[object, str]:
    """Launch the app on a free loopback port in this process, as the tests do."""
    from prefixkv_core import Engine, load_model
    from ui.app_builder import serve_locally

    return serve_locally(Engine(load_model(model)), default_methods=METHODS, max_new_tokens_limit=64)


def save(png: bytes, path: Path, colours: int = 256) -> None:
    """A palette PNG: screenshots of flat UI colours lose nothing visible and shrink several times."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
    print(f"{path}: {image.width}x{image.height}, {path.stat().st_size // 1024} KB")


def box_around(page, first: str, *last: str) -> dict:
    """The page-coordinate rectangle from the top of `first` to the lowest bottom of the `last` elements, as wide
    as the page's column (the tab's content)."""
    top = page.locator(first).first.bounding_box()
    bottom = max((page.locator(sel).first.bounding_box() for sel in last), key=lambda b: b["y"] + b["height"])
    column = page.locator("#tabs").first.bounding_box()
    scroll = page.evaluate("window.scrollY")
    y0, y1 = max(0, top["y"] + scroll - 8), bottom["y"] + bottom["height"] + scroll + 8
    x0 = max(0, column["x"] - 8)
    return {"x": x0, "y": y0, "width": min(VIEWPORT - x0, column["width"] + 16), "height": y1 - y0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="the model the app loads (default: embedded)")
    p.add_argument("--max-new", type=int, default=32, help="max new tokens of the comparison (default 32)")
    p.add_argument("--out", default=str(ROOT / "assets"), help="folder for the PNGs (default assets/)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from playwright.sync_api import expect, sync_playwright

    demo, url = serve(args.model)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": VIEWPORT, "height": 900})
            page.goto(url, wait_until="domcontentloaded")
            expect(page.locator("#run")).to_be_visible(timeout=120_000)
            page.locator("#image-input input[type=file]").set_input_files(str(IMAGE))
            expect(page.locator("#image-input img").first).to_be_visible(timeout=30_000)
            page.locator("#prompt textarea").fill(PROMPT)
            for field, value in (("#budget", BUDGET), ("#max-new", str(args.max_new))):
                page.locator(f"{field} input[type=number]").fill(value)
                page.locator(f"{field} input[type=number]").press("Enter")
            page.locator("#run").click()
            expect(page.locator("#status-line")).to_contain_text("Done", timeout=600_000)
            for chart in ("bars", "lorenz", "memory", "latency", "quality"):
                expect(page.locator(f"#chart-{chart} .js-plotly-plot")).to_have_count(1, timeout=60_000)
            expect(page.locator("#overlay img")).to_have_count(len(METHODS), timeout=60_000)
            page.wait_for_timeout(2_000)  # the last redraw of the charts

            page.screenshot(path=None, full_page=True)  # lays the whole page out once before measuring it
            shot = page.screenshot(full_page=True, clip=box_around(page, "#status-line", "#panels"))
            save(shot, out / "screenshot-compare.png")
            shot = page.screenshot(full_page=True, clip=box_around(page, "#chart-bars", "#chart-lorenz", "#chart-quality"))
            save(shot, out / "screenshot-charts.png")

            page.evaluate("window.scrollTo(0, 0)")
            page.locator("#tab-leaderboard-button").click()
            expect(page.locator("#lb-chart .js-plotly-plot")).to_have_count(1, timeout=60_000)
            page.wait_for_timeout(2_000)
            shot = page.screenshot(full_page=True, clip=box_around(page, "#leaderboard-intro", "#lb-chart"))
            save(shot, out / "screenshot-leaderboard.png")
            browser.close()
    finally:
        demo.close()


if __name__ == "__main__":
    main()
