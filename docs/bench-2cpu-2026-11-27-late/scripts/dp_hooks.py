"""Section 4: our bucketed data parallel at dp 2, time spent inside DataParallel._on_grad_ready
(wrapped) and in finish_gradient_sync per step, per rank: [step ms, hooks ms, sync ms].

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/dp_hooks.py
"""
import sys, time, statistics
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks

def rank_fn(cfg_dict, steps):
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.model import build_model
    from parallel_mini.data import global_batch, shard
    from parallel_mini.optim import Adam
    from parallel_mini.parallel.data import DataParallel
    cfg = RunConfig.from_dict(cfg_dict)
    n, r = dist.get_world_size(), dist.get_rank()
    model = build_model(cfg)
    spent = [0.0]
    orig = DataParallel._on_grad_ready
    def timed(self, p):
        t = time.perf_counter(); orig(self, p); spent[0] += time.perf_counter() - t
    DataParallel._on_grad_ready = timed
    dp = DataParallel(model, Comm(build_mesh(cfg)), mode="bucketed", bucket_mb=cfg.bucket_mb)
    opt = Adam(model.parameters(), lr=cfg.lr)
    hook_s, unpack_s, step_s = [], [], []
    for i in range(steps):
        x, y = shard(global_batch(cfg, i), r, n)
        dist.barrier()
        spent[0] = 0.0
        t = time.perf_counter()
        model(x, y).backward()
        t1 = time.perf_counter(); dp.finish_gradient_sync(); t2 = time.perf_counter()
        opt.step(); opt.zero_grad()
        step_s.append(time.perf_counter() - t); unpack_s.append(t2 - t1); hook_s.append(spent[0])
    return [round(1e3 * statistics.median(v[5:]), 2) for v in (step_s, hook_s, unpack_s)]

cfg = RunConfig(dp=2, batch=16, bucket_mb=0.25, steps=50).validate()
print("step ms, hooks ms, finish_gradient_sync ms:", [r.value for r in run_ranks(rank_fn, 2, cfg.to_dict(), 40, timeout=300, backend="gloo")])
