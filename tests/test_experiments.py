"""The live experiments the app's pages call (parallel_mini/course/experiments.py), checked directly."""
from parallel_mini.config import RunConfig
from parallel_mini.course.experiments import tp_mlp_shards


def test_tp_mlp_shards_are_each_ranks_slices_and_the_all_reduce_restores_the_mlp():
    cfg = RunConfig(tp=2, layers=2)
    ranks = tp_mlp_shards(cfg.to_dict())
    h, t = cfg.d_model, cfg.tp
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert len(r["blocks"]) == cfg.layers
        for i, b in enumerate(r["blocks"]):
            rows = slice(*b["fc_rows"])
            assert b["fc"].shape == (4 * h // t, h) and b["proj"].shape == (h, 4 * h // t)
            # exact slices of rank 0's full weights: fc by rows, proj by columns
            full = ranks[0]["blocks"][i]
            assert (b["fc"] == full["fc_full"][rows]).all()
            assert (b["proj"] == full["proj_full"][:, slice(*b["proj_cols"])]).all()
            assert b["y_slice_diff"] <= 1e-6 and b["all_reduce_diff"] <= 1e-5
            assert b["partial_diff"] > 1e-3  # one rank's partial sum is not the answer
        assert [c["layer"] for c in r["comm"]] == ["g"] * cfg.layers
