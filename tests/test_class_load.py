"""A class at once, against one real Streamlit server: sessions driven through Streamlit's own
websocket protocol (the messages a browser sends and receives, without a browser: 20 browsers do
not fit CI's 2 cores), all pressing "Run live" on the Ring page together.

- At the default controls: the server measured the page's default run when it started (its
  warm-up), so every press is a read of that shared result: every session's first chart arrives
  within 10 s of its press, and its status line says the result was taken from the cache.
- With distinct controls (distinct runs): every session that waits sees its place in the queue and
  an estimate of its wait, and every one gets its chart.
"""
from __future__ import annotations

import asyncio
import re
import time

import pytest

websockets = pytest.importorskip("websockets")
from streamlit.proto.BackMsg_pb2 import BackMsg  # noqa: E402
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg  # noqa: E402

from parallel_mini.course.bench import app_server  # noqa: E402

CHART_WITHIN_S = 10.0  # issue 22's bound: every chart within 10 s at the default controls


class Session:
    """One browser tab's conversation with the server: open a page, set widgets, press a button,
    and note when each element arrives (time.monotonic)."""

    def __init__(self, url: str):
        self.url = url.replace("http://", "ws://") + "/_stcore/stream"
        self.page_hash = ""
        self.widgets: dict[str, str] = {}  # label -> widget id
        self.events: list[tuple[float, str, str]] = []  # (when, kind, text)

    async def __aenter__(self):
        self.ws = await websockets.connect(self.url, subprotocols=["streamlit"], max_size=None,
                                           open_timeout=60)
        return self

    async def __aexit__(self, *exc):
        await self.ws.close()

    async def _rerun(self, page_name: str = "", values: dict | None = None,
                     press: str | None = None) -> None:
        msg = BackMsg()
        state = msg.rerun_script
        state.page_script_hash, state.page_name = self.page_hash, page_name
        for label, value in (values or {}).items():
            w = state.widget_states.widgets.add()
            w.id = self.widgets[label]
            if isinstance(value, str):
                w.string_array_value.data.append(value)  # a select_slider: its option's text
            else:
                w.double_array_value.data.append(value)  # a slider
        if press:
            w = state.widget_states.widgets.add()
            w.id, w.trigger_value = self.widgets[press], True
        await self.ws.send(msg.SerializeToString())
        await self._until_finished()

    async def _until_finished(self) -> None:
        while True:
            fm = ForwardMsg()
            fm.ParseFromString(await self.ws.recv())
            now, kind = time.monotonic(), fm.WhichOneof("type")
            if kind == "new_session":
                self.page_hash = fm.new_session.page_script_hash
            elif kind == "navigation":
                self.page_hash = fm.navigation.page_script_hash
            elif kind == "script_finished":
                return
            elif kind == "delta" and fm.delta.WhichOneof("type") == "new_element":
                el = fm.delta.new_element
                what = el.WhichOneof("type")
                widget = getattr(el, what, None)
                if hasattr(widget, "id") and hasattr(widget, "label") and widget.id:
                    self.widgets[widget.label] = widget.id
                text = {"alert": el.alert.body, "markdown": el.markdown.body,
                        "exception": el.exception.message}.get(what, "")
                self.events.append((now, what, text))
            elif kind == "delta" and fm.delta.WhichOneof("type") == "add_block":
                block = fm.delta.add_block
                if block.WhichOneof("type") == "expandable":  # st.status (or an st.expander)
                    self.events.append((now, "status", block.expandable.label))

    async def open(self, page_name: str) -> None:
        await self._rerun(page_name)

    async def press(self, values: dict | None = None) -> float:
        """Press "Run live" (with `values` set first, as a browser sends them with the press);
        returns when the press was sent."""
        self.events = []
        t0 = time.monotonic()
        await self._rerun(values=values, press="Run live")
        return t0

    def status_line(self) -> str:
        """The last label of the press's status box (run_live's: "<label>: done in ...")."""
        return [x for x in self.texts("status") if x.startswith(("Running a ", "The run"))][-1]

    def first(self, kind: str) -> float | None:
        return next((t for t, k, _ in self.events if k == kind), None)

    def texts(self, kind: str) -> list[str]:
        return [x for _, k, x in self.events if k == kind]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own that warms the Ring page only (the default warms every page), bounded to
    2 rank processes as on CI's 2 cores."""
    log_path = tmp_path_factory.mktemp("class_load") / "server.log"
    try:
        with app_server({"PARALLEL_MINI_WARM": "ring", "PARALLEL_MINI_MAX_RANKS": "2"},
                        str(log_path), start_timeout_s=60) as url:
            yield url
    except RuntimeError as err:
        pytest.fail(str(err))


async def _warmed(url: str) -> str:
    """Open Home (the first session starts the warm-up) until it says the Ring page's default run
    was measured; its line."""
    deadline = time.monotonic() + 240
    while True:
        async with Session(url) as home:
            await home.open("")
            lines = [ln for text in home.texts("markdown") for ln in text.splitlines()
                     if ln.startswith("- Ring all-reduce: ")]
        if lines and "measured at" in lines[0]:
            return lines[0]
        assert not lines or lines[0].endswith((": waiting", ": running")), lines
        assert time.monotonic() < deadline, f"the warm-up never measured the ring: {lines}"
        await asyncio.sleep(1)


async def _class(url: str, values: list[dict | None]) -> list[tuple[Session, float]]:
    """One session per entry of `values`: all open the Ring page, then all press Run live together
    (each with its own controls, None: the defaults)."""
    sessions = [Session(url) for _ in values]
    for s in sessions:
        await s.__aenter__()
    try:
        await asyncio.gather(*(s.open("ring") for s in sessions))
        pressed = await asyncio.gather(*(s.press(v) for s, v in zip(sessions, values)))
    finally:
        for s in sessions:
            await s.__aexit__()
    return list(zip(sessions, pressed))


@pytest.mark.alone  # a bound on wall time: not beside the suite's other worker (Makefile)
def test_twenty_sessions_at_the_default_controls_all_see_the_chart_within_10_s(server):
    line = asyncio.run(_warmed(server))
    assert re.search(r"measured at \d\d:\d\d:\d\d in \d+\.\d s", line), line
    done = asyncio.run(_class(server, [None] * 20))
    late = []
    for s, t0 in done:
        assert not s.texts("exception"), s.texts("exception")
        chart = s.first("vega_lite_chart")
        assert chart is not None, f"no chart: {s.events[-5:]}"
        final = s.status_line()
        assert "on 4 ranks: done in" in final and "taken from the cache: measured on this machine" \
            " at " in final and "by the server's start-up run" in final, final
        if chart - t0 > CHART_WITHIN_S:
            late.append(round(chart - t0, 1))
    assert not late, f"charts later than {CHART_WITHIN_S} s after the press: {late}"


def _distinct(n: int) -> list[dict]:
    """n distinct settings of the Ring page on 2 ranks (the default is 4), small tensors first."""
    return [{"World size N (ranks)": 2.0, "Elements in the animated tensor": str(numel),
             "Timed tensor (MB)": str(mb)} for mb in (1, 4, 16, 64) for numel in (8, 16, 32, 64)][:n]


def _assert_each_waiter_told_place_and_estimate(done) -> None:
    waited = 0
    for s, _ in done:
        assert not s.texts("exception"), s.texts("exception")
        assert s.first("vega_lite_chart") is not None, f"no chart: {s.events[-5:]}"
        final = s.status_line()
        assert " ranks: done in" in final and "measured now on this machine" in final, final
        notes = [a for a in s.texts("alert") if "in the queue" in a]
        if "waiting for rank processes" not in final:
            continue
        waited += 1
        assert notes, f"waited without being told its place: {final}"
        for note in notes:  # the ring's warm-up run is measured: every run ahead has an estimate
            assert re.search(r"number \d+ in the queue, (waiting )?\d+ s so far; expected to start in about "
                             r"\d+ s \(the runs ahead replayed from measured durations of similar "
                             r"runs\)", note), note
    assert waited >= len(done) - 1, "fewer sessions waited than the queue of 2 slots implies"


def test_sessions_with_distinct_controls_see_their_place_and_an_estimate(server):
    asyncio.run(_warmed(server))
    _assert_each_waiter_told_place_and_estimate(asyncio.run(_class(server, _distinct(3))))


@pytest.mark.slow
def test_twenty_sessions_with_distinct_controls(server):
    asyncio.run(_warmed(server))
    _assert_each_waiter_told_place_and_estimate(asyncio.run(_class(server, _distinct(16) + [
        {"World size N (ranks)": 3.0, "Elements in the animated tensor": str(numel),
         "Timed tensor (MB)": "1"} for numel in (8, 16, 32, 64)])))
