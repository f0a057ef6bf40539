"""Shared by the ring scripts: the ring all-reduce in torch.distributed alone (bare_ring) and Comm
variants with parts of the metering off."""
import time, torch, torch.distributed as dist
from parallel_mini.comm import Comm
from parallel_mini.mesh import build_mesh
from parallel_mini.config import RunConfig
def bare_ring(x, n, r, landing, kept, g=None):
    chunks = list(x.view(-1).tensor_split(n)); right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        s_i, r_i = (r - step) % n, (r - step - 1) % n
        land = landing[: chunks[r_i].numel()]
        a = dist.irecv(land, left); b = dist.isend(chunks[s_i], right); a.wait(); b.wait(); kept[:] = [a]
        chunks[r_i] += land
    for step in range(n - 1):
        s_i, r_i = (r + 1 - step) % n, (r - step) % n
        a = dist.irecv(chunks[r_i], left); b = dist.isend(chunks[s_i], right); a.wait(); b.wait(); kept[:] = [a]
    return x
def variants(n):
    mk = lambda: Comm(build_mesh(RunConfig(dp=n, batch=n)))
    v = {"full": mk(), "nocpu": mk(), "nowire": mk(), "none": mk()}
    def strip_cpu(c):
        def begin(rec, sockets=True):
            if sockets: c.meter.wire.begin(rec)
            return rec
        def end(rec, work=None, async_op=False, poll=False):
            c.meter.wire.end(rec); rec["end"] = time.perf_counter()
        c.meter.begin, c.meter.end = begin, end
    strip_cpu(v["nocpu"]); v["nowire"].meter.wire.fd = None
    strip_cpu(v["none"]); v["none"].meter.wire.fd = None; v["none"].meter.sent = lambda *a, **k: None
    return v
