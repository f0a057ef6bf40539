"""The "Plan a run" page (AppTest) and what it is built on: the decision guide's rule
(parallel_mini.course.guide, pure Python) and the ranked-layout chart's frames (parallel_mini.course.viz.plan).

One AppTest session (one page load, one live run: the cheapest way through the page). Before any
run the page draws the planner's ranked layouts for Llama 3 70B on 64 H100s: each bar's memory
parts add up to the planner's predicted total and its step-time parts to the predicted step
(planner.plan called here), and the layout the guide's answers lead to is the best-ranked one that
follows them. Answering the guide changes that layout (long sequences: context parallel; states
that fit: none of 70B's fitting layouts follows such a guide, and the page says so). Ethernet
between nodes changes the planner's ranking as planner.plan does with that link, and the guide's
facts call the link slow. The toy
version, run live on 2 ranks, puts the measured step time beside the planner's, and every rank's
measured model states equal theory.run_theory's to the byte. A custom model whose heads do not
divide its width is refused in one line, its inputs kept."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import streamlit as st

from parallel_mini import theory
from parallel_mini.course import guide, planner
from parallel_mini.course.viz import plan as vplan
from test_app import _app, _assert_clean, _chart, _charts, _metric, _rows_with, _widget

PAGE = "app_pages/plan.py"
RANKED = "Ranked layouts: memory per GPU and step time (theory)"


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


# ---------------------------------------------------------------------------------------------
# the guide's rule, pure Python
# ---------------------------------------------------------------------------------------------
def test_the_guide_turns_answers_into_axes():
    fits = guide.recommend({"fits": "yes"})
    assert (fits.tp, fits.pp, fits.cp, fits.ep, fits.zero) == (False, False, False, False, (0,))
    assert guide.recommend({"fits": "states_only"}).zero == (1, 2)
    split = guide.recommend({"fits": "no"})
    assert split.tp and split.pp and 3 in split.zero
    assert guide.recommend({"fits": "no", "link": "slow"}).zero == (0, 1)  # no ZeRO-3 across nodes
    assert guide.recommend({"long": "yes"}).cp and guide.recommend({"moe": "yes"}).ep
    for answers in itertools.product(*(q[1] for q in guide.QUESTIONS.values())):
        rec = guide.recommend(dict(zip(guide.QUESTIONS, answers)))
        assert len(rec.reasons) == 4  # one line per question
    with pytest.raises(ValueError, match="fits = 'maybe': choose one of yes, states_only, no"):
        guide.recommend({"fits": "maybe"})


def test_follows_and_departures():
    L = planner.Layout
    rec = guide.recommend({"fits": "no", "link": "slow"})
    assert guide.follows(L(8, 8, 4, 1, 1, 1, "1f1b", 1, 8, 1, "full", True), rec)
    assert guide.departures(L(64, 1, 1, 1, 1, 3, "-", 1, 1, 1, "full", False), rec) == [
        "the model split (tp or pp)", "ZeRO 0/1"]  # slow link: ZeRO-3 alone does not do
    fast = guide.recommend({"fits": "no"})
    assert guide.follows(L(64, 1, 1, 1, 1, 3, "-", 1, 1, 1, "full", False), fast)
    assert guide.departures(L(8, 8, 1, 2, 1, 1, "-", 1, 1, 1, "full", True), fast) == [
        "no context parallel"]
    assert guide.follows(L(1, 1, 1, 1, 1, 0, "-", 1, 1, 1, "none", False), guide.recommend({}))


def test_fact_answers():
    gib = 2 ** 30
    assert guide.fact_answers(8 * 10 ** 9, 72 * gib, 8192, 0, 50e9) == {
        "fits": "states_only", "long": "no", "moe": "no", "link": "fast"}  # 128 GB of states
    assert guide.fact_answers(10 ** 9, 72 * gib, 131072, 256, 3e9) == {
        "fits": "yes", "long": "yes", "moe": "yes", "link": "slow"}
    assert guide.fact_answers(70 * 10 ** 9, 72 * gib, 8192, 0, 50e9)["fits"] == "no"


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
def _bar_sums(chart: dict, column: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in _rows_with(chart, column):
        if "part" in row:
            out[row["layout"]] = out.get(row["layout"], 0.0) + row[column]
    return out


def test_ranked_layouts_the_guide_a_live_toy_run_and_bad_input():
    at = _app(PAGE)
    _assert_clean(at)
    assert at.title[0].value == "Plan a run"
    assert [b.label for b in at.button] == ["Run live (toy version)"]
    assert any("Press **Run live (toy version)**" in i.value for i in at.info)
    assert [c["spec"]["title"]["text"] for c in _charts(at)] == [RANKED]

    # every bar is the planner's prediction, its parts adding up to it
    spec, hw = planner.MODELS["llama3-70b"], planner.hardware("h100-80gb")
    res = planner.plan(spec, 64, hw, 1024, 8, top=8)
    chart = _chart(at, RANKED)
    mem, step = _bar_sums(chart, "bytes"), _bar_sums(chart, "seconds")
    for e in res["layouts"]:
        label = vplan.layout_label(e)
        lay = e["layout"]
        assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == 64
        assert mem[label] == pytest.approx(e["theory"]["memory_bytes_per_gpu"]["total"], rel=1e-9)
        assert step[label] == pytest.approx(e["theory"]["step_s"], rel=1e-9)
    assert list(mem)[:8] == [vplan.layout_label(e) for e in res["layouts"]]  # best first
    assert 0 < res["fit"] < res["considered"]  # (1,496 of 4,584 since DualPipe joined the plan)
    assert f"{res['fit']:,} of {res['considered']:,} layouts fit" in " ".join(
        chart["spec"]["title"]["subtitle"])

    # the guide, answered by the facts on a first visit: 70B's states do not fit on one GPU
    assert _widget(at.radio, "Do the model's states fit").value == "no"
    want = guide.first_following(res["all"], guide.recommend({"fits": "no"}))
    assert _metric(at, "Guide's best layout") == f"#{want[0]:,}"
    lay = want[1]
    assert (lay.tp > 1 or lay.pp > 1 or lay.zero == 3) and lay.cp == 1
    assert f"{vplan.layout_label(planner.layout_entry(lay, want[2], want[0]))}" in mem

    # long sequences: the guide's layout takes context parallel
    _widget(at.radio, "Are the sequences long").set_value("yes").run()
    _assert_clean(at)
    long = guide.first_following(res["all"], guide.recommend({"fits": "no", "long": "yes"}))
    assert long[1].cp > 1 and _metric(at, "Guide's best layout") == f"#{long[0]:,}"
    # a model whose states fit needs no split: nothing that follows such a guide fits 70B
    _widget(at.radio, "Do the model's states fit").set_value("yes").run()
    assert any(w.value.startswith(f"None of the {res['fit']:,} layouts that fit in memory follows the guide")
               for w in at.warning)
    assert "dp1 zero0 tp1 pp1 cp2" in at.markdown[-1].value  # the toy still follows it
    assert "follows the guide" in at.markdown[-1].value

    # a slow network between nodes: the planner's numbers follow it, the guide's facts say so
    _widget(at.selectbox, "Network between nodes").set_value(
        "25 Gb Ethernet (3.1 GB/s per GPU)").run()
    _assert_clean(at)
    slow = dataclasses.replace(hw, inter="25 Gb Ethernet", inter_bw=3.125e9)
    top = planner.plan(spec, 64, slow, 1024, 8, top=1)["layouts"][0]
    chart = _chart(at, RANKED)
    assert next(iter(_bar_sums(chart, "bytes"))) == vplan.layout_label(top)
    assert "nodes of 8: 25 Gb Ethernet 3.12 GB/s per GPU between them" in " ".join(
        chart["spec"]["title"]["subtitle"])
    suggested = [c.value for c in at.caption]
    assert "The numbers suggest: slow: Ethernet, a few GB/s per GPU." in suggested

    # the toy version of that layout is the library's (lesson 09's): guide.toy_version
    answers = {k: _widget(at.radio, q).value for k, (q, _) in guide.QUESTIONS.items()}
    toy = guide.toy_version(guide.recommend(answers), 2)
    shown = next(m.value for m in at.markdown if m.value.startswith("**Toy layout:**"))
    assert shown.startswith(f"**Toy layout:** {toy.layout.describe()}: the planner's "
                            f"#{toy.place} of the toy's layouts on 2 ranks that ")
    # run live on 2 ranks: measured beside the planner
    at.button[0].click().run()
    _assert_clean(at)
    assert _metric(at, "Step time: theory (planner)").endswith(" ms")
    measured = _metric(at, "Step time: measured")
    assert float(measured.split()[0]) > 0 and measured.split()[1] in ("ms", "s")
    assert _metric(at, "Ranks whose states equal theory") == "2 of 2"
    # the chart's numbers, checked against theory.run_theory for the run's own config
    chart = _chart(at, "Toy run: memory per rank, measured vs theory")
    rows = _rows_with(chart, "category")
    cfg = toy.config
    th = theory.run_theory(cfg, theory.gpt_param_count(128, 32, 64, 4))
    stages = th["stages"] if cfg.pp > 1 else [th]
    for rank in (0, 1):
        stage = stages[rank // (2 // cfg.pp)]  # pipeline stages outermost in the mesh
        for k in ("params", "grads", "optimizer"):
            got = {r["source"]: r["bytes"] for r in rows
                   if r["rank"] == f"rank {rank}" and r["category"] == k}
            assert got["measured"] == got["theory"] == stage["memory"][k]
        acts = {r["source"]: r["bytes"] for r in rows
                if r["rank"] == f"rank {rank}" and r["category"] == "activations"}
        assert acts["measured"] > 0 and acts["theory"] > 0
    assert "equal within 1e-5" in [m.delta for m in at.metric]

    # a custom model with impossible heads: one line, the inputs kept, nothing drawn
    _widget(at.selectbox, "Model").set_value("custom GPT (layers, width, heads)").run()
    _assert_clean(at)
    _widget(at.number_input, "Attention heads").set_value(48).run()
    assert len(at.error) == 1 and not at.exception
    assert at.error[0].value == ("Invalid settings: hidden size 4,096 is not divisible by 48 "
                                 "attention heads; choose heads that divide it (e.g. 8, 16, 32, "
                                 "64, 128).")
    assert RANKED not in [c["spec"]["title"]["text"] for c in _charts(at)]  # no plan drawn
    assert _widget(at.number_input, "Attention heads").value == 48


@pytest.mark.slow
def test_every_toy_layout_the_guide_can_pick_runs_with_states_equal_to_the_planners():
    """For every answer to the guide and 2 or 4 local ranks, the toy layout the page would run (the
    best-ranked with the fewest departures from the guide) runs here, and every rank's measured
    params/grads/optimizer bytes equal the planner's prediction (planner.validate_on_toy_runs)."""
    picks: dict[bool, set] = {False: set(), True: set()}
    for answers in itertools.product(*(q[1] for q in guide.QUESTIONS.values())):
        rec = guide.recommend(dict(zip(guide.QUESTIONS, answers)))
        for ranks in (2, 4):
            picks[rec.ep].add(guide.toy_version(rec, ranks).layout)
    for moe, layouts in picks.items():
        model = {**guide.TOY_MODEL, **(guide.TOY_EXPERTS if moe else {})}
        res = planner.validate_on_toy_runs(sorted(layouts, key=planner.Layout.describe), steps=3,
                                           model=model)
        assert res["failed"] == 0, [r for r in res["rows"] if "error" in r]
        assert res["states_equal"] == len(layouts), [r["mismatches"] for r in res["rows"]]
