"""The CLI's `--trace FILE`: a run's op events and comm records as a Chrome / Perfetto trace
(open it in chrome://tracing or ui.perfetto.dev)."""
from __future__ import annotations

import json


def chrome_trace(report) -> dict:
    """Every op event and comm record of every rank, one process per rank (thread 0: ops, thread
    1: communication), times in microseconds. The JSON Trace Event Format's complete events."""
    events = []
    for r in report.ranks:
        pid = r["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": pid,
                       "args": {"name": f"rank {pid} " + " ".join(f"{a}{v}" for a, v in r["coords"].items())}})
        for tid, name in ((0, "ops"), (1, "comm")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        for e in r["events"]:
            label = e["kind"] if e.get("microbatch") is None else f"{e['kind']}{e['microbatch']}"
            events.append({"name": label, "cat": e["kind"], "ph": "X", "pid": pid, "tid": 0,
                           "ts": 1e6 * e["start"], "dur": 1e6 * (e["end"] - e["start"]),
                           "args": {k: v for k, v in e.items() if k not in ("start", "end")}})
        for c in r["comm"]:
            if "end" in c:
                events.append({"name": c["op"], "cat": c["group"], "ph": "X", "pid": pid, "tid": 1,
                               "ts": 1e6 * c["start"], "dur": 1e6 * (c["end"] - c["start"]),
                               "args": {k: v for k, v in c.items() if k not in ("start", "end")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(report, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(chrome_trace(report), fh)
