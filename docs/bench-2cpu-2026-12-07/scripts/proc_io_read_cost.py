"""What one reading of /proc/self/io (the socket counter, meters.WireMeter) costs: 2,000 readings
in this process, then in rank 0 of 2 idle gloo ranks after one all-reduce; µs a reading, and the
threads of the process.
python docs/bench-2cpu-2026-12-07/scripts/proc_io_read_cost.py"""
import os
import time

import torch
import torch.distributed as dist

from parallel_mini.runtime.launch import run_ranks


def cost(n: int = 2000) -> tuple[int, float]:
    fd = os.open("/proc/self/io", os.O_RDONLY)
    t0 = time.perf_counter()
    for _ in range(n):
        os.pread(fd, 1024, 0)
    us = 1e6 * (time.perf_counter() - t0) / n
    os.close(fd)
    return len(os.listdir("/proc/self/task")), round(us, 1)


def rank():
    dist.all_reduce(torch.ones(4))
    return cost()


if __name__ == "__main__":
    print("this process: threads, us a reading", cost())
    print("rank 0 of 2:  threads, us a reading", run_ranks(rank, 2, backend="gloo", timeout=60)[0].value)
