"""Exercise graders: run the learner's function on real ranks and compare it with the library's.

Each `check_*` returns a Grade. A stub that still raises NotImplementedError is "not attempted"
(shown, not raised, so the learner's notebook runs top to bottom); a wrong answer raises an
AssertionError that says what was observed; a right one returns the measured run so the lesson can
draw the learner's own result (e.g. animate their ring).

While the learner's code runs, the library's own implementation of the same thing is disabled (its
functions' code swapped for a raiser that says so), so an answer that calls it is refused. The
ranks of a check wait at most CHECK_PG_TIMEOUT seconds for each other: a _RankTrace records each
rank's calls in the learner's code (or, where the learner's function runs inside the library's
code, as lessons 06 and 07's merge and route do, in that code and whether the rank was in the
learner's function), so a deadlock is reported as who waited in which call, not as gloo's text.
`compare_prediction` prints a lesson's prediction cell against what the live cell got.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from .. import theory
from ..config import RunConfig
from ..launch import RankError, RunTimeout


@dataclass
class Grade:
    status: str  # "not attempted" | "correct"
    message: str
    details: dict = field(default_factory=dict, repr=False)

    def __str__(self):
        return f"[{self.status}] {self.message}"

    def _repr_html_(self):
        colour = {"correct": "#1b7f3b", "not attempted": "#8a6d00"}.get(self.status, "#b00020")
        return (f'<div style="border-left:4px solid {colour};padding:4px 8px">'
                f'<b>{html.escape(self.status)}</b>: {html.escape(self.message)}</div>')


def _not_attempted(err: RankError) -> bool:
    return "NotImplementedError" in err.details


def _last_line(err: RankError) -> str:
    lines = [ln for ln in err.details.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else str(err)


def _on_ranks(run, stub_message: str, where: str):
    """Run the learner's code (`run()` launches the ranks). A stub still raising
    NotImplementedError gives a "not attempted" Grade, returned instead of the result; any other
    failure becomes an AssertionError saying where, with the failing rank's last line (an
    AssertionError raised by a rank's own check is passed on as is)."""
    try:
        return run()
    except RankError as err:
        if _not_attempted(err):
            return Grade("not attempted", stub_message)
        line = _last_line(err)
        if line.startswith("AssertionError: "):
            raise AssertionError(line.removeprefix("AssertionError: ")) from None
        if isinstance(err, RunTimeout):
            raise AssertionError(f"{where}: ranks did not finish within the checker's time (a "
                                 f"loop that never ends, or a deadlock): {line}") from None
        if any(s in line for s in _STUCK):  # gloo gave up waiting outside a traced region
            raise AssertionError(f"{where}: rank {err.rank} stopped waiting for a peer after "
                                 f"{CHECK_PG_TIMEOUT:g} s (a deadlock, or a peer that failed): "
                                 f"every rank must make the same calls in the same order")
        raise AssertionError(f"{where} rank {err.rank} failed: {line}") from None


# ---------------------------------------------------------------------------------------------
# the learner's code on a rank: traced, the library's own version disabled, deadlocks explained
# ---------------------------------------------------------------------------------------------
# A check's collectives are tiny: one that waits longer than this is a deadlock. Short, so that a
# deadlocked check cell stops within 10 s (launch + this wait + the message), with a hint.
CHECK_PG_TIMEOUT = 5.0
CHECK_RUN_TIMEOUT = 60.0  # the launcher's backstop (a Python loop that never ends)
_STUCK = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
          "Connect timeout", "timed out", "Timeout")
_COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv",
             "isend", "irecv", "recv")
_DIST_OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
             "all_to_all_single", "send", "recv", "batch_isend_irecv", "barrier")


def _describe(where: str, name: str, args, kwargs) -> str:
    """One op as the learner wrote it, e.g. "comm.sendrecv(send to rank 1, receive from rank 3)"."""
    def arg(i, key):
        return kwargs.get(key, args[i] if len(args) > i else None)

    if where == "comm" and name == "sendrecv":
        return f"comm.sendrecv(send to rank {arg(1, 'dst')}, receive from rank {arg(3, 'src')})"
    if where == "comm" and name in ("isend", "irecv", "recv"):
        peer = arg(1, "dst" if name == "isend" else "src")
        return f"comm.{name}({'to' if name == 'isend' else 'from'} rank {peer})"
    if where == "handle":
        rec = args[0].record if args and hasattr(args[0], "record") else {}
        return (f"the wait() of an async comm.{rec.get('op', 'op')}"
                + (f" (bucket {rec['bucket']})" if "bucket" in rec else ""))
    if where == "comm" and name == "all_to_all" and kwargs.get("layer") == "moe":
        # expert parallel's exchanges (parallel/expert.py): rows to and from each rank
        ins, outs = arg(4, "in_splits"), arg(3, "out_splits")
        rows = f": sending {ins} rows, receiving {outs}" if ins is not None else ""
        return (f"comm.all_to_all(over '{arg(2, 'axis')}', MoE layer {kwargs.get('block')} "
                f"{kwargs.get('phase', '')}"
                f"{' (backward)' if kwargs.get('pass') == 'backward' else ''}{rows})")
    if where == "comm":
        return f"comm.{name}(over '{arg(1 if name in ('all_reduce', 'broadcast') else 2, 'axis')}')"
    if name in ("send", "recv"):
        return f"dist.{name}({'to' if name == 'send' else 'from'} rank {arg(1, 'dst' if name == 'send' else 'src')})"
    return f"dist.{name}"


class _RankTrace:
    """On a rank, while a learner's function runs: every recorded collective and send/receive it
    enters (through `comm` or torch.distributed directly; the outermost call only) is counted, and
    this rank's state (its last op, whether it is still waiting in it, whether the function
    returned) is written to the run's rendezvous store, where a rank that gives up waiting reads
    every rank's state to say who waited on what. `refuse` maps an op name ("dist.all_reduce") to
    a message: such a call raises AssertionError instead of running."""

    def __init__(self, label: str, refuse: dict | None = None):
        import torch.distributed as dist
        self.dist, self.label, self.refuse = dist, label, refuse or {}
        self.rank = dist.get_rank()
        self.calls, self.last, self.waiting, self.done, self.depth = 0, None, False, False, 0
        self.failed = None  # the AssertionError this rank raised (a peer reports it)
        self.timed_out = True
        self.round = 0  # how many times the learner's function was entered
        self.history: list[int] = []  # the count of calls when each round returned
        self.store = dist.distributed_c10d._get_default_store()
        # when the library's code runs with a learner's function inside it (lessons 06, 07):
        # the function running now ("your merge"), and how often each was entered on this rank
        self.inside, self.entered = None, {}

    def publish(self) -> None:
        import json
        state = {"calls": self.calls, "last": self.last, "waiting": self.waiting,
                 "done": self.done, "failed": self.failed, "round": self.round,
                 "history": self.history, "inside": self.inside,
                 "entered": self.entered.get(self.inside, 0)}
        self.store.set(f"pm_check/{self.rank}", json.dumps(state))

    def learners(self, fn, name: str, where: str):
        """`fn` (the learner's function, called by the library's code on this rank) as `name`
        ("your merge"): while it runs, peers that give up waiting say this rank was in it; a call
        to a collective from inside it is refused (it gets this rank's tensors only, and a
        collective only some ranks make waits forever); an exception it raises becomes an
        AssertionError saying where."""
        def run(*args, **kwargs):
            self.entered[name] = self.entered.get(name, 0) + 1
            self.inside = name
            self.publish()
            try:
                return fn(*args, **kwargs)
            except (AssertionError, NotImplementedError):
                raise
            except Exception as e:  # noqa: BLE001 - the learner's code: say what it raised
                raise AssertionError(f"{where}: {name} raised {type(e).__name__}: {e}") from None
            finally:
                self.inside = None
                self.publish()
        return run

    def _wrap(self, where: str, name: str, fn):
        def traced(*args, **kwargs):
            if self.depth:  # inside an op already traced (comm.all_reduce calls dist.all_reduce)
                return fn(*args, **kwargs)
            key = f"{where}.{name}"
            if key in self.refuse:
                raise AssertionError(self.refuse[key])
            if self.inside:
                raise AssertionError(f"{self.inside} called {key}: it gets this rank's tensors "
                                     f"only and needs no communication (the library's code "
                                     f"around it makes the calls, the same on every rank)")
            self.calls += 1
            self.last = _describe(where, name, args[1:] if where == "comm" else args, kwargs)
            if where == "handle":
                self.calls -= 1  # a wait is no call of its own: ranks may wait differently
            self.waiting, self.depth = True, 1
            self.publish()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.depth = 0
            self.waiting = False
            self.publish()
            return out
        return traced

    def __enter__(self):
        from ..comm import Comm, _Handle
        self.saved = []
        for owner, where, names in ((Comm, "comm", _COMM_OPS), (self.dist, "dist", _DIST_OPS),
                                    (_Handle, "handle", ("wait",))):
            for name in names:
                if hasattr(owner, name):
                    fn = getattr(owner, name)
                    self.saved.append((owner, name, fn))
                    setattr(owner, name, self._wrap(where, name, fn))
        self.done, self.round = False, self.round + 1
        return self

    def __exit__(self, exc_type, exc, tb):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)
        if exc_type is None:
            self.done, self.waiting = True, False
            self.history.append(self.calls)
            self.publish()
            return False
        if exc_type is AssertionError:
            self.failed = str(exc)
            self.publish()
            return False
        if exc_type is NotImplementedError:
            return False
        if any(s in str(exc) for s in _STUCK):
            self.timed_out = "imed out" in str(exc) or "timeout" in str(exc).lower()
            raise AssertionError(self.stuck_message()) from None
        return False

    def agree(self) -> None:
        """After the learner's function returned, before the checker's own collective: wait
        (through the store, not the backend) until every rank has returned from it as often as
        this one, with as many calls. Ranks that disagree are named now, instead of letting the
        checker's collective meet a stray one of the learner's (gloo then aborts the process or
        waits forever)."""
        import time
        deadline = time.monotonic() + CHECK_PG_TIMEOUT
        world = self.dist.get_world_size()
        k = self.round
        while True:
            states = self.states()
            failed = [s["failed"] for s in states.values() if s.get("failed")]
            if failed:
                raise AssertionError(failed[0])
            # a peer may already be in round k + 1 (it saw everyone done with k): its history says
            if len(states) == world and all(len(s["history"]) >= k for s in states.values()):
                counts = {q: s["history"][k - 1] for q, s in states.items()}
                if len(set(counts.values())) == 1:
                    return
                self.failed = self.mismatch_message(states, k)
                break
            ahead = [q for q, s in states.items() if s["round"] == k and s["waiting"]
                     and s["calls"] > self.calls]
            if ahead or time.monotonic() > deadline:
                self.failed = self.stuck_message("deadlock: " if ahead else None)
                break
            time.sleep(0.005)
        self.publish()
        raise AssertionError(self.failed)

    def mismatch_message(self, states: dict, k: int) -> str:
        def made(s):
            c = s["history"][k - 1] - (s["history"][k - 2] if k > 1 else 0)
            return f"{c} call{'s' if c != 1 else ''}"
        parts = [f"rank {q} made {made(s)}" + (f" (the last {s['last']})" if s["last"] and s["round"] == k else "")
                 for q, s in sorted(states.items())]
        return (f"the ranks made different calls in {self.label}: " + "; ".join(parts)
                + ". Every rank must make the same calls in the same order: a collective that "
                "only some ranks call waits for the others forever")

    def states(self) -> dict:
        import json
        world = self.dist.get_world_size()
        out = {}
        for q in range(world):
            key = f"pm_check/{q}"
            if self.store.check([key]):
                out[q] = json.loads(self.store.get(key))
        return out

    def stuck_message(self, head: str | None = None) -> str:
        """Who waited on what, from every rank's published state."""
        states = self.states()
        failed = [s["failed"] for s in states.values() if s.get("failed")]
        if failed:  # a peer refused the answer and left: its message is the news
            return failed[0]
        closed = not self.timed_out
        parts = []
        for q in range(self.dist.get_world_size()):
            s = states.get(q)
            if s is None:
                parts.append(f"rank {q} had made no call in {self.label} yet")
                continue
            # calls counted within the rank's current (or last returned) call of the function
            before = s["history"][-2 if s["done"] else -1] if len(s["history"]) > s["done"] else 0
            c, again = s["calls"] - before, (f" (its call {s['round']} of it)"
                                             if s["round"] > 1 else "")
            last = f" (the last {s['last']})" if s["last"] and c else ""
            if s.get("inside"):
                parts.append(f"rank {q} was still running {s['inside']} (its call "
                             f"{s['entered']} of it on that rank), after {c} "
                             f"call{'s' if c != 1 else ''} in {self.label}{last}")
            elif s["waiting"]:
                parts.append(f"rank {q} waited in {s['last']}, its call {c} in "
                             f"{self.label}{again}")
            elif s["done"]:
                parts.append(f"rank {q} had returned from {self.label}{again} after {c} "
                             f"call{'s' if c != 1 else ''}{last}")
            else:
                parts.append(f"rank {q} was computing in {self.label}{again} after {c} "
                             f"call{'s' if c != 1 else ''}{last}")
        still = next((s["inside"] for s in states.values() if s.get("inside")), None)
        head = head or (f"a rank stopped while its peers waited (it died or returned), so "
                        f"they could not go on: " if closed else
                        f"stopped after {CHECK_PG_TIMEOUT:g} s of waiting for a rank that never "
                        f"left {still} (a loop that never ends, or a wait in it): " if still else
                        f"deadlock, stopped after {CHECK_PG_TIMEOUT:g} s of waiting: ")
        if still:  # the library's code makes the calls: the learner's function held it up
            return (head + "; ".join(parts) + f". The library's code around {still} makes the "
                    f"same calls on every rank, so one rank that stays in {still} holds up all "
                    f"the others: look for a loop, or a wait, that does not end on that rank")
        return (head + "; ".join(parts)
                + ". A send is matched only by a receive on the rank it is sent to, and a "
                "collective only by the same collective on every rank of the group: every rank "
                "must make the same calls in the same order")


def _trace_for(comm, label: str, refuse: dict) -> "_RankTrace":
    """One trace per rank's Comm, kept over the learner function's calls (its rounds)."""
    trace = getattr(comm, "_grading_trace", None)
    if trace is None:
        trace = comm._grading_trace = _RankTrace(label, refuse)
    return trace


def _stuck_after(trace: "_RankTrace", err: BaseException) -> None:
    """The checker's own collective after the learner's code timed out: a peer is still stuck in
    (or left) the learner's code. Raise the same hint."""
    if any(s in str(err) for s in _STUCK):
        trace.timed_out = "imed out" in str(err) or "timeout" in str(err).lower()
        raise AssertionError(trace.stuck_message()) from None


# ---------------------------------------------------------------------------------------------
# lesson 01: the ring all-reduce
# ---------------------------------------------------------------------------------------------
_RING_STUB = ("ring_all_reduce still raises NotImplementedError: fill in the two phases, then run "
              "this cell again.")


def _library_ring_refused(x, comm, axis="dp"):
    """Swapped in for the code of comm.ring_all_reduce while a learner's ring runs (a literal
    message: the code object runs with the library module's globals)."""
    raise AssertionError("your ring called the library's own ring_all_reduce (parallel_mini.comm."
                         "ring_all_reduce), which the checker disables while your code runs: "
                         "write the two phases yourself, with comm.sendrecv")


class _CodeSwapped:
    """While active, each library function of `swaps()` runs its refusal's code instead of its
    own (the code object swapped), so an answer calling it, by whatever name it was imported
    under, is refused; restored on exit. Each checker's subclass says which functions."""

    def swaps(self) -> list:  # [(library function, refusal)]
        raise NotImplementedError

    def __enter__(self):
        self.saved = []
        for fn, refusal in self.swaps():
            self.saved.append((fn, fn.__code__))
            fn.__code__ = refusal.__code__
        return self

    def __exit__(self, *exc):
        for fn, code in reversed(self.saved):
            fn.__code__ = code
        return False


class _LibraryRingDisabled(_CodeSwapped):
    """comm.ring_all_reduce raises while active."""

    def swaps(self):
        from .. import comm
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
    from ..comm import Comm, probe_input

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
            "sent_bytes": sum(rec["wire_bytes_model"] for rec in comm.records if rec["op"] == "send")}


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
    waiting with what every rank waited on."""
    from ..launch import run_ranks

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
        runs.append({"world_size": n, "numel": numel,
                     "sent_bytes_per_rank": [p["sent_bytes"] for p in per_rank],
                     "steps_per_rank": [len(p["calls"]) for p in per_rank]})
    return Grade("correct", f"equal to dist.all_reduce at N,numel = {list(cases)}, in 2(N-1) "
                 f"steps, sending 2(N-1)/N*X per rank on average; the library's ring and the "
                 f"backend's collectives disabled while yours ran", {"runs": runs})


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
        from ..parallel import data
        return [(data.average_gradients, _library_average_refused)]


def _checked_average(fn, params, comm) -> None:
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
    import functools

    from ..engine import train_rank  # late: engine imports the launcher stack
    from ..launch import run_ranks
    from ..report import merge_rank_results

    report = None
    for n in world_sizes:
        cfg = RunConfig(dp=n, dp_mode="naive", batch=2 * n, steps=steps, reference=True).validate()
        results = _on_ranks(lambda: run_ranks(train_rank, n, cfg.to_dict(),
                                              average_fn=functools.partial(_checked_average, fn),
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _AVERAGE_STUB, f"at dp={n}")
        if isinstance(results, Grade):
            return results
        report = merge_rank_results(cfg, [res.value for res in results])
        if report.max_abs_diff > 1e-5:
            raise AssertionError(f"at dp={n} training differs from the single-process reference "
                                 f"by {report.max_abs_diff:.2e} (> 1e-5)")
        measured = report.wire_bytes_per_step().get("dp", 0)
        predicted = report.theory["wire_bytes_per_step"]["dp"]
        if measured != predicted:
            raise AssertionError(f"at dp={n} your averaging sent {measured:,.0f} bytes per step; "
                                 f"all-reducing every gradient once sends {predicted:,} "
                                 f"(use comm.all_reduce(p.grad, 'dp') so bytes are measured)")
    return Grade("correct", f"equal to the single-process reference (max |diff| "
                 f"{report.max_abs_diff:.1e}) at dp = {list(world_sizes)}, moving exactly "
                 f"2(N-1)/N x gradient bytes per step; the library's average_gradients disabled "
                 f"while yours ran", {"report": report})


# ---------------------------------------------------------------------------------------------
# lesson 02: bucketed, overlapped gradient all-reduce (DDP's reducer)
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


class _LibraryBucketsDisabled(_CodeSwapped):
    """The library's bucketed DP raises while active."""

    def swaps(self):
        from ..parallel import data
        fns = [data.make_buckets, data.average_gradients, data.Bucket.__init__]
        fns += [getattr(data.DataParallel, name) for name in (
            "__init__", "_on_grad_ready", "_launch_ready_buckets", "finish_gradient_sync",
            "_wait_and_unpack", "_rebuild_buckets")]
        return [(f, _library_buckets_refused) for f in fns]


def _bucketed_rank(cfg_dict: dict, cls, bucket_mb: float) -> dict:
    """One rank of the bucketed check: the toy GPT with the learner's `cls(params, comm,
    bucket_bytes)` registering its gradient hooks; each step forward and backward on this rank's
    shard, then `finish_gradient_sync()`. Every gradient is compared with the mean over the ranks
    (an uncounted all-reduce of copies that a hook registered first takes); every all-reduce
    record's launch and finish are timed against the moment backward returned."""
    import time

    import torch
    import torch.distributed as dist

    from ..comm import Comm
    from ..data import global_batch, shard
    from ..experiments import allreduce_overlap
    from ..mesh import build_mesh
    from ..model import build_model

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
        x, y = shard(global_batch(cfg, step), r, n)  # [b/N, s] x 2
        loss = model(x, y)
        t_start = time.perf_counter()
        with _LibraryBucketsDisabled(), trace:
            loss.backward()  # the learner's hooks run in here
        t_end = time.perf_counter()  # backward has returned
        with _LibraryBucketsDisabled(), trace:
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
        # launch and finish relative to the end of backward, as the library's bucketed DP is
        # measured (experiments.allreduce_overlap), each with the gradients still pending then
        rows = allreduce_overlap(recs, step, t_start, t_end)
        for i, (row, c) in enumerate(zip(rows, recs)):
            row.update(bucket=i, grads_pending=sum(t > c["start"] for t in arrived),
                       rank=r, step=step, finished_in_backward=row["finish_ms"] <= 0.0,
                       wire_bytes_model=c["wire_bytes_model"], payload_bytes=c["payload_bytes"],
                       **{"async": bool(c.get("async_op"))})
        steps.append({"step": step, "backward_ms": 1e3 * (t_end - t_start),
                      "finish_ms": 1e3 * (t_done - t_end), "all_reduces": rows})
    return {"rank": r, "steps": steps, "n_params": sum(p.numel() for p in params),
            "n_tensors": len(params)}


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
    all asynchronous, 2(N-1)/N x 4P bytes per step; and, measured, at least one all-reduce on
    every rank and step launched before backward returned (the overlap bucketing exists for).
    The library's bucketed data parallel raises while the learner's code runs, and a deadlock
    stops after CHECK_PG_TIMEOUT seconds of waiting with what every rank waited on."""
    from ..launch import run_ranks

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
                if len(ars) >= rank["n_tensors"]:
                    raise AssertionError(f"{at}: {len(ars)} all-reduces for {rank['n_tensors']} "
                                         f"gradient tensors: one call per gradient is naive mode. "
                                         f"Pack the gradients into buckets and all-reduce each "
                                         f"bucket once")
                if not all(a["async"] for a in ars):
                    raise AssertionError(f"{at}: an all-reduce ran with async_op=False: a blocking "
                                         f"call inside a hook stops backward until it is done. "
                                         f"Launch it with comm.all_reduce(flat, 'dp', "
                                         f"async_op=True), keep the handle, wait in "
                                         f"finish_gradient_sync")
                sent = sum(a["wire_bytes_model"] for a in ars)
                if sent != predicted:
                    raise AssertionError(f"{at}: your all-reduces sent {sent:,} bytes (ring "
                                         f"model); every gradient once is 2(N-1)/N x 4P = "
                                         f"{predicted:,}: each gradient in exactly one bucket, "
                                         f"each bucket all-reduced once per step")
                early = [a for a in ars if a["launch_ms"] < 0]
                if not early:
                    raise AssertionError(
                        f"{at}: none of your {len(ars)} all-reduces was launched before backward "
                        f"returned (the first {min(a['launch_ms'] for a in ars):+.2f} ms after "
                        f"it): launch each bucket's all-reduce from the gradient hook, as soon "
                        f"as its last gradient has arrived, not in finish_gradient_sync")
        from ..experiments import overlapped_share
        rows = [a for rk in per_rank for row in rk["steps"] for a in row["all_reduces"]]
        runs.append({"dp": n, "all_reduces_per_step": len(per_rank[0]["steps"][0]["all_reduces"]),
                     "launched_in_backward": sum(a["launch_ms"] < 0 for a in rows),
                     "finished_in_backward": sum(a["finished_in_backward"] for a in rows),
                     "overlapped_share": overlapped_share(rows),
                     "all_reduces": len(rows), "wire_bytes_per_step": predicted,
                     "buckets": rows})
    return Grade("correct", f"equal to the mean over the ranks at dp = {list(world_sizes)}, "
                 f"{runs[-1]['all_reduces_per_step']} bucket all-reduces per step, moving exactly "
                 f"2(N-1)/N x gradient bytes, launched during backward on every rank and step "
                 f"(measured); the library's bucketed data parallel disabled while yours ran",
                 {"runs": runs})


# ---------------------------------------------------------------------------------------------
# lesson 03: the ZeRO-1 optimizer step
# ---------------------------------------------------------------------------------------------
# The check model: small and with a padded flat buffer at N = 4 (P = 77,322 = 4 * 19,330 + 2), so
# the learner's slicing must handle the padding that ZeRO's flat layout adds.
ZERO1_CHECK_SHAPE = {"layers": 3, "d_model": 42, "heads": 6}


def _library_zero_refused(*args, **kwargs):
    """Swapped in for the code of the library's ZeRO while a learner's zero1_step runs."""
    raise AssertionError("your zero1_step called the library's own ZeRO (parallel_mini.parallel."
                         "zero.ZeroDataParallel), which the checker disables while your code runs: "
                         "reduce-scatter, step and all-gather yourself, with comm")


class _LibraryZeroDisabled(_CodeSwapped):
    """ZeroDataParallel's constructor, gradient sync and step raise while active."""

    def swaps(self):
        from ..parallel import zero
        return [(getattr(zero.ZeroDataParallel, n), _library_zero_refused)
                for n in ("__init__", "finish_gradient_sync", "step")]


def _zero1_rank(cfg_dict: dict, fn) -> dict:
    """One rank of the ZeRO-1 check: ZeroDataParallel's flat layout (every parameter a view into
    one flat fp32 buffer, padded to a multiple of N) and an Adam that owns only this rank's slice,
    with the learner's `fn(flat_params, flat_grads, step_shard, comm)` doing the gradient sync and
    the step. Each step checks what `step_shard` received and what `flat_params` holds afterwards
    against uncounted torch.distributed collectives; a wrong answer raises AssertionError here."""
    import torch
    import torch.distributed as dist

    from ..comm import Comm, _all_gather
    from ..data import global_batch, shard
    from ..launch import rank_device
    from ..mesh import build_mesh
    from ..model import build_model
    from ..optim import Adam
    from ..parallel.zero import FlatLayout

    cfg = RunConfig.from_dict(cfg_dict)
    mesh = build_mesh(cfg)
    comm = Comm(mesh)
    n, r, group = comm.size("dp"), comm.rank("dp"), mesh.groups["dp"]
    device = rank_device()
    model = build_model(cfg).to(device)  # the same seed on every rank: identical replicas
    params = [p for p in model.parameters() if p.requires_grad]
    layout = FlatLayout(params, n)
    k = layout.shard_numel
    flat_params = torch.zeros(layout.padded, device=device)  # [N*k]
    for p, view in zip(params, layout.views(flat_params)):
        view.copy_(p.data)
        p.data = view
    mine = layout.shard(flat_params, r)  # [k]: the slice this rank's optimizer owns
    optimizer = Adam([mine], lr=cfg.lr)  # moments for k elements only: ZeRO-1's saving
    received: list[torch.Tensor] = []  # the gradient step_shard got, this step
    updated: list[torch.Tensor] = []  # my slice right after the step, before any all-gather

    def step_shard(grad_shard: torch.Tensor) -> None:
        """Adam on this rank's slice flat_params[r*k:(r+1)*k], in place, with `grad_shard` [k]."""
        if not isinstance(grad_shard, torch.Tensor) or tuple(grad_shard.shape) != (k,):
            got = (tuple(grad_shard.shape) if isinstance(grad_shard, torch.Tensor)
                   else type(grad_shard).__name__)
            raise AssertionError(f"at dp={n}: step_shard takes this rank's averaged gradient "
                                 f"slice, shape ({k},) = padded {layout.padded} / N {n}; "
                                 f"got {got}")
        received.append(grad_shard.detach().clone())
        mine.grad = grad_shard.detach().to(mine.dtype)
        optimizer.step()
        mine.grad = None
        updated.append(mine.detach().clone())

    def close(a, b):  # reduce-scatter and all-reduce may sum in different orders
        return torch.allclose(a, b, rtol=1e-5, atol=1e-8)

    losses = []
    trace = _RankTrace("your zero1_step")
    for step in range(cfg.steps):
        comm.step = step
        flat_grads = torch.zeros_like(flat_params)  # [N*k], backward accumulates into it
        for p, view in zip(params, layout.views(flat_grads)):
            p.grad = view
        x, y = (t.to(device) for t in shard(global_batch(cfg, step), r, n))  # [b/N, s] x 2
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        local = layout.shard(flat_grads, r).clone()  # this rank's own, unreduced slice
        expected = flat_grads.clone()  # the answer, by an all-reduce the records do not see
        if n > 1:
            dist.all_reduce(expected, group=group)
        expected = layout.shard(expected, r) / n
        received.clear()
        updated.clear()
        with _LibraryZeroDisabled(), trace:
            fn(flat_params, flat_grads, step_shard, comm)
        trace.agree()  # every rank made the same calls: the checks' own collectives may follow
        at = f"at dp={n}, step {step}"
        if len(received) != 1:
            raise AssertionError(f"{at}: step_shard was called {len(received)} times; call it "
                                 f"once per step, with the averaged gradient of your slice")
        got = received[0].to(expected.dtype)
        if not close(got, expected):
            if close(got, local):
                why = ("step_shard received this rank's own gradient slice, not the mean over "
                       "the ranks: reduce-scatter the gradients first (comm.reduce_scatter)")
            elif close(got, expected * n):
                why = ("step_shard received N times the mean gradient: divide the "
                       "reduce-scattered slice by N (comm.size('dp'))")
            elif close(got, local / n):
                why = ("step_shard received this rank's own gradient divided by N: the gradients "
                       "were never summed across ranks (comm.reduce_scatter)")
            else:
                why = (f"step_shard received a gradient that is not the mean over the ranks of "
                       f"slice r = [r*k, (r+1)*k) (k = {k}); max |difference| "
                       f"{(got - expected).abs().max().item():.2e}")
            raise AssertionError(f"{at}: {why}")
        truth = torch.empty_like(flat_params)  # every rank's updated slice, side by side
        if n > 1:
            _all_gather(truth, updated[0], group=group)
        else:
            truth.copy_(updated[0])
        if not torch.equal(flat_params, truth):
            stale = [q for q in range(n) if q != r and not torch.equal(
                layout.shard(flat_params, q), layout.shard(truth, q))]
            if not stale:
                raise AssertionError(f"{at}: after zero1_step, this rank's own slice of "
                                     f"flat_params is not what step_shard left there: each rank "
                                     f"contributes its own slice, flat_params[r*k:(r+1)*k], to "
                                     f"the all-gather")
            raise AssertionError(f"{at}: after zero1_step, flat_params does not hold the other "
                                 f"ranks' updated slices ({len(stale)} of {n - 1} differ): "
                                 f"all-gather every rank's own slice into flat_params "
                                 f"(comm.all_gather), in place")
    full = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return {"rank": r, "losses": losses, "params": full, "comm": comm.records,
            "n_params": layout.numel, "padding": layout.padding,
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in optimizer.state_tensors())}


def check_zero1_step(fn, world_sizes=(2, 4), steps: int = 3) -> Grade:
    """`fn(flat_params, flat_grads, step_shard, comm)` must do ZeRO-1's gradient sync and step:
    reduce-scatter `flat_grads` over "dp" (rank r receives the sum of slice r), divide by N, hand
    that slice to `step_shard`, and all-gather every rank's updated slice into `flat_params`.

    Checked by training a small GPT with it on real ranks at each world size (dp=4 pads the flat
    buffer): the gradient each rank steps with, and the parameters every rank holds afterwards,
    every step; losses and final parameters against the single-process reference (1e-5); losses
    against the library's ZeroDataParallel(stage=1); bytes on the wire per step against
    2(N-1)/N x padded Psi (reduce-scatter + all-gather, what one all-reduce moves) and against the
    library's measured bytes."""
    from ..engine import run  # late: engine imports the launcher stack
    from ..launch import run_ranks
    from ..reference import max_abs_diff, train_reference

    summary = []
    for n in world_sizes:
        cfg = RunConfig(dp=n, zero=1, batch=2 * n, steps=steps, **ZERO1_CHECK_SHAPE)
        results = _on_ranks(lambda: run_ranks(_zero1_rank, n, cfg.to_dict(), fn,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            "zero1_step still raises NotImplementedError: write the three "
                            "steps, then run this cell again.", f"at dp={n}")
        if isinstance(results, Grade):
            return results
        per_rank = [res.value for res in results]
        losses = [sum(vals) / n for vals in zip(*(r["losses"] for r in per_rank))]
        ref_losses, ref_params = train_reference(cfg)
        diff = max_abs_diff(losses, per_rank[0]["params"], ref_losses, ref_params)
        if max(diff.values()) > 1e-5:
            raise AssertionError(f"at dp={n}: training with zero1_step differs from the "
                                 f"single-process reference by {max(diff.values()):.2e} (> 1e-5)")
        library = run(cfg)
        if max(abs(a - b) for a, b in zip(losses, library.losses)) > 1e-5:
            raise AssertionError(f"at dp={n}: losses {losses} differ from the library's ZeRO-1 "
                                 f"{library.losses}")
        p = per_rank[0]["n_params"]
        units = theory.gpt_unit_sizes(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers)
        predicted = theory.zero_wire_bytes_per_step(1, p, "fp32", n, units)
        library_bytes = library.wire_bytes_per_step().get("dp", 0)
        s = 4 * theory.padded(p, n)  # padded flat buffer, fp32
        for r in per_rank:
            measured = sum(c["wire_bytes_model"] for c in r["comm"] if c["step"] >= 0) / steps
            if measured != predicted or measured != library_bytes:
                hint = ""
                if measured == 0:
                    hint = (" Nothing went through comm: use comm.reduce_scatter and "
                            "comm.all_gather (torch.distributed directly is not recorded).")
                elif measured == theory.wire_bytes("all_reduce", s, n) + theory.wire_bytes(
                        "all_gather", s, n):
                    hint = (" That is an all-reduce of the gradients plus an all-gather: each "
                            "rank needs only its own slice, so reduce-scatter it.")
                raise AssertionError(f"at dp={n}: rank {r['rank']} sent {measured:,.0f} bytes "
                                     f"per step; reduce-scatter + all-gather of the padded flat "
                                     f"buffer send 2(N-1)/N x {s:,} = {predicted:,} (the "
                                     f"library's ZeRO-1 measured {library_bytes:,.0f}).{hint}")
        summary.append({"dp": n, "n_params": p, "padding": per_rank[0]["padding"],
                        "wire_bytes_per_step": predicted, "max_abs_diff": max(diff.values()),
                        "losses": losses, "reference_losses": ref_losses,
                        "library_losses": library.losses,
                        "optimizer_bytes": per_rank[0]["optimizer_bytes"]})
    worst = max(row["max_abs_diff"] for row in summary)
    return Grade("correct", f"equal to the single-process reference (max |diff| {worst:.1e}) and "
                 f"to the library's ZeRO-1 at dp = {list(world_sizes)} (padding included), moving "
                 f"exactly 2(N-1)/N x padded Psi bytes per step", {"runs": summary})


# ---------------------------------------------------------------------------------------------
# lesson 04: a column-then-row parallel MLP
# ---------------------------------------------------------------------------------------------
# The check MLP: h = 16, hidden 4h = 64 (splits over 2 and 4 ranks), two input shapes per world
# size. Weights ~ N(0, 1/fan_in) and biases ~ N(0, 1) (not zero, as the model's init makes them):
# a bias added on every rank must show.
PARALLEL_MLP_SHAPE = {"d_model": 16, "inputs": ((2, 8), (3, 5))}
PARALLEL_MLP_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _parallel_mlp_weights(h: int, seed: int = 0):
    """The full MLP, the same on every process: fc [4h, h] + [4h], proj [h, 4h] + [h], and inputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    fc_w = torch.randn(4 * h, h, generator=g) / h ** 0.5
    fc_b = torch.randn(4 * h, generator=g)
    proj_w = torch.randn(h, 4 * h, generator=g) / (4 * h) ** 0.5
    proj_b = torch.randn(h, generator=g)
    xs = [torch.randn(b, s, h, generator=g) for b, s in PARALLEL_MLP_SHAPE["inputs"]]
    return fc_w, fc_b, proj_w, proj_b, xs


def _library_tp_refused(*args, **kwargs):
    """Swapped in for the code of the library's tensor-parallel layers while a learner's MLP runs."""
    raise AssertionError("your parallel_mlp called the library's own tensor parallelism (parallel_"
                         "mini.parallel.tensor: ColumnParallelLinear, RowParallelLinear, "
                         "reduce_from_tp, copy_to_tp, ...), which the checker disables while your "
                         "code runs: write the two matmuls and the one comm.all_reduce yourself")


class _LibraryTensorParallelDisabled(_CodeSwapped):
    """The library's tensor-parallel layers and their f/g functions raise while active."""

    def swaps(self):
        from ..parallel import tensor
        fns = [tensor.copy_to_tp, tensor.reduce_from_tp, tensor.apply_tensor_parallel,
               tensor._CopyToTP.forward, tensor._ReduceFromTP.forward,
               tensor.ColumnParallelLinear.forward, tensor.RowParallelLinear.forward]
        return [(f, _library_tp_refused) for f in fns]


def _parallel_mlp_rank(cfg_dict: dict, fn) -> dict:
    """One rank of the parallel-MLP check: rank r gets fc's rows r (its slice of the hidden
    features), proj's columns r (the matching slice of proj's inputs) and proj's whole bias, calls
    `fn` once per input and returns each output and the comm records that call made."""
    import torch

    from ..comm import Comm
    from ..mesh import build_mesh

    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    n, r = comm.size("tp"), comm.rank("tp")
    fc_w, fc_b, proj_w, proj_b, xs = _parallel_mlp_weights(cfg.d_model)
    shards = (fc_w.chunk(n, dim=0)[r].clone(), fc_b.chunk(n, dim=0)[r].clone(),  # [4h/t, h], [4h/t]
              proj_w.chunk(n, dim=1)[r].clone(), proj_b.clone())  # [h, 4h/t], [h]
    calls = []
    trace = _RankTrace("your parallel_mlp")
    for x in xs:
        comm.records.clear()
        with _LibraryTensorParallelDisabled(), trace:
            out = fn(x.clone(), *(t.clone() for t in shards), comm)
        trace.agree()
        calls.append({"out": out.detach().clone() if isinstance(out, torch.Tensor) else out,
                      "records": [{k: c.get(k) for k in ("op", "group", "payload_bytes",
                                                         "wire_bytes_model", "count")}
                                  for c in comm.records]})
    return {"rank": r, "calls": calls}


def check_parallel_mlp(fn, world_sizes=(2, 4)) -> Grade:
    """`fn(x, fc_w_shard, fc_b_shard, proj_w_shard, proj_b, comm)` must compute the MLP
    proj(GELU(fc(x))) on x [b, s, h] with weights split over the "tp" ranks, Megatron-style: fc
    column-parallel (rank r holds rows r of fc.weight [4h, h] and of its bias), proj row-parallel
    (columns r of proj.weight [h, 4h]; proj's bias whole on every rank), and exactly one
    comm.all_reduce per call, of the [b, s, h] output.

    Checked on real ranks at each tp degree, with two input shapes: every rank's output equals the
    unsharded MLP computed in one process, within rtol = atol = 1e-5 (fp32: the sharded version
    adds the 4h products of each output in t partial sums, a different order than one matmul, so
    the last bits may differ; a wrong answer is off by O(1)); each call records exactly one
    all-reduce over "tp", of b*s*h fp32 numbers, whose wire bytes are theory's 2(t-1)/t x S.
    While the learner's code runs the library's tensor-parallel layers raise (an answer built on
    them is refused, saying so); a deadlock stops after CHECK_PG_TIMEOUT seconds of waiting."""
    import torch
    import torch.nn.functional as F

    from ..launch import run_ranks

    h = PARALLEL_MLP_SHAPE["d_model"]
    fc_w, fc_b, proj_w, proj_b, xs = _parallel_mlp_weights(h)
    full = [F.gelu(x @ fc_w.T + fc_b) @ proj_w.T + proj_b for x in xs]  # [b, s, h], one process
    summary = []
    for n in world_sizes:
        cfg = RunConfig(tp=n, d_model=h, heads=n, vocab=128)
        results = _on_ranks(lambda: run_ranks(_parallel_mlp_rank, n, cfg.to_dict(), fn,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            "parallel_mlp still raises NotImplementedError: write it, then run "
                            "this cell again.", f"at tp={n}")
        if isinstance(results, Grade):
            return results
        per_rank = [res.value for res in results]
        worst = 0.0
        for i, (x, want) in enumerate(zip(xs, full)):
            b, s = x.shape[:2]
            at = f"at tp={n}, x of shape {list(x.shape)}"
            out_bytes = b * s * h * 4
            for rank in per_rank:
                call, r = rank["calls"][i], rank["rank"]
                got, recs = call["out"], call["records"]
                if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                    shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                    raise AssertionError(f"{at}: rank {r} returned {shape}; parallel_mlp returns "
                                         f"the full output [b, s, h] = {list(want.shape)} on "
                                         f"every rank")
                reduces = [c for c in recs if c["op"] == "all_reduce"]
                others = sorted({c["op"] for c in recs if c["op"] != "all_reduce"})
                if others:
                    raise AssertionError(f"{at}: rank {r} called {', '.join(others)}; column-"
                                         f"then-row needs nothing but one comm.all_reduce")
                if not reduces:
                    raise AssertionError(
                        f"{at}: rank {r} recorded no all-reduce, so its output is only its own "
                        f"partial sum over 4h/t = {4 * h // n} hidden features. Sum the partial "
                        f"products over the ranks with comm.all_reduce(y, 'tp') (torch.distributed "
                        f"called directly is not recorded)")
                if len(reduces) > 1:
                    raise AssertionError(f"{at}: rank {r} made {len(reduces)} all-reduces in one "
                                         f"call; column-then-row needs exactly one, after proj")
                rec = reduces[0]
                if rec["group"] != "tp":
                    raise AssertionError(f"{at}: the all-reduce went over '{rec['group']}'; the "
                                         f"weights are split over 'tp'")
                hidden_bytes = b * s * (4 * h // n) * 4
                if rec["payload_bytes"] == hidden_bytes and hidden_bytes != out_bytes:
                    raise AssertionError(
                        f"{at}: the all-reduce carried {hidden_bytes} bytes, the fc output "
                        f"[b, s, 4h/t] = [{b}, {s}, {4 * h // n}]: all-reducing after fc adds up "
                        f"*different* hidden features of the ranks. The fc output needs no "
                        f"communication; all-reduce after proj, [b, s, h]")
                if rec["payload_bytes"] != out_bytes:
                    raise AssertionError(f"{at}: the all-reduce carried {rec['payload_bytes']} "
                                         f"bytes; the MLP's output [b, s, h] in fp32 is "
                                         f"{out_bytes}")
                expected_wire = theory.wire_bytes("all_reduce", out_bytes, n)
                if rec["wire_bytes_model"] != expected_wire:
                    raise AssertionError(f"{at}: the all-reduce's wire bytes {rec['wire_bytes_model']} "
                                         f"differ from 2(t-1)/t x {out_bytes} = {expected_wire}")
                got = got.to(want.dtype)
                if not torch.allclose(got, want, **PARALLEL_MLP_TOLERANCE):
                    diff = (got - want).abs().max().item()
                    if torch.allclose(got, want + (n - 1) * proj_b, **PARALLEL_MLP_TOLERANCE):
                        why = (f"the output is off by (t-1) x proj's bias: every rank added the "
                               f"bias before the all-reduce, so the sum holds it t = {n} times. "
                               f"Add proj_b once, after the sum")
                    elif torch.allclose(got, want - proj_b, **PARALLEL_MLP_TOLERANCE):
                        why = "proj's bias is missing: add proj_b (once, after the all-reduce)"
                    else:
                        why = (f"rank {r}'s output differs from the unsharded MLP by up to "
                               f"{diff:.2e} (tolerance: rtol = atol = 1e-5)")
                    raise AssertionError(f"{at}: {why}")
                worst = max(worst, (got - want).abs().max().item())
        summary.append({"tp": n, "max_abs_diff": worst,
                        "all_reduce_bytes": [x.shape[0] * x.shape[1] * h * 4 for x in xs],
                        "wire_bytes_model": [theory.wire_bytes("all_reduce", x.shape[0] * x.shape[1] * h * 4, n)
                                       for x in xs]})
    worst = max(row["max_abs_diff"] for row in summary)
    return Grade("correct", f"equal to the unsharded MLP (max |diff| {worst:.1e}) at tp = "
                 f"{list(world_sizes)}, with exactly one all-reduce of the [b, s, h] output per "
                 f"call", {"runs": summary})


def _parse_ops(ops, rank: int) -> list[list]:
    """["F0", "B0", ...] (or ("F", 0) pairs) -> [["F", 0], ...]."""
    if not isinstance(ops, (list, tuple)):
        raise AssertionError(f"rank {rank}: one_f_one_b returned {type(ops).__name__}; return a "
                             f"list of ops such as ['F0', 'F1', 'B0', ...]")
    out = []
    for op in ops:
        kind, micro = (op[0], op[1:]) if isinstance(op, str) else op
        if kind not in ("F", "B") or not str(micro).isdigit():
            raise AssertionError(f"rank {rank}: {op!r} is not an op; write 'F3' (forward of "
                                 f"micro-batch 3) or 'B3' (its backward)")
        out.append([kind, int(micro)])
    return out


def _library_schedule_refused(*args, **kwargs):
    """Swapped in for the code of the library's schedule builders while a learner's order is
    built (a literal message: the code object runs with the library module's globals)."""
    raise AssertionError("your one_f_one_b called one of the library's own schedules "
                         "(parallel_mini.parallel.schedules: one_f_one_b, build_schedule, "
                         "interleaved, ...), which the checker disables while your code runs: "
                         "write the warm-up, steady state and cool-down yourself")


class _LibrarySchedulesDisabled(_CodeSwapped):
    """While active, every schedule builder in parallel/schedules.py raises (their code objects
    swapped), so an order that wraps the library's 1F1B, by whatever name, is refused."""

    NAMES = ("naive", "gpipe", "one_f_one_b", "interleaved", "zero_bubble_h1", "zero_bubble_v",
             "build_schedule", "for_config")

    def swaps(self):
        from ..parallel import schedules
        return [(getattr(schedules, n), _library_schedule_refused) for n in self.NAMES]


def check_one_f_one_b(fn, cases=((2, 4), (4, 8), (4, 2)), run_cases=((2, 4), (4, 8))) -> Grade:
    """`fn(rank, pp, m)` returns one rank's 1F1B op order, e.g. ["F0", "F1", "B0", ...].

    Checked for every rank at each (pp, m) in `cases`: each F and B once, an order that cannot
    deadlock (schedules.check), 1F1B's warm-up (min(p - r, m) forwards before rank r's first
    backward: the naive order has 1) and its memory bound: rank r never holds more than p - r
    micro-batches (all-forward-then-all-backward would hold m). Then the order runs on real ranks
    at each of `run_cases` and must equal the single-process reference. While `fn` runs, the
    library's schedule builders (one_f_one_b, build_schedule, ...) raise: an order that wraps the
    library's 1F1B is refused, saying so."""
    from ..engine import run
    from ..parallel.schedules import Op, from_ops, in_flight

    orders = {}
    for pp, m in cases:
        try:
            with _LibrarySchedulesDisabled():
                orders_here = [fn(r, pp, m) for r in range(pp)]
            ops = [_parse_ops(o, r) for r, o in enumerate(orders_here)]
        except NotImplementedError:
            return Grade("not attempted", "one_f_one_b still raises NotImplementedError: write "
                                          "the warm-up, steady state and cool-down, then run this cell again.")
        try:
            schedule = from_ops([[Op(k, i, r) for k, i in rank_ops] for r, rank_ops in
                                 enumerate(ops)], m, "1f1b")
        except ValueError as e:
            raise AssertionError(f"at pp={pp}, m={m}: {e}") from None
        for r, rank_ops in enumerate(ops):
            before = next((i for i, (k, _) in enumerate(rank_ops) if k == "B"), len(rank_ops))
            if before != min(pp - r, m):
                raise AssertionError(f"at pp={pp}, m={m} rank {r} runs {before} forwards before its "
                                     f"first backward; 1F1B warms up with p - 1 - r = {pp - 1 - r} "
                                     f"and then starts with one more forward, so {min(pp - r, m)} "
                                     f"(fewer leaves the pipeline idle, more holds more memory)")
        held = in_flight(schedule)
        for r, h in enumerate(held):
            if h > min(pp - r, m):
                raise AssertionError(f"at pp={pp}, m={m} rank {r} holds {h} micro-batches at once; "
                                     f"1F1B holds at most p - r = {pp - r} (start backwards as soon "
                                     f"as the warm-up of p - 1 - r forwards is done)")
        orders[(pp, m)] = ops
    reports = {}
    for pp, m in run_cases:
        cfg = RunConfig(pp=pp, microbatches=m, batch=m, schedule="1f1b", steps=2, reference=True,
                        extra={"ops": orders[(pp, m)], "lesson": "05"})
        report = run(cfg)
        if report.max_abs_diff > 1e-5:
            raise AssertionError(f"at pp={pp}, m={m} training differs from the reference by "
                                 f"{report.max_abs_diff:.2e}")
        reports[(pp, m)] = report
    return Grade("correct", f"your 1F1B order runs on real ranks and equals the reference "
                            f"(max difference {max(r.max_abs_diff for r in reports.values()):.1e}) "
                            f"at " + ", ".join(f"pp={p} m={m}" for p, m in run_cases),
                 {"reports": reports, "orders": orders})


# ---------------------------------------------------------------------------------------------
# lesson 06: merging two partial attention results (the online softmax)
# ---------------------------------------------------------------------------------------------
# Ring attention on C ranks, with the learner's merge in place of the library's, against torch's
# SDPA on the whole sequence: contiguous chunks at C = 2 and 4, zigzag at C = 4. One sequence
# shape for every case (s divisible by 2C for zigzag).
MERGE_CHECK_CASES = ((2, "contiguous"), (4, "contiguous"), (4, "zigzag"))
MERGE_CHECK_SHAPE = (2, 4, 32, 8)  # b, a (heads), s, d (head size)
MERGE_TOLERANCE = 1e-5  # fp32: the merge sums the same terms in another order than SDPA
_MERGE_STUB = ("merge still raises NotImplementedError: write the online-softmax rule, then run "
               "this cell again.")


def _library_merge_refused(out, lse, o_t, lse_t):
    """Swapped in for the code of the library's context._merge while the checker runs a learner's
    merge (a literal message: the code object runs with the library module's globals)."""
    raise AssertionError("your merge called the library's own merge "
                         "(parallel_mini.parallel.context._merge), which the checker disables "
                         "while it runs your code: write the rule yourself, with torch "
                         "operations (torch.logaddexp, torch.exp, ...)")


class _LibraryMergeDisabled(_CodeSwapped):
    """While active, the library's `_merge` raises (its code object swapped), so an answer that
    calls it, by any name it was imported under, is refused. Restored on exit."""

    def swaps(self):
        from ..parallel import context
        fn = context._merge
        while hasattr(fn, "__wrapped_library__"):  # on a rank: the checker's own wrapper
            fn = fn.__wrapped_library__
        return [(fn, _library_merge_refused)]


def _merge_rule(out, lse, o_t, lse_t):
    """The rule, written out here (not the library's function) so the checker can run while the
    library's is disabled: (out', lse') of the union of both blocks' keys."""
    import torch

    new = torch.logaddexp(lse, lse_t)
    return out * (lse - new).exp().unsqueeze(-1) + o_t * (lse_t - new).exp().unsqueeze(-1), new


def _merge_result(res, shapes: tuple, where: str):
    """The learner's return value as (out', lse'), or an AssertionError saying what is wrong."""
    import torch

    out_shape, lse_shape = shapes
    if not (isinstance(res, (tuple, list)) and len(res) == 2
            and all(isinstance(t, torch.Tensor) for t in res)):
        raise AssertionError(f"{where}: merge must return a pair of tensors (out, lse); it "
                             f"returned {type(res).__name__}"
                             + (f" of {len(res)}" if isinstance(res, (tuple, list)) else ""))
    got = tuple(tuple(t.shape) for t in res)
    if got == (lse_shape, out_shape):
        raise AssertionError(f"{where}: merge returned (lse, out), shapes {list(got)}; return "
                             f"(out, lse) in that order")
    if got != (out_shape, lse_shape):
        raise AssertionError(f"{where}: merge returned tensors of shapes {list(got)}; out keeps "
                             f"the shape of out, {list(out_shape)}, and lse that of lse, "
                             f"{list(lse_shape)} (one log-sum-exp per query row)")
    return res


def _merge_probe_inputs(kind: str):
    """(out, lse, out_t, lse_t) for the checks on one merge, fp32, [b, a, n, d] / [b, a, n]."""
    import torch

    g = torch.Generator().manual_seed(6)
    b, a, n, d = 2, 3, 5, 4
    out, o_t = torch.randn(b, a, n, d, generator=g), torch.randn(b, a, n, d, generator=g)
    lse, lse_t = 2 * torch.randn(b, a, n, generator=g), 2 * torch.randn(b, a, n, generator=g) + 1
    if kind == "first":  # how ring_forward starts every query row: nothing seen yet
        out, lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    elif kind == "large":  # scores of a few hundred: e^lse overflows fp32 (max ~ e^88.7)
        lse, lse_t = lse + 1000, lse_t + 1000
    return out, lse, o_t, lse_t


def _merge_diagnosis(fn) -> None:
    """One merge at a time, in this process, with the library's merge disabled: the common
    mistakes named. Raises NotImplementedError (the stub) or AssertionError."""
    import torch

    def close(a, b, tol=1e-5):
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=False)

    for kind in ("random", "first", "large"):
        out, lse, o_t, lse_t = _merge_probe_inputs(kind)
        where = {"random": "on one merge",
                 "first": "on the first merge of a row (out = 0, lse = -inf: nothing seen yet, "
                          "how ring_forward starts every query row)",
                 "large": "on one merge with large scores (lse around 1000)"}[kind]
        args = [t.clone() for t in (out, lse, o_t, lse_t)]
        with _LibraryMergeDisabled():
            try:
                res = fn(*args)
            except (NotImplementedError, AssertionError):
                raise
            except Exception as e:  # noqa: BLE001 - the learner's code: say what it raised
                raise AssertionError(f"{where}: merge raised {type(e).__name__}: {e}") from None
        got_out, got_lse = _merge_result(res, (tuple(out.shape), tuple(lse.shape)), where)
        want_out, want_lse = _merge_rule(out, lse, o_t, lse_t)
        if not (torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()):
            why = {"first": "the first merge must give back (out_t, lse_t) exactly: e^(-inf) = 0, "
                            "but -inf - (-inf) and inf - inf are nan. torch.logaddexp(-inf, x) "
                            "is x",
                   "large": "e^1000 is inf in fp32 (the largest is about e^88.7): never "
                            "exponentiate a log-sum-exp itself. Work with differences such as "
                            "lse - lse', which are <= 0, or use torch.logaddexp"}.get(
                kind, "check every exp and log in your rule")
            raise AssertionError(f"{where}: merge returned inf or nan. {why}")
        if kind != "random":
            # lse ~ 1000 in fp32 is only good to ~6e-5 (its spacing there), and so are the
            # weights e^(lse - lse') made from it, whichever way they are computed
            tol = 1e-3 if kind == "large" else 1e-5
            if not (close(got_lse, want_lse, tol) and close(got_out, want_out, tol)):
                raise AssertionError(f"{where}: merge returned out and lse that differ from "
                                     f"the merged result by up to "
                                     f"{max((got_out - want_out).abs().max().item(), (got_lse - want_lse).abs().max().item()):.2e}"
                                     + (" (from nothing seen yet, the result is the new block's "
                                        "own out_t and lse_t)" if kind == "first" else
                                        " (large scores overflow e^lse in fp32: use "
                                        "differences of log-sum-exps, or torch.logaddexp)"))
            continue
        # the random probe: name the mistake
        new = want_lse
        w_old, w_new = (lse - new).exp().unsqueeze(-1), (lse_t - new).exp().unsqueeze(-1)
        if not close(got_lse, want_lse):
            if close(got_lse, torch.maximum(lse, lse_t)):
                why = ("lse' is max(lse, lse_t): the maximum is what a safe softmax subtracts "
                       "before exponentiating, not the normaliser. The two blocks' keys together "
                       "have the softmax sum e^lse + e^lse_t, so lse' is its log (the "
                       "log-sum-exp), which is larger than the max")
            elif close(got_lse, lse + lse_t):
                why = ("lse' = lse + lse_t: adding the logs multiplies the two sums; the keys of "
                       "both blocks add their sums, e^lse + e^lse_t")
            elif close(got_lse, lse_t):
                why = "lse' is the new block's lse_t alone: the keys seen before count too"
            else:
                why = (f"lse' differs from the log-sum-exp over both blocks' keys, "
                       f"log(e^lse + e^lse_t), by up to {(got_lse - want_lse).abs().max().item():.2e}")
            raise AssertionError(f"{where}: {why}")
        if not close(got_out, want_out):
            if close(got_out, out + o_t * w_new):
                why = ("the old output was not rescaled. out was normalised by e^lse, the sum over "
                       "the keys seen so far; once the new block is in, the sum is e^lse', so out "
                       "must be multiplied by e^(lse - lse') (and out_t by e^(lse_t - lse'))")
            elif close(got_out, out * w_old + o_t):
                why = ("out_t was added without its weight: it is normalised over its own block "
                       "only, so it counts with e^(lse_t - lse'), its block's share of the sum")
            elif close(got_out, out + o_t):
                why = ("out + out_t: each output is already normalised over its own keys, so "
                       "their weights in the sum add up to 2. Weigh each by its block's share of "
                       "the softmax sum, e^(lse - lse') and e^(lse_t - lse')")
            elif close(got_out, (out + o_t) / 2):
                why = ("the two outputs were averaged with equal weights: a block's weight is its "
                       "share of the softmax sum, e^(lse - lse') and e^(lse_t - lse'), not 1/2")
            elif close(got_out, out * w_new + o_t * w_old):
                why = ("the weights are swapped: out (the keys seen so far) goes with "
                       "e^(lse - lse'), out_t (the new block) with e^(lse_t - lse')")
            else:
                m = torch.maximum(lse, lse_t)
                if close(got_out, out * (lse - m).exp().unsqueeze(-1)
                         + o_t * (lse_t - m).exp().unsqueeze(-1)):
                    why = ("the outputs were weighted by e^(lse - max) and e^(lse_t - max): "
                           "normalise by the combined sum instead, e^(lse - lse') and "
                           "e^(lse_t - lse'), so the weights add up to 1")
                else:
                    why = (f"out' differs from the softmax-weighted output over both blocks by up "
                           f"to {(got_out - want_out).abs().max().item():.2e}")
            raise AssertionError(f"{where}: {why}")


def _merge_rank(cfg_dict: dict, layout: str, fn, shape: tuple) -> dict:
    """One rank of the merge check: the library's RingAttentionCore with the learner's merge in
    place of context._merge (the library's own disabled), forward and backward on this rank's
    tokens of one random q, k, v; compared with torch's SDPA (output, gradients) and the causal
    log-sum-exp on the whole sequence at this rank's positions."""
    import math

    import torch
    import torch.nn.functional as F

    from ..comm import Comm
    from ..mesh import build_mesh
    from ..parallel import context

    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    c, r = comm.size("cp"), comm.rank("cp")
    b, a, s, d = shape
    g = torch.Generator().manual_seed(6)
    q, k, v, grad = (torch.randn(b, a, s, d, generator=g) for _ in range(4))  # the same everywhere
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)  # [b, a, s, d], one process
    ref.backward(grad)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    ref_lse = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~causal, float("-inf")
                                                                   ).logsumexp(-1)  # [b, a, s]
    pos = context.positions_of(layout, s, c, r)
    mine = [t[:, :, pos].contiguous() for t in (q, k, v)]  # [b, a, s/C, d]
    calls, inside = [0], [False]
    where = f"at C={c} ({layout}), rank {r}"
    # the ring's sends and receives traced: a merge that hangs, or raises, on one rank only is
    # reported as who waited on what within CHECK_PG_TIMEOUT, not as gloo's text
    trace = _RankTrace("ring attention with your merge")
    traced_fn = trace.learners(fn, "your merge", where)

    def learners_merge(out, lse, o_t, lse_t):
        if inside[0]:  # the learner's code called context._merge, i.e. this wrapper
            _library_merge_refused(out, lse, o_t, lse_t)
        inside[0] = True
        try:
            res = traced_fn(out, lse, o_t, lse_t)
        finally:
            inside[0] = False
        calls[0] += 1
        return _merge_result(res, (tuple(out.shape), tuple(lse.shape)), where)

    library = context._merge
    learners_merge.__wrapped_library__ = library
    context._merge = learners_merge
    try:
        with _LibraryMergeDisabled(), trace:
            core = context.RingAttentionCore(comm, "cp", layout)
            out, lse = core.ring_forward(*mine)
            dq, dk, dv = core.ring_backward(*mine, out, lse, grad[:, :, pos].contiguous())
    finally:
        context._merge = library
    diffs = {"out": (out - ref[:, :, pos]).abs().max().item(),
             "lse": (lse - ref_lse[:, :, pos]).abs().max().item()}
    for name, mine_g, f in zip(("dq", "dk", "dv"), (dq, dk, dv), full):
        diffs[name] = (mine_g - f.grad[:, :, pos]).abs().max().item()
    return {"rank": r, "diffs": diffs, "calls": calls[0],
            "tiles_computed": sum(t["computed"] for t in core.tiles)}


def check_merge(fn, cases=MERGE_CHECK_CASES, shape=MERGE_CHECK_SHAPE) -> Grade:
    """`fn(out, lse, out_t, lse_t) -> (out, lse)` must fold a block's partial attention result
    into the running one: out [b, a, n, d] is the attention output of n query rows over the keys
    seen so far (normalised), lse [b, a, n] the log of their softmax sum; out_t, lse_t the same
    over a new block of keys. The result is out and lse over both blocks' keys together.

    First one merge at a time in this process (random values, the first merge of a row from
    out = 0 and lse = -inf, and scores large enough to overflow e^lse in fp32), naming the usual
    mistakes (the old output not rescaled, max instead of the log-sum-exp, ...). Then on real
    ranks: the library's ring attention (RingAttentionCore.ring_forward and ring_backward) with
    `fn` in place of its `_merge`, at each (C, layout) of `cases`, against torch's SDPA on the
    whole sequence: every rank's output, log-sum-exp and dq, dk, dv within MERGE_TOLERANCE.
    Throughout, the library's own `_merge` is disabled (it raises): an answer that calls it is
    refused, saying so. A merge that raises on one rank only is named with that rank; one that
    never returns on a rank stops the check after CHECK_PG_TIMEOUT seconds of waiting, saying
    which rank was still in it and what the others waited on."""
    from ..launch import run_ranks

    try:
        _merge_diagnosis(fn)
    except NotImplementedError:
        return Grade("not attempted", _MERGE_STUB)
    summary = []
    for c, layout in cases:
        cfg = RunConfig(cp=c, cp_impl="zigzag" if layout == "zigzag" else "ring",
                        seq=shape[2], heads=shape[1])
        results = _on_ranks(lambda: run_ranks(_merge_rank, c, cfg.to_dict(), layout, fn, shape,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _MERGE_STUB, f"at C={c} ({layout})")
        if isinstance(results, Grade):
            return results
        per_rank = sorted((res.value for res in results), key=lambda x: x["rank"])
        at = f"at C={c} ({layout} chunks)"
        what = {"out": "attention output", "lse": "log-sum-exp", "dq": "dq", "dk": "dk", "dv": "dv"}
        # the forward first: a wrong output on one rank spoils every rank's dk, dv (they travel)
        for keys in (("out", "lse"), ("dq", "dk", "dv")):
            for row in per_rank:
                bad = {k: row["diffs"][k] for k in keys if not row["diffs"][k] <= MERGE_TOLERANCE}
                if not bad:  # (a nan is never <= the tolerance)
                    continue
                worst = ", ".join(f"{what[k]} by {v:.2e}" for k, v in bad.items())
                hint = ("" if keys[0] == "out" else " (the gradients use the forward's lse: is it "
                        "the log-sum-exp over every key seen?)")
                raise AssertionError(f"{at}: rank {row['rank']}'s ring attention with your merge "
                                     f"differs from torch SDPA on the whole sequence: {worst} "
                                     f"(tolerance {MERGE_TOLERANCE:.0e}){hint}")
        summary.append({"cp": c, "layout": layout,
                        "max_abs_diff": max(max(r["diffs"].values()) for r in per_rank),
                        "merges_per_rank": [r["calls"] for r in per_rank],
                        "tiles_computed": [r["tiles_computed"] for r in per_rank]})
    worst = max(row["max_abs_diff"] for row in summary)
    where = ", ".join(f"C={row['cp']} {row['layout']}" for row in summary)
    return Grade("correct", f"ring attention with your merge equals torch SDPA on the whole "
                 f"sequence (output, log-sum-exp, dq, dk, dv; max |diff| {worst:.1e}) at {where}, "
                 f"the library's own merge disabled", {"runs": summary})


# ---------------------------------------------------------------------------------------------
# lesson 07: top-k routing with capacity (the mixture-of-experts router)
# ---------------------------------------------------------------------------------------------
# The learner's route(logits, k, cap) -> moe.Routing goes where the library's is, the MoE layer's
# `routing` seam; their capacity(tokens, experts, k, factor), if given, computes the cap it gets.
# In-process probes first (named mistakes), then training runs on real ranks with expert
# parallel: every MoE layer of the ep run routes with the learner's code, compared with the same
# run routed by the library (drops, losses) and with the single-process reference (parameters).
ROUTE_RUN_CASES = (
    dict(dp=2, ep=2, experts=4, top_k=1, capacity_factor=1.0, layers=2),
    dict(dp=4, ep=4, experts=8, top_k=2, capacity_factor=1.25, layers=4, moe_every=2,
         grad_accum=2),
)
ROUTE_RUN_COMMON = dict(d_model=64, heads=4, seq=32, vocab=128, batch=8, steps=2)
ROUTE_TOLERANCE = 1e-5  # fp32: a gate written another way (e.g. a softmax over the k chosen
#                          logits) is equal up to rounding, and so is the training
CAPACITY_CASES = ((32, 8, 2, 1.0), (32, 8, 1, 1.0), (10, 4, 1, 1.0), (32, 8, 2, 1.1),
                  (32, 8, 2, 1.25), (6, 4, 1, 0.5), (12, 4, 2, 1.5))
_ROUTE_STUB = ("route still raises NotImplementedError: write it, then run this cell again.")
_CAPACITY_STUB = ("capacity still raises NotImplementedError: write it (and route), then run "
                  "this cell again.")
_ROUTING_FIELDS = ("expert", "gate", "slot", "keep", "probs")


def _library_route_refused(*args, **kwargs):
    """Swapped in for the code of moe.route while a learner's routing runs (a literal message:
    the code object runs with the library module's globals)."""
    raise AssertionError("your code called the library's own route (parallel_mini.moe.route, "
                         "also MoE.routing), which the checker disables while your code runs: "
                         "write the routing yourself, with torch operations (softmax, sort, ...)")


def _library_capacity_refused(*args, **kwargs):
    raise AssertionError("your code called the library's own capacity (parallel_mini.moe."
                         "capacity), which the checker disables while your code runs: write "
                         "the formula yourself (math.ceil)")


def _library_dispatch_refused(*args, **kwargs):
    raise AssertionError("your code called the library's own dispatch_order (parallel_mini.moe."
                         "dispatch_order), which the checker disables while your code runs: it "
                         "consumes a Routing, route has to make one")


class _LibraryRoutingDisabled(_CodeSwapped):
    """While active, moe.route, moe.capacity and moe.dispatch_order raise (their code objects
    swapped), so an answer calling any of them, by whatever name, is refused. Restored on exit."""

    RAISERS = (("route", _library_route_refused), ("capacity", _library_capacity_refused),
               ("dispatch_order", _library_dispatch_refused))

    def swaps(self):
        from .. import moe
        return [(getattr(moe, name), raiser) for name, raiser in self.RAISERS]


def _capacity_rule(tokens: int, experts: int, k: int, factor: float) -> int:
    """Written out here: the library's capacity is disabled while a learner's code runs."""
    import math
    return math.ceil(factor * tokens * k / experts)


def _queue_slots(expert, E: int, order: str = "choice"):
    """Each assignment's place in its expert's queue, [g, t, k] int64. order "choice": the right
    one (first choices in token order, then second choices, ..., a queue per routing group);
    the usual mistakes: "token" (token by token, each token's k choices together), "per-choice"
    (every choice column a queue of its own), "one-queue" (one queue over all the groups)."""
    import torch

    g, t, k = expert.shape
    ex = expert.tolist()
    slot = [[[0] * k for _ in range(t)] for _ in range(g)]
    shared = [0] * E
    for gi in range(g):
        taken = shared if order == "one-queue" else [0] * E
        pairs = ([(ti, j) for ti in range(t) for j in range(k)] if order == "token"
                 else [(ti, j) for j in range(k) for ti in range(t)])
        for ti, j in pairs:
            if order == "per-choice" and ti == 0:
                taken = [0] * E
            e = ex[gi][ti][j]
            slot[gi][ti][j] = taken[e]
            taken[e] += 1
    return torch.tensor(slot, dtype=torch.long).view(g, t, k)


def _route_rule(logits, k: int, ties: str = "lower"):
    """(probs, expert, gate) as the library's rule gives them, written out here; ties="higher"
    breaks ties toward the higher expert index instead (a mistake the checker names)."""
    import torch

    probs = logits.float().softmax(-1)  # [g, t, E]
    E = probs.shape[-1]
    if ties == "higher":
        p_sorted, e_sorted = torch.sort(probs.flip(-1), dim=-1, descending=True, stable=True)
        e_sorted = E - 1 - e_sorted
    else:
        p_sorted, e_sorted = torch.sort(probs, dim=-1, descending=True, stable=True)
    top = p_sorted[..., :k]
    return probs, e_sorted[..., :k], top / top.sum(-1, keepdim=True)


def _route_probes():
    """(name, logits [g, t, E], k, cap) for the in-process checks, fp32."""
    import torch

    g = torch.Generator().manual_seed(7)
    ties = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 0.0], [0.0, 3.0, 0.0, 3.0],
                          [5.0, 1.0, 1.0, 1.0], [0.0, 1.0, 2.0, 3.0]]])
    bias4 = torch.tensor([1.5, 1.0, 0.0, -1.0])
    bias8 = torch.tensor([1.5, 1.2, 0.8, 0.4, 0.0, -0.4, -0.8, -1.2])
    return [
        ("tied probabilities", ties, 2, 2),
        ("two sequences of 12 tokens, k = 2", 2 * torch.randn(2, 12, 4, generator=g) + bias4, 2,
         _capacity_rule(12, 4, 2, 1.0)),
        ("two sequences of 10 tokens, 8 experts, k = 3",
         2 * torch.randn(2, 10, 8, generator=g) + bias8, 3, _capacity_rule(10, 8, 3, 1.0)),
        ("three sequences of 8 tokens, k = 1", 2 * torch.randn(3, 8, 4, generator=g) + bias4, 1,
         _capacity_rule(8, 4, 1, 1.0)),
    ]


def _routing_result(r, g: int, t: int, k: int, E: int, where: str):
    """The learner's return value checked for its form: fields, shapes, dtypes."""
    import torch

    if isinstance(r, (tuple, list)):
        raise AssertionError(f"{where}: route returned a {type(r).__name__} of {len(r)}; return "
                             f"moe.Routing(expert=..., gate=..., slot=..., keep=..., probs=...), "
                             f"the fields by name")
    missing = [n for n in _ROUTING_FIELDS if not isinstance(getattr(r, n, None), torch.Tensor)]
    if missing:
        raise AssertionError(f"{where}: route's result has no tensor {', '.join(missing)}; return "
                             f"moe.Routing(expert, gate, slot, keep, probs)")
    want = {"expert": ((g, t, k), "int64"), "gate": ((g, t, k), "float"),
            "slot": ((g, t, k), "int64"), "keep": ((g, t, k), "bool"),
            "probs": ((g, t, E), "float")}
    for name, (shape, kind) in want.items():
        x = getattr(r, name)
        if tuple(x.shape) != shape:
            raise AssertionError(f"{where}: {name} has shape {list(x.shape)}; for logits "
                                 f"[g, t, E] = [{g}, {t}, {E}] and k = {k} it is {list(shape)}")
        ok = {"int64": x.dtype == torch.long, "bool": x.dtype == torch.bool,
              "float": x.dtype.is_floating_point}[kind]
        if not ok:
            hint = {"int64": " (torch.long: F.one_hot and indexing need it; .long() converts)",
                    "bool": " (a mask: slot < cap gives one)",
                    "float": ""}[kind]
            raise AssertionError(f"{where}: {name} is {x.dtype}; it must be "
                                 f"{'a floating type' if kind == 'float' else kind}{hint}")
    return r


def _first_difference(got, want) -> tuple:
    """(g, t, j) of the first element where two [g, t, k] tensors differ."""
    return tuple(int(i) for i in (got != want).nonzero()[0])


def _routing_diagnosis(fn, name: str, logits, k: int, cap: int) -> None:
    """One probe: the learner's route on `logits`, checked field by field against the rule, the
    usual mistakes named. Raises NotImplementedError (the stub) or AssertionError."""
    import torch

    def close(a, b, tol=1e-6):
        return torch.allclose(a.double(), b.double(), rtol=10 * tol, atol=tol)

    g, t, E = logits.shape
    where = f"on the example '{name}' (logits of shape [{g}, {t}, {E}], k = {k}, cap = {cap})"
    leaf = logits.clone().requires_grad_()
    with _LibraryRoutingDisabled():
        try:
            r = fn(leaf, k, cap)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as e:  # noqa: BLE001 - the learner's code: say what it raised
            raise AssertionError(f"{where}: route raised {type(e).__name__}: {e}") from None
    r = _routing_result(r, g, t, k, E, where)
    probs, expert, gate = _route_rule(logits, k)
    # probs: the router's softmax over the E experts
    if not close(r.probs.detach(), probs):
        why = ("probs holds the logits: it is their softmax over the E experts"
               if close(r.probs.detach(), logits) else
               "probs must be the softmax of the logits over the experts (the last dimension), "
               "in fp32")
        raise AssertionError(f"{where}: {why}")
    # expert: the k most probable, most probable first, ties to the lower index
    if not torch.equal(r.expert, expert):
        gi, ti, _ = _first_difference(r.expert, expert)
        row = logits[gi, ti].tolist()
        got, right = r.expert[gi, ti].tolist(), expert[gi, ti].tolist()
        at = f"token {ti}" + (f" of sequence {gi}" if g > 1 else "") + f" (logits {row})"
        p_row = probs[gi, ti]
        tied = bool((p_row[right].unsqueeze(-1) == p_row).sum(-1).gt(1).any())
        if torch.equal(r.expert, _route_rule(logits, k, ties="higher")[1]):
            why = (f"ties are broken toward the higher index: {at} got experts {got}, the rule "
                   f"{right}. Among equal probabilities the lower expert index comes first, so "
                   f"that every rank (and every run) picks the same experts: a stable sort "
                   f"keeps equal values in index order (torch.sort(..., descending=True, "
                   f"stable=True))")
        elif tied:
            why = (f"{at} has tied probabilities: your route chose experts {got}, the rule "
                   f"{right}, the lower index first among equal probabilities. torch.topk "
                   f"makes no promise about the order of equal values (here it does not give "
                   f"the lower index); sort with torch.sort(probs, descending=True, stable=True)")
        elif sorted(got) == sorted(right) and got == sorted(got):
            why = (f"{at}: experts {got} are listed by index; list them most probable first, "
                   f"{right} (the first choice queues before the second)")
        elif sorted(got) == sorted(right):
            why = f"{at}: experts {got} must be listed most probable first: {right}"
        elif set(got) == set(probs[gi, ti].argsort()[:k].tolist()):
            why = (f"{at} went to its {k} least probable experts {got}; the rule takes the most "
                   f"probable, {right}")
        else:
            why = (f"{at} went to experts {got}; the {k} most probable are {right}, most "
                   f"probable first")
        raise AssertionError(f"{where}: {why}")
    # gate: the chosen probabilities renormalised over the k, carrying the router's gradient
    top = probs.gather(-1, expert)
    if not close(r.gate.detach(), gate):
        if k > 1 and close(r.gate.detach(), top):
            why = ("the gates are not renormalised: they are the router's probabilities of the "
                   "chosen experts, which sum to less than 1. Divide by their sum over the k, "
                   "so that a token's output is a weighted mean of its experts' outputs")
        elif close(r.gate.detach(), torch.full_like(gate, 1.0 / k)):
            why = (f"every gate is 1/k = {1 / k:.3g}: each is the chosen expert's probability "
                   f"divided by the sum of the k chosen probabilities")
        else:
            why = (f"the gates differ from the chosen probabilities renormalised over the k by "
                   f"up to {(r.gate.detach().double() - gate.double()).abs().max().item():.2e}")
        raise AssertionError(f"{where}: {why}")
    for field_name in ("gate", "probs"):
        if not getattr(r, field_name).requires_grad:
            raise AssertionError(
                f"{where}: {field_name} carries no gradient to the router (it was computed from "
                f"detached values, .tolist() or .item(), or under torch.no_grad). The router "
                f"learns through the gates (and the load-balancing loss through probs): compute "
                f"them from the logits with torch operations")
    weights = torch.randn(g, t, k, generator=torch.Generator().manual_seed(8))
    (got_grad,) = torch.autograd.grad((r.gate * weights).sum(), leaf, allow_unused=True)
    want_leaf = logits.clone().requires_grad_()
    (want_grad,) = torch.autograd.grad((_route_rule(want_leaf, k)[2] * weights).sum(), want_leaf)
    if got_grad is None or not close(got_grad, want_grad, 1e-5):
        raise AssertionError(f"{where}: the gates' gradient with respect to the logits differs "
                             f"from the rule's: compute the gates from the softmax of the logits "
                             f"(not from detached or re-created tensors)")
    # slot: the place in the expert's queue, first choices first, a queue per sequence
    slot = _queue_slots(expert, E)
    if not torch.equal(r.slot, slot):
        gi, ti, j = _first_difference(r.slot, slot)
        at = (f"token {ti}" + (f" of sequence {gi}" if g > 1 else "") + f", choice {j + 1} "
              f"(expert {int(expert[gi, ti, j])}): slot {int(r.slot[gi, ti, j])}, the rule "
              f"{int(slot[gi, ti, j])}")
        if torch.equal(r.slot, slot + 1):
            why = (f"the slots count from 1 ({at}). A slot is the number of assignments queued "
                   f"before this one: the first in a queue has slot 0, and slots 0 to cap - 1 "
                   f"are kept")
        elif torch.equal(r.slot, _queue_slots(expert, E, "token")):
            why = (f"the queues are filled token by token, each token's k choices together "
                   f"({at}). Every token's first choice queues first, in token order, then the "
                   f"second choices: a token's second choice must not take the place of a later "
                   f"token's first choice")
        elif torch.equal(r.slot, _queue_slots(expert, E, "per-choice")):
            why = (f"each choice starts a queue of its own ({at}): the second choices queue "
                   f"behind all the first choices for the same expert, in the same queue")
        elif torch.equal(r.slot, _queue_slots(expert, E, "one-queue")):
            why = (f"one queue runs over all the sequences ({at}): the routing group is one "
                   f"sequence, and each has its own queues (its own cap slots per expert)")
        elif torch.equal(r.slot[slot < cap], slot[slot < cap]):
            why = (f"the kept assignments have the right slots, the dropped ones not ({at}): a "
                   f"slot is the place in the queue for every assignment, >= cap for a dropped "
                   f"one")
        else:
            why = (f"{at}. A slot is the number of assignments queued before this one for the "
                   f"same expert")
        raise AssertionError(f"{where}: {why}")
    # keep: slot < cap
    keep = slot < cap
    if not torch.equal(r.keep, keep):
        if bool(r.keep.all()) and bool((slot > cap).any()):
            why = (f"nothing was dropped, though {int((~keep).sum())} assignments found their "
                   f"expert's queue full: keep = slot < cap")
        elif torch.equal(r.keep, slot <= cap):
            why = (f"capacity off by one: an expert kept cap + 1 = {cap + 1} assignments of a "
                   f"sequence. Slots start at 0, so slots 0 to cap - 1 are the cap kept: keep = "
                   f"slot < cap")
        elif torch.equal(r.keep, slot < cap - 1):
            why = (f"capacity off by one: an expert kept cap - 1 = {cap - 1} assignments of a "
                   f"sequence; keep = slot < cap")
        else:
            gi, ti, j = _first_difference(r.keep, keep)
            why = (f"token {ti}" + (f" of sequence {gi}" if g > 1 else "") + f", choice {j + 1}: "
                   f"keep {bool(r.keep[gi, ti, j])}, the rule {bool(keep[gi, ti, j])} (slot "
                   f"{int(slot[gi, ti, j])}, cap {cap}): keep = slot < cap")
        raise AssertionError(f"{where}: {why}")


def _capacity_diagnosis(capacity_fn) -> None:
    """The learner's capacity on CAPACITY_CASES, the usual mistakes named."""
    import math
    import numbers

    for tokens, E, k, F in CAPACITY_CASES:
        where = f"capacity(tokens={tokens}, experts={E}, k={k}, factor={F})"
        with _LibraryRoutingDisabled():
            try:
                got = capacity_fn(tokens, E, k, F)
            except (NotImplementedError, AssertionError):
                raise
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{where} raised {type(e).__name__}: {e}") from None
        want = _capacity_rule(tokens, E, k, F)
        exact = F * tokens * k / E
        if not isinstance(got, numbers.Integral) or isinstance(got, bool):
            raise AssertionError(f"{where} returned {got!r} ({type(got).__name__}); return an int "
                                 f"(a number of slots: math.ceil gives one)")
        if got == want:
            continue
        if got == math.floor(exact):
            why = (f"rounds down: F·tokens·k/E = {exact:g} gives {want} slots (math.ceil), not "
                   f"{got}. Rounding down would leave the fair share's remainder without a slot")
        elif got == round(exact):
            why = (f"rounds to the nearest: F·tokens·k/E = {exact:g} rounds up, to {want} "
                   f"(math.ceil)")
        elif got == want + 1:
            why = (f"one slot too many: F·tokens·k/E = {exact:g}, so {want} (math.ceil; an "
                   f"integer needs no extra slot)")
        elif got == math.ceil(F * tokens / E):
            why = (f"k is missing: each token makes k = {k} assignments, so the fair share is "
                   f"tokens·k/E; ceil(F·tokens·k/E) = {want}")
        elif got == math.ceil(tokens * k / E):
            why = f"the capacity factor is missing: ceil(F·tokens·k/E) = ceil({exact:g}) = {want}"
        else:
            why = f"returned {got}; ceil(F·tokens·k/E) = ceil({exact:g}) = {want}"
        raise AssertionError(f"{where} {why}")


def _learners_routing(fn, capacity_fn, factor: float, calls: list, where: str, trace):
    """The function put in a MoE layer's `routing` seam on a rank: the learner's capacity (if
    any) computes the cap, the learner's route routes, the library's own disabled meanwhile;
    both run as the learner's code under the rank's `trace` (_RankTrace.learners)."""
    route_fn = trace.learners(fn, "your route", where)
    cap_fn = capacity_fn and trace.learners(capacity_fn, "your capacity", where)

    def routing(logits, k, cap):
        g, t, E = logits.shape
        with _LibraryRoutingDisabled():
            if cap_fn is not None:
                cap = cap_fn(t, E, k, factor)
            r = route_fn(logits, k, cap)
        calls.append(1)
        return _routing_result(r, g, t, k, E, where)

    return routing


def _route_rank(cfg_dict: dict, fn, capacity_fn) -> dict:
    """One rank of the routing check: engine.train_rank with every MoE layer's `routing` seam
    set to the learner's function (the single-process reference, which rank 0 then trains for
    the comparison, keeps the library's route)."""
    from .. import engine

    import torch.distributed as dist

    cfg = RunConfig.from_dict(cfg_dict)
    calls: list = []
    original = engine.apply_expert_parallel
    where = f"at {_case_name(cfg)}, rank {dist.get_rank()}"
    # every collective of the run traced: a route that hangs, or raises, on one rank only is
    # reported as who waited on what within CHECK_PG_TIMEOUT, not as gloo's text
    trace = _RankTrace("the training run with your route")

    def apply_with_learners_routing(model, comm, axis, loss_scale=1.0):
        experts = original(model, comm, axis, loss_scale)
        for layer in experts.layers:
            layer.routing = _learners_routing(fn, capacity_fn, cfg.capacity_factor, calls, where,
                                              trace)
        return experts

    engine.apply_expert_parallel = apply_with_learners_routing
    try:
        with trace:
            out = engine.train_rank(cfg_dict)
    finally:
        engine.apply_expert_parallel = original
    out["route_calls"] = len(calls)
    return out


def _case_name(cfg) -> str:
    return f"dp={cfg.dp} x ep={cfg.ep} (E={cfg.experts}, k={cfg.top_k}, F={cfg.capacity_factor:g})"


def _compare_route_runs(cfg, mine, library) -> None:
    """The learner's run against the library's (the same config): every rank's routing log (the
    assignments kept per expert and the dropped ones, per layer and micro-batch), the losses, and
    the final parameters against the single-process reference."""
    case = _case_name(cfg)
    micro = cfg.grad_accum
    n_moe = len(theory.moe_blocks(cfg.layers, cfg.experts, cfg.moe_every))
    for r in mine.ranks:
        want_calls = n_moe * micro * cfg.steps
        if r["route_calls"] != want_calls:  # the seam was not used: the checker itself is wrong
            raise AssertionError(f"at {case}: your route ran {r['route_calls']} times on rank "
                                 f"{r['rank']}, not {want_calls} (MoE layers x micro-batches x "
                                 f"steps): the checker could not put it in place")
    for r_mine, r_lib in zip(mine.ranks, library.ranks):
        if len(r_mine["moe"]["log"]) != len(r_lib["moe"]["log"]):
            raise AssertionError(f"at {case}: rank {r_mine['rank']} logged "
                                 f"{len(r_mine['moe']['log'])} MoE forwards with your route, "
                                 f"{len(r_lib['moe']['log'])} with the library's")
    # the earliest forward first, over all ranks: a route wrong on one rank changes every rank's
    # training after the step's gradient sync, and that later difference is not the news
    for i in range(max(len(r["moe"]["log"]) for r in mine.ranks)):
        for r_mine, r_lib in zip(mine.ranks, library.ranks):
            if i >= len(r_mine["moe"]["log"]):  # (a pipeline stage logs its own layers only)
                continue
            a, b = r_mine["moe"]["log"][i], r_lib["moe"]["log"][i]
            if (a["kept"], a["dropped"]) != (b["kept"], b["dropped"]):
                raise AssertionError(
                    f"at {case}: rank {r_mine['rank']}, step {a['step']}, layer {a['layer']}: "
                    f"with your route the experts kept {a['kept']} assignments and dropped "
                    f"{a['dropped']}; with the library's route {b['kept']} and {b['dropped']}")
    loss_diff = max(abs(x - y) for x, y in zip(mine.losses, library.losses))
    if not loss_diff <= ROUTE_TOLERANCE:
        raise AssertionError(f"at {case}: the losses with your route {mine.losses} differ from "
                             f"the library's {library.losses} by {loss_diff:.2e}")
    detail = mine.max_abs_diff_detail
    if not max(detail.values()) <= ROUTE_TOLERANCE:
        raise AssertionError(f"at {case}: after training with your route the final parameters "
                             f"differ from the single-process reference (the library's route) "
                             f"by {detail['params']:.2e}, the losses by {detail['losses']:.2e}")


def check_route(fn, capacity=None, cases=ROUTE_RUN_CASES) -> Grade:
    """`fn(logits, k, cap) -> moe.Routing` must route like the library's moe.route: logits
    [g, t, E] (g routing groups, here sequences, of t tokens); per token the k experts of highest
    softmax probability, most probable first, ties to the lower expert index (`expert`, int64);
    their probabilities renormalised over the k (`gate`, with the router's gradient); each
    assignment's place in its expert's queue, first choices in token order before second choices,
    a queue per group (`slot`, int64); `keep` = slot < cap (bool); `probs` the softmax [g, t, E].
    `capacity(tokens, experts, k, factor)`, if given, must be ceil(factor * tokens * k / experts),
    and gives the cap on the ranks.

    First in this process: capacity on CAPACITY_CASES, then route on small examples (tied
    probabilities, drops, k = 1, 2, 3), naming the usual mistakes (ties to the higher index,
    queues filled token by token, capacity off by one or rounded down, gates not renormalised or
    without gradient). Then on real ranks, for each case: a training run with expert parallel in
    which every MoE layer routes with `fn` (its `routing` seam), against the same run with the
    library's route: the same assignments kept and dropped in every layer, micro-batch and rank,
    the same losses, and final parameters equal to the single-process reference (within
    ROUTE_TOLERANCE). Throughout, the library's route, capacity and dispatch_order are disabled
    (they raise) while the learner's code runs: an answer calling them is refused, saying so.
    On the ranks, a route (or capacity) that raises on one rank only is named with that rank, one
    that calls a collective is refused, and one that never returns on a rank stops the check
    after CHECK_PG_TIMEOUT seconds of waiting, saying which rank was still in it and what the
    others waited on (e.g. the MoE layer's all-to-all, with its rows per rank)."""
    from ..engine import run
    from ..launch import run_ranks
    from ..report import merge_rank_results

    try:
        if capacity is not None:
            _capacity_diagnosis(capacity)
    except NotImplementedError:
        return Grade("not attempted", _CAPACITY_STUB)
    try:
        for name, logits, k, cap in _route_probes():
            _routing_diagnosis(fn, name, logits, k, cap)
    except NotImplementedError:
        return Grade("not attempted", _ROUTE_STUB)
    summary = []
    for case in cases:
        cfg = RunConfig(**{**ROUTE_RUN_COMMON, **case}, reference=True).validate()
        results = _on_ranks(lambda: run_ranks(_route_rank, cfg.world_size, cfg.to_dict(), fn,
                                              capacity, timeout=120.0,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _ROUTE_STUB, f"at {_case_name(cfg)}")
        if isinstance(results, Grade):
            return results
        mine = merge_rank_results(cfg, [res.value for res in results])
        library = run(cfg.replace(reference=False))
        _compare_route_runs(cfg, mine, library)
        summary.append({"case": _case_name(cfg), "config": cfg.to_dict(), "report": mine,
                        "library": library,
                        "route_calls_per_rank": [r["route_calls"] for r in mine.ranks],
                        "dropped": sum(e["dropped"] for r in mine.ranks for e in r["moe"]["log"]),
                        "assignments": sum(sum(e["routed"]) for r in mine.ranks
                                           for e in r["moe"]["log"]),
                        "max_abs_diff": mine.max_abs_diff})
    worst = max(row["max_abs_diff"] for row in summary)
    dropped = sum(row["dropped"] for row in summary)
    return Grade("correct", f"your {'capacity and ' if capacity is not None else ''}route trained "
                 f"the MoE model with expert parallel on real ranks exactly as the library's: the "
                 f"same {dropped} assignments dropped, every layer, step and rank, the same "
                 f"losses, final parameters equal to the single-process reference (max |diff| "
                 f"{worst:.1e}) at " + ", ".join(row["case"] for row in summary)
                 + "; the library's route, capacity and dispatch_order disabled while yours ran",
                 {"runs": summary})


# ---------------------------------------------------------------------------------------------
# predictions: what the learner wrote down before a live cell, against what the cell got
# ---------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def compare_prediction(guess, actual, what: str, source: str = "measured", formula: str = "",
                       choices=None, rel_tol: float = 0.02) -> str:
    """One line for a lesson: the learner's prediction `guess` (written down in the cell before
    the live one) against `actual`, which the live cell `source` ("measured", "counted", "theory"),
    with the `formula` that predicts it. `choices`: the answers a choice question offers (then
    `actual` is one of them and the comparison is exact, ignoring case); otherwise numbers match
    within `rel_tol`. A guess of None prints the value and the formula only."""
    line = f"{what}: {source} {_fmt(actual)}" + (f" ({formula})" if formula else "")
    if guess is None:
        return line + ". Write your prediction in the cell above first, then run this one again."
    if choices is not None:
        if not isinstance(guess, str) or guess.strip().lower() not in [c.lower() for c in choices]:
            return (line + f". Your prediction {guess!r} is not one of the choices: "
                    + ", ".join(repr(c) for c in choices))
        ok = guess.strip().lower() == str(actual).lower()
        return line + f". You predicted {guess!r}: " + ("right." if ok else "not what happened.")
    try:
        g = float(guess)
    except (TypeError, ValueError):
        return line + f". Your prediction {guess!r} is not a number."
    a = float(actual)
    if abs(g - a) <= rel_tol * max(abs(a), 1e-12):
        return line + f". You predicted {_fmt(guess)}: right."
    ratio = f", {g / a:.3g} x the {source} value" if a else ""
    return line + f". You predicted {_fmt(guess)}: off{ratio}."


# ---------------------------------------------------------------------------------------------
# lessons 08 and 09: model states per rank of a composed layout; a layout that fits a budget
# ---------------------------------------------------------------------------------------------
# Both exercises are about prediction, so the library functions that would answer them are
# disabled while the learner's code runs: theory's per-rank model (run_theory and the pieces it
# is built from), the planner, and live runs (engine.run). Each raises an AssertionError naming
# itself; the checker computes its own expectations before and after, never during.
_STATE_KEYS = ("params", "grads", "optimizer")


def _refusal(qualified: str, advice: str):
    """A function with no closure whose body raises a literal message: its code object can be
    swapped into any library function (the code runs with that module's globals)."""
    message = (f"your code called the library's own {qualified}, which the checker disables "
               f"while your code runs: {advice}")
    ns: dict = {}
    exec(f"def refused(*args, **kwargs):\n    raise AssertionError({message!r})\n", ns)
    return ns["refused"]


class _LibraryFunctionsDisabled(_CodeSwapped):
    """While active, each (module, name) raises (its code object swapped for a refusal), so an
    answer calling it, by whatever name it was imported under, is refused. Restored on exit."""

    def __init__(self, targets, advice: str):
        self.targets, self.advice = targets, advice

    def swaps(self):
        import importlib
        out = []
        for module, name in self.targets:
            fn = getattr(importlib.import_module(f"parallel_mini.{module}"), name)
            fn = getattr(fn, "__wrapped__", fn)  # functools wrappers: the function inside
            out.append((fn, _refusal(f"{module}.{name}", self.advice)))
        return out


_PER_RANK_THEORY = (("theory", "run_theory"), ("theory", "_rank_theory"),
                    ("theory", "_pipeline_theory"), ("theory", "model_state_bytes"),
                    ("theory", "gpt_unit_sizes"), ("theory", "gpt_local_param_count"),
                    ("theory", "pipeline_stage_units"))
_PLANNER = (("planner", "plan"), ("planner", "predict"), ("planner", "stage_states"),
            ("planner", "validate_on_toy_runs"), ("planner", "enumerate_layouts"))
_LIVE = (("engine", "run"),)


# -- lesson 08: states_per_rank(cfg) -> {rank: {params, grads, optimizer}} --------------------
STATES_CASES = (  # in this process, against theory; (what the case is about, RunConfig fields)
    ("dp2 x tp2 x pp2", dict(dp=2, tp=2, pp=2, layers=2)),
    ("tp2 x pp2, 4 layers", dict(tp=2, pp=2, layers=4)),
    ("pp4 x dp2 ZeRO-1 (middle stages)", dict(dp=2, pp=4, layers=4, zero=1)),
    ("dp2 x pp2 ZeRO-2", dict(dp=2, pp=2, layers=2, zero=2)),
    ("dp2 x cp2 x tp2 ZeRO-1", dict(dp=2, cp=2, tp=2, layers=2, zero=1)),
    ("dp2 x cp2 x tp2 x pp2 ZeRO-1", dict(dp=2, cp=2, tp=2, pp=2, layers=2, zero=1)),
    ("dp3 ZeRO-1 (padding)", dict(dp=3, layers=2, zero=1, batch=6)),
    ("dp3 x tp2 ZeRO-2 (padding)", dict(dp=3, tp=2, layers=2, zero=2, batch=6)),
)
# live: lesson 08's 4-D layout on 16 ranks, at its tiny sizes (16 processes train in seconds)
STATES_LIVE = dict(dp=2, cp=2, tp=2, pp=2, zero=1, layers=2, d_model=32, heads=2, seq=16,
                   vocab=64, batch=4, microbatches=2, steps=1)
_STATES_STUB = ("states_per_rank still raises NotImplementedError: write it, then run this cell "
                "again.")


def _states_rule(cfg, whole: bool = False, tp_splits_all: bool = False, even: bool = False,
                 pp_fastest: bool = False, pad: bool = True, grads_as: int | None = None,
                 shard_cp: bool = True, optimizer_sharded: bool = True) -> dict:
    """Model-state bytes per rank (fp32, Adam), written out here (theory's functions are
    disabled while a learner's code runs); the keyword arguments are the usual mistakes, for
    naming them. Per pipeline stage, on one tensor-parallel rank: L/pp blocks of (12h^2 + 7h)/t +
    6h (the matrices and column-parallel biases split, LayerNorms and row-parallel biases
    whole), the first stage adds v*h/t + s*h (token table split, positions whole), the last
    2h + h*v/t (final LayerNorm, LM head split). ZeRO-1: optimizer states / N; ZeRO-2: gradients
    too, N = dp x cp, the stage's parameters padded to a multiple of N."""
    h, v, s, L = cfg.d_model, cfg.vocab, cfg.seq, cfg.layers
    t = 1 if whole else cfg.tp
    pp = 1 if whole else cfg.pp
    if tp_splits_all:
        block, embed, head = (12 * h * h + 13 * h) // t, (v * h + s * h) // t, (2 * h + h * v) // t
    else:
        block, embed, head = (12 * h * h + 7 * h) // t + 6 * h, v * h // t + s * h, 2 * h + h * v // t
    per = L // pp
    stages = [per * block + (r == 0) * embed + (r == pp - 1) * head for r in range(pp)]
    if even:
        stages = [sum(stages) // pp] * pp
    n = cfg.dp * (cfg.cp if shard_cp else 1)
    out = {}
    for rank in range(cfg.world_size):
        stage = 0 if whole else (rank % cfg.pp if pp_fastest else rank // (cfg.world_size // cfg.pp))
        count = stages[stage]
        if cfg.zero == 0:
            out[rank] = {"params": 4 * count, "grads": 4 * count, "optimizer": 8 * count}
            continue
        padded = -(-count // n) * n if pad else count
        sharded_grads = (grads_as or cfg.zero) >= 2
        out[rank] = {"params": 4 * padded,
                     "grads": 4 * padded // n if sharded_grads else 4 * padded,
                     "optimizer": 8 * padded // n if optimizer_sharded else 8 * padded}
    return out


_STATES_MISTAKES = (
    (dict(whole=True), "every rank holds the whole model: tensor parallel keeps 1/tp of each "
     "weight matrix on a rank, and a pipeline rank keeps only its stage's layers"),
    (dict(tp_splits_all=True), "tensor parallel does not split everything: the LayerNorms, the "
     "row-parallel layers' biases and the position table stay whole on every tp rank (per block "
     "(12h^2 + 7h)/t + 6h)"),
    (dict(even=True), "the stages are not equal: the first one also holds the embeddings "
     "(v*h/t + s*h), the last one the final LayerNorm and the LM head (2h + h*v/t)"),
    (dict(pp_fastest=True), "your ranks sit on the wrong pipeline stages: the mesh puts pp "
     "outermost and tp fastest, so rank r is on stage r // (world / pp), not r % pp"),
    (dict(pad=False), "ZeRO pads the stage's flat parameter buffer to a multiple of N = dp x cp "
     "before it cuts N equal shards, and every rank keeps the padded size in params"),
    (dict(shard_cp=False), "ZeRO shards over dp x cp, not over dp alone: the context-parallel "
     "ranks hold the same weights too"),
    (dict(optimizer_sharded=False), "with ZeRO the optimizer states are sharded: 8 bytes per "
     "parameter / N on each rank"),
)


def _states_answer(got, cfg, where: str) -> dict:
    """The learner's return value, checked for shape: {rank: {params, grads, optimizer}} with
    whole numbers, for every rank of the layout."""
    if not isinstance(got, dict):
        raise AssertionError(f"{where}: states_per_rank returned {type(got).__name__}, not a dict "
                             f"{{rank: {{'params': bytes, 'grads': bytes, 'optimizer': bytes}}}}")
    ranks = sorted(got, key=str)
    if set(got) != set(range(cfg.world_size)):
        raise AssertionError(f"{where}: states_per_rank must have one entry per rank, 0 to "
                             f"{cfg.world_size - 1} (world = dp*tp*pp*cp = {cfg.world_size}); "
                             f"yours has {ranks}")
    for rank, row in got.items():
        if not isinstance(row, dict) or set(row) != set(_STATE_KEYS):
            raise AssertionError(f"{where}: rank {rank}'s entry must be a dict with exactly the "
                                 f"keys {list(_STATE_KEYS)}; yours is {row!r}")
        for k, b in row.items():
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not float(b).is_integer():
                raise AssertionError(f"{where}: rank {rank}'s {k} is {b!r}: bytes are a whole "
                                     f"number (padding makes every division exact)")
    return {r: {k: int(got[r][k]) for k in _STATE_KEYS} for r in got}


def _states_from_theory(cfg) -> dict:
    """The library's prediction, per rank (theory.run_theory: stage entries under pp)."""
    th = theory.run_theory(cfg, theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers))
    stages = th.get("stages")
    per_stage = cfg.world_size // cfg.pp
    return {r: {k: (stages[r // per_stage] if stages else th)["memory"][k] for k in _STATE_KEYS}
            for r in range(cfg.world_size)}


def _states_diagnosis(got: dict, want: dict, cfg, where: str) -> None:
    if got == want:
        return
    for kw, why in _STATES_MISTAKES:
        wrong = _states_rule(cfg, **kw)
        if wrong != want and got == wrong:
            raise AssertionError(f"{where}: {why}")
    r = min(r for r in want if got[r] != want[r])
    k = next(k for k in _STATE_KEYS if got[r][k] != want[r][k])
    hint = ""
    if cfg.zero == 1 and got[r]["grads"] * cfg.dp * cfg.cp == want[r]["grads"]:
        hint = " (ZeRO-1 shards only the optimizer states; the gradients stay whole until ZeRO-2)"
    elif cfg.zero == 2 and got[r]["grads"] == want[r]["grads"] * cfg.dp * cfg.cp:
        hint = " (ZeRO-2 shards the gradients too)"
    raise AssertionError(f"{where}: rank {r}'s {k} should be {want[r][k]:,} bytes, yours says "
                         f"{got[r][k]:,}{hint}")


def _layout_name(cfg) -> str:
    """e.g. "dp2 x tp2 x pp2 ZeRO-1": the degrees above 1 (dp1 when nothing is split)."""
    axes = [f"{a}{getattr(cfg, a)}" for a in ("dp", "cp", "tp", "pp") if getattr(cfg, a) > 1]
    return " x ".join(axes or ["dp1"]) + (f" ZeRO-{cfg.zero}" if cfg.zero else "")


def check_states_per_rank(fn, cases=STATES_CASES, live=STATES_LIVE) -> Grade:
    """`fn(cfg) -> {rank: {"params": B, "grads": B, "optimizer": B}}` must predict every rank's
    model-state bytes (fp32, Adam) for a RunConfig composed of dp, tp, pp, cp and ZeRO 0-2.

    First in this process, for each of `cases`, against theory.run_theory (the library's
    prediction), naming the usual mistakes (whole model on every rank, tensor parallel splitting
    LayerNorms too, equal stages, ranks on the wrong stage, ZeRO's padding, its shard group,
    which states each stage shards). Then one live run (`live`, 16 ranks): every rank's measured
    params/grads/optimizer bytes must equal the learner's prediction, to the byte. Throughout,
    theory's per-rank model, the planner and engine.run are disabled while `fn` runs."""
    from ..engine import run

    advice = ("count the parameters of each stage on one tensor-parallel rank yourself, then "
              "apply the 16 bytes (and ZeRO's division) to them")
    targets = _PER_RANK_THEORY + _PLANNER + _LIVE
    for name, fields in cases:
        cfg = RunConfig(**fields).validate()
        want = _states_from_theory(cfg)
        with _LibraryFunctionsDisabled(targets, advice):
            try:
                got = fn(cfg)
            except NotImplementedError:
                return Grade("not attempted", _STATES_STUB)
        got = _states_answer(got, cfg, f"at {name}")
        _states_diagnosis(got, want, cfg, f"at {name}")
    cfg = RunConfig(**live).validate()
    with _LibraryFunctionsDisabled(targets, advice):
        predicted = fn(cfg)
    where = f"live at {_layout_name(cfg)}"
    predicted = _states_answer(predicted, cfg, where)
    report = run(cfg)
    for rank in report.ranks:
        measured = {k: rank["memory"][k] for k in _STATE_KEYS}
        if measured != predicted[rank["rank"]]:
            k = next(k for k in _STATE_KEYS if measured[k] != predicted[rank["rank"]][k])
            raise AssertionError(f"{where}: rank {rank['rank']} measured {measured[k]:,} bytes "
                                 f"of {k}, you predicted {predicted[rank['rank']][k]:,}")
    total = sum(sum(m.values()) for m in predicted.values())
    return Grade("correct", f"your states_per_rank equals the library's theory on "
                 f"{len(cases)} layouts (" + ", ".join(n for n, _ in cases) + ") and what "
                 f"every rank of a live {_layout_name(cfg)} run measured, to the byte "
                 f"({total:,} bytes of model states over {cfg.world_size} ranks); theory's "
                 f"per-rank model, the planner and engine.run disabled while yours ran",
                 {"config": cfg.to_dict(), "report": report, "predicted": predicted})


# -- lesson 09: choose_layout(budget) -> {dp, tp, pp, zero} or None -----------------------------
# The toy GPT on LAYOUT_RANKS ranks, fp32 with Adam; the budget is model-state bytes per rank
# (params + grads + optimizer: what the planner's memory model and the run's meters agree on to
# the byte). The rule the lesson teaches: as much data parallel as fits, with the ZeRO stage (0-2)
# that makes it fit (ZeRO-3 fits first whenever anything does: the question here is when to split
# the model instead); tp or pp for what is left, either. None when nothing fits.
LAYOUT_RANKS = 4
LAYOUT_MODEL = dict(layers=4, d_model=64, heads=4, seq=32, vocab=128, batch=8)
LAYOUT_BUDGETS = (4_000_000, 2_500_000, 1_600_000, 1_400_000, 1_105_000, 1_000_000, 910_000,
                  800_000)
LAYOUT_LIVE_BUDGETS = (1_105_000, 910_000)
_LAYOUT_KEYS = ("dp", "tp", "pp", "zero")
_LAYOUT_STUB = ("choose_layout still raises NotImplementedError: write it, then run this cell "
                "again.")


def layout_candidates(ranks: int = LAYOUT_RANKS, model: dict | None = None) -> list[dict]:
    """Every {dp, tp, pp, zero} of `ranks` ranks the exercise considers: dp x tp x pp = ranks,
    tp dividing the heads and the vocabulary, pp at most the layers, ZeRO 0-2 (0 alone at dp 1)."""
    m = {**LAYOUT_MODEL, **(model or {})}
    out = []
    for dp in range(1, ranks + 1):
        for tp in range(1, ranks // dp + 1):
            if ranks % (dp * tp) or m["heads"] % tp or m["vocab"] % tp:
                continue
            pp = ranks // (dp * tp)
            if pp > m["layers"] or m["layers"] % pp or m["batch"] % dp:
                continue
            for zero in ((0, 1, 2) if dp > 1 else (0,)):
                out.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero})
    return out


def layout_config(layout: dict, model: dict | None = None, steps: int = 1) -> RunConfig:
    """The RunConfig of a layout on the toy (pipelines: 1F1B, 2 micro-batches per step)."""
    return RunConfig(**{**LAYOUT_MODEL, **(model or {})}, **layout, steps=steps,
                     microbatches=2 if layout["pp"] > 1 else 4, schedule="1f1b")


def planned_states(layout: dict, model: dict | None = None) -> list[int]:
    """The planner's memory model: model-state bytes (params + grads + optimizer) of each
    pipeline rank of `layout` on the toy, fp32 with Adam (planner.predict; theory, no run)."""
    from .. import planner

    m = {**LAYOUT_MODEL, **(model or {})}
    spec = planner.toy_model(**m)
    pp = layout["pp"]
    lay = planner.Layout(layout["dp"], layout["tp"], pp, 1, 1, layout["zero"],
                         "1f1b" if pp > 1 else "-", 1, 2 if pp > 1 else 1,
                         m["batch"] // layout["dp"] // (2 if pp > 1 else 1), "none", False)
    p = planner.predict(spec, lay, planner.hardware("cpu"), m["batch"], precision="fp32")
    return [sum(mem[k] for k in _STATE_KEYS) for mem in p["memory_per_rank"]]


def _layout_text(layout: dict | None) -> str:
    if layout is None:
        return "None"
    return f"dp{layout['dp']} tp{layout['tp']} pp{layout['pp']} ZeRO-{layout['zero']}"


def _layout_answer(got, budget: int, ranks: int, model: dict) -> dict | None:
    where = f"budget {budget:,} bytes"
    if got is None:
        return None
    if not isinstance(got, dict) or set(got) != set(_LAYOUT_KEYS):
        raise AssertionError(f"{where}: choose_layout must return a dict with exactly the keys "
                             f"{list(_LAYOUT_KEYS)} (or None when nothing fits); yours returned "
                             f"{got!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got.values()):
        raise AssertionError(f"{where}: every degree is a whole number; yours returned {got!r}")
    if got["dp"] * got["tp"] * got["pp"] != ranks:
        raise AssertionError(f"{where}: {_layout_text(got)} uses dp*tp*pp = "
                             f"{got['dp'] * got['tp'] * got['pp']} ranks; the job has {ranks}")
    if got["zero"] == 3:
        raise AssertionError(f"{where}: ZeRO-3 is outside this exercise (0, 1 or 2): it would fit "
                             f"first at every budget where anything fits, and the question here "
                             f"is when to split the model instead")
    if got not in layout_candidates(ranks, model):
        raise AssertionError(f"{where}: {_layout_text(got)} is not a layout of this model: tp must "
                             f"divide the {model['heads']} heads, pp the {model['layers']} layers, "
                             f"and ZeRO needs dp > 1 (stages 0-2)")
    return dict(got)


def _layout_diagnosis(got: dict | None, budget: int, table: list) -> None:
    """`table`: (layout, planned states per pipeline rank) for every candidate."""
    where = f"budget {budget:,} bytes"
    fits = [(lay, st) for lay, st in table if max(st) <= budget]
    if got is None:
        if fits:
            lay, st = max(fits, key=lambda f: f[0]["dp"])
            raise AssertionError(f"{where}: something fits, e.g. {_layout_text(lay)} "
                                 f"({max(st):,} bytes of model states on its fullest rank)")
        return
    states = next(st for lay, st in table if lay == got)
    if max(states) > budget:
        worst = states.index(max(states))
        stage = f" (pipeline stage {worst}, the one with the embeddings)" if got["pp"] > 1 and \
            worst == 0 else (f" (pipeline stage {worst})" if got["pp"] > 1 else "")
        raise AssertionError(f"{where}: {_layout_text(got)} does not fit: its fullest rank"
                             f"{stage} holds {max(states):,} bytes of model states")
    best_dp = max(lay["dp"] for lay, _ in fits)
    if got["dp"] < best_dp:
        lay, st = next((lay, st) for lay, st in fits if lay["dp"] == best_dp)
        raise AssertionError(f"{where}: {_layout_text(lay)} fits too ({max(st):,} bytes): keep "
                             f"as much data parallel as fits, and split the model only when "
                             f"ZeRO is not enough")


def check_layout_choice(fn, budgets=LAYOUT_BUDGETS, live=LAYOUT_LIVE_BUDGETS,
                        ranks: int = LAYOUT_RANKS, model: dict | None = None) -> Grade:
    """`fn(budget_bytes) -> {"dp", "tp", "pp", "zero"}` (or None) must pick, for the toy GPT on
    `ranks` ranks (fp32, Adam), a layout whose model states fit `budget_bytes` on every rank:
    the largest dp that fits (with any ZeRO stage 0-2 that makes it fit), tp and pp for the
    rest, either; None when nothing fits.

    Each budget is graded with the planner's memory model (planner.predict, per pipeline rank),
    naming the mistake (does not fit, and on which pipeline stage; a larger dp fits too;
    something fits where None was returned). Then the answers for the `live` budgets run on
    real ranks: every rank's measured params + grads + optimizer bytes must be within the budget
    and equal the planner's prediction. The planner and engine.run are disabled while `fn` runs."""
    from ..engine import run

    m = {**LAYOUT_MODEL, **(model or {})}
    table = [(lay, planned_states(lay, m)) for lay in layout_candidates(ranks, m)]
    advice = ("work out the model states per rank of each candidate layout yourself (theory's "
              "formulas are allowed, as in lesson 08), then apply the rule")
    answers = {}
    for budget in budgets:
        with _LibraryFunctionsDisabled(_PLANNER + _LIVE, advice):
            try:
                got = fn(budget)
            except NotImplementedError:
                return Grade("not attempted", _LAYOUT_STUB)
        got = _layout_answer(got, budget, ranks, m)
        _layout_diagnosis(got, budget, table)
        answers[budget] = got
    runs = []
    for budget in live:
        layout = answers.get(budget)
        if layout is None:
            continue
        report = run(layout_config(layout, m))
        planned = next(st for lay, st in table if lay == layout)
        for rank in report.ranks:
            measured = sum(rank["memory"][k] for k in _STATE_KEYS)
            want = planned[rank["coords"]["pp"]]
            if measured != want or measured > budget:
                raise AssertionError(f"live at {_layout_text(layout)}: rank {rank['rank']} "
                                     f"measured {measured:,} bytes of model states; the planner "
                                     f"predicts {want:,}, the budget is {budget:,}")
        runs.append({"budget": budget, "layout": layout, "report": report,
                     "measured_max": max(sum(r["memory"][k] for k in _STATE_KEYS)
                                         for r in report.ranks)})
    shown = "; ".join(f"{b:,} -> {_layout_text(a)}" for b, a in answers.items())
    return Grade("correct", f"your choose_layout picks, for every budget, the layout the rule "
                 f"asks for by the planner's memory model ({shown}); live runs of "
                 + ", ".join(_layout_text(r["layout"]) for r in runs) + " measured every "
                 f"rank's model states equal to the planner's prediction and within budget; the "
                 f"planner and engine.run disabled while yours ran",
                 {"answers": answers, "runs": runs, "table": table})
