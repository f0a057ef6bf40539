"""The mesh: grid axes, combined axes built from them, expert parallel carved out of dp x cp."""
from types import SimpleNamespace

from parallel_mini.runtime.launch import run_ranks
from parallel_mini.mesh import GRID, carve_experts, coords_of, lines, rank_of

SHAPE = {"pp": 2, "dp_rep": 2, "dp_shard": 2, "cp": 2, "tp": 2}  # 32 ranks, on paper


def test_tp_is_innermost_and_pp_outermost():
    assert coords_of(1, SHAPE)["tp"] == 1 and coords_of(16, SHAPE)["pp"] == 1
    for r in range(32):
        assert rank_of(coords_of(r, SHAPE), SHAPE) == r


def test_combined_axis_is_the_ranks_differing_only_in_its_parts():
    groups = lines(("dp_shard", "cp"), SHAPE)  # ZeRO's shard axis with context parallel
    assert len(groups) == 32 // 4 and all(len(g) == 4 for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(32))  # a partition of the world
    for g in groups:
        fixed = [{a: coords_of(r, SHAPE)[a] for a in GRID if a not in ("dp_shard", "cp")} for r in g]
        assert all(f == fixed[0] for f in fixed)
    assert lines(("dp_shard", "cp"), SHAPE)[0] == [0, 2, 4, 6]  # cp fastest, then dp_shard


def test_experts_carved_out_of_the_loss_axis():
    loss_lines = lines(("dp_rep", "dp_shard", "cp"), SHAPE)  # 8 ranks each
    carved = carve_experts(loss_lines, ep=4)
    assert all(len(g) == 4 for g in carved["ep"]) and all(len(g) == 2 for g in carved["edp"])
    for line in loss_lines:  # every ep group and its replica group lie inside one loss line
        mine = [g for g in carved["ep"] if g[0] in line]
        assert sorted(r for g in mine for r in g) == sorted(line)
    # rank 0's experts are replicated on the rank at the same place in the next ep block
    assert [0, 8] in carved["edp"]


def _axes(cfg_dict):
    from parallel_mini.mesh import build_mesh
    mesh = build_mesh(SimpleNamespace(**cfg_dict, world_size=cfg_dict["dp"] * cfg_dict["tp"]
                                      * cfg_dict["pp"] * cfg_dict["cp"]))
    roles = ("batch", "loss", "shard", "replicate", "expert", "expert_dp")
    return {"members": mesh.members, "roles": {r: mesh.axis_for(r) for r in roles},
            "coords": mesh.coords}


def test_hybrid_mesh_on_eight_ranks():
    """dp 4 as 2 replicas x 2 shards, tp 2, ep 2: the groups each role talks over, on real ranks."""
    cfg = dict(dp=4, dp_shard=2, tp=2, pp=1, cp=1, ep=2)
    out = [r.value for r in run_ranks(_axes, 8, cfg)]
    r0 = out[0]
    assert r0["members"]["tp"] == [0, 1] and r0["members"]["dp"] == [0, 2, 4, 6]
    assert r0["members"]["dp_shard"] == [0, 2] and r0["members"]["dp_rep"] == [0, 4]
    assert r0["members"]["ep"] == [0, 2] and r0["members"]["edp"] == [0, 4]
    # plain names where a combined axis has the same ranks: the comm records keep reading "dp"
    assert r0["roles"] == {"batch": "dp", "loss": "dp", "shard": "dp_shard", "replicate": "dp_rep",
                           "expert": "dp_shard", "expert_dp": "dp_rep"}
    assert [o["coords"]["dp"] for o in out] == [0, 0, 1, 1, 2, 2, 3, 3]
