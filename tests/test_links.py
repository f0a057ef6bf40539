"""course/links.py: the alpha-beta fit recovers the link it was generated from (and a wrong hop
count shows), and a real measurement over two gloo ranks returns what measure_links promises."""
import statistics

import pytest

from parallel_mini.course import links

ALPHA, BW = 40e-6, 1.5e9


def _synthetic(world: int) -> dict:
    """measure_links' shape, the times from predict() (theory) of one link (ALPHA, BW)."""
    rows = []
    for op in links.OPS:
        for size in links.DEFAULT_SIZES:
            t = links.predict(op, size, world, ALPHA, BW)
            rows.append({"op": op, "bytes": size, "seconds": [t], "median_s": t, "min_s": t})
    return {"world": world, "rows": rows}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fit_recovers_alpha_and_beta_from_the_model(world):
    res = _synthetic(world)
    fit = links.fit_alpha_beta(res)
    assert set(fit) == set(links.OPS) | {"all"}
    for op, f in fit.items():
        assert f["alpha_s"] == pytest.approx(ALPHA, rel=1e-6), op
        assert f["bandwidth_Bps"] == pytest.approx(BW, rel=1e-6), op
        assert f["max_rel_err"] < 1e-6, op
    n = world  # the ring algorithm's counts, written out independently of links.hops
    ring = {"p2p": (1, 1), "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
            "all_gather": (n - 1, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n),
            "all_to_all": (n - 1, (n - 1) / n)}
    assert {op: (fit[op]["a"], fit[op]["b"]) for op in links.OPS} == ring


def test_wrong_hop_counts_give_a_clearly_wrong_fit():
    """Sabotage: rows made with the ring's counts, fitted as if every op were one p2p step. Each
    op alone still fits (a rescaled pair), but the ops no longer agree on the link, and one pair
    for all of them misses by far: the agreement is the model's check."""
    world = 4
    res = _synthetic(world)
    wrong = links.fit_alpha_beta(res, hop_counts=lambda op, n: (1.0, 1.0))
    alphas = [wrong[op]["alpha_s"] for op in links.OPS]
    assert max(alphas) / min(alphas) > 3  # all_reduce's 6 hops vs p2p's 1
    assert wrong["all"]["max_rel_err"] > 0.3
    right = links.fit_alpha_beta(res)
    assert right["all"]["max_rel_err"] < 1e-6


def test_fit_weighs_small_sizes_in_relative_error():
    """A 10% error on the 4-byte row moves alpha; least squares in absolute seconds would let the
    64 MiB rows drown it. The fitted pair stays within a few % of the truth either way."""
    res = _synthetic(2)
    for row in res["rows"]:
        if row["op"] == "p2p" and row["bytes"] == 4:
            row["median_s"] *= 1.1
    f = links.fit_alpha_beta(res)["p2p"]
    assert 0.0 < f["max_rel_err"] < 0.1
    assert f["alpha_s"] == pytest.approx(ALPHA, rel=0.1)


def test_predict_and_interconnects():
    assert links.predict("all_reduce", 1e9, 8, 0.0, 1e9) == pytest.approx(2 * 7 / 8)
    assert links.predict("p2p", 4, 8, 1e-6, 1e9) == pytest.approx(1e-6 + 4e-9)
    rows = links.interconnects("all_reduce", links.GiB, 8,
                               fit={"alpha_s": ALPHA, "bandwidth_Bps": BW})
    names = [r["link"] for r in rows]
    assert "RoCE 400G" in names and names[-1] == "this machine (fitted)"
    nv = next(r for r in rows if r["link"] == "NVLink 4 (H100)")
    assert nv["seconds"] == pytest.approx(14 * 1e-6 + 1.75 * links.GiB / 450e9)
    with pytest.raises(ValueError, match="op="):
        links.hops("broadcast", 2)


def test_measure_links_on_two_gloo_ranks():
    sizes = [4, 4096, 262144]
    res = links.measure_links(world=2, sizes=sizes, ops=("p2p", "all_reduce"), repeats=3)
    assert res["world"] == 2 and res["cores"] >= 1
    assert len(res["load_before"]) == 3 and len(res["load_after"]) == 3
    assert [(r["op"], r["bytes"]) for r in res["rows"]] == [
        ("p2p", 8), ("p2p", 4096), ("p2p", 262144),
        ("all_reduce", 8), ("all_reduce", 4096), ("all_reduce", 262144)]  # 4 B: 2 floats, one per rank
    for r in res["rows"]:
        assert len(r["seconds"]) == 3 and all(s > 0 for s in r["seconds"])
        assert r["median_s"] == statistics.median(r["seconds"]) and r["min_s"] == min(r["seconds"])
    fit = links.fit_alpha_beta(res)
    assert fit["all"]["alpha_s"] >= 0 and fit["all"]["beta_s_per_byte"] >= 0


def test_bench_links_prints_the_fit_beside_the_source_table(capsys):
    """`bench links`' summary and table from predict()'s rows (no ranks): the fitted link is
    the generating one, and the 1 GiB all-reduce on it is predict()'s."""
    from parallel_mini.course import bench

    res = dict(_synthetic(2), cores=2, load_before=[1.0] * 3, load_after=[1.0] * 3)
    out = bench.links_summary(res)
    assert out["fit"]["all"]["bandwidth_Bps"] == pytest.approx(BW)
    mine = out["example"]["rows"][-1]
    assert mine["link"] == "this machine (fitted)"
    assert mine["seconds"] == pytest.approx(links.predict("all_reduce", 2 ** 30, 8, ALPHA, BW))
    bench._print_links(out)
    text = capsys.readouterr().out
    assert "vendor figures, from the source material" in text and "RoCE 400G" in text
    assert "this machine (fitted)" in text and "1.5" in text
