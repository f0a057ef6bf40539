"""The Experts page in a real browser (Debian's chromium via playwright, server from test_browser):
"Run live" draws the routing heatmap (a cell per token and choice, the dropped ones crossed), the
load per expert with its capacity rule, the all-to-all rank x rank matrix, the bytes beside the
uniform-routing formula and the model states per rank, each with its axis titles; moving the step
slider redraws the heatmap for step 0 from the same run. A full-page screenshot is left in
/tmp/experts_page.png for a look at the labels, legends and axis titles."""
from __future__ import annotations

import pytest

from parallel_mini.moe import capacity
from test_browser import (CHROMIUM, CHROMIUM_ARGS, app_url,  # noqa: F401  (app_url: the fixture)
                          screenshot_whole_page, wait_for_the_run)

pytestmark = pytest.mark.browser
SCREENSHOT = "/tmp/experts_page.png"
E, K, F, SEQ, BATCH = 8, 2, 1.25, 32, 8  # the page's defaults


def test_experts_page_runs_live_and_draws_the_routing(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(f"{app_url}/experts")
            page.get_by_role("button", name="Run live").click(timeout=30_000)
            charts = page.locator('[data-testid="stVegaLiteChart"]')

            def chart(title: str):
                return charts.filter(has=page.locator("svg text", has_text=title))

            heat = chart("Routing of rank 0's tokens, layer 0, step 3 (measured)")
            wait_for_the_run(page, heat.locator("svg text", has_text="step 3").first)
            heat.scroll_into_view_if_needed()
            texts = heat.locator("svg text").all_text_contents()
            for label in ("1st choice", "2nd choice", "dropped (over capacity)",
                          "expert 0 · ep rank 0", "expert 7 · ep rank 1"):
                assert label in texts, texts
            assert any(t.startswith("token of rank 0's first micro-batch") for t in texts), texts
            # one mark per (token, choice): 128 tokens x 2 cells at least, drawn as SVG paths
            assert heat.locator("svg path").count() >= (BATCH // 2) * SEQ * K
            before = heat.screenshot()

            cap = capacity(SEQ, E, K, F) * BATCH
            load = chart("Load per expert, layer 0, step 3")
            load.scroll_into_view_if_needed()
            load_texts = load.locator("svg text").all_text_contents()
            assert f"capacity {cap}" in load_texts and "token assignments in the step" in load_texts
            for title, axes in (("All-to-all bytes, step 3", ("source rank", "destination rank")),
                                ("All-to-all bytes per rank per step",
                                 ("theory (uniform routing, no drops)",
                                  "counted (this run's splits)")),
                                ("Model states per rank: measured vs theory",
                                 ("experts replicated (ep = 1)",))):
                c = chart(title)
                c.scroll_into_view_if_needed()
                got = c.locator("svg text").all_text_contents()
                assert all(a in got for a in axes), (title, got)
            expect(page.get_by_text("equal within 1e-5").first).to_be_visible()
            assert page.locator('[data-testid="stException"]').count() == 0

            # the step slider: Home moves it to step 0, the heatmap redraws from the same run
            step = page.locator('[data-testid="stSlider"]').filter(
                has=page.get_by_text("Step", exact=True))
            expect(step).to_have_count(1)
            step.get_by_role("slider").focus()
            page.keyboard.press("Home")
            heat0 = chart("Routing of rank 0's tokens, layer 0, step 0 (measured)")
            heat0.locator("svg text", has_text="step 0").first.wait_for(timeout=30_000)
            assert heat0.screenshot() != before
            assert page.locator('[data-testid="stException"]').count() == 0

            screenshot_whole_page(page, SCREENSHOT, 1500)
        finally:
            browser.close()
