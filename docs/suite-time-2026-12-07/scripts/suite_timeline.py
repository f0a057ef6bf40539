"""A pytest plugin: per test, its wall seconds and the machine's CPU seconds busy and idle (from
/proc/stat, all processes: ranks, kernels, servers, chromium), and the pytest process's own CPU.
PYTHONPATH=docs/suite-time-2026-12-07/scripts TL_OUT=/tmp/timeline.jsonl \
    .venv/bin/python -m pytest -q -p suite_timeline
then: python docs/suite-time-2026-12-07/scripts/suite_by_file.py /tmp/timeline.jsonl"""
import json
import os
import resource
import time

import pytest

OUT = os.environ.get("TL_OUT", "/tmp/timeline.jsonl")


def _cpu():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, idle, v[0], v[2]


_f = open(OUT, "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0, r0 = time.time(), _cpu(), resource.getrusage(resource.RUSAGE_SELF)
    yield
    t1, c1, r1 = time.time(), _cpu(), resource.getrusage(resource.RUSAGE_SELF)
    own = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    _f.write(json.dumps({"id": item.nodeid, "t0": t0, "t1": t1, "busy": c1[0] - c0[0],
                         "idle": c1[1] - c0[1], "user": c1[2] - c0[2], "sys": c1[3] - c0[3],
                         "self": own}) + "\n")
    _f.flush()
