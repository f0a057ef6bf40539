"""The same entry point under torchrun (the path a learner with GPUs uses), here on gloo."""
import json
import os
import subprocess
import sys
from pathlib import Path

TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_torchrun_two_ranks_equals_reference():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "parallel_mini", "run",
         "--dp", "2", "--steps", "2", "--reference", "--json", "-"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)  # only rank 0 prints: stdout is exactly one JSON object
    assert report["world_size"] == 2
    assert report["max_abs_diff"] <= 1e-5
    assert report["measured"]["wire_bytes_per_step"]["dp"] == report["theory"]["wire_bytes_per_step"]["dp"]
