"""One exchange (isend + irecv, batch_isend_irecv) per repeat, each after a barrier and followed by
the slowest-rank all-reduce: the first half of the repeats free the exchange's Works at once, the
second half keep them until the next exchange has waited. 2 and 4 ranks, 4 B and 64 KB.
python docs/bench-2cpu-2026-12-07/scripts/p2p_after_freed_works.py"""
import time, statistics, torch, torch.distributed as dist, sys
from parallel_mini.runtime.launch import run_ranks
def rank(numel, repeats):
    n, r = dist.get_world_size(), dist.get_rank(); right, left = (r + 1) % n, (r - 1) % n
    full, recv = torch.ones(numel), torch.empty(numel); kept = []
    def p2p(keep):
        ops = [dist.P2POp(dist.isend, full, right), dist.P2POp(dist.irecv, recv, left)]
        works = dist.batch_isend_irecv(ops)
        for w in works: w.wait()
        if keep: kept[:] = works
    t = {False: [], True: []}
    for i in range(2 * repeats + 2):
        keep = i >= repeats + 1
        dist.barrier(); t0 = time.perf_counter(); p2p(keep)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64); dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= 2: t[keep].append(dt.item())
    return "freed %.3f ms, kept %.3f ms" % (1e3 * statistics.median(t[False]), 1e3 * statistics.median(t[True]))
for n in (2, 4):
    for numel in (1, 16384):
        print(n, numel * 4, "B:", run_ranks(rank, n, numel, 40, timeout=300, backend="gloo")[0].value)
