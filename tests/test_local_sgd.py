"""Local SGD (--sync-every H, parallel/local_sgd.py): equal to its single-process twin
(reference.simulate_local_sgd) at 1, 2 and 4 ranks; bytes per step H times fewer than at H = 1,
counted (comm records), predicted (theory) and written to the sockets (measured); every other
layout refused, one line, before torch is imported."""
import subprocess
import sys

import pytest

from parallel_mini import theory
from parallel_mini.runtime.cli import _summary
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.course.experiments import local_sgd_bytes
from parallel_mini.runtime.launch import run
from parallel_mini.reference import simulate_local_sgd, train_reference

TOY = dict(layers=1, d_model=32, heads=2, seq=16, vocab=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def config(**kw) -> RunConfig:
    kw = {**TOY, "batch": 4 * kw.get("dp", 1), "steps": 4, "sync_every": 2, "reference": True, **kw}
    return RunConfig(**kw)


def check(report, written: bool = True) -> None:
    """Equal to the simulation; rank by rank the all-reduces' bytes equal the formula, and (on
    Linux, gloo) what the sockets took is within 3% of it (gloo's headers)."""
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail
    summary = report.extra["local_sgd"]
    steps, every = report.config["steps"], report.config["sync_every"]
    assert summary["averages"] == -(-steps // every)
    for r in range(report.world_size):
        counted = report.wire_bytes_per_step(r).get("dp", 0)
        assert counted == pytest.approx(report.theory["wire_bytes_per_step"]["dp"], abs=0.5)
        measured = report.wire_bytes_per_step(r, kind="measured").get("dp", 0)
        if written and counted and measured is not None and sys.platform.startswith("linux"):
            assert measured == pytest.approx(counted, rel=0.03), (r, measured, counted)


def test_local_sgd_two_ranks_equals_its_simulation_and_bytes_fall_by_h():
    """dp 2: H = 2 over 4 steps averages twice; H = 1 four times: twice the bytes per step."""
    apart = run(config(dp=2))
    check(apart)
    assert "local SGD: 2 averages of the weights" in _summary(apart)
    every_step = run(config(dp=2, sync_every=1, reference=False))
    ratio = every_step.wire_bytes_per_step()["dp"] / apart.wire_bytes_per_step()["dp"]
    assert ratio == 2
    written = [r.wire_bytes_per_step(kind="measured")["dp"] for r in (every_step, apart)]
    if None not in written:
        assert written[0] / written[1] == pytest.approx(2, rel=0.03)


def test_local_sgd_four_ranks_with_the_optimizer_states():
    """dp 4, Adam's moments averaged with the weights: three times the bytes of the weights."""
    report = run(config(dp=4, sync_optimizer=True))
    check(report)
    counted = report.extra["local_sgd"]["bytes_per_step"]["counted"]
    weights_only = theory.local_sgd_wire_bytes_per_step(config(dp=4), report.theory["n_params"])
    assert counted == pytest.approx(3 * weights_only)


def test_h1_with_sgd_is_data_parallel_and_with_adam_is_not():
    """One process, no ranks: averaging parameters after every SGD step is averaging gradients
    (the plain reference, which steps on the whole batch), to rounding; Adam's step is not linear
    in the gradient, so there the two differ."""
    for optimizer, lr, same in (("sgd", 0.5, True), ("adam", 3e-3, False)):
        cfg = config(dp=2, sync_every=1, optimizer=optimizer, lr=lr, steps=3)
        losses, params = simulate_local_sgd(cfg)
        ref_losses, ref_params = train_reference(RunConfig(**{**cfg.to_dict(), "sync_every": 0}))
        diff = max((params[n] - ref_params[n]).abs().max().item() for n in params)
        assert (diff <= 1e-6) == same, (optimizer, diff)
        assert losses[0] == pytest.approx(ref_losses[0], abs=1e-6)  # the same first step


def test_local_sgd_formula():
    """ceil(T/H) averages in T steps, of 4 bytes a parameter (x3 with Adam's moments)."""
    cfg = RunConfig(dp=4, steps=6, sync_every=4)
    ring = theory.wire_bytes("all_reduce", 4 * 1000, 4)  # 2 (N-1)/N S
    assert theory.local_sgd_wire_bytes_per_step(cfg, 1000) == 2 * ring / 6
    cfg = cfg.replace(sync_optimizer=True)
    assert theory.local_sgd_wire_bytes_per_step(cfg, 1000) == 3 * 2 * ring / 6
    cfg = cfg.replace(optimizer="sgd")  # SGD keeps no state: nothing more to average
    assert theory.local_sgd_wire_bytes_per_step(cfg, 1000) == 2 * ring / 6


REFUSED = [
    (dict(tp=2), "--tp 2: tensor-parallel"), (dict(pp=2, layers=2), "--pp 2: pipeline"),
    (dict(cp=2), "--cp 2: context-parallel"), (dict(dp=2, zero=1), "--zero 1: ZeRO"),
    (dict(dp=2, ep=2, experts=2), "--ep 2: expert parallel"),
    (dict(dp_mode="naive"), "--dp-mode naive"), (dict(precision="bf16-mixed"), "bf16"),
    (dict(save="/tmp/x"), "--save: a checkpoint"), (dict(offload_disk="/tmp/x"), "--offload-disk"),
]


@pytest.mark.parametrize("kw,reason", REFUSED)
def test_local_sgd_refuses_every_layout_but_dp(kw, reason):
    with pytest.raises(ConfigError, match=reason) as e:
        RunConfig(sync_every=2, **kw).validate()
    assert "\n" not in str(e.value) and str(e.value).startswith("--sync-every 2 with ")


@pytest.mark.parametrize("kw,reason", [(dict(sync_every=-1), "--sync-every -1"),
                                       (dict(sync_optimizer=True), "--sync-optimizer")])
def test_bad_local_sgd_values(kw, reason):
    with pytest.raises(ConfigError, match=reason):
        RunConfig(**kw).validate()


def test_cli_refuses_without_torch():
    """One line, exit 2, and torch never imported."""
    code = ("import sys; from parallel_mini.__main__ import main; "
            "rc = main(['run', '--sync-every', '2', '--tp', '2']); "
            "sys.exit(rc if 'torch' not in sys.modules else 99)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "--tp 2" in out.stderr


# -- -m slow: every world size, the optimizer states, gradient accumulation, experts -------------
@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("kw", [dict(), dict(sync_optimizer=True), dict(sync_every=3, steps=5),
                                dict(grad_accum=2), dict(optimizer="sgd", lr=0.3)])
def test_local_sgd_matrix(dp, kw):
    check(run(config(dp=dp, **kw)))


@pytest.mark.slow
def test_local_sgd_with_experts():
    """A mixture-of-experts model on dp ranks (its experts whole on every rank) trains apart too."""
    check(run(config(dp=2, experts=2, layers=2)))


@pytest.mark.slow
def test_local_sgd_bytes_experiment():
    """The lesson's figure: bytes per sample, DDP's and local SGD's at H = 1, 2, 4 on 2 ranks."""
    rows = local_sgd_bytes(dp=2, every=(1, 2, 4), steps=4)
    assert [r["sync_every"] for r in rows] == [0, 1, 2, 4]
    assert [r["ratio_to_ddp"] for r in rows] == [1, 1, 0.5, 0.25]
    for r in rows:
        b = r["bytes_per_sample"]
        assert b["counted"] == pytest.approx(b["theory"])
        if b["measured"] is not None:
            assert b["measured"] == pytest.approx(b["counted"], rel=0.03)
