"""2 ranks: a 512-float all-reduce after nothing, a 0.5 ms or a 2 ms sleep, waited for by blocking
(dist.all_reduce), async + wait, or spinning on is_completed(); medians of 60, two rounds
(README section 6).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/wait_blocked_or_polled.py
"""
import time, statistics
import torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
def rank_fn():
    out = {}
    x = torch.randn(512)
    def blocking(): dist.all_reduce(x)
    def spinning():
        w = dist.all_reduce(x, async_op=True)
        while not w.is_completed(): pass
        w.wait()
    def asyncwait(): dist.all_reduce(x, async_op=True).wait()
    gaps = {"nothing": lambda: None, "sleep 0.5 ms": lambda: time.sleep(5e-4), "sleep 2 ms": lambda: time.sleep(2e-3)}
    for rnd in range(2):
        for gname, gap in gaps.items():
            for fname, f in (("blocking", blocking), ("async+wait", asyncwait), ("spin on is_completed", spinning)):
                ts = []
                for i in range(60):
                    gap()
                    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
                out.setdefault(f"{gname:13s} {fname}", []).append(round(statistics.median(ts) * 1e3, 3))
    return out
for k, v in run_ranks(rank_fn, 2, timeout=300, backend="gloo")[0].value.items(): print(f"{k:40s} {v} ms")
