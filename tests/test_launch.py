"""The local launcher's contract (launch.py): values and prints come back per rank; a failing rank
fails the run promptly with its traceback; a rank that dies silently or a collective mismatch is a
RankError, not a hang, and the hint follows the signal (abort, kill from outside, crash); a run past
its timeout is a RunTimeout that says whether the ranks were idle (deadlock) or computing (too long);
no rank process outlives run_ranks; functions from a test module, lambdas, notebook-like functions
and unguarded scripts all work.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from parallel_mini.runtime import launch
from parallel_mini.runtime.launch import RankError, RankResult, RunTimeout

REPO = Path(__file__).resolve().parents[1]


def run_ranks(fn, world_size, *args, **kwargs):
    """These ranks compute on CPU tensors: pin gloo (the default would be NCCL on a GPU machine)."""
    return launch.run_ranks(fn, world_size, *args, backend="gloo", **kwargs)


@pytest.fixture(scope="module", autouse=True)
def _forkserver_started():
    """The first launch of a process starts the forkserver (it imports torch and the engine: 12 s
    measured at load average 14 on 2 cores). The timing assertions below are about the run, not
    about that: start it once before them, whichever test runs first (`-k` picks one alone)."""
    run_ranks(lambda: None, 1)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _rank_processes() -> list[psutil.Process]:
    """Live rank processes started from this test process: the forkserver's children (ranks are
    forked by it), and direct multiprocessing children (ranks under the spawn fallback). Other
    children (a server another test module keeps for the session, say) are not ranks."""
    found = []
    for child in psutil.Process().children():
        try:
            cmd = " ".join(child.cmdline())
            if "multiprocessing.forkserver" in cmd:
                found += child.children(recursive=True)
            elif "multiprocessing" in cmd and "resource_tracker" not in cmd:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return [p for p in found if _alive(p.pid)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _note_pid(pid_dir: str) -> None:
    """Every rank notes its pid before any goes on: a rank that fails at once must not have the run
    (and its peers) ended before a slow peer has noted its pid (seen under load: 1 of 2 pid files)."""
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()


def _pids(pid_dir: Path, n: int) -> list[int]:
    files = sorted(pid_dir.glob("rank*.pid"))
    assert len(files) == n, f"every rank should have started and noted its pid: {files}"
    return [int(f.read_text()) for f in files]


def _assert_no_rank_survives(pids=()):
    for pid in pids:
        assert not _alive(pid), f"rank process {pid} outlived run_ranks"
    assert _rank_processes() == [], "rank processes left behind"


# functions at module level: pickled by reference, the rank imports this module
def _module_fn(a, b=0):
    print(f"hello from rank {dist.get_rank()}")
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": a + b,
            "threads": torch.get_num_threads(), "backend": dist.get_backend()}


def _fail_on_rank_1(pid_dir):
    _note_pid(pid_dir)
    if dist.get_rank() == 1:
        print("about to fail")
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a peer that is gone: only the launcher can end this


def _abort_on_rank_1(pid_dir, peer_waits_in_barrier):
    _note_pid(pid_dir)
    if dist.get_rank() == 1:
        os.abort()  # dies without a word, as a C++ abort would
    if peer_waits_in_barrier:
        dist.barrier()  # gloo notices the lost peer and raises "Connection reset by peer"
    else:
        time.sleep(60)  # busy elsewhere: only the launcher can notice that rank 1 is gone


def _sizes_disagree_all_reduce(pid_dir):
    _note_pid(pid_dir)
    t = torch.ones(10 if dist.get_rank() == 0 else 1000)
    dist.all_reduce(t)


def _sizes_disagree_all_gather(pid_dir):
    _note_pid(pid_dir)
    r, n = dist.get_rank(), dist.get_world_size()
    out = [torch.empty(3) for _ in range(n)]
    dist.all_gather(out, torch.ones(3 if r == 0 else 5))


def _deadlock(pid_dir):
    _note_pid(pid_dir)
    t = torch.empty(4)
    dist.recv(t, src=1 - dist.get_rank())  # both ranks wait for a message nobody sends


def _spin(pid_dir):
    _note_pid(pid_dir)
    end = time.monotonic() + 60
    while time.monotonic() < end:  # computing, far longer than the timeout
        pass


def _sleep_after_noting_pid(pid_dir):
    _note_pid(pid_dir)
    time.sleep(60)


def _unpicklable_result():
    return threading.Lock()


def _exit_quietly():
    if dist.get_rank() == 1:
        os._exit(3)
    return "rank 0 is fine"


# ---------------------------------------------------------------------------------------------
# success
# ---------------------------------------------------------------------------------------------
def test_values_and_prints_come_back_per_rank():
    results = run_ranks(_module_fn, 3, 40, b=2)
    assert [type(r) for r in results] == [RankResult] * 3
    assert [r.rank for r in results] == [0, 1, 2]
    for r in results:
        assert r.value == {"rank": r.rank, "world": 3, "sum": 42, "threads": 1, "backend": "gloo"}
        assert r.output == f"hello from rank {r.rank}\n"
    _assert_no_rank_survives()


def test_lambda_closure_and_notebook_function_run():
    scale = 7
    assert [r.value for r in run_ranks(lambda: dist.get_rank() * 3, 2)] == [0, 3]

    def closure(x):  # local: not importable, shipped by value
        return x * scale + dist.get_rank()
    assert [r.value for r in run_ranks(closure, 2, 1)] == [7, 8]

    # A function from a module no rank can import (a notebook cell's `__main__`, say): by value.
    namespace = {"__name__": "some_notebook_cell_that_is_not_importable"}
    exec(textwrap.dedent("""
        import torch.distributed as dist
        def notebook_fn(k):
            return [dist.get_rank()] * k
    """), namespace)
    assert [r.value for r in run_ranks(namespace["notebook_fn"], 2, 2)] == [[0, 0], [1, 1]]


def _listening(pid: int) -> list[tuple[str, int]]:
    """The TCP addresses process `pid` listens on (read from a rank, during the run)."""
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
                  if c.status == psutil.CONN_LISTEN)


def test_the_rendezvous_store_listens_on_loopback_only(monkeypatch):
    """The launcher's TCPStore, created for 127.0.0.1, used to listen on every interface (issue
    26: a client reached it through the machine's external address and read the peers' keys).
    Read during a run, from its ranks: the store's port is bound to 127.0.0.1 and nothing else.
    (Never checked by connecting from outside: only the listening sockets are read.)"""
    ports = []

    def recording(pg_timeout):
        store = real(pg_timeout)
        ports.append(store.port)
        return store
    real = launch.loopback_store
    monkeypatch.setattr(launch, "loopback_store", recording)
    seen = [r.value for r in run_ranks(_listening, 2, os.getpid())]
    assert len(ports) == 1
    for addresses in seen:
        assert [a for a in addresses if a[1] == ports[0]] == [("127.0.0.1", ports[0])], addresses


def test_world_size_out_of_range():
    for n in (0, 17):
        with pytest.raises(ValueError, match="world_size"):
            run_ranks(_module_fn, n, 1)


# ---------------------------------------------------------------------------------------------
# failure: prompt, named, nothing left behind
# ---------------------------------------------------------------------------------------------
def test_a_raising_rank_fails_the_run_promptly_with_its_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank_1, 2, str(tmp_path), timeout=60, pg_timeout=60)
    elapsed = time.monotonic() - t0
    e = info.value
    assert not isinstance(e, RunTimeout)
    assert e.rank == 1
    assert "Traceback" in e.details and "ValueError: boom on rank 1" in e.details
    assert "_fail_on_rank_1" in e.details  # the failing frame is named
    assert "rank 1" in str(e)
    assert e.outputs[1] == "about to fail\n"
    assert elapsed < 10, f"took {elapsed:.1f} s: the run should fail as soon as rank 1 does"
    _assert_no_rank_survives(_pids(tmp_path, 2))


def test_a_rank_dying_silently_is_reported_with_its_signal(tmp_path):
    """launch.py's contract: a rank that dies without a word is reported with its exit signal.
    (The timeout is short only to keep a failure of this test cheap; passing needs < 5 s.)"""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_abort_on_rank_1, 2, str(tmp_path), False, timeout=8, pg_timeout=60)
    elapsed = time.monotonic() - t0
    assert not isinstance(info.value, RunTimeout), \
        f"a dead rank was reported as a deadlock after {elapsed:.1f} s: {info.value}"
    assert info.value.rank == 1 and "SIGABRT" in info.value.details
    assert elapsed < 5
    _assert_no_rank_survives(_pids(tmp_path, 2))


def test_a_quiet_exit_is_reported_with_its_exit_code():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_exit_quietly, 2, timeout=8)
    assert not isinstance(info.value, RunTimeout), str(info.value)
    assert info.value.rank == 1 and "exit code 3" in info.value.details
    assert time.monotonic() - t0 < 5


def test_an_abort_is_named_even_when_its_peers_fail_because_of_it(tmp_path):
    """Rank 1 aborts; rank 0 then fails in its barrier with gloo's 'Connection reset by peer'.
    The report must lead the learner to the cause (rank 1, SIGABRT), not only to the symptom."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_abort_on_rank_1, 2, str(tmp_path), True, timeout=60, pg_timeout=60)
    assert time.monotonic() - t0 < 10
    assert "SIGABRT" in str(info.value), f"the root cause is missing from:\n{info.value}"
    _assert_no_rank_survives(_pids(tmp_path, 2))


@pytest.mark.parametrize("fn", [_sizes_disagree_all_reduce, _sizes_disagree_all_gather],
                         ids=["all_reduce", "all_gather"])
def test_ranks_disagreeing_on_sizes_is_a_rank_error_not_a_hang(fn, tmp_path):
    """gloo either raises (list all_gather checks sizes) or aborts the process in C++
    (all_reduce: 'Received data size doesn't match expected size'). Both must end the run quickly;
    pg_timeout and timeout are far away so that neither can be what ends it."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(fn, 2, str(tmp_path), timeout=60, pg_timeout=60)
    elapsed = time.monotonic() - t0
    assert not isinstance(info.value, RunTimeout)
    assert elapsed < 10, f"took {elapsed:.1f} s"
    _assert_no_rank_survives(_pids(tmp_path, 2))


def test_a_deadlock_is_a_run_timeout(tmp_path):
    """The ranks' CPU time is read over the last second before the deadline: they must have started
    (and gone idle) before it. Measured from the call to both pids noted: 1.2-1.9 s at load average
    14 on 2 cores (other test suites running); a 4 s timeout leaves 3 s."""
    t0 = time.monotonic()
    with pytest.raises(RunTimeout) as info:
        run_ranks(_deadlock, 2, str(tmp_path), timeout=4, pg_timeout=60)
    elapsed = time.monotonic() - t0
    assert 4 <= elapsed < 11, f"took {elapsed:.1f} s for a 4 s timeout"
    message = str(info.value)
    assert "ranks [0, 1] did not finish within 4 s" in message
    assert "idle" in message and "deadlock" in message, message  # both waited: 0 % CPU
    assert info.value.idle is True and sorted(info.value.cpu_share) == [0, 1]
    _assert_no_rank_survives(_pids(tmp_path, 2))


def test_a_run_still_computing_at_the_timeout_is_not_called_a_deadlock(tmp_path):
    """The ranks spin: the message says they were computing and names the flag that gives more time.
    (A rank still starting when its CPU time is read, 0.5 s before this 1 s deadline, computes too.)"""
    with pytest.raises(RunTimeout) as info:
        run_ranks(_spin, 2, str(tmp_path), timeout=1, pg_timeout=60)
    message = str(info.value)
    assert "did not finish within 1 s" in message and "still computing" in message, message
    assert "--timeout-s" in message and "deadlock" not in message, message
    assert info.value.idle is False
    # the ranks may not have reached their pid files within 1 s on a loaded machine: those noted
    _assert_no_rank_survives([int(f.read_text()) for f in tmp_path.glob("rank*.pid")])


def test_a_rank_killed_from_outside_is_not_blamed_on_a_collective(tmp_path, monkeypatch):
    """kill -9 of one rank (as `kill` or the out-of-memory killer would): the hint says it came from
    outside. The oom_kill counter is held still so that an OOM kill elsewhere on the machine during
    the test cannot change the hint; that branch is tested on its own below."""
    monkeypatch.setattr(launch, "oom_kills", lambda: 7)

    def kill_rank_1():
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1)
    killer.start()
    with pytest.raises(RankError) as info:
        run_ranks(_sleep_after_noting_pid, 2, str(tmp_path), timeout=60, pg_timeout=60)
    killer.join()
    e = info.value
    assert not isinstance(e, RunTimeout) and e.rank == 1
    assert "SIGKILL" in e.details and "killed from outside" in e.details, e.details
    assert "disagreed" not in e.details
    _assert_no_rank_survives(_pids(tmp_path, 2))


def test_the_hint_follows_the_signal(monkeypatch):
    monkeypatch.setattr(launch, "oom_kills", lambda: 5)
    assert "out-of-memory killer ran" in launch._why_it_died(-signal.SIGKILL, 4)  # counter rose
    assert "killed from outside" in launch._why_it_died(-signal.SIGKILL, 5)
    assert "killed from outside" in launch._why_it_died(-signal.SIGTERM, None)  # no /proc/vmstat
    assert "disagreed on a collective" in launch._why_it_died(-signal.SIGABRT, 5)
    assert "crash in native code" in launch._why_it_died(-signal.SIGSEGV, 5)
    for code in (-signal.SIGKILL, -signal.SIGSEGV, 3):
        assert "disagreed" not in launch._why_it_died(code, 5)


def test_an_unpicklable_result_is_a_rank_error():
    with pytest.raises(RankError) as info:
        run_ranks(_unpicklable_result, 2, timeout=30)
    assert "pickle" in info.value.details.lower()
    _assert_no_rank_survives()


def test_the_launcher_works_after_failures():
    """The forkserver survives failed runs: the next run is normal."""
    assert [r.value["rank"] for r in run_ranks(_module_fn, 2, 1)] == [0, 1]


# ---------------------------------------------------------------------------------------------
# a script without `if __name__ == "__main__":`
# ---------------------------------------------------------------------------------------------
def test_unguarded_script_runs_its_body_once(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import os
        print("BODY", os.getpid(), flush=True)
        import torch.distributed as dist
        from parallel_mini.runtime.launch import run_ranks

        def which():
            return dist.get_rank() * 10

        print("RESULT", [r.value for r in run_ranks(which, 2)], flush=True)
        print("AGAIN", [r.value for r in run_ranks(lambda: dist.get_world_size(), 3)], flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("BODY")] == [f"BODY {lines[0].split()[1]}"], \
        f"the script's body ran more than once:\n{proc.stdout}"
    assert "RESULT [0, 10]" in lines and "AGAIN [3, 3, 3]" in lines


# ---------------------------------------------------------------------------------------------
# a rank ends when its launcher is gone (exit_with_parent), however late or early that happens
# ---------------------------------------------------------------------------------------------
def _child_watching(read_end_closed_before_watch: bool) -> tuple[int, int]:
    """Fork a stand-in rank that holds the write end of a result pipe and would sleep 30 s; the test
    process plays the launcher, holding the read end. Returns (child pid, read end or -1)."""
    r, w = os.pipe()
    if read_end_closed_before_watch:
        os.close(r)  # the launcher died before the rank could start watching (prctl's race)
    pid = os.fork()
    if pid == 0:  # the stand-in rank: only os calls and a thread, no torch
        try:
            if not read_end_closed_before_watch:
                os.close(r)
            launch.exit_with_parent(w)
            time.sleep(30)
        finally:
            os._exit(0)  # 0 only if the watch did not end it
    os.close(w)
    return pid, (-1 if read_end_closed_before_watch else r)


def _exit_status_within(pid: int, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watch is Linux-only")
def test_a_rank_ends_when_its_launcher_is_gone_before_or_after_it_starts_watching():
    pid, _ = _child_watching(read_end_closed_before_watch=True)
    assert _exit_status_within(pid, 5) == 1, "a launcher gone before the watch went unnoticed"

    pid, read_end = _child_watching(read_end_closed_before_watch=False)
    time.sleep(0.3)  # its watch is running by now (a thread started right after the fork)
    assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the rank ended while its launcher was alive"
    os.close(read_end)  # the launcher dies
    assert _exit_status_within(pid, 5) == 1, "the rank outlived its launcher"
