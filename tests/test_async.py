"""Asynchronous SGD with a parameter server (parallel/async_ps.py): every run equals its replay
oracle (the recorded updates, each gradient taken at its recorded version, in one process), the
staleness bound holds update by update, K = 0 is a barrier, a straggler only costs time, and
every combination but --dp is refused in one line before torch is imported."""
from __future__ import annotations

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest

from parallel_mini import theory
from parallel_mini.runtime import launch
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.course.async_sim import simulate
from parallel_mini.parallel.async_ps import worker_batch
from parallel_mini.reference import replay_updates, train_reference

TOL = 1e-5
# ~5k parameters: a run of 4 ranks costs a few tenths of a CPU second per rank
TINY = dict(layers=1, d_model=16, heads=2, seq=8, vocab=32, batch=12, steps=3)


def _run(**kw):
    cfg = RunConfig(**{**TINY, "asynchronous": True, "reference": True, **kw}).validate()
    return cfg, launch.run(cfg)


def _check(cfg, report):
    """The run equals its replay; the records are complete and consistent; the bound held."""
    a = report.extra["async"]
    updates, workers = a["updates"], cfg.dp - 1
    assert report.max_abs_diff is not None and report.max_abs_diff <= TOL, report.max_abs_diff_detail
    assert len(updates) == cfg.steps * workers == len(report.losses)
    assert [u["update"] for u in updates] == list(range(len(updates)))
    assert all(u["staleness"] == u["update"] - u["computed_on"] >= 0 for u in updates)
    assert sum(a["staleness_histogram"].values()) == len(updates)
    assert sum(a["updates_per_worker"].values()) == len(updates)
    for w in range(1, cfg.dp):  # each worker's steps are 0, 1, 2, ... in the server's order
        assert [u["step"] for u in updates if u["worker"] == w] == \
            list(range(a["updates_per_worker"][str(w)]))
    # SSP, update by update: when the server granted version v to a worker for its step c, every
    # worker had pushed at least c - K gradients (counted from the updates before v)
    if cfg.max_staleness >= 0:
        for u in updates:
            pushed = [sum(1 for x in updates[:u["computed_on"]] if x["worker"] == w)
                      for w in range(1, cfg.dp)]
            assert u["step"] - min(pushed) <= cfg.max_staleness, (u, pushed)
        assert max(x["staleness"] for x in updates) <= a["theory"]["bound"]
    return a


@pytest.fixture(scope="module")
def straggled():
    """4 ranks (3 workers), rank 2 three times slower, no bound on staleness."""
    return _run(dp=4, seed=1, straggler="2:3")


def test_async_with_a_straggler_equals_its_replay(straggled):
    cfg, report = straggled
    a = _check(cfg, report)
    assert a["straggler"] == {"rank": 2, "factor": 3.0}
    assert report.ranks[2]["straggler_slept_s"] > 0 and report.ranks[1]["straggler_slept_s"] == 0
    assert any(e["kind"] == "straggle" for e in report.ranks[2]["events"])
    # bytes: the server sends one grant per update and a stop to each worker (counted = formula)
    sent = sum(r["wire_bytes_model"] for r in report.ranks[0]["comm"] if r["op"] == "send")
    assert sent == cfg.steps * report.theory["wire_bytes_per_step"]["dp"] \
        == cfg.steps * theory.async_server_wire_bytes_per_step(cfg, report.ranks[0]["n_params"])


def test_the_oracle_sees_a_gradient_applied_to_the_wrong_version(straggled):
    """Record one stale update as computed on a neighbouring version: the replay no longer
    matches the run. (The run's equality above is therefore not a property of any order.)"""
    cfg, report = straggled
    updates = report.extra["async"]["updates"]
    i = next(i for i, u in enumerate(updates) if u["staleness"] > 0)
    wrong = copy.deepcopy(updates)
    wrong[i]["computed_on"] += 1  # one version fresher than the one its worker really pulled
    losses, _ = replay_updates(cfg, wrong, worker_batch)
    assert max(abs(a - b) for a, b in zip(report.losses[:i], losses[:i])) <= TOL
    assert abs(report.losses[i] - losses[i]) > 100 * TOL, (report.losses[i], losses[i])


@pytest.mark.parametrize("bound", [-1, 0, 1, 2])
@pytest.mark.parametrize("times", [{1: 3.0, 2: 1.0, 3: 1.1}, {1: 1.0, 2: 1.3, 3: 5.0}])
def test_server_schedule_simulated(bound, times):
    """The server's loop against simulated workers (no ranks, course/async_sim.py): every worker is
    stopped once, the budget is spent exactly, and no grant breaks the bound."""
    cfg = RunConfig(**{**TINY, "steps": 6}, dp=4, asynchronous=True, max_staleness=bound).validate()
    a = simulate(cfg, times)  # (asserts every worker was stopped once, none left in flight)
    assert len(a["updates"]) == cfg.steps * 3 == sum(a["updates_per_worker"].values())
    fake = SimpleNamespace(extra={"async": a}, losses=[0.0] * len(a["updates"]), max_abs_diff=0.0)
    _check(cfg, fake)
    if bound == 0:
        assert [u["staleness"] for u in a["updates"]] == [0, 1, 2] * cfg.steps


@pytest.mark.parametrize("times", [{1: 1.0, 2: 1.0, 3: 1.0}, {1: 3.0, 2: 1.0, 3: 1.0}])
def test_simulated_staleness_meets_theory(times):
    """Unbounded, workers of fixed step times (simulated, so the staleness is counted, not timed):
    W - 1 on average; with a 3x straggler F(W-1) for it and W - 2 + 1/F for the others (the
    first and last updates of the run see fewer: a margin for those ends)."""
    cfg = RunConfig(**{**TINY, "steps": 40}, dp=4, asynchronous=True).validate()
    a = simulate(cfg, times)
    expected = theory.async_staleness(3, max(times.values()))
    assert a["theory"] == expected
    assert a["staleness_mean"] == pytest.approx(expected["mean"], abs=0.05)
    for w, t in times.items():
        want = expected["straggler"] if t > 1 else expected["others"]
        got = a["staleness_mean_by_worker"][str(w)]
        assert got == pytest.approx(want, abs=0.1 * want), (w, a["staleness_mean_by_worker"])


def test_max_staleness_zero_is_a_barrier_every_step():
    """K = 0: every round's W gradients come from one version and are applied in turn."""
    cfg, report = _run(dp=4, max_staleness=0, straggler="3:2")
    a = _check(cfg, report)
    assert a["staleness_histogram"] == {"0": 3, "1": 3, "2": 3}
    assert a["updates_per_worker"] == {"1": 3, "2": 3, "3": 3}
    assert a["staleness_mean"] == a["theory"]["mean"] == 1.0
    assert sorted(u["computed_on"] for u in a["updates"]) == [0] * 3 + [3] * 3 + [6] * 3


def test_async_without_a_straggler_equals_its_replay():
    """4 ranks, no straggler, no bound, another seed than the tests above (seeds 0, 1, 2 in the
    default suite; the matrix of seeds is -m slow): the run equals the replay of its own order."""
    cfg, report = _run(dp=4, batch=12, seed=2)
    a = _check(cfg, report)
    assert a["straggler"] is None and sum(a["updates_per_worker"].values()) == 3 * cfg.steps


def test_one_worker_is_plain_sgd():
    """--dp 2: one worker, never stale: the single-process reference itself, step by step."""
    cfg, report = _run(dp=2, batch=4)
    _check(cfg, report)
    ref_losses, _ = train_reference(cfg)
    assert max(abs(a - b) for a, b in zip(report.losses, ref_losses)) <= TOL
    assert report.extra["async"]["staleness_histogram"] == {"0": cfg.steps}


def test_a_synchronous_straggler_changes_time_only():
    cfg = RunConfig(**{**TINY, "batch": 4}, dp=2, straggler="1:2", reference=True).validate()
    report = launch.run(cfg)
    assert report.max_abs_diff <= TOL
    assert report.ranks[1]["straggler_slept_s"] > 0 and "straggler_slept_s" not in report.ranks[0]


def test_theory_of_staleness():
    assert theory.async_staleness(4)["mean"] == 3
    t = theory.async_staleness(4, factor=3)
    assert (t["mean"], t["straggler"], t["others"]) == (3, 9, 2 + 1 / 3)
    assert theory.async_staleness(4, max_staleness=0) == {"bound": 3, "mean": 1.5,
                                                         "straggler": None, "others": None}
    assert theory.async_staleness(3, max_staleness=2)["bound"] == 10


REFUSED = [
    (dict(asynchronous=True), "needs --dp 2"),
    (dict(asynchronous=True, dp=4, batch=8), "choose a multiple of 12"),
    (dict(asynchronous=True, dp=2, tp=2), "--async with --tp"),
    (dict(asynchronous=True, dp=2, pp=2, layers=2), "--async with --pp"),
    (dict(asynchronous=True, dp=2, cp=2), "--async with --cp"),
    (dict(asynchronous=True, dp=2, experts=2), "--async with --experts"),
    (dict(asynchronous=True, dp=2, zero=1), "--async with --zero"),
    (dict(asynchronous=True, dp=2, grad_accum=2), "--async with --grad-accum"),
    (dict(asynchronous=True, dp=2, precision="bf16-mixed"), "--async with --precision"),
    (dict(asynchronous=True, dp=2, checkpointing="full"), "--async with --checkpointing"),
    (dict(asynchronous=True, dp=2, save="x"), "--async with --save"),
    (dict(asynchronous=True, dp=2, backend="nccl"), "--async with --backend"),
    (dict(asynchronous=True, dp=2, sync_every=2), "--async with --sync-every"),
    (dict(asynchronous=True, dp=2, federated=True), "--async with --federated"),
    (dict(max_staleness=1, dp=2), "add --async"),
    (dict(asynchronous=True, dp=2, max_staleness=-2), "--max-staleness -2"),
    (dict(straggler="1:3"), "needs --dp 2"),
    (dict(straggler="3", dp=4), "RANK:FACTOR"),
    (dict(straggler="1:0.5", dp=2), "FACTOR must be between"),
    (dict(straggler="4:2", dp=4), "RANK must be a rank, 0..3"),
    (dict(straggler="0:2", dp=4, batch=12, asynchronous=True), "rank 0 is the parameter server"),
    (dict(straggler="1:2", dp=2, tp=2), "--straggler with --tp"),
]


@pytest.mark.parametrize("kw,reason", REFUSED)
def test_refused_with_its_reason(kw, reason):
    with pytest.raises(ConfigError, match=reason) as e:
        RunConfig(**kw).validate()
    assert "\n" not in str(e.value)


def test_cli_refuses_in_one_line_without_torch():
    code = ("import sys; from parallel_mini.__main__ import main\n"
            "rc = main(['run', '--async', '--dp', '2', '--dp-mode', 'naive'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "--dp-mode" in p.stderr and "--async" in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2, 3])
@pytest.mark.parametrize("dp,straggler,bound", [
    (2, "", -1), (2, "1:3", -1), (4, "", -1), (4, "3:3", -1), (4, "1:3", 1), (4, "", 2),
    (4, "2:2", 0), (3, "2:3", -1)])
def test_async_matrix_equals_its_replay(seed, dp, straggler, bound):
    batch = {2: 4, 3: 6, 4: 12}[dp]
    cfg, report = _run(dp=dp, batch=batch, seed=seed, straggler=straggler, max_staleness=bound,
                       steps=4)
    _check(cfg, report)


@pytest.mark.slow
def test_bench_async_runs_and_reports():
    from parallel_mini.course.bench import _print_async, bench_async
    res = bench_async(4, 2.0, 2, 12, model=dict(layers=1, d_model=16, heads=2, seq=8, vocab=32))
    runs = {r["run"]: r for r in res["runs"]}
    assert set(runs) == {"sync DP, straggler", "async K=0, straggler", "async, straggler",
                         "sync DP", "async"}
    assert runs["sync DP"]["updates"] == runs["sync DP, straggler"]["updates"] == 2
    assert [p["loss"] for p in runs["sync DP"]["curve"]] == \
        [p["loss"] for p in runs["sync DP, straggler"]["curve"]]  # a straggler costs time only
    for r in res["runs"]:
        assert r["samples_to_target"] is not None and r["curve"][-1]["samples"] == 24
    assert runs["async K=0, straggler"]["staleness_histogram"] == {"0": 2, "1": 2, "2": 2}
    _print_async(res)


@pytest.mark.slow
def test_async_with_sgd_equals_its_replay():
    cfg, report = _run(dp=4, seed=5, straggler="1:2", optimizer="sgd", lr=0.05)
    _check(cfg, report)
