"""The ring page in a real browser: Debian's chromium driven by playwright against a Streamlit
server started here. Press "Run live", wait for the chart the run produced, move the animation's
step slider and check that what is drawn changes to the decoded state of that step."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _require_chromium():
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        msg = f"chromium not installed: {CHROMIUM} is missing (make chromium, or apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    _require_chromium()
    port = _free_port()
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    streamlit = shutil.which("streamlit", path=str(Path(sys.executable).parent)) or "streamlit"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [streamlit, "run", "app/streamlit_app.py", "--server.address", "127.0.0.1",
             "--server.port", str(port), "--server.headless", "true",
             "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: the ranks' forkserver goes with it
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 45
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _svg_texts(chart) -> list[str]:
    return chart.locator("svg text").all_text_contents()


def test_ring_page_runs_live_and_the_animation_moves(app_url):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{app_url}/ring")
            page.get_by_role("button", name="Run live").click(timeout=30_000)

            # the animation: the first chart on the page, drawn once the run returned
            chart = page.locator('[data-testid="stVegaLiteChart"]').first
            start_caption = chart.locator("svg text", has_text="step 0 of 6")
            start_caption.wait_for(timeout=60_000)
            expect(page.get_by_text("Bytes sent by each rank: measured")).to_be_visible()
            slider = chart.locator('input[type="range"]')
            expect(slider).to_have_attribute("max", "6")  # 2(N-1) steps for the default N = 4
            cells = chart.locator('path[aria-roledescription="rect mark"]')
            expect(cells.first).to_be_visible()
            chart.scroll_into_view_if_needed()
            before_png = chart.screenshot()
            before_texts = _svg_texts(chart)
            assert "all 4" not in before_texts  # at the start each rank holds only its own data

            slider.fill("6")  # the last step: the all-reduce is complete
            chart.locator("svg text", has_text="step 6 of 6").wait_for(timeout=10_000)
            after_texts = _svg_texts(chart)
            # every rank x chunk now holds all 4 ranks' data (decoded from the run's messages)
            assert sum(t.startswith("all 4") for t in after_texts) == 16, after_texts
            assert after_texts != before_texts
            assert chart.screenshot() != before_png

            slider.fill("2")  # mid reduce-scatter: partial sums, three ranks' data at most
            chart.locator("svg text", has_text="step 2 of 6").wait_for(timeout=10_000)
            mid = _svg_texts(chart)
            assert not any(t.startswith("all 4") for t in mid)
            assert any(t.count("+") == 2 for t in mid), mid  # e.g. "0+2+3"
        finally:
            browser.close()
