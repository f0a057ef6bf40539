"""A pipeline run's bubble: measured on the wall clock, and replayed "as if each rank had its own
device" (the views drawn from them and the trace file: course/timelines.py).

Measured (wall clock): every op event's start and end. When the machine has at least as many cores
as the run has ranks, the launcher pins each rank to a core of its own with one thread
(launch.pin_to_core): no rank waits for a core another rank holds, and the idle share of each rank
on the wall clock is the bubble, measured. The rest of the gap to the formula is then measured too,
from the same events (`wall_gap`): stage imbalance, op-time variation, point-to-point messages
(hand-off, latency, receive), and the bookkeeping between ops. With more ranks than cores the ranks
share cores, a rank's wall clock also counts the time the OS gave its core to another rank, and the
wall view says so.

Replayed (measured op times, own-device schedule): each op event also carries the rank's own CPU
seconds. `own_device_replay` runs every rank's recorded op order through the schedule's
dependencies (schedules.simulate) with those CPU durations: the run as it would look with one device
per rank and instant links. A simulation fed with measurements, not a measurement: with equal op
costs it returns the formula by construction.

The bubble, either way, is read per rank: the share of the pipeline's span (first op of the step to
its last, across the pipeline) in which the rank ran no F, B or W.
"""
from __future__ import annotations

import statistics

from .. import theory
from ..parallel.schedules import PIPELINE_STEPS, dependencies, for_config, idle_fractions, simulate

COMPUTE = ("F", "B", "W")


def pipelines(report) -> list[list[dict]]:
    """The ranks of each pipeline (one per data-parallel replica), in stage order."""
    by_replica: dict[tuple, list[dict]] = {}
    for r in report.ranks:
        key = tuple(v for a, v in sorted(r["coords"].items()) if a != "pp")
        by_replica.setdefault(key, []).append(r)
    return [sorted(rs, key=lambda r: r["coords"]["pp"]) for rs in by_replica.values()]


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
    pipeline = pipeline or pipelines(report)[0]
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
    pipeline = pipeline or pipelines(report)[0]
    if durations == "typical":
        cost = own_device_costs(report, pipeline)
        return simulate(schedule, lambda rank, op: cost[(rank, op.kind, op.chunk)])
    cpu = {(stage, e["kind"], e["microbatch"], e["stage"]): e["cpu"]
           for stage, r in enumerate(pipeline) for e in r["events"]
           if e["kind"] in COMPUTE and e["step"] == step}
    return simulate(schedule, lambda rank, op: cpu[(rank, op.kind, op.microbatch, op.chunk)])


def op_costs(report) -> dict[str, float]:
    """F, B and W's own-device CPU seconds (per chunk; own_device_costs averaged over stages and
    pipelines): the zero-bubble formula's inputs."""
    by_kind: dict[str, list[float]] = {}
    for pipeline in pipelines(report):
        for (_, kind, _), seconds in own_device_costs(report, pipeline).items():
            by_kind.setdefault(kind, []).append(seconds)
    return {k: statistics.fmean(v) for k, v in by_kind.items()}


GAP_PARTS = {"stage_imbalance": "stage imbalance", "op_time_variation": "op-time variation",
             "p2p_messages": "p2p messages (hand-off, latency, receive)", "between_ops": "between ops"}


def placement(report) -> dict:
    """Where the ranks ran (each rank's record from launch.pin_to_core), for the wall view:
    {"ranks_shared_cores": False (each pinned to a core of its own) / True (more ranks than cores)
    / None (not known), "note": one sentence}."""
    records = [r.get("placement") for r in report.ranks]
    n = len(records)
    if any(p is None for p in records):
        from ..runtime.launch import TORCHRUN_PLACEMENT, under_torchrun
        how = TORCHRUN_PLACEMENT["how"] if under_torchrun() else "where the ranks ran was not recorded"
        return {"ranks_shared_cores": None, "note": how + ": whether ranks shared cores is not known"}
    if all(p["pinned"] for p in records):
        cores = [p["cores"][0] for p in records]
        return {"ranks_shared_cores": False,
                "note": f"each of the {n} ranks pinned to a core of its own (cores {cores}), one "
                        f"thread each: the wall clock measures the run"}
    available = {p["cores_available"] for p in records}
    if len(available) == 1 and None not in available and n > min(available):
        return {"ranks_shared_cores": True,
                "note": f"{n} ranks shared {min(available)} cores: a rank's wall clock also counts "
                        f"time its core ran another rank, so its waits include core contention"}
    return {"ranks_shared_cores": None, "note": records[0]["how"]}


def _replay_with_links(schedule, duration, hand_off, latency, receive) -> list[dict]:
    """schedules.simulate with the links put back: after each op its rank spends `hand_off(rank,
    op)` handing the op's message to the link; a message from another rank arrives `latency(dep)`
    after the op that made it ended, and taking it costs the receiver `receive(dep)` when it is
    already there (a receive that blocks ends when the message arrives: in the latency)."""
    end, clock, position, timed = {}, [0.0] * schedule.pp, [0] * schedule.pp, []
    owner = schedule.owner
    while any(position[r] < len(ops) for r, ops in enumerate(schedule.ops)):
        progressed = False
        for r, ops in enumerate(schedule.ops):
            while position[r] < len(ops):
                op = ops[position[r]]
                deps = dependencies(op, schedule.stages)
                if any(d not in end for d in deps):
                    break
                remote = [d for d in deps if owner[d.chunk] != r]
                start = max([clock[r] + sum(receive(d) for d in remote)]
                            + [end[d] + (latency(d) if d in remote else 0.0) for d in deps])
                end[op] = start + duration(r, op)
                clock[r] = end[op] + hand_off(r, op)
                timed.append({"rank": r, "kind": op.kind, "microbatch": op.microbatch,
                              "chunk": op.chunk, "start": start, "end": end[op]})
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the recorded order deadlocks")  # for_config's schedules never do
    return timed


def _clipped(events: list[dict], t0: float, t1: float) -> float:
    return sum(max(0.0, min(e["end"], t1) - max(e["start"], t0)) for e in events)


def wall_gap(report, step: int, pipeline: list[dict] | None = None) -> dict:
    """One step of one pipeline on the wall clock, and what its idle time is made of, measured.

    Per rank (shares of the pipeline's span): idle in all, of which waiting on messages (the
    "wait" events: a receive, the last sends), handing messages to the link ("send" events) and
    the rest ("other": the runner's bookkeeping between ops, the optimizer step after the rank's
    last op while the pipe drains, a core taken by another process).

    And the bubble replayed through the schedule with the op times this step really took on the
    wall clock, adding one measured effect at a time: each stage's mean op time (the formula's
    equal stages -> stage imbalance), each op its own time (op-time variation), then the messages:
    the senders' hand-off ("send" events), each message's latency (op end to the receiver holding
    it, measured where the receiver was already blocked on it; elsewhere the median of those, at
    most what that message can have taken) and the receive of a message that was already there
    (its "wait" event). What is left to the measured bubble happens between ops."""
    schedule = for_config(report.config)
    pipeline = pipeline or pipelines(report)[0]
    pp = schedule.pp
    ev = [[e for e in r["events"] if e["step"] == step] for r in pipeline]
    ops = {(rank, e["kind"], e["microbatch"], e["stage"]): e
           for rank, es in enumerate(ev) for e in es if e["kind"] in COMPUTE}
    t0 = min(e["start"] for e in ops.values())
    t1 = max(e["end"] for e in ops.values())
    span = t1 - t0
    idle = []
    for rank, es in enumerate(ev):
        busy = sum(e["end"] - e["start"] for e in es if e["kind"] in COMPUTE)
        waiting = _clipped([e for e in es if e["kind"] == "wait"], t0, t1)
        sending = _clipped([e for e in es if e["kind"] == "send"], t0, t1)
        idle.append({"idle": 1 - busy / span, "waiting_on_messages": waiting / span,
                     "sending": sending / span, "other": (span - busy - waiting - sending) / span})

    def wall(rank, op):
        e = ops[(rank, op.kind, op.microbatch, op.chunk)]
        return e["end"] - e["start"]

    by_stage: dict[tuple, list[float]] = {}
    for (rank, kind, _, chunk), e in ops.items():
        by_stage.setdefault((rank, kind, chunk), []).append(e["end"] - e["start"])
    stage_mean = {k: statistics.fmean(v) for k, v in by_stage.items()}
    sends = {(rank, e["message"], e["microbatch"], e["to_chunk"]): e
             for rank, es in enumerate(ev) for e in es if e["kind"] == "send"}
    waits = {(rank, e["microbatch"], e["stage"], e["waiting_for"][0]): e
             for rank, es in enumerate(ev) for e in es if e["kind"] == "wait" and e["microbatch"] is not None}
    latencies, bounds, receives = [], {}, {}
    for (rank, kind, micro, chunk), op_event in ops.items():
        to = chunk + 1 if kind == "F" else chunk - 1
        if kind == "W" or not 0 <= to < schedule.n_chunks or schedule.owner[to] == rank:
            continue
        wait = waits.get((schedule.owner[to], micro, to, kind))
        if wait is None:
            continue
        bounds[(kind, micro, chunk)] = wait["end"] - op_event["end"]
        if wait["start"] < op_event["end"]:  # the receiver was blocked on this very message
            latencies.append(wait["end"] - op_event["end"])
        else:  # it was there already: the wait is the cost of taking it
            receives[(kind, micro, chunk)] = wait["end"] - wait["start"]
    typical = statistics.median(latencies) if latencies else 0.0

    def hand_off(rank, op):
        to, message = (op.chunk + 1, "act") if op.kind == "F" else (op.chunk - 1, "grad")
        e = sends.get((rank, message, op.microbatch, to)) if op.kind != "W" else None
        return e["end"] - e["start"] if e else 0.0

    def latency(dep):
        return min(typical, bounds.get((dep.kind, dep.microbatch, dep.chunk), typical))

    def receive(dep):
        return receives.get((dep.kind, dep.microbatch, dep.chunk), 0.0)

    def mean_idle(timed):
        return statistics.fmean(idle_fractions(timed, pp))

    return {"per_rank": [x["idle"] for x in idle], "idle_per_rank": idle,
            "replay_stage_means": mean_idle(simulate(schedule, lambda r, op: stage_mean[(r, op.kind, op.chunk)])),
            "replay_each_op": mean_idle(simulate(schedule, wall)),
            "replay_each_op_and_links": mean_idle(_replay_with_links(schedule, wall, hand_off, latency, receive)),
            "p2p_latencies_s": latencies}


def bubble(report) -> dict:
    """The bubble measured on the wall clock (with what its gap to the formula is made of),
    replayed with the measured op times (own device), and the formula, for the report."""
    cfg = report.config
    schedule = for_config(cfg)
    steps = _steps_to_measure(cfg["steps"])
    pp = cfg["pp"]
    own, each, gaps = [], [], {step: [] for step in steps}
    cpu_share: list[list[float]] = []
    for pipeline in pipelines(report):
        own.append(idle_fractions(own_device_replay(report, steps[0], pipeline), pp))
        for step in steps:
            each.append(idle_fractions(own_device_replay(report, step, pipeline, "each"), pp))
            gaps[step].append(wall_gap(report, step, pipeline))
        timed = [[e for e in r["events"] if e["kind"] in COMPUTE and e["step"] in steps] for r in pipeline]
        cpu_share.append([sum(e["cpu"] for e in es) / sum(e["end"] - e["start"] for e in es) for es in timed])
    every = [g for step in steps for g in gaps[step]]
    costs = op_costs(report)
    formula = theory.bubble_fraction(cfg["schedule"], pp, cfg["microbatches"], schedule.virtual,
                                     costs if "W" in costs else None)
    wall_per_rank = [statistics.fmean(g["per_rank"][r] for g in every) for r in range(pp)]
    chain = [formula] + [statistics.fmean(g[k] for g in every) for k in
                         ("replay_stage_means", "replay_each_op", "replay_each_op_and_links")]
    overall = statistics.fmean(wall_per_rank)
    latencies = [x for g in every for x in g["p2p_latencies_s"]]
    where = placement(report)
    wall = {"overall": overall, "per_rank": wall_per_rank,
            "per_step": [statistics.fmean(x for g in gaps[step] for x in g["per_rank"]) for step in steps],
            "ranks_shared_cores": where["ranks_shared_cores"], "placement": where["note"],
            "op_cpu_over_wall_per_rank": [statistics.fmean(c[r] for c in cpu_share) for r in range(pp)],
            "idle_per_rank": [{k: statistics.fmean(g["idle_per_rank"][r][k] for g in every)
                               for k in ("waiting_on_messages", "sending", "other")}
                              for r in range(pp)],
            "replays": dict(zip(("stage_means", "each_op", "each_op_and_links"), chain[1:])),
            "gap_to_formula": {"stage_imbalance": chain[1] - chain[0],
                               "op_time_variation": chain[2] - chain[1],
                               "p2p_messages": chain[3] - chain[2],
                               "between_ops": overall - chain[3]},
            "p2p_latency_median_s": statistics.median(latencies) if latencies else None,
            "p2p_messages_waited_on": len(latencies)}
    per_rank = [statistics.fmean(f[r] for f in own) for r in range(pp)]
    replayed = {"overall": statistics.fmean(per_rank), "per_rank": per_rank,
                "each_op": statistics.fmean(x for f in each for x in f)}
    return {"wall": wall, "replayed": replayed, "theory": formula, "steps": steps, "op_cpu_s": costs}


def summary_lines(report) -> list[str]:
    """The command line's lines for a pipeline run's bubble (none for other runs)."""
    if report.config["pp"] == 1:
        return []
    b = bubble(report)
    wall, gap = b["wall"], b["wall"]["gap_to_formula"]
    share = wall["op_cpu_over_wall_per_rank"]
    return [f"bubble: measured (wall clock) {wall['overall']:.1%}  replayed (measured op times, "
            f"own-device schedule) {b['replayed']['overall']:.1%}  theory (formula) "
            f"{b['theory']:.1%}",
            f"  wall clock: {wall['placement']}; the ops' CPU time is {min(share):.0%}-"
            f"{max(share):.0%} of their wall time (100%: nothing else ran on the rank's core)",
            "  wall clock minus formula, points: " + "  ".join(
                f"{GAP_PARTS[k]} {100 * v:+.1f}" for k, v in gap.items())
            + (f"  (median p2p latency {1e3 * wall['p2p_latency_median_s']:.2f} ms)"
               if wall["p2p_latency_median_s"] is not None else "")]
