"""tp 2 through launch.run (12 steps, batch 16): per kind of collective (layer tag f, g, ce), the
median start skew between the two ranks, rank 0's duration and the time both were inside it.

    PYTHONPATH=. python docs/bench-2cpu-2026-11-28/scripts/tp_collective_times.py
"""
import statistics, collections
from parallel_mini.runtime.launch import run
from parallel_mini.config import RunConfig
rep = run(RunConfig(tp=2, steps=12, batch=16))
r0, r1 = [[c for c in rk["comm"] if c["step"] >= 2] for rk in rep.ranks[:2]]
assert len(r0) == len(r1)
by = collections.defaultdict(list)
for a, b in zip(r0, r1):
    key = (a["op"], a.get("kind") or a.get("layer") or a.get("where") or "", a["count"])
    skew = abs(a["start"] - b["start"]); dur = min(a["end"], b["end"]) - max(a["start"], b["start"])
    by[key].append((skew * 1e3, (a["end"] - a["start"]) * 1e3, dur * 1e3))
print(len(r0) / 10, "collectives per step")
for k, v in by.items():
    print(k, len(v) // 10, "per step; skew ms %.2f, rank0 dur %.2f, both-in dur %.2f" % tuple(statistics.median(x[i] for x in v) for i in range(3)))
print({k: r0[0].get(k) for k in r0[0]})
