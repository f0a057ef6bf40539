"""course/links.py: the alpha-beta fit recovers the link it was generated from (and a wrong hop
count shows), and a real measurement over two gloo ranks returns what measure_links promises."""
import math
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
        assert r["cpu_all_ranks_s"] > 0  # both ranks' threads ran the call
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


# ---------------------------------------------------------------------------------------------
# the planner's "this machine" profile (planner.measure_hardware), without measuring
# ---------------------------------------------------------------------------------------------
def _toy_shape():
    from parallel_mini.course import planner
    return {k: v for k, v in planner.VALIDATION_MODEL.items() if k != "batch"}


# tp1's and tp2's measured passes, made up: tp2's 74 calls add 0.3 ms of CPU each
TP_CALLS = {"tp1_fwd_bwd_cpu_s": 0.06, "tp1_calls": 0, "tp2_fwd_bwd_cpu_s": 0.06 + 74 * 3e-4,
            "tp2_calls": 74}


def _hardware_measured(shape: dict, more_calls: dict):
    """A profile from made-up measurements: 50 GFLOP/s and 0.3 ms per block, one link fit at 2
    ranks, tp2's calls at 0.3 ms of CPU each, and `more_calls`' measured runs."""
    from parallel_mini.course import planner

    spec = planner.toy_model(batch=1, **shape)
    per_seq = planner.model_flops_per_token(spec) * spec.seq
    line = [{"batch": b, "seconds": spec.layers * 3e-4 + b * per_seq / 50e9} for b in (1, 2, 4)]
    calls = {**TP_CALLS, **more_calls}
    return planner.hardware_from_measurements(
        {"fwd_bwd": [], "engine_fwd_bwd": line, "calls": calls},
        {2: {"alpha_s": 1e-4, "bandwidth_Bps": 2e9}}, shape, cores=2)


def test_hardware_from_measurements_recovers_the_rates():
    from parallel_mini.course import planner

    shape = _toy_shape()
    spec = planner.toy_model(batch=1, **shape)
    per_seq = planner.model_flops_per_token(spec) * spec.seq
    block, rate = 3e-4, 50e9
    compute = {"matmul_flops_per_s": 90e9, "fwd_bwd": [  # the bare model's: not what is fitted
        {"batch": b, "seconds": 1.0, "chunked_s": 1.0 + spec.layers * 1e-5} for b in (1, 2, 4)],
        "engine_fwd_bwd": [{"batch": b, "seconds": spec.layers * block + b * per_seq / rate}
                           for b in (1, 2, 4, 8, 16)]}
    fits = {2: {"alpha_s": 1e-4, "bandwidth_Bps": 2e9}, 8: {"alpha_s": 8e-4, "bandwidth_Bps": 1e9}}
    hw = planner.hardware_from_measurements(compute, fits, shape, cores=2)
    assert hw.name == "this machine" and hw.source.startswith("measured here")
    assert hw.block_overhead_s == pytest.approx(block) and hw.flops == pytest.approx(rate)
    assert hw.chunk_overhead_s == pytest.approx(1e-5)
    assert hw.latency_intra_s == pytest.approx(1e-4)  # 2 ranks, a core each
    assert hw.shared_hop_s == pytest.approx(8e-4 * 2 / 8)  # charged x ranks / cores
    assert hw.intra_bw == pytest.approx(1e9) and hw.cores == 2


def test_block_overhead_is_charged_per_block_micro_batch_and_replica():
    """On shared cores every rank's blocks pay the fixed cost, all on the cores there are."""
    import dataclasses

    from parallel_mini.course import planner

    batch = planner.VALIDATION_MODEL["batch"]
    spec = planner.toy_model(batch=batch, **_toy_shape())
    hw = dataclasses.replace(planner.hardware("cpu"), cores=2)
    lay = planner.Layout(dp=8, tp=1, pp=1, cp=1, ep=1, zero=1, schedule="-", virtual=1,
                         microbatches=2, micro_batch=1, checkpointing="none", sp=False)
    base = planner.predict(spec, lay, hw, batch, precision="fp32")
    more = planner.predict(spec, lay, dataclasses.replace(hw, block_overhead_s=1e-3), batch,
                           precision="fp32")
    extra = spec.layers * 1e-3 * lay.microbatches * lay.dp / hw.cores
    assert more["compute_s"] - base["compute_s"] == pytest.approx(extra)


def test_measure_hardware_reads_its_json_without_measuring(tmp_path):
    import dataclasses
    import json

    from parallel_mini.course import planner

    hw = dataclasses.replace(planner.hardware("cpu"), name="this machine", block_overhead_s=2e-4)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"hardware": dataclasses.asdict(hw)}))
    assert planner.measure_hardware(str(path), worlds=()) == hw  # worlds=(): would fail to measure


@pytest.mark.slow
def test_measure_hardware_tiny_real_run_writes_its_json(tmp_path):
    from parallel_mini.course import planner

    path = tmp_path / "hw.json"
    hw = planner.measure_hardware(str(path), worlds=(2,), batches=(1, 16), max_bytes=4096,
                                  repeats=1)
    assert 0 < hw.flops < math.inf and hw.block_overhead_s >= 0 and hw.latency_intra_s >= 0
    assert hw.optimizer_s > 0 and hw.full_recompute_block_s >= 0
    assert planner.measure_hardware(str(path)) == hw


def test_bench_plan_prints_predicted_over_measured(capsys):
    from parallel_mini.course import bench, planner

    hw = planner.hardware("cpu")
    rows = [{"layout": f"L{i}", "states_equal": True, "predicted_step_s": p, "measured_step_s": m,
             "predicted_compute_s": p / 2, "measured_cpu_s": p, "predicted_assumed_step_s": 2 * p}
            for i, (p, m) in enumerate([(0.1, 0.1), (0.2, 0.5), (0.3, 0.35)])]
    res = {"ranks": 8, "cores": 2, "states_equal": 3, "layouts": 3, "failed": 0, "rows": rows,
           "spearman_step_time": planner.spearman([0.1, 0.2, 0.3], [0.1, 0.5, 0.35]),
           "hardware": {**planner.dataclasses.asdict(hw), "name": "this machine",
                        "links": [[2, "p2p", 1e-4, 5e-10], [8, "p2p", 1e-3, 2e-9]],
                        "call_cpu_s": 2e-4, "sp_call_cpu_s": 1e-4, "p2p_call_cpu_s": 5e-5,
                        "shared_world": 8, "shared_call_cpu_s": 3e-4, "shared_sp_call_cpu_s": 2e-4,
                        "shared_p2p_call_cpu_s": 1e-4}}
    bench._print_plan(res)
    text = capsys.readouterr().out
    assert "2 ranks: p2p 100 (2.00); 8 ranks: p2p 1000 (0.50)" in text  # (rows without groups)
    assert "tp 200, tp+sp 100, p2p 50 with a core per rank; with 8 ranks on the cores: tp 300" in text
    assert "predicted/measured within 0.7-1.4: 2 of 3 layouts" in text  # 1.0, 0.4, 0.86
    assert "0.40" in text and "+0.50" in text and "with the assumed rates" in text


@pytest.mark.parametrize("argv", [["links", "--world", "1"], ["links", "--max-mib", "0"]])
def test_bench_links_bad_input_is_one_line_and_exit_2(argv, capsys):
    from parallel_mini.course import bench

    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and argv[1] in err


# The lead's idle 2-core run (torch 2.11, /tmp/team/device/2/hw.json): the bare toy's forward +
# backward on a CPU rank grew with the batch; the engine's, on the machine's GPU (a run of one rank
# took it), stayed flat: the host thread's CPU time saw kernel launches, not the work.
DEVICE_BARE = [(1, 0.010011333), (2, 0.011923134), (4, 0.01660259), (8, 0.0318527), (16, 0.074899977)]
DEVICE_ENGINE_ON_GPU = [(1, 0.006864161), (2, 0.0068482785), (4, 0.0073637195), (8, 0.0085043745),
                        (16, 0.0064180715)]


def _rows(pairs):
    return [{"batch": b, "seconds": t} for b, t in pairs]


def test_compute_fit_refuses_a_flat_sweep_and_fits_a_real_one():
    from parallel_mini.course import planner

    shape = _toy_shape()
    spec = planner.toy_model(batch=1, **shape)
    per_seq = planner.model_flops_per_token(spec) * spec.seq
    with pytest.raises(planner.MeasurementError, match="does not grow with the batch"):
        planner.fit_compute(_rows(DEVICE_ENGINE_ON_GPU), spec.layers, per_seq)
    fits = {2: {"alpha_s": 1.6e-4, "bandwidth_Bps": 1.9e9}, 8: {"alpha_s": 1.4e-3,
                                                                "bandwidth_Bps": 5.3e8}}
    with pytest.raises(planner.MeasurementError):  # never an infinite rate
        planner.hardware_from_measurements({"fwd_bwd": [], "engine_fwd_bwd": _rows(
            DEVICE_ENGINE_ON_GPU)}, fits, shape, cores=2)
    hw = planner.hardware_from_measurements({"fwd_bwd": _rows(DEVICE_BARE)}, fits, shape, cores=2)
    assert 1e9 < hw.flops < 1e12 and 0 <= hw.block_overhead_s < 1e-2  # finite, of a CPU's order
    # a sweep the line misses by far (it fell with the batch, then jumped) is refused too
    with pytest.raises(planner.MeasurementError, match="misses a row"):
        planner.fit_compute(_rows([(1, 0.02), (2, 0.005), (4, 0.03), (16, 0.04)]), spec.layers,
                            per_seq)


def test_recompute_and_optimizer_are_measured_and_charged():
    """Checkpointing's fixed cost per block is recovered from its sweep; the optimizer step is
    charged to each rank for the share of the optimizer states it holds."""
    import dataclasses

    from parallel_mini.course import planner

    shape = _toy_shape()
    spec = planner.toy_model(batch=1, **shape)
    per_seq = planner.model_flops_per_token(spec) * spec.seq
    block, rate, extra = 3e-4, 50e9, 2e-4
    line = [{"batch": b, "seconds": spec.layers * block + b * per_seq / rate, "optimizer_s": 2e-3}
            for b in (1, 2, 4, 8)]
    full = [{"batch": r["batch"], "seconds": r["seconds"] + spec.layers * extra + r["batch"]
             * planner._recomputed_flops(spec, "full") * spec.seq / rate} for r in line]
    fits = {2: {"alpha_s": 1e-4, "bandwidth_Bps": 2e9}}
    hw = planner.hardware_from_measurements({"fwd_bwd": [], "engine_fwd_bwd": line,
                                             "engine_recompute": {"full": full}}, fits, shape,
                                            cores=2)
    assert hw.full_recompute_block_s == pytest.approx(extra) and hw.optimizer_s == 2e-3
    batch = planner.VALIDATION_MODEL["batch"]
    big = planner.toy_model(batch=batch, **shape)
    lay = planner.Layout(dp=8, tp=1, pp=1, cp=1, ep=1, zero=1, schedule="-", virtual=1,
                         microbatches=1, micro_batch=2, checkpointing="full", sp=False)
    no_opt = dataclasses.replace(hw, optimizer_s=0.0)
    base = planner.predict(big, lay, no_opt, batch, precision="fp32")["compute_s"]
    none = planner.predict(big, dataclasses.replace(lay, checkpointing="none"), no_opt, batch,
                           precision="fp32")["compute_s"]
    recompute_flops = planner._recomputed_flops(spec, "full") * lay.micro_batch * spec.seq
    assert base - none == pytest.approx(
        lay.dp * (spec.layers * extra + recompute_flops / hw.flops) / hw.cores)
    with_opt = planner.predict(big, lay, hw, batch, precision="fp32")["compute_s"]
    assert with_opt - base == pytest.approx(2e-3 / hw.cores, rel=0.05)  # 8 shares of 1/8 (padded)


def test_comm_calls_cpu_is_measured_and_charged_per_call():
    """The CPU a tp2 (cp2) run's passes add to tp1's, per comm call, is charged per call the
    planner counts: tp's calls per micro-step are 4 per block + 5 (the count a live run makes)."""
    import dataclasses

    from parallel_mini.course import planner

    shape = _toy_shape()
    hw = _hardware_measured(shape, {"cp2_fwd_bwd_cpu_s": 0.06 + 110 * 2e-5, "cp2_calls": 110})
    assert hw.call_cpu_s == pytest.approx(3e-4) and hw.p2p_call_cpu_s == pytest.approx(2e-5)
    batch = planner.VALIDATION_MODEL["batch"]
    big = planner.toy_model(batch=batch, **shape)
    lay = planner.Layout(dp=1, tp=2, pp=1, cp=1, ep=1, zero=0, schedule="-", virtual=1,
                         microbatches=1, micro_batch=16, checkpointing="none", sp=False)
    free = planner.predict(big, lay, dataclasses.replace(hw, call_cpu_s=0.0), batch,
                           precision="fp32")
    charged = planner.predict(big, lay, hw, batch, precision="fp32")
    assert free["comm"]["tp"]["calls"] == 4 * big.layers + 5  # 37, as tp2 runs them
    assert charged["compute_s"] - free["compute_s"] == pytest.approx(37 * 3e-4)
    sp = planner.predict(big, dataclasses.replace(lay, sp=True), hw, batch, precision="fp32")
    full = planner.predict(big, dataclasses.replace(lay, sp=True, checkpointing="full"), hw, batch,
                           precision="fp32")  # tp2 runs count 122 and 146 (8 blocks)
    assert (sp["comm"]["tp"]["calls"], full["comm"]["tp"]["calls"]) == (122, 146)
    # with a tp2 run at batch 1 beside: the same calls, fewer bytes, give a per-byte cost too
    both = dict(TP_CALLS, tp2_wire_bytes=8e6, tp1_b1_fwd_bwd_cpu_s=0.005, tp1_b1_calls=0,
                tp2_b1_calls=74, tp2_b1_wire_bytes=5e5)
    both["tp2_fwd_bwd_cpu_s"] = 0.06 + 74 * 3e-4 + 8e6 * 1e-10
    both["tp2_b1_fwd_bwd_cpu_s"] = 0.005 + 74 * 3e-4 + 5e5 * 1e-10
    assert planner._call_cost(both) == pytest.approx((3e-4, 1e-10))


# ---------------------------------------------------------------------------------------------
# the links table: each op fitted at each world measured, a layout charged at its own world's
# ---------------------------------------------------------------------------------------------
def _two_worlds() -> tuple:
    """Fits at 2 and 8 ranks from synthetic links (8 ranks: 10x the latency, half the bandwidth)."""
    fits = {}
    for world, alpha, bw in ((2, ALPHA, BW), (8, 10 * ALPHA, BW / 2)):
        res = _synthetic(world)
        for row in res["rows"]:
            row["median_s"] = links.predict(row["op"], row["bytes"], world, alpha, bw)
        fits[world] = links.fit_alpha_beta(res)
    return fits, links.fit_table(fits)


def test_link_at_takes_the_nearest_measured_world_and_the_ops_own_fit():
    fits, table = _two_worlds()
    assert links.nearest_world([2, 8], 2) == 2 and links.nearest_world([2, 8], 8) == 8
    assert links.nearest_world([2, 8], 4) == 8  # as near in ratio: the one sharing more
    assert links.nearest_world([2, 4, 8], 3) == 4 and links.nearest_world([], 4) is None
    alpha, beta, w, g = links.link_at(table, "all_gather", 8)
    assert (w, g) == (8, 8) and alpha == pytest.approx(10 * ALPHA) and beta == pytest.approx(2 / BW)
    assert links.link_at(table, "p2p", 2)[:2] == pytest.approx((ALPHA, 1 / BW))
    only_all = tuple(r for r in table if r[2] == "all")
    assert links.link_at(only_all, "p2p", 8)[0] == fits[8]["all"]["alpha_s"]
    assert links.link_at((), "p2p", 8) is None


def _toy_and_tp(tp: int, sp: bool = True, checkpointing: str = "none"):
    from parallel_mini.course import planner

    batch = planner.VALIDATION_MODEL["batch"]
    spec = planner.toy_model(batch=batch, **_toy_shape())
    lay = planner.Layout(dp=1, tp=tp, pp=1, cp=1, ep=1, zero=0, schedule="-", virtual=1,
                         microbatches=2, micro_batch=batch // 2, checkpointing=checkpointing, sp=sp)
    return spec, lay, batch


def test_predict_charges_each_call_at_its_op_and_the_layouts_world():
    """A tp8 layout's tp seconds: every all-gather, reduce-scatter and all-reduce at the 8-rank
    fit (hops x alpha + bytes x beta); tp2's at the 2-rank fit; no table: the old latency."""
    import dataclasses

    from parallel_mini.course import planner

    _, table = _two_worlds()
    hw = dataclasses.replace(planner.hardware("cpu"), cores=2, links=table)
    for tp, alpha, bw in ((8, 10 * ALPHA, BW / 2), (2, ALPHA, BW)):
        spec, lay, batch = _toy_and_tp(tp)
        tp_comm = planner.predict(spec, lay, hw, batch, precision="fp32")["comm"]["tp"]
        ar, agrs = planner._tp_collectives(spec.layers, lay, spec.toy)
        hops = lay.microbatches * (ar * 2 + agrs) * (tp - 1)
        assert tp_comm["hops"] == hops
        assert tp_comm["seconds"] == pytest.approx(hops * alpha + tp_comm["bytes"] / bw, rel=1e-6)
    plain = planner.predict(spec, lay, planner.hardware("cpu"), batch, precision="fp32")
    cpu = planner.hardware("cpu")
    assert plain["comm"]["tp"]["seconds"] == pytest.approx(
        hops * cpu.latency_intra_s + plain["comm"]["tp"]["bytes"] / cpu.intra_bw)


def test_tp_collectives_by_kind_are_what_a_tp2_sp_run_calls():
    """With sp the toy's tp rank makes, per micro-step, all-gathers and reduce-scatters for the
    sequence shards and all-reduces for the replicated parameters' gradients and cross-entropy:
    counted from a live tp2 run's records (2 blocks, full checkpointing: its recompute's calls too);
    without sp, all-reduces only, counted from a second run. (_tp_calls is their sum.)"""
    import collections
    import dataclasses

    from parallel_mini.config import RunConfig
    from parallel_mini.course import planner
    from parallel_mini.runtime.launch import run

    spec, lay, _ = _toy_and_tp(2, checkpointing="full")
    rep = run(RunConfig(layers=2, d_model=32, heads=4, seq=16, vocab=64, batch=2, steps=1, tp=2,
                        sp=True, checkpointing="full", backend="gloo"))
    got = collections.Counter(r["op"] for r in rep.ranks[0]["comm"])
    ar, agrs = planner._tp_collectives(2, lay, toy=True)
    assert (got["all_reduce"], got["all_gather"] + got["reduce_scatter"]) == (ar, agrs)
    # without sp and checkpointing: all-reduces only, as many as a live tp2 run makes
    plain = dataclasses.replace(lay, sp=False, checkpointing="none")
    rep = run(RunConfig(layers=2, d_model=32, heads=4, seq=16, vocab=64, batch=2, steps=1, tp=2,
                        backend="gloo"))
    got = collections.Counter(r["op"] for r in rep.ranks[0]["comm"])
    assert planner._tp_collectives(2, plain, toy=True) == (got["all_reduce"], 0)
    assert got["all_gather"] + got["reduce_scatter"] == 0


def test_the_links_table_survives_the_profiles_json(tmp_path):
    import dataclasses
    import json

    from parallel_mini.course import planner

    _, table = _two_worlds()
    hw = dataclasses.replace(planner.hardware("cpu"), name="this machine", links=table)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"hardware": dataclasses.asdict(hw)}))
    back = planner.measure_hardware(str(path), worlds=())
    assert back == hw and hash(back) == hash(hw)


def test_link_at_takes_the_group_measured_nearest_within_the_world():
    """Measured in groups: a tp2 call among 8 ranks is charged at the fit of 8 ranks in groups
    of 2 (four pairs at once), not at 8 ranks in one ring nor at 2 ranks alone."""
    fits = {}
    for key, alpha in (((2, 2), ALPHA), ((8, 2), 3 * ALPHA), ((8, 8), 10 * ALPHA)):
        res = _synthetic(key[1])
        for row in res["rows"]:
            row["median_s"] = links.predict(row["op"], row["bytes"], key[1], alpha, BW)
        fits[key] = links.fit_alpha_beta(res)
    table = links.fit_table(fits)
    assert links.link_at(table, "all_gather", 8, 2)[0] == pytest.approx(3 * ALPHA)
    assert links.link_at(table, "all_gather", 8, 8)[0] == pytest.approx(10 * ALPHA)
    assert links.link_at(table, "all_gather", 8, 4)[2:] == (8, 8)  # nearest group, the larger
    assert links.link_at(table, "all_gather", 8)[2:] == (8, 8)  # no group: the world's
    assert links.link_at(table, "p2p", 2, 2)[0] == pytest.approx(ALPHA)


def test_measure_links_in_groups_spans_the_group():
    """2 ranks in groups of 1 are refused; 4 ranks in 2 groups of 2 time each group's own op:
    the payload rounds to the group's size and the fit counts the group's hops."""
    with pytest.raises(ValueError, match="divisor"):
        links.measure_links(world=4, group=3, sizes=[4])
    res = links.measure_links(world=4, group=2, sizes=[4, 4096], ops=("all_gather",), repeats=1)
    assert res["group"] == 2 and [r["bytes"] for r in res["rows"]] == [8, 4096]
    assert links.fit_alpha_beta(res)["all_gather"]["a"] == 1.0  # 2 - 1 hops


def test_sp_calls_are_charged_at_their_own_measured_cost():
    """A tp2 + sp run beside tp1 gives the CPU of a call with sequence parallel (sp_call_cpu_s),
    charged per call for sp layouts instead of the plain tp calls' cost."""
    import dataclasses

    from parallel_mini.course import planner

    shape = _toy_shape()
    hw = _hardware_measured(shape, {"tp2sp_fwd_bwd_cpu_s": 0.06 + 244 * 1e-4, "tp2sp_calls": 244})
    assert hw.sp_call_cpu_s == pytest.approx(1e-4) and hw.call_cpu_s == pytest.approx(3e-4)
    spec16, lay, batch = _toy_and_tp(2)  # sp, 2 micro-batches
    free = planner.predict(spec16, lay, dataclasses.replace(hw, sp_call_cpu_s=0.0, call_cpu_s=0.0),
                           batch, precision="fp32")
    charged = planner.predict(spec16, lay, hw, batch, precision="fp32")
    assert charged["compute_s"] - free["compute_s"] == pytest.approx(
        charged["comm"]["tp"]["calls"] * 1e-4)


def test_pipeline_fill_and_drain_chain_is_charged_on_shared_cores():
    """pp8 with 2 micro-batches on 2 cores: each rank sends 4 messages, but the fill and drain
    are 14 messages one after another (2 (pp - 1)); nothing overlaps on shared cores."""
    import dataclasses

    from parallel_mini.course import planner

    batch = planner.VALIDATION_MODEL["batch"]
    spec = planner.toy_model(batch=batch, **_toy_shape())
    hw = dataclasses.replace(planner.hardware("cpu"), cores=2)
    lay = planner.Layout(dp=1, tp=1, pp=8, cp=1, ep=1, zero=0, schedule="1f1b", virtual=1,
                         microbatches=2, micro_batch=8, checkpointing="none", sp=False)
    pp = planner.predict(spec, lay, hw, batch, precision="fp32")["comm"]["pp"]
    boundary = lay.micro_batch * spec.seq * spec.d_model * 4
    hop = hw.shared_hop_s * lay.world / hw.cores
    assert pp["hops"] == 4 and pp["seconds"] == pytest.approx(4 * (hop + boundary / hw.intra_bw))
    assert pp["exposed_s"] == pytest.approx(14 * (hop + boundary / hw.intra_bw))


def test_calls_cpu_measured_on_shared_cores_is_charged_where_ranks_share_them():
    """Runs of 8 ranks on the cores (dp x tp2 / tp2 + sp / cp2 beside dp alone) give the calls'
    CPU with the cores shared; a layout of 8 ranks on 2 cores is charged those, one of 2 ranks
    the figures measured with a core each."""
    import dataclasses

    from parallel_mini.course import planner

    shared = {"world": 8, "dp_fwd_bwd_cpu_s": 0.1, "dp_calls": 0,
              "tp2_fwd_bwd_cpu_s": 0.1 + 100 * 5e-4, "tp2_calls": 100,
              "tp2sp_fwd_bwd_cpu_s": 0.1 + 300 * 2e-4, "tp2sp_calls": 300,
              "cp2_fwd_bwd_cpu_s": 0.1 + 200 * 3e-4, "cp2_calls": 200}
    costs = planner._shared_costs(shared)
    assert costs["shared_world"] == 8 and costs["shared_call_cpu_s"] == pytest.approx(5e-4)
    assert costs["shared_sp_call_cpu_s"] == pytest.approx(2e-4)
    assert costs["shared_p2p_call_cpu_s"] == pytest.approx(3e-4)
    hw = dataclasses.replace(planner.hardware("cpu"), cores=2, sp_call_cpu_s=1e-5, **costs)
    spec, lay8, batch = _toy_and_tp(8)
    p8 = planner.predict(spec, lay8, hw, batch, precision="fp32")
    assert planner._calls_cpu(hw, lay8, p8["comm"], True) == pytest.approx(
        p8["comm"]["tp"]["calls"] * 2e-4)
    spec, lay2, batch = _toy_and_tp(2)
    p2 = planner.predict(spec, lay2, hw, batch, precision="fp32")
    assert planner._calls_cpu(hw, lay2, p2["comm"], False) == pytest.approx(
        p2["comm"]["tp"]["calls"] * 1e-5)
