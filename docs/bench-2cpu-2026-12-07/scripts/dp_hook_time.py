"""Our bucketed DataParallel alone at the given dp (argv), 25 measured steps, per rank: forward +
backward, finish_gradient_sync, the time inside the all-reduce launches, _wait_and_unpack, and the
gradient hooks' time including their launches (the hooks' own time = the last minus the third),
ms a step. python docs/bench-2cpu-2026-12-07/scripts/dp_hook_time.py 2 4"""
import sys, time, statistics, torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.config import RunConfig
from parallel_mini.mesh import build_mesh
from parallel_mini.model import build_model
from parallel_mini.comm import Comm
from parallel_mini.optim import Adam
from parallel_mini.data import global_batch, shard
from parallel_mini.parallel import data as D

def rank(cfgd, steps):
    cfg = RunConfig.from_dict(cfgd); n, r = dist.get_world_size(), dist.get_rank()
    mesh = build_mesh(cfg)
    acc0 = {"hook": 0.0}
    orig = D.DataParallel._on_grad_ready
    def timed(self, p):
        t = time.perf_counter(); orig(self, p); acc0["hook"] += time.perf_counter() - t
    D.DataParallel._on_grad_ready = timed
    m2 = build_model(cfg); c = Comm(mesh); dp = D.DataParallel(m2, c, mode="bucketed", bucket_mb=cfg.bucket_mb)
    acc = {"hook": 0.0, "ar": 0.0, "wait": 0.0}
    orig_hook = dp._on_grad_ready
    def hook(p):
        t = time.perf_counter(); orig_hook(p); acc["hook"] += time.perf_counter() - t
    # re-register: replace bound method used by registered hooks is impossible; patch class-level via instance attr not used
    orig_ar = c.all_reduce
    def ar(*a, **k):
        t = time.perf_counter(); h = orig_ar(*a, **k); acc["ar"] += time.perf_counter() - t; return h
    c.all_reduce = ar
    orig_wu = dp._wait_and_unpack
    def wu():
        t = time.perf_counter(); orig_wu(); acc["wait"] += time.perf_counter() - t
    dp._wait_and_unpack = wu
    opt = Adam(m2.parameters(), lr=cfg.lr)
    # time hooks by patching the function used in registered hook: registered bound method -> wrap via DataParallel._on_grad_ready? measure separately
    res = []
    for i in range(steps):
        x, y = shard(global_batch(cfg, i), r, n); c.step = i
        for k in acc: acc[k] = 0.0
        acc0["hook"] = 0.0
        dist.barrier(); t0 = time.perf_counter()
        loss = m2(x, y); loss.backward(); t2 = time.perf_counter(); dp.finish_gradient_sync(); t3 = time.perf_counter()
        opt.step(); opt.zero_grad()
        if i >= 5: res.append((t2 - t0, t3 - t2, acc["ar"], acc["wait"], acc0["hook"]))
    # micro: cost of hook body alone
    p = dp.params[0]
    return [1e3*statistics.median(x) for x in zip(*res)]

for n in map(int, sys.argv[1:]):
    cfg = RunConfig(dp=n, batch=16, bucket_mb=0.25, steps=40).validate()
    out = run_ranks(rank, n, cfg.to_dict(), 30, timeout=600, backend="gloo")
    for rr in out: print(n, "fw+bw, sync, in all_reduce calls, wait_and_unpack, hooks(incl launches) ms:", ["%.3f" % v for v in rr.value])
