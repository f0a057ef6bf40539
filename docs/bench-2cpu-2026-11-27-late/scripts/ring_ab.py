"""Section 3's A/B: our ring_all_reduce against gloo's all-reduce, samples of CALLS calls back to
back after a barrier (the two alternate sample by sample), median per call of the slowest rank.
Run it on two checkouts to compare them:

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/ring_ab.py RANKS [SAMPLES CALLS]
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

from parallel_mini.runtime.launch import run_ranks

SIZES = [16384, 262144, 1048576]  # fp32 elements: 64 KB, 1 MB, 4 MB


def fn(samples, calls):
    from parallel_mini.comm import Comm, ring_all_reduce
    from parallel_mini.config import RunConfig
    from parallel_mini.mesh import build_mesh

    n = dist.get_world_size()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    impls = {"ring": lambda x: ring_all_reduce(x, comm), "gloo": dist.all_reduce}
    out = {}
    for numel in SIZES:
        x = torch.randn(numel)
        t = {k: [] for k in impls}
        for i in range(samples + 1):  # the first warms up
            for k, f in (list(impls.items()) if i % 2 else list(impls.items())[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    f(x)
                dt = torch.tensor((time.perf_counter() - t0) / calls)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i:
                    t[k].append(dt.item())
            comm.records.clear(), comm.p2p_log.clear()
        out[numel] = {k: statistics.median(v) for k, v in t.items()}
    return out


if __name__ == "__main__":
    ranks = int(sys.argv[1])
    samples, calls = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 3 else (9, 5)
    res = run_ranks(fn, ranks, samples, calls, timeout=300, backend="gloo")[0].value
    for numel, d in res.items():
        print(f"{ranks} ranks, {numel * 4 / 2 ** 20:g} MB: ring {1e3 * d['ring']:.2f} ms, gloo "
              f"{1e3 * d['gloo']:.2f} ms, ring/gloo bus bandwidth {d['gloo'] / d['ring']:.2f}")
