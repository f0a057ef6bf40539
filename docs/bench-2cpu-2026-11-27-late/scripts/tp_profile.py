"""Section 2 and 5: tensor parallel at tp 2 (SP with a 3rd argument "sp"), ours or the DTensor
blocks-only peer, 15 steps after 3 warm-up: median step time per rank, and with PROFILE=1 rank
0's cProfile by own time (its collective and wait calls counted: 21 vs 16 a step).

    PYTHONPATH=. python docs/bench-2cpu-2026-11-27-late/scripts/tp_profile.py ours|dtensor PROFILE [sp]
"""
import sys, time, cProfile, pstats, io, statistics
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks

def rank_fn(cfg_dict, which, steps, prof):
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.model import build_model
    from parallel_mini.data import global_batch
    from parallel_mini.optim import Adam
    from parallel_mini.parallel.tensor import apply_tensor_parallel
    from parallel_mini.course.peers import dtensor_tp_model, peer_adam
    c = RunConfig.from_dict(cfg_dict)
    if which == "ours":
        model = apply_tensor_parallel(build_model(c), Comm(build_mesh(c)), sp=c.sp)
        opt = Adam(model.parameters(), lr=c.lr)
    else:
        model = dtensor_tp_model(c, c.sp); opt = peer_adam(model.parameters(), c)
    def step(i):
        x, y = global_batch(c, i)
        model(x, y).backward(); opt.step(); opt.zero_grad()
    for i in range(3): step(i)
    ts = []
    pr = cProfile.Profile()
    for i in range(steps):
        dist.barrier()
        if prof: pr.enable()
        t = time.perf_counter(); step(i)
        ts.append(time.perf_counter() - t)
        if prof: pr.disable()
    s = io.StringIO()
    if prof: pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    return statistics.median(ts), s.getvalue()

which, prof = sys.argv[1], int(sys.argv[2])
sp = len(sys.argv) > 3 and sys.argv[3] == "sp"
cfg = RunConfig(tp=2, sp=sp, steps=30).validate()
res = run_ranks(rank_fn, 2, cfg.to_dict(), which, 15, prof, timeout=300, backend="gloo")
print(which, "ms/step", [round(1e3 * r.value[0], 1) for r in res])
print(res[0].value[1])
