"""Two torchrun agents on loopback form one job: the multi-node path (c10d rendezvous, one agent a
"node") run here without a second machine. Traffic stays on 127.0.0.1."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(args: list[str], nnodes: int = 2, nproc: int = 2, timeout: float = 180,
            torchrun: tuple = (), env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """`nnodes` torchrun agents, each `nproc` workers, meeting at one c10d endpoint on loopback;
    `torchrun`: more of its flags (--max-restarts R), `env`: more environment for the workers."""
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    procs = [subprocess.Popen(
        [str(TORCHRUN), *torchrun, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"pm{port}",
         "--node-rank", str(i), "--local-addr", "127.0.0.1", "-m", "parallel_mini", "run", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        for i in range(nnodes)]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:  # (a hung agent: it and its workers, each agent's own session, are ended)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return out


def test_two_agents_dp2_tp2_equal_the_reference():
    """Node 0 holds ranks 0-1 (one tp pair), node 1 ranks 2-3: tp inside a node, dp across nodes."""
    node0, node1 = _agents(["--dp", "2", "--tp", "2", "--layers", "2", "--d-model", "32", "--heads", "2",
                            "--seq", "16", "--vocab", "64", "--batch", "4", "--steps", "2",
                            "--reference", "--json", "-"])
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert node1.stdout.strip() == ""  # only global rank 0 (on node 0) prints
    report = json.loads(node0.stdout)
    assert report["world_size"] == 4
    assert report["max_abs_diff"] <= 1e-5
    coords = {r["rank"]: r["coords"] for r in report["ranks"]}
    assert {coords[0]["tp"], coords[1]["tp"]} == {0, 1} and coords[0]["dp"] == coords[1]["dp"]
    assert coords[2]["dp"] != coords[0]["dp"]
