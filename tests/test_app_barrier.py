"""The "Without a barrier" page, driven headless with AppTest. Nothing runs before "Run live"; one
press (a 3x straggler on rank 3, no bound, H = 4, A = 10, E = 4: five live runs) puts on the page
what the runs recorded, checked here against the reports themselves: the staleness histogram's
bars are the server's counted updates (they add up to steps x workers) with theory's W - 1 = 2
beside them, the loss-against-time chart has one point per update of each run, local SGD's bytes
per sample are 1/H of DDP's (counted) next to theory's 1/H, and FedAvg's chart has one point per
round; a changed control marks the results stale."""
from __future__ import annotations

import pytest
import streamlit as st

from test_app import _app, _assert_clean, _charts, _metric, _widget

PAGE = "app_pages/barrier.py"


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _titled(at, start: str) -> dict:
    found = [c for c in _charts(at)
             if (c["spec"].get("usermeta", {}).get("title") or c["spec"]["title"]["text"]
                 ).startswith(start)]
    assert len(found) == 1, [c["spec"]["title"] for c in _charts(at)]
    return found[0]


def _rows(chart: dict) -> list[dict]:
    return [r for rows in chart["datasets"].values() for r in rows]


def test_page_before_any_run():
    at = _app(PAGE)
    _assert_clean(at)
    assert at.title[0].value == "Without a barrier"
    assert [b.label for b in at.button] == ["Run live"]
    assert any("Press **Run live**" in i.value for i in at.info)
    assert not at.get("vega_lite_chart")


@pytest.mark.slow  # five live runs (~25 s at load 15)
def test_live_run_draws_what_the_runs_recorded():
    at = _app(PAGE)
    at.button[0].click().run()
    _assert_clean(at)
    hist = _rows(_titled(at, "Staleness of the applied updates"))
    bars = [r for r in hist if "updates" in r]
    assert sum(r["updates"] for r in bars) == 6 * 3  # steps x workers, counted by the server
    rules = {r["what"]: r["at"] for r in hist if "what" in r}
    assert any(w.startswith("theory mean 2") for w in rules), rules  # W - 1, 3 workers
    counted = sum(r["staleness"] * r["updates"] for r in bars) / 18
    assert float(_metric(at, "Mean staleness: counted")) == pytest.approx(counted, abs=0.005)
    assert _metric(at, "Mean staleness: theory") == "2"
    assert _metric(at, "Async ÷ sync: theory") == f"{(3 * (3 - 1) + 1) / 4:.2f}"  # (F(W-1)+1)/(W+1)
    time_rows = _rows(_titled(at, "Loss against the wall clock"))
    assert sorted({r["run"] for r in time_rows}) == ["async", "sync DP"]
    assert sum(r["run"] == "sync DP" for r in time_rows) == 6
    assert sum(r["run"] == "async" for r in time_rows) == 18
    assert float(_metric(at, "Bytes per sample, local SGD ÷ DDP: counted")) == 0.25
    assert _metric(at, "theory: 1/H") == "0.250"
    assert len(_rows(_titled(at, "Federated averaging"))) >= 6
    assert _metric(at, "Data bytes that left a client (counted)") == "0"
    assert "DIFFERENT" not in str(at.get("metric"))
    _widget(at.radio, "Local SGD: sync every H steps").set_value(2).run()
    assert any("The settings changed" in w.value for w in at.warning)
