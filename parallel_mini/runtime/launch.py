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
time), and where each was. What the parent reads from outside (`Watch`): a rank stopped by a signal
(state T in /proc/PID/stat) is named as stopped, not blamed on the peer that waited for it; a peer's
timeout names the rank it waited for and where that rank is (its own stack, dumped on SIGUSR1); a
forkserver killed from outside is not taken for the ranks' exit. No rank outlives `run_ranks`, nor the process that called it: a rank ends itself when that
process is gone, however it ended (SIGKILL included; see `exit_with_parent`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import select
import signal
import socket
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from ..comm import OWN_CORE
from ..config import MAX_LOCAL_RANKS, under_torchrun  # (torch-free: the CLI's checks use them)
from . import preflight

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
    os.environ[OWN_CORE] = "1"  # (Comm then waits for its collectives by polling)
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


def dump_stack_on_request(path: str) -> None:
    """On SIGUSR1, write every Python thread's stack to `path` (faulthandler: from the signal
    handler itself, so it answers while the rank is blocked inside gloo, holding the GIL). The
    launcher asks when a run goes wrong, to say where a rank is (see `where`)."""
    fh = open(path, "w")  # kept open for the rank's life: faulthandler writes to its descriptor
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
    dump_stack_on_request.file = fh


def _rank_main(rank, world_size, port, payload, conn, backend, pg_timeout, echo, stack_dir=None):
    placement = pin_to_core(rank, world_size)  # before any thread exists: they inherit it
    exit_with_parent(conn.fileno())
    fix_malloc_threshold()
    if stack_dir is not None:
        dump_stack_on_request(os.path.join(stack_dir, f"rank{rank}"))
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
    stack_dir = tempfile.mkdtemp(prefix="parallel_mini_stacks_")
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, store.port, payload, pipes[r][1], backend,
                               pg_timeout, echo, stack_dir))
             for r in range(world_size)]
    started = {}
    try:
        with _main_module_hidden():
            for p in procs:
                p.start()
                started[p.pid] = start_time(p.pid)
        for _, w in pipes:
            w.close()  # the parent keeps only the read ends
        watch = Watch(procs, stack_dir, pg_timeout, oom_before)
        return _collect(procs, [r for r, _ in pipes], timeout, oom_before, watch)
    finally:
        _kill(procs)
        _kill_orphans(started)
        shutil.rmtree(stack_dir, ignore_errors=True)
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


def _died(r, procs, outputs, oom_before, watch: Watch | None = None) -> RankError:
    if watch is not None and watch.forkserver_gone():
        state = proc_state(procs[r].pid)
        now = ("gone" if state in (None, "Z") else f"still there, state {state} in "
               f"/proc/{procs[r].pid}/stat: ended by this launcher now")
        return RankError(r, f"rank {r} ended without a result, and its exit status is unknown: the "
                            f"forkserver that started the ranks (pid {watch.server_gone}), which "
                            f"reports how each rank ended, is gone (killed from outside this run); "
                            f"rank {r} is {now}", outputs)
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
                grace: float = 0.5, watch: Watch | None = None) -> RankError:
    """A rank that fails makes its peers fail too, with gloo's "Connection closed/reset by peer",
    often before the parent reads the first failure: a rank that dies silently (a C++ abort), or
    one whose report sits in its pipe behind a peer's that the parent happened to read first (two
    ranks timing out in a deadlock at the same moment: the first to exit closes the other's
    connection). Give the other ranks a moment; a death without a report (a rank that reports exits
    0), or, when `first` only lost its peer, another rank's report of something else, is the cause."""
    others = [r for r in pending if r != first.rank]
    if watch is not None:
        stopped = [r for r in others if proc_state(procs[r].pid) in ("T", "t")]
        if stopped:  # it waited on a rank that was stopped: that is the news
            return _then(watch.stopped(stopped[0], outputs), first)
        if _timed_out_waiting(first.details):
            hung = _hung(first, others, procs, conns, outputs, watch)
            if hung is not None:
                return _then(hung, first)
    deadline = time.monotonic() + grace
    while others:
        dead = [r for r in others if procs[r].exitcode not in (None, 0) and not conns[r].poll()]
        if dead:
            return _then(_died(dead[0], procs, outputs, oom_before, watch), first)
        if _lost_peer(first.details):
            for r in [r for r in others if conns[r].poll()]:
                try:
                    status, value, outputs[r], _ = cloudpickle.loads(conns[r].recv_bytes())
                except EOFError:
                    return _then(_died(r, procs, outputs, oom_before, watch), first)
                others.remove(r)  # reported: its pipe is read, whatever it said
                if status != "ok" and not _lost_peer(value):
                    return _then(RankError(r, value, outputs), first)
        if time.monotonic() > deadline or all(not procs[r].is_alive() for r in others):
            break
        time.sleep(0.02)
    return first


# gloo's words when a collective or recv waited past the process group's timeout
TIMED_OUT = ("Timed out waiting", "timed out", "Timeout waiting")


def _timed_out_waiting(details) -> bool:
    return any(words in str(details) for words in TIMED_OUT)


def _hung(first: RankError, others, procs, conns, outputs, watch: Watch) -> RankError | None:
    """`first` waited on its peers past the process group's timeout: a peer that is alive, has not
    reported and did not end is the one that made no progress; named with where it is."""
    for r in others:
        if conns[r].poll() or proc_state(procs[r].pid) in (None, "Z"):
            continue
        cpu0, t0 = cpu_seconds(procs[r].pid), time.monotonic()
        at = watch.where(r)
        cpu1, wall = cpu_seconds(procs[r].pid), time.monotonic() - t0
        busy = ""
        if cpu0 is not None and cpu1 is not None and wall > 0:
            share = (cpu1 - cpu0) / wall
            busy = (f"; computing ({share:.0%} of a core while looked at)" if share >= IDLE_CPU_SHARE
                    else f"; waiting ({share:.0%} of a core while looked at)")
        return RankError(r, f"rank {r} made no progress for {watch.pg_timeout:g} s in "
                            f"{at or 'a place it could not say'}: rank {first.rank} waited that "
                            f"long for it in a collective and timed out{busy}", outputs)
    return None


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


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()  # after the command name (may hold spaces)
    except (OSError, IndexError):
        return None


def proc_state(pid: int) -> str | None:
    """The state letter of a process in /proc/PID/stat: R running, S sleeping (waiting), D in
    the kernel, T stopped by a signal (SIGSTOP, SIGTSTP), t stopped by a debugger, Z ended, not yet
    reaped; None where it is gone (or no /proc)."""
    fields = _stat(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): a pid with another start time is
    another process (pids are reused)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


STOPPED_GRACE_S = 5.0  # a rank seen stopped (state T) this long ends the run, named as the cause
STATE_NAMES = {"T": "SIGSTOP state T", "t": "stopped by a debugger, state t"}


class Watch:
    """What the parent reads of its ranks from outside while it waits: their /proc state (a rank
    stopped by a signal is named as such, not blamed on the peer that waited for it), whether
    the forkserver that started them (and reports their exit status) is still there, and, on
    request, where a rank is (its Python stack, `where`)."""

    def __init__(self, procs, stack_dir: str | None, pg_timeout: float, oom_before=None):
        self.procs, self.stack_dir, self.pg_timeout = procs, stack_dir, pg_timeout
        self.oom_before, self.stopped_since, self.server_gone = oom_before, {}, None
        forked = procs and type(getattr(procs[0], "_popen", None)).__module__.endswith("forkserver")
        self.server = _forkserver_pid() if forked else None

    def check_stopped(self, pending, outputs) -> None:
        """Raise for a rank stopped by a signal for STOPPED_GRACE_S (read every wake-up, <= 1 s)."""
        now = time.monotonic()
        for r in pending:
            if proc_state(self.procs[r].pid) == "T":
                since = self.stopped_since.setdefault(r, now)
                if now - since >= STOPPED_GRACE_S:
                    raise self.stopped(r, outputs, now - since)
            else:
                self.stopped_since.pop(r, None)

    def stopped(self, r, outputs, for_s: float | None = None) -> RankError:
        pid = self.procs[r].pid
        state = proc_state(pid)
        how = f" for {for_s:.0f} s" if for_s else ""
        if state == "t":
            return RankError(r, f"rank {r} stopped ({STATE_NAMES['t']} in /proc/{pid}/stat){how}: "
                                f"a debugger holds it, and its peers waited on it", outputs)
        return RankError(r, f"rank {r} stopped ({STATE_NAMES['T']} in /proc/{pid}/stat){how}: a "
                            f"stopped rank runs nothing and its peers wait on it in their next "
                            f"collective. Something sent it SIGSTOP or SIGTSTP (kill -STOP, Ctrl-Z "
                            f"of its process group, a scheduler suspending it; kill -CONT {pid} "
                            f"resumes one); the run was ended", outputs)

    def forkserver_gone(self) -> bool:
        """The forkserver (the ranks' parent, which reports their exit status) has ended: killed
        from outside. Its state is read, not waited for (multiprocessing reaps it itself); or a
        rank's sentinel spoke while the rank lived (_collect: the forkserver closed it dying)."""
        if self.server is not None and self.server_gone is None \
                and proc_state(self.server) in (None, "Z"):
            self.server_gone = self.server
        return self.server_gone is not None

    def where(self, r: int) -> str | None:
        """Where rank r is now: its Python stack, dumped by the rank on SIGUSR1, read back as the
        innermost call and the innermost call of the program (outside torch); None when it
        cannot say (stopped, gone, no stack file)."""
        if self.stack_dir is None or proc_state(self.procs[r].pid) in (None, "Z", "T", "t"):
            return None
        path = os.path.join(self.stack_dir, f"rank{r}")
        try:
            before = os.path.getsize(path)
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        except OSError:
            return None
        deadline, last = time.monotonic() + 2.0, before
        while time.monotonic() < deadline:  # the dump: the file grows, then stops growing
            time.sleep(0.05)
            size = os.path.getsize(path)
            if size > before and size == last:
                break
            last = size
        with open(path) as fh:
            fh.seek(before)
            return innermost_calls(fh.read())


def innermost_calls(dump: str) -> str | None:
    """From a faulthandler dump of every thread, the rank's main thread (the one in _rank_main):
    "F (file:line)" for its innermost call, then ", called from G (file:line)" for the innermost
    one of the program (outside torch, Python's standard library and this launcher), when that
    is another."""
    for block in dump.split("\n\n"):
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if not any(ln.endswith(" in _rank_main") for ln in frames):
            continue
        calls = []
        for ln in frames:  # File "PATH", line N in FUNC (most recent first)
            try:
                path, rest = ln[len('File "'):].split('", line ', 1)
                line, func = rest.split(" in ", 1)
            except ValueError:
                continue
            calls.append((func, "/".join(path.split("/")[-2:]), line, path))
        if not calls:
            return None
        f, file, line, _ = calls[0]
        text = f"{f} ({file}:{line})"
        stdlib = sysconfig.get_paths()["stdlib"] + "/"
        own = next((c for c in calls if "/torch/" not in c[3] and not c[3].endswith("launch.py")
                    and not c[3].startswith(stdlib)), None)
        if own is not None and own is not calls[0]:
            text += f", called from {own[0]} ({own[1]}:{own[2]})"
        return text
    return None


def _forkserver_pid() -> int | None:
    try:
        from multiprocessing import forkserver
        return forkserver._forkserver._forkserver_pid
    except (ImportError, AttributeError):
        return None


def _kill_orphans(started: dict[int, int | None]) -> None:
    """Ranks whose forkserver was killed: multiprocessing can no longer end them (it asks the
    forkserver), so they are ended by pid, if that pid is still the same process."""
    for pid, t0 in started.items():
        if t0 is not None and start_time(pid) == t0 and proc_state(pid) not in (None, "Z"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _timed_out(timeout, pending, procs, sample, outputs, watch: Watch | None = None) -> RunTimeout:
    """"Did not finish" and, where /proc says how much CPU the pending ranks used over the last
    window before the deadline, what that suggests: idle ranks wait on each other (a collective or
    recv their peers never call); a rank still computing means the run is longer than the timeout."""
    head = f"ranks {pending} did not finish within {timeout:g} s"
    if watch is not None:  # where each was: stopped, or its innermost call
        at = {}
        for r in pending:
            state = proc_state(procs[r].pid)
            where = f"stopped ({STATE_NAMES[state]})" if state in STATE_NAMES else watch.where(r)
            if where:
                at[r] = where if state in STATE_NAMES else f"in {where}"
        if at:
            head += " (" + "; ".join(f"rank {r} {w}" for r, w in at.items()) + ")"
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


def _collect(procs, conns, timeout, oom_before=None, watch: Watch | None = None) -> list[RankResult]:
    n = len(procs)
    watch = watch or Watch(procs, None, timeout, oom_before)
    results: list[RankResult | None] = [None] * n
    outputs = [""] * n
    deadline = time.monotonic() + timeout
    window = min(1.0, timeout / 2)  # the pending ranks' CPU time is read over this last stretch
    sample = None  # (time, {rank: cpu seconds}) taken `window` before the deadline
    while any(r is None for r in results):
        pending = [r for r in range(n) if results[r] is None]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(timeout, pending, procs, sample, outputs, watch)
        if sample is None and remaining <= window:
            sample = (time.monotonic(), {r: cpu_seconds(procs[r].pid) for r in pending})
        wake = remaining - window if sample is None else remaining  # wake for the sample
        # a forkserver killed from outside: its sentinels say nothing of the ranks any more (EOF
        # on each, an exit code 255 that no rank gave): a rank's pipe tells its end instead
        sentinels = [] if watch.forkserver_gone() else [procs[r].sentinel for r in pending]
        ready = mpc.wait([conns[r] for r in pending] + sentinels,
                         timeout=max(0.0, min(wake, 1.0)))
        for r in pending:
            if conns[r] in ready or conns[r].poll():  # poll() is also true at EOF
                try:
                    status, value, outputs[r], placement = cloudpickle.loads(conns[r].recv_bytes())
                except EOFError:  # the rank closed its pipe without a word: it died
                    raise _died(r, procs, outputs, oom_before, watch) from None
                if status == "ok":
                    results[r] = RankResult(r, value, outputs[r], placement)
                    continue
                raise _root_cause(RankError(r, value, outputs), procs, conns, pending, outputs,
                                  oom_before, watch=watch)
            if procs[r].sentinel in ready and results[r] is None and not conns[r].poll() \
                    and not watch.forkserver_gone():
                if proc_state(procs[r].pid) not in (None, "Z"):  # the rank lives: the sentinel
                    watch.server_gone = watch.server or -1  # spoke for its dying forkserver
                    continue
                raise _died(r, procs, outputs, oom_before, watch)  # gone, its pipe not at EOF
        watch.check_stopped([r for r in pending if results[r] is None], outputs)
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


# ---------------------------------------------------------------------------------------------
# a training run: checked, launched, merged
# ---------------------------------------------------------------------------------------------
def run(cfg, average_fn=None):
    """Launch `cfg.world_size` local ranks (or join torchrun's), each running engine.train_rank, and
    return the merged RunReport. `average_fn`: see train_rank."""
    preflight.check(cfg.validate())  # the values, then what this machine and disk allow
    if cfg.offload_disk:  # the ranks' working directory may not be this process's
        cfg = dataclasses.replace(cfg, offload_disk=os.path.abspath(cfg.offload_disk))
    try:
        return _run(cfg, average_fn)
    finally:  # whatever happened to the ranks, --offload-disk leaves no file (unless kept)
        if cfg.offload_disk and not cfg.keep_offload:
            mine = [int(os.environ["RANK"])] if under_torchrun() else range(cfg.world_size)
            preflight.remove_offload_files(cfg.offload_disk, mine)


def _run(cfg, average_fn=None):
    from ..engine import train_rank  # (here: the launcher itself needs none of the library)
    from ..parallel import federated, local_sgd
    from ..report import merge_rank_results
    from . import checkpoint
    t0 = time.perf_counter()
    backend = None if cfg.backend == "auto" else cfg.backend
    backend = "gloo" if cfg.asynchronous else backend  # the server receives from any worker
    if under_torchrun():
        init_from_env(backend, cfg.timeout_s)
        mine = train_rank(cfg.to_dict(), average_fn=average_fn, checkpoints=checkpoint)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        per_rank = gathered
    else:
        results = run_ranks(train_rank, cfg.world_size, cfg.to_dict(), timeout=cfg.timeout_s,
                            pg_timeout=min(cfg.timeout_s, 60.0), backend=backend,
                            average_fn=average_fn, checkpoints=checkpoint)
        per_rank = [r.value for r in results]
    start = per_rank[0]["resumed_from_step"]
    # A resumed run's records cover the steps it trained: the report counts those (per-step
    # bytes, the bubble's timed steps), and says where it started.
    merged = dataclasses.replace(cfg, steps=cfg.steps - start) if start else cfg
    report = merge_rank_results(merged, per_rank, wall_s=time.perf_counter() - t0)
    if cfg.asynchronous:  # the server's records are the run's (parallel/async_ps.py)
        report.extra["async"] = report.ranks[0].pop("async")
    if cfg.resume:
        report.extra["resumed_from_step"] = start
        step_dir = f"step_{start}"  # (DIR/latest may name a newer one by now)
        where = cfg.resume if os.path.basename(os.path.normpath(cfg.resume)) == step_dir \
            else os.path.join(cfg.resume, step_dir)
        if not under_torchrun() or dist.get_rank() == 0:  # (under torchrun every rank is here)
            print(f"resumed from step {start} ({where}): trained steps {start + 1}-{cfg.steps}"
                  if start else f"--resume {cfg.resume}: no checkpoint there yet; trained from "
                  f"step 0", file=sys.stderr)
    if cfg.sync_every:  # what the averages cost, counted, predicted and measured
        report.extra["local_sgd"] = local_sgd.summary(report)
    if cfg.federated:  # per round: clients' losses, drift; what crossed the network
        report.extra["federated"] = federated.summary(report)
    if cfg.save:
        report.extra["saved"] = f"{cfg.save.rstrip('/')}/step_{cfg.steps}"
    return report
