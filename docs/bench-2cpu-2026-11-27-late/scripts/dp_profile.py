"""Section 4: data parallel at dp 2, DDP or our bucketed DataParallel alone (30 steps after 5),
median step time per rank; PROFILE=1: rank 0's cProfile by own time.

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/dp_profile.py ddp|ours PROFILE
"""
import sys, time, cProfile, pstats, io, statistics
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks

def rank_fn(cfg_dict, which, steps, prof):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.model import build_model
    from parallel_mini.data import global_batch, shard
    from parallel_mini.optim import Adam
    from parallel_mini.parallel.data import DataParallel
    cfg = RunConfig.from_dict(cfg_dict)
    n, r = dist.get_world_size(), dist.get_rank()
    model = build_model(cfg)
    if which == "ddp":
        fwd = DDP(model, bucket_cap_mb=cfg.bucket_mb); sync = lambda: None
    else:
        dp = DataParallel(model, Comm(build_mesh(cfg)), mode="bucketed", bucket_mb=cfg.bucket_mb)
        fwd, sync = model, dp.finish_gradient_sync
    opt = Adam(model.parameters(), lr=cfg.lr)
    def step(i):
        x, y = shard(global_batch(cfg, i), r, n)
        fwd(x, y).backward(); sync(); opt.step(); opt.zero_grad()
    for i in range(5): step(i)
    ts, pr = [], cProfile.Profile()
    for i in range(steps):
        dist.barrier()
        if prof: pr.enable()
        t = time.perf_counter(); step(i); ts.append(time.perf_counter() - t)
        if prof: pr.disable()
    s = io.StringIO()
    if prof: pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(16)
    return statistics.median(ts), s.getvalue()

which, prof = sys.argv[1], int(sys.argv[2])
cfg = RunConfig(dp=2, batch=16, bucket_mb=0.25, steps=50).validate()
res = run_ranks(rank_fn, 2, cfg.to_dict(), which, 30, prof, timeout=300, backend="gloo")
print(which, "ms/step", [round(1e3 * r.value[0], 1) for r in res])
print(res[0].value[1])
