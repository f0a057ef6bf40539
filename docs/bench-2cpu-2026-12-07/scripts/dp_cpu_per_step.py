"""bench dp (a)'s rank loop with each runner's CPU a step: the process (all its threads, gloo's
included) and the main thread, medians over 30 steps, per rank, at the dps in argv.
python docs/bench-2cpu-2026-12-07/scripts/dp_cpu_per_step.py 4 2
It was run with PYTHONPATH at c590122 plus e389f9a's bucket views, where every step ran all three
runners in a rotating order (the step attribution below assumes it); since e389f9a naive stops early."""
import sys, time, statistics
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.config import RunConfig
import parallel_mini.course.bench as B

def rank(cfgd, w, s):
    import time as T
    cpu = {}
    orig = T.perf_counter
    # wrap runner timing: measure process CPU between barrier and slowest-rank
    import torch.distributed as dist
    real_barrier = dist.barrier
    state = {}
    def barrier(*a, **k):
        real_barrier(*a, **k); state["p0"] = T.process_time(); state["t0"] = T.thread_time()
    def slowest(sec):
        state.setdefault("cpu", []).append((T.process_time() - state["p0"], T.thread_time() - state["t0"]))
        t = B.torch.tensor([sec], dtype=B.torch.float64); dist.all_reduce(t, op=dist.ReduceOp.MAX); return t.item()
    dist.barrier = barrier; B._slowest_rank = slowest
    out = B._dp_rank(cfgd, w, s)
    # runners order rotates: names = ddp, bucketed, naive; order = names[i%3:]+names[:i%3]
    names = ["ddp", "bucketed", "naive"]; res = {k: [] for k in names}; j = 0
    i = 0
    cpus = state["cpu"]
    while j < len(cpus):
        order = names[i % 3:] + names[:i % 3]
        for nm in order:
            if i >= w: res[nm].append(cpus[j])
            j += 1
        i += 1
    return {k: (1e3*statistics.median([c[0] for c in v]), 1e3*statistics.median([c[1] for c in v])) for k, v in res.items()}

for n in map(int, sys.argv[1:]):
    cfg = RunConfig(dp=n, batch=16, bucket_mb=0.25, steps=45).validate()
    for rr in run_ranks(rank, n, cfg.to_dict(), 5, 30, timeout=900, backend="gloo"):
        print(n, {k: "process %.1f ms, main thread %.1f ms" % v for k, v in rr.value.items()})
