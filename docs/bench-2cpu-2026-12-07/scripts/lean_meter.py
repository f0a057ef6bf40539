"""Section 7's sketch of a leaner metering (variant `lean` of comm_variants.py): async ops in flight
at once share one socket-counter reading at each end of their overlap (the ops that ended since
the last reading share it too), and the completion callback only takes the time; the reading is
taken on the main thread (at the wait), never in gloo's thread. Measured: no gain (section 7)."""
import time
from parallel_mini import meters
from parallel_mini.meters import WireMeter, _Handle


class LeanWire(WireMeter):
    def __init__(self, backend):
        super().__init__(backend)
        self.done = []

    def _settle(self):
        now = self._read()
        delta, self.last = now - self.last, now
        ops = self.inflight + self.done
        self.done = []
        if not ops:
            return
        weights = [max(r["wire_bytes_model"], 1) for r in ops]
        groups = sorted({r["group"] for r in ops})
        for r, w in zip(ops, weights):
            r["wire_bytes_measured"] += delta * w / sum(weights)
            if len(ops) > 1:
                r["wire_shared"] = True
                r["wire_shared_with"] = sorted(set(r.get("wire_shared_with", [])) | set(groups))
        for r in ops:
            if r not in self.inflight and not r.get("wire_shared"):
                r["wire_bytes_measured"] = int(r["wire_bytes_measured"])

    def begin(self, rec, async_op=False):
        if self.fd is None:
            rec["wire_bytes_measured"] = None
            return
        with self.lock:
            if self.run is not None:
                self.run.append(rec)
            elif not (async_op and self.inflight):
                self._settle()
            rec["wire_bytes_measured"] = 0
            self.inflight.append(rec)

    def end(self, rec, async_op=False):
        if self.fd is None:
            return
        with self.lock:
            if self.run is not None and any(r is rec for r in self.run):
                return
            if any(r is rec for r in self.inflight):
                self.inflight = [r for r in self.inflight if r is not rec]
                self.done.append(rec)
                if not (async_op and self.inflight):
                    self._settle()


class LeanHandle(_Handle):
    def _done(self, fut):
        self.record["end"] = time.perf_counter()

    def wait(self):
        meters.wait_for(self.work, self.poll)
        self.meter.end(self.record, async_op=True)
        self.record.setdefault("end", time.perf_counter())
        self.record["waited_until"] = time.perf_counter()


def lean(comm):
    comm.meter.wire = LeanWire(comm.meter.wire.fd is not None and "gloo")
    orig_begin = comm.meter.begin
    def begin(rec, sockets=True):
        comm.meter._cpu0[id(rec)] = time.thread_time()
        if sockets:
            comm.meter.wire.begin(rec, async_op=rec.get("async_op", False))
        return rec
    comm.meter.begin = begin
    m = comm.meter
    def end(rec, work=None, async_op=False, poll=False):
        rec["cpu"] = time.thread_time() - m._cpu0.pop(id(rec))
        if async_op:
            return LeanHandle(work, rec, m.wire, m._future(work, rec["op"]), poll)
        m.wire.end(rec)
        rec["end"] = time.perf_counter()
    comm.meter.end = end
    return comm
