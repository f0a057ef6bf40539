"""Expert parallel with ZeRO-3 and HYBRID_SHARD.

ZeRO-3 makes each MoE layer's experts a unit of their own, sharded, gathered and reduced over the
edp ranks (the experts' replicas), while the rest of each block is a unit over dp x cp
(parallel/zero3.py `apart`: FSDP2's nested fully_shard, as torchtitan shards MoE experts).
HYBRID_SHARD splits edp into edp_shard (an expert's replicas inside one shard group: they shard
its states) x edp_rep (across replicas: they all-reduce the reduced slices), mesh.py. Every run
equals the single-process reference (fp32, 1e-5), drops the tokens the reference drops, and holds,
rank by rank, the model states theory predicts to the byte, with the bytes per axis (check_moe).
"""
from types import SimpleNamespace

import pytest

from parallel_mini import theory
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.mesh import coords_of, grid_shape, plan_groups, role_names
from parallel_mini.model import build_model
from parallel_mini.moe import Experts
from parallel_mini.parallel.zero3 import Zero3DataParallel, plan_units

from test_experts import check_moe, cli_reference_run, moe_config


def _mesh(**kw):
    cfg = SimpleNamespace(**{"pp": 1, "tp": 1, "cp": 1, "dp_shard": 0, **kw})
    return plan_groups(cfg), grid_shape(cfg), role_names(cfg)


# -- the groups, on paper ---------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(dp=8, dp_shard=4, ep=2),  # ep inside a shard group
                                dict(dp=4, dp_shard=2, cp=2, ep=2),  # ep = cp, inside
                                dict(dp=8, dp_shard=2, ep=4),  # ep spans two shard groups
                                dict(dp=4, ep=2)])  # no hybrid: edp_shard is edp
def test_each_experts_replicas_split_into_shard_x_replicate(kw):
    groups, shape, _ = _mesh(**kw)
    for edp in groups["edp"]:
        shards = [g for g in groups["edp_shard"] if g[0] in edp]
        reps = [g for g in groups["edp_rep"] if g[0] in edp]
        assert len(shards) * len(shards[0]) == len(edp) == len(reps) * len(reps[0])
        assert len(shards[0]) * len(reps[0]) == len(edp)  # a product: every replica reached once
        for g in shards:  # inside one replica of the dense model (one shard group)
            assert len({coords_of(r, shape)["dp_rep"] for r in g}) == 1
        for g in reps:  # the same place in every replica
            assert len({(coords_of(r, shape)["dp_shard"], coords_of(r, shape)["cp"])
                        for r in g}) == 1


def test_expert_axes_names_in_the_records():
    assert _mesh(dp=8, dp_shard=4, ep=2)[2]["expert_shard"] == "edp_shard"
    assert _mesh(dp=8, dp_shard=4, ep=2)[2]["expert_replicate"] == "dp_rep"  # the same ranks
    assert _mesh(dp=4, ep=2)[2]["expert_shard"] == "edp"  # no hybrid: all of edp
    assert _mesh(dp=4, ep=2)[2]["expert_replicate"] is None


def test_an_ep_group_across_part_of_a_shard_group_is_refused():
    """dp-shard 4 and ep 6: an ep group would hold part of two shard groups; the expert's
    replicas then split into no shard x replicate grid."""
    with pytest.raises(ConfigError, match="--ep 6 with --dp-shard 4") as e:
        RunConfig(dp=12, dp_shard=4, ep=6, experts=6, zero=2, batch=12).validate()
    assert "\n" not in str(e.value)
    RunConfig(dp=8, dp_shard=2, ep=4, experts=4, zero=3, batch=8).validate()  # spans whole ones


def test_experts_apart_are_units_of_their_own():
    """plan_units: each MoE layer's experts leave their block's unit and form one of their own;
    every trainable parameter is in exactly one unit."""
    model = build_model(RunConfig(experts=4, moe_every=2).validate(), seed=0)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    units = plan_units(model, experts)
    assert [m for m, _ in units[-len(experts):]] == experts
    mine = {p for m in experts for p in m.parameters()}
    for m, ps in units[:-len(experts)]:
        assert not mine & set(ps)
    held = [p for _, ps in units for p in ps]
    assert len(held) == len(set(held)) == len(list(model.parameters()))


def test_find_unused_parameters_with_units_over_other_axes_is_refused():
    """Its one 0/1 map per step would mix the parameters of ranks holding other experts; refused
    before any collective (no ranks needed to see it)."""
    model = build_model(RunConfig(experts=4).validate(), seed=0)
    apart = {m: dict(axis="edp", shard_axis="edp") for m in model.modules()
             if isinstance(m, Experts)}
    with pytest.raises(ValueError, match="find_unused_parameters"):
        Zero3DataParallel(model, None, find_unused_parameters=True, apart=apart)


# -- runs -------------------------------------------------------------------------------------
def test_zero3_experts_are_units_of_their_own_over_edp():
    """d_model 9: every unit needs padding (dense ones to a multiple of 4, the experts' to 2), so
    states equal to theory to the byte means the units are cut as theory says: one per layer's
    experts over edp, apart from its block over dp."""
    report = run(moe_config(dp=4, ep=2, zero=3, experts=2, top_k=1, d_model=9, heads=3))
    check_moe(report)
    one_expert = theory.mlp_params(9)  # E/ep = 1 expert per layer: 693 parameters, odd
    gathers = [rec for rec in report.ranks[0]["comm"]
               if rec["op"] == "all_gather" and rec["group"] == "edp" and rec["step"] == 0]
    assert gathers and {rec["payload_bytes"] for rec in gathers} == {4 * (one_expert + 1)}
    assert len(gathers) == 2 * 4  # each of 4 layers' experts: gathered for forward and backward


def test_hybrid_shard_zero3_shards_experts_inside_replicates_across():
    """dp 8 = 2 replicas x 4 shards, ep 2: each expert has 4 replicas, 2 in each shard group.
    Its states are sharded over those 2 (edp_shard) and its reduced slices all-reduced across the
    replicas (dp_rep), beside the dense units' dp_shard and dp_rep traffic."""
    report = run(moe_config(dp=8, dp_shard=4, ep=2, fsdp="HYBRID_SHARD", batch=16))
    check_moe(report)
    assert {"dp_shard", "dp_rep", "edp_shard"} <= set(report.wire_bytes_per_step(0))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(dp=4, dp_shard=2, ep=2, zero=1),
    dict(dp=4, dp_shard=2, ep=2, zero=2),
    dict(dp=4, dp_shard=2, ep=2, zero=3),  # the experts replicated across, not sharded
    dict(dp=4, dp_shard=2, ep=4, zero=3, experts=8),  # ep spans both shard groups
    dict(dp=8, dp_shard=2, ep=4, zero=3, batch=16),
    dict(dp=8, dp_shard=4, ep=2, zero=1, batch=16),
    dict(dp=4, ep=4, zero=3, experts=8, top_k=2),
    dict(dp=4, ep=2, zero=3, checkpointing="full", grad_accum=2, batch=16),
    dict(dp=4, ep=2, zero=3, checkpointing="selective"),
    dict(dp=2, ep=2, zero=3, tp=2),
    dict(dp=4, dp_shard=2, ep=2, zero=3, tp=2),
    dict(dp=2, ep=2, zero=3, pp=2, schedule="1f1b"),
    dict(dp=2, ep=2, zero=3, pp=2, schedule="gpipe", moe_every=2),
    dict(dp=2, ep=2, zero=3, pp=2, schedule="interleaved", layers=4),
    dict(dp=2, ep=2, zero=3, pp=2, schedule="zb"),
    dict(dp=2, ep=2, zero=3, pp=2, schedule="zbv", layers=4),
    dict(dp=4, dp_shard=2, ep=2, zero=3, pp=2, schedule="zb"),
    dict(dp=4, dp_shard=2, ep=2, zero=3, pp=2, schedule="1f1b"),
    dict(dp=4, dp_shard=2, ep=2, zero=2, pp=2, schedule="1f1b"),
    dict(dp=2, ep=2, zero=3, tp=2, pp=2, schedule="1f1b"),
    dict(dp=2, cp=2, ep=2, zero=3),
    dict(dp=2, cp=2, ep=4, zero=3, cp_impl="zigzag"),
    dict(dp=4, dp_shard=2, cp=2, ep=2, zero=3),
    dict(dp=4, dp_shard=2, cp=2, ep=4, zero=1, cp_impl="ulysses"),
    dict(dp=8, dp_shard=4, cp=2, ep=4, zero=3, batch=16),  # 16 ranks: ep inside a shard group
    # five axes on 16 ranks, ZeRO-3: dp2 x tp2 x pp2 x cp2, experts over ep 4 of the dp x cp ranks
    dict(dp=2, tp=2, pp=2, cp=2, ep=4, zero=3, schedule="1f1b", cp_impl="zigzag"),
], ids=repr)
def test_matrix(kw):
    check_moe(run(moe_config(**kw)))


@pytest.mark.slow
def test_checkpoint_saved_under_hybrid_zero3_experts_resumes_elsewhere(tmp_path):
    """Each rank saves its slices of the expert units (boxes of the full experts); a run under
    another layout reads them back and continues the reference."""
    small = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8, experts=4)
    ck = str(tmp_path / "ck")
    run(RunConfig(steps=2, save=ck, dp=4, dp_shard=2, ep=2, zero=3, **small))
    resumed = run(RunConfig(steps=4, resume=ck, reference=True, dp=2, ep=2, zero=1, **small))
    assert resumed.max_abs_diff <= 1e-5, resumed.max_abs_diff_detail


@pytest.mark.slow
def test_cli_ep_with_zero3():
    report = cli_reference_run("--dp", "4", "--ep", "2", "--experts", "4", "--zero", "3",
                               timeout=180)
    for r in report["ranks"]:
        assert {k: r["memory"][k] for k in ("params", "grads", "optimizer")} == \
            {k: report["theory"]["memory"][k] for k in ("params", "grads", "optimizer")}
