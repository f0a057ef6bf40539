"""The "Pipeline bubbles" page, driven headless with AppTest. Before any run the two schedules are
drawn as planned, and the idle share of each drawn plan is the textbook formula (computed here by
hand). A live run (two of them in this file: GPipe vs 1F1B on 4 stages, interleaved vs zero bubble
on 2) puts the step on the page, measured on the wall clock and replayed with the measured op
times: the bubble shown in each view is the idle share of the timeline drawn (recomputed here from
the chart's own bars), the page says whether the ranks had cores of their own, the p2p bytes per
stage equal the count by hand,
GPipe keeps m micro-batches in flight on every stage and 1F1B p − r, and the losses equal the
single-process reference. A bad combination shows the one-line ConfigError and starts nothing."""
from __future__ import annotations

import os

import pytest
import streamlit as st

from parallel_mini import theory
from parallel_mini.course import trace
from test_app import (_app, _assert_clean, _charts, _rows_with, _widget, assert_steps,
                      record_steps)

PAGE = "app_pages/pipeline.py"
ACT = 4 * 32 * 64  # one micro-batch's activation [1, 32, 64] in fp32, bytes
OWN, WALL = "replayed (measured op times, own-device schedule)", "measured (wall clock)"


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _set(at, kind: str, label_start: str, value):
    _widget(getattr(at, kind), label_start).set_value(value)
    at.run()


def _percent(at, label_start: str) -> float:
    return float(_widget(at.metric, label_start).value.rstrip("%"))


def _chart(at, title_start: str) -> dict:
    """The one chart whose whole title starts so (wrapped titles: see _titles)."""
    found = [c for c in _charts(at) if (c["spec"].get("usermeta", {}).get("title")
                                        or str(c["spec"]["title"]["text"])).startswith(title_start)]
    assert len(found) == 1, _titles(at)
    return found[0]


def _titles(at) -> list[str]:
    """Each chart's title, whole (a title wider than its column is wrapped on the page: its whole
    text is kept in the spec's usermeta, viz.style.fit_width)."""
    return [c["spec"].get("usermeta", {}).get("title") or c["spec"]["title"]["text"]
            for c in _charts(at)]


def _timeline_rows(chart: dict) -> list[dict]:
    """The bars of a pipeline_timeline (its largest dataset: the labels layer holds a subset)."""
    return max((rows for rows in chart["datasets"].values() if rows and "x2" in rows[0]), key=len)


def _idle_share(rows: list[dict]) -> float:
    """Mean over ranks of the share of the span (first op's start to last op's end) in which the
    rank ran no F, B or W: the bubble, read off the drawn bars."""
    ops = [r for r in rows if r["kind"] in ("F", "B", "W")]
    span = max(r["x2"] for r in ops) - min(r["x"] for r in ops)
    ranks = sorted({r["rank"] for r in ops})
    busy = {k: sum(r["x2"] - r["x"] for r in ops if r["rank"] == k) for k in ranks}
    return sum(1 - busy[k] / span for k in ranks) / len(ranks)


def test_pipeline_page_draws_the_plans_before_any_run():
    at = _app(PAGE)
    _assert_clean(at)
    assert at.title[0].value == "Pipeline bubbles"
    assert [b.label for b in at.button] == ["Run live"]
    assert any("Press **Run live**" in i.value for i in at.info)
    assert _titles(at) == ["Planned: gpipe, p = 4, m = 8", "Planned: 1f1b, p = 4, m = 8"]
    # GPipe and 1F1B: (p-1)/(m+p-1) = 3/11; the drawn plan idles exactly that share
    for s in ("gpipe", "1f1b"):
        assert _widget(at.metric, f"Bubble (theory): {s}").value == f"{3 / 11:.1%}" == "27.3%"
        rows = _timeline_rows(_chart(at, f"Planned: {s}"))
        assert _idle_share(rows) == pytest.approx(3 / 11, abs=1e-12)
        assert len([r for r in rows if r["kind"] == "F"]) == 4 * 8
    # unit costs: GPipe's plan lasts (m + p - 1)(F + B) = 11 x 3 units, 1F1B's the same
    assert max(r["x2"] for r in _timeline_rows(_chart(at, "Planned: gpipe"))) == 33

    # interleaved (v = 2) beside zero bubble: no ranks start, only the plans change
    _set(at, "selectbox", "Schedule", "interleaved")
    _set(at, "selectbox", "Compare with", "zb")
    _assert_clean(at)
    assert not _widget(at.radio, "Virtual stages").disabled
    # 4 stages x 2 chunks x 4 blocks (schedules.BLOCKS_PER_CHUNK): the model gets 32 layers
    assert any("Model: 32 layers" in c.value for c in at.caption)
    assert _widget(at.metric, "Bubble (theory): interleaved").value == f"{3 / (2 * 8 + 3):.1%}"
    assert _widget(at.metric, "Bubble (theory): zb").value == f"{3 / (3 * 8 + 3):.1%}"
    inter = _timeline_rows(_chart(at, "Planned: interleaved (v = 2)"))
    assert _idle_share(inter) == pytest.approx(3 / 19, abs=1e-12)
    assert {r["label"] for r in inter if r["kind"] == "F" and r["rank"] == 0} >= {"0·c0", "0·c4"}
    zb = _timeline_rows(_chart(at, "Planned: zb"))
    assert _idle_share(zb) == pytest.approx(theory.bubble_fraction("zb", 4, 8), abs=1e-12)
    assert len([r for r in zb if r["kind"] == "W"]) == 4 * 8
    _set(at, "radio", "Virtual stages", 3)
    assert any("Model: 48 layers" in c.value for c in at.caption)
    assert _widget(at.metric, "Bubble (theory): interleaved").value == f"{3 / (3 * 8 + 3):.1%}"
    # 16 micro-batches x 3 chunks: too narrow to label each bar: colour is the micro-batch
    _set(at, "slider", "Micro-batches", 16)
    _assert_clean(at)
    crowded = _chart(at, "Planned: interleaved (v = 3)")
    assert crowded["spec"]["layer"][1]["encoding"]["color"]["field"] == "microbatch"
    assert "colour is the micro-batch" in " ".join(crowded["spec"]["title"]["subtitle"])
    assert len([r for r in _timeline_rows(crowded) if r["kind"] == "F"]) == 4 * 16 * 3
    assert _idle_share(_timeline_rows(crowded)) == pytest.approx(3 / (3 * 16 + 3), abs=1e-12)


def test_bad_combination_shows_the_config_error_and_starts_nothing():
    at = _app(PAGE)
    _set(at, "selectbox", "Schedule", "interleaved")
    _set(at, "slider", "Micro-batches", 6)  # not a multiple of p = 4
    assert not at.exception
    (err,) = at.error
    assert err.value.startswith("interleaved (v = 2): invalid settings: --microbatches 6")
    assert "use a multiple of 4" in err.value and "\n" not in err.value.strip()
    assert at.button[0].disabled
    assert _titles(at) == ["Planned: 1f1b, p = 4, m = 6"]  # the valid one is still drawn
    _set(at, "selectbox", "Compare with", "zb")
    _set(at, "slider", "Micro-batches", 2)  # zero bubble needs m >= p as well
    assert not at.exception
    assert len(at.error) == 2 and any("at least as many micro-batches" in e.value for e in at.error)
    assert not at.get("vega_lite_chart")
    _set(at, "radio", "Pipeline stages", 2)  # p = 2, m = 2: both are fine again
    _assert_clean(at)
    assert not at.button[0].disabled


def test_live_gpipe_vs_1f1b_bubbles_memory_bytes_and_reference(monkeypatch):
    at = _app(PAGE)
    steps = record_steps(monkeypatch)
    at.button[0].click().run()
    _assert_clean(at)
    p, m = 4, 8
    assert_steps(at, steps, [f"{s}: {p} ranks, {m} micro-batches, {trace.PIPELINE_STEPS} steps, "
                             "and the single-process reference…" for s in ("gpipe", "1f1b")])
    shared = len(os.sched_getaffinity(0)) < p if hasattr(os, "sched_getaffinity") else None
    for s in ("gpipe", "1f1b"):
        assert float(_widget(at.metric, f"max |run − reference| (losses, final params): {s}")
                     .value) <= 1e-5
        # first the measurement: the bubble shown is the idle share of the wall-clock step drawn
        wall = _idle_share(_timeline_rows(_chart(at, f"{s}: {WALL}")))
        assert 0 < wall < 1
        assert _percent(at, f"Measured: {s}") == pytest.approx(100 * wall, abs=0.05 + 1e-9)
        assert _widget(at.metric, f"Formula: {s}").value == "27.3%"
        assert 0 < _percent(at, f"Replayed: {s}") < 100
        subtitle = " ".join(_chart(at, f"{s}: {WALL}")["spec"]["title"]["subtitle"])
        if shared is not None:  # the page says whether the 4 ranks had cores of their own
            assert ("ranks shared" in subtitle) == shared and ("core of its own" in subtitle) != shared
    bars = {(r["schedule"], r["source"]): r["bubble"]
            for r in _rows_with(_chart(at, "Pipeline bubble"), "source")}
    assert set(bars) == {(s, src) for s in ("gpipe", "1f1b") for src in (WALL, OWN, "formula")}
    for s in ("gpipe", "1f1b"):
        assert bars[s, "formula"] == theory.bubble_fraction(s, p, m) == pytest.approx(3 / 11)
        assert 0 < bars[s, WALL] < 1 and 0 < bars[s, OWN] < 1
    assert any("Wall clock minus formula, points" in c.value for c in at.caption)

    # the replay of the same runs: no new run, the numbers of the replay drawn
    _set(at, "radio", "View", OWN)
    _assert_clean(at)
    for s in ("gpipe", "1f1b"):
        own = _idle_share(_timeline_rows(_chart(at, f"{s}: {OWN}")))
        assert _percent(at, f"Replayed: {s}") == pytest.approx(100 * own, abs=0.05 + 1e-9)
        assert bars[s, OWN] == pytest.approx(own, abs=1e-9)
    # each timeline its own time axis; the toggle puts both on one
    def domains():
        titles = [t for t in _titles(at) if OWN in t]
        return {t: _chart(at, t)["spec"]["layer"][0]["encoding"]["x"].get("scale") for t in titles}
    assert list(domains().values()) == [None, None]
    _set(at, "toggle", "Same time axis", True)
    shared = [tuple(d["domain"]) for d in domains().values()]
    assert len(shared) == 2 and len(set(shared)) == 1
    _set(at, "toggle", "Same time axis", False)

    # activations: GPipe keeps all m micro-batches on every stage, 1F1B p - r on stage r
    mem = _rows_with(_chart(at, "Activation peak per stage"), "in_flight")
    labels = {(r["source"], r["stage"]): r["in_flight"] for r in mem}
    assert labels == {**{("gpipe", f"rank {r}"): f"{m} in flight" for r in range(p)},
                      **{("1f1b", f"rank {r}"): f"{p - r} in flight" for r in range(p)}}
    peak = {(r["source"], r["stage"]): r["bytes"] for r in mem}
    for r in range(p):
        assert peak["gpipe", f"rank {r}"] > peak["1f1b", f"rank {r}"]
    assert peak["1f1b", "rank 0"] > peak["1f1b", "rank 3"]
    assert _chart(at, "Activations in flight per stage: gpipe")
    # p2p: stage 0 sends m activations, the last stage m gradients, the others both
    by_hand = [m * ACT, 2 * m * ACT, 2 * m * ACT, m * ACT]
    for s in ("gpipe", "1f1b"):
        rows = _rows_with(_chart(at, f"Bytes each stage sends per step: {s}"), "source")
        for src in ("counted", "theory"):
            got = {r["stage"]: r["bytes"] for r in rows if r["source"] == src}
            assert got == {f"rank {r}": by_hand[r] for r in range(p)}, (s, src)
        written = {r["stage"]: r["bytes"] for r in rows
                   if r["source"] == "measured (written to sockets)"}  # absent off Linux
        assert written or not os.access("/proc/self/io", os.R_OK)
        for r in range(p) if written else ():  # payloads plus gloo's framing of m or 2m messages
            assert by_hand[r] < written[f"rank {r}"] < by_hand[r] + (by_hand[r] // ACT) * 1024
        assert _widget(at.metric, f"Stages sending exactly the formula's bytes (counted): {s}"
                       ).value == "4 of 4"

    # back to the wall clock: the same numbers
    _set(at, "radio", "View", WALL)
    _assert_clean(at)
    for s in ("gpipe", "1f1b"):
        wall = _idle_share(_timeline_rows(_chart(at, f"{s}: {WALL}")))
        assert _percent(at, f"Measured: {s}") == pytest.approx(100 * wall, abs=0.05 + 1e-9)
    # a knob that changes the runs starts nothing: the page says the result is stale
    _set(at, "slider", "Micro-batches", 4)
    _assert_clean(at)
    assert any("settings changed" in w.value for w in at.warning)
    assert _chart(at, f"gpipe: {WALL}")


def _live_pair(p: int, m: int, first: str, second: str):
    """The page after a live run of `first` beside `second` on p stages, m micro-batches."""
    at = _app(PAGE)
    _set(at, "radio", "Pipeline stages", p)
    _set(at, "slider", "Micro-batches", m)
    _set(at, "selectbox", "Schedule", first)
    _set(at, "selectbox", "Compare with", second)
    at.button[0].click().run()
    _assert_clean(at)
    return at


def test_live_interleaved_vs_zero_bubble_on_two_stages():
    p, m, v = 2, 4, 2
    at = _live_pair(p, m, "interleaved", "zb")
    assert float(_widget(at.metric, "max |run − reference| (losses, final params): interleaved")
                 .value) <= 1e-5
    assert float(_widget(at.metric, "max |run − reference| (losses, final params): zb")
                 .value) <= 1e-5
    assert _widget(at.metric, "Formula: interleaved").value == f"{1 / (v * m + 1):.1%}"
    bars = {(r["schedule"], r["source"]): r["bubble"]
            for r in _rows_with(_chart(at, "Pipeline bubble"), "source")}
    assert bars["interleaved (v = 2)", "formula"] == pytest.approx(1 / 9)
    # zero bubble's formula takes the measured F, B, W times: below 1F1B's (p-1)/(m+p-1)
    assert 0 < bars["zb", "formula"] < theory.bubble_fraction("1f1b", p, m)
    # the wall clock first: with 2 ranks and 2 cores or more, each rank had a core of its own
    for lab in ("interleaved (v = 2)", "zb"):
        chart = _chart(at, f"{lab}: {WALL}")
        if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= p:
            assert "core of its own" in " ".join(chart["spec"]["title"]["subtitle"])
        assert _percent(at, f"Measured: {lab.split(' ')[0]}") == pytest.approx(
            100 * _idle_share(_timeline_rows(chart)), abs=0.05 + 1e-9)
    assert len([r for r in _timeline_rows(_chart(at, f"zb: {WALL}")) if r["kind"] == "W"]) == p * m
    _set(at, "radio", "View", OWN)
    inter = _timeline_rows(_chart(at, f"interleaved (v = 2): {OWN}"))
    assert {(r["rank"], r["chunk"]) for r in inter if r["kind"] == "F"} == {
        (0, 0), (0, 2), (1, 1), (1, 3)}
    zb = _timeline_rows(_chart(at, f"zb: {OWN}"))
    assert len([r for r in zb if r["kind"] == "W"]) == p * m
    for lab in ("interleaved (v = 2)", "zb"):
        own = _idle_share(_timeline_rows(_chart(at, f"{lab}: {OWN}")))
        assert bars[lab, OWN] == pytest.approx(own, abs=1e-9)
    # interleaved: 4 chunks on 2 ranks, 3 boundaries crossed twice by each micro-batch: 3m each
    rows = _rows_with(_chart(at, "Bytes each stage sends per step: interleaved"), "source")
    written = [r["bytes"] for r in rows if r["source"] == "measured (written to sockets)"]
    assert {(r["stage"], r["source"]): r["bytes"] for r in rows if r["source"] != (
        "measured (written to sockets)")} == {
        (f"rank {r}", src): 3 * m * ACT for r in range(p) for src in ("counted", "theory")}
    assert all(3 * m * ACT < b < 3 * m * (ACT + 1024) for b in written)  # gloo's framing on top
    labels = {(r["source"], r["stage"]): r["in_flight"]
              for r in _rows_with(_chart(at, "Activation peak per stage"), "in_flight")}
    assert labels["zb", "rank 0"] == f"{p} in flight"  # 1F1B's count, W's queued behind B


def test_dualpipe_plans_and_refusal():
    """DualPipe beside DualPipeV, planned: each F&B pair drawn as one unit (the report's count), the
    drawn plan idles exactly the report's (PP/2-1)(F&B+B-3W) share with F = B = W = 1: (p-2)/(3m+p-2)
    for DualPipe's p stages, (p-1)/(3m+p-1) for DualPipeV's 2p chunks; m below 2p is refused."""
    at = _app(PAGE)
    _set(at, "selectbox", "Schedule", "dualpipe")
    _set(at, "selectbox", "Compare with", "dualpipev")
    _assert_clean(at)
    p, m = 4, 8
    # one model for both: 2p chunks of 4 blocks for DualPipeV, p stages of 8 for DualPipe
    assert any("Model: 32 layers" in c.value and "8 layer(s) per chunk (dualpipe), 4 layer(s) per "
               "chunk (dualpipev)" in c.value for c in at.caption)
    want = {"dualpipe": (p - 2) / (3 * m + p - 2), "dualpipev": (p - 1) / (3 * m + p - 1)}
    for s, share in want.items():
        (metric,) = [w for w in at.metric if w.label == f"Bubble (theory): {s}"]
        assert metric.value == f"{share:.1%}"
        (chart,) = [c for c in _charts(at) if c["spec"].get("usermeta", {}).get("title", str(
            c["spec"]["title"]["text"])).startswith(f"Planned: {s},")]
        rows = _timeline_rows(chart)
        assert _idle_share(rows) == pytest.approx(share, abs=1e-12)
        assert "F&B pair" in " ".join(chart["spec"]["title"]["subtitle"])
    # DualPipe: micro-batches 0-3 go down from rank 0, 4-7 come up from rank 3
    dual = _timeline_rows(_chart(at, "Planned: dualpipe,"))
    assert {r["microbatch"] for r in dual if r["kind"] == "F" and r["rank"] == 0 and r["chunk"] == 0} \
        == {0, 1, 2, 3}
    assert {r["microbatch"] for r in dual if r["kind"] == "F" and r["rank"] == 3 and r["chunk"] == 4} \
        == {4, 5, 6, 7}
    _set(at, "slider", "Micro-batches", 6)  # below 2p = 8
    assert not at.exception and len(at.error) == 2
    assert all("needs at least 2 x pp = 8" in e.value for e in at.error)
    assert at.button[0].disabled


@pytest.mark.slow
def test_live_dualpipe_vs_dualpipev_on_two_stages():
    """Both DualPipes run live on the page: equal to the reference, the wall-clock bubble shown is
    the drawn timeline's idle share, and every stage sends exactly the bytes theory predicts
    (DualPipe's include the exchange of the two copies' gradients)."""
    p, m = 2, 4
    at = _live_pair(p, m, "dualpipe", "dualpipev")
    for lab in ("dualpipe", "dualpipev"):
        (diff,) = [w for w in at.metric if w.label == f"max |run − reference| (losses, final params): {lab}"]
        assert float(diff.value) <= 1e-5
        (exact,) = [w for w in at.metric
                    if w.label == f"Stages sending exactly the formula's bytes (counted): {lab}"]
        assert exact.value == f"{p} of {p}"
        (chart,) = [c for c in _charts(at) if str(c["spec"].get("usermeta", {}).get("title", c["spec"]["title"]["text"])) == f"{lab}: {WALL}"]
        (measured,) = [w for w in at.metric if w.label == f"Measured: {lab}"]
        assert float(measured.value.rstrip("%")) == pytest.approx(
            100 * _idle_share(_timeline_rows(chart)), abs=0.05 + 1e-9)
