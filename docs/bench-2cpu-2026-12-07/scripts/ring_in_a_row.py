"""The ring all-reduce on 4 gloo ranks, ms a call (10 back to back, median of 20 samples), with the
wire meter reading the counter once for the whole ring (Comm.in_a_row, as ring_all_reduce does)
against twice per step (in_a_row switched off), beside gloo's all-reduce; 64 KB, 256 KB, 1 MB.
python docs/bench-2cpu-2026-12-07/scripts/ring_in_a_row.py"""
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from parallel_mini.comm import Comm, ring_all_reduce
from parallel_mini.config import RunConfig
from parallel_mini.mesh import build_mesh
from parallel_mini.runtime.launch import run_ranks


def rank(numel, samples):
    n = dist.get_world_size()
    mk = lambda: Comm(build_mesh(RunConfig(dp=n, batch=n)))
    comms = {"in_a_row": mk(), "per_step": mk()}
    comms["per_step"].in_a_row = contextlib.nullcontext
    x = torch.randn(numel)
    names = list(comms) + ["gloo"]
    t = {k: [] for k in names}
    for i in range(samples + 1):
        for k in names[i % 3:] + names[:i % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(x) if k == "gloo" else ring_all_reduce(x, comms[k])
                x.mul_(0.25)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:
                t[k].append(dt.item() / 10)
        for c in comms.values():
            c.records.clear()
            c.p2p_log.clear()
    return " ".join(f"{k} {1e3 * statistics.median(v):.2f}" for k, v in t.items())


if __name__ == "__main__":
    for numel in (16384, 65536, 262144):
        print(f"{numel * 4 // 1024} KB, ms a call:",
              run_ranks(rank, 4, numel, 20, timeout=600, backend="gloo")[0].value)
