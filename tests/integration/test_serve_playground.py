"""The playground page at / in a real headless browser (Debian's chromium, driven by Playwright pointed at that
executable: no browser download): type a prompt, press Generate, the streamed text appears, each generated token
shaded by its probability. Skipped, saying why, where chromium or Playwright is absent (a fresh CI machine may
lack chromium: docs/testing.md). Keeps a screenshot at docs/img/serve_playground.png when FAIRSEQ_SCREENSHOT is
set (the docs' picture is made that way)."""

import os
import shutil

import pytest

from tests.integration.test_serve import ROOT, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install -y chromium)")
def test_playground_streams_shaded_tokens(tiny_lm_checkpoint, tiny_data):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    proc, url = start_server(tiny_lm_checkpoint, tiny_data)
    try:
        with sync_api.sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1000, "height": 640})
            page.goto(url + "/")
            page.fill("#prompt", "w1 w2 w3")
            page.fill("#max_tokens", "20")
            page.fill("#temperature", "1")
            page.fill("#seed", "2")
            page.click("#generate")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=30000)
            spans = page.query_selector_all("#output span")
            text = page.inner_text("#output")
            shaded = [
                s
                for s in spans
                if "background" in (s.get_attribute("style") or "")
                and (s.get_attribute("title") or "").startswith("log p")
            ]
            if os.environ.get("FAIRSEQ_SCREENSHOT"):
                page.screenshot(path=os.path.join(ROOT, "docs", "img", "serve_playground.png"))
            browser.close()
    finally:
        proc.kill()
        proc.wait()
    assert text.startswith("w1 w2 w3") and len(text) > len("w1 w2 w3")
    assert shaded, "no generated token was shaded by its probability"
