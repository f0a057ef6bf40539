"""The ring all-reduce in torch.distributed alone, on 4 gloo ranks, three ways, interleaved round by
round after a barrier (slowest rank's time, medians of the rounds): `step`, each step's receive
posted at its step and both Works waited (ringlib.bare_ring: the library's ring before section 7);
`ahead`, every receive posted before the first send, the sends waited at the end (the library's
ring since); `gloo`, dist.all_reduce. Prints ms and gloo's time / ours (= ours / gloo bus bandwidth).
python docs/bench-2cpu-2026-12-07/scripts/ring_posted_ahead.py [rounds=60]"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

from parallel_mini.runtime.launch import run_ranks
from ringlib import bare_ring

NAMES = ["step", "ahead", "gloo"]


def ahead_ring(x, n, r, landing, kept):
    chunks = list(x.view(-1).tensor_split(n))
    right, left = (r + 1) % n, (r - 1) % n
    width = chunks[0].numel()
    rs = [((r - s) % n, (r - s - 1) % n) for s in range(n - 1)]
    ag = [((r + 1 - s) % n, (r - s) % n) for s in range(n - 1)]
    lands = [landing[s * width: s * width + chunks[i].numel()] for s, (_, i) in enumerate(rs)]
    lands += [chunks[i] for _, i in ag]
    recvs = [dist.irecv(land, left) for land in lands]
    sends = []
    for step, (send_i, recv_i) in enumerate(rs):
        sends.append(dist.isend(chunks[send_i], right))
        recvs[step].wait()
        chunks[recv_i] += lands[step]
    for step, (send_i, _) in enumerate(ag, start=n - 1):
        sends.append(dist.isend(chunks[send_i], right))
        recvs[step].wait()
    for s in sends:
        s.wait()
    kept[:] = recvs + sends
    return x


def rank(sizes_mb, rounds):
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for mb in sizes_mb:
        numel = int(mb * 2 ** 20 / 4)
        base = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        landing, kept = torch.empty(numel), []
        t = {k: [] for k in NAMES}
        for i in range(rounds + 1):  # round 0 warms up
            for name in NAMES[i % 3:] + NAMES[:i % 3]:
                x = base.clone()
                dist.barrier()
                t0 = time.perf_counter()
                if name == "step":
                    bare_ring(x, n, r, landing, kept)
                elif name == "ahead":
                    ahead_ring(x, n, r, landing, kept)
                else:
                    dist.all_reduce(x)
                dt = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i:
                    t[name].append(dt.item())
        y, z = base.clone(), base.clone()
        ahead_ring(y, n, r, landing, kept)
        dist.all_reduce(z)
        out[mb] = {k: 1e3 * statistics.median(v) for k, v in t.items()}
        out[mb]["max_err"] = (y - z).abs().max().item()
    return out


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    res = run_ranks(rank, 4, [0.0625, 0.25, 1, 4, 16], rounds, timeout=900, backend="gloo")
    print("MB      step ms  ahead ms  gloo ms  gloo/step  gloo/ahead  max|ahead - gloo|")
    for mb, row in res[0].value.items():
        print(f"{mb:<7} {row['step']:7.2f} {row['ahead']:9.2f} {row['gloo']:8.2f} "
              f"{row['gloo'] / row['step']:10.2f} {row['gloo'] / row['ahead']:11.2f} {row['max_err']:.1e}")
