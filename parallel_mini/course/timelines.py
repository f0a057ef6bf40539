"""Timelines to look at: a step as the wall clock saw it, a schedule drawn before any run, and a
Chrome/Perfetto trace file of a whole run (`run --trace PATH`). The labels say which is which:
measured, replayed (a simulation fed with measured op times, trace.py) or a formula.
"""
from __future__ import annotations

import json

from ..parallel.schedules import simulate
from .trace import COMPUTE, pipelines

LABELS = {"wall": "measured (wall clock)",
          "replayed": "replayed (measured op times, own-device schedule)",
          "theory": "formula"}


def wall_view(report, step: int, pipeline: list[dict] | None = None) -> list[dict]:
    """The same step as measured: wall-clock start and end of every op, waits included."""
    pipeline = pipeline or pipelines(report)[0]
    out = []
    for stage, r in enumerate(pipeline):
        for e in r["events"]:
            if e["step"] == step and (e["kind"] in COMPUTE or e["kind"] in ("send", "wait")):
                out.append({"rank": stage, "kind": e["kind"], "microbatch": e["microbatch"],
                            "chunk": e["stage"], "start": e["start"], "end": e["end"]})
    t0 = min(e["start"] for e in out)
    for e in out:
        e["start"] -= t0
        e["end"] -= t0
    return out


def replay_ops(schedule, cost: dict[str, float]) -> list[dict]:
    """A schedule drawn before any run: every F/B/W takes `cost[kind]` seconds (e.g. F 1, B 2)."""
    return simulate(schedule, lambda rank, op: cost[op.kind] / schedule.virtual)


# ---------------------------------------------------------------------------------------------
# Chrome / Perfetto trace (open in chrome://tracing or ui.perfetto.dev)
# ---------------------------------------------------------------------------------------------
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
