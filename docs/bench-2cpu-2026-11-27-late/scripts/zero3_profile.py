"""Section 2: ZeRO-3 at dp 2, ours or FSDP2, 20 profiled steps: step time and rank 0's cProfile
by own time (18 collectives a step, the share of wait).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/zero3_profile.py ours|fsdp
"""
import sys, time, cProfile, pstats, io
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks

def rank_fn(cfg_dict, which, steps):
    from parallel_mini.engine import parallelize
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.model import build_model
    from parallel_mini.data import global_batch, shard
    from parallel_mini.course.peers import zero_peer
    cfg = RunConfig.from_dict(cfg_dict)
    r, n = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg)
    if which == "ours":
        ours = parallelize(model, Comm(build_mesh(cfg)), cfg)
        def step(x, y):
            ours.zero_grad(); model(x, y).backward(); ours.finish_gradient_sync(); ours.step()
    else:
        module, opt = zero_peer(cfg, "FSDP2")
        def step(x, y):
            opt.zero_grad(); module(x, y).backward(); opt.step()
    for i in range(3):
        x, y = shard(global_batch(cfg, i), r, n); step(x, y)
    dist.barrier()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for i in range(steps):
        x, y = shard(global_batch(cfg, i), r, n); step(x, y)
    pr.disable()
    dt = (time.perf_counter() - t) / steps
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    return dt, s.getvalue()

which = sys.argv[1]
cfg = RunConfig(dp=2, zero=3, batch=16, steps=30).validate()
res = run_ranks(rank_fn, 2, cfg.to_dict(), which, 20, timeout=300, backend="gloo")
print(which, "ms/step (profiled)", 1e3 * res[0].value[0])
print(res[0].value[1])
