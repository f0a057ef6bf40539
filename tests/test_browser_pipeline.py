"""The pipeline page in a real browser (Debian's chromium via playwright, server from test_browser):
the planned schedules are drawn before any run; "Run live" draws each rank's step measured on the
wall clock as a Gantt chart (SVG, one lane per rank, F and B bars), the bubble measured, replayed
and by the formula, and switching to the replay (measured op times, own-device schedule) redraws
the timelines. A full-page screenshot is left in /tmp/pipeline_page.png for a look at the labels,
legends and axis titles."""
from __future__ import annotations

import re

import pytest

from test_browser import CHROMIUM, CHROMIUM_ARGS, app_url  # noqa: F401  (app_url: the fixture)

pytestmark = pytest.mark.browser
SCREENSHOT = "/tmp/pipeline_page.png"


def test_pipeline_page_runs_live_and_draws_the_timelines(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(f"{app_url}/pipeline")
            charts = page.locator('[data-testid="stVegaLiteChart"]')
            # before any run: the two schedules as planned, unit costs, with the formula
            planned = charts.filter(has=page.locator("svg text", has_text="Planned: gpipe"))
            planned.wait_for(timeout=30_000)
            assert "time from the step's start (time units (one forward = 1))" in \
                planned.locator("svg text").all_text_contents()
            formula = page.locator('[data-testid="stMetric"]').filter(
                has_text="Bubble (theory): gpipe")
            expect(formula).to_contain_text("27.3%")  # (p-1)/(m+p-1) = 3/11 for p = 4, m = 8

            page.get_by_role("button", name="Run live").click(timeout=30_000)
            wall = charts.filter(has=page.locator(
                "svg text", has_text="gpipe: measured (wall clock)"))
            wall.wait_for(timeout=60_000)
            wall.scroll_into_view_if_needed()
            texts = wall.locator("svg text").all_text_contents()
            for label in ("rank 0", "rank 1", "rank 2", "rank 3", "F: forward", "B: backward",
                          "time from the step's start (ms)"):
                assert label in texts, texts
            measured = page.locator('[data-testid="stMetric"]').filter(
                has_text="Measured: gpipe")
            expect(measured).to_contain_text(re.compile(r"\d+\.\d%"))
            expect(page.locator('[data-testid="stMetric"]').filter(
                has_text="Formula: 1f1b")).to_contain_text("27.3%")
            bubble = charts.filter(has=page.locator(
                "svg text", has_text="Pipeline bubble: measured (wall clock), replayed and formula"))
            for source in ("measured (wall clock)", "replayed (measured op times, own-device schedule)",
                           "formula"):
                expect(bubble.locator("svg text", has_text=source).first).to_be_visible()
            expect(page.get_by_text("equal within 1e-5").first).to_be_visible()
            assert page.locator('[data-testid="stException"]').count() == 0

            # the replay: the same ops, each its stage's measured CPU time, one device per rank
            page.get_by_text("replayed (measured op times, own-device schedule)", exact=True).first.click()
            own = charts.filter(has=page.locator(
                "svg text", has_text="gpipe: replayed (measured op times, own-device schedule)"))
            own.wait_for(timeout=30_000)
            bars = own.locator('path[aria-roledescription="bar"]')
            assert bars.count() >= 4 * 2 * 8  # ranks x (F, B) x micro-batches, plus idle gaps
            expect(page.locator('[data-testid="stMetric"]').filter(
                has_text="Replayed: gpipe")).to_contain_text(re.compile(r"\d+\.\d%"))
            assert page.locator('[data-testid="stException"]').count() == 0
            page.get_by_text("measured (wall clock)", exact=True).first.click()
            wall.wait_for(timeout=30_000)
            # Streamlit scrolls inside its main block: a viewport as tall as the page shows it all
            height = page.evaluate('document.querySelector(\'[data-testid="stMain"]\').scrollHeight')
            page.set_viewport_size({"width": 1500, "height": min(int(height) + 50, 12_000)})
            page.wait_for_timeout(1000)  # let the charts finish drawing before the screenshot
            page.screenshot(path=SCREENSHOT, full_page=True)
        finally:
            browser.close()
