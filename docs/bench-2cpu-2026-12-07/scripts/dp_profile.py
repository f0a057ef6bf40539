"""cProfile of 60 steps at dp 2 of one runner (argv[1]: ours or ddp), rank 0: where the main
thread's time goes (the all-reduce launches among it). python docs/bench-2cpu-2026-12-07/scripts/dp_profile.py ours"""
import cProfile, pstats, io, time, torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.config import RunConfig
from parallel_mini.mesh import build_mesh
from parallel_mini.model import build_model
from parallel_mini.comm import Comm
from parallel_mini.optim import Adam
from parallel_mini.data import global_batch, shard
from parallel_mini.parallel.data import DataParallel
def rank(which):
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg = RunConfig(dp=2, batch=16, bucket_mb=0.25, steps=100).validate(); n, r = 2, dist.get_rank()
    m = build_model(cfg)
    if which == "ddp":
        f = DDP(m, bucket_cap_mb=0.25); sync = lambda: None
    else:
        c = Comm(build_mesh(cfg)); dp = DataParallel(m, c, bucket_mb=0.25); f = m; sync = dp.finish_gradient_sync
    opt = Adam(m.parameters(), lr=cfg.lr)
    def step(i):
        x, y = shard(global_batch(cfg, i), r, n)
        loss = f(x, y); loss.backward(); sync(); opt.step(); opt.zero_grad()
    for i in range(5): step(i)
    dist.barrier()
    pr = cProfile.Profile(); pr.enable(); t0 = time.perf_counter()
    for i in range(5, 65): step(i)
    el = time.perf_counter() - t0
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); return "%.1f ms/step\n" % (el / 60 * 1e3) + s.getvalue()
import sys
print(run_ranks(rank, 2, sys.argv[1], timeout=300, backend="gloo")[0].value)
