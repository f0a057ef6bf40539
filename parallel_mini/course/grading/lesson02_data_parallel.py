"""Lesson 02 (02_data_parallel): averaging gradients over the data-parallel ranks,
`check_average_gradients`, then bucketed, overlapped gradient all-reduce (DDP's reducer),
`check_bucketed_grad_sync`.

Both train the toy GPT on real ranks with the learner's code in place of the library's and
compare every gradient with the mean over the ranks (the usual mistakes named by
`_gradient_mistake`); the bucketed check also measures when each bucket's all-reduce was launched
against the end of backward.
"""
from __future__ import annotations

import statistics

from ... import theory
from ...config import RunConfig
from .core import (CHECK_PG_TIMEOUT, CHECK_RUN_TIMEOUT, _CodeSwapped, Grade, _RankTrace,
                   _library_copy, _on_ranks, _stuck_after, _trace_for, _wire_summary,
                   _wire_verdict)


# ---------------------------------------------------------------------------------------------
# averaging the gradients, one all-reduce per tensor (naive data parallel)
# ---------------------------------------------------------------------------------------------
_AVERAGE_STUB = ("average_gradients still raises NotImplementedError: write it, then run this "
                 "cell again.")


def _library_average_refused(params, comm, axis="dp"):
    """Swapped in for the code of data.average_gradients while a learner's averaging runs."""
    raise AssertionError("your average_gradients called the library's own (parallel_mini.parallel."
                         "data.average_gradients), which the checker disables while your code "
                         "runs: write the loop yourself, with comm.all_reduce")


class _LibraryAverageDisabled(_CodeSwapped):
    """The library's average_gradients raises while active."""

    def swaps(self):
        from ...parallel import data
        return [(data.average_gradients, _library_average_refused)]


def _average_rank(cfg_dict: dict, fn) -> dict:
    """One rank of the averaging check: engine.train_rank with `fn` checked in place of naive
    DP's averaging, the bytes it wrote to its sockets added to the rank's result."""
    import functools

    from ...engine import train_rank  # late: engine imports the launcher stack

    box: dict = {}
    out = train_rank(cfg_dict, average_fn=functools.partial(_checked_average, fn, box))
    out["wire"] = box.get("wire", {"written": 0, "explained": 0, "calls": 0})
    return out


def _checked_average(fn, box: dict, params, comm) -> None:
    """In place of naive DP's averaging on a rank: the learner's `fn`, traced, the library's own
    disabled, then every gradient compared with the mean over the ranks computed by an
    uncounted all-reduce of a copy taken before; the usual mistakes named."""
    import torch
    import torch.distributed as dist

    direct = ("your average_gradients called dist.all_reduce directly: use comm.all_reduce("
              "p.grad, 'dp'), which records its bytes (the checker compares them with the "
              "formula)")
    before = [p.grad.detach().clone() for p in params]
    trace = _trace_for(comm, "your average_gradients", {"dist.all_reduce": direct})
    with _LibraryAverageDisabled(), trace:
        fn(params, comm)
    trace.agree()
    box["wire"] = _wire_summary(trace)  # the trace's totals so far, for the rank's result
    n, group = comm.size("dp"), comm.mesh.groups["dp"]
    flat = torch.cat([g.reshape(-1) for g in before])  # [P]: this rank's own gradients
    mean = flat.clone()
    try:
        if n > 1:
            dist.all_reduce(mean, group=group)
    except RuntimeError as e:
        _stuck_after(trace, e)
        raise
    mean /= n
    got = torch.cat([p.grad.detach().reshape(-1) for p in params])
    why = _gradient_mistake(got, mean, flat, n)
    if why:
        raise AssertionError(f"at dp={n}, rank {dist.get_rank()}, step {comm.step}: {why}")


def _gradient_mistake(got, mean, flat, n: int) -> str | None:
    """None if the gradients `got` [P] are the mean over the ranks `mean` [P]; else the usual
    mistake named (`flat`: this rank's own gradients before any averaging)."""
    import torch

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-7)

    if close(got, mean):
        return None
    if close(got, mean * n):
        why = (f"every p.grad holds the sum over the ranks, N = {n} times the mean: divide by N "
               f"(comm.size('dp')) after the all-reduce")
    elif close(got, flat):
        why = ("the gradients are unchanged, still this rank's own: all-reduce each p.grad "
               "(comm.all_reduce(p.grad, 'dp')), in place")
    elif close(got, flat / n):
        why = ("each p.grad is this rank's own gradient divided by N: the gradients were never "
               "summed over the ranks (comm.all_reduce(p.grad, 'dp'))")
    elif close(got, mean / n):
        why = f"the gradients were divided by N twice (N = {n}): all-reduce, then divide once"
    else:
        why = (f"the gradients differ from the mean over the ranks by up to "
               f"{(got - mean).abs().max().item():.2e}")
    return why


def check_average_gradients(fn, world_sizes=(2, 4), steps: int = 3) -> Grade:
    """`fn(params, comm)` must leave every p.grad equal to the mean over the "dp" ranks, using
    comm.all_reduce. Checked by training the tiny GPT with it in naive DP mode against the
    single-process reference, at each world size; after every call each rank's gradients are
    compared with the mean (sum instead of mean, unchanged gradients, never summed: named). The
    library's own average_gradients raises while the learner's code runs, and a deadlock stops
    after CHECK_PG_TIMEOUT seconds of waiting with what every rank waited on."""
    from ...runtime.launch import run_ranks
    from ...report import merge_rank_results

    _library_copy(fn, _LIBRARY_DP, "your")
    report, wires = None, []
    for n in world_sizes:
        cfg = RunConfig(dp=n, dp_mode="naive", batch=2 * n, steps=steps, reference=True).validate()
        results = _on_ranks(lambda: run_ranks(_average_rank, n, cfg.to_dict(), fn,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _AVERAGE_STUB, f"at dp={n}")
        if isinstance(results, Grade):
            return results
        report = merge_rank_results(cfg, [res.value for res in results])
        if report.max_abs_diff > 1e-5:
            raise AssertionError(f"at dp={n} training differs from the single-process reference "
                                 f"by {report.max_abs_diff:.2e} (> 1e-5)")
        counted = report.wire_bytes_per_step().get("dp", 0)
        predicted = report.theory["wire_bytes_per_step"]["dp"]
        if counted != predicted:
            raise AssertionError(f"at dp={n} your averaging sent {counted:,.0f} bytes per step "
                                 f"(counted from its calls); "
                                 f"all-reducing every gradient once sends {predicted:,} "
                                 f"(use comm.all_reduce(p.grad, 'dp') so its bytes are recorded)")
        wires.append({"dp": n, **_wire_verdict([res.value for res in results], f"at dp={n}",
                                               "your average_gradients")})
    return Grade("correct", f"equal to the single-process reference (max |diff| "
                 f"{report.max_abs_diff:.1e}) at dp = {list(world_sizes)}, moving exactly "
                 f"2(N-1)/N x gradient bytes per step (counted), and no bytes written to the "
                 f"sockets beyond those all-reduces' (measured); the library's average_gradients "
                 f"disabled while yours ran", {"report": report, "wire": wires})


# ---------------------------------------------------------------------------------------------
# bucketed, overlapped gradient all-reduce (DDP's reducer)
# ---------------------------------------------------------------------------------------------
# The check model: the toy GPT (P = 218,496 fp32 gradients, 874 KB) in buckets of 0.1 MB: nine
# buckets, so that most can be launched while backward still runs.
BUCKETED_CHECK = {"world_sizes": (2, 4), "steps": 2, "bucket_mb": 0.1}
_BUCKETED_STUB = ("BucketedGradSync still raises NotImplementedError: write on_grad_ready and "
                  "finish_gradient_sync, then run this cell again.")


def _library_buckets_refused(*args, **kwargs):
    """Swapped in for the code of the library's bucketed data parallel while a learner's runs."""
    raise AssertionError("your code called the library's own bucketed data parallel (parallel_mini"
                         ".parallel.data: DataParallel, make_buckets, Bucket), which the checker "
                         "disables while your code runs: pack, launch and unpack the buckets "
                         "yourself, with comm.all_reduce(..., async_op=True)")


_LIBRARY_DP = ("parallel.data", "course.grading.lesson02_data_parallel")


class _LibraryBucketsDisabled(_CodeSwapped):
    """The library's bucketed DP raises while active."""

    def swaps(self):
        from ...parallel import data
        fns = [data.make_buckets, data.average_gradients, data.Bucket.__init__]
        fns += [getattr(data.DataParallel, name) for name in (
            "__init__", "_on_grad_ready", "_launch_ready_buckets", "finish_gradient_sync",
            "_wait_and_unpack", "_rebuild_buckets")]
        return [(f, _library_buckets_refused) for f in fns]


def _bucketed_rank(cfg_dict: dict, cls, bucket_mb: float) -> dict:
    """One rank of the bucketed check: the toy GPT with the learner's `cls(params, comm,
    bucket_bytes)` registering its gradient hooks; each step forward and backward on this rank's
    shard, then `finish_gradient_sync()`. Every gradient is compared with the mean over the ranks
    (an uncounted all-reduce of copies that a hook registered first takes). Measured: when each
    all-reduce record was launched and finished against the moment backward returned and against
    each gradient's arrival; every wait() or blocking collective the learner's code made while
    backward ran (a hook that blocks); backward's duration with the learner's hooks and, before
    they exist, without them; the bytes this rank wrote to its sockets."""
    import time

    import torch
    import torch.distributed as dist

    from ...comm import Comm
    from ...data import global_batch, shard
    from ..experiments import allreduce_overlap
    from ...mesh import build_mesh
    from ...model import build_model

    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    n, r, group = comm.size("dp"), comm.rank("dp"), comm.mesh.groups["dp"]
    model = build_model(cfg)  # the same seed on every rank: identical replicas
    params = [p for p in model.parameters() if p.requires_grad]
    own: dict = {}  # this rank's own gradient of each parameter, before any averaging

    arrived: list[float] = []  # when each gradient of this step was ready

    def keep_own(p):  # registered before the learner's hooks, so it runs first
        own[p] = p.grad.detach().clone()
        arrived.append(time.perf_counter())

    for p in params:
        p.register_post_accumulate_grad_hook(keep_own)
    # backward without the learner's hooks (they do not exist yet), the same batches, after one
    # untimed pass (the first backward allocates: it is slower with or without hooks)
    plain_ms = []
    for step in [0] + list(range(cfg.steps)):
        x, y = shard(global_batch(cfg, step), r, n)  # [b/N, s] x 2
        loss = model(x, y)
        t0 = time.perf_counter()
        loss.backward()
        plain_ms.append(1e3 * (time.perf_counter() - t0))
        for p in params:
            p.grad = None
    plain_ms = plain_ms[1:]
    direct = ("your code called dist.all_reduce directly: use comm.all_reduce(flat, 'dp', "
              "async_op=True), which records when each bucket was launched and finished")
    trace = _RankTrace("your BucketedGradSync", {"dist.all_reduce": direct})
    where = f"at dp={n}, rank {r}"
    with _LibraryBucketsDisabled(), trace:
        sync = cls(params, comm, int(bucket_mb * 2 ** 20))
    steps = []
    for step in range(cfg.steps):
        comm.step = step
        for p in params:
            p.grad = None
        own.clear()
        arrived.clear()
        trace.blocked.clear()
        x, y = shard(global_batch(cfg, step), r, n)  # [b/N, s] x 2
        loss = model(x, y)
        with _LibraryBucketsDisabled(), trace:  # one window: the bytes of async calls included
            trace.in_backward = True
            t_start = time.perf_counter()
            try:
                loss.backward()  # the learner's hooks run in here
            finally:
                trace.in_backward = False
            t_end = time.perf_counter()  # backward has returned
            sync.finish_gradient_sync()
            t_done = time.perf_counter()
        trace.agree()
        at = f"{where}, step {step}"
        if len(own) != len(params):
            raise AssertionError(f"{at}: backward produced {len(own)} of {len(params)} gradients")
        flat = torch.cat([own[p].reshape(-1) for p in params])  # [P]
        mean = flat.clone()
        try:
            dist.all_reduce(mean, group=group)
        except RuntimeError as e:
            _stuck_after(trace, e)
            raise
        mean /= n
        if any(p.grad is None for p in params):
            raise AssertionError(f"{at}: after finish_gradient_sync some p.grad are None: copy "
                                 f"each bucket's averaged values back into p.grad")
        got = torch.cat([p.grad.detach().reshape(-1) for p in params])
        why = _gradient_mistake(got, mean, flat, n)
        if why:
            raise AssertionError(f"{at}: after finish_gradient_sync, {why}")
        recs = [c for c in comm.records if c["op"] == "all_reduce" and c["step"] == step]
        for c in recs:
            c.setdefault("end", t_done)  # (a blocking call's end is set; an async one's by gloo)
        blocked = [(b0, b1) for _, b0, b1 in trace.blocked]
        # launch and finish relative to the end of backward, as the library's bucketed DP is
        # measured (experiments.allreduce_overlap), each with the gradients still pending then;
        # in flight while backward still ran: a gradient arrived between its launch and its
        # end, or backward returned meanwhile (a state, read from the events' order)
        rows = allreduce_overlap(recs, step, t_start, t_end, blocked)
        for i, (row, c) in enumerate(zip(rows, recs)):
            done = min(c["end"], c.get("waited_until", c["end"]))
            row.update(bucket=i, grads_pending=sum(t > c["start"] for t in arrived),
                       rank=r, step=step, finished_in_backward=row["finish_ms"] <= 0.0,
                       in_flight_in_backward=c["start"] < t_end and (
                           done > t_end or any(c["start"] < t < done for t in arrived)),
                       wire_bytes_model=c["wire_bytes_model"], payload_bytes=c["payload_bytes"],
                       **{"async": bool(c.get("async_op"))})
        steps.append({"step": step, "backward_ms": 1e3 * (t_end - t_start),
                      "plain_backward_ms": plain_ms[step],
                      "finish_ms": 1e3 * (t_done - t_end), "all_reduces": rows,
                      "blocked_in_backward": [{"call": what, "ms": 1e3 * (b1 - b0)}
                                              for what, b0, b1 in trace.blocked]})
    return {"rank": r, "steps": steps, "n_params": sum(p.numel() for p in params),
            "n_tensors": len(params), "wire": _wire_summary(trace)}


def check_bucketed_grad_sync(cls, world_sizes=BUCKETED_CHECK["world_sizes"],
                             steps: int = BUCKETED_CHECK["steps"],
                             bucket_mb: float = BUCKETED_CHECK["bucket_mb"]) -> Grade:
    """`cls(params, comm, bucket_bytes)` must average the gradients over the "dp" ranks in buckets
    while backward runs, as DDP's reducer does: gradient hooks that pack each ready gradient into
    its bucket and launch the bucket's comm.all_reduce(async_op=True) as soon as it is full, and a
    `finish_gradient_sync()` that waits for every bucket, divides by N and copies the averages
    back into p.grad.

    Checked on real ranks at each world size, the toy GPT, `steps` steps: every p.grad after
    finish_gradient_sync equals the mean over the ranks (sum instead of mean, unchanged gradients:
    named); fewer all-reduces per step than gradient tensors (buckets, not one call per tensor),
    all asynchronous, 2(N-1)/N x 4P bytes per step (counted) and no more bytes written to the
    sockets than those calls explain (measured: a collective that goes around comm is refused).
    Measured, the overlap bucketing exists for: no wait() and no blocking collective while
    backward runs (a hook that blocks is refused by name: backward stops until the bytes have
    moved), at least one all-reduce on every rank and step launched before backward returned,
    and at least one in flight while backward still ran (a gradient arrived, or backward
    returned, between its launch and its end: an order of events, not a duration). The overlap
    figure is that measurement: the share of all-reduce time inside backward's span while
    backward was not waiting; backward's duration is shown beside a backward without the hooks.
    A class whose methods are the library's (code, bytecode or source) is refused; the library's
    bucketed data parallel raises while the learner's code runs, and a deadlock stops after
    CHECK_PG_TIMEOUT seconds of waiting with what every rank waited on."""
    from ...runtime.launch import run_ranks

    _library_copy(cls, _LIBRARY_DP, "your BucketedGradSync's")
    runs = []
    for n in world_sizes:
        cfg = RunConfig(dp=n, batch=2 * n, steps=steps).validate()
        results = _on_ranks(lambda: run_ranks(_bucketed_rank, n, cfg.to_dict(), cls, bucket_mb,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _BUCKETED_STUB, f"at dp={n}")
        if isinstance(results, Grade):
            return results
        per_rank = sorted((res.value for res in results), key=lambda x: x["rank"])
        p_count = per_rank[0]["n_params"]
        predicted = theory.wire_bytes("all_reduce", 4 * p_count, n)
        for rank in per_rank:
            for row in rank["steps"]:
                at, ars = f"at dp={n}, rank {rank['rank']}, step {row['step']}", row["all_reduces"]
                if not ars:
                    raise AssertionError(f"{at}: no comm.all_reduce was recorded, yet the "
                                         f"gradients are averaged: use comm.all_reduce so the "
                                         f"checker can see when each bucket was launched")
                if row["blocked_in_backward"]:
                    first = row["blocked_in_backward"][0]
                    raise AssertionError(
                        f"{at}: a blocking call inside a hook: {first['call']} ran while "
                        f"loss.backward() was running ({len(row['blocked_in_backward'])} such "
                        f"call{'s' if len(row['blocked_in_backward']) != 1 else ''} this step), so "
                        f"backward stopped until the bytes had moved: nothing overlapped. Launch "
                        f"each bucket with comm.all_reduce(flat, 'dp', async_op=True) in the hook, "
                        f"keep the handle, and wait only in finish_gradient_sync")
                if len(ars) >= rank["n_tensors"]:
                    raise AssertionError(f"{at}: {len(ars)} all-reduces for {rank['n_tensors']} "
                                         f"gradient tensors: one call per gradient is naive mode. "
                                         f"Pack the gradients into buckets and all-reduce each "
                                         f"bucket once")
                early = [a for a in ars if a["launch_ms"] < 0]
                if not early:
                    raise AssertionError(
                        f"{at}: none of your {len(ars)} all-reduces was launched before backward "
                        f"returned (measured: the first {min(a['launch_ms'] for a in ars):+.2f} ms "
                        f"after it): all-reduces placed after backward cannot overlap it. Launch "
                        f"each bucket's all-reduce from the gradient hook, as soon as its last "
                        f"gradient has arrived, not in finish_gradient_sync")
                late_sync = [a for a in ars if not a["async"]]
                if late_sync:
                    raise AssertionError(
                        f"{at}: {len(late_sync)} all-reduce(s) ran with async_op=False after "
                        f"backward returned: every bucket is launched in the hook with "
                        f"async_op=True (its handle waited for in finish_gradient_sync)")
                sent = sum(a["wire_bytes_model"] for a in ars)
                if sent != predicted:
                    raise AssertionError(f"{at}: your all-reduces sent {sent:,} bytes (ring "
                                         f"model, counted); every gradient once is 2(N-1)/N x "
                                         f"4P = {predicted:,}: each gradient in exactly one "
                                         f"bucket, each bucket all-reduced once per step")
        rows = [a for rk in per_rank for row in rk["steps"] for a in row["all_reduces"]]
        if not any(a["in_flight_in_backward"] for a in rows):
            raise AssertionError(
                f"at dp={n}: none of your {len(rows)} all-reduces was in flight while backward "
                f"still ran (measured, on every rank and step: each completed before the next "
                f"gradient arrived, and before backward returned). An all-reduce overlaps "
                f"backward only if backward goes on computing while it moves its bytes: launch "
                f"it without waiting for it")
        wire = _wire_verdict(per_rank, f"at dp={n}", "your BucketedGradSync")
        from ..experiments import overlapped_share
        backward = [row for rk in per_rank for row in rk["steps"]]
        runs.append({"dp": n, "all_reduces_per_step": len(per_rank[0]["steps"][0]["all_reduces"]),
                     "launched_in_backward": sum(a["launch_ms"] < 0 for a in rows),
                     "finished_in_backward": sum(a["finished_in_backward"] for a in rows),
                     "overlapped_share": overlapped_share(rows),
                     "in_flight_in_backward": sum(a["in_flight_in_backward"] for a in rows),
                     "all_reduces": len(rows), "wire_bytes_per_step": predicted,
                     "backward_ms": statistics.median(b["backward_ms"] for b in backward),
                     "plain_backward_ms": statistics.median(b["plain_backward_ms"]
                                                            for b in backward),
                     "written_bytes": wire["written"], "explained_bytes": wire["explained"],
                     "buckets": rows})
    # (the message holds no timing: it is the same on every run; the figures are in the details)
    return Grade("correct", f"equal to the mean over the ranks at dp = {list(world_sizes)}, "
                 f"{runs[-1]['all_reduces_per_step']} bucket all-reduces per step, 2(N-1)/N x "
                 f"gradient bytes (counted; the bytes written to the sockets, measured, agree), "
                 f"launched during backward on every rank and step, none waited for inside a "
                 f"hook, and all-reduces in flight while backward still ran (measured); the "
                 f"library's bucketed data parallel disabled while yours ran", {"runs": runs})
