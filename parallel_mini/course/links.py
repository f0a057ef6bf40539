"""This machine's links, measured: latency and bandwidth between local ranks, and the alpha-beta fit.

    measure_links(world=2)        -> each op's time over message sizes (measured, gloo over loopback)
    fit_alpha_beta(result)        -> alpha (s per hop) and beta (s per byte) per op and together
    predict(op, nbytes, world, alpha_s, bandwidth_Bps) -> the alpha-beta model's time (theory)
    interconnects(op, nbytes, world, fit=None) -> the same op on the source material's links

The alpha-beta model: a ring collective over N ranks makes a(op, N) steps one after the other,
each paying the link's latency alpha, and pushes b(op, N) x bytes through each rank's link at
beta seconds per byte (1 / bandwidth):

    t = a(op, N) * alpha + b(op, N) * bytes * beta

with the ring algorithm's counts (HOPS): p2p 1 and 1 (one ring step: every rank sends `bytes` to
its right neighbour while receiving as many from its left); all-reduce 2(N-1) and 2(N-1)/N;
all-gather and reduce-scatter N-1 and (N-1)/N of the full tensor; all-to-all N-1 and (N-1)/N.
alpha and beta belong to the link, not to the op: fitted per op they should agree, and where they
do not, the model (or the algorithm gloo really runs) is what the measurement contradicts.
"""
from __future__ import annotations

import math
import os
import statistics
import time

from .. import theory

OPS = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MiB = 2 ** 20
GiB = 2 ** 30
# powers of 4 from 4 B to 64 MiB
DEFAULT_SIZES = [4 ** k for k in range(1, 14)]

# What `bytes` is, per op (the per-rank buffer the op is called with):
PAYLOAD = {
    "p2p": "the buffer each rank sends to its right neighbour (and receives from its left) in one "
           "ring step",
    "all_reduce": "the tensor each rank holds and reduces",
    "all_gather": "the full (gathered) output tensor; each rank contributes bytes/N",
    "reduce_scatter": "the full input tensor; each rank keeps bytes/N of the sum",
    "all_to_all": "each rank's input tensor; bytes/N go to each rank",
}

# The source material's interconnect table: bandwidth per direction (theory.INTERCONNECTS, where
# it lists the link) and the figure as the source states it (vendor figures, from the source
# material). RoCE is not in theory.INTERCONNECTS (adding it there would add a line to lesson 04's
# checked output): its "up to 400 Gb/s" is 50 GB/s per direction.
SOURCE_LINKS = {
    "PCIe Gen5 x16": (theory.INTERCONNECTS["PCIe Gen5 x16"], "64 GB/s per direction"),
    "NVLink 4 (H100)": (theory.INTERCONNECTS["NVLink 4 (H100)"], "900 GB/s bidirectional"),
    "NVLink 5 (B200)": (theory.INTERCONNECTS["NVLink 5 (B200)"], "1.8 TB/s bidirectional"),
    "InfiniBand NDR": (theory.INTERCONNECTS["InfiniBand NDR"], "400 Gb/s (50 GB/s) per port"),
    "InfiniBand XDR": (theory.INTERCONNECTS["InfiniBand XDR"], "800 Gb/s (100 GB/s) per port"),
    "RoCE 400G": (400e9 / 8, "up to 400 Gb/s"),
}

# Latency per hop. The source material gives bandwidths only: these are typical orders of
# magnitude (NCCL's per-step latency on NVLink ~1-2 us, a PCIe hop ~2 us, an InfiniBand or RoCE hop
# through one switch ~2-5 us), assumed: neither measured nor from the source material.
LINK_LATENCY_S = {
    "PCIe Gen5 x16": 2e-6,
    "NVLink 4 (H100)": 1e-6,
    "NVLink 5 (B200)": 1e-6,
    "InfiniBand NDR": 3e-6,
    "InfiniBand XDR": 3e-6,
    "RoCE 400G": 5e-6,
}


def hops(op: str, world: int) -> tuple[float, float]:
    """(a, b) of the ring algorithm: a latency terms, b x bytes through each rank's link."""
    n = world
    if op == "p2p":
        return 1.0, 1.0
    if n <= 1:
        return 0.0, 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    raise ValueError(f"op={op!r}: one of {', '.join(OPS)}")


def predict(op: str, nbytes: float, world: int, alpha_s: float, bandwidth_Bps: float) -> float:
    """The alpha-beta model's seconds for `op` on `nbytes` (PAYLOAD[op]) over `world` ranks in a
    ring whose links have latency alpha_s and bandwidth bandwidth_Bps (theory)."""
    a, b = hops(op, world)
    return a * alpha_s + b * nbytes / bandwidth_Bps


# ---------------------------------------------------------------------------------------------
# measuring (one process per rank, gloo over loopback)
# ---------------------------------------------------------------------------------------------
def _links_rank(op: str, sizes: list[int], repeats: int, group_size: int = 0) -> list[dict]:
    """`group_size` (0: the world): the ranks split into consecutive groups of that many, every
    group calling the op at once among its own ranks (as a layout's tp or cp groups do)."""
    import torch
    import torch.distributed as dist

    from ..comm import _all_gather, _reduce_scatter  # torch 2.13 renamed them; imported here, not
    # at the top: importing this module must not import torch (the CLI refuses bad input without it)

    torch.set_num_threads(1)
    world, me = dist.get_world_size(), dist.get_rank()
    n = group_size or world
    groups = [dist.new_group(list(range(g, g + n))) if n < world else None
              for g in range(0, world, n)]  # new_group is collective: every rank makes every one
    group, base, r = groups[me // n], me // n * n, me % n
    right, left = base + (r + 1) % n, base + (r - 1) % n  # global ranks, for point-to-point
    rows = []
    for size in sizes:
        numel = max(n, size // 4 // n * n)  # fp32, a multiple of the group's size
        full = torch.ones(numel)
        part = torch.ones(numel // n)
        recv = torch.empty(numel)

        def p2p():
            ops = [dist.P2POp(dist.isend, full, right, group), dist.P2POp(dist.irecv, recv, left, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        calls = {"p2p": p2p,
                 "all_reduce": lambda: dist.all_reduce(full, group=group),
                 "all_gather": lambda: _all_gather(recv, part, group=group),
                 "reduce_scatter": lambda: _reduce_scatter(part, full, group=group),
                 "all_to_all": lambda: dist.all_to_all_single(recv, full, group=group)}
        call = calls[op]
        times, cpus = [], []
        for i in range(repeats + 1):  # the first warms the connections and buffers up
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            call()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if i:
                times.append(dt)
                cpus.append(dc)
        # a call ends for its group when the group's slowest rank is done: max over the group's
        # ranks, per repeat; with several groups, the mean over the groups of that
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(slowest)
        slowest /= world
        # every thread of every rank (gloo's own included), summed over ranks, per repeat
        cpu = torch.tensor(cpus, dtype=torch.float64)
        dist.all_reduce(cpu)
        seconds = slowest.tolist()
        rows.append({"op": op, "bytes": numel * 4, "seconds": seconds,
                     "median_s": statistics.median(seconds), "min_s": min(seconds),
                     "cpu_all_ranks_s": statistics.median(cpu.tolist())})
    return rows


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure_links(world: int = 2, sizes: list[int] | None = None, ops=OPS, repeats: int = 5,
                  progress=None, timeout: float = 600.0, group: int = 0) -> dict:
    """Time each op of `ops` on each message size over `world` local gloo ranks (measured).

    `bytes` is PAYLOAD[op] (fp32, rounded down to a multiple of 4 x world; at least world
    elements): for all-gather and reduce-scatter the full tensor, as HOPS counts it. Per op and
    size: one unmeasured call, then `repeats` calls, each after a barrier; a repeat's time is the
    slowest rank's of the group (max over the group's ranks; in groups, the mean over the groups
    of that), the row's median_s the median over repeats. One launch of
    `world` ranks per op; `progress(row)` is called for each row as its op finishes. `group` (a
    divisor of world; 0: world): the op runs in world / group groups of that many ranks at once,
    each on its own (the world's ranks still share the cores), and `bytes` and the hop counts are
    the group's; "group" in the result.
    Returns {"world", "cores", "load_before", "load_after", "payload", "rows": [{"op", "bytes",
    "seconds", "median_s", "min_s", "cpu_all_ranks_s"}]}; JSON-able. cpu_all_ranks_s: the CPU
    time every thread of every rank spent from the call's start to its return (gloo's own
    threads included), summed over the ranks, median over repeats: over the cores, the least
    wall time the call can take when the ranks share them. (On a shared machine a repeat that lost its core
    takes a scheduler quantum, milliseconds, instead of ~0.1 ms: min_s, the fastest repeat, is
    the time with the cores free; median_s what a call takes under the load that was there.)"""
    from ..runtime.launch import run_ranks

    sizes = list(DEFAULT_SIZES if sizes is None else sizes)
    group = group or world
    if world % group:
        raise ValueError(f"group={group}: a divisor of world={world}")
    for op in ops:
        hops(op, 2)  # a bad name fails here, before any rank starts
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for op in ops:
        got = run_ranks(_links_rank, world, op, sizes, repeats, group, timeout=timeout,
                        backend="gloo")[0].value
        for row in got:
            rows.append(row)
            if progress:
                progress(row)
    return {"world": world, "group": group, "cores": _cores(), "load_before": load_before,
            "load_after": [round(x, 2) for x in os.getloadavg()],
            "payload": {op: PAYLOAD[op] for op in ops}, "rows": rows}


# ---------------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------------
def fit_relative(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """alpha, beta >= 0 minimising sum(((a*alpha + bx*beta) / t - 1)^2) over (a, bx, t): least
    squares in relative error (each row divided by its measured t), so a 4-byte message weighs as
    much as a 64 MiB one. Where the unconstrained optimum has a negative coordinate, the best
    fit with that coordinate at 0."""
    rows = [(a / t, bx / t) for a, bx, t in points if t > 0]
    s11 = sum(u * u for u, _ in rows)
    s12 = sum(u * v for u, v in rows)
    s22 = sum(v * v for _, v in rows)
    y1 = sum(u for u, _ in rows)
    y2 = sum(v for _, v in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-300):
        alpha, beta = (y1 * s22 - y2 * s12) / det, (y2 * s11 - y1 * s12) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    # one coordinate at zero: the better of the two one-parameter fits
    cands = []
    if s11 > 0:
        cands.append((y1 / s11, 0.0))
    if s22 > 0:
        cands.append((0.0, y2 / s22))
    return min(cands, key=lambda ab: sum((u * ab[0] + v * ab[1] - 1) ** 2 for u, v in rows))


def _fitted(points, hop_counts) -> dict:
    alpha, beta = fit_relative(points)
    errs = [abs(a * alpha + bx * beta - t) / t for a, bx, t in points]
    return {"alpha_s": alpha, "beta_s_per_byte": beta,
            "bandwidth_Bps": (1.0 / beta) if beta > 0 else math.inf,
            "max_rel_err": max(errs), "points": len(points), **hop_counts}


def fit_alpha_beta(result: dict, hop_counts=None, stat: str = "median_s") -> dict:
    """Fit the alpha-beta model to measure_links' rows, per op and over all ops together.

    alpha (seconds per hop) and beta (seconds per byte; bandwidth_Bps = 1/beta) are of the link,
    so every op fitted alone should give about the same pair: the ops agreeing is the check of
    the model (and of HOPS, the ring algorithm's counts); the "all" entry fits one pair to every
    row. The fit minimises the squared relative error (each row weighted by 1/measured time), so
    the small sizes that fix alpha count as much as the large ones that fix beta; max_rel_err is
    the worst |predicted - measured| / measured over the rows fitted. `hop_counts(op, world)`
    replaces HOPS (for a test that a wrong count shows); `stat`: which time of a row is fitted
    ("median_s", or "min_s": the fastest repeat). Returns {op: {"alpha_s",
    "beta_s_per_byte", "bandwidth_Bps", "max_rel_err", "points", "a", "b"}, "all": {...}}."""
    count = hop_counts or hops
    n = result.get("group") or result["world"]  # the ranks one call spans
    by_op: dict[str, list] = {}
    for row in result["rows"]:
        a, b = count(row["op"], n)
        by_op.setdefault(row["op"], []).append((a, b * row["bytes"], row[stat]))
    out = {}
    for op, points in by_op.items():
        a, b = count(op, n)
        out[op] = _fitted(points, {"a": a, "b": b})
    out["all"] = _fitted([p for pts in by_op.values() for p in pts], {"a": None, "b": None})
    return out


def fit_table(fits: dict) -> tuple:
    """{world: fit_alpha_beta(...)} or {(world, group): fit_alpha_beta(...)} as flat rows (world,
    group, op, alpha_s, beta_s_per_byte), sorted: the form a Hardware profile keeps (hashable,
    JSON-able). `op` is one of OPS or "all"; a world alone is its own group."""
    def key(k):
        w, g = k if isinstance(k, tuple) else (k, k)
        return int(w), int(g)
    return tuple(sorted((*key(k), op, f["alpha_s"], f["beta_s_per_byte"])
                        for k, fit in fits.items() for op, f in fit.items()))


def nearest_world(worlds, world: int) -> int:
    """The measured world that stands for `world` ranks: itself when measured, else the nearest in
    ratio (2 and 8 measured: 4 takes 8, the tie going to the larger, where more ranks share the
    cores), else None when nothing was measured."""
    worlds = sorted(set(worlds))
    if not worlds:
        return None
    return min(worlds, key=lambda w: (abs(math.log(w / world)), -w))


def table_rows(table) -> list[tuple]:
    """fit_table's rows, each (world, group, op, alpha_s, beta_s_per_byte); a row of 4, from a
    profile written before groups were measured (world, op, alpha, beta), has the world as group."""
    return [tuple(r) if len(r) == 5 else (r[0], r[0], *r[1:]) for r in table]


def link_at(table: tuple, op: str, world: int, group: int = 0) -> tuple | None:
    """(alpha_s, beta_s_per_byte, world, group they were fitted at) for `op` in groups of `group`
    ranks (0: the world) among `world` ranks, from fit_table's rows: the measured world nearest
    `world` (nearest_world), in it the measured group nearest `group`; the op's own fit, or the
    "all" fit where the op was not fitted there. None when the table is empty."""
    rows = table_rows(table)
    w = nearest_world({r[0] for r in rows}, world)
    if w is None:
        return None
    g = nearest_world({r[1] for r in rows if r[0] == w}, min(group or world, w))
    at = {r[2]: r for r in rows if r[:2] == (w, g)}
    row = at.get(op) or at["all"]
    return row[3], row[4], w, g


# ---------------------------------------------------------------------------------------------
# the source material's links beside this machine's
# ---------------------------------------------------------------------------------------------
def interconnects(op: str = "all_reduce", nbytes: float = GiB, world: int = 8,
                  fit: dict | None = None) -> list[dict]:
    """`op` on `nbytes` over `world` ranks on each link of the source material's table
    (SOURCE_LINKS: bandwidth per direction, vendor figures, from the source material; latency
    LINK_LATENCY_S, assumed) and, with `fit` (fit_alpha_beta's "all" entry or one op's), on this
    machine's fitted link. Every time is the alpha-beta model's (theory); the fitted row's alpha
    and bandwidth were fitted to times measured here."""
    rows = [{"link": link, "bandwidth_Bps": bw, "stated": stated, "latency_s": LINK_LATENCY_S[link],
             "seconds": predict(op, nbytes, world, LINK_LATENCY_S[link], bw),
             "source": "vendor figures, from the source material; latency assumed"}
            for link, (bw, stated) in SOURCE_LINKS.items()]
    if fit is not None:
        rows.append({"link": "this machine (fitted)", "bandwidth_Bps": fit["bandwidth_Bps"],
                     "stated": "fitted", "latency_s": fit["alpha_s"],
                     "seconds": predict(op, nbytes, world, fit["alpha_s"], fit["bandwidth_Bps"]),
                     "source": "alpha and beta fitted to times measured here (measure_links)"})
    return rows
