"""Strategies that compose: tensor x pipeline x data parallel x ZeRO x checkpointing on one mesh.

Every supported combination equals the single-process reference (fp32, 1e-5), and every rank's
bytes per mesh axis and model states equal its stage's formula. The cheap subset runs in `make
test`; the whole matrix up to 8 ranks is marked `slow` (`pytest -m slow`). Combinations that still
cannot run are refused before any rank starts, each with its reason.
"""
import pytest

from parallel_mini import theory
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.runtime.launch import run

SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved", "zb", "zbv"]


def _layers(schedule: str, pp: int) -> int:
    return 2 * pp * (2 if schedule in ("interleaved", "zbv") else 1)


def check(report) -> None:
    """Equal to the reference; every rank's bytes per axis and states equal to its formula."""
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail
    stages = report.theory.get("stages")
    for rank in report.ranks:
        predicted = stages[rank["coords"]["pp"]] if stages else report.theory
        measured = report.wire_bytes_per_step(rank["rank"])
        for group, nbytes in predicted["wire_bytes_per_step"].items():
            assert measured.get(group, 0) == pytest.approx(nbytes, abs=0.5), (rank["rank"], group)
        for cat in ("params", "grads", "optimizer"):
            assert rank["memory"][cat] == predicted["memory"][cat], (rank["rank"], cat)


def config(**kw) -> RunConfig:
    kw.setdefault("steps", 2)
    kw.setdefault("microbatches", 2 * kw.get("pp", 1))
    kw.setdefault("batch", 4 * kw.get("dp", 1) * kw["microbatches"] // 2)
    kw.setdefault("layers", _layers(kw.get("schedule", "1f1b"), kw.get("pp", 1)))
    kw.setdefault("reference", True)
    return RunConfig(**kw)


# -- in make test: one of each kind --------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_tp_x_pp(schedule):
    check(run(config(tp=2, pp=2, schedule=schedule)))


def test_dp_tp_pp_eight_ranks():
    """Three axes at once, 8 ranks: dp 2 x tp 2 x pp 2 (1F1B), the CLI's defaults but 2 steps."""
    check(run(RunConfig(dp=2, tp=2, pp=2, schedule="1f1b", steps=2, reference=True)))


def test_tp_pp_zero1_interleaved():
    """Tensor and interleaved pipeline parallel under ZeRO-1: tp 2 x pp 2, two chunks per rank."""
    check(run(RunConfig(tp=2, pp=2, zero=1, schedule="interleaved", layers=8, steps=2,
                        reference=True)))


def test_sp_with_pp_sends_sequence_shards():
    """With SP the stages pass [b, s/tp, h]: half the point-to-point bytes of plain TP."""
    sp = run(config(tp=2, pp=2, sp=True, schedule="gpipe"))
    check(sp)
    plain = run(config(tp=2, pp=2, schedule="gpipe", steps=1, reference=False))
    assert sp.wire_bytes_per_step(0)["pp"] * 2 == plain.wire_bytes_per_step(0)["pp"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_with_pp_counts_recomputation(mode):
    """Each checkpointed segment runs once more in backward, also when the pipeline runner (not
    loss.backward) drives autograd: per rank, recomputed == first passes."""
    report = run(config(pp=2, tp=2, checkpointing=mode, schedule="1f1b"))
    check(report)
    for r in report.ranks:
        counts = r["recompute"]
        # 2 blocks per stage (full: a segment each; selective: one attention core each), 4 micro-batches
        assert counts["segment_forwards"] == report.config["steps"] * 4 * 2
        assert counts["recomputed_forwards"] == counts["segment_forwards"]


# -- the whole matrix: slow --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tp_x_pp_every_schedule(schedule):
    check(run(config(tp=2, pp=2, schedule=schedule)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved", "zbv"])
def test_dp_tp_pp_every_kind_of_schedule(schedule):
    check(run(config(dp=2, tp=2, pp=2, schedule=schedule)))


@pytest.mark.slow
@pytest.mark.parametrize("zero,schedule", [(1, "1f1b"), (2, "zb"), (2, "gpipe"), (1, "zbv"),
                                           (3, "1f1b")])
def test_tp_pp_zero(zero, schedule):
    check(run(config(dp=2, tp=2, pp=2, zero=zero, schedule=schedule)))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "zb", "zbv"])
def test_sp_pp_schedules(schedule):
    check(run(config(tp=2, pp=2, sp=True, schedule=schedule)))


@pytest.mark.slow
@pytest.mark.parametrize("mode,schedule", [("full", "zb"), ("selective", "interleaved"),
                                           ("full", "gpipe")])
def test_checkpointing_pp_schedules(mode, schedule):
    check(run(config(pp=2, checkpointing=mode, schedule=schedule)))


@pytest.mark.slow
def test_pipedream_with_tp_is_sequential_training_at_one_microbatch():
    """One micro-batch: no staleness, so PipeDream with TP stages is plain sequential training
    (its gradients are zeroed after every update: no model-state comparison here)."""
    report = run(config(tp=2, pp=2, schedule="pipedream", microbatches=1, batch=2))
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail


@pytest.mark.slow
def test_tp4_x_pp2():
    check(run(config(tp=4, pp=2, schedule="1f1b")))


# -- refused, with a reason ---------------------------------------------------------------------
REFUSED = [
    (dict(pp=2, schedule="pipedream", dp=2), "gradient sync per micro-batch"),
    (dict(pp=2, schedule="pipedream", zero=1), "PipeDream steps"),
    (dict(pp=2, precision="bf16-mixed", fp32_grad_accum=True), "fp32"),
    (dict(cp=4, cp_impl="ulysses", heads=2, d_model=32), "Ulysses gives each"),
    (dict(ep=2, dp=2), "expert parallel"),
    (dict(tp=2, pp=2, sp=True, seq=33), "--seq 33"),
    (dict(asynchronous=True, dp=2, tp=2), "composes with --dp alone"),
    (dict(asynchronous=True, dp=2, zero=1), "the server holds the whole optimizer"),
    (dict(straggler="1:3", dp=2, pp=2, layers=2), "composes with --dp alone"),
]


@pytest.mark.parametrize("kw,reason", REFUSED)
def test_refused_combinations_name_their_reason(kw, reason):
    with pytest.raises(ConfigError, match=reason) as e:
        RunConfig(**kw).validate()
    assert "\n" not in str(e.value)


def test_no_local_cap_under_torchrun(monkeypatch):
    """Locally at most 16 ranks (a laptop only thrashes beyond); under torchrun the cluster decides."""
    with pytest.raises(ConfigError, match="torchrun"):
        RunConfig(dp=32, batch=32).validate()
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "32"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    assert RunConfig(dp=32, batch=32).validate().world_size == 32
