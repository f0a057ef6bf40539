"""One async all-reduce launched and waited for, through Comm (recorded) and bare
(dist.all_reduce and the same polled wait), on 2 ranks, 300 calls each, twice: medians of the wall
time of a call and of this thread's CPU in its launch, per tensor size (elements).
Variants of Comm (argv): those of comm_variants.py (full, nowire, noread, nofuture, nometer), and
noclock (nometer, and the CPU clock a constant).
python docs/bench-2cpu-2026-12-07/scripts/allreduce_launch_cost.py full nometer noclock"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

import parallel_mini.course.bench as B
from comm_variants import comm_variant
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks


def rank(cfgd, size, reps, variants):
    from parallel_mini import meters
    from parallel_mini.meters import wait_for

    mesh = B.build_mesh(RunConfig.from_dict(cfgd))
    group, x = mesh.groups["dp"], torch.ones(size)
    comms = {}
    for v in variants:
        comms[v] = comm_variant(mesh, "nometer" if v == "noclock" else v)
    thread_time = time.thread_time

    def call(v):
        c0 = thread_time()
        if v == "bare":
            work = dist.all_reduce(x, group=group, async_op=True)
            c = thread_time() - c0
            wait_for(work, comms[variants[0]].polls if variants else False)
            return c
        meters.time.thread_time = (lambda: 0.0) if v == "noclock" else thread_time
        h = comms[v].all_reduce(x, "dp", async_op=True, bucket=0, grads_pending=0)
        c = thread_time() - c0
        h.wait()
        meters.time.thread_time = thread_time
        return c

    out = {}
    for v in ("bare", *variants) * 2:
        walls, cpus = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            cpus.append(call(v))
            walls.append(time.perf_counter() - t0)
        out[v] = out.get(v, []) + [(1e6 * statistics.median(walls), 1e6 * statistics.median(cpus))]
    return out


if __name__ == "__main__":
    cfg = RunConfig(dp=2).validate()
    for size in (1, 65536):
        res = run_ranks(rank, 2, cfg.to_dict(), size, 300, sys.argv[1:], timeout=600, backend="gloo")
        for k, v in res[0].value.items():
            print(size, f"{k:9s}", ";  ".join(f"wall {w:.0f} us, launch CPU {c:.0f} us" for w, c in v))
