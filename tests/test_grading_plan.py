"""The graders of lessons 08 and 09 (parallel_mini/course/grading/lesson08_09_layouts.py): model
states per rank of a composed layout (check_states_per_rank) and a layout that fits a memory
budget (check_layout_choice).

Each checker must accept the right answer (with a live run whose measured bytes equal it), say
"not attempted" to a stub, name each typical mistake, and refuse an answer that calls the library
functions it disables, restoring them afterwards. The wrong answers fail before any rank starts;
each correct answer costs one small live run.
"""
from __future__ import annotations

import pytest

from parallel_mini import theory
from parallel_mini.course import planner
from parallel_mini.config import RunConfig
from parallel_mini.course.grading import (LAYOUT_MODEL, check_layout_choice, check_states_per_rank,
                                   layout_candidates, layout_config, planned_states)
from parallel_mini.course.grading import lesson08_09_layouts as layouts

STATES = ("params", "grads", "optimizer")


# ---------------------------------------------------------------------------------------------
# lesson 08: states_per_rank
# ---------------------------------------------------------------------------------------------
def _stage_params(cfg) -> list[int]:
    """Parameters on one tp rank of each pipeline stage, counted module by module (theory is
    disabled while an answer runs, so this cannot use it): QKV and fc column-parallel (weights
    and biases split), attention-out and proj row-parallel (weights split, biases whole), two
    LayerNorms whole; token table and LM head split over the vocabulary, positions whole."""
    h, v, s, t = cfg.d_model, cfg.vocab, cfg.seq, cfg.tp
    qkv, out, fc, proj, norms = (3 * h * h + 3 * h) // t, h * h // t + h, (4 * h * h + 4 * h) // t, \
        4 * h * h // t + h, 4 * h
    block = qkv + out + fc + proj + norms
    per = cfg.layers // cfg.pp
    return [per * block + (r == 0) * (v * h // t + s * h) + (r == cfg.pp - 1) * (2 * h + h * v // t)
            for r in range(cfg.pp)]


def right_states(cfg, shard_over_cp: bool = True) -> dict:
    n = cfg.dp * (cfg.cp if shard_over_cp else 1)
    out = {}
    for rank in range(cfg.world_size):
        p = _stage_params(cfg)[rank // (cfg.world_size // cfg.pp)]
        q = -(-p // n) * n
        out[rank] = {0: {"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p},
                     1: {"params": 4 * q, "grads": 4 * q, "optimizer": 8 * q // n},
                     2: {"params": 4 * q, "grads": 4 * q // n, "optimizer": 8 * q // n}}[cfg.zero]
    return out


def test_the_checkers_own_rule_is_theory():
    """The rule written out in the grader (theory is disabled while the learner's code runs)
    equals theory.run_theory on every case it grades."""
    for name, fields in layouts.STATES_CASES:
        cfg = RunConfig(**fields).validate()
        assert layouts._states_rule(cfg) == layouts._states_from_theory(cfg) == right_states(cfg), name


def test_states_stub_is_not_attempted():
    def states_per_rank(cfg):
        raise NotImplementedError("exercise: write states_per_rank")
    grade = check_states_per_rank(states_per_rank)
    assert grade.status == "not attempted" and "states_per_rank" in grade.message


def _with(cfg, **changes):
    return RunConfig(**{**cfg.to_dict(), **changes})


def whole_model(cfg):
    return right_states(_with(cfg, tp=1, pp=1, dp=cfg.world_size, cp=1))


def pp_fastest(cfg):  # rank r on stage r % pp
    right = right_states(cfg)
    per = cfg.world_size // cfg.pp
    return {r: right[(r % cfg.pp) * per] for r in right}


def zero_over_dp_only(cfg):
    return right_states(cfg, shard_over_cp=False)


def zero1_shards_grads(cfg):
    right = right_states(cfg)
    n = cfg.dp * cfg.cp
    return {r: {**s, "grads": s["grads"] // n} if cfg.zero == 1 else s for r, s in right.items()}


def missing_rank(cfg):
    right = right_states(cfg)
    right.pop(cfg.world_size - 1)
    return right


@pytest.mark.parametrize("answer, says", [
    (whole_model, "every rank holds the whole model"),
    (pp_fastest, "rank r is on stage r // (world / pp)"),
    (zero_over_dp_only, "not over dp alone"),
    (zero1_shards_grads, "ZeRO-1 shards only the optimizer states"),
    (missing_rank, "one entry per rank"),
    (lambda cfg: {r: {"params": 1.5, "grads": 0, "optimizer": 0} for r in range(cfg.world_size)},
     "whole number"),
    (lambda cfg: [0] * cfg.world_size, "not a dict"),
])
def test_states_mistakes_are_named(answer, says):
    with pytest.raises(AssertionError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_states_per_rank(answer)


def test_states_refuses_the_library_and_restores_it():
    cfg = RunConfig(dp=2, tp=2, pp=2, layers=2)
    before = theory.run_theory(cfg, 0)["memory"]

    def calls_theory(cfg):
        th = theory.run_theory(cfg, 0)
        return {r: th["memory"] for r in range(cfg.world_size)}

    with pytest.raises(AssertionError, match="theory.run_theory, which the checker disables"):
        check_states_per_rank(calls_theory)
    from parallel_mini.runtime.launch import run as engine_run
    with pytest.raises(AssertionError, match="launch.run, which the checker disables"):
        check_states_per_rank(lambda cfg: engine_run(cfg))
    assert theory.run_theory(cfg, 0)["memory"] == before  # restored


def test_states_right_answer_is_correct_and_measured():
    """One small live run (2 ranks, ZeRO-1) in place of the lesson's 8-rank one."""
    grade = check_states_per_rank(right_states, live=dict(dp=2, zero=1, layers=2, steps=1))
    assert grade.status == "correct", grade
    report = grade.details["report"]
    assert all({k: r["memory"][k] for k in STATES} == grade.details["predicted"][r["rank"]]
               for r in report.ranks)


# ---------------------------------------------------------------------------------------------
# lesson 09: choose_layout
# ---------------------------------------------------------------------------------------------
def _fullest(layout) -> int:
    cfg = layout_config(layout)
    th = theory.run_theory(cfg, 0)
    return max(sum(s["memory"][k] for k in STATES) for s in th.get("stages", [th]))


def choose_layout(budget):
    """The rule with theory's per-rank states (allowed in lesson 09): the most dp that fits."""
    for dp in (4, 2, 1):
        for layout in layout_candidates():
            if layout["dp"] == dp and _fullest(layout) <= budget:
                return layout
    return None


def test_planner_memory_model_is_theory_for_every_candidate():
    for layout in layout_candidates():
        cfg = layout_config(layout)
        th = theory.run_theory(cfg, 0)
        want = [sum(s["memory"][k] for k in STATES) for s in th.get("stages", [th])]
        assert planned_states(layout) == want, layout


def test_budgets_exercise_every_branch():
    """Each budget separates something: dp4 at ZeRO 0, 1 or 2 only, dp2 by tp or by pp, dp1,
    nothing at all."""
    picks = {b: choose_layout(b) for b in layouts.LAYOUT_BUDGETS}
    assert [p and (p["dp"], p["zero"]) for p in picks.values()][:3] == [(4, 0), (4, 1), (4, 2)]
    assert picks[1_105_000] == {"dp": 2, "tp": 1, "pp": 2, "zero": 2}  # tp2 x dp2 does not fit
    assert picks[910_000] == {"dp": 1, "tp": 2, "pp": 2, "zero": 0}
    assert picks[800_000] is None


def test_layout_stub_is_not_attempted():
    def stub(budget):
        raise NotImplementedError("exercise: write choose_layout")
    assert check_layout_choice(stub).status == "not attempted"


@pytest.mark.parametrize("answer, says", [
    (lambda b: {"dp": 4, "tp": 1, "pp": 1, "zero": 0}, "does not fit"),
    (lambda b: choose_layout(b) or {"dp": 1, "tp": 4, "pp": 1, "zero": 0}, "does not fit"),
    (lambda b: {"dp": 1, "tp": 2, "pp": 2, "zero": 0}, "dp4 tp1 pp1 ZeRO-0 fits too"),
    (lambda b: None, "something fits"),
    (lambda b: {"dp": 4, "tp": 1, "pp": 1, "zero": 3}, "ZeRO-3 is outside"),
    (lambda b: {"dp": 2, "tp": 1, "pp": 1, "zero": 0}, "the job has 4"),
    (lambda b: (4, 1, 1, 0), "exactly the keys"),
    (lambda b: planner.plan(planner.toy_model(), 4, planner.hardware("cpu")),
     "planner.plan, which the checker disables"),
])
def test_layout_mistakes_are_named(answer, says):
    with pytest.raises(AssertionError, match=says):
        check_layout_choice(answer)


def test_layout_pipeline_stage_zero_is_named():
    """dp2 x pp2 at ZeRO-1 overflows 1,310,000 bytes on stage 0 only (it holds the embeddings)."""
    with pytest.raises(AssertionError, match="pipeline stage 0, the one with the embeddings"):
        check_layout_choice(lambda b: {"dp": 2, "tp": 1, "pp": 2, "zero": 1}, budgets=(1_310_000,))


def test_layout_right_answer_is_correct_and_measured():
    grade = check_layout_choice(choose_layout, live=(1_105_000,))
    assert grade.status == "correct", grade
    (row,) = grade.details["runs"]
    assert row["layout"] == {"dp": 2, "tp": 1, "pp": 2, "zero": 2}
    assert row["measured_max"] == max(planned_states(row["layout"])) <= 1_105_000
    assert planner.predict.__code__.co_name == "predict"  # restored
