"""Section 3: CPU seconds per wall second of each thread of rank 0 (/proc/self/task/*/stat,
clock ticks), over 300 rounds of our-style ring steps (2(N-1) irecv + isend of SIZE fp32 elements)
and over 300 of gloo's all-reduce of the same tensor: gloo_tcp_loop is gloo's I/O thread.

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/gloo_thread_cpu.py RANKS [SIZE]
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from parallel_mini.runtime.launch import run_ranks


def tasks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            s = open(f"/proc/self/task/{tid}/stat").read()
            name = s[s.index("(")+1:s.rindex(")")]
            f = s[s.rindex(")")+2:].split()
            out[tid] = (name, int(f[11]) + int(f[12]))  # utime+stime ticks
        except OSError: pass
    return out

def fn(reps, which, size):
    r, n = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(size); out = torch.empty(size // n if size > n else size)
    right, left = (r + 1) % n, (r - 1) % n
    k = 2 * (n - 1)
    dist.barrier()
    a = tasks(); t = time.perf_counter()
    for i in range(reps):
        if which == "ring":
            for _ in range(k):
                rq = dist.irecv(out, left); sq = dist.isend(buf[:out.numel()], right); rq.wait(); sq.wait()
        else:
            dist.all_reduce(buf)
    w = time.perf_counter() - t
    b = tasks()
    hz = os.sysconf("SC_CLK_TCK")
    per = {b[t][0] + ":" + t: (b[t][1] - a.get(t, (0, 0))[1]) / hz / w for t in b if b[t][1] - a.get(t, (0, 0))[1] > 0}
    return w / reps * 1e3, per

n = int(sys.argv[1])
for which in ("ring", "allreduce"):
    res = run_ranks(fn, n, 300, which, int(sys.argv[2]) if len(sys.argv) > 2 else 1, timeout=120, backend="gloo")
    print(which, f"{res[0].value[0]:.2f} ms per all-reduce-equivalent;", res[0].value[1])
