"""Data parallelism (parallel/data.py) equals the single-process reference, moves the bytes theory
says, overlaps communication with backward when bucketed, and makes differently initialised ranks
agree through its start-up broadcast."""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from parallel_mini import engine, theory
from parallel_mini.runtime import launch
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.model import build_model
from parallel_mini.reference import train_reference

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not import this file

# ~30k parameters (120 KB of gradients); 20 KB buckets give several buckets per step
SMALL = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8, steps=3, bucket_mb=0.02)
P = theory.gpt_param_count(64, 16, 32, 2)
TOL = 1e-5  # DESIGN.md: fp32 losses and final parameters within 1e-5


@pytest.fixture(scope="module")
def reference():
    """The reference runs the whole global batch at once: one for every layout below."""
    return train_reference(RunConfig(**SMALL).validate())


def _check_against_reference(report, ref_losses):
    assert report.max_abs_diff is not None and report.max_abs_diff <= TOL, report.max_abs_diff_detail
    assert report.max_abs_diff_detail["params"] <= TOL
    assert len(report.losses) == len(ref_losses)
    assert max(abs(a - b) for a, b in zip(report.losses, ref_losses)) <= TOL, \
        (report.losses, ref_losses)


def _check_wire_bytes(report, cfg):
    n = cfg.dp
    expected = 2 * (n - 1) * 4 * P // n  # 2(N-1)/N * gradient bytes, written out
    assert report.theory["wire_bytes_per_step"]["dp"] == expected
    for rank in range(n):
        per_step = {}
        for rec in report.ranks[rank]["comm"]:
            if rec["step"] >= 0:
                assert rec["group"] == "dp"
                per_step[rec["step"]] = per_step.get(rec["step"], 0) + rec["wire_bytes_model"]
        assert [per_step.get(s, 0) for s in range(cfg.steps)] == [expected] * cfg.steps, \
            f"rank {rank}: wire bytes per step {per_step}, theory {expected}"
        assert report.wire_bytes_per_step(rank).get("dp", 0) == expected
        # every gradient element is all-reduced exactly once per step
        payload = sum(rec["payload_bytes"] for rec in report.ranks[rank]["comm"]
                      if rec["step"] == 0 and rec["op"] == "all_reduce")
        assert payload == (4 * P if n > 1 else 0)


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["naive", "bucketed"])
def test_dp_equals_reference_and_theory(mode, dp, grad_accum, reference):
    cfg = RunConfig(dp=dp, dp_mode=mode, grad_accum=grad_accum, reference=True,
                    **SMALL).validate()
    report = launch.run(cfg)
    _check_against_reference(report, reference[0])
    _check_wire_bytes(report, cfg)
    for r in report.ranks:  # every rank logged the same global loss
        assert r["losses"] == report.losses
    setup = [rec for rec in report.ranks[0]["comm"] if rec["step"] == -1]
    if dp > 1:  # rank 0 heads the broadcast chain: it sends every parameter once
        assert {rec["op"] for rec in setup} == {"broadcast"}
        weights = [rec for rec in setup if rec.get("kind") != "bucket-order"]
        assert sum(rec["payload_bytes"] for rec in weights) == sum(rec["wire_bytes_model"] for rec in weights) == 4 * P
        # bucketed: after the first step, the order gradients became ready (one int64 per tensor)
        order = [rec for rec in setup if rec.get("kind") == "bucket-order"]
        n_tensors = sum(1 for _ in engine.build_model(cfg).parameters())
        assert [rec["payload_bytes"] for rec in order] == ([8 * n_tensors] if mode == "bucketed" else [])
    else:
        assert setup == []


def test_dp_on_8_ranks():
    cfg = RunConfig(dp=8, layers=1, d_model=16, heads=2, seq=8, vocab=32, batch=8, steps=2,
                    bucket_mb=0.005, reference=True).validate()
    report = launch.run(cfg)
    assert report.world_size == 8
    assert report.max_abs_diff <= TOL, report.max_abs_diff_detail
    n_params = theory.gpt_param_count(32, 8, 16, 1)
    for r in report.ranks:
        assert report.wire_bytes_per_step(r["rank"])["dp"] == 2 * 7 * 4 * n_params // 8


def _sum_without_dividing(params, comm):
    """A learner's bug for naive mode: sums the gradients but forgets to divide by N."""
    for p in params:
        comm.all_reduce(p.grad, "dp")


def test_a_wrong_average_is_caught():
    """The comparison with the reference can fail: summing instead of averaging is far off."""
    cfg = RunConfig(dp=2, dp_mode="naive", reference=True, **SMALL).validate()
    report = launch.run(cfg, average_fn=_sum_without_dividing)
    assert report.max_abs_diff > 1e-3


# ---------------------------------------------------------------------------------------------
# when bytes move: overlap in bucketed mode, none in naive mode, only the last micro-step syncs
# ---------------------------------------------------------------------------------------------
def _backward_events(rank, step):
    return sorted((e for e in rank["events"] if e["kind"] == "backward" and e["step"] == step),
                  key=lambda e: e["microbatch"])


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_bucketed_all_reduces_overlap_backward(grad_accum):
    cfg = RunConfig(dp=2, dp_mode="bucketed", grad_accum=grad_accum, **SMALL).validate()
    report = launch.run(cfg)
    for rank in report.ranks:
        for step in range(cfg.steps):
            recs = [rec for rec in rank["comm"] if rec["step"] == step and rec["op"] == "all_reduce"]
            backward = _backward_events(rank, step)
            assert len(backward) == grad_accum
            last = backward[-1]
            assert len(recs) >= 2, "several buckets expected with 20 KB buckets"
            assert [rec["bucket"] for rec in recs] == list(range(len(recs)))  # launched in order
            assert all(rec["async_op"] is True and "end" in rec for rec in recs)
            assert sum(rec["payload_bytes"] for rec in recs) == 4 * P
            # launched from gradient hooks, while backward is still running
            assert all(last["start"] <= rec["start"] <= last["end"] for rec in recs), \
                (last, [rec["start"] for rec in recs])
            # the first bucket starts before the last one: backward went on in between
            assert recs[0]["start"] < recs[-1]["start"]
            # no_sync: the earlier micro-steps' backward moved no bytes
            for early in backward[:-1]:
                assert all(rec["start"] > early["end"] for rec in recs)


def test_naive_all_reduces_start_after_backward():
    cfg = RunConfig(dp=2, dp_mode="naive", grad_accum=2, **SMALL).validate()
    report = launch.run(cfg)
    n_tensors = len(list(build_model(cfg).parameters()))
    for rank in report.ranks:
        for step in range(cfg.steps):
            recs = [rec for rec in rank["comm"] if rec["step"] == step and rec["op"] == "all_reduce"]
            last = _backward_events(rank, step)[-1]
            assert len(recs) == n_tensors  # one blocking all-reduce per parameter
            assert all(rec["async_op"] is False and rec["start"] >= last["end"] for rec in recs)


# ---------------------------------------------------------------------------------------------
# the start-up broadcast
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["naive", "bucketed"])
def test_startup_broadcast_makes_differently_initialised_ranks_agree(mode, reference):
    cfg = RunConfig(dp=2, dp_mode=mode, reference=True, **SMALL).validate()
    # init_seed_offset=1: rank r builds its model from seed + r, so rank 1 starts elsewhere
    outs = [res.value for res in run_ranks(engine.train_rank, 2, cfg.to_dict(), 1)]
    assert outs[0]["losses"] == outs[1]["losses"]
    detail = outs[0]["max_abs_diff"]
    assert detail["params"] <= TOL and detail["losses"] <= TOL, detail
    assert max(abs(a - b) for a, b in zip(outs[0]["losses"], reference[0])) <= TOL
