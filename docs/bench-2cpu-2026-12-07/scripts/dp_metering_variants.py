"""bench dp (a)'s loop at dp 2 with runners chosen on the command line, each its own model, in a
rotating order (as the bench rotates DDP and ours), 5 warm-up + 200 measured steps; per runner the
median / mean / p90 of each part of a step (ms, rank by rank): forward, backward (DDP's wait is
inside its backward), our finish_gradient_sync, the optimizer, the whole step, and the main
thread's CPU. Runners: ddp (torch's DistributedDataParallel), ours (DataParallel(bucketed) on
Comm, as the bench runs it), and ours on the Comm variants of comm_variants.py (nowire, noread,
nofuture, nometer, bare). A name ending in `_percopy` (ours_percopy, bare_percopy) runs that
runner with the DataParallel of before section 7 (dp_percopy.py: one copy_ per gradient).
NOGC=1 in the environment: the garbage collector off in every rank (section 7).
python docs/bench-2cpu-2026-12-07/scripts/dp_metering_variants.py ddp ours nometer bare"""
import gc
import os
import statistics
import sys
import time

import torch.distributed as dist

import parallel_mini.course.bench as B
from comm_variants import comm_variant
from dp_percopy import PerCopy
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks


def rank(cfgd, names, warm, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim import Adam

    from parallel_mini.parallel.data import DataParallel

    if os.environ.get("NOGC"):
        gc.disable()
    cfg = RunConfig.from_dict(cfgd)
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = B.build_mesh(cfg)
    run, comms = {}, []
    for name in names:
        model = B.build_model(cfg)
        if name == "ddp":
            run[name] = (DDP(model, bucket_cap_mb=cfg.bucket_mb), lambda: None,
                         Adam(model.parameters(), lr=cfg.lr))
            continue
        base = name.removesuffix("_percopy")
        comm = comm_variant(mesh, "full" if base == "ours" else base)
        comms.append(comm)
        dp = (PerCopy if name.endswith("_percopy") else DataParallel)(
            model, comm, mode="bucketed", bucket_mb=cfg.bucket_mb)
        run[name] = (model, dp.finish_gradient_sync, Adam(model.parameters(), lr=cfg.lr))
    parts = {k: [] for k in run}
    for i in range(warm + steps):
        x, y = B.shard(B.global_batch(cfg, i), r, n)
        for comm in comms:
            comm.step = i
        for name in names[i % len(names):] + names[:i % len(names)]:
            forward, sync, opt = run[name]
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            loss = forward(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t4 = time.perf_counter()
            if i >= warm:
                parts[name].append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0,
                                    time.thread_time() - c0))
    return {k: [(1e3 * statistics.median(c), 1e3 * statistics.mean(c),
                 1e3 * sorted(c)[int(0.9 * len(c))]) for c in zip(*v)] for k, v in parts.items()}


if __name__ == "__main__":
    names = sys.argv[1:]
    cfg = RunConfig(dp=2, batch=16, bucket_mb=0.25, steps=10).validate()
    for rr in run_ranks(rank, 2, cfg.to_dict(), names, 5, 200, timeout=900, backend="gloo"):
        for k, v in rr.value.items():
            print(f"{k:9s}", "  ".join("%s %.2f/%.2f/%.2f" % (lab, *c) for lab, c in
                                       zip(("fwd", "bwd", "finish", "opt", "total", "cpu"), v)))
