"""This thread's CPU for one 4-B exchange step on 2 gloo ranks (1,000 back to back): torch.distributed
alone, the ProcessGroup directly, Comm.sendrecv, its metering alone, Comm without the wire meter,
Comm with records only. Run before c9ed420 (the send's Work was freed at once then).
python docs/bench-2cpu-2026-12-07/scripts/step_cpu_parts.py"""
import time, statistics, torch, torch.distributed as dist
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.comm import Comm
from parallel_mini.mesh import build_mesh
from parallel_mini.config import RunConfig
def rank():
    n, r = dist.get_world_size(), dist.get_rank(); right, left = (r + 1) % n, (r - 1) % n
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n))); g = comm.mesh.groups["dp"]
    pg = g if g is not None else dist.distributed_c10d._get_default_group()
    one, buf = torch.ones(1), torch.empty(1)
    kept = []
    def via_dist():
        a = dist.irecv(buf, left, group=g); b = dist.isend(one, right, group=g); a.wait(); b.wait(); kept[:] = [a, b]
    def via_pg():
        a = pg.recv([buf], left, 0); b = pg.send([one], right, 0); a.wait(); b.wait(); kept[:] = [a, b]
    def via_comm():
        comm.sendrecv(one, right, buf, left, "dp")
    rec = {}
    comm2 = Comm(build_mesh(RunConfig(dp=n, batch=n))); comm2.meter.wire.fd = None
    comm3 = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    comm3.meter.begin = lambda rec, sockets=True: rec
    def end3(rec, work=None, async_op=False, poll=False): rec["end"] = time.perf_counter()
    comm3.meter.end = end3
    def meter_only():
        sent, got = comm._send_record(one, "dp", right), comm._recv_record(buf, "dp", left)
        comm.meter.begin(sent); comm.meter.end(sent); got["end"] = sent["end"]; comm.meter.sent(sent, one, r, right)
    out = {}
    for name, f in (("dist", via_dist), ("pg", via_pg), ("comm", via_comm), ("meter_only", meter_only), ("comm_nowire", lambda: comm2.sendrecv(one, right, buf, left, "dp")), ("comm_nometer", lambda: comm3.sendrecv(one, right, buf, left, "dp"))) * 2:
        for _ in range(50): f()
        dist.barrier(); c0 = time.thread_time()
        for _ in range(1000): f()
        out[name] = "%.1f us" % ((time.thread_time() - c0) / 1000 * 1e6)
        [c.records.clear() or c.p2p_log.clear() for c in (comm, comm2, comm3)]
    return out
print(run_ranks(rank, 2, timeout=300, backend="gloo")[0].value)
