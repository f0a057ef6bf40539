"""One ring step (4 B, irecv + isend + waits) on 4 gloo ranks, 20 back to back, median of 15: Comm's
metered sendrecv, without the wire meter, with records only, and torch.distributed alone (both
Works kept). ms a step and this thread's CPU. python docs/bench-2cpu-2026-12-07/scripts/step_metering.py"""
import time, statistics, torch, torch.distributed as dist, sys
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.comm import Comm
from parallel_mini.mesh import build_mesh
from parallel_mini.config import RunConfig
def rank():
    n, r = dist.get_world_size(), dist.get_rank(); right, left = (r + 1) % n, (r - 1) % n
    mk = lambda: Comm(build_mesh(RunConfig(dp=n, batch=n)))
    full, nowire, nocpu = mk(), mk(), mk()
    nowire.meter.wire.fd = None
    nocpu.meter.wire.fd = None; nocpu.meter.sent = lambda *a, **k: None
    nocpu.meter.begin = lambda rec, sockets=True: rec
    def end3(rec, work=None, async_op=False, poll=False): rec["end"] = time.perf_counter()
    nocpu.meter.end = end3
    one, buf = torch.ones(1), torch.empty(1); kept = []
    def bare():
        a = dist.irecv(buf, left); b = dist.isend(one, right); a.wait(); b.wait(); kept[:] = [a, b]
    calls = {"full": lambda: full.sendrecv(one, right, buf, left, "dp"), "nowire": lambda: nowire.sendrecv(one, right, buf, left, "dp"),
             "records_only": lambda: nocpu.sendrecv(one, right, buf, left, "dp"), "bare": bare}
    t = {k: [] for k in calls}; cpu = {k: [] for k in calls}
    for i in range(16):
        for k in list(calls)[i % 4:] + list(calls)[:i % 4]:
            dist.barrier(); t0 = time.perf_counter(); c0 = time.thread_time()
            for _ in range(20): calls[k]()
            c = time.thread_time() - c0
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64); dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i: t[k].append(dt.item() / 20); cpu[k].append(c / 20)
        for c_ in (full, nowire, nocpu): c_.records.clear(); c_.p2p_log.clear()
    return " ".join("%s %.2f ms (cpu %.0f us)" % (k, 1e3 * statistics.median(v), 1e6 * statistics.median(cpu[k])) for k, v in t.items())
for _ in range(2): print(run_ranks(rank, 4, timeout=600, backend="gloo")[0].value)
