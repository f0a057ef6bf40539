"""The decision guide's toy version (parallel_mini.course.guide.toy_version): a recommendation turned into
a layout of parallel_mini's GPT on a few local ranks, the planner's prediction for it and the
RunConfig that runs it. Lesson 09 runs it live; here the layout is checked against the guide and
the planner's memory model against theory, and one 2-rank run against the prediction, to the byte.

(The guide's rule itself, recommend / departures / fact_answers, is tested with the app page that
walks it: tests/test_app_plan.py.)
"""
from __future__ import annotations

import pytest

from parallel_mini import theory
from parallel_mini.course import guide
from parallel_mini.runtime.launch import run

STATES = ("params", "grads", "optimizer")


def test_long_sequences_that_fit_give_a_toy_layout_with_context_parallel():
    rec = guide.recommend({"fits": "states_only", "long": "yes"})
    toy = guide.toy_version(rec, 2, steps=3)
    lay, cfg = toy.layout, toy.config
    assert toy.departures == [] and guide.follows(lay, rec)
    assert (lay.dp, lay.cp, lay.tp, lay.pp) == (1, 2, 1, 1) and lay.zero in (1, 2)
    assert cfg.world_size == 2 and (cfg.cp, cfg.zero) == (2, lay.zero)
    assert cfg.steps == 3 and cfg.reference and cfg.seq == guide.TOY_MODEL["seq"]
    cfg.validate()  # RunConfig accepts it before any rank starts
    # the planner's memory model is theory's: the same bytes per rank for the same config
    states = theory.run_theory(cfg, 0)["memory"]
    assert {k: toy.prediction["memory_per_rank"][0][k] for k in STATES} == \
        {k: states[k] for k in STATES}


def test_a_toy_too_small_for_the_guide_says_what_it_lacks():
    """Split the model and split the sequences, on 2 ranks and without ZeRO-3 (slow link): no
    layout does both, so the closest one lacks one choice, and says which."""
    rec = guide.recommend({"fits": "no", "long": "yes", "link": "slow"})
    toy = guide.toy_version(rec, 2)
    assert len(toy.departures) == 1
    assert toy.departures == guide.departures(toy.layout, rec)
    assert toy.departures[0] in ("context parallel", "the model split (tp or pp)")


def test_a_mixture_of_experts_gets_the_toys_experts():
    toy = guide.toy_version(guide.recommend({"moe": "yes"}), 2)
    assert toy.layout.ep == 2 and toy.departures == []
    assert toy.config.experts == guide.TOY_EXPERTS["experts"]
    assert toy.config.top_k == guide.TOY_EXPERTS["top_k"]


@pytest.mark.parametrize("ranks", [0, -2, 2.0, True, "4"])
def test_bad_rank_counts_are_refused_in_one_line(ranks):
    with pytest.raises(ValueError, match=r"ranks = .*whole number of local ranks"):
        guide.toy_version(guide.recommend({}), ranks)


def test_the_toy_version_runs_and_its_states_equal_the_prediction():
    """One live run on 2 ranks (ZeRO 1 or 2 over dp 2): every rank's measured model states equal
    the planner's prediction, and memory_rows pairs each measured number with theory's."""
    toy = guide.toy_version(guide.recommend({"fits": "states_only"}), 2, steps=2)
    assert (toy.layout.dp, toy.layout.zero in (1, 2)) == (2, True)
    report = run(toy.config)
    assert report.max_abs_diff <= 1e-5
    assert toy.states_equal(report.ranks) == 2
    rows = toy.memory_rows(report.ranks)
    assert len(rows) == 2 * 4 * 2  # ranks x (3 states + activations) x (measured, theory)
    for r in report.ranks:
        measured = {x["category"]: x["bytes"] for x in rows
                    if x["rank"] == r["rank"] and x["source"] == "measured"}
        theory_ = {x["category"]: x["bytes"] for x in rows
                   if x["rank"] == r["rank"] and x["source"] == "theory"}
        assert measured == {**{k: r["memory"][k] for k in STATES},
                            "activations": r["memory"]["activations_peak"]}
        assert {k: theory_[k] for k in STATES} == {k: measured[k] for k in STATES}
    broken = [{**r, "memory": {**r["memory"], "grads": r["memory"]["grads"] + 4}}
              for r in report.ranks[:1]] + report.ranks[1:]
    assert toy.states_equal(broken) == 1  # the count can fail
