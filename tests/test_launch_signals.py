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


def _start_training(mark: str) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """A 2-rank run far too long to finish. Its stderr is drained by a thread (a full pipe would block
    the CLI's last words); the event is set once rank 0 reported its first step (or at EOF)."""
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
        first_step.set()  # EOF: the CLI is gone (the caller's assertion says why)

    threading.Thread(target=drain, daemon=True).start()
    return cli, lines, first_step


def _ranks(procs: dict[int, int], cli_pid: int) -> list[int]:
    """The ranks: children of a marked process that is not the CLI (the forkserver)."""
    return [pid for pid, ppid in procs.items() if ppid in procs and ppid != cli_pid]


def _wait_until_gone(mark: str, pids, within: float) -> dict[int, int]:
    deadline = time.monotonic() + within
    while (left := {p: pp for p, pp in _marked(mark).items() if p in pids}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_sigterm_and_sigkill_of_the_cli_leave_no_process_behind():
    """Two CLIs train at once (their start-up, mostly imports, is the cost of this test: run side by
    side on 2 cores it is paid about once); one gets SIGTERM, the other SIGKILL."""
    marks = {"TERM": uuid.uuid4().hex, "KILL": uuid.uuid4().hex}
    started = {how: _start_training(mark) for how, mark in marks.items()}
    try:
        _signal_both_and_check(marks, started)
    finally:  # a failed assertion must not leave a CLI training (its ranks would follow it)
        for cli, _, _ in started.values():
            if cli.poll() is None:
                cli.kill()


def _signal_both_and_check(marks, started):
    procs, ranks = {}, {}
    for how, (cli, lines, first_step) in started.items():
        first_step.wait(timeout=120)
        assert any(ln.startswith("step ") for ln in lines) and cli.poll() is None, "".join(lines)
        procs[how] = _marked(marks[how])
        ranks[how] = _ranks(procs[how], cli.pid)
        assert len(ranks[how]) == 2, procs[how]

    started["TERM"][0].send_signal(signal.SIGTERM)
    started["KILL"][0].kill()  # no handler runs: the ranks must notice by themselves

    # SIGTERM: the CLI kills and joins its ranks, says so in one line, exits 128 + 15.
    cli, lines, _ = started["TERM"]
    assert cli.wait(timeout=60) == 128 + signal.SIGTERM
    said = "stopped by SIGTERM: every rank was ended; no report\n"
    deadline = time.monotonic() + 10  # written before the exit; the drain thread may lag behind
    while lines[-1] != said and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lines[-1] == said, lines[-3:]
    assert not any("Traceback" in ln for ln in lines)
    assert _wait_until_gone(marks["TERM"], ranks["TERM"], 0) == {}, "a rank outlived the CLI"

    # SIGKILL: the ranks end themselves within moments (measured: 0.07 s).
    assert started["KILL"][0].wait(timeout=60) == -signal.SIGKILL
    assert _wait_until_gone(marks["KILL"], ranks["KILL"], 5) == {}, \
        "the ranks kept running after the CLI was killed"

    # Then the forkserver and the resource tracker end, their last client gone (the forkserver's
    # own interpreter shutdown: 3-5 s measured on a loaded 2-core machine).
    for how in marks:
        assert _wait_until_gone(marks[how], procs[how], 60) == {}, \
            f"a process of the run outlived the CLI ({how})"


def test_the_progress_line_is_written_in_one_write():
    """The race behind a failure of the test above: print() wrote "step 2/10000  loss 4.8191" and
    its newline in two writes, the rank was killed between them, and the CLI's "stopped by
    SIGTERM" line was glued to the open one. engine.say_progress writes line and newline at once."""
    import io
    from parallel_mini.engine import say_progress

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, s):
            self.calls.append(s)
            return super().write(s)

    out = Writes()
    say_progress(2, 10000, 4.81912, stream=out)
    assert out.calls == ["step 2/10000  loss 4.8191\n"]
