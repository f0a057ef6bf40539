"""The "This machine's links" page, driven headless with AppTest: nothing runs until Run live; a
press times the chosen collective on real ranks (one op, 2 ranks, sizes up to 64 KiB: ~1 s warm),
the chart carries what they measured and the fitted line, the fit table says the fitted α and B,
and moving the comparison's controls redraws the theory at once without starting ranks."""
from __future__ import annotations

from parallel_mini.course import links
from test_app import (_app, _assert_clean, _chart, _fresh_cache,  # noqa: F401 (autouse)
                      _rows_with, _widget, record_steps)

PAGE = "app_pages/links.py"


def test_links_page_runs_the_sweep_live_and_compares_the_links(monkeypatch):
    at = _app(PAGE)
    _assert_clean(at)
    assert any("Run live" in i.value for i in at.info) and not at.get("vega_lite_chart")

    _widget(at.multiselect, "Operations").set_value(["all_reduce"])
    _widget(at.select_slider, "Largest message").set_value(2 ** 16)
    at.run()
    texts = record_steps(monkeypatch)
    calls = []
    measure = links.measure_links
    monkeypatch.setattr(links, "measure_links",
                        lambda *a, **kw: calls.append(a) or measure(*a, **kw))
    at.button[0].click().run()
    _assert_clean(at)
    sizes = [4 ** k for k in range(1, 9)]  # 4 B to 64 KiB, x4 each step
    assert calls == [(2, sizes, ["all_reduce"], 5)]
    assert texts[-1] == "Step 1 of 1: done"

    chart = _chart(at, "This machine's links: 2 ranks, 1 operation")
    dots = [r for r in _rows_with(chart, "measured_s")]
    # fp32 elements, a multiple of the 2 ranks, at least 2: 4 B is timed as 8 B
    assert sorted(r["bytes"] for r in dots) == [4 * max(2, s // 4 // 2 * 2) for s in sizes]
    assert all(0 < r["min_s"] <= r["measured_s"] <= r["max_s"] for r in dots)
    row = at.dataframe[0].value.iloc[0]  # the fit table
    assert row["operation"] == "all-reduce" and row.iloc[3] == "2, 1"  # 2(N-1) hops, 2(N-1)/N

    # the comparison: theory, redrawn at once: no ranks start
    cmp = _chart(at, "One all-reduce of 256 MiB on 8 ranks")
    assert {r["kind"] for r in _rows_with(cmp, "kind")} == {
        "measured here, fitted α–β", "vendor bandwidth, assumed latency (theory)"}
    _widget(at.select_slider, "Ranks N").set_value(1024)
    _widget(at.select_slider, "All-reduce size").set_value(2 ** 10)
    at.run()
    _assert_clean(at)
    cmp = _chart(at, "One all-reduce of 1 KiB on 1024 ranks")
    assert [r["link"] for r in _rows_with(cmp, "kind")][0] == "this machine (gloo, 1024 ranks)"
    assert len(calls) == 1
