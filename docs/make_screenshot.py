"""Regenerate README's screenshot: the app on the embedded model, a rendered scene, every method at r = 0.1.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python docs/make_screenshot.py [--out assets/screenshot.png]

Starts `app.py` on a free local port, drives Debian's chromium through Playwright (upload, prompt, budget,
run), waits until every panel is done and saves a full-page PNG.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    from playwright.sync_api import expect, sync_playwright

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "assets" / "screenshot.png"))
    ap.add_argument("--image", default=str(ROOT / "assets" / "images" / "scene-2.png"))
    ap.add_argument("--prompt", default="Describe the image.")
    ap.add_argument("--budget", default="0.1")
    ap.add_argument("--max-new", default="48")
    args = ap.parse_args(argv)
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    app = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=ROOT, env=env)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            deadline = time.time() + 300
            while True:
                try:
                    page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
                    break
                except Exception:  # noqa: BLE001 - the server is still loading the model
                    if time.time() > deadline or app.poll() is not None:
                        raise
                    time.sleep(2)
            expect(page.locator("#run")).to_be_visible(timeout=120_000)
            page.locator("#image-input input[type=file]").set_input_files(args.image)
            expect(page.locator("#image-input img").first).to_be_visible(timeout=20_000)
            page.locator("#prompt textarea").fill(args.prompt)
            for field, value in (("#budget", args.budget), ("#max-new", args.max_new)):
                page.locator(f"{field} input[type=number]").fill(value)
                page.locator(f"{field} input[type=number]").press("Enter")
            page.locator("#run").click()
            expect(page.locator("#status-line")).to_contain_text("Done", timeout=600_000)
            page.wait_for_timeout(3000)  # the charts' last redraw
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        app.terminate()
        app.wait(timeout=30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
