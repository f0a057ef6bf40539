"""torchrun's elastic restarts resume from the last periodic checkpoint: two agents on loopback
(two "nodes", c10d rendezvous), one worker SIGKILLed mid-run, torchrun restarts the group with the
same command line, which resumes from DIR/latest and finishes the very run an uninterrupted one
makes: the same losses and every shard file of the final checkpoint byte for byte."""
import json
import os

from test_multinode import _agents

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run

# torchrun's agents share one store with their workers by default, and a restarted group reads the
# previous group's keys from it (pytorch issue 135712: each agent counts its restarts itself);
# seen here as gloo "Connection refused" to the dead group's ports, two wasted restarts out of three.
ELASTIC = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
SMALL = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8)


def _flags(d: dict) -> list[str]:
    return [x for k, v in d.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _shards(folder: str) -> dict:
    files = json.load(open(os.path.join(folder, "meta.json")))["files"]
    return {name: f["sha256"] for name, f in files.items() if name.endswith(".distcp")}


def test_worker_killed_torchrun_restarts_and_resumes(tmp_path):
    """dp2 over two one-worker "nodes", 5 steps saved every 2. Global rank 1 SIGKILLs itself after
    step 3 (once: the marker file). torchrun (--max-restarts 3) restarts both nodes' workers; the
    new group resumes from step_2 and trains steps 3-5."""
    every = dict(dp=2, steps=5, save_every=2, **SMALL)
    straight_dir, ck, marker = str(tmp_path / "a"), str(tmp_path / "ck"), str(tmp_path / "killed")
    straight = run(RunConfig(save=straight_dir, **every))
    kill = json.dumps({"rank": 1, "at": "step 3", "once": marker})
    nodes = _agents([*_flags(every), "--save", ck, "--resume", ck, "--json", "-"], nproc=1,
                    torchrun=("--max-restarts", "3"), env={"PARALLEL_MINI_KILL": kill, **ELASTIC})
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    assert os.path.exists(marker)  # the kill happened
    reports = [json.loads(n.stdout) for n in nodes if n.stdout.strip()]  # (rank 0: either node
    assert len(reports) == 1, [n.stdout[:200] for n in nodes]            # after the restart)
    report = reports[0]
    assert report["resumed_from_step"] == 2 and report["losses"] == straight.losses[2:]
    want, got = _shards(os.path.join(straight_dir, "step_5")), _shards(os.path.join(ck, "step_5"))
    assert len(want) == 2 and want == got
    assert sorted(n for n in os.listdir(ck) if not n.startswith(".")) == \
        ["latest", "step_2", "step_4", "step_5"]
