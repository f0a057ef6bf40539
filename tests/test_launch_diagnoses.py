"""The launcher names what went wrong with a rank from outside it (issue 26): a rank stopped by a
signal (SIGSTOP: state T in /proc/PID/stat) is named as stopped within STOPPED_GRACE_S, not
reported after the process group's timeout as its peer's recv timeout; a rank that hangs is named
with where it is ("made no progress for N s in F (file:line)", from its own stack, which it dumps
on SIGUSR1); a forkserver killed from outside is not taken for the ranks' exit (it reports their
exit status: its sentinels all read EOF, exit code 255), and ranks that go on finish the run.
Each test waits for states: the ranks put themselves in the state (stop themselves, block, kill
their forkserver) once every rank has reached the same point."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from pathlib import Path

from parallel_mini.runtime import launch
from parallel_mini.runtime.launch import RankError

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


def run_ranks(fn, world_size, *args, **kwargs):
    return launch.run_ranks(fn, world_size, *args, backend="gloo", **kwargs)


def _rank_1_stops_itself():
    dist.barrier()  # both ranks are up
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # as `kill -STOP`: the rank runs nothing any more
    dist.barrier()  # rank 0 waits here for a peer that never comes


def test_a_stopped_rank_is_named_as_stopped():
    """pg_timeout 300 s: before, rank 0's recv timed out after it and was blamed."""
    with pytest.raises(RankError) as info:
        run_ranks(_rank_1_stops_itself, 2, timeout=600, pg_timeout=300)
    e = info.value
    assert e.rank == 1, str(e)
    assert "rank 1 stopped (SIGSTOP state T in /proc/" in e.details, e.details
    assert "Timed out" not in e.details


def _rank_1_blocks():
    dist.barrier()
    if dist.get_rank() == 1:
        threading.Event().wait()  # blocked for ever, outside any collective
    dist.barrier()


def test_a_hung_rank_is_named_with_where_it_is():
    """Rank 0 times out waiting for rank 1 in the barrier (pg_timeout 8 s); the report names rank
    1, the seconds, and its innermost call and this test's function (its own stack)."""
    with pytest.raises(RankError) as info:
        run_ranks(_rank_1_blocks, 2, timeout=600, pg_timeout=8)
    e = info.value
    assert e.rank == 1, str(e)
    first = e.details.splitlines()[0]
    assert first.startswith("rank 1 made no progress for 8 s in wait (") and \
        "called from _rank_1_blocks (tests/test_launch_diagnoses.py:" in first, e.details
    assert "rank 0 waited that long for it in a collective and timed out" in first
    assert "Then rank 0 failed" in e.details  # its own words follow


def _kill_my_forkserver(seen):
    dist.barrier()
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as fh:
        is_forkserver = b"forkserver" in fh.read()
    if dist.get_rank() == 0 and is_forkserver:
        os.kill(parent, signal.SIGKILL)
    while is_forkserver and not os.path.exists(seen):  # the launcher has seen it gone
        time.sleep(0.01)
    dist.barrier()  # both ranks go on after their forkserver is gone
    return {"rank": dist.get_rank(), "forkserver": is_forkserver}


@pytest.mark.slow  # starts a second forkserver (torch's import again)
def test_a_killed_forkserver_is_not_the_ranks_exit(tmp_path, monkeypatch):
    """The ranks finish and their results come back (before: 'rank 0 died with exit code 255 ...
    os._exit or sys.exit called inside the rank'); the next run starts a new forkserver. The ranks
    go on once the launcher has seen the forkserver gone (a file it makes then): before, it had
    raised by that time."""
    seen = tmp_path / "seen"
    gone = launch.Watch.forkserver_gone

    def forkserver_gone(self):
        if gone(self):
            seen.touch()
            return True
        return False
    monkeypatch.setattr(launch.Watch, "forkserver_gone", forkserver_gone)
    results = run_ranks(_kill_my_forkserver, 2, str(seen), timeout=300)
    assert [r.value["rank"] for r in results] == [0, 1]
    if not results[0].value["forkserver"]:
        pytest.skip("ranks were not started by a forkserver here")
    assert seen.exists()
    assert [r.value for r in run_ranks(lambda: 7, 1, timeout=300)] == [7]


def test_where_reads_the_main_thread_of_a_dump():
    dump = ('Thread 0x00007f01 (most recent call first):\n'
            '  File "/x/lib/python3.11/selectors.py", line 415 in select\n'
            '  File "/repo/parallel_mini/launch.py", line 180 in watch\n\n'
            'Current thread 0x00007f02 (most recent call first):\n'
            '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2345 in recv\n'
            '  File "/repo/parallel_mini/parallel/pipeline.py", line 88 in receive\n'
            '  File "/repo/parallel_mini/step.py", line 12 in train_step\n'
            '  File "/repo/parallel_mini/launch.py", line 240 in _rank_main\n')
    assert launch.innermost_calls(dump) == ("recv (distributed/distributed_c10d.py:2345), called "
                                            "from receive (parallel/pipeline.py:88)")


@pytest.mark.slow  # a CLI in a subprocess
def test_rank_0_killed_after_a_complete_save_says_only_the_report_is_lost(tmp_path):
    """Rank 0 SIGKILLed once its last checkpoint is whole and `latest` names it (checkpoint's
    crash_point 'save N latest'): one line, exit 1, saying what happened (before: 'run failed on
    rank 0' and the kill's hint). A real CLI run: the hook reads the environment in the ranks."""
    from parallel_mini.runtime import checkpoint
    if not hasattr(checkpoint, "crash_point"):
        pytest.skip("needs checkpoint.crash_point (periodic checkpoints, issue 26 item 1)")
    ck = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-m", "parallel_mini", "run", "--dp", "2", "--steps", "2", "--layers", "1",
         "--d-model", "16", "--heads", "2", "--seq", "8", "--vocab", "32", "--batch", "4",
         "--save", str(ck)], cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PARALLEL_MINI_KILL": json.dumps({"rank": 0, "at": "save 2 latest"})})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: rank 0 died with signal SIGKILL after the run's last save: "
                               f"all 2 steps trained and {ck}/step_2 is complete"), lines[0]
    assert (ck / "latest").read_text().strip() == "step_2"
