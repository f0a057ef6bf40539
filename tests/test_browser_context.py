"""The Long sequences page in a real browser (Debian's chromium via playwright, server from
test_browser): "Run live" draws the K/V ring from the run's sends; moving its frame slider redraws
which block each rank holds; it plays by itself in the browser (a timer in its spec) and
unticking "play" holds the frame; the tile maps, the two message timelines and the activation
curve (its points measured behind their own button) are drawn with their axis titles. A full-page
screenshot is left in /tmp/long_sequences_page.png for a look at the labels, legends and axis
titles."""
from __future__ import annotations

import re

import pytest

from test_browser import (CHROMIUM, CHROMIUM_ARGS, _wait_for_ticks,  # noqa: F401
                          app_url, screenshot_whole_page, wait_for_the_rerun,
                          wait_for_the_run)

pytestmark = pytest.mark.browser
SCREENSHOT = "/tmp/long_sequences_page.png"


def _discs(chart) -> list[str]:
    """The 'K/V b' labels on the ranks' discs, in drawing order (rank 0 first)."""
    return [t for t in chart.locator("svg text").all_text_contents() if t.startswith("K/V ")
            and len(t.split()) == 2]


def _frame(chart) -> int:
    """The frame the animation shows, read from its caption ('frame k of 2C-1 · ...')."""
    texts = chart.locator("svg text").all_text_contents()
    for text in texts:
        if text.startswith("frame ") and " of " in text:
            return int(text.split()[1])
    raise AssertionError(texts)


def test_long_sequences_page_runs_live_and_the_ring_moves(app_url):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(f"{app_url}/long_sequences")
            page.get_by_role("button", name="Run live").click(timeout=30_000)
            charts = page.locator('[data-testid="stVegaLiteChart"]')
            ring = charts.filter(has=page.locator("svg text",
                                                  has_text="K/V blocks around the ring"))
            # the chart, or the page's error: a refused or failed run says why (a soak round
            # under load once waited the whole guard for a chart that a refusal never drew)
            wait_for_the_run(page, ring.locator("svg text", has_text=" of 7").first)
            ring.scroll_into_view_if_needed()
            ring.locator(".vega-bind", has_text="play").locator("input").uncheck()  # it plays
            slider = ring.locator('input[type="range"]')
            expect(slider).to_have_attribute("max", "7")  # 2C - 1 frames for the default C = 4
            slider.fill("0")
            ring.locator("svg text", has_text="frame 0 of 7").wait_for(timeout=60_000)
            assert _discs(ring) == ["K/V 0", "K/V 1", "K/V 2", "K/V 3"]  # everyone its own block
            texts = ring.locator("svg text").all_text_contents()
            # the caption lists every hop as recorded: K and V of [4, 4, 8, 16] fp32 = 16,384 B
            assert any("rank 0 → rank 1: K/V of block 0, 16,384 B" in t for t in texts), texts
            before = ring.screenshot()

            slider.fill("2")  # forward ring step 2: rank r holds block r - 2
            ring.locator("svg text", has_text="frame 2 of 7").wait_for(timeout=60_000)
            assert _discs(ring) == ["K/V 2", "K/V 3", "K/V 0", "K/V 1"]
            assert ring.screenshot() != before
            slider.fill("7")  # backward's last hop: dK, dV go home
            ring.locator("svg text", has_text="the last hop takes dK, dV home").wait_for(
                timeout=60_000)

            # the tile maps: contiguous rank 3 computes all 4 tiles, zigzag every rank 9 of 16
            tiles = charts.filter(has=page.locator("svg text",
                                                   has_text="Causal attention tiles per rank"))
            tiles.scroll_into_view_if_needed()
            tile_texts = tiles.locator("svg text").all_text_contents()
            for label in ("rank 3: 4 of 4 tiles", "rank 0: 1 of 4 tiles", "rank 0: 9 of 16 tiles",
                          "key position (token)", "query position (token)"):
                assert label in tile_texts, tile_texts
            # the activation curve's points: their own button, their own 18 runs
            page.get_by_role("button", name="Measure the activation curve").click()
            page.get_by_text("equal to the formula").first.wait_for(timeout=180_000)
            for title, axis in (("ring (contiguous chunks): the cp messages", "time from the step's first cp message (ms)"),
                                ("Ulysses (all-to-all): the cp messages", "time from the step's first cp message (ms)"),
                                ("Activation bytes per layer per rank", "sequence length s (tokens)")):
                chart = charts.filter(has=page.locator("svg text", has_text=title))
                chart.scroll_into_view_if_needed()
                assert axis in chart.locator("svg text").all_text_contents(), title
            expect(page.get_by_text("equal within 1e-5").first).to_be_visible()
            expect(page.get_by_text("equal to the formula").first).to_be_visible()
            assert page.locator('[data-testid="stException"]').count() == 0

            # it plays by itself in the browser (viz.animate): play on, the frame moves on with no
            # click; untick play and it holds while the chart's own timer ticks on
            ring.scroll_into_view_if_needed()
            play = ring.locator(".vega-bind", has_text="play").locator("input")
            play.check()  # from frame 7 on: 0, then 1
            # any frame but 7 (the one it held): true 7/8 of each cycle, not one 0.75 s window
            ring.locator("svg text", has_text=re.compile(r"^frame (?!7 )\d+ of 7")).first.wait_for(
                timeout=30_000)
            play.uncheck()
            held = _frame(ring)
            _wait_for_ticks(page, ring, 3 * 3)  # three frames' worth at the normal speed
            assert _frame(ring) == held
            assert page.locator('[data-testid="stException"]').count() == 0

            screenshot_whole_page(page, SCREENSHOT, 1500)
        finally:
            browser.close()
