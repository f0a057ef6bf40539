"""The ring page in a real browser: Debian's chromium driven by playwright against a Streamlit
server started here. On 8 ranks (the most the page allows), press "Run live", wait for the chart
the run produced, see it play (the step advances), pause it (it holds), move the animation's step
slider and check that what is drawn changes to the decoded state of that step, that the legend
names every count 1..8 and that the whole message list of a step lies inside the chart. The
animation plays by itself in the browser (no Play button: a timer in the chart's spec); unticking
its "play" box holds the step while the chart's own timer ticks on (waited for by its tick count,
never by sleeping)."""
from __future__ import annotations

import os
import re
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


# One Streamlit server for every browser module of this pytest process (each module imports
# app_url from here): a cold server costs its first page 10-20 s of imports on a loaded 2-core
# machine, and its shutdown 5 s. Pages keep nothing between browser sessions but st.cache_data.
# The server warms no page in the background (PARALLEL_MINI_WARM=none): its start-up runs would
# compete with the tests' own runs for the machine's cores; tests/test_class_load.py checks the
# warm-up with a server of its own.
_SERVER: dict = {}


@pytest.fixture(scope="module")
def app_url(request, tmp_path_factory):
    _require_chromium()
    if _SERVER:
        yield _SERVER["url"]
        return
    from parallel_mini.course.bench import app_server

    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    server = app_server({"PARALLEL_MINI_WARM": "none"}, log_path=str(log_path), start_timeout_s=45)
    try:
        url = server.__enter__()
    except RuntimeError as e:
        pytest.fail(str(e))
    _SERVER.update(url=url)
    request.config.add_cleanup(lambda: server.__exit__(None, None, None))  # at the session's end
    yield url


# every chart drawn (vega-embed draws after the script run has ended)
ALL_DRAWN = """() => [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')]
    .every(e => e.querySelector('svg.marks, canvas.marks'))"""


def screenshot_whole_page(page, path: str, width: int) -> None:
    """A picture of the whole page for a reader (no assertion): Streamlit scrolls inside its main
    block, so the viewport is made as tall as the page; then every chart drawn and two frames
    painted (states, not a fixed wait) before the screenshot."""
    height = page.evaluate('document.querySelector(\'[data-testid="stMain"]\').scrollHeight')
    page.set_viewport_size({"width": width, "height": min(int(height) + 50, 12_000)})
    page.wait_for_function(ALL_DRAWN, timeout=60_000)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    page.screenshot(path=path, full_page=True)


def _svg_texts(chart) -> list[str]:
    return chart.locator("svg text").all_text_contents()


def wait_for_the_run(page, drawn, timeout: float = 180_000) -> None:
    """After Run live: wait until `drawn` (what the run draws) is on the page, or the page shows
    an error, and fail naming the error. A refused run (the memory check on a busy machine) draws
    no chart; waiting for the chart alone then spends the whole guard and says nothing of why.
    The timeout is a guard against a hang, not a duration the run is expected to take."""
    error = page.locator('[data-testid="stAlertContentError"]')
    drawn.or_(error).first.wait_for(timeout=timeout)
    assert error.count() == 0, error.first.inner_text()


def wait_for_the_rerun(page) -> None:
    """Streamlit keeps the previous run's elements (stale) on the page until a rerun ends, and
    draws the new ones as the script reaches them: wait for the run to end before reading them."""
    page.locator('[data-testid="stApp"][data-test-script-state="notRunning"]').wait_for(
        timeout=60_000)


def _wait_for_ticks(page, chart, ticks: int) -> None:
    """Wait until the chart's timer (viz.animate's invisible 'timer tick N') has ticked `ticks`
    more times: time has passed in the browser, counted by the chart itself, not slept here."""
    # At least start + ticks, never exactly: each count is drawn for one tick (250 ms), which a
    # poll on a loaded machine can miss (CI saw 'timer tick 73' never found in 60 s); the count
    # only grows, so "at least" is a state that stays true once reached.
    target = _tick(chart) + ticks
    page.wait_for_function(
        """([chart, target]) => [...chart.querySelectorAll('svg text')].some(t =>
             t.textContent.startsWith('timer tick ') && parseInt(t.textContent.slice(11)) >= target)""",
        arg=[chart.element_handle(), target], timeout=60_000)


def _tick(chart) -> int:
    for text in _svg_texts(chart):
        if text.startswith("timer tick "):
            return int(text.split()[-1])
    raise AssertionError(_svg_texts(chart))


def _caption_step(chart) -> int:
    """The frame the ring animation shows, read from its caption ('step k of 2(N-1) · ...')."""
    for text in _svg_texts(chart):
        if text.startswith("step ") and " of " in text:
            return int(text.split()[1])
    raise AssertionError(_svg_texts(chart))


def test_ring_page_runs_live_and_the_animation_moves(app_url):
    from playwright.sync_api import expect, sync_playwright

    n, steps = 8, 14  # the largest ring the page allows: 2(N-1) = 14 steps
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{app_url}/ring")
            size = page.get_by_role("slider", name="World size N (ranks)")
            size.wait_for(timeout=30_000)
            size.focus()
            page.keyboard.press("End")  # N = 8, the most
            expect(size).to_have_value(str(n))
            timed = page.get_by_role("slider", name="Timed tensor (MB)")
            timed.focus()
            page.keyboard.press("Home")  # 1 MB, the least: 8 ranks share this machine's cores
            expect(timed).to_have_attribute("aria-valuetext", "1")
            page.get_by_role("button", name="Run live").click(timeout=30_000)

            # the animation: the first chart on the page, drawn once the run returned; it plays
            # by itself in the browser (viz.animate): the step it shows changes with no click
            chart = page.locator('[data-testid="stVegaLiteChart"]').first
            wait_for_the_run(page, chart.locator("svg text", has_text=f" of {steps} · ").first)
            expect(page.get_by_text("Bytes sent by each rank: counted")).to_be_visible()
            expect(page.get_by_text("Written to sockets by each rank: measured")).to_be_visible()
            slider = chart.locator('input[type="range"]')
            expect(slider).to_have_attribute("max", str(steps))
            cells = chart.locator('path[aria-roledescription="rect mark"]')
            expect(cells.first).to_be_visible()
            chart.scroll_into_view_if_needed()
            first = _caption_step(chart)
            chart.locator("svg text", has_text=re.compile(
                rf"^step (?!{first} )\d+ of {steps}")).first.wait_for(timeout=30_000)

            # Pause (untick play): the step holds while the chart's timer ticks on
            play = chart.locator(".vega-bind", has_text="play").locator("input")
            expect(play).to_be_checked()
            play.uncheck()
            held = _caption_step(chart)
            _wait_for_ticks(page, chart, 3 * 3)  # three steps' worth at the normal speed
            assert _caption_step(chart) == held
            assert page.locator('[data-testid="stException"]').count() == 0

            # each step below is a state that stays (play is off): 60 s is a hang guard (10 s, the
            # old one, was short on a loaded CI: 'step 2 of 14' never appeared within it)
            slider.fill("0")  # the start: each rank holds only its own data
            chart.locator("svg text", has_text=f"step 0 of {steps}").first.wait_for(timeout=60_000)
            before_png = chart.screenshot()
            before_texts = _svg_texts(chart)
            assert f"all {n}" not in before_texts
            # the legend names every count of ranks summed in, 1..8
            legend = before_texts.index("ranks summed in")  # its labels come first in the SVG
            assert before_texts[legend - n:legend] == [str(i) for i in range(1, n + 1)], \
                before_texts

            slider.fill(str(steps))  # the last step: the all-reduce is complete
            last = chart.locator("svg text", has_text=f"step {steps} of {steps}")
            last.wait_for(timeout=60_000)
            after_texts = _svg_texts(chart)
            # every rank x chunk now holds all 8 ranks' data (decoded from the run's messages)
            assert sum(t.startswith(f"all {n}") for t in after_texts) == n * n, after_texts
            assert after_texts != before_texts
            assert chart.screenshot() != before_png
            # the message list under the grid, all 2 + N lines, inside the chart as drawn
            box = chart.bounding_box()
            for line in ("(each received chunk is copied over the local one)",
                         f"rank {n - 1} → rank 0: chunk"):
                text = chart.locator("svg text", has_text=line).bounding_box()
                assert text["y"] + text["height"] <= box["y"] + box["height"] + 0.5, (line, text, box)

            slider.fill("2")  # mid reduce-scatter: partial sums, three ranks' data at most
            chart.locator("svg text", has_text=f"step 2 of {steps}").wait_for(timeout=60_000)
            mid = _svg_texts(chart)
            assert not any(t.startswith(f"all {n}") for t in mid)
            assert any(t.count("+") == 2 for t in mid), mid  # e.g. "0+6+7"
        finally:
            browser.close()
