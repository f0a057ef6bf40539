"""The "Experts" page (mixture of experts, expert parallel), driven headless with AppTest. Nothing
runs before "Run live"; a live run (dp 2, ep 2, E = 8, top-2, F = 1.25, 4 steps) puts on the page
what the ranks logged, checked here against counts made by hand: the heatmap's cells are tokens x
k assignments of rank 0's first micro-batch and its dropped ones the metric's, the capacity is
ceil(F s k / E) per sequence and the load chart's rule that times the step's sequences, the load
adds up to every token k times, the all-to-all matrix is symmetric over both passes with the
uniform-routing formula beside it, states equal theory on every rank with the experts 1/P, and the
losses equal the single-process reference. Moving the step slider redraws without a run; the
aux-loss pair (8 steps) draws weight 0 beside the chosen weight; a changed knob marks results
stale."""
from __future__ import annotations

import os

import pytest
import streamlit as st

from parallel_mini import theory
from parallel_mini.config import RunConfig
from parallel_mini.moe import capacity
from test_app import (_app, _assert_clean, _chart, _charts, _metric, _rows_with, _widget,
                      assert_steps, record_steps)

PAGE = "app_pages/experts.py"
E, K, F, P, SEQ, BATCH, STEPS, LAYERS, D = 8, 2, 1.25, 2, 32, 8, 4, 2, 64  # the page's defaults


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _titles(at) -> list[str]:
    """Each chart's title, whole (a title wider than its column is wrapped on the page: its whole
    text is kept in the spec's usermeta, viz.style.fit_width)."""
    return [c["spec"].get("usermeta", {}).get("title") or c["spec"]["title"]["text"]
            for c in _charts(at)]


def _subtitle(chart: dict) -> str:
    sub = chart["spec"]["title"].get("subtitle", "")
    return " ".join(sub) if isinstance(sub, list) else sub


def test_page_before_any_run():
    at = _app(PAGE)
    _assert_clean(at)
    assert at.title[0].value == "Experts"
    assert [b.label for b in at.button] == ["Run live", "Run weight 0 vs 0.05"]
    assert any("Press **Run live**" in i.value for i in at.info)
    assert any("Press **Run weight 0 vs 0.05**" in i.value for i in at.info)
    assert not at.get("vega_lite_chart")


def test_live_run_routing_load_wire_memory_and_the_aux_pair(monkeypatch):
    at = _app(PAGE)
    at.button[0].click().run()
    _assert_clean(at)
    assert _titles(at) == [
        "Routing of rank 0's tokens, layer 0, step 3 (measured)",
        "Load per expert, layer 0, step 3, all ranks (measured)",
        "All-to-all bytes, step 3 (counted from the run's splits)",
        "All-to-all bytes per rank per step: written, counted, uniform routing",
        "Model states per rank: measured vs theory"]

    # --- 1 routing: rank 0's first micro-batch, tokens x k assignments -------------------------
    tokens = BATCH // P * SEQ
    heat = _chart(at, "Routing of rank 0's tokens")
    cells = [r for r in _rows_with(heat, "choice_label") if "mid" not in r]  # not the crosses
    assert len(cells) == tokens * K
    assert sorted({r["token"] for r in cells}) == list(range(tokens))
    assert {r["choice_label"] for r in cells} == {"1st choice", "2nd choice"}
    dropped = sum(not r["kept"] for r in cells)
    assert _metric(at, "Assignments (tokens × k)") == f"{tokens * K:,}"
    assert _metric(at, "Dropped (over capacity), measured") == f"{dropped:,}"
    cap = capacity(SEQ, E, K, F)
    assert cap == 10 and _metric(at, "Capacity per expert per sequence (formula)") == str(cap)

    # --- 2 load: every token of the step k times, the capacity rule ----------------------------
    load = _chart(at, "Load per expert")
    bars = _rows_with(load, "status")
    assert sum(r["assignments"] for r in bars) == BATCH * SEQ * K
    assert len({r["expert"] for r in bars}) == E
    (rule,) = _rows_with(load, "capacity")
    assert rule["capacity"] == cap * BATCH and rule["label"] == f"capacity {cap * BATCH}"
    assert _metric(at, "Capacity for the step") == f"{cap * BATCH:,}"

    # --- 4 the wire: symmetric over both passes; uniform routing by the formula ---------------
    matrix = _chart(at, "All-to-all bytes, step 3")
    m = {(r["src"], r["dst"]): r["bytes"] for r in _rows_with(matrix, "src")}
    assert len(m) == P * P and m[("rank 0", "rank 1")] == m[("rank 1", "rank 0")] > 0
    cfg = RunConfig(dp=P, ep=P, experts=E, top_k=K, capacity_factor=F, layers=LAYERS,
                    seq=SEQ, batch=BATCH, d_model=D, vocab=128, steps=STEPS)
    uniform = theory.ep_wire_bytes_per_step(cfg)
    t = BATCH // P * SEQ  # tokens per rank per step
    assert uniform == LAYERS * (4 * (P - 1) / P * t * K * D * 4 + (P - 1) / P * E * 8)
    bars = _rows_with(_chart(at, "All-to-all bytes per rank"), "source")
    assert [r["bytes"] for r in bars if r["source"].startswith("theory")] == [uniform] * P
    counted = [r["bytes"] for r in bars if r["source"].startswith("counted")]
    # with P = 2 every row one rank sends comes back in the other pass: both send the same
    assert len(counted) == P and counted[0] == counted[1] > 0
    written = [r["bytes"] for r in bars if r["source"] == "measured (written to sockets)"]
    assert len(written) == P or not os.access("/proc/self/io", os.R_OK)
    assert all(counted[0] < w < 2 * counted[0] for w in written)  # the rows + gloo's framing
    assert "forward and backward" in _subtitle(matrix)
    _widget(at.radio, "Exchange").set_value("dispatch")
    _widget(at.radio, "Pass").set_value("forward only").run()
    assert "the dispatch all-to-alls, forward only" in _subtitle(_chart(at, "All-to-all bytes,"))

    # --- 5 memory: theory to the byte, experts 1/P -------------------------------------------
    assert _metric(at, "Ranks whose measured states equal theory") == f"{P} of {P}"
    experts = LAYERS * E * theory.mlp_params(D)
    assert _metric(at, "Expert parameters per rank (theory)") == f"{experts // P:,}"
    assert _metric(at, "All expert parameters (theory)") == f"{experts:,}"
    mem = _rows_with(_chart(at, "Model states per rank"), "bytes")
    rep = sum(r["bytes"] for r in mem if r["who"] == "experts replicated (ep = 1)")
    mine = sum(r["bytes"] for r in mem if r["who"] == "rank 0" and r["source"] == "theory")
    assert rep - mine == 16 * experts * (P - 1) // P  # fp32 Adam: 16 B per parameter
    assert "equal within 1e-5" in [m.delta for m in at.metric]

    # --- the step slider redraws from the same run ---------------------------------------------
    at.select_slider(key="experts_step").set_value(0).run()
    _assert_clean(at)
    assert _titles(at)[0] == "Routing of rank 0's tokens, layer 0, step 0 (measured)"
    assert not at.warning

    # --- 3 the aux-loss pair, 8 steps ---------------------------------------------------------
    _widget(at.select_slider, "Steps per run").set_value(8).run()
    steps = record_steps(monkeypatch)
    _widget(at.button, "Run weight 0 vs 0.05").click().run()
    _assert_clean(at)
    assert_steps(at, steps, ["aux-loss weight 0: 8 steps…", "aux-loss weight 0.05: 8 steps…"])
    steps = _chart(at, "Load balance over the steps, layer 3")
    rows = _rows_with(steps, "max_over_mean")
    assert sorted({r["run"] for r in rows}) == ["aux-loss weight 0", "aux-loss weight 0.05"]
    assert sorted(r["step"] for r in rows if r["run"] == "aux-loss weight 0") == list(range(8))
    assert all(r["max_over_mean"] >= 1 and 1 <= r["aux"] <= E for r in rows)
    assert all(r["dropped_fraction"] == r["dropped"] / (16 * SEQ * K) for r in rows)
    first = [r for r in rows if r["step"] == 0]  # same data and seed: step 0 routes alike
    assert first[0]["max_over_mean"] == first[1]["max_over_mean"]
    assert _metric(at, "aux-loss weight 0: aux loss, last 5 steps")

    # --- a changed knob: both results are kept and marked stale --------------------------------
    _widget(at.select_slider, "Capacity factor").set_value(1.0).run()
    assert len(at.warning) == 2 and all("settings changed" in w.value for w in at.warning)
    assert len(_titles(at)) == 6  # the last results stay drawn under the warnings


def test_ep1_keeps_every_expert_on_every_rank():
    """ep = 1 (dp 2, E = 4, top-1): no all-to-all to draw, every expert's states on every rank."""
    at = _app(PAGE)
    _widget(at.radio, "Expert-parallel ranks").set_value(1)
    _widget(at.radio, "Experts per MoE layer").set_value(4)
    _widget(at.radio, "Experts per token").set_value(1).run()
    at.button[0].click().run()
    _assert_clean(at)
    assert any(i.value.startswith("ep = 1: every rank holds every expert") for i in at.info)
    assert not [t for t in _titles(at) if t.startswith("All-to-all")]
    experts = LAYERS * 4 * theory.mlp_params(D)
    assert _metric(at, "Expert parameters per rank (theory)") == f"{experts:,}"
    assert _metric(at, "All expert parameters (theory)") == f"{experts:,}"
    assert _metric(at, "Ranks whose measured states equal theory") == "2 of 2"
    mem = _rows_with(_chart(at, "Model states per rank"), "bytes")
    assert {r["who"] for r in mem} == {"rank 0", "rank 1"}  # nothing to compare with
    cells = [r for r in _rows_with(_chart(at, "Routing of rank 0's tokens"), "choice_label")
             if "mid" not in r]
    assert len(cells) == BATCH // 2 * SEQ and {r["choice_label"] for r in cells} == {"1st choice"}
