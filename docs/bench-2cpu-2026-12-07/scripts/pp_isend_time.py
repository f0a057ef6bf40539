"""pp 2 (bench pp's model: 8 layers, batch 16, 8 micro-batches), 30 steps after 3, runners rotated:
step medians of ours and torch's schedule; per schedule, our runner's events (count per step,
median ms, ms per step) and the time spent in gloo's dist.isend itself per step (median), timed
through a wrapper of comm.py's torch.distributed. A schedule name with "-nowire" runs ours without
the socket counter, "-nocpu" without the CPU clock of the comm records (no torch runner then).
python docs/bench-2cpu-2026-12-07/scripts/pp_isend_time.py gpipe 1f1b interleaved"""
import statistics, sys, time
import torch, torch.distributed as dist
from parallel_mini.config import RunConfig
from parallel_mini.data import global_batch
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.course.peers import OurPipeline, TorchPipeline

T = {"isend": [], "record": []}

def rank(cfgd, names, steps):
    cfg = RunConfig.from_dict(cfgd)
    import parallel_mini.comm as C
    class Proxy:
        def __getattr__(self, name): return getattr(dist, name)
        def isend(self, *a, **k):
            t0 = time.perf_counter(); w = dist.isend(*a, **k); T["isend"].append(time.perf_counter() - t0); return w
    C.dist = Proxy()
    runners = {}
    for n in names:
        base, _, var = n.partition("-")
        runners[("ours", n)] = OurPipeline(cfg, base)
        if var == "nowire":
            runners[("ours", n)].comm.meter.wire.fd = None
        if var == "nocpu":
            import parallel_mini.meters as M
            m = runners[("ours", n)].comm.meter
            def begin(rec, sockets=True, m=m):
                if sockets: m.wire.begin(rec)
                return rec
            def end(rec, work=None, async_op=False, poll=False, m=m):
                rec["cpu"] = 0.0
                if async_op:
                    return M._Handle(work, rec, m.wire, m._future(work, rec["op"]), poll)
                m.wire.end(rec); rec["end"] = time.perf_counter()
            m.begin, m.end = begin, end
        if not var:
            runners[("torch", n)] = TorchPipeline(cfg, n)
    keys = list(runners)
    times = {k: [] for k in keys}
    sends = {n: [] for n in names}
    isend = {n: [] for n in names}
    kinds = {n: {} for n in names}
    for i in range(steps + 3):
        x, y = global_batch(cfg, i)
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            T["isend"].clear()
            dist.barrier()
            t0 = time.perf_counter()
            runners[key].step(x, y)
            dt = time.perf_counter() - t0
            if i >= 3:
                times[key].append(dt)
                if key[0] == "ours":
                    ev = runners[key].last_events
                    for e in ev:
                        kinds[key[1]].setdefault(e["kind"], []).append(e["end"] - e["start"])
                    isend[key[1]].append(sum(T["isend"]))
    out = {f"{w} {n}": round(1e3 * statistics.median(v), 2) for (w, n), v in times.items()}
    for n in names:
        out[f"{n} events"] = {k: (len(v) // steps, round(1e3 * statistics.median(v), 3), round(1e3 * sum(v) / steps, 2)) for k, v in kinds[n].items()}
        out[f"{n} dist.isend ms/step"] = round(1e3 * statistics.median(isend[n]), 3)
    return out

if __name__ == "__main__":
    cfg = RunConfig(pp=2, layers=8, batch=16, microbatches=8).validate()
    for r in run_ranks(rank, 2, cfg.to_dict(), sys.argv[1:] or ["1f1b", "interleaved"], 30, timeout=900, backend="gloo"):
        print(r.value)
