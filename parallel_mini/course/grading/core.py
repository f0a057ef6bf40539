"""What every lesson's checker shares: the Grade a check returns; `_on_ranks`, which runs the
learner's code on real ranks and turns a stub or a failure into a Grade or a one-line
AssertionError; `_RankTrace`, which records each rank's calls in the learner's code so that a
deadlock is reported as who waited in which call, and counts the bytes the learner's recorded
calls explain against what the process wrote to its sockets meanwhile (`_wire_verdict` refuses
the rest: traffic around comm); `_CodeSwapped`, which disables the library's own version of an
exercise (its functions' code swapped for a raiser) while the learner's runs; `_library_copy`,
which refuses an answer that is the library's function (code object, bytecode, source); and
`_call_in_time`, which stops a single-process answer that does not return within ANSWER_TIMEOUT.
"""
from __future__ import annotations

import html
import os
import sys
import time
from dataclasses import dataclass, field

from ...runtime.launch import RankError, RunTimeout


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
        # the bytes the learner's comm calls explain (_wire_allowance of each record a real Comm
        # call made, taken when the call returned), and what this process wrote meanwhile
        self.explained, self.comm_calls = 0, 0
        self.written = _SocketBytes()
        # while `in_backward` is set (lesson 02: loss.backward() runs the learner's hooks), a
        # wait() or a blocking collective is logged here as (what, start, end)
        self.in_backward, self.blocked = False, []

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
            comm = args[0] if where == "comm" else None
            before = len(comm.records) if comm is not None else 0
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.depth = 0
            if comm is not None:  # the records this real call made, read before anyone edits them
                for rec in comm.records[before:]:
                    self.explained += _wire_allowance(rec, comm.size(rec["group"])
                                                      if rec["group"] in comm.mesh.groups else 1)
                    self.comm_calls += 1
            made = comm.records[before:] if comm is not None else []
            if self.in_backward and (where == "handle" or (
                    where == "dist" and not kwargs.get("async_op")) or any(
                    not rec.get("async_op") for rec in made)):
                self.blocked.append((self.last, t0, time.perf_counter()))
            self.waiting = False
            self.publish()
            return out
        return traced

    def __enter__(self):
        from ...comm import Comm
        from ...meters import _Handle
        self.saved = []
        for owner, where, names in ((Comm, "comm", _COMM_OPS), (self.dist, "dist", _DIST_OPS),
                                    (_Handle, "handle", ("wait",))):
            for name in names:
                if hasattr(owner, name):
                    fn = getattr(owner, name)
                    self.saved.append((owner, name, fn))
                    setattr(owner, name, self._wrap(where, name, fn))
        self.done, self.round = False, self.round + 1
        self.written.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.written.__exit__(exc_type, exc, tb)
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
# the library's own version disabled while the learner's code runs
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# the bytes a rank really wrote against what its recorded calls explain (the bypass of `comm`)
# ---------------------------------------------------------------------------------------------
# What gloo (torch 2.13, TCP) writes besides the payload, measured on 2 and 4 ranks (every op
# alone after a barrier, 4 B to 1 MiB, bytes read from /proc/self/io's wchar, which counts what
# every thread of the process passed to write()/send(); the TCPStore's traffic is not counted
# there: measured 0): 144 bytes per message. A send is one message; an all-reduce, 2(N-1) to
# 4(N-1) (gloo's ring cuts small tensors unevenly: at N = 4 ranks wrote 688 to 1,088 B for a 16 B
# tensor); gloo's reduce-scatter is an all-reduce of the whole input (it writes 2(N-1)/N x S,
# twice the ring model's (N-1)/N x S); its broadcast is a tree (the root writes more than the
# chain model, a leaf nothing), whose sum over the ranks is the chain's. So the allowance is a
# record's gloo bytes plus GLOO_HEADER per message it may send, and it is compared with the sum
# over the ranks. A bypass of the payload (the collective called on the process group behind
# `comm`, with a decoy of zeros through `comm` to keep the records right) writes the payload a
# second time: at least its ring bytes beyond the allowance, never within it.
GLOO_HEADER = 160  # bytes per message allowed for gloo's framing (measured: 144)
GLOO_CONNECT = 64  # bytes per rank allowed for connecting pairs on first use (measured: 1 to 16)


def _messages(op: str, n: int) -> int:
    return {"send": 1, "all_reduce": 4 * (n - 1), "reduce_scatter": 4 * (n - 1),
            "all_gather": 2 * (n - 1), "broadcast": 2 * (n - 1),
            "all_to_all": 2 * (n - 1)}.get(op, 0)


def _wire_allowance(rec: dict, n: int) -> int:
    """The most bytes gloo writes for one record of `comm` on a group of n ranks."""
    op, model = rec.get("op"), int(rec.get("wire_bytes_model") or 0)
    if n <= 1 or op in ("recv", "d2h", "h2d"):
        return 0
    if op == "reduce_scatter":  # gloo's: an all-reduce of the input, 2(N-1)/N x S
        model = 2 * (n - 1) * int(rec.get("payload_bytes") or 0) // n + 1
    return model + GLOO_HEADER * _messages(op, n)


class _SocketBytes:
    """What this process wrote to its sockets (wchar of /proc/self/io) over the windows it is
    entered for, summed; `total` None where that cannot be read (off Linux). Meanwhile Python
    writes no bytecode (a .pyc written by an import inside the learner's code would count) and
    what goes to sys.stderr (a warning) is held and written after the window."""

    def __init__(self):
        try:
            self.fd = os.open("/proc/self/io", os.O_RDONLY)
        except OSError:
            self.fd = None
        self.total = 0 if self.fd is not None else None
        self.start = None

    def read(self) -> int:
        for line in os.pread(self.fd, 1024, 0).splitlines():
            if line.startswith(b"wchar:"):
                return int(line.split()[1])
        return 0

    def __enter__(self):
        if self.fd is not None:
            import io
            self.saved_flag, sys.dont_write_bytecode = sys.dont_write_bytecode, True
            self.saved_err, sys.stderr = sys.stderr, io.StringIO()
            self.start = self.read()
        return self

    def __exit__(self, *exc):
        if self.fd is not None and self.start is not None:
            self.total += self.read() - self.start
            self.start = None
            sys.dont_write_bytecode = self.saved_flag
            held, sys.stderr = sys.stderr.getvalue(), self.saved_err
            if held:
                sys.stderr.write(held)
        return False


def _wire_summary(trace: "_RankTrace") -> dict:
    """A rank's side of the wire check, for the parent: written while the learner's code ran,
    and what its recorded calls explain."""
    return {"written": trace.written.total, "explained": trace.explained,
            "calls": trace.comm_calls}


def _wire_verdict(per_rank: list[dict], where: str, label: str) -> dict:
    """Every rank's `_wire_summary` (the "wire" entry of its result): AssertionError when the ranks
    wrote more to their sockets than the calls recorded by `comm` explain (their gloo bytes with
    headers); else the figures, measured, for the Grade."""
    wires = [p["wire"] for p in per_rank]
    written = [w["written"] for w in wires]
    explained = sum(w["explained"] for w in wires) + GLOO_CONNECT * len(wires)
    if any(w is None for w in written):
        return {"written": None, "explained": explained}
    total = sum(written)
    if total > explained:
        raise AssertionError(
            f"{where}: while {label} ran, the ranks wrote {total:,} bytes to their sockets "
            f"(measured), but the calls recorded by comm explain at most {explained:,} (their "
            f"gloo bytes, headers included): {total - explained:,} bytes went around comm, e.g. a "
            f"collective called on the process group behind comm (comm.mesh.groups[...]) or on "
            f"torch.distributed directly. Make every transfer through comm, so it is recorded")
    return {"written": total, "explained": explained}


# ---------------------------------------------------------------------------------------------
# a learner's function that is the library's: the same code object, bytecode or source
# ---------------------------------------------------------------------------------------------
def _functions_of(obj) -> list:
    """The plain functions a learner's answer consists of: a function, a method's function, a
    partial's function, or every function defined in a class's own namespace."""
    import functools
    import inspect

    while isinstance(obj, functools.partial):
        obj = obj.func
    if inspect.isclass(obj):
        out = []
        for value in vars(obj).values():
            out += _functions_of(getattr(value, "__func__", value)) if callable(
                getattr(value, "__func__", value)) else []
        return out
    obj = getattr(obj, "__func__", obj)
    return [obj] if hasattr(obj, "__code__") else []


def _library_functions(modules) -> list:
    """Every function and method defined in `modules` (module objects), nested classes included."""
    import inspect

    out, seen = [], set()

    def walk(ns, mod_name):
        for value in list(vars(ns).values()):
            value = getattr(value, "__func__", value)
            if inspect.isfunction(value) and value.__module__ == mod_name and id(value) not in seen:
                seen.add(id(value))
                out.append(value)
            elif inspect.isclass(value) and value.__module__ == mod_name and id(value) not in seen:
                seen.add(id(value))
                walk(value, mod_name)
    for m in modules:
        walk(m, m.__name__)
    return out


def _bytecode_key(code) -> tuple:
    """A code object without its names: the instructions, the globals and attributes it names, its
    constants (a docstring dropped, nested code compared the same way)."""
    consts = []
    for i, c in enumerate(code.co_consts):
        if hasattr(c, "co_code"):
            consts.append(_bytecode_key(c))
        elif not (i == 0 and isinstance(c, str)):
            consts.append(repr(c))
    return (code.co_code, code.co_names, tuple(consts))


def _source_key(fn) -> tuple | None:
    """(the function's syntax tree without its name, docstring and comments, its docstring, its
    node count); None without source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))), None)
    if node is None:
        return None
    doc = ast.get_docstring(node, clean=True) or ""
    body = node.body[1:] if doc else node.body
    node = ast.FunctionDef(name="f", args=node.args, body=body, decorator_list=[], returns=None,
                           type_params=[])
    return (ast.dump(node, annotate_fields=False, include_attributes=False), doc,
            sum(1 for _ in ast.walk(node)))


_SOURCE_NODES = 40  # below this, the same tree written independently is likely (a one-line formula)


def _library_copy(answer, modules, what: str) -> None:
    """AssertionError when a function of `answer` (the learner's function or class) is one of the
    library's functions in `modules` (module names under parallel_mini, e.g. "comm"): the same code
    object; a copy of it (the same bytecode, and the library's file and lines in it, which a
    function written anywhere else does not carry); or its source pasted in (the same syntax tree,
    names included, comments not: with the library's docstring, or long enough, at least
    _SOURCE_NODES nodes, that writing it independently is not plausible). A learner's one-line
    formula that happens to compile to the library's bytecode is not refused. Run before the
    checker disables the library (its code objects are then swapped)."""
    import importlib

    mods = [importlib.import_module(f"parallel_mini.{m}") for m in modules]
    library = [f for f in _library_functions(mods) if f.__code__.co_code]
    for fn in _functions_of(answer):
        code, key, src = fn.__code__, None, None
        for lib in library:
            lc, how = lib.__code__, None
            if code is lc:
                how = "the same code object"
            elif code.co_filename == lc.co_filename and code.co_firstlineno == lc.co_firstlineno:
                key = key or _bytecode_key(code)
                if key == _bytecode_key(lc):
                    how = "the same bytecode (a copy of its __code__)"
            else:
                src = src if src is not None else (_source_key(fn) or ())
                if src:
                    lib_src = _source_key(lib)
                    if lib_src and src[0] == lib_src[0] and (
                            (src[1] and src[1] == lib_src[1]) or src[2] >= _SOURCE_NODES):
                        how = "the same source (the library's code pasted in)"
            if how:
                raise AssertionError(
                    f"{what} {fn.__name__} is the library's own {lib.__module__}."
                    f"{lib.__qualname__}: {how}. The checker grades code you wrote: write it "
                    f"yourself")


# ---------------------------------------------------------------------------------------------
# a single-process check that an endless answer cannot hold up
# ---------------------------------------------------------------------------------------------
ANSWER_TIMEOUT = 10.0  # seconds a single-process check waits for one call of the learner's code


class _Stopped(BaseException):
    """Raised inside a learner's function that ran past ANSWER_TIMEOUT (thread stopped)."""


def _call_in_time(fn, *args, what: str, timeout: float | None = None):
    """fn(*args) in a thread of this process, waited for at most `timeout` seconds (ANSWER_TIMEOUT):
    its value; an AssertionError or NotImplementedError it raised, raised again here; any other
    exception as an AssertionError saying what `what` raised; past the time an AssertionError
    says so, and the thread is stopped (an exception raised into it at its next Python instruction)."""
    import ctypes
    import threading

    timeout = ANSWER_TIMEOUT if timeout is None else timeout
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="learner-answer", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident),
                                                   ctypes.py_object(_Stopped))
        t.join(1.0)
        raise AssertionError(f"{what} did not return within {timeout:g} s: a loop that never "
                             f"ends? (stopped by the checker)")
    err = box.get("error")
    if isinstance(err, (AssertionError, NotImplementedError)):
        raise err.with_traceback(None)
    if err is not None:  # the learner's code failed: say what it raised, one line
        raise AssertionError(f"{what} raised {type(err).__name__}: {err}") from None
    return box.get("value")
