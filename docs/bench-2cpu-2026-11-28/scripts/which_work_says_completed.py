"""2 gloo ranks: which async Work reports is_completed() without being waited on (0.5 s of asking):
all_reduce, all_gather, all_to_all, broadcast do; reduce_scatter does not (README section 6).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/which_work_says_completed.py
"""
import time, torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
def rank_fn():
    n = dist.get_world_size(); x = torch.ones(8 * n); out = {}
    ops = {
        "all_reduce": lambda: dist.all_reduce(x.clone(), async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8 * n * n), x.clone(), async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8), x.clone(), async_op=True),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(8 * n), x.clone(), async_op=True),
        "broadcast": lambda: dist.broadcast(x.clone(), 0, async_op=True),
    }
    for name, f in ops.items():
        w = f(); t = time.perf_counter()
        while not w.is_completed() and time.perf_counter() - t < 0.5: pass
        out[name] = w.is_completed(); w.wait()
    return out
print(run_ranks(rank_fn, 2, timeout=60, backend="gloo")[0].value)
