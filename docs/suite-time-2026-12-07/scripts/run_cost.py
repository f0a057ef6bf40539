"""Wall and machine CPU seconds (user, sys, idle from /proc/stat) of small launch.run calls, three
times each: what one test's run costs. python docs/suite-time-2026-12-07/scripts/run_cost.py"""
import time

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run, run_ranks


def cpu():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return v[0] + v[1], v[2], v[3] + v[4]


def noop(*a):
    return 0


for label, f in [("noop 4 ranks", lambda: run_ranks(noop, 4)),
                 ("dp4 zero1 3 steps", lambda: run(RunConfig(dp=4, zero=1, steps=3))),
                 ("dp4 zero1 10 steps", lambda: run(RunConfig(dp=4, zero=1, steps=10))),
                 ("dp2 3 steps", lambda: run(RunConfig(dp=2, steps=3)))]:
    for _ in range(3):  # the first noop starts the forkserver
        c0, t = cpu(), time.perf_counter()
        f()
        w, c1 = time.perf_counter() - t, cpu()
        print(f"{label:20s} {w:6.3f} s  user {(c1[0] - c0[0]) / 100:.2f}  sys "
              f"{(c1[1] - c0[1]) / 100:.2f}  idle {(c1[2] - c0[2]) / 100:.2f}", flush=True)
