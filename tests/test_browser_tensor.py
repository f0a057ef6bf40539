"""The tensor-parallel page in a real browser (Debian's chromium via playwright, server from
test_browser): press "Run live", wait for the weight-shard heatmaps to be drawn as SVG (one panel
per rank, each holding its slice of fc's rows), and check that the measured tp bytes are shown
equal to the formula."""
from __future__ import annotations

import pytest

from test_browser import CHROMIUM, CHROMIUM_ARGS, app_url  # noqa: F401  (app_url: the fixture)
from test_browser import wait_for_the_run

pytestmark = pytest.mark.browser


def test_tensor_page_runs_live_and_draws_the_shards(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{app_url}/tensor")
            charts = page.locator('[data-testid="stVegaLiteChart"]')
            shards = charts.filter(has=page.locator("svg text", has_text="MLP weight shards"))
            page.get_by_role("button", name="Run live").click(timeout=30_000)
            wait_for_the_run(page, shards)
            shards.scroll_into_view_if_needed()
            texts = shards.locator("svg text").all_text_contents()
            # tp = 2 by default, d64: fc.weight [256, 64] split by rows, proj [64, 256] by columns
            for label in ("rank 0: [0:128, 0:64]", "rank 1: [128:256, 0:64]",
                          "rank 0: [0:64, 0:128]", "rank 1: [0:64, 128:256]"):
                assert label in texts, texts
            cells = shards.locator('path[aria-roledescription="rect mark"]')
            assert cells.count() >= 2 * 2 * 32 * 16  # 2 matrices x 2 ranks x (32 x 16) patches
            tp_bytes = "TP bytes per step, rank 0: counted (ring model of the ops run)"
            expect(page.get_by_text(tp_bytes)).to_be_visible()
            theory = page.locator('[data-testid="stMetric"]').filter(
                has_text="TP bytes per step: theory")
            expect(theory).to_contain_text("591,360 B")
            expect(theory).to_contain_text("equal")
            expect(page.locator('[data-testid="stMetric"]').filter(
                has_text=tp_bytes)).to_contain_text("591,360 B")
        finally:
            browser.close()
