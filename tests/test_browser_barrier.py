"""The Without a barrier page in a real browser (Debian's chromium via playwright, server from
test_browser). Cheap (default): the page opens with its six controls, its Run live button and
nothing drawn, and fits a 1440x900 screen's width. -m slow: "Run live" draws the staleness histogram with its theory rule, the loss against the
wall clock for sync DP and async, local SGD's bytes and FedAvg's rounds, each with its axis titles,
and every chart fits inside its column (no horizontal overflow). Waits for elements, never for a
duration."""
from __future__ import annotations

import pytest

from test_browser import CHROMIUM, CHROMIUM_ARGS, app_url  # noqa: F401  (app_url: the fixture)
from test_browser import wait_for_the_run

pytestmark = pytest.mark.browser
CONTROLS = ("Straggler rank", "Straggler factor (× slower)", "Max staleness K (async)",
            "Local SGD: sync every H steps", "FedAvg: non-IID A", "FedAvg: local steps E")


def test_barrier_page_opens_with_its_controls(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(f"{app_url}/barrier")
            expect(page.get_by_role("heading", name="Without a barrier")).to_be_visible(
                timeout=30_000)
            for label in CONTROLS:
                expect(page.get_by_text(label, exact=True).first).to_be_visible()
            expect(page.get_by_role("button", name="Run live")).to_be_enabled()
            expect(page.get_by_text("Press Run live").first).to_be_visible()
            assert page.locator('[data-testid="stVegaLiteChart"]').count() == 0
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        finally:
            browser.close()


@pytest.mark.slow  # five live runs behind one press: ~50 s at load 15
def test_barrier_page_runs_live_and_draws_its_charts(app_url):  # noqa: F811
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(f"{app_url}/barrier")
            page.get_by_role("button", name="Run live").click(timeout=30_000)
            charts = page.locator('[data-testid="stVegaLiteChart"]')

            def chart(title: str):
                return charts.filter(has=page.locator("svg text", has_text=title))

            hist = chart("Staleness of the applied updates")
            wait_for_the_run(page, hist.locator("svg text", has_text="updates (counted)").first)
            for title, texts in (
                    ("Staleness of the applied updates",
                     ("theory mean 2 (W − 1)", "staleness (versions the gradient did not see)")),
                    ("Loss against the wall clock", ("wall-clock time (s, measured)", "sync DP",
                                                     "async")),
                    ("Loss against samples", ("samples (sequences trained on)",)),
                    ("Bytes sent per sample", ("counted (comm records)", "theory (formula)")),
                    ("Federated averaging", ("union loss (nats)",))):
                c = chart(title)
                c.first.scroll_into_view_if_needed()
                got = c.first.locator("svg text").all_text_contents()
                assert all(t in got for t in texts), (title, got)
                fits = c.first.evaluate(
                    "el => el.querySelector('svg').getBoundingClientRect().width"
                    " <= el.parentElement.getBoundingClientRect().width + 1")
                assert fits, f"{title}: wider than its column"
        finally:
            browser.close()
