"""RunConfig validation and the command line (DESIGN.md: "the run contract").

Every bad input must give exactly one ConfigError whose one-line message names the field, before any
rank starts; the CLI prints that line (prefixed "error:") and exits 2 with no traceback; `--json -`
prints one JSON object with the run-contract keys.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_mini.runtime import launch
from parallel_mini.__main__ import main as cli_main
from parallel_mini.config import ConfigError, RunConfig

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # the venv's python when pytest runs from it


# ---------------------------------------------------------------------------------------------
# RunConfig.validate
# ---------------------------------------------------------------------------------------------
BAD = [
    # (changes, the flag the message must name)
    (dict(dp=4, batch=6), "--batch"),
    (dict(dp=2, grad_accum=3, batch=8), "--batch"),
    (dict(dp=2, grad_accum=2, batch=6), "--batch"),
    *[(dict(**{name: 0}), "--" + name.replace("_", "-"))
      for name in ("dp", "layers", "d_model", "heads", "seq", "vocab", "batch", "steps",
                   "grad_accum", "microbatches")],
    *[(dict(**{name: -2}), "--" + name.replace("_", "-"))
      for name in ("dp", "layers", "d_model", "seq", "vocab", "batch", "steps", "grad_accum")],
    (dict(dp=2.0), "--dp"),
    (dict(layers=True), "--layers"),
    (dict(bucket_mb=0), "--bucket-mb"),
    (dict(bucket_mb=-1.0), "--bucket-mb"),
    (dict(bucket_mb=float("nan")), "--bucket-mb"),
    (dict(lr=0), "--lr"),
    (dict(lr=-1e-3), "--lr"),
    (dict(timeout_s=0), "--timeout-s"),
    (dict(dp_mode="fast"), "--dp-mode"),
    (dict(optimizer="rmsprop"), "--optimizer"),
    (dict(precision="fp16"), "--precision"),
    (dict(schedule="zigzag"), "--schedule"),
    (dict(checkpointing="everything"), "--checkpointing"),
    (dict(backend="mpi"), "--backend"),
    (dict(zero=4), "--zero"),
    (dict(d_model=64, heads=5), "--d-model"),
    (dict(d_model=4, heads=8), "--heads"),
    (dict(zero=-1), "--zero"),
    (dict(zero="1"), "--zero"),
    (dict(zero=1, dp_mode="naive"), "--dp-mode"),  # ZeRO reduce-scatters by itself
    # expert parallel (issue 12's bad inputs): one line before any rank starts
    (dict(ep=2), "--ep"),  # no experts to shard
    (dict(dp=2, ep=2, experts=3), "--experts"),  # E not divisible by P
    (dict(experts=4, top_k=5), "--top-k"),  # K > E
    (dict(experts=4, capacity_factor=0.0), "--capacity-factor"),
    (dict(experts=4, capacity_factor=-1.0), "--capacity-factor"),
    (dict(dp=2, ep=4, experts=8, batch=8), "--ep"),  # ep does not divide the data-parallel ranks
    (dict(dp=3, ep=2, experts=4, batch=6), "--ep"),
    (dict(experts=-1), "--experts"),
    (dict(experts=4, moe_every=0), "--moe-every"),
    (dict(experts=4, moe_every=5, layers=4), "--moe-every"),
    (dict(dp=12, dp_shard=4, ep=6, experts=6, zero=2, batch=12), "--ep"),  # ep across shard groups
    (dict(steps=10_001), "--steps"),
]


@pytest.mark.parametrize("changes,flag", BAD, ids=[repr(c) for c, _ in BAD])
def test_bad_config_gives_one_config_error_naming_the_field(changes, flag):
    with pytest.raises(ConfigError) as info:
        RunConfig(**changes).validate()
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert flag in msg, msg
    assert "\n" not in msg, "the message must be one line"


def test_world_size_over_the_local_limit():
    n = launch.MAX_LOCAL_RANKS
    RunConfig(dp=n, batch=n).validate()  # the limit itself is fine
    with pytest.raises(ConfigError, match="world size") as info:
        RunConfig(dp=n + 1, batch=n + 1).validate()
    assert str(n + 1) in str(info.value) and "torchrun" in str(info.value)


@pytest.mark.parametrize("changes,flag", [
    (dict(lr="fast"), "--lr"),
    (dict(bucket_mb=None), "--bucket-mb"),
    (dict(timeout_s="10"), "--timeout-s"),
    (dict(seed=1.5), "--seed"),
], ids=["lr-str", "bucket-None", "timeout-str", "seed-float"])
def test_wrongly_typed_values_from_python_are_config_errors(changes, flag):
    """The app and lessons build RunConfig from Python (or JSON): a wrongly typed value must be a
    ConfigError naming the field too, not a TypeError here or a crash inside the ranks."""
    with pytest.raises(ConfigError) as info:
        RunConfig(**changes).validate()
    assert flag in str(info.value)


def test_good_configs_validate_and_round_trip():
    cfg = RunConfig(dp=4, batch=8, grad_accum=2, dp_mode="naive", optimizer="sgd").validate()
    assert cfg.world_size == 4
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(dp=2).dp == 2
    with pytest.raises(ConfigError, match="--batch"):
        cfg.replace(dp=3)
    with pytest.raises(ConfigError, match="unknown field"):
        RunConfig.from_dict({**cfg.to_dict(), "dp_degree": 2})


# ---------------------------------------------------------------------------------------------
# the CLI, in process (cheap) ...
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,flag", [
    (["--dp", "0"], "--dp"),
    (["--dp", "3"], "--batch"),
    (["--heads", "3"], "--d-model"),
    (["--dp-mode", "fast"], "--dp-mode"),
    (["--optimizer", "lamb"], "--optimizer"),
    (["--ep", "2"], "--ep"),
    (["--dp", "4", "--ep", "4", "--experts", "6"], "--experts"),
    (["--experts", "4", "--top-k", "8"], "--top-k"),
    (["--experts", "4", "--capacity-factor", "0"], "--capacity-factor"),
    (["--dp", "2", "--ep", "4", "--experts", "8"], "--ep"),
    (["--zero", "5"], "--zero"),
    (["--zero", "2", "--dp-mode", "naive"], "--dp-mode"),
    (["--precision", "fp16"], "--precision"),
    (["--dp", "17", "--batch", "17"], "world size"),
    (["--bucket-mb", "0"], "--bucket-mb"),
])
def test_cli_config_error_is_one_line_exit_2(argv, flag, capsys):
    assert cli_main(["run", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], err


# ---------------------------------------------------------------------------------------------
# ... and as a real process: exit status, no traceback, the JSON report
# ---------------------------------------------------------------------------------------------
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq", "8", "--vocab", "32",
        "--batch", "4", "--steps", "2"]
CASES = {
    "batch": ["run", "--dp", "3", "--batch", "8"],
    "json": ["run", "--dp", "2", *TINY, "--reference", "--json", "-"],
}


@pytest.fixture(scope="module")
def cli_runs():
    """All CLI processes start at once (each pays the torch import; 2 cores share them)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {k: subprocess.Popen([PYTHON, "-m", "parallel_mini", *argv], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, argv in CASES.items()}
    out = {}
    try:
        for k, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            out[k] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_cli_process_config_error(cli_runs):
    rc, stdout, stderr = cli_runs["batch"]
    assert rc == 2, stderr
    assert stdout == ""
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--batch" in lines[0], stderr


@pytest.mark.parametrize("argv,flag", [(["--dp", "abc"], "--dp"), (["--steps", "2.5"], "--steps"),
                                       (["--dpp", "2"], "--dpp")])
def test_cli_argparse_error_is_one_error_line(argv, flag, capsys):
    """`--dp abc` is a bad value too: the contract is one line naming the field, exit 2, no
    traceback. (argparse's default prints a usage block first and prefixes the program name.)"""
    with pytest.raises(SystemExit) as info:
        cli_main(["run", *argv])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], lines


def test_cli_json_report_has_the_run_contract(cli_runs):
    rc, stdout, stderr = cli_runs["json"]
    assert rc == 0, stderr
    report = json.loads(stdout)  # stdout is exactly one JSON object
    assert isinstance(report, dict)
    for key in ("config", "world_size", "losses", "reference_losses", "max_abs_diff", "ranks",
                "theory"):
        assert key in report, key
    cfg = report["config"]
    assert (cfg["dp"], cfg["layers"], cfg["d_model"], cfg["steps"], cfg["reference"]) == \
        (2, 1, 16, 2, True)
    assert report["world_size"] == 2
    assert len(report["losses"]) == len(report["reference_losses"]) == 2
    assert 0 <= report["max_abs_diff"] <= 1e-5
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        assert set(r["coords"]) == {"dp", "tp", "pp", "cp", "ep"}
        assert r["coords"]["dp"] == r["rank"]
        for k in ("params", "grads", "optimizer", "activations_peak", "total_peak"):
            assert isinstance(r["memory"][k], int) and r["memory"][k] > 0, k
        assert r["comm"], "a dp=2 run communicates"
        for rec in r["comm"]:
            for k in ("op", "group", "count", "payload_bytes", "wire_bytes_model"):
                assert k in rec
        assert {e["kind"] for e in r["events"]} >= {"forward", "backward", "optimizer"}
        for e in r["events"]:
            for k in ("kind", "microbatch", "stage", "start", "end", "cpu"):
                assert k in e
    th = report["theory"]
    assert th["memory"]["params"] == report["ranks"][0]["memory"]["params"]
    assert th["wire_bytes_per_step"]["dp"] > 0


def test_pipeline_defaults_for_layers_and_steps(capsys):
    """Without --layers/--steps a pipeline gets 4 blocks per chunk and 6 steps (a note, printed
    once the run is accepted); what the learner gives is kept, and a run without --pp keeps
    RunConfig's defaults silently."""
    from parallel_mini.runtime.cli import _pipeline_defaults

    def chosen(**given):
        values = {"pp": 1, "schedule": "gpipe", "virtual_stages": 0, "layers": None, "steps": None,
                  **given}
        note = _pipeline_defaults(values)
        return values["layers"], values["steps"], note

    assert chosen() == (RunConfig.layers, RunConfig.steps, "")
    layers, steps, note = chosen(pp=4)
    assert (layers, steps) == (16, 6) and "--layers 16 --steps 6" in note
    assert chosen(pp=4, schedule="interleaved")[0] == 32  # 2 chunks per rank
    assert chosen(pp=2, schedule="interleaved", virtual_stages=3)[0] == 24
    layers, steps, note = chosen(pp=4, layers=4, steps=3)
    assert (layers, steps, note) == (4, 3, "")
    assert chosen(pp=4, layers=8)[2].startswith("note: --steps 6 ")


# ---------------------------------------------------------------------------------------------
# configuration without side effects (issue 28 item 3)
# ---------------------------------------------------------------------------------------------
def test_config_imports_nothing_of_the_package_and_validate_changes_nothing(tmp_path):
    """config.py sits at the bottom: it imports no module of parallel_mini (so no cycle, and no
    torch); validate reads no file (a --resume that does not exist is preflight's to refuse) and
    leaves the config as it was; the model's fields are GPTConfig's, written once."""
    import ast
    import dataclasses

    from parallel_mini import config
    from parallel_mini.runtime import preflight
    from parallel_mini.model import GPTConfig
    tree = ast.parse(Path(config.__file__).read_text())
    imported = [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert {m.split(".")[0] for m in imported} <= {"__future__", "dataclasses", "math", "os"}, imported
    cfg = RunConfig(dp=4, fsdp="FULL_SHARD", batch=8, resume=str(tmp_path / "nothing"))
    before = cfg.to_dict()
    assert cfg.validate() is cfg and cfg.to_dict() == before and cfg.zero == 3
    with pytest.raises(ConfigError, match="no such directory"):
        preflight.check(cfg)
    model_fields = [f.name for f in dataclasses.fields(GPTConfig)]
    assert GPTConfig is config.GPTConfig and issubclass(RunConfig, GPTConfig)
    assert [f.name for f in dataclasses.fields(RunConfig)][:len(model_fields)] == model_fields
    assert vars(GPTConfig.from_run(cfg)) == {k: before[k] for k in model_fields}
