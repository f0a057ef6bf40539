"""WireMeter._settle's cost with 1, 12 and 24 ops in flight (a pipeline stage's sends stay in
flight until the step ends: 24 a step at pp 2 interleaved), and one reading of /proc/self/io
alone; one process, 5,000 calls each, us per call.
python docs/bench-2cpu-2026-12-07/scripts/settle_cost.py"""
import time

from parallel_mini.meters import WireMeter

for n in (1, 12, 24):
    m = WireMeter("gloo")
    m.inflight = [{"wire_bytes_model": 16384, "group": "pp", "wire_bytes_measured": 0}
                  for _ in range(n)]
    t0 = time.perf_counter()
    for _ in range(5000):
        m._settle()
    print(f"{n:2d} in flight: {(time.perf_counter() - t0) / 5000 * 1e6:.2f} us a reading and its shares")
m = WireMeter("gloo")
t0 = time.perf_counter()
for _ in range(5000):
    m._read()
print(f"the reading alone: {(time.perf_counter() - t0) / 5000 * 1e6:.2f} us")
