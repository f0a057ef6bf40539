"""Lesson 01 (01_collectives): the ring all-reduce, `check_ring_all_reduce`.

The learner's `ring_all_reduce(x, comm)` runs on real ranks on integers whose every value says
whose data it holds: its result against dist.all_reduce, and each comm.sendrecv call's chunks read
from the tensors' offsets in x, so a wrong index, a missing all-gather or a chunk added twice is
named. The library's ring and the backend's collectives raise meanwhile.
"""
from __future__ import annotations

from ... import theory
from .core import (CHECK_PG_TIMEOUT, CHECK_RUN_TIMEOUT, _CodeSwapped, Grade, _RankTrace,
                   _library_copy, _on_ranks, _stuck_after, _wire_summary, _wire_verdict)


_RING_STUB = ("ring_all_reduce still raises NotImplementedError: fill in the two phases, then run "
              "this cell again.")


def _library_ring_refused(x, comm, axis="dp"):
    """Swapped in for the code of comm.ring_all_reduce while a learner's ring runs (a literal
    message: the code object runs with the library module's globals)."""
    raise AssertionError("your ring called the library's own ring_all_reduce (parallel_mini.comm."
                         "ring_all_reduce), which the checker disables while your code runs: "
                         "write the two phases yourself, with comm.sendrecv")


class _LibraryRingDisabled(_CodeSwapped):
    """comm.ring_all_reduce raises while active."""

    def swaps(self):
        from ... import comm
        return [(comm.ring_all_reduce, _library_ring_refused)]


def _ring_refusals() -> dict:
    """The backend's collectives, refused while the learner's ring runs: an all-reduce built on
    one is no ring."""
    out = {}
    for where in ("comm", "dist"):
        for op in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                   "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast",
                   "all_to_all", "all_to_all_single"):
            out[f"{where}.{op}"] = (f"your ring called {where}.{op}, one of the backend's own "
                                    f"collectives, which the checker refuses while your code runs: "
                                    f"build the all-reduce from comm.sendrecv alone")
    return out


def _ring_check_rank(n: int, numel: int, fn) -> dict:
    """One rank of the ring check: the learner's ring on the probe input (integers whose every
    value says whose data it holds, comm.probe_input), the library's ring and the backend's
    collectives disabled. Logs, per comm.sendrecv call, which chunk of x was sent and which chunk
    the receive went into (None: a buffer outside x), read from the tensors' offsets in x."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..collectives import _dp_comm
    from ...comm import Comm, probe_input

    comm, r = _dp_comm(n), dist.get_rank()
    x = probe_input(numel, r, n)  # [numel] int64
    starts = [0]
    for c in x.tensor_split(n):
        starts.append(starts[-1] + c.numel())
    base, size = x.data_ptr(), x.element_size()
    calls = []

    def chunk_at(t):
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != base or not numel:
            return None
        pos = (t.data_ptr() - base) // size
        return max(i for i in range(n) if starts[i] <= pos) if 0 <= pos < numel else None

    store = dist.distributed_c10d._get_default_store()
    sent_to, received_from = [0] * n, [0] * n

    def sendrecv(send, dst, recv, src, axis, **log):
        """Before the real call, each message's size and chunk go through the rendezvous store,
        so that a send and a receive of different sizes (which gloo answers by aborting the
        process) are named here, with the chunk indices that caused them."""
        call = {"send": chunk_at(send), "recv": chunk_at(recv), "dst": dst, "src": src}
        calls.append(call)
        s = len(calls) - 1
        if isinstance(dst, int) and 0 <= dst < n and isinstance(src, int) and 0 <= src < n:
            store.set(f"pm_ring/{r}>{dst}/{sent_to[dst]}",
                      json.dumps({**call, "numel": send.numel(), "call": s}))
            key = f"pm_ring/{src}>{r}/{received_from[src]}"
            sent_to[dst] += 1
            received_from[src] += 1
            try:
                store.wait([key], timedelta(seconds=2))
            except Exception:  # noqa: BLE001 - never sent: the real call will say deadlock
                pass
            else:
                peer = json.loads(store.get(key))
                if peer["numel"] != recv.numel():
                    why = (_ring_call_problem(n, src, peer["call"], peer)
                           or _ring_call_problem(n, r, s, call))
                    raise AssertionError(
                        f"at N={n}, numel={numel}, " + (why or (
                            f"call {s} of rank {r}: rank {src} sends {peer['numel']} elements to "
                            f"rank {r}, which receives into a tensor of {recv.numel()}: a send "
                            f"and its receive must have the same size (the chunks differ by one "
                            f"element when N does not divide the size: slice the buffer, "
                            f"incoming[:chunks[i].numel()])")))
        return Comm.sendrecv(comm, send, dst, recv, src, axis, **log)

    comm.sendrecv = sendrecv
    trace = _RankTrace("your ring_all_reduce", _ring_refusals())
    try:
        with _LibraryRingDisabled(), trace:
            returned = fn(x, comm)
    except RuntimeError as e:
        if "can't be cast to the desired output type" in str(e):
            raise AssertionError(
                f"at N={n}: your ring divides (x / N, or x /= N): an all-reduce returns the "
                f"*sum* over the ranks, not the mean (averaging is the caller's business, as "
                f"lesson 02's gradients will show). The checker runs your ring on integers, "
                f"where a division fails with torch's '{str(e).strip()}'") from None
        raise
    trace.agree()
    expected = probe_input(numel, r, n)
    try:
        dist.all_reduce(expected)
    except RuntimeError as e:
        _stuck_after(trace, e)
        raise
    returned_sum = (isinstance(returned, torch.Tensor) and returned is not x
                    and returned.shape == x.shape and torch.equal(returned.to(x.dtype), expected))
    return {"rank": r, "calls": calls, "final": x.tolist(), "expected": expected.tolist(),
            "returned_sum": returned_sum, "starts": starts,
            "sent_bytes": sum(rec["wire_bytes_model"] for rec in comm.records if rec["op"] == "send"),
            "wire": _wire_summary(trace)}


def _ring_call_problem(n: int, r: int, s: int, call: dict) -> str | None:
    """What is wrong with rank r's call s (counting from 0) of comm.sendrecv, against the ring of
    the lesson: reduce-scatter step k sends chunk (r - k) mod N to the right and receives chunk
    (r - k - 1) mod N from the left; all-gather step k sends (r + 1 - k) mod N and receives
    (r - k) mod N. None if nothing."""
    phase, k = ("reduce-scatter", s) if s < n - 1 else ("all-gather", s - (n - 1))
    send_i = (r - k) % n if phase == "reduce-scatter" else (r + 1 - k) % n
    recv_i = (r - k - 1) % n if phase == "reduce-scatter" else (r - k) % n
    step = f"{phase} step {k} (counting from 0), rank {r}"
    if s >= theory.ring_steps(n):
        return None
    if call["dst"] != (r + 1) % n or call["src"] != (r - 1) % n:
        return (f"{step} sent to rank {call['dst']} and received from rank {call['src']}: on the "
                f"ring every step sends to the right neighbour (r+1) mod N = {(r + 1) % n} and "
                f"receives from the left (r-1) mod N = {(r - 1) % n}")
    if call["send"] != send_i:
        what = ("a tensor that is not a chunk of x" if call["send"] is None
                else f"chunk {call['send']}")
        rule = ("(r - s) mod N: its own chunk r at step 0, then the chunk it has just added to"
                if phase == "reduce-scatter" else
                "(r + 1 - s) mod N: at step 0 the chunk it completed in the reduce-scatter, "
                "(r+1) mod N, then the chunk it has just received")
        return f"{step} sent {what}; it should send chunk {send_i} = {rule}"
    if phase == "all-gather" and call["recv"] not in (None, recv_i):
        return (f"{step} received into chunk {call['recv']}; in all-gather step s rank r "
                f"receives chunk (r - s) mod N = {recv_i}, the one its left neighbour sends")
    return None


def _ring_diagnosis(n: int, numel: int, per_rank: list[dict]) -> str | None:
    """None if every rank ended with dist.all_reduce's result in 2(N-1) sendrecv calls sending
    2(N-1) X bytes in all; else what went wrong, the usual mistakes named."""
    at, want = f"at N={n}, numel={numel}", theory.ring_steps(n)
    steps = [len(p["calls"]) for p in per_rank]
    exact = all(p["final"] == p["expected"] for p in per_rank)
    if exact and steps == [want] * n:
        total, x_bytes = sum(p["sent_bytes"] for p in per_rank), 8 * numel
        if total != want * x_bytes:
            return (f"{at} the ranks sent {total} bytes in all; the ring sends 2(N-1)*X = "
                    f"{want * x_bytes} (X = {x_bytes} bytes of int64): send one chunk per step, "
                    f"chunks[i], not the whole tensor")
        return None
    if all(p["returned_sum"] for p in per_rank):
        return (f"{at} your function returned the sum but left x unchanged: sum in place. The "
                f"chunks are views of x, so `chunks[i] += buf` writes x, while `chunks[i] = "
                f"chunks[i] + buf` or a new tensor does not")
    if any(s == 0 for s in steps):
        r = steps.index(0)
        return (f"{at} rank {r} made no comm.sendrecv call: move every chunk with "
                f"comm.sendrecv(send, dst, recv, src, 'dp') (dist.send / dist.recv are not "
                f"recorded, so nothing can be checked)")
    if exact:
        return (f"{at} the result is right, but the ranks made {steps} comm.sendrecv calls; the "
                f"ring makes 2(N-1) = {want} on every rank, each moving one chunk of X/N (so that "
                f"no link carries more than 2(N-1)/N X)")
    if steps == [n - 1] * n:
        return (f"{at} each rank made N-1 = {n - 1} comm.sendrecv calls: that is the "
                f"reduce-scatter alone, and the all-gather is missing. After it rank r holds only "
                f"chunk (r+1) mod N complete; the all-gather's N-1 more steps pass the complete "
                f"chunks once around the ring, copied, not added")
    if steps != [want] * n:
        return (f"{at} the ranks made {steps} comm.sendrecv calls; a ring all-reduce needs "
                f"2(N-1) = {want} on every rank, N-1 = {n - 1} per phase (use comm.sendrecv for "
                f"every move so the run can be watched)")
    # the right number of steps, a wrong result: which chunk moved where
    for s in range(want):
        for p in per_rank:
            why = _ring_call_problem(n, p["rank"], s, p["calls"][s])
            if why:
                return f"{at}, {why}"
    for p in per_rank:
        bad = [i for i, (a, b) in enumerate(zip(p["final"], p["expected"])) if a != b]
        if not bad:
            continue
        i, r = bad[0], p["rank"]
        chunk = max(c for c in range(n) if p["starts"][c] <= i)
        ag = p["calls"][n - 1:]
        if any(a > b for a, b in zip(p["final"], p["expected"])):
            return (f"{at}, rank {r}: some elements hold more than the sum over the ranks (element "
                    f"{i}: {p['final'][i]}, dist.all_reduce {p['expected'][i]}): a chunk was added "
                    f"twice, most likely in the all-gather. A chunk received in the all-gather is "
                    f"already complete: copy it (receive straight into chunks[(r - s) % N]), do "
                    f"not add it")
        if ag and all(c["recv"] is None for c in ag):
            return (f"{at}, rank {r}: chunk {chunk} never received the complete sum (element {i}: "
                    f"{p['final'][i]}, dist.all_reduce {p['expected'][i]}): the all-gather "
                    f"received into a buffer that was never copied into x. Receive straight into "
                    f"chunks[(r - s) % N] (a view of x)")
        return (f"{at}, rank {r}: element {i} (chunk {chunk}) is {p['final'][i]}, "
                f"dist.all_reduce gives {p['expected'][i]}: in reduce-scatter step s rank r adds "
                f"the chunk (r - s - 1) mod N arriving from the left into its own; the all-gather "
                f"copies complete chunks")
    return None


def check_ring_all_reduce(fn, cases=((2, 5), (3, 10), (4, 16), (4, 17))) -> Grade:
    """`fn(x, comm)` must sum x in place over comm's "dp" ranks using only comm.sendrecv.

    Checked on real ranks at each (world size, numel) in `cases`, sizes not divisible by N
    included, on comm.probe_input's integers: the result equals dist.all_reduce exactly; each
    rank makes 2(N-1) sendrecv calls, to its right neighbour and from its left; all ranks together
    send 2(N-1) * X bytes (each step moves every chunk once). Which chunk each call sent and
    received into is read from the tensors' offsets in x, so a wrong index is named, as are a
    missing all-gather, a chunk added twice and a division by N. Throughout, the library's own
    ring_all_reduce and the backend's collectives raise while the learner's code runs: an answer
    calling them is refused, saying so. A deadlock stops after CHECK_PG_TIMEOUT seconds of
    waiting with what every rank waited on. Measured: the bytes each rank wrote to its sockets
    while the learner's ring ran, against what its recorded sendrecv calls explain (gloo's
    headers included), so a transfer around comm (the process group behind it called directly,
    beside decoy sendrecv calls) is refused; so is a function that is the library's ring (its
    code object, bytecode or source)."""
    from ...runtime.launch import run_ranks

    _library_copy(fn, ("comm", "course.collectives", "course.grading.lesson01_ring"), "your")
    runs = []
    for n, numel in cases:
        results = _on_ranks(lambda: run_ranks(_ring_check_rank, n, n, numel, fn,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _RING_STUB, f"at N={n}, numel={numel}")
        if isinstance(results, Grade):
            return results
        per_rank = sorted((res.value for res in results), key=lambda p: p["rank"])
        why = _ring_diagnosis(n, numel, per_rank)
        if why:
            raise AssertionError(why)
        wire = _wire_verdict(per_rank, f"at N={n}, numel={numel}", "your ring_all_reduce")
        runs.append({"world_size": n, "numel": numel, "written_bytes": wire["written"],
                     "explained_bytes": wire["explained"],
                     "sent_bytes_per_rank": [p["sent_bytes"] for p in per_rank],
                     "steps_per_rank": [len(p["calls"]) for p in per_rank]})
    return Grade("correct", f"equal to dist.all_reduce at N,numel = {list(cases)}, in 2(N-1) "
                 f"steps, sending 2(N-1)/N*X per rank on average (counted), and no bytes written "
                 f"to the sockets beyond those steps' (measured); the library's ring and the "
                 f"backend's collectives disabled while yours ran", {"runs": runs})
