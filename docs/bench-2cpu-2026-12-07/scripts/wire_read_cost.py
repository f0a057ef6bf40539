"""The wire meter's costs alone, on 2 gloo ranks doing nothing else: one read of /proc/self/io
(parsed and raw), time.thread_time(), and a begin + end of an op, µs a call (5,000 calls).
python docs/bench-2cpu-2026-12-07/scripts/wire_read_cost.py"""
import time, torch, torch.distributed as dist, os, threading
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.meters import WireMeter
def rank():
    w = WireMeter("gloo")
    res = {"threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task"))}
    for name, f in (("_read", w._read), ("pread", lambda: os.pread(w.fd, 1024, 0)), ("thread_time", time.thread_time),
                    ("begin+end", lambda: (w.begin(rec := {"wire_bytes_model": 8, "group": "dp"}), w.end(rec)))):
        t0 = time.perf_counter()
        for _ in range(5000): f()
        res[name] = "%.1f us" % ((time.perf_counter() - t0) / 5000 * 1e6)
    return res
print(run_ranks(rank, 2, timeout=100, backend="gloo")[0].value)
