"""Live experiments on the communication primitives, shared by lesson 01 and the app's ring page.

- `primitives_demo(n)`: each collective run on n ranks; every rank's tensor before and after.
- `ring_experiment(n, numel, impl)`: a ring all-reduce (ours, or a learner's) run three ways on the
  same ranks: (1) a *probe* run on integer data whose every message says which ranks' data it
  carries and where (see comm.probe_input), decoded into animation frames of what really moved;
  (2) a correctness run against dist.all_reduce on ints (exact) and floats (fp32 rounding);
  (3) timed runs, ring vs gloo's own all-reduce, with bytes sent per rank beside 2(N-1)/N * X.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import theory
from ..comm import Comm, probe_input, ring_all_reduce
from ..config import RunConfig
from ..mesh import rank_device
from ..runtime.launch import run_ranks
from ..mesh import build_mesh


def _dp_comm(n: int) -> Comm:
    """A Comm over a pure data-parallel grid of n ranks (the primitives' lessons need no more)."""
    return Comm(build_mesh(RunConfig(dp=n, batch=n)))


# reading comm.probe_input's values back
def decode_probe(value: int, n: int) -> tuple[int, int]:
    """(position, contributor mask) of a probe value."""
    mask = value % (1 << n)
    k = bin(mask).count("1")
    return (value >> n) // max(k, 1), mask


def chunk_of(position: int, numel: int, n: int) -> int:
    """Which of torch.tensor_split's n chunks holds `position`."""
    q, rem = divmod(numel, n)
    big = rem * (q + 1)  # the first `rem` chunks hold one extra element
    return position // (q + 1) if position < big else rem + (position - big) // max(q, 1)


# ---------------------------------------------------------------------------------------------
# the primitives, before and after
# ---------------------------------------------------------------------------------------------
def _primitives_rank(n: int) -> list[dict]:
    comm, r = _dp_comm(n), dist.get_rank()
    rows = []

    def show(op, before, after, note):
        rows.append({"op": op, "rank": r, "before": before, "after": after, "note": note,
                     "wire_bytes_model": comm.records[-1]["wire_bytes_model"] if comm.records else 0})

    dev = rank_device()
    x = torch.arange(n, dtype=torch.float32, device=dev) + 10 * r  # [n]: rank r holds 10r, 10r+1, ...
    y = x.clone(); comm.all_reduce(y, "dp")
    show("all_reduce", x.tolist(), y.tolist(), "every rank gets the element-wise sum")
    y = x.clone(); comm.broadcast(y, "dp", src=0)
    show("broadcast", x.tolist(), y.tolist(), "every rank gets rank 0's tensor")
    mine = torch.tensor([float(10 * r)], device=dev)
    out = torch.empty(n, device=dev); comm.all_gather(out, mine, "dp")
    show("all_gather", mine.tolist(), out.tolist(), "every rank gets every rank's piece, in rank order")
    out = torch.empty(1, device=dev); comm.reduce_scatter(out, x.clone(), "dp")
    show("reduce_scatter", x.tolist(), out.tolist(), "rank i gets element i of the sum")
    out = torch.empty(n, device=dev); comm.all_to_all(out, x.clone(), "dp")
    show("all_to_all", x.tolist(), out.tolist(), "rank i's j-th element goes to rank j's i-th slot")
    return rows


def primitives_demo(n: int = 4) -> list[dict]:
    """One row per (collective, rank): the rank's tensor before and after, and its wire bytes."""
    return [row for res in run_ranks(_primitives_rank, n, n) for row in res.value]


# ---------------------------------------------------------------------------------------------
# the ring, watched
# ---------------------------------------------------------------------------------------------
def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ring_rank(n: int, numel: int, impl, repeats: int, timed_numel: int | None) -> dict:
    torch.manual_seed(1234 + dist.get_rank())
    r, dev = dist.get_rank(), rank_device()
    out = {"rank": r}
    # (1) probe: what moved where, carrying whose data
    comm = _dp_comm(n)
    probe = probe_input(numel, r, n).to(dev)
    impl(probe, comm)
    out["p2p_log"] = comm.p2p_log
    expected = probe_input(numel, r, n).to(dev)
    dist.all_reduce(expected)
    out["int_exact"] = bool(torch.equal(probe, expected))
    # (2) floats against the backend's all-reduce
    x = torch.randn(numel, device=dev)
    ours, ref = x.clone(), x.clone()
    fcomm = _dp_comm(n)
    impl(ours, fcomm)
    out["sent_bytes"] = sum(rec["wire_bytes_model"] for rec in fcomm.records)  # fp32: 4 bytes/element
    sends = [rec for rec in fcomm.records if rec["op"] == "send"]
    written = [rec["wire_bytes_measured"] for rec in sends]  # None where /proc/self/io is unreadable
    out["written_bytes"] = None if None in written else round(sum(written))
    out["messages"] = len(sends)
    dist.all_reduce(ref)
    out["float_max_abs_err"] = (ours - ref).abs().max().item() if numel else 0.0
    # (3) timing: ring vs the backend, same bytes
    m = timed_numel or numel
    big = torch.randn(m, device=dev)
    tcomm = _dp_comm(n)
    out["time_ring_s"] = _timed(lambda: impl(big.clone(), tcomm), repeats)
    out["time_backend_s"] = _timed(lambda: dist.all_reduce(big.clone()), repeats)
    out["step_log"] = [{k: e[k] for k in ("seq", "start", "end", "bytes")}
                       for e in tcomm.p2p_log[-2 * (n - 1):]]
    return out


def ring_frames(p2p_logs: list[list[dict]], n: int, numel: int) -> list[dict]:
    """Decode the probe run's messages into frames: at each step, the moves (src -> dst, which
    chunk, carrying which ranks' data) and the state after it (for every rank and chunk, the set of
    ranks whose data it holds, as a bitmask). Frame 0 is the start: rank r holds only its own."""
    state = [[1 << r for _ in range(n)] for r in range(n)]
    frames = [{"step": 0, "phase": "start", "moves": [], "state": [row[:] for row in state]}]
    by_step: dict[int, list[dict]] = {}
    for log in p2p_logs:
        for e in log:
            if e.get("peek") is None:
                continue
            pos, mask = decode_probe(e["peek"], n)
            by_step.setdefault(e["seq"], []).append(
                {"src": e["src"], "dst": e["dst"], "chunk": chunk_of(pos, numel, n), "mask": mask})
    for seq in sorted(by_step):
        moves = by_step[seq]
        for mv in moves:  # a received chunk is summed (reduce) or copied (gather): OR covers both
            state[mv["dst"]][mv["chunk"]] |= mv["mask"]
        frames.append({"step": seq + 1,
                       "phase": "reduce-scatter" if seq < n - 1 else "all-gather",
                       "moves": moves, "state": [row[:] for row in state]})
    return frames


def ring_experiment(n: int = 4, numel: int = 16, impl=None, repeats: int = 3,
                    timed_mb: float | None = None, timeout: float = 60.0) -> dict:
    """Run a ring all-reduce on n ranks and report what it did (see module docstring).

    `impl(x, comm)` sums x in place over the ranks of comm's "dp" axis; default: ours.
    `timed_mb`: size of the timed tensor in MB (default: the probe's size)."""
    impl = impl or ring_all_reduce
    timed_numel = int(timed_mb * 2 ** 20 / 4) if timed_mb else None
    per_rank = [res.value for res in run_ranks(_ring_rank, n, n, numel, impl, repeats,
                                              timed_numel, timeout=timeout)]
    nbytes = 4 * numel
    tbytes = 4 * (timed_numel or numel)
    t_ring = max(r["time_ring_s"] for r in per_rank)
    t_backend = max(r["time_backend_s"] for r in per_rank)
    rank0_steps = per_rank[0]["step_log"]
    t_first = rank0_steps[0]["start"] if rank0_steps else 0.0
    return {
        "world_size": n, "numel": numel, "nbytes": nbytes,
        "chunk_sizes": [c.numel() for c in torch.empty(numel).tensor_split(n)],
        "frames": ring_frames([r["p2p_log"] for r in per_rank], n, numel),
        "int_exact": all(r["int_exact"] for r in per_rank),
        "float_max_abs_err": max(r["float_max_abs_err"] for r in per_rank),
        "sent_bytes_per_rank": [r["sent_bytes"] for r in per_rank],  # counted: the sends' payloads
        # measured: what each rank's process wrote to its sockets during those sends (None: unreadable)
        "written_bytes_per_rank": [r["written_bytes"] for r in per_rank],
        "messages_per_rank": [r["messages"] for r in per_rank],
        "theory_bytes_per_rank": theory.wire_bytes("all_reduce", nbytes, n),
        "steps_measured": len(per_rank[0]["p2p_log"]),
        "steps_theory": theory.ring_steps(n),
        "timed_bytes": tbytes,
        "time_ring_s": t_ring, "time_backend_s": t_backend,
        # bus bandwidth: the bytes each rank must move, 2(N-1)/N * X, per second (NCCL's busbw)
        "busbw_ring": theory.wire_bytes("all_reduce", tbytes, n) / t_ring if t_ring else 0.0,
        "busbw_backend": theory.wire_bytes("all_reduce", tbytes, n) / t_backend if t_backend else 0.0,
        "step_times": [{"step": i + 1, "start": e["start"] - t_first,
                        "end": e["end"] - t_first, "bytes": e["bytes"]}
                       for i, e in enumerate(rank0_steps)],  # the last timed repeat's 2(N-1) steps
    }
