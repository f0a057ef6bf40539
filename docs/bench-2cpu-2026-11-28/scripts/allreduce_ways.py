"""2 ranks, back to back: one all-reduce of NUMEL floats by dist.all_reduce, comm.all_reduce, the functional all-reduce and async + wait (medians of 200, three rounds).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/allreduce_ways.py 16384
"""
import time, statistics, sys
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks

def rank_fn(numel, reps):
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    import torch.distributed._functional_collectives as fc
    comm = Comm(build_mesh(RunConfig(tp=2, batch=2)))
    g = comm.mesh.groups["tp"]
    x = torch.randn(numel)
    name = dist._get_process_group_name(g) if hasattr(dist, "_get_process_group_name") else g.group_name
    def a(): dist.all_reduce(x, group=g)
    def b(): comm.all_reduce(x, "tp")
    def c():
        y = torch.ops._c10d_functional.all_reduce(x, "sum", g.group_name)
        torch.ops._c10d_functional.wait_tensor(y)
    def d(): dist.all_reduce(x, group=g, async_op=True).wait()
    out = {}
    for k in range(3):
        for nm, f in (("dist sync", a), ("comm", b), ("functional", c), ("dist async+wait", d)):
            dist.barrier(group=g)
            ts = []
            for i in range(reps):
                t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
            out.setdefault(nm, []).append(statistics.median(ts) * 1e3)
    return out
numel = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
res = run_ranks(rank_fn, 2, numel, 200, timeout=300, backend="gloo")
for k, v in res[0].value.items(): print(f"{k:18s}", " ".join(f"{t:.3f}" for t in v), "ms")
