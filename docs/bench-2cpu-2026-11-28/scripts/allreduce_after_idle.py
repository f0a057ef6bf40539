"""2 gloo ranks: a 512-float all-reduce, median of 60, with something between calls: nothing, matmuls,
busy-waiting, sleeping (README section 5).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/allreduce_after_idle.py
"""
import time, statistics
import torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
def rank_fn():
    out = {}
    a = torch.randn(512, 64); w = torch.randn(64, 64)
    x = torch.randn(512)
    def busy(sec):
        t = time.perf_counter()
        while time.perf_counter() - t < sec: pass
    for name, between in (("nothing", lambda: None), ("1 matmul", lambda: a @ w), ("5 matmuls", lambda: [a @ w for _ in range(5)]),
                          ("busy 0.1 ms", lambda: busy(1e-4)), ("busy 0.5 ms", lambda: busy(5e-4)), ("busy 2 ms", lambda: busy(2e-3)),
                          ("sleep 0.5 ms", lambda: time.sleep(5e-4)), ("sleep 2 ms", lambda: time.sleep(2e-3))):
        ts = []
        for i in range(60):
            between()
            t = time.perf_counter(); dist.all_reduce(x); ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts) * 1e3
    return out
for k, v in run_ranks(rank_fn, 2, timeout=200, backend="gloo")[0].value.items(): print(f"{k:14s} {v:.3f} ms")
