"""Which all-gathers one step of ZeRO-3 issues, and from where: wraps each Unit.gather and prints (unit, async, the calling frames) for the third step.

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/zero3_gather_count.py "dict(dp=2, zero=3, batch=16)"
"""
import torch, torch.distributed as dist, collections, traceback
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks
def rank_fn(cfg_dict):
    from parallel_mini.engine import parallelize
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.model import build_model
    from parallel_mini.data import global_batch, shard
    cfg = RunConfig.from_dict(cfg_dict)
    r, n = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg)
    ours = parallelize(model, Comm(build_mesh(cfg)), cfg)
    z = ours
    names = {id(u): type(u.module).__name__ + str(i) for i, u in enumerate(z.units)}
    log = []
    for u in z.units:
        g = u.gather
        def wrapped(comm, shard, async_op=False, u=u, g=g):
            log.append((names[id(u)], async_op, [f.name for f in traceback.extract_stack()[-5:-1]]))
            return g(comm, shard, async_op)
        u.gather = wrapped
    for i in range(3):
        log.clear()
        x, y = shard(global_batch(cfg, i), r, n)
        ours.zero_grad(); model(x, y).backward(); ours.finish_gradient_sync(); ours.step()
    return list(log)
import sys; cfg = RunConfig(**eval(sys.argv[1])).validate()
res = run_ranks(rank_fn, 2, cfg.to_dict(), timeout=300, backend="gloo")
for l in res[0].value: print(l)
