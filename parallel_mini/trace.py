"""Timelines of a run: as measured, as if each rank had its own device, the bubble, and a trace file.

Local ranks share a few CPU cores, so a rank's wall clock also counts the time the OS gave the
core to another rank: a wall-clock timeline shows waits that a GPU per rank would not have. Each
op event therefore carries the rank's own CPU seconds too. The "own device" view replays every
rank's recorded op order through the schedule's dependencies (schedules.simulate) with those CPU
durations: what the same run would look like with one device per rank and instant links.

The bubble is read from events, never from the formula: per rank, the share of the pipeline's span
(first op of the step to its last, across the pipeline) in which the rank ran no F, B or W.
"""
from __future__ import annotations

import json
import statistics

from . import theory
from .parallel.schedules import for_config, idle_fractions, simulate

COMPUTE = ("F", "B", "W")


def _pipelines(report) -> list[list[dict]]:
    """The ranks of each pipeline (one per data-parallel replica), in stage order."""
    by_replica: dict[tuple, list[dict]] = {}
    for r in report.ranks:
        key = tuple(v for a, v in sorted(r["coords"].items()) if a != "pp")
        by_replica.setdefault(key, []).append(r)
    return [sorted(rs, key=lambda r: r["coords"]["pp"]) for rs in by_replica.values()]


# A pipeline run that does not choose its steps runs this many: steps 1-4 are timed (step 0 warms
# caches up and the last step runs under the memory meter, every op slower), 32 samples of every
# op kind on every stage at 8 micro-batches.
PIPELINE_STEPS = 6
OWN_DEVICE_QUANTILE = 0.1  # see own_device_costs


def _steps_to_measure(steps: int) -> list[int]:
    """Step 0 warms caches up and the last step runs under the memory meter (every op slower):
    the steps between are measured when there are any."""
    return list(range(1, steps - 1)) if steps >= 3 else list(range(steps))


def own_device_costs(report, pipeline: list[dict] | None = None) -> dict[tuple, float]:
    """What each op costs on a device of its own: {(stage, kind, chunk): CPU seconds}, the 10th
    percentile of that op's CPU times over the timed steps' micro-batches (with fewer than 10
    samples, e.g. one timed step of 8 micro-batches, the fastest).

    Not the mean: on shared cores an op runs slower whenever another rank disturbs it (its core
    switched to another rank mid-op and the caches went cold; on a VM one virtual core at times
    runs ~2x slower than the other for a whole step). Measured here: one op's CPU time varies by
    ~30%, and every such disturbance lengthens the replayed critical path, GPipe's most (it pays
    the slowest stage once per micro-batch in each phase). A device of its own runs the same op on
    a same-shaped micro-batch in the same time, which the undisturbed samples show: the low
    percentile (like timeit's best-of) drops the disturbed ones and keeps differences between
    stages (the first holds the embeddings, the last the head and the loss)."""
    pipeline = pipeline or _pipelines(report)[0]
    steps = set(_steps_to_measure(report.config["steps"]))
    samples: dict[tuple, list[float]] = {}
    for stage, r in enumerate(pipeline):
        for e in r["events"]:
            if e["kind"] in COMPUTE and e["step"] in steps:
                samples.setdefault((stage, e["kind"], e["stage"]), []).append(e["cpu"])
    return {k: sorted(v)[int(OWN_DEVICE_QUANTILE * len(v))] for k, v in samples.items()}


def own_device_replay(report, step: int, pipeline: list[dict] | None = None,
                      durations: str = "typical") -> list[dict]:
    """One step of one pipeline replayed on "own devices" (see the module docstring). Records:
    {rank (the stage), kind, microbatch, chunk, start, end} in seconds from the step's start.

    durations="typical": every op takes its own_device_costs (the same for every step).
    durations="each": every op of `step` its own measured CPU time, disturbances included."""
    schedule = for_config(report.config)
    pipeline = pipeline or _pipelines(report)[0]
    if durations == "typical":
        cost = own_device_costs(report, pipeline)
        return simulate(schedule, lambda rank, op: cost[(rank, op.kind, op.chunk)])
    cpu = {(stage, e["kind"], e["microbatch"], e["stage"]): e["cpu"]
           for stage, r in enumerate(pipeline) for e in r["events"]
           if e["kind"] in COMPUTE and e["step"] == step}
    return simulate(schedule, lambda rank, op: cpu[(rank, op.kind, op.microbatch, op.chunk)])


def wall_view(report, step: int, pipeline: list[dict] | None = None) -> list[dict]:
    """The same step as measured: wall-clock start and end of every op, waits included."""
    pipeline = pipeline or _pipelines(report)[0]
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


def op_costs(report) -> dict[str, float]:
    """F, B and W's own-device CPU seconds (per chunk; own_device_costs averaged over stages and
    pipelines): the zero-bubble formula's inputs."""
    by_kind: dict[str, list[float]] = {}
    for pipeline in _pipelines(report):
        for (_, kind, _), seconds in own_device_costs(report, pipeline).items():
            by_kind.setdefault(kind, []).append(seconds)
    return {k: statistics.fmean(v) for k, v in by_kind.items()}


def bubble(report) -> dict:
    """Measured bubble (own-device replay and wall clock) beside the formula, for the report."""
    cfg = report.config
    schedule = for_config(cfg)
    steps = _steps_to_measure(cfg["steps"])
    own, each, wall = [], [], {step: [] for step in steps}
    for pipeline in _pipelines(report):
        own.append(idle_fractions(own_device_replay(report, steps[0], pipeline), cfg["pp"]))
        for step in steps:
            each.append(idle_fractions(own_device_replay(report, step, pipeline, "each"), cfg["pp"]))
            timed = [e for e in wall_view(report, step, pipeline) if e["kind"] in COMPUTE]
            wall[step] += idle_fractions(timed, cfg["pp"])
    per_rank = [statistics.fmean(f[r] for f in own) for r in range(cfg["pp"])]
    wall_per_step = [statistics.fmean(wall[step]) for step in steps]
    costs = op_costs(report)
    return {"measured": statistics.fmean(per_rank),
            "measured_per_rank": per_rank,
            "measured_each_op": statistics.fmean(x for f in each for x in f),
            "measured_wall": statistics.fmean(wall_per_step),
            "measured_wall_per_step": wall_per_step,
            "theory": theory.bubble_fraction(cfg["schedule"], cfg["pp"], cfg["microbatches"],
                                             schedule.virtual, costs if "W" in costs else None),
            "steps": steps, "op_cpu_s": costs}


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


def replay_ops(schedule, cost: dict[str, float]) -> list[dict]:
    """A schedule drawn before any run: every F/B/W takes `cost[kind]` seconds (e.g. F 1, B 2)."""
    return simulate(schedule, lambda rank, op: cost[op.kind] / schedule.virtual)

