"""2 gloo ranks: all-reduces of 512 and 32,768 floats (sum, max) back to back, then after five small
matmuls each (median of 100; README section 5).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/allreduce_after_compute.py
"""
import time, statistics
import torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
def rank_fn():
    g = None
    out = {}
    for name, numel, op in (("512 sum", 512, dist.ReduceOp.SUM), ("512 max", 512, dist.ReduceOp.MAX), ("32768 sum", 32768, dist.ReduceOp.SUM), ("512 sum again", 512, dist.ReduceOp.SUM)):
        x = torch.randn(numel)
        ts = []
        for i in range(100):
            t = time.perf_counter(); dist.all_reduce(x, op=op); ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts) * 1e3
    # inside a loop with compute between, like the loss
    a = torch.randn(512, 64); w = torch.randn(64, 64)
    for name, numel in (("512 after compute", 512), ("32768 after compute", 32768)):
        x = torch.randn(numel); ts = []
        for i in range(100):
            for _ in range(5): a @ w
            t = time.perf_counter(); dist.all_reduce(x); ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts) * 1e3
    return out
for k, v in run_ranks(rank_fn, 2, timeout=200, backend="gloo")[0].value.items(): print(f"{k:22s} {v:.3f} ms")
