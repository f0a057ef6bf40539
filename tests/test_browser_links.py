"""The "This machine's links" page in a real browser (chromium via playwright, the server from
test_browser), marked slow: its default sweep (five collectives on 2 ranks, 4 B to 4 MiB) runs
live, then every chart must lie inside its column and the screen, its legends unclipped, in normal
and presentation mode at 1440 x 900, at the comparison's first and last settings (4 B on 2 ranks,
14 GB on 1024 ranks), and in presentation mode every text is drawn at 16 px or more."""
from __future__ import annotations

import pytest

from test_browser import (ALL_DRAWN, CHROMIUM, CHROMIUM_ARGS,  # noqa: F401  (app_url: the fixture)
                          app_url, wait_for_the_rerun)
from test_browser_fit import (MIN_TEXT_PX, SMALL_TEXTS, chart_overflows, open_page,
                              presentation_on)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


TWO_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"


def _slide(page, name: str, key: str, value: str) -> None:
    from playwright.sync_api import expect

    slider = page.get_by_role("slider", name=name)
    slider.focus()
    page.keyboard.press(key)
    expect(slider).to_have_attribute("aria-valuetext", value)
    wait_for_the_rerun(page)
    page.wait_for_function(ALL_DRAWN, timeout=60_000)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("presentation", [False, True], ids=["normal", "presentation"])
def test_the_links_page_fits_at_every_comparison_setting(app_url, presentation):  # noqa: F811
    from playwright.sync_api import sync_playwright

    problems: dict[str, list[str]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(app_url)
            page.get_by_role("switch", name="Presentation mode").wait_for(timeout=90_000)
            if presentation:
                presentation_on(page)
            open_page(page, "links", "This machine's links")
            page.get_by_role("button", name="Run live").first.click(timeout=30_000)
            page.mouse.move(1, 1)
            done = page.locator('[data-testid="stExpanderIconCheck"], '
                                '[data-testid="stExpanderIconError"]')
            done.first.wait_for(timeout=600_000, state="attached")
            wait_for_the_rerun(page)
            assert page.locator('[data-testid="stExpanderIconError"]').count() == 0
            page.get_by_role("slider", name="Ranks N").wait_for(timeout=60_000)
            page.wait_for_function(ALL_DRAWN, timeout=60_000)
            for setting, moves in (("defaults", []),
                                   ("4 B on 2 ranks", [("All-reduce size", "Home", "4 B"),
                                                       ("Ranks N", "Home", "2")]),
                                   ("14 GB on 1024 ranks", [
                                       ("All-reduce size", "End",
                                        "14 GB = 13 GiB (7B params, bf16 grads)"),
                                       ("Ranks N", "End", "1024")])):
                for name, key, value in moves:
                    _slide(page, name, key, value)
                page.evaluate(TWO_FRAMES)  # vega-embed has sized what it drew
                found = chart_overflows(page)
                if presentation:
                    found += [f"{t['px']:g} px {t['tag']} ({t['testid']}): {t['text']!r}"
                              for t in page.evaluate(SMALL_TEXTS, MIN_TEXT_PX)]
                assert page.locator('[data-testid="stException"]').count() == 0, setting
                if found:
                    problems[setting] = found
        finally:
            browser.close()
    assert not problems, problems
