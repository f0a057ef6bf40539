"""Live experiments that are neither a training run (`launch.run`) nor a collective
(`collectives.py`): each starts ranks, does one small thing on them, and returns plain data that a
page or a lesson draws. The app's pages call these and never run code on a rank themselves.

- `tp_mlp_shards(cfg_dict)`: the MLP weights tensor parallel leaves on each rank, read back from
  the ranks, and the column-then-row-parallel MLP redone with them (the app's Tensor parallel page).
- `wire_bytes_experiment(n, nbytes)`: each collective once on n ranks, the bytes every rank really
  wrote to its sockets beside the ring model's count (lesson 01).
- `dp_overlap_experiment(dp)`: naive, bucketed and one-bucket data parallel, interleaved runs; step
  times and how much of the bucketed all-reduce time overlapped backward (lesson 02).

And what a training run's timeline says, read from a RunReport (plain data, no ranks started):

- `timed_steps(report)`: the steps whose times mean something (not the warm-up, not the metered one);
- `step_times(report)`: per rank and timed step, the step's wall time and each op kind's wall and
  CPU time (lesson 02's step times, lesson 03's recompute cost);
- `allreduce_overlap(records, step, backward_start, backward_end)` and `overlapped_share(rows)`:
  per all-reduce, when it was launched and finished relative to the end of backward, and the share
  of all-reduce time that fell within backward's wall-clock span (`python -m parallel_mini.bench
  dp` too);
- `bucket_overlap(report)`: the same for every rank and timed step of a data-parallel run;
- `comm_during_other_compute(report)`: per collective (DualPipe's question: the experts'
  all-to-all), how much of its wall interval fell inside a compute op (F, B, W) of another
  micro-batch or chunk on the same rank, counted from the timeline records.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import Comm
from ..config import RunConfig
from ..mesh import rank_device
from ..runtime.launch import run_ranks
from ..mesh import build_mesh
from ..model import build_model
from ..parallel.tensor import apply_tensor_parallel


def _tp_mlp_shards_rank(cfg_dict: dict, tokens: int = 8) -> dict:
    """On each tp rank: build the model (the same full weights everywhere, one seed), shard it with
    apply_tensor_parallel, and return this rank's MLP weights of every block. Then redo Megatron-LM's
    picture with them: Y_r = GELU(X A_r) needs no communication; the partial products Y_r B_r are
    summed by an all-reduce, and both are compared with the unsharded computation."""
    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    t, r = comm.size("tp"), comm.rank("tp")
    model = build_model(cfg)
    full = [(b.mlp.fc.weight.detach().clone(), b.mlp.fc.bias.detach().clone(),
             b.mlp.proj.weight.detach().clone()) for b in model.blocks]
    apply_tensor_parallel(model, comm, cfg.sp)
    torch.manual_seed(1234)
    x = torch.randn(tokens, cfg.d_model)  # [tokens, h], the same on every rank
    blocks = []
    with torch.no_grad():
        for (fc_w, fc_b, proj_w), block in zip(full, model.blocks):
            w1, b1, w2 = (block.mlp.fc.weight.detach(), block.mlp.fc.bias.detach(),
                          block.mlp.proj.weight.detach())  # [4h/t, h], [4h/t], [h, 4h/t]
            n = w1.shape[0]
            y_r = F.gelu(x @ w1.T + b1)  # [tokens, 4h/t]: this rank's columns of Y, no comm
            z = (y_r @ w2.T).contiguous()  # [tokens, h]: a partial sum over this rank's 4h/t
            partial = z.clone()
            if t > 1:
                comm.all_reduce(z, "tp", layer="g")  # Σ_r Y_r B_r
            y_full = F.gelu(x @ fc_w.T + fc_b)  # [tokens, 4h], one process
            z_full = y_full @ proj_w.T  # [tokens, h]
            out = {"fc": w1.numpy().copy(), "proj": w2.numpy().copy(),
                   "fc_rows": [r * n, (r + 1) * n], "proj_cols": [r * n, (r + 1) * n],
                   "y_shape": list(y_r.shape), "z_shape": list(z.shape),
                   "y_slice_diff": float((y_r - y_full[:, r * n:(r + 1) * n]).abs().max()),
                   "partial_diff": float((partial - z_full).abs().max()),
                   "all_reduce_diff": float((z - z_full).abs().max())}
            if r == 0:
                out.update(fc_full=fc_w.numpy().copy(), proj_full=proj_w.numpy().copy())
            blocks.append(out)
    return {"rank": r, "blocks": blocks,
            "comm": [{k: v for k, v in c.items() if k in ("op", "layer", "payload_bytes",
                                                           "wire_bytes_model")} for c in comm.records]}


def tp_mlp_shards(cfg_dict: dict, tokens: int = 8, timeout: float = 60.0) -> list[dict]:
    """Every tp rank's MLP shards of every block, in rank order (rank 0's entry also holds the full
    weights), with the diffs of the sharded MLP against the unsharded one and the comm records.
    `cfg_dict`: a RunConfig as a dict, one rank per tp degree (dp = pp = 1)."""
    results = run_ranks(_tp_mlp_shards_rank, cfg_dict["tp"], cfg_dict, tokens, timeout=timeout,
                        pg_timeout=timeout)
    return [res.value for res in sorted(results, key=lambda res: res.rank)]


# ---------------------------------------------------------------------------------------------
# bytes on the wire: the ring model against what gloo really writes (lesson 01)
# ---------------------------------------------------------------------------------------------
WIRE_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def _wire_rank(numel: int, repeats: int) -> list[dict]:
    n, r = dist.get_world_size(), dist.get_rank()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    dev = rank_device()
    x = torch.ones(numel, device=dev)  # [numel] fp32: S = 4 * numel bytes, the same for every op
    piece, out = torch.ones(numel // n, device=dev), torch.empty(numel, device=dev)
    calls = {"all_reduce": lambda: comm.all_reduce(x, "dp"),
             "broadcast": lambda: comm.broadcast(x, "dp", src=0),
             "all_gather": lambda: comm.all_gather(out, piece, "dp"),
             "reduce_scatter": lambda: comm.reduce_scatter(piece, x, "dp"),
             "all_to_all": lambda: comm.all_to_all(out, x, "dp")}
    rows = []
    for op in WIRE_OPS:
        written = []
        for _ in range(repeats):
            dist.barrier()  # nothing else in flight: the bytes written during the op are its own
            calls[op]()
            written.append(comm.records[-1]["wire_bytes_measured"])
        rec = comm.records[-1]
        rows.append({"op": op, "rank": r, "payload_bytes": rec["payload_bytes"],
                     "ring_model_bytes": rec["wire_bytes_model"],
                     "written_bytes": (None if None in written else
                                       int(statistics.median(written)))})
    return rows


def wire_bytes_experiment(n: int = 4, nbytes: int = 2 ** 20, repeats: int = 3,
                          timeout: float = 60.0) -> list[dict]:
    """Each collective on n ranks over an fp32 tensor of `nbytes` (S: the full tensor, as in
    theory.wire_bytes): one row per (op, rank) with the ring model's bytes (the op's record,
    `wire_bytes_model`) and the bytes the rank really wrote to its sockets during the op (median of
    `repeats` calls, `wire_bytes_measured`; None where it cannot be read: off Linux, on NCCL).
    The model assumes a ring (a pipelined chain for broadcast); gloo does not always use one."""
    numel = max(n, nbytes // 4 // n * n)
    rows = [row for res in run_ranks(_wire_rank, n, numel, repeats, timeout=timeout,
                                     pg_timeout=timeout, backend="gloo") for row in res.value]
    return sorted(rows, key=lambda row: (WIRE_OPS.index(row["op"]), row["rank"]))


# ---------------------------------------------------------------------------------------------
# a training run's timeline: step times and overlap (lessons 02 and 03, bench dp)
# ---------------------------------------------------------------------------------------------
def _as_dict(report) -> dict:
    return report.to_dict() if hasattr(report, "to_dict") else report


def timed_steps(report, warmup: int = 1) -> list[int]:
    """The steps whose times mean something: not the first `warmup` ones (first allocations; data
    parallel learns its bucket order in step 0) and not the metered one (the last: every op runs
    several times slower under the live-bytes meter)."""
    d = _as_dict(report)
    metered = {r.get("metered_step") for r in d["ranks"]}
    return [s for s in range(warmup, d["config"]["steps"]) if s not in metered]


def step_times(report, warmup: int = 1) -> list[dict]:
    """One row per rank and timed step: `step_ms`, the wall time from the step's first op to its
    last (forward of the first micro-batch to the end of the optimizer step), and for every op kind
    its wall (`<kind>_ms`) and CPU (`<kind>_cpu_ms`) time, summed over micro-batches. CPU time is
    the rank's own thread only: what the op would take on a device of its own, whoever else shares
    the cores; wall time includes the waiting."""
    d = _as_dict(report)
    keep = set(timed_steps(d, warmup))
    rows = []
    for r in d["ranks"]:
        by_step: dict[int, list[dict]] = {}
        for e in r["events"]:
            if e.get("step") in keep:
                by_step.setdefault(e["step"], []).append(e)
        for step, events in sorted(by_step.items()):
            row = {"rank": r["rank"], "step": step,
                   "step_ms": 1e3 * (max(e["end"] for e in events) - min(e["start"] for e in events))}
            for e in events:
                row[f"{e['kind']}_ms"] = row.get(f"{e['kind']}_ms", 0.0) + 1e3 * (e["end"] - e["start"])
                row[f"{e['kind']}_cpu_ms"] = row.get(f"{e['kind']}_cpu_ms", 0.0) + 1e3 * e.get("cpu", 0.0)
            rows.append(row)
    return rows


def allreduce_overlap(records: list[dict], step: int, backward_start: float,
                      backward_end: float, blocked=()) -> list[dict]:
    """One row per all-reduce of `step` in `records` (one rank's comm records): when it was launched
    and when it finished (as the backend reported it: the completion callback, or the wait that
    returned first), both in ms relative to the end of backward (negative: before backward ended),
    its duration, and how much of it fell within backward's wall-clock span [backward_start,
    backward_end] while backward was not itself held up in a collective (`blocked`: (start, end)
    intervals in which the rank's backward waited, e.g. a wait() inside a gradient hook: backward
    computed nothing then, so that time is no overlap). On a machine whose ranks share cores,
    backward may also be waiting for a core during part of it."""
    rows = []
    for c in records:
        if c.get("step") != step or c["op"] != "all_reduce" or "end" not in c:
            continue
        done = min(c["end"], c.get("waited_until", c["end"]))
        lo, hi = max(c["start"], backward_start), min(done, backward_end)
        inside = max(0.0, hi - lo)
        for b0, b1 in blocked:  # (the intervals do not overlap each other: one thread's calls)
            inside -= max(0.0, min(hi, b1) - max(lo, b0))
        rows.append({"bucket": c.get("bucket"), "grads_pending": c.get("grads_pending"),
                     "launch_ms": 1e3 * (c["start"] - backward_end),
                     "finish_ms": 1e3 * (done - backward_end),
                     "allreduce_ms": 1e3 * (done - c["start"]),
                     "overlapped_ms": 1e3 * max(0.0, inside),
                     "backward_ms": 1e3 * (backward_end - backward_start)})
    return rows


def overlapped_share(rows: list[dict]) -> float:
    """Of the all-reduce time in `rows` (allreduce_overlap's), the share that overlapped backward:
    0 when every all-reduce ran after backward, 1 when all of them finished inside it."""
    total = sum(row["allreduce_ms"] for row in rows)
    return sum(row["overlapped_ms"] for row in rows) / total if total > 0 else 0.0


def bucket_overlap(report, warmup: int = 1) -> list[dict]:
    """allreduce_overlap for every rank and timed step of a data-parallel run (RunReport or its
    dict), against the backward that synchronised (the last micro-batch's), with `rank`, `step`
    and `finished_in_backward` added."""
    d = _as_dict(report)
    keep = set(timed_steps(d, warmup))
    rows = []
    for r in d["ranks"]:
        for step in sorted(keep):
            backward = [e for e in r["events"] if e["kind"] == "backward" and e.get("step") == step]
            if not backward:
                continue
            last = max(backward, key=lambda e: e["end"])  # the micro-step whose backward syncs
            for row in allreduce_overlap(r["comm"], step, last["start"], last["end"]):
                rows.append({"rank": r["rank"], "step": step, **row,
                             "finished_in_backward": row["finish_ms"] <= 0.0})
    return rows


COMPUTE_OPS = ("F", "B", "W")


def comm_during_other_compute(report, op: str = "all_to_all", warmup: int = 1) -> dict:
    """Counted from a pipeline run's records (RunReport or its dict): for every `op` record of a
    timed step with a wall interval, the op it was issued from (the compute op, F/B/W, on the same
    rank whose interval holds the record's start: its own micro-batch and chunk) and the time it
    overlapped any OTHER compute op of that rank (another micro-batch's, or the same micro-batch's
    other chunk): DualPipe's F&B overlap, a chunk's all-to-all in flight while another computes.
    Returns {"records": n, "inside_own_op": n, "overlapping_other": n, "comm_s": total wall time,
    "overlapped_s": total overlap with other compute, "rows": one row per record}. A runner that
    runs each rank's ops one after the other, its all-to-all blocking inside the op that needs it,
    counts overlapping_other = 0 whatever the machine."""
    d = _as_dict(report)
    keep = set(timed_steps(d, warmup))
    rows = []
    for r in d["ranks"]:
        compute = [e for e in r["events"] if e["kind"] in COMPUTE_OPS and e.get("step") in keep]
        for c in r["comm"]:
            if c["op"] != op or c.get("step") not in keep or "end" not in c:
                continue
            own = next((e for e in compute if e["start"] <= c["start"] <= e["end"]), None)
            other = sum(max(0.0, min(c["end"], e["end"]) - max(c["start"], e["start"]))
                        for e in compute if e is not own)
            rows.append({"rank": r["rank"], "step": c["step"], "phase": c.get("phase"),
                         "own_op": None if own is None else
                         f"{own['kind']}{own.get('microbatch')}.{own.get('stage')}",
                         "inside_own_op": own is not None and c["end"] <= own["end"],
                         "comm_s": c["end"] - c["start"], "overlapped_other_s": other})
    return {"records": len(rows), "inside_own_op": sum(x["inside_own_op"] for x in rows),
            "overlapping_other": sum(x["overlapped_other_s"] > 0 for x in rows),
            "comm_s": sum(x["comm_s"] for x in rows),
            "overlapped_s": sum(x["overlapped_other_s"] for x in rows), "rows": rows}


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def dp_overlap_experiment(dp: int = 4, batch: int = 8, bucket_mb: float = 0.25, steps: int = 6,
                          repeats: int = 2, **model) -> dict:
    """Data parallel three ways on the same model and data: `naive` (one all-reduce per gradient,
    after backward), `bucketed` (buckets of `bucket_mb`, each all-reduced as soon as backward has
    filled it) and `one bucket` (bucketed with every gradient in one bucket: it can only start when
    backward ends, so the same code without the overlap). `repeats` runs of `steps` steps each,
    the modes interleaved (A B C, then C B A, ...) so that a machine that gets busier or quieter
    does not favour one mode.

    Returns {"summary": one row per mode: medians over ranks x timed steps x runs of the step time,
    backward (wall, and the rank's own CPU time), waiting for the gradients after backward
    (grad_sync), the share of all-reduce time
    that overlapped backward, all-reduces per step and how many finished before backward ended;
    "steps": step_times rows with `mode` and `run`; "buckets": bucket_overlap rows of the bucketed
    runs; "config": what ran}."""
    from ..runtime.launch import run  # engine imports much of the library: only when a run is asked for

    base = RunConfig(dp=dp, batch=batch, steps=steps, **model).validate()
    n_params = sum(1 for _ in build_model(base).parameters())
    grad_mb = 4 * sum(p.numel() for p in build_model(base).parameters()) / 2 ** 20
    modes = {"naive": base.replace(dp_mode="naive"),
             "bucketed": base.replace(dp_mode="bucketed", bucket_mb=bucket_mb),
             "one bucket": base.replace(dp_mode="bucketed", bucket_mb=2 * grad_mb + 1)}
    order = list(modes)
    step_rows, bucket_rows = [], []
    for rep in range(repeats):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            report = run(modes[mode]).to_dict()
            step_rows += [{"mode": mode, "run": rep, **row} for row in step_times(report)]
            overlap = [{"mode": mode, "run": rep, **row} for row in bucket_overlap(report)]
            bucket_rows += overlap
    summary = []
    for mode in order:
        st = [row for row in step_rows if row["mode"] == mode]
        ov = [row for row in bucket_rows if row["mode"] == mode]
        per_step: dict[tuple, list[dict]] = {}
        for row in ov:
            per_step.setdefault((row["run"], row["rank"], row["step"]), []).append(row)
        summary.append({
            "mode": mode, "bucket_mb": modes[mode].bucket_mb if mode != "naive" else None,
            "allreduces_per_step": _median(len(v) for v in per_step.values()),
            "step_ms": _median(row["step_ms"] for row in st),
            "backward_ms": _median(row["backward_ms"] for row in st),
            "backward_cpu_ms": _median(row["backward_cpu_ms"] for row in st),
            "grad_sync_ms": _median(row["grad_sync_ms"] for row in st),
            "overlapped_share": _median(overlapped_share(v) for v in per_step.values()),
            "finished_in_backward": _median(sum(r["finished_in_backward"] for r in v)
                                            for v in per_step.values()),
            "samples": len(st)})
    return {"summary": summary, "steps": step_rows,
            "buckets": [row for row in bucket_rows if row["mode"] == "bucketed"],
            "config": {"dp": dp, "batch": batch, "steps": steps, "repeats": repeats,
                       "bucket_mb": bucket_mb, "gradient_tensors": n_params,
                       "gradient_mb": grad_mb, "timed_steps": timed_steps(
                           {"config": {"steps": steps}, "ranks": [{"metered_step": steps - 1}]})}}


# ---------------------------------------------------------------------------------------------
# Without a barrier (lesson 10): local SGD's bytes, federated averaging's rounds to a target loss
# ---------------------------------------------------------------------------------------------
SMALL = dict(layers=1, d_model=32, heads=2, seq=16, vocab=64)  # a model that trains in seconds


def _per_sample(report, batch: int) -> dict:
    """Bytes rank 0 sent over dp per step, per sample (one sequence of the step's batch): counted
    from the comm records, theory, written to the sockets (measured; None where unreadable)."""
    measured = report.wire_bytes_per_step(kind="measured").get("dp", 0)
    return {"counted": report.wire_bytes_per_step().get("dp", 0) / batch,
            "theory": report.theory["wire_bytes_per_step"].get("dp", 0) / batch,
            "measured": None if measured is None else measured / batch}


def local_sgd_bytes(dp: int = 4, every=(1, 2, 4), steps: int = 8, batch: int = 8,
                    **model) -> list[dict]:
    """Data parallel (gradients averaged every step) and local SGD at each H in `every`, one live
    run each on the same data: per row `mode`, `sync_every` (0: DDP), `bytes_per_sample`
    ({counted, theory, measured}), `ratio_to_ddp` (counted), and the run's `losses`."""
    from ..runtime.launch import run  # only when a run is asked for

    rows = []
    for h in (0, *every):
        cfg = RunConfig(dp=dp, steps=steps, batch=batch, sync_every=h, **{**SMALL, **model})
        report = run(cfg)
        rows.append({"mode": "DDP" if h == 0 else f"local SGD, H = {h}", "sync_every": h,
                     "bytes_per_sample": _per_sample(report, batch), "losses": report.losses})
    ddp = rows[0]["bytes_per_sample"]["counted"]
    for row in rows:
        row["ratio_to_ddp"] = row["bytes_per_sample"]["counted"] / ddp if ddp else None
    return rows


def rounds_to_target(losses: list[float], target: float) -> int | None:
    """The first round (1-based) after which the loss is at most `target`; None if none is."""
    return next((r + 1 for r, x in enumerate(losses) if x <= target), None)


def fedavg_rounds_to_target(target: float = 3.0, non_iid=(0.0, 10.0), local_steps=(1, 4),
                            rounds: int = 12, dp: int = 2, clients: int = 4,
                            clients_per_round: int = 2, lr: float = 1e-2, **model) -> list[dict]:
    """Federated averaging's rounds to `target` (the server's loss on the union of the clients'
    data) as non-IID-ness and local steps grow: one live run per (A, E), the same clients, data
    sizes and sampling. Per row `non_iid`, `local_steps`, `rounds_to_target` (None: not within
    `rounds`), the union loss per round, each round's mean client drift, and the weights' bytes
    rank 0 sent per round ({counted, theory, measured})."""
    from ..runtime.launch import run  # only when a run is asked for

    rows = []
    for a in non_iid:
        for e in local_steps:
            cfg = RunConfig(dp=dp, federated=True, clients=clients, lr=lr,
                            clients_per_round=clients_per_round, local_steps=e, rounds=rounds,
                            non_iid=float(a), batch=4, **{**SMALL, **model})
            report = run(cfg)
            fed = report.extra["federated"]
            rows.append({"non_iid": a, "local_steps": e,
                         "rounds_to_target": rounds_to_target(report.losses, target),
                         "union_loss": report.losses,
                         "mean_drift": [sum(r["drift"].values()) / max(1, len(r["drift"]))
                                        for r in fed["rounds"]],
                         "weights_bytes_per_round": fed["network"][0]["weights_bytes_per_round"]})
    return rows


def barrier_curve(report) -> list[dict]:
    """A synchronous or asynchronous run's loss curve: per update {time (s on the wall clock,
    measured), samples, loss} (bench's curves: sync DP's global loss per step; async's smoothed
    over one update per worker)."""
    from .bench import _async_curve, _sync_curve

    return _async_curve(report) if report.config.get("asynchronous") else _sync_curve(report)


def straggler_runs(ranks: int = 4, factor: float = 3.0, steps: int = 8, batch: int = 12,
                   max_staleness: int = -1, straggler_rank: int | None = None, **model) -> dict:
    """Synchronous DP and asynchronous SGD on `ranks` ranks, each without and with a straggler
    (`straggler_rank`, default the last rank, `factor` times slower): {name: RunReport}, one live
    run each on the same data and model (SMALL unless given)."""
    from ..runtime.launch import run

    slow = f"{ranks - 1 if straggler_rank is None else straggler_rank}:{factor:g}"
    common = dict(dp=ranks, steps=steps, batch=batch, **{**SMALL, **model})
    configs = {"sync DP": RunConfig(**common), f"sync DP, straggler ×{factor:g}":
               RunConfig(**common, straggler=slow),
               "async": RunConfig(**common, asynchronous=True, max_staleness=max_staleness),
               f"async, straggler ×{factor:g}": RunConfig(**common, asynchronous=True,
                                                          max_staleness=max_staleness,
                                                          straggler=slow)}
    return {name: run(cfg) for name, cfg in configs.items()}
