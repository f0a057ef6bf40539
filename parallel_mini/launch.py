"""Run a function on N ranks: locally (gloo on CPU, NCCL when GPUs are present) or under torchrun.

Why a forkserver: a notebook or the Streamlit app is a multi-threaded parent, and forking it can
deadlock; spawning re-imports torch in every rank (~1 s each). A forkserver is a clean,
single-threaded process that imported torch once; every rank is a cheap fork of it. So a repeated
4-rank run costs a fraction of a second, and the parent never forks itself.

Functions defined in a notebook cannot be pickled by reference (they live in `__main__`), so the
function and its arguments are shipped *by value* with cloudpickle.

Timing: when the machine has at least as many cores as the run has ranks, each local rank is pinned
to a core of its own (rank i to the i-th core this process may use), with one thread: no rank then
waits for a core another rank holds, and its wall clock measures the run (see `pin_to_core`).

Failure contract: a rank that raises fails the whole run promptly with that rank's traceback; a rank
that dies without a word is reported with its exit signal and what that signal usually means (an abort:
gloo when ranks disagree on a tensor size; a kill from outside: `kill`, the out-of-memory killer; a
crash); a run that exceeds `timeout` is killed with a message naming the ranks that did not finish and
whether they were idle (waiting on each other: likely a deadlock) or still computing (the run needs more
time). No rank outlives `run_ranks`, nor the process that called it: a rank ends itself when that
process is gone, however it ended (SIGKILL included; see `exit_with_parent`).
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from .config import MAX_LOCAL_RANKS, under_torchrun  # (torch-free: the CLI's checks use them)

# Imported once by the forkserver so no rank pays for them. torch._dynamo is pulled in lazily by
# the first TorchDispatchMode (the memory meter) and costs ~1 s per process otherwise.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "parallel_mini.engine"]


class RankError(RuntimeError):
    """One rank failed; `rank`, `details` (its traceback or exit status) and `outputs` (what every
    rank printed) are kept for display."""

    def __init__(self, rank: int, details: str, outputs: list[str] | None = None):
        self.rank, self.details, self.outputs = rank, details, outputs or []
        super().__init__(f"rank {rank} failed:\n{details}")


class RunTimeout(RankError):
    """The run did not finish within its timeout. `cpu_share`: each pending rank's CPU time over the
    last stretch before the deadline, as a share of one core (empty where /proc cannot say);
    `idle`: True when every pending rank was below IDLE_CPU_SHARE (waiting: likely a deadlock),
    False when one was computing (the run is too long), None when unknown."""

    def __init__(self, rank: int, details: str, outputs: list[str] | None = None,
                 cpu_share: dict[int, float] | None = None):
        super().__init__(rank, details, outputs)
        self.cpu_share = cpu_share or {}
        self.idle = (all(v < IDLE_CPU_SHARE for v in self.cpu_share.values())
                     if self.cpu_share else None)


@dataclass
class RankResult:
    rank: int
    value: object
    output: str  # what the rank printed
    placement: dict | None = None  # pin_to_core's record: where the rank ran


# ---------------------------------------------------------------------------------------------
# inside a rank
# ---------------------------------------------------------------------------------------------
def default_backend(world_size: int = 1) -> str:
    """NCCL when every rank can have a GPU of its own, else gloo (NCCL refuses two ranks on one
    GPU, so a 4-rank lesson on a 1-GPU laptop runs on gloo)."""
    if torch.cuda.is_available() and dist.is_nccl_available() \
            and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bound_to(device: torch.device) -> dict:
    """NCCL groups told their device up front (else each collective guesses it from the rank)."""
    return {"device_id": device} if device.type == "cuda" else {}


def rank_device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Tee(io.TextIOBase):
    """Keeps what a rank prints (to return it) and optionally forwards it."""

    def __init__(self, forward=None):
        self.buf, self.forward = io.StringIO(), forward

    def write(self, s):
        self.buf.write(s)
        if self.forward is not None:
            self.forward.write(s)
        return len(s)

    def flush(self):
        if self.forward is not None:
            self.forward.flush()


def connect_gloo_lazily() -> None:
    """Gloo connects the pairs of a process group when they first communicate, not all pairs of
    every group at creation. Measured here: creating the 14 groups of an 8-rank hybrid mesh with
    eager full-mesh connects failed in 3 of 85 launches ("connectFullMesh failed ... Connection
    closed by peer", inside new_group, before any training); connecting lazily, 0 of 120 launches
    that also ran a collective on every group. Re-measured (the same mesh, an all_reduce on every
    group, no retry): lazily 0 of 100, eagerly 0 of 100 this time: eager failures are rare (3 of
    185 in all), lazy ones not seen (0 of 320). The race inside gloo's eager connect is not
    identified; this avoids the code path, and with it the failure at start-up that the launcher
    used to retry (init_process_group no longer connects anything, so there is nothing to retry:
    a connect failure would now surface in the first collective, as any rank error does).
    Read when a gloo group is created."""
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")


def pin_to_core(rank: int, world_size: int) -> dict:
    """Pin this process to a core of its own when every rank can have one: rank i to the i-th of
    the cores this process may use (sorted `os.sched_getaffinity`), called first thing in a fresh
    rank, so that the threads gloo starts later inherit the core. With fewer cores than ranks
    nothing is pinned: the ranks share the cores and the OS moves them as it likes. A run of one
    rank is not pinned either: it has no other rank to share with, and two such runs at once (a
    test suite's workers) would otherwise both sit on the first core.

    Returns what was done, for the report: {"pinned", "cores" (the rank's cores afterwards),
    "cores_available", "how"}. Other processes of the machine may still run on a pinned core: the
    timeline's CPU / wall time of an op says how much of it the rank really had its core."""
    if not hasattr(os, "sched_setaffinity"):  # macOS, Windows: no affinity API
        return {"pinned": False, "cores": None, "cores_available": os.cpu_count(),
                "how": "not pinned: this OS has no sched_setaffinity; ranks may share cores"}
    cores = sorted(os.sched_getaffinity(0))
    if world_size == 1:
        return {"pinned": False, "cores": cores, "cores_available": len(cores),
                "how": "not pinned: a single rank shares its cores with no other rank"}
    if world_size > len(cores):
        return {"pinned": False, "cores": cores, "cores_available": len(cores),
                "how": f"not pinned: {world_size} ranks on {len(cores)} cores share them"}
    os.sched_setaffinity(0, {cores[rank]})
    return {"pinned": True, "cores": sorted(os.sched_getaffinity(0)), "cores_available": len(cores),
            "how": f"pinned to core {cores[rank]} (rank {rank} of {world_size}, {len(cores)} cores)"}


def exit_with_parent(result_fd: int) -> None:
    """End this rank as soon as the process that launched it is gone (Linux).

    Why not PR_SET_PDEATHSIG: a rank's parent is the forkserver, not the launching process, and the
    forkserver outlives the launcher: it stops only when every holder of its "alive" pipe is gone,
    and each rank holds one (multiprocessing passes it to every child). So after a SIGKILL of the
    CLI the forkserver waits for the ranks and the ranks train on (seen: both left running).
    (PDEATHSIG on the forkserver itself would fire when the *thread* that started it ends: a
    Streamlit script thread.) What does end with the launcher is the read end of this rank's result
    pipe: only the launcher holds it, and the kernel closes it when the launcher dies, however it
    dies. `poll` then reports POLLERR on our write end. That is a state, not an event: a launcher
    that died before this watch started is seen at once, so there is no start-up race. Once the ranks
    are gone, the forkserver reads EOF on its alive pipe and exits too."""
    if not sys.platform.startswith("linux"):  # elsewhere a pipe's write end may not report it
        return
    fd = os.dup(result_fd)  # our own copy: the rank closing its result pipe must not wake us

    def watch():
        poller = select.poll()
        poller.register(fd, 0)  # no events asked: POLLERR and POLLHUP are always reported
        while not any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll()):
            pass
        os._exit(1)  # nobody is left to read a result: skip teardown (gloo may block in it)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


MMAP_THRESHOLD = 128 * 1024  # glibc's default starting value, held fixed (see fix_malloc_threshold)


def fix_malloc_threshold() -> bool:
    """Hold glibc's mmap threshold at MMAP_THRESHOLD, so that every block of at least that size
    (a tensor of 32k floats or more) comes from mmap and goes back to the system when freed.

    Why: glibc raises the threshold each time such a block is freed (up to 32 MB on 64-bit), after
    which large tensors come from the heap, and a heap keeps the holes that freed tensors leave;
    tensors of other sizes fit them badly. An MoE layer's per-expert tensors change size every
    step: a 1-rank run (4 experts, top-2, 2 layers, 16k tokens a step) grew ~10 MB a step, with
    its routing log off, and passed its memory estimate in 20 steps; held fixed, 0.7 MB a step
    (measured from /proc/self/statm after each step; dense runs did not grow either way). Returns
    whether it was set (glibc only)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_MMAP_THRESHOLD = -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hold
        return False


TORCHRUN_PLACEMENT = {"pinned": False, "cores": None, "cores_available": None,
                      "how": "under torchrun: CPU affinity left as the launcher set it"}


def _rank_main(rank, world_size, port, payload, conn, backend, pg_timeout, echo):
    placement = pin_to_core(rank, world_size)  # before any thread exists: they inherit it
    exit_with_parent(conn.fileno())
    fix_malloc_threshold()
    torch.set_num_threads(1)  # one compute thread per rank: ranks do not fight over cores
    connect_gloo_lazily()
    out = _Tee(sys.__stderr__ if echo else None)
    status, value = "ok", None
    try:
        with contextlib.redirect_stdout(out):
            fn, args, kwargs = cloudpickle.loads(payload)
            store = dist.TCPStore("127.0.0.1", port, is_master=False,
                                  timeout=timedelta(seconds=pg_timeout))
            device = device_for(backend, rank)  # NCCL: the group is bound to this rank's GPU
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout), **_bound_to(device))
            value = fn(*args, **kwargs)
            if isinstance(value, dict) and "events" in value:
                # a rank's report with a timeline (engine.train_rank): its times are read
                # against where the rank ran (trace.bubble's wall view)
                value.setdefault("placement", placement)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        status, value = "error", traceback.format_exc()
    try:
        conn.send_bytes(cloudpickle.dumps((status, value, out.buf.getvalue(), placement)))
    except BaseException:  # noqa: BLE001 - e.g. an unpicklable result
        conn.send_bytes(cloudpickle.dumps(("error", traceback.format_exc(), out.buf.getvalue(),
                                           placement)))
    conn.close()
    # Skip interpreter teardown: gloo's destructor can block on peers that already failed.
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# in the parent
# ---------------------------------------------------------------------------------------------
def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Preload torch and this package once in the server; '__main__' is left out on purpose
        # (a notebook or Streamlit has no importable main module).
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _kill(procs):
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join(timeout=5)


# One process-wide lock (the app starts runs from several session threads at once): without it a
# second thread could restore `__main__` while the first one's ranks are still being started.
_STARTING = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden():
    """multiprocessing re-imports the parent's `__main__` in every child (a script without an
    `if __name__ == "__main__"` guard would run again on every rank). Ranks receive their function
    by value, so they never need it: hide it while the ranks start."""
    with _STARTING:
        main = sys.modules["__main__"]
        saved = {k: main.__dict__.pop(k) for k in ("__file__", "__spec__") if k in main.__dict__}
        main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
              backend: str | None = None, echo: bool = False, **kwargs) -> list[RankResult]:
    """Run `fn(*args, **kwargs)` on `world_size` fresh ranks with a process group initialised.

    Returns one RankResult per rank (value, printed output). Raises RankError / RunTimeout."""
    if not 1 <= world_size <= MAX_LOCAL_RANKS:
        raise ValueError(f"world_size={world_size}: local runs take 1..{MAX_LOCAL_RANKS} ranks "
                         f"(use torchrun for more)")
    backend = backend or default_backend(world_size)
    payload = cloudpickle.dumps((fn, args, kwargs))
    return _launch(payload, world_size, timeout, pg_timeout, backend, echo)


def _launch(payload: bytes, world_size: int, timeout: float, pg_timeout: float, backend: str,
            echo: bool) -> list[RankResult]:
    store = loopback_store(pg_timeout)
    ctx = _context()
    oom_before = oom_kills()  # to tell a rank ended by the out-of-memory killer (see _why_it_died)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, store.port, payload, pipes[r][1], backend,
                               pg_timeout, echo))
             for r in range(world_size)]
    try:
        with _main_module_hidden():
            for p in procs:
                p.start()
        for _, w in pipes:
            w.close()  # the parent keeps only the read ends
        return _collect(procs, [r for r, _ in pipes], timeout, oom_before)
    finally:
        _kill(procs)
        del store


def loopback_store(pg_timeout: float) -> dist.TCPStore:
    """The rendezvous store, hosted by the parent on a free port of 127.0.0.1 only: no port race,
    nothing to clean up, and nothing reachable from beyond this machine. (A TCPStore created for
    "127.0.0.1" binds its server to every interface, and any client that reaches it can read and
    write the peers' keys; so the socket is bound here, and the store serves on it.)"""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=pg_timeout), master_listen_fd=sock.detach())


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot (Linux 4.13+)."""
    try:
        with open("/proc/vmstat") as fh:
            return next((int(ln.split()[1]) for ln in fh if ln.startswith("oom_kill ")), None)
    except OSError:
        return None


def _why_it_died(code: int | None, oom_before: int | None) -> str:
    """What a rank's exit status usually means, for the learner to know where to look."""
    if code is None:
        return "It is still running, yet its result pipe is closed."
    if code in (-signal.SIGKILL, -signal.SIGTERM):
        oom_now = oom_kills()
        if oom_before is not None and oom_now is not None and oom_now > oom_before:
            return (f"The kernel's out-of-memory killer ran during this run (oom_kill in /proc/vmstat "
                    f"went from {oom_before} to {oom_now}): the machine ran out of memory; try a "
                    f"smaller --batch, --seq or model, or fewer ranks.")
        return ("It was killed from outside this run (the `kill` command, a job scheduler, or the "
                "out-of-memory killer: `dmesg` says which); nothing in the ranks' code asked for it.")
    if code == -signal.SIGABRT:
        return ("A C++ abort: usually the ranks disagreed on a collective (different tensor sizes, "
                "dtypes or op order), which gloo cannot recover from.")
    if code in (-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE):
        return ("A crash in native code (a bug in torch or an extension, or a tensor used after "
                "its memory was freed), not an error of the distributed program.")
    if code == -signal.SIGINT:
        return "It was interrupted (Ctrl-C)."
    if code > 0:
        return "It ended without a result: os._exit or sys.exit called inside the rank, or by native code."
    return "It ended without a result."


def _died(r, procs, outputs, oom_before) -> RankError:
    procs[r].join(timeout=1)
    code = procs[r].exitcode
    status = "no exit status yet" if code is None else _signal_name(code)
    return RankError(r, f"rank {r} died with {status} before returning a result. "
                        f"{_why_it_died(code, oom_before)}", outputs)


# gloo's words on a rank whose peer went away: a consequence of another rank's failure, not a cause
LOST_PEER = ("Connection closed by peer", "Connection reset by peer")


def _lost_peer(details) -> bool:
    return any(words in str(details) for words in LOST_PEER)


def _root_cause(first: RankError, procs, conns, pending, outputs, oom_before,
                grace: float = 0.5) -> RankError:
    """A rank that fails makes its peers fail too, with gloo's "Connection closed/reset by peer",
    often before the parent reads the first failure: a rank that dies silently (a C++ abort), or
    one whose report sits in its pipe behind a peer's that the parent happened to read first (two
    ranks timing out in a deadlock at the same moment: the first to exit closes the other's
    connection). Give the other ranks a moment; a death without a report (a rank that reports exits
    0), or, when `first` only lost its peer, another rank's report of something else, is the cause."""
    others = [r for r in pending if r != first.rank]
    deadline = time.monotonic() + grace
    while others:
        dead = [r for r in others if procs[r].exitcode not in (None, 0) and not conns[r].poll()]
        if dead:
            return _then(_died(dead[0], procs, outputs, oom_before), first)
        if _lost_peer(first.details):
            for r in [r for r in others if conns[r].poll()]:
                try:
                    status, value, outputs[r], _ = cloudpickle.loads(conns[r].recv_bytes())
                except EOFError:
                    return _then(_died(r, procs, outputs, oom_before), first)
                others.remove(r)  # reported: its pipe is read, whatever it said
                if status != "ok" and not _lost_peer(value):
                    return _then(RankError(r, value, outputs), first)
        if time.monotonic() > deadline or all(not procs[r].is_alive() for r in others):
            break
        time.sleep(0.02)
    return first


def _then(cause: RankError, first: RankError) -> RankError:
    cause.details += f"\n\nThen rank {first.rank} failed:\n{first.details}"
    cause.args = (f"rank {cause.rank} failed:\n{cause.details}",)
    return cause


IDLE_CPU_SHARE = 0.05  # below 5 % of one core over the last window: the rank is waiting, not working


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, every thread) a live process has used, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _timed_out(timeout, pending, procs, sample, outputs) -> RunTimeout:
    """"Did not finish" and, where /proc says how much CPU the pending ranks used over the last
    window before the deadline, what that suggests: idle ranks wait on each other (a collective or
    recv their peers never call); a rank still computing means the run is longer than the timeout."""
    head = f"ranks {pending} did not finish within {timeout:g} s"
    more_time = ("give it more time: --timeout-s on the command line, the `timeout` argument of "
                 "run_ranks")
    shares = {}
    if sample is not None:
        t0, cpu0 = sample
        wall = time.monotonic() - t0
        for r in pending:
            now = cpu_seconds(procs[r].pid)
            if now is not None and cpu0.get(r) is not None and wall > 0:
                shares[r] = (now - cpu0[r]) / wall
    if len(shares) < len(pending):  # not measurable here (no /proc) or a rank just ended
        return RunTimeout(pending[0], (
            f"{head}. Either they wait on a collective or recv that a peer never calls (a deadlock: "
            f"check that every rank calls the same collectives in the same order), or the run needs "
            f"longer ({more_time})."), outputs)
    window = f"{wall:.1f} s before the deadline"
    cpu = ", ".join(f"rank {r} {shares[r]:.0%}" for r in pending)
    busy = [r for r in pending if shares[r] >= IDLE_CPU_SHARE]
    if not busy:
        return RunTimeout(pending[0], (
            f"{head}, and they were idle (CPU time over the last {window}: {cpu} of a core). Most "
            f"likely a deadlock: each waits on a collective or recv that its peers never call "
            f"(check that every rank calls the same collectives in the same order)."), outputs, shares)
    return RunTimeout(pending[0], (
        f"{head}; ranks {busy} were still computing (CPU time over the last {window}: {cpu} of a "
        f"core), so the run is longer than the timeout rather than stuck: {more_time}, or make "
        f"the run smaller."), outputs, shares)


def _collect(procs, conns, timeout, oom_before=None) -> list[RankResult]:
    n = len(procs)
    results: list[RankResult | None] = [None] * n
    outputs = [""] * n
    deadline = time.monotonic() + timeout
    window = min(1.0, timeout / 2)  # the pending ranks' CPU time is read over this last stretch
    sample = None  # (time, {rank: cpu seconds}) taken `window` before the deadline
    while any(r is None for r in results):
        pending = [r for r in range(n) if results[r] is None]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(timeout, pending, procs, sample, outputs)
        if sample is None and remaining <= window:
            sample = (time.monotonic(), {r: cpu_seconds(procs[r].pid) for r in pending})
        wake = remaining - window if sample is None else remaining  # wake for the sample
        ready = mpc.wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
                         timeout=max(0.0, min(wake, 1.0)))
        for r in pending:
            if conns[r] in ready or conns[r].poll():  # poll() is also true at EOF
                try:
                    status, value, outputs[r], placement = cloudpickle.loads(conns[r].recv_bytes())
                except EOFError:  # the rank closed its pipe without a word: it died
                    raise _died(r, procs, outputs, oom_before) from None
                if status == "ok":
                    results[r] = RankResult(r, value, outputs[r], placement)
                    continue
                raise _root_cause(RankError(r, value, outputs), procs, conns, pending, outputs,
                                  oom_before)
            if procs[r].sentinel in ready and results[r] is None and not conns[r].poll():
                raise _died(r, procs, outputs, oom_before)  # gone, though its pipe is not at EOF
    return results  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# under torchrun
# ---------------------------------------------------------------------------------------------
def init_from_env(backend: str | None = None, pg_timeout: float = 60.0) -> torch.device:
    """Initialise the default process group from torchrun's environment; returns this rank's device.
    The CPU affinity is left as the launcher set it (a cluster's job script pins, or not, on
    purpose); TORCHRUN_PLACEMENT says so in the report."""
    torch.set_num_threads(1)
    connect_gloo_lazily()
    fix_malloc_threshold()
    backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    device = device_for(backend, int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=pg_timeout), **_bound_to(device))
    return device
