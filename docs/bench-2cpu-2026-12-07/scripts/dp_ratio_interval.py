"""bench dp (a)'s rank loop run for a fixed count of steps (argv[1]) at the given dp (argv[2:]); the
ratio bucketed/DDP and its 90 % bootstrap interval (steps resampled in pairs) after 20, 40, 80
and 160 steps. python docs/bench-2cpu-2026-12-07/scripts/dp_ratio_interval.py 160 2"""
import sys, statistics, random
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.config import RunConfig
from parallel_mini.course.bench import _dp_rank
def boot(a, b, k=2000):
    rnd = random.Random(0); n = len(a); rs = []
    for _ in range(k):
        idx = [rnd.randrange(n) for _ in range(n)]
        rs.append(statistics.median([a[i] for i in idx]) / statistics.median([b[i] for i in idx]))
    rs.sort(); return rs[int(0.05*k)], rs[int(0.95*k)]
steps = int(sys.argv[1])
for n in map(int, sys.argv[2:]):
    cfg = RunConfig(dp=n, batch=16, bucket_mb=0.25, steps=steps+5).validate()
    out = run_ranks(_dp_rank, n, cfg.to_dict(), 5, steps, timeout=900, backend="gloo")[0].value
    a, b = out["times"]["bucketed"], out["times"]["ddp"]
    for m in (20, 40, 80, 160):
        if m <= len(a):
            lo, hi = boot(a[:m], b[:m])
            print(n, m, "ratio %.3f  90%% CI %.3f-%.3f  paired median %.3f" % (statistics.median(a[:m])/statistics.median(b[:m]), lo, hi, statistics.median([x/y for x, y in zip(a[:m], b[:m])])))
