"""pp 2 interleaved (bench pp's model), ours alone, 30 steps after 3: where a send's time goes,
timed by wrappers: Comm.isend's parts (the record, meter.begin, gloo's dist.isend, meter.end),
Mailbox.send and the runner's send, WireMeter._read and _settle (with the ops in flight at each
reading, printed in us as "inflight" = their count), and one CPU-clock reading. Per part: calls a
step, median us, mean us.
python docs/bench-2cpu-2026-12-07/scripts/pp_send_parts.py"""
import statistics, sys, time
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.data import global_batch
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.course.peers import OurPipeline

P = {}
def acc(k, v): P.setdefault(k, []).append(v)

def rank(cfgd, steps):
    import parallel_mini.comm as C
    from parallel_mini import meters as M
    cfg = RunConfig.from_dict(cfgd)
    orig_isend = C.Comm.isend
    def isend(self, tensor, dst, axis, **tags):
        t0 = time.perf_counter()
        rec = self._send_record(tensor, axis, dst, async_op=True, **tags)
        t1 = time.perf_counter()
        self.meter.begin(rec)
        t2 = time.perf_counter()
        work = dist.isend(tensor, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        t3 = time.perf_counter()
        h = self.meter.end(rec, work, async_op=True)
        t4 = time.perf_counter()
        for k, v in zip(("record", "begin", "dist.isend", "end"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            acc(k, v)
        return h
    C.Comm.isend = isend
    orig_read = M.WireMeter._read
    def rd(self):
        t0 = time.perf_counter(); v = orig_read(self); acc("_read", time.perf_counter() - t0); return v
    M.WireMeter._read = rd
    orig_settle = M.WireMeter._settle
    def st(self):
        acc("inflight", len(self.inflight) * 1e-6)
        t0 = time.perf_counter(); orig_settle(self); acc("_settle", time.perf_counter() - t0)
    M.WireMeter._settle = st
    orig_wb = M.WireMeter.begin
    def wb(self, rec):
        t0 = time.perf_counter(); orig_wb(self, rec); acc("wire.begin", time.perf_counter() - t0)
    M.WireMeter.begin = wb
    orig_mb = M.CommMeter.begin
    def mb(self, rec, sockets=True):
        t0 = time.perf_counter(); time.thread_time(); acc("a thread_time", time.perf_counter() - t0)
        return orig_mb(self, rec, sockets)
    M.CommMeter.begin = mb
    from parallel_mini.parallel import pipeline as PL
    orig_send = PL.Mailbox.send
    def msend(self, key, tensor):
        t0 = time.perf_counter(); orig_send(self, key, tensor); acc("mailbox.send", time.perf_counter() - t0)
    PL.Mailbox.send = msend
    orig_op = PL.PipelineRunner._send
    def psend(self, key, tensor):
        t0 = time.perf_counter(); orig_op(self, key, tensor); acc("runner._send", time.perf_counter() - t0)
    PL.PipelineRunner._send = psend
    r = OurPipeline(cfg, "interleaved")
    for i in range(steps + 3):
        x, y = global_batch(cfg, i)
        if i == 3: P.clear()
        dist.barrier(); r.step(x, y)
    return {k: (len(v) // steps, round(1e6 * statistics.median(v), 1), round(1e6 * statistics.mean(v), 1)) for k, v in P.items()}

if __name__ == "__main__":
    cfg = RunConfig(pp=2, layers=8, batch=16, microbatches=8).validate()
    for r in run_ranks(rank, 2, cfg.to_dict(), 30, timeout=900, backend="gloo"):
        print(r.value)
