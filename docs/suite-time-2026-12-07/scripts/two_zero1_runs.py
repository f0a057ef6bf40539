"""Two launches of the toy at dp 4 with ZeRO-1, 3 steps (the second timed): what `perf` watched for
the page faults.
perf stat -a -e page-faults,context-switches,cpu-migrations -- python two_zero1_runs.py
perf record -a -e page-faults -g -o pf.data -- python two_zero1_runs.py
perf report -i pf.data --no-children --sort comm,dso,sym --stdio"""
import time

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run

run(RunConfig(dp=4, zero=1, steps=3))
t = time.perf_counter()
run(RunConfig(dp=4, zero=1, steps=3))
print(f"second run {time.perf_counter() - t:.2f} s")
