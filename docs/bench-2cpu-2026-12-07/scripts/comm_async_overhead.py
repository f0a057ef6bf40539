"""Python cost of one async all-reduce through Comm and its variants (comm_variants.py), with the
backend stubbed (dist.all_reduce returns a finished Work at once): one process, 5 x 2,000 calls,
us per call (launch and wait).
python docs/bench-2cpu-2026-12-07/scripts/comm_async_overhead.py"""
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("gloo", rank=0, world_size=1)
from parallel_mini.config import RunConfig
from parallel_mini.course.bench import build_mesh
from comm_variants import comm_variant
cfg = RunConfig(dp=1).validate()
mesh = build_mesh(cfg)
class W:
    def wait(self): pass
    def is_completed(self): return True
    def get_future(self): raise RuntimeError
dist.all_reduce = lambda *a, **k: W()
mesh.size = lambda axis: 2  # pretend 2 ranks
t = torch.zeros(65536)
for name in ("full", "nowire", "nofuture", "nometer", "bare"):
    c = comm_variant(mesh, name)
    c.size = lambda axis: 2
    for rep in range(5):
        t0 = time.perf_counter()
        for i in range(2000):
            h = c.all_reduce(t, "dp", async_op=True, bucket=1, grads_pending=3)
            h.wait()
        print(name, (time.perf_counter() - t0) / 2000 * 1e6, "us")
