"""The Plan a run page in a real browser (Debian's chromium via playwright, server from
test_browser), one session: the planner's ranked layouts are drawn before any run with their axis
titles and the GPU's capacity; answering the guide's "long sequences" question moves the guide's
layout to one with context parallel (its place among the fitting layouts as planner and guide
compute it here); "Run live (toy version)" trains the toy layout on 2 ranks and its measured step
time appears in the same row as the planner's prediction, with every rank's states equal to the
planner's. A full-page screenshot is left in /tmp/plan_page.png."""
from __future__ import annotations

import pytest

from parallel_mini.course import guide, planner
from test_browser import (CHROMIUM, CHROMIUM_ARGS, app_url,  # noqa: F401  (app_url: the fixture)
                          screenshot_whole_page, wait_for_the_run)

pytestmark = pytest.mark.browser
SCREENSHOT = "/tmp/plan_page.png"


def test_plan_page_guide_and_toy_run(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    ranked = planner.plan(planner.MODELS["llama3-70b"], 64, planner.hardware("h100-80gb"),
                          1024, 8, top=0)["all"]
    place = guide.first_following(ranked, guide.recommend({"fits": "no", "long": "yes"}))[0]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(f"{app_url}/plan")
            chart = page.locator('[data-testid="stVegaLiteChart"]').filter(
                has=page.locator("svg text", has_text="Ranked layouts"))
            chart.locator("svg text", has_text="memory per GPU (GiB)").first.wait_for(timeout=60_000)
            texts = chart.locator("svg text").all_text_contents()
            for label in ("predicted step time (s)", "model states", "activations", "compute",
                          "GPU memory 80 GiB"):
                assert any(t.startswith(label) for t in texts), (label, texts)
            assert sum(t.startswith("#") for t in texts) >= 8  # a row per ranked layout

            def metric(label: str):
                return page.locator('[data-testid="stMetric"]').filter(has_text=label)

            # the guide: long sequences -> the planner's best layout with context parallel
            page.get_by_text("yes: one layer's activations crowd the GPU").click()
            expect(metric("Guide's best layout")).to_contain_text(
                f"#{place:,}", timeout=30_000)
            expect(page.locator('[data-testid="stMarkdown"]').filter(
                has_text="Toy layout:")).to_contain_text("cp2")

            page.get_by_role("button", name="Run live (toy version)").click()
            measured = metric("Step time: measured")
            wait_for_the_run(page, measured)
            theory = metric("Step time: theory (planner)")
            value = measured.locator('[data-testid="stMetricValue"]').inner_text()
            assert float(value.split()[0]) > 0 and value.split()[1] in ("s", "ms"), value
            # beside the prediction: the same row of metrics
            assert abs(measured.bounding_box()["y"] - theory.bounding_box()["y"]) < 2
            expect(metric("Ranks whose states equal theory")).to_contain_text(
                "2 of 2")
            toy = page.locator('[data-testid="stVegaLiteChart"]').filter(
                has=page.locator("svg text", has_text="Toy run: memory per rank"))
            toy.scroll_into_view_if_needed()
            toy_texts = toy.locator("svg text").all_text_contents()
            assert {"rank 0", "rank 1", "measured", "theory"} <= set(toy_texts), toy_texts
            assert any(t.startswith("memory per rank (") for t in toy_texts), toy_texts
            assert page.locator('[data-testid="stException"]').count() == 0

            screenshot_whole_page(page, SCREENSHOT, 1440)
        finally:
            browser.close()
