"""A/B: our ring (comm.ring_all_reduce) vs a two-waves (two receives in flight) ring vs gloo, at
64 KB-16 MB; medians of 15, max over ranks, ROUNDS rounds (README section 3).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/ring_pipelined.py RANKS ROUNDS
"""
import sys, time, statistics
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks

def ring_pipelined(x, comm, axis="dp"):
    n, r = comm.size(axis), comm.rank(axis)
    chunks = list(x.view(-1).tensor_split(n))
    segs = [list(c.tensor_split(2)) for c in chunks]  # segs[chunk][k]
    right, left = (r + 1) % n, (r - 1) % n
    land = [torch.empty_like(segs[0][k]) for k in range(2)]
    # wave k: the k-th half of every chunk goes round on its own; the two waves are one message apart
    def post(step, k):
        if step < n - 1:   # reduce-scatter
            s, rv = (r - step) % n, (r - step - 1) % n
            rb = land[k][: segs[rv][k].numel()]
        else:
            t = step - (n - 1)
            s, rv = (r + 1 - t) % n, (r - t) % n
            rb = segs[rv][k]
        rw = comm.irecv(rb, left, axis)
        sw = comm.isend(segs[s][k], right, axis)
        return rw, sw, rv, rb
    inflight = [post(0, 0), post(0, 1)]
    for step in range(2 * (n - 1)):
        for k in range(2):
            rw, sw, rv, rb = inflight[k]
            rw.wait(); sw.wait()
            if step < n - 1:
                segs[rv][k] += rb
            if step + 1 < 2 * (n - 1):
                inflight[k] = post(step + 1, k)
    return x

def rank_fn(sizes_mb, reps):
    from parallel_mini.comm import Comm, ring_all_reduce
    from parallel_mini.mesh import build_mesh
    n = dist.get_world_size()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    out = {}
    for mb in sizes_mb:
        numel = int(mb * 2**20) // 4
        x0 = torch.randn(numel)
        ref = x0.clone(); dist.all_reduce(ref)
        for name, f in (("ring", lambda x: ring_all_reduce(x, comm)), ("pipelined", lambda x: ring_pipelined(x, comm)),
                        ("gloo", lambda x: dist.all_reduce(x))):
            x = x0.clone(); f(x)
            err = (x - ref).abs().max().item()
            ts = []
            for i in range(reps):
                x = x0.clone(); dist.barrier(); t = time.perf_counter(); f(x); ts.append(time.perf_counter() - t)
            t = torch.tensor([statistics.median(ts)]); dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.setdefault(mb, {})[name] = (t.item() * 1e3, err)
    return out

sizes = [0.0625, 0.25, 1, 4, 16]
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    res = run_ranks(rank_fn, int(sys.argv[1]) if len(sys.argv) > 1 else 4, sizes, 15, timeout=600, backend="gloo")[0].value
    for mb, d in res.items():
        g = d["gloo"][0]
        print(f"{mb:7} MB  ring {d['ring'][0]:7.2f} ms ({g/d['ring'][0]:.2f} of gloo)  pipelined {d['pipelined'][0]:7.2f} ms ({g/d['pipelined'][0]:.2f})  gloo {g:7.2f}  err {d['pipelined'][1]:.1e}")
    print()
