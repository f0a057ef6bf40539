"""Mixture of experts with sequence parallel (--experts with --sp, issue #13 item 1).

Under sp a tp rank holds a contiguous 1/tp of every sequence (of its cp rank's part under cp), and
its MoE layers dispatch only those tokens: the ranks all-gather their router logits over tp (and
cp), route the whole sequences alike and keep their own tokens' decisions (parallel/expert.py
WholeSequences); router and expert gradients are summed over tp. Every run here equals the
single-process reference (fp32, 1e-5), counts per axis exactly the bytes theory predicts (the
logits' all-gather and the expert gradients' all-reduce over tp included), routes every token
exactly once over all ranks (per expert, the reference's routed and kept counts; the load chart
of viz/experts.py too) and dispatches over ep exactly the rows it kept.
"""
import pytest

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.moe import capacity
from parallel_mini.course.viz import experts as vx

from test_composition import check
from test_experts import moe_config, reference_logs


def _per_expert(logs) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """(step, layer) -> (assignments routed per expert, kept per expert), summed over `logs`."""
    out: dict = {}
    for log in logs:
        for e in log:
            routed, kept = out.setdefault((e["step"], e["layer"]), ([0] * len(e["routed"]),
                                                                   [0] * len(e["kept"])))
            for i, (r, k) in enumerate(zip(e["routed"], e["kept"])):
                routed[i] += r
                kept[i] += k
    return out


def check_moe_sp(report) -> dict:
    """check(), plus the routing and the all-to-alls; returns the reference's _per_expert."""
    check(report)  # the reference, every axis's bytes (tp, cp, dp, ...) and states
    cfg = RunConfig.from_dict(report.config)
    # every rank routes its own tokens (tp ranks too): together, each token once
    logs = [r["moe"]["log"] for r in report.ranks if "moe" in r]
    reference = _per_expert(reference_logs(cfg))
    assert _per_expert(logs) == reference
    for r in report.ranks:
        gathers = [rec for rec in r["comm"] if rec.get("layer") == "moe_routing"]
        assert {rec["group"] for rec in gathers} == {"tp"} | ({"cp"} if cfg.cp > 1 else set())
        if cfg.ep > 1:  # the rows this rank dispatched are the assignments its routing kept
            again = cfg.checkpointing == "full"
            sent = sum(sum(rec["in_splits"]) for rec in r["comm"] if rec.get("layer") == "moe"
                       and rec["step"] >= 0 and rec["phase"] == "dispatch" and "pass" not in rec)
            assert sent == (1 + again) * sum(sum(e["kept"]) for e in r["moe"]["log"])
    return reference


@pytest.mark.parametrize("kw", [
    dict(tp=2, sp=True),
    dict(dp=2, ep=2, tp=2, sp=True),
], ids=repr)
def test_experts_with_sp(kw):
    report = run(moe_config(**kw))
    reference = check_moe_sp(report)
    # the load chart counts each token once (every tp rank's shard) against the step's capacity
    cfg, rep = report.config, report.to_dict()
    for (step, layer), (routed, kept) in reference.items():
        df, cap = vx.expert_load_frame(rep, layer, step)
        assert df.groupby("status")["assignments"].sum().to_dict() == {
            "kept": sum(kept), "dropped": sum(routed) - sum(kept)}
        assert cap == capacity(cfg["seq"], cfg["experts"], cfg["top_k"],
                               cfg["capacity_factor"]) * cfg["batch"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(tp=4, sp=True, top_k=1, capacity_factor=1.0),
    dict(tp=2, sp=True, checkpointing="full", grad_accum=2),
    dict(dp=2, ep=2, tp=2, sp=True, checkpointing="full", zero=2),
    dict(tp=2, sp=True, checkpointing="selective", moe_every=2),
    dict(dp=2, tp=2, sp=True, zero=3),
    dict(cp=2, tp=2, sp=True, cp_impl="ring"),
    dict(cp=2, tp=2, sp=True, ep=2, cp_impl="zigzag"),
    dict(dp=2, cp=2, tp=2, sp=True, ep=4, cp_impl="zigzag", zero=1),
    dict(cp=2, tp=2, sp=True, cp_impl="ulysses"),
    dict(tp=2, sp=True, pp=2, schedule="1f1b"),
    dict(dp=2, tp=2, sp=True, pp=2, ep=2, schedule="1f1b"),
    dict(cp=2, tp=2, sp=True, pp=2, ep=2, schedule="gpipe", cp_impl="zigzag"),
], ids=repr)
def test_experts_with_sp_matrix(kw):
    check_moe_sp(run(moe_config(**kw)))
