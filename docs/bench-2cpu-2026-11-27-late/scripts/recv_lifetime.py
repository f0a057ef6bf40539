"""Section 3: a loop of irecv + isend + wait + wait (4 B) between 2 gloo ranks, 2,000 steps, wall
time per step, with each receive's Work freed at a different moment:
  plain     the loop inline: the names are rebound after the next irecv is posted
  del       both Works freed right after their waits, before the next posting
  keeprecv  only the receive's Work kept until the next receive is posted
  keepsend  only the send's Work kept

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/recv_lifetime.py plain,del,keeprecv,keepsend
"""
import sys
import time

import torch
import torch.distributed as dist

from parallel_mini.runtime.launch import run_ranks


def fn(variant, k):
    n, r = dist.get_world_size(), dist.get_rank()
    one, buf = torch.ones(1), torch.empty(1)
    right, left = (r + 1) % n, (r - 1) % n
    keep = []
    dist.barrier()
    t = time.perf_counter()
    for _ in range(k):
        rq = dist.irecv(buf, left)
        sq = dist.isend(one, right)
        rq.wait()
        sq.wait()
        if variant == "del":
            del rq, sq
        elif variant in ("keeprecv", "keepsend"):
            keep[:] = [rq if variant == "keeprecv" else sq]
            del rq, sq
    return (time.perf_counter() - t) / k * 1e6


if __name__ == "__main__":
    for v in sys.argv[1].split(","):
        us = run_ranks(fn, 2, v, 2000, timeout=120, backend="gloo")[0].value
        print(f"{v}: {us:.0f} us a step")
