"""The CLI's ranks end with it: a SIGTERM cleans up like Ctrl-C (ranks killed, one line, exit 143), and
after a SIGKILL of the CLI, which runs no cleanup at all, the ranks end themselves (launch's
exit_with_parent) and the forkserver and resource tracker follow. The processes are found by a marker
in the CLI's environment, which every process it starts inherits: a scan of /proc/*/environ finds them
whoever their parent is now."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = "PARALLEL_MINI_TEST_MARK"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _marked(mark: str) -> dict[int, int]:
    """{pid: parent pid} of the live processes (zombies excluded) that carry `mark`."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"{MARK}={mark}".encode() not in (d / "environ").read_bytes():
                continue
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if fields[0] != "Z":
            found[int(d.name)] = int(fields[1])
    return found


def _start_training(mark: str) -> tuple[subprocess.Popen, list[str]]:
    """A 2-rank run far too long to finish; returns once rank 0 reported its first step. Its stderr
    is drained by a thread (a full pipe would block the CLI's last words)."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "parallel_mini", "run", "--dp", "2", "--steps", "10000", "--layers",
         "1", "--d-model", "16", "--heads", "2", "--progress"],
        cwd=REPO, env={**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first_step = threading.Event()

    def drain():
        for line in cli.stderr:
            lines.append(line)
            if line.startswith("step "):
                first_step.set()
        first_step.set()  # EOF: the CLI is gone (the assertion below says why)

    threading.Thread(target=drain, daemon=True).start()
    first_step.wait(timeout=120)
    assert any(ln.startswith("step ") for ln in lines) and cli.poll() is None, "".join(lines)
    return cli, lines


def _ranks(procs: dict[int, int], cli_pid: int) -> list[int]:
    """The ranks: children of a marked process that is not the CLI (the forkserver)."""
    return [pid for pid, ppid in procs.items() if ppid in procs and ppid != cli_pid]


def _wait_until_gone(mark: str, pids, within: float) -> dict[int, int]:
    deadline = time.monotonic() + within
    while (left := {p: pp for p, pp in _marked(mark).items() if p in pids}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_sigterm_to_the_cli_ends_every_rank_with_one_line():
    mark = uuid.uuid4().hex
    cli, lines = _start_training(mark)
    procs = _marked(mark)
    ranks = _ranks(procs, cli.pid)
    assert len(ranks) == 2, procs
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(0.1)  # the drain thread reads the last line
    assert lines[-1] == "stopped by SIGTERM: every rank was ended; no report\n", lines[-3:]
    assert not any("Traceback" in ln for ln in lines)
    # The CLI killed and joined its ranks before exiting; the forkserver and the resource tracker
    # end when their last client is gone (their own interpreter shutdown: ~1 s, ~6 s on a loaded
    # 2-core machine).
    assert _wait_until_gone(mark, ranks, 0) == {}, "a rank outlived the CLI"
    assert _wait_until_gone(mark, procs, 60) == {}, "a process of the run outlived the CLI"


def test_sigkill_of_the_cli_ends_every_rank():
    mark = uuid.uuid4().hex
    cli, _ = _start_training(mark)
    procs = _marked(mark)
    ranks = _ranks(procs, cli.pid)
    assert len(ranks) == 2, procs
    cli.kill()  # no handler runs: the ranks must notice by themselves
    assert cli.wait(timeout=60) == -signal.SIGKILL
    assert _wait_until_gone(mark, ranks, 5) == {}, "the ranks kept running after the CLI was killed"
    assert _wait_until_gone(mark, procs, 60) == {}, "a process of the run outlived the CLI"
