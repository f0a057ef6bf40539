"""DualPipe's F&B overlap (issue 24 item 1): `bench fb-overlap`'s arithmetic (course/bench.py:
the hidden fraction paired round by round, and whether the machine has the cores to show it) and
the count from a run's timeline records (course/experiments.comm_during_other_compute). The default
suite starts no ranks here; the live measurement and a DualPipe run with experts are `-m slow`."""
import pytest

from parallel_mini.runtime import launch
from parallel_mini.config import RunConfig
from parallel_mini.course import bench
from parallel_mini.course.experiments import comm_during_other_compute


def test_hidden_fraction_is_paired_round_by_round():
    times = {"comm": [1.0, 1.0, 2.0], "compute": [2.0, 2.0, 2.0],
             "serial": [3.0, 3.0, 4.0], "overlapped": [2.0, 3.5, 3.0]}
    s = bench.fb_overlap_summary(times)
    # each round against its own all-to-all: (3-2)/1, (3-3.5)/1, (4-3)/2
    assert s["hidden_per_round"] == pytest.approx([1.0, -0.5, 0.5])
    assert s["hidden_fraction"] == pytest.approx(0.5)
    assert (s["hidden_min"], s["hidden_max"]) == pytest.approx((-0.5, 1.0))
    assert s["hidden_q1"] == pytest.approx(0.0) and s["hidden_q3"] == pytest.approx(0.75)
    assert s["rounds_hiding"] == 2
    assert s["median_s"]["serial"] == 3.0
    assert s["serial_over_sum"] == pytest.approx(3.0 / (1.0 + 2.0))
    assert s["best_possible_fraction"] == 1.0  # the all-to-all is the shorter one
    longer = bench.fb_overlap_summary({**times, "comm": [4.0] * 3})
    assert longer["best_possible_fraction"] == pytest.approx(2.0 / 4.0)


def test_the_cores_verdict_counts_gloo_s_worker_thread():
    here = bench.fb_overlap_cores(ranks=2, torch_threads=1, cpus=2, load=0.0)
    assert here["threads_needed"] == 4 and not here["cores_enough"] and not here["can_show"]
    assert here["cores_verdict"].startswith("cannot show it: 2 ranks x (1 compute thread(s) + "
                                            "gloo's worker) = 4 busy threads > 2 cores")
    busy = bench.fb_overlap_cores(ranks=2, torch_threads=1, cpus=16, load=14.0)
    assert busy["cores_enough"] and not busy["can_show"] and "may not show it" in busy["cores_verdict"]
    idle = bench.fb_overlap_cores(ranks=2, torch_threads=1, cpus=16, load=0.5)
    assert idle["can_show"] and idle["cores_verdict"].startswith("has the cores for it: 4 busy threads")


def _report(events, comm, steps=3):
    return {"config": {"steps": steps},
            "ranks": [{"rank": 0, "metered_step": steps - 1, "events": events, "comm": comm}]}


def _op(kind, mb, start, end, step=1, stage=0):
    return {"kind": kind, "microbatch": mb, "stage": stage, "step": step, "start": start, "end": end}


def test_comm_during_other_compute_counts_only_other_micro_batches():
    events = [_op("F", 0, 0.0, 1.0), _op("B", 1, 1.0, 2.0, stage=1), _op("W", 1, 2.0, 2.5),
              _op("F", 0, 0.0, 9.0, step=0), {"kind": "wait", "step": 1, "start": 2.5, "end": 3.0}]
    comm = [{"op": "all_to_all", "step": 1, "start": 0.2, "end": 0.6, "phase": "dispatch"},
            # issued in F0, still in flight while B1 computes: 0.5 s of another micro-batch's op
            {"op": "all_to_all", "step": 1, "start": 0.8, "end": 1.5, "phase": "combine"},
            {"op": "all_to_all", "step": 0, "start": 0.1, "end": 5.0},  # the warm-up step
            {"op": "all_to_all", "step": 1, "start": 0.3},  # never completed: no interval
            {"op": "send", "step": 1, "start": 0.9, "end": 2.2}]
    got = comm_during_other_compute(_report(events, comm))
    assert (got["records"], got["inside_own_op"], got["overlapping_other"]) == (2, 1, 1)
    assert [r["own_op"] for r in got["rows"]] == ["F0.0", "F0.0"]
    assert got["overlapped_s"] == pytest.approx(0.5) and got["comm_s"] == pytest.approx(1.1)
    sends = comm_during_other_compute(_report(events, comm), "send")
    # issued inside F0 at 0.9, outstanding through B1 and 0.2 s of W1
    assert sends["overlapping_other"] == 1 and sends["overlapped_s"] == pytest.approx(1.0 + 0.2)


@pytest.mark.slow
def test_the_runner_runs_the_experts_all_to_all_inside_its_own_op():
    """DualPipe with experts on real ranks: every all-to-all lies inside the op that issued it
    (ops run in order, the all-to-all blocks), while the pipeline's asynchronous sends are
    outstanding during other ops' compute; and the run equals the reference."""
    cfg = RunConfig(pp=2, dp=2, ep=2, experts=4, top_k=2, schedule="dualpipe", microbatches=4,
                    batch=8, layers=2, steps=3, reference=True)
    report = launch.run(cfg)
    assert report.max_abs_diff <= 1e-5
    a2a = comm_during_other_compute(report)
    assert a2a["records"] > 0 and a2a["inside_own_op"] == a2a["records"]
    assert a2a["overlapping_other"] == 0
    assert comm_during_other_compute(report, "send")["overlapping_other"] > 0


@pytest.mark.slow
def test_bench_fb_overlap_measures_every_round_and_gets_the_same_bytes():
    r = bench.bench_fb_overlap(ranks=2, repeats=2, timeline=False)
    assert r["overlapped_equals_blocking"]
    assert all(len(r["times_s"][k]) == 2 for k in ("comm", "compute", "serial", "overlapped"))
    assert len(r["hidden_per_round"]) == 2 and r["payload_bytes"] > 0
    assert r["threads_needed"] == 2 * (r["torch_threads"] + 1)


def test_bench_has_an_fb_overlap_verb():
    args = bench._parser().parse_args(["fb-overlap", "--ranks", "2", "--fb-repeats", "15"])
    assert [name for name, _, _ in bench._sections(args)["fb-overlap"]] == ["fb_overlap"]
    assert (args.ranks, args.fb_repeats) == (2, 15)
