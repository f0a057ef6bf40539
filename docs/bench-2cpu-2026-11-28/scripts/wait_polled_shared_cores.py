"""N ranks (2: a core each; 4: sharing the 2 cores): a 512-float all-reduce after five matmuls or a
0.5 ms sleep, waited for by blocking, spinning on is_completed(), or spinning with os.sched_yield();
medians of 40, max over ranks, two rounds (README section 6).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/wait_polled_shared_cores.py 2|4
"""
import time, statistics, os, sys
import torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
def rank_fn():
    out = {}
    x = torch.randn(512)
    a = torch.randn(512, 64); w = torch.randn(64, 64)
    def blocking(): dist.all_reduce(x)
    def spin():
        wk = dist.all_reduce(x, async_op=True)
        while not wk.is_completed(): pass
        wk.wait()
    def spin_yield():
        wk = dist.all_reduce(x, async_op=True)
        while not wk.is_completed(): os.sched_yield()
        wk.wait()
    gaps = {"5 matmuls": lambda: [a @ w for _ in range(5)], "sleep 0.5 ms": lambda: time.sleep(5e-4)}
    for rnd in range(2):
        for gname, gap in gaps.items():
            for fname, f in (("blocking", blocking), ("spin", spin), ("spin+yield", spin_yield)):
                ts = []
                for i in range(40):
                    gap()
                    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
                t = torch.tensor([statistics.median(ts)]); dist.all_reduce(t, op=dist.ReduceOp.MAX)
                out.setdefault(f"{gname:13s} {fname}", []).append(round(t.item() * 1e3, 3))
    return out
n = int(sys.argv[1])
for k, v in run_ranks(rank_fn, n, timeout=300, backend="gloo")[0].value.items(): print(f"{n} ranks {k:30s} {v} ms")
