"""The memory page in a real browser (Debian's chromium via playwright, server from test_browser):
press "Run live", wait for the measured-vs-predicted chart to be drawn as SVG, and check that the
page says the measured model states equal the formula to the byte."""
from __future__ import annotations

import pytest

from test_browser import CHROMIUM, CHROMIUM_ARGS, app_url  # noqa: F401  (app_url: the fixture)
from test_browser import wait_for_the_run

pytestmark = pytest.mark.browser


def test_memory_page_runs_all_zero_stages_live(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{app_url}/memory")
            charts = page.locator('[data-testid="stVegaLiteChart"]')
            # the theory chart is there before anything runs, with all four stages
            stages_chart = charts.filter(has=page.locator(
                "svg text", has_text="Memory per GPU by ZeRO stage"))
            stages_chart.wait_for(timeout=30_000)
            for k in range(4):
                expect(stages_chart.locator("svg text", has_text=f"ZeRO-{k}")).to_be_visible()
            assert charts.count() == 1
            expect(page.get_by_text("equal to the byte")).to_have_count(0)

            page.get_by_role("button", name="Run live").click(timeout=30_000)
            measured = charts.filter(has=page.locator(
                "svg text", has_text="Memory per GPU: measured"))
            wait_for_the_run(page, measured)
            bars = measured.locator('path[aria-roledescription="bar"]')
            expect(bars.first).to_be_visible()
            assert bars.count() >= 4 * 2 * 4  # 4 stages x (measured, predicted) x categories
            texts = measured.locator("svg text").all_text_contents()
            assert {"ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"} <= set(texts), texts
            expect(page.get_by_text("equal to the byte")).to_be_visible()
            expect(page.get_by_text("Activations, measured peak")).to_be_visible()
        finally:
            browser.close()


@pytest.mark.slow
def test_disk_choice_runs_live_and_its_charts_fit(app_url):  # noqa: F811
    """The "to disk" choice: the four stages run live with --offload-disk, the page shows the
    step's bytes to and from disk beside the /proc counters, and every chart fits its column."""
    from playwright.sync_api import expect, sync_playwright

    from test_browser_fit import chart_overflows

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(f"{app_url}/memory")
            charts = page.locator('[data-testid="stVegaLiteChart"]')
            charts.first.wait_for(timeout=60_000)
            page.get_by_text("Optimizer states to disk").click(timeout=30_000)
            stages_chart = charts.filter(has=page.locator("svg text", has_text="+ disk"))
            stages_chart.first.wait_for(timeout=30_000)
            page.get_by_role("button", name="Run live").click(timeout=30_000)
            io = charts.filter(has=page.locator("svg text", has_text="Bytes to and from disk"))
            wait_for_the_run(page, io)
            expect(io.locator('path[aria-roledescription="bar"]').first).to_be_visible()
            expect(page.get_by_text("equal to the byte")).to_be_visible()
            assert chart_overflows(page) == []
        finally:
            browser.close()
