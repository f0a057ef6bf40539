"""The ring all-reduce on 4 (then 2) gloo ranks, ms a call (10 back to back, median of 20), with
Comm.sendrecv variants: full = Comm as checked out (before c9ed420: the send's Work freed at once);
S4 no metering, both Works kept until after the next waits; S6 = full metering + both kept (what
c9ed420 made Comm do); S7 receive as _posted_recv + send kept; S6nowire / S6nocpu = S6 without the
wire meter / without the CPU clock; bare = torch.distributed alone, receive kept (ringlib.bare_ring).
Run from the repository root: python docs/bench-2cpu-2026-12-07/scripts/ring_work_keeping.py"""
import time, statistics, torch, torch.distributed as dist, sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.comm import Comm, ring_all_reduce
from parallel_mini.mesh import build_mesh
from parallel_mini.config import RunConfig
from ringlib import bare_ring

class S1(Comm):  # no metering, Comm's posting
    def sendrecv(self, send, dst, recv, src, axis, **log):
        receiving = self._posted_recv(recv, axis, src)
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait(); sending.wait()
class S2(Comm):  # free the previous receive only after both waits
    def sendrecv(self, send, dst, recv, src, axis, **log):
        receiving = dist.irecv(recv, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait(); sending.wait()
        self._last_recv[(axis, src)] = receiving
class S3(Comm):  # drop each receive's Work at once
    def sendrecv(self, send, dst, recv, src, axis, **log):
        receiving = dist.irecv(recv, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait(); sending.wait()
class S4(Comm):  # keep the send's Work too, until the next
    def sendrecv(self, send, dst, recv, src, axis, **log):
        receiving = dist.irecv(recv, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait(); sending.wait()
        self._last_recv[(axis, src)] = (receiving, sending)

class S5(Comm):  # full metering, the send's Work kept until the next send to that peer is posted
    def sendrecv(self, send, dst, recv, src, axis, **log):
        sent, got = self._send_record(send, axis, dst), self._recv_record(recv, axis, src)
        self.meter.begin(sent)
        receiving = self._posted_recv(recv, axis, src)
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        self._last_send[(axis, dst)] = sending
        receiving.wait()
        sending.wait()
        self.meter.end(sent)
        got["end"] = sent["end"]
        self.meter.sent(sent, send, self.rank(axis), dst, **log)
class S6(Comm):  # full metering, both kept until after the next waits
    def sendrecv(self, send, dst, recv, src, axis, **log):
        sent, got = self._send_record(send, axis, dst), self._recv_record(recv, axis, src)
        self.meter.begin(sent)
        receiving = dist.irecv(recv, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait()
        sending.wait()
        self._last_recv[(axis, src)] = (receiving, sending)
        self.meter.end(sent)
        got["end"] = sent["end"]
        self.meter.sent(sent, send, self.rank(axis), dst, **log)
class S7(Comm):  # recv as _posted_recv, send kept until after the next waits
    def sendrecv(self, send, dst, recv, src, axis, **log):
        sent, got = self._send_record(send, axis, dst), self._recv_record(recv, axis, src)
        self.meter.begin(sent)
        receiving = self._posted_recv(recv, axis, src)
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait()
        sending.wait()
        self._last_send[(axis, dst)] = sending
        self.meter.end(sent)
        got["end"] = sent["end"]
        self.meter.sent(sent, send, self.rank(axis), dst, **log)
class S6nowire(S6):
    pass
class S6nocpu(S6):
    pass
def rank(numel):
    n, r = dist.get_world_size(), dist.get_rank()
    mk = lambda cls: cls(build_mesh(RunConfig(dp=n, batch=n)))
    comms = {"full": mk(Comm), "S4": mk(S4), "S6": mk(S6), "S7": mk(S7), "S6nowire": mk(S6nowire), "S6nocpu": mk(S6nocpu)}
    comms["S7"]._last_send = {}
    comms["S6nowire"].meter.wire.fd = None
    c = comms["S6nocpu"]
    def begin(rec, sockets=True, c=c):
        if sockets: c.meter.wire.begin(rec)
        return rec
    def end(rec, work=None, async_op=False, poll=False, c=c):
        c.meter.wire.end(rec); rec["end"] = time.perf_counter()
    c.meter.begin, c.meter.end = begin, end
    x = torch.randn(numel); landing = torch.empty(numel); kept = []
    names = list(comms) + ["bare"]; t = {k: [] for k in names}
    for i in range(21):
        for k in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier(); t0 = time.perf_counter()
            for _ in range(10):
                bare_ring(x, n, r, landing, kept) if k == "bare" else ring_all_reduce(x, comms[k])
                x.mul_(0.25)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64); dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i: t[k].append(dt.item() / 10)
        for c in comms.values(): c.records.clear(); c.p2p_log.clear()
    return " ".join("%s %.2f" % (k, 1e3 * statistics.median(v)) for k, v in t.items())
for w in (4, 4, 2):
  for numel in (16384, 262144):
    print(w, numel * 4 // 1024, "KB, ms per all-reduce:", run_ranks(rank, w, numel, timeout=600, backend="gloo")[0].value)
