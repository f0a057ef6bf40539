"""The pipeline page in a real browser (Debian's chromium via playwright, server from test_browser):
the planned schedules are drawn before any run, every op bar labelled with its micro-batch
(interleaved, 32 ops per rank: micro-batch over chunk), each schedule on its own time axis unless
the toggle puts both on one; at m = 1 "Run live" draws each rank's step measured on the wall clock
as a Gantt chart (SVG, one lane per rank, F and B bars), the bubble measured, replayed and by the
formula, the activations in flight against an op count ticked 1, 2; switching to the replay
(measured op times, own-device schedule) redraws the timelines. Elements are counted once the
rerun has ended: until then Streamlit keeps the previous run's (stale) elements beside the new
ones. A full-page screenshot is left in /tmp/pipeline_page.png for a look at the labels, legends
and axis titles."""
from __future__ import annotations

import re

import pytest

from test_browser import (CHROMIUM, CHROMIUM_ARGS, app_url,  # noqa: F401  (app_url: the fixture)
                          wait_for_the_rerun, wait_for_the_run)

pytestmark = pytest.mark.browser
SCREENSHOT = "/tmp/pipeline_page.png"


def _x_axis(chart):
    """The time axis, whose aria-label Vega writes for screen readers: 'X-axis titled ... for a
    linear scale with values from 0 to 35'."""
    return chart.locator('g[aria-roledescription="axis"]').filter(
        has_text="time from the step's start").first


def _ends_at(units: int):
    return re.compile(rf"values from 0 to {units}$")


def _choose(page, label: str, option: str) -> None:
    page.get_by_role("combobox", name=label).click()
    page.get_by_role("option", name=option).click()


def test_pipeline_page_runs_live_and_draws_the_timelines(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(f"{app_url}/pipeline")
            charts = page.locator('[data-testid="stVegaLiteChart"]')
            metrics = page.locator('[data-testid="stMetric"]')
            # before any run: the two schedules as planned, unit costs, with the formula
            planned = charts.filter(has=page.locator("svg text", has_text="Planned: gpipe"))
            planned.wait_for(timeout=30_000)
            texts = planned.locator("svg text").all_text_contents()
            assert "time from the step's start (time units (one forward = 1))" in texts
            # every op bar says its micro-batch: 0..7 on each of 4 ranks, F and B
            assert sorted(t for t in texts if t.isdigit() and len(t) == 1).count("7") >= 4 * 2
            expect(metrics.filter(has_text="Bubble (theory): gpipe")).to_contain_text("27.3%")

            # interleaved, 32 ops per rank (p = 4, m = 8, v = 2): a timeline per row, every bar
            # labelled micro-batch over chunk ("0" over "c4"), on its own time axis
            _choose(page, "Schedule", "interleaved 1F1B")
            inter = charts.filter(has=page.locator("svg text",
                                                   has_text="Planned: interleaved (v = 2)"))
            inter.wait_for(timeout=30_000)  # drawn by the rerun: it has started
            wait_for_the_rerun(page)
            labels = [t for t in inter.locator("svg text").all_text_contents() if "c" in t
                      and t.split("c")[0].isdigit()]
            assert len(labels) == 4 * 32 and {"0c0", "0c4", "7c4", "7c7"} <= set(labels), labels
            f1b = charts.filter(has=page.locator("svg text", has_text="Planned: 1f1b"))
            expect(_x_axis(inter)).to_have_attribute("aria-label", _ends_at(30))  # 28.5 units
            expect(_x_axis(f1b)).to_have_attribute("aria-label", _ends_at(35))  # 1F1B's: 33
            page.get_by_text("Same time axis for both schedules").click()
            for chart in (inter, f1b):  # redrawn once the rerun gets there
                expect(_x_axis(chart)).to_have_attribute("aria-label", _ends_at(33))
            page.get_by_text("Same time axis for both schedules").click()
            expect(_x_axis(inter)).to_have_attribute("aria-label", _ends_at(30))
            _choose(page, "Schedule", "GPipe (all F, then all B)")

            # one micro-batch (the cheapest live run): the in-flight chart counts ops in integers
            m = page.get_by_role("slider", name="Micro-batches per step (m)")
            m.focus()
            page.keyboard.press("Home")
            expect(m).to_have_value("1")
            charts.filter(has=page.locator("svg text", has_text="Planned: gpipe, p = 4, m = 1")
                          ).wait_for(timeout=30_000)
            wait_for_the_rerun(page)
            expect(metrics.filter(has_text="Bubble (theory): gpipe")).to_contain_text("75.0%")

            page.get_by_role("button", name="Run live").click(timeout=30_000)
            wall = charts.filter(has=page.locator(
                "svg text", has_text="gpipe: measured (wall clock)"))
            wait_for_the_run(page, wall)
            wait_for_the_rerun(page)
            wall.scroll_into_view_if_needed()
            texts = wall.locator("svg text").all_text_contents()
            for label in ("rank 0", "rank 1", "rank 2", "rank 3", "F: forward", "B: backward",
                          "time from the step's start (ms)"):
                assert label in texts, texts
            measured = metrics.filter(has_text="Measured: gpipe")
            expect(measured).to_have_count(1)  # one per schedule, the page's own
            expect(measured).to_contain_text(re.compile(r"\d+\.\d%"))
            expect(metrics.filter(has_text="Formula: 1f1b")).to_contain_text("75.0%")
            bubble = charts.filter(has=page.locator(
                "svg text", has_text="Pipeline bubble: measured (wall clock), replayed and formula"))
            for source in ("measured (wall clock)", "replayed (measured op times, own-device schedule)",
                           "formula"):
                expect(bubble.locator("svg text", has_text=source).first).to_be_visible()
            flight = charts.filter(has=page.locator(
                "svg text", has_text="Activations in flight per stage: gpipe"))
            ticks = flight.locator('g[aria-roledescription="axis"]').filter(
                has_text="op of the step on this rank").locator("text").all_text_contents()
            assert ticks[-1].startswith("op of the step") and ticks[:-1] == ["1", "2"], ticks
            expect(page.get_by_text("equal within 1e-5").first).to_be_visible()
            assert page.locator('[data-testid="stException"]').count() == 0

            # the replay: the same ops, each its stage's measured CPU time, one device per rank
            page.get_by_text("replayed (measured op times, own-device schedule)", exact=True).first.click()
            own = charts.filter(has=page.locator(
                "svg text", has_text="gpipe: replayed (measured op times"))  # the title wraps
            own.wait_for(timeout=30_000)
            wait_for_the_rerun(page)  # the wall view's metrics stay on the page until it ends
            bars = own.locator('path[aria-roledescription="bar"]')
            assert bars.count() >= 4 * 2 * 1  # ranks x (F, B) x micro-batches, plus idle gaps
            replayed = metrics.filter(has_text="Replayed: gpipe")
            expect(replayed).to_have_count(1)
            expect(replayed).to_contain_text(re.compile(r"\d+\.\d%"))
            assert page.locator('[data-testid="stException"]').count() == 0
            page.get_by_text("measured (wall clock)", exact=True).first.click()
            wall.wait_for(timeout=30_000)
            wait_for_the_rerun(page)
            # Streamlit scrolls inside its main block: a viewport as tall as the page shows it all
            height = page.evaluate('document.querySelector(\'[data-testid="stMain"]\').scrollHeight')
            page.set_viewport_size({"width": 1500, "height": min(int(height) + 50, 12_000)})
            page.wait_for_timeout(1000)  # let the charts finish drawing before the screenshot
            page.screenshot(path=SCREENSHOT, full_page=True)
        finally:
            browser.close()
