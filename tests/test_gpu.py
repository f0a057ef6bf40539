"""On a machine with a CUDA GPU (`make test-gpu`, issue 27): the CUDA path at world size 1, and
pipeline / ring timelines with one CPU core per gloo rank.

Why world size 1: the machines this project borrows have one GPU, and NCCL refuses two ranks on
one device. So the multi-rank checks stay on gloo, here with a core of their own per rank (the
16-core host), and the CUDA checks are the plain step, every strategy that runs at world 1, the
memory meter against the CUDA caching allocator, and op timelines from CUDA events.

Every test is marked `gpu` and runs only when asked for (`pytest -m gpu`, conftest.py); the
CUDA ones skip without a CUDA device, the core-per-rank ones without enough cores. Measured
figures go to $PARALLEL_MINI_GPU_FIGURES (default build/gpu_figures.json) for docs/gpu.md.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.reference import train_reference

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
FIGURES: dict = {}
TOL = 1e-5  # fp32 with TF32 off: our run vs its reference on the same device


@pytest.fixture(autouse=True)
def figures():
    """What each test measured, written after every test (merged with earlier runs' figures), so
    that a run stopped at its time limit keeps what it had."""
    yield FIGURES
    path = Path(os.environ.get("PARALLEL_MINI_GPU_FIGURES", "build/gpu_figures.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    old.update(FIGURES)
    old["device"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                     "cores": len(os.sched_getaffinity(0)),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path.write_text(json.dumps(old, indent=1))


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 means fp32: TF32 matmuls (10-bit mantissa) would differ from the CPU by ~1e-3."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield


def _small(**kw) -> RunConfig:
    base = dict(steps=3, batch=4, seq=32, d_model=64, heads=4, layers=2, vocab=128,
                reference=True, backend="nccl")
    return RunConfig(**{**base, **kw}).validate()


# ---------------------------------------------------------------------------------------------
# 1. the CUDA path at world size 1
# ---------------------------------------------------------------------------------------------
@cuda
def test_reference_on_cuda_equals_the_cpu_reference():
    """The single-process reference itself, on the GPU and on the CPU: the same losses and final
    parameters within TOL (different kernels sum in different orders: not bit-identical)."""
    cfg = _small(steps=4)
    cpu_losses, cpu_params = train_reference(cfg, "cpu")
    gpu_losses, gpu_params = train_reference(cfg, "cuda")
    loss = max(abs(a - b) for a, b in zip(cpu_losses, gpu_losses))
    param = max((cpu_params[n] - gpu_params[n].cpu()).abs().max().item() for n in cpu_params)
    FIGURES["reference_cuda_vs_cpu"] = {"losses": loss, "params": param, "steps": cfg.steps}
    assert loss <= TOL and param <= TOL, (loss, param)


WORLD1 = {  # every feature that runs at world size 1 (flags as the CLI takes them)
    "plain": {},
    "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3},
    "checkpointing full": {"checkpointing": "full"},
    "checkpointing selective": {"checkpointing": "selective"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "bf16-mixed zero3": {"precision": "bf16-mixed", "zero": 3},
    "offload (ZeRO-Offload)": {"zero": 1, "offload": True},
    "MoE 4 experts top-2": {"experts": 4, "top_k": 2},
    "MoE zero3 + checkpointing": {"experts": 4, "top_k": 2, "zero": 3, "checkpointing": "full"},
}


@cuda
@pytest.mark.parametrize("name", list(WORLD1))
def test_world_size_1_on_nccl_equals_its_reference(name):
    """`run --backend nccl` on one GPU: the rank's model, optimizer and data on cuda:0, the
    reference on the same device; equal within TOL (bf16-mixed: against the bf16-mixed reference,
    the same arithmetic, so the same bound)."""
    report = run(_small(**WORLD1[name]))
    diff = report.max_abs_diff_detail
    FIGURES.setdefault("world1", {})[name] = {"max_abs_diff": diff,
                                              "final_loss": report.losses[-1]}
    assert report.ranks[0].get("cuda_memory"), "the rank did not run on CUDA"
    assert report.max_abs_diff <= TOL, diff


@cuda
@pytest.mark.parametrize("name, flags, per_param", [
    ("fp32 Adam", {}, 16),                              # 4 + 4 + 8
    ("bf16-mixed Adam", {"precision": "bf16-mixed"}, 16),  # 2 + 2 + 4 + 4 + 4
    ("bf16-mixed Adam, ZeRO-1", {"precision": "bf16-mixed", "zero": 1}, 16),  # 4 + 12/N at N = 1
    ("bf16-mixed Adam, ZeRO-2", {"precision": "bf16-mixed", "zero": 2}, 16),  # 2 + 14/N
    ("bf16-mixed Adam, ZeRO-3", {"precision": "bf16-mixed", "zero": 3}, 16),  # 16/N
])
def test_memory_meter_equals_the_cuda_allocator(name, flags, per_param):
    """The meter's bytes of each model-state category (storages, exact) against the CUDA caching
    allocator's own count: how far torch.cuda.memory_allocated() falls when the rank frees that
    category's storages at the end of the run. Equal once each storage is rounded up to the
    allocator's 512-byte blocks; and bytes per parameter as the formula says (16 at world 1 for
    every ZeRO stage: 16/7/5.5/4 need N = 4 GPUs). Whatever else the allocator holds is listed
    (the libraries' workspaces: cuBLAS keeps one per handle and stream)."""
    report = run(_small(steps=2, extra={"cuda_free_states": True}, **flags))
    r = report.ranks[0]
    meter, view, freed = r["memory"], r["cuda_memory"], r["cuda_freed"]
    states = meter["params"] + meter["grads"] + meter["optimizer"]
    FIGURES.setdefault("memory_vs_allocator", {})[name] = {
        "meter": {k: meter[k] for k in ("params", "grads", "optimizer")}, "freed": freed,
        "per_param": states / r["n_params"], "n_params": r["n_params"], "allocator_view": view}
    assert states == per_param * r["n_params"]
    for kind in ("params", "grads", "optimizer"):
        assert freed[kind] == view["rounded_512"][kind], (kind, freed, view["rounded_512"])
        assert 0 <= freed[kind] - meter[kind] < 512 * view["storages"][kind], kind  # rounding only


@cuda
def test_offload_keeps_the_optimizer_on_the_host():
    """ZeRO-Offload at world 1: the GPU holds bf16 parameters and gradients (4 bytes per
    parameter, the allocator agrees); the fp32 master and Adam's moments (12) are host memory."""
    report = run(_small(steps=2, precision="bf16-mixed", zero=1, offload=True,
                        extra={"cuda_free_states": True}))
    r = report.ranks[0]
    meter, view, freed = r["memory"], r["cuda_memory"], r["cuda_freed"]
    FIGURES["offload_world1"] = {"memory": meter, "freed": freed, "allocator_view": view,
                                 "n_params": r["n_params"]}
    assert meter["params"] + meter["grads"] == 4 * r["n_params"]
    assert meter["host"] == 12 * r["n_params"] and freed["optimizer"] == 0
    assert freed["params"] + freed["grads"] == view["rounded_512"]["params"] + view["rounded_512"]["grads"]


@cuda
def test_op_timeline_from_cuda_events():
    """Every op event carries the GPU's own start and end (CUDA events), on the host's clock: the
    GPU starts an op no earlier than the host launched it, and ends it no earlier than it started."""
    report = run(_small(steps=4, layers=4, d_model=256, seq=128, batch=8))
    events = report.ranks[0]["events"]
    assert events and all("gpu_start" in e and "gpu_end" in e for e in events)
    slack = 1e-4  # event timestamps have ~0.5 us resolution; origin taken after a synchronize
    for e in events:
        assert e["gpu_start"] >= e["start"] - slack and e["gpu_end"] >= e["gpu_start"]
    kinds = {}
    for e in events:
        if e["step"] > 0:  # after the first step's warm-up (kernel selection, allocator)
            kinds.setdefault(e["kind"], []).append(e)
    FIGURES["cuda_event_timeline"] = {k: {
        "ops": len(es), "gpu_ms_median": 1e3 * statistics.median(e["gpu_end"] - e["gpu_start"] for e in es),
        "host_ms_median": 1e3 * statistics.median(e["end"] - e["start"] for e in es)}
        for k, es in kinds.items()}


# ---------------------------------------------------------------------------------------------
# 2. gloo ranks with a core each: pipeline bubbles, the ring, ring attention
# ---------------------------------------------------------------------------------------------
def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _needs_cores(n: int):
    return pytest.mark.skipif(_cores() < n, reason=f"needs {n} cores for a core per rank")


@_needs_cores(8)
@pytest.mark.parametrize("pp, m", [(4, 8), (8, 16)])
def test_pipeline_bubbles_with_a_core_per_rank(pp, m):
    """Each schedule at pp ranks pinned one per core: the bubble measured on the wall clock, the
    replay with measured op times, and the formula; every run equals the reference."""
    from parallel_mini.course.bench import bench_bubble
    rows = bench_bubble(schedules=("gpipe", "1f1b", "interleaved", "zb", "zbv"), setups=((pp, m),),
                        repeats=3)
    FIGURES.setdefault("bubble", {})[f"pp{pp} m{m}"] = rows
    for row in rows:
        assert row["ranks_shared_cores"] is False, row["schedule"]
        assert row["max_abs_diff"] <= TOL, (row["schedule"], row["max_abs_diff"])


@_needs_cores(8)
def test_ring_all_reduce_bus_bandwidth_with_a_core_per_rank():
    """Our ring (send/recv) against gloo's all-reduce at 4 and 8 pinned ranks: bus bandwidth."""
    from parallel_mini.course.bench import bench_ring
    rows = [r for n in (4, 8) for r in bench_ring(n=n, sizes_mb=(0.0625, 1, 16, 64), repeats=5)]
    FIGURES["ring"] = rows
    assert all(r["max_abs_err"] <= 1e-4 for r in rows)


@_needs_cores(4)
def test_ring_attention_hidden_share_with_a_core_per_rank():
    """Ring attention (contiguous and zigzag) at cp 2 and 4, pinned: ours vs torch's template, and
    the share of each K/V hop hidden behind the current block's compute."""
    from parallel_mini.course.bench import bench_cp
    rows = bench_cp(cps=(2, 4), impls=("ring", "zigzag"))
    FIGURES["ring_attention"] = rows
    assert all(0.0 <= r["kv_hidden"] <= 1.0 for r in rows)
