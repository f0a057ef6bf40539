"""Bad input at the command line, tried as a hostile user would (issue 26): every one of these
invocations of `run` and `plan` exits 2 with exactly one line on stderr ("error: ..." naming the
flag), nothing on stdout, no traceback, before any rank starts; a fault met while running (a run
that diverges, a report that cannot be written after the run) is one line and exit 1. The refusals
come before torch is imported (a subprocess checks sys.modules).
(In process: the same `main` the CLI runs; argparse's own errors arrive as SystemExit(2).)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parallel_mini.__main__ import main as cli_main
from parallel_mini.runtime.cli import _write_outputs
from parallel_mini.runtime.checkpoint import _meta
from parallel_mini.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
HUGE = "9" * 400  # a 400-digit number
LONG = "/tmp/" + "a" * 300  # a file name longer than NAME_MAX (255)

BAD = [
    # (argv after "run", a word the message must contain)
    # whole numbers and choices
    (["--dp", "0"], "--dp"), (["--dp", "-2"], "--dp"), (["--dp", "two"], "--dp"),
    (["--tp", "0"], "--tp"), (["--pp", "0"], "--pp"), (["--cp", "0"], "--cp"), (["--ep", "0"], "--ep"),
    (["--layers", "0"], "--layers"), (["--d-model", "0"], "--d-model"), (["--heads", "0"], "--heads"),
    (["--seq", "0"], "--seq"), (["--vocab", "0"], "--vocab"), (["--batch", "0"], "--batch"),
    (["--steps", "0"], "--steps"), (["--steps", "100000"], "--steps"),
    (["--grad-accum", "0"], "--grad-accum"), (["--microbatches", "0", "--pp", "2"], "--microbatches"),
    (["--dp-mode", "fast"], "--dp-mode"), (["--optimizer", "lamb"], "--optimizer"),
    (["--precision", "fp16"], "--precision"), (["--schedule", "fast", "--pp", "2"], "--schedule"),
    (["--checkpointing", "all"], "--checkpointing"), (["--cp-impl", "star", "--cp", "2"], "--cp-impl"),
    (["--backend", "mpi"], "--backend"), (["--zero", "4"], "--zero"), (["--fsdp", "SHARD_ALL"], "--fsdp"),
    # numbers that are not finite or not positive
    (["--lr", "inf"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"), (["--lr", "-1"], "--lr"),
    (["--bucket-mb", "0"], "--bucket-mb"), (["--bucket-mb", "inf"], "--bucket-mb"),
    (["--timeout-s", "0"], "--timeout-s"), (["--timeout-s", "inf"], "--timeout-s"),
    # shapes that do not divide
    (["--dp", "3", "--batch", "8"], "--batch"), (["--heads", "3"], "--d-model"),
    (["--tp", "3", "--heads", "4"], "--heads"), (["--tp", "2", "--vocab", "127"], "--vocab"),
    (["--pp", "2", "--layers", "3"], "--layers"), (["--pp", "2", "--batch", "6", "--microbatches", "4"], "--batch"),
    (["--cp", "3", "--seq", "32"], "--seq"), (["--cp", "2", "--cp-impl", "zigzag", "--seq", "30"], "--seq"),
    (["--cp", "4", "--cp-impl", "ulysses", "--heads", "2", "--d-model", "64"], "--heads"),
    (["--sp"], "--sp"), (["--tp", "2", "--sp", "--seq", "31"], "--seq"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "-1"], "--virtual-stages"),
    (["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"], "--virtual-stages"),
    (["--pp", "2", "--schedule", "interleaved", "--microbatches", "3", "--batch", "6"], "--microbatches"),
    (["--pp", "2", "--grad-accum", "2"], "--grad-accum"),
    # strategies that need another
    (["--offload"], "--offload"), (["--dp", "4", "--dp-shard", "3"], "--dp-shard"),
    (["--dp", "4", "--dp-shard", "2"], "--dp-shard"), (["--zero", "1", "--dp-mode", "naive"], "--dp-mode"),
    (["--fp32-grad-accum"], "--fp32-grad-accum"), (["--fsdp", "FULL_SHARD", "--zero", "1"], "--fsdp"),
    (["--dp", "2", "--zero", "2", "--no-prefetch"], "--no-prefetch"),
    (["--pp", "2", "--zero", "1", "--schedule", "pipedream"], "--zero"),
    # experts
    (["--ep", "2"], "--ep"), (["--dp", "2", "--ep", "2", "--experts", "3"], "--experts"),
    (["--experts", "4", "--top-k", "5"], "--top-k"), (["--experts", "4", "--capacity-factor", "0"], "--capacity-factor"),
    (["--experts", "4", "--capacity-factor", "-0.5"], "--capacity-factor"),
    (["--dp", "2", "--ep", "4", "--experts", "8"], "--ep"), (["--experts", "-1"], "--experts"),
    (["--experts", "4", "--moe-every", "9"], "--moe-every"),
    (["--experts", "4", "--aux-loss-weight", "-1"], "--aux-loss-weight"),
    # flags the layout would ignore
    (["--schedule", "interleaved", "--virtual-stages", "3", "--microbatches", "7"], "--pp"),
    (["--microbatches", "8"], "--microbatches"), (["--cp-impl", "zigzag"], "--cp-impl"),
    (["--top-k", "2"], "--top-k"), (["--capacity-factor", "2"], "--capacity-factor"),
    (["--dp", "2", "--zero", "1", "--bucket-mb", "1"], "--bucket-mb"),
    # sizes this machine cannot hold: refused with the estimate
    (["--batch", "10000000"], "memory"), (["--seq", "10000000"], "memory"),
    (["--vocab", "100000000"], "memory"), (["--dp", "8", "--batch", "65536", "--seq", "512"], "memory"),
    # issue 26: 20,000 blocks used 4.2 GB against 0.8 GB estimated (objects per block now counted)
    (["--layers", "1000000", "--d-model", "8", "--heads", "1"], "layer objects"),
    # too many local ranks; outputs that cannot be written
    (["--dp", "17", "--batch", "17"], "world size"),
    (["--json", "/nonexistent/dir/report.json"], "--json"), (["--trace", "/nonexistent/t.json"], "--trace"),
    (["--json", "/"], "--json"),
    # unknown flags and missing values (argparse)
    (["--dpp", "2"], "unrecognized"), (["--dp"], "--dp"), (["--lr", "fast"], "--lr"),
    (["--dp", "1e3"], "--dp"), (["--steps", "2.5"], "--steps"), (["--json"], "--json"),
    (["--layers", ""], "--layers"), (["--seed", "2**70"], "--seed"),
    # issue 26's hostile user: 400-digit numbers (were tracebacks: theory's floats overflowed)
    *[(["--" + f, HUGE], "--" + f) for f in ("seq", "vocab", "batch", "d-model", "layers", "heads",
                                             "dp", "steps", "grad-accum")],
    (["--pp", "2", "--microbatches", HUGE], "--microbatches"), (["--pp", HUGE], "--pp"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", HUGE], "--virtual-stages"),
    (["--experts", HUGE], "--experts"), (["--dp", "2", "--dp-shard", HUGE], "--dp-shard"),
    (["--dp", HUGE, "--batch", HUGE], "--dp"), (["--dp", "2147483647", "--batch", "2147483647"], "world size"),
    # timeouts a run cannot meet or a clock cannot hold (1e-9 was a traceback in TCPStore)
    (["--timeout-s", "1e-9"], "--timeout-s"), (["--timeout-s", "0.5"], "--timeout-s"),
    (["--timeout-s", "-1"], "--timeout-s"), (["--timeout-s", "1e300"], "--timeout-s"),
    (["--timeout-s", "nan"], "--timeout-s"),
    # seeds the data's generator cannot take (2**70 failed inside every rank)
    (["--seed", str(2 ** 70)], "--seed"), (["--seed", str(2 ** 32)], "--seed"), (["--seed", "-1"], "--seed"),
    (["--seed", HUGE], "--seed"),
    # silently accepted before, absurd: refused with the reason
    (["--vocab", "1"], "--vocab"), (["--lr", "1e12"], "--lr"), (["--lr", "11"], "--lr"),
    (["--lr", "1e300"], "--lr"),
    (["--experts", "4", "--aux-loss-weight", "1e300"], "--aux-loss-weight"),
    (["--experts", "4", "--aux-loss-weight", "101"], "--aux-loss-weight"),
    (["--experts", "4", "--z-loss-weight", "1e300"], "--z-loss-weight"),
    (["--experts", "4", "--z-loss-weight", "inf"], "--z-loss-weight"),
    (["--experts", "4", "--z-loss-weight", "-1"], "--z-loss-weight"),
    (["--experts", "4", "--capacity-factor", "1e300"], "--capacity-factor"),
    (["--experts", "4", "--capacity-factor", "nan"], "--capacity-factor"),
    (["--bucket-mb", "1e300"], "--bucket-mb"), (["--bucket-mb", "-1"], "--bucket-mb"),
    (["--lr", "-inf"], "--lr"), (["--dp", "2", "--dp-shard", "-1"], "--dp-shard"),
    (["--virtual-stages", "2"], "--virtual-stages"), (["--zero", "-1"], "--zero"),
    (["--fsdp", "HYBRID_SHARD", "--dp", "2"], "--fsdp"), (["--fsdp", "full_shard"], "--fsdp"),
    (["--pp", "2", "--schedule", "zb", "--microbatches", "1", "--batch", "8"], "--microbatches"),
    (["--experts", "4", "--pp", "2", "--schedule", "pipedream"], "--experts"),
    # empty names: they meant "none" and were silently ignored
    (["--json", ""], "--json"), (["--trace", ""], "--trace"), (["--save", ""], "--save"),
    (["--resume", ""], "--resume"),
    # a trace is a file, not a stream
    (["--trace", "-"], "--trace"),
    # outputs that cannot be written, refused before the ranks run (were tracebacks after them)
    (["--json", "/dev/full"], "--json"), (["--trace", "/dev/full"], "--trace"),
    (["--json", "/proc/report.json"], "--json"), (["--trace", "/proc/trace.json"], "--trace"),
    (["--json", "/proc"], "--json"), (["--trace", "/tmp"], "--trace"),
    (["--json", LONG], "--json"), (["--trace", LONG], "--trace"),
    (["--json", "/nonexistent/" + "b" * 300], "--json"),
    # one file for both: the report overwrote the trace, silently
    (["--json", "/tmp/pm_same.json", "--trace", "/tmp/pm_same.json"], "same file"),
    (["--json", "/tmp/pm_same.json", "--trace", "/tmp/../tmp/pm_same.json"], "same file"),
    # checkpoint directories that cannot be one
    (["--save", "/nonexistent/ckpt"], "--save"), (["--save", "/dev/null"], "--save"),
    (["--save", "/proc/self/status"], "--save"), (["--resume", "/nonexistent/ckpt"], "--resume"),
    (["--resume", "/dev/null"], "--resume"), (["--resume", "/proc/self"], "--resume"),
    (["--pp", "2", "--schedule", "pipedream", "--save", "/tmp/pm_ckpt"], "PipeDream"),
    (["--save", "/proc/ckpt"], "--save"), (["--save", LONG], "--save"),
]


READ_ONLY = "/sys/parallel_mini_report.json"  # sysfs: no file can be created there, even by root
if os.path.isdir("/sys/kernel"):  # (Linux)
    BAD += [(["--json", READ_ONLY], "--json"), (["--trace", READ_ONLY], "--trace"),
            (["--save", "/sys/parallel_mini_ckpt"], "--save")]
if not torch.cuda.is_available():  # no GPU here
    BAD.append((["--backend", "nccl"], "--backend"))


def _id(argv) -> str:
    return " ".join(argv).replace(HUGE, "<400 digits>").replace(LONG, "<300-letter name>")


def refused(argv, capsys, rc_wanted=2) -> str:
    """Runs the CLI in process; asserts the contract; returns the one line."""
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == rc_wanted, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv,word", BAD, ids=[_id(a) for a, _ in BAD])
def test_bad_invocation_exits_2_with_one_line(argv, word, capsys):
    assert word in refused(["run", *argv], capsys)


# ---------------------------------------------------------------------------------------------
# --resume of what is not a checkpoint: one line each, never a traceback (meta.json read safely)
# ---------------------------------------------------------------------------------------------
def _checkpoint(d: Path, meta, latest: bytes | None = b"step_2\n") -> Path:
    (d / "step_2").mkdir(parents=True)
    if meta is not None:
        (d / "step_2" / "meta.json").write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    if latest is not None:
        (d / "latest").write_bytes(latest)
    return d


GOOD_META = _meta(RunConfig(), 2)
RESUME = {
    # (what the directory holds, a word the line must contain)
    "garbage directory": (lambda d: (d.mkdir(), (d / "x.bin").write_bytes(os.urandom(64)), d)[-1],
                          "no checkpoint there"),
    "meta not JSON": (lambda d: _checkpoint(d, b"{not json"), "not JSON"),
    "meta empty": (lambda d: _checkpoint(d, b""), "not JSON"),
    "meta binary": (lambda d: _checkpoint(d, b"\x00\xff\xfe\x80" * 16), "binary"),
    "meta an empty object": (lambda d: _checkpoint(d, {}), "'step'"),
    "meta a list": (lambda d: _checkpoint(d, [1, 2]), "holds a list"),
    "meta a string": (lambda d: _checkpoint(d, "step_2"), "holds a string"),
    "meta null": (lambda d: _checkpoint(d, b"null"), "holds a null"),
    "step a string": (lambda d: _checkpoint(d, {**GOOD_META, "step": "2"}),
                      "'step' should be a whole number, found string"),
    "step a bool": (lambda d: _checkpoint(d, {**GOOD_META, "step": True}), "'step'"),
    "step negative": (lambda d: _checkpoint(d, {**GOOD_META, "step": -1}), "negative"),
    "no model": (lambda d: _checkpoint(d, {k: v for k, v in GOOD_META.items() if k != "model"}), "'model'"),
    "model a list": (lambda d: _checkpoint(d, {**GOOD_META, "model": [4, 64]}), "'model'"),
    "model lacks fields": (lambda d: _checkpoint(d, {**GOOD_META, "model": {"layers": 4}}), "lacks"),
    "no optimizer": (lambda d: _checkpoint(d, {k: v for k, v in GOOD_META.items() if k != "optimizer"}),
                     "'optimizer'"),
    "world size a float": (lambda d: _checkpoint(d, {**GOOD_META, "world_size": 1.5}), "'world_size'"),
    "meta huge": (lambda d: _checkpoint(d, b" " * (2 ** 20 + 1)), "larger"),
    "meta a directory": (lambda d: (_checkpoint(d, None), (d / "step_2" / "meta.json").mkdir(), d)[-1],
                         "no checkpoint there"),
    "latest binary": (lambda d: _checkpoint(d, GOOD_META, b"\x89PNG\xff\xfe\x00" * 4), "binary"),
    "latest a directory": (lambda d: (_checkpoint(d, GOOD_META, None), (d / "latest").mkdir(), d)[-1],
                           "not a file"),
    "latest empty": (lambda d: _checkpoint(d, GOOD_META, b""), "does not name"),
    "latest out of the directory": (lambda d: _checkpoint(d, GOOD_META, b"../../etc"), "does not name"),
    "latest names a missing step": (lambda d: _checkpoint(d, GOOD_META, b"step_9"), "no checkpoint there"),
    "latest huge": (lambda d: _checkpoint(d, GOOD_META, b"step_2" * 100), "larger"),
    "a file, not a directory": (lambda d: (d.write_text("hello"), d)[-1], "no such directory"),
    "missing": (lambda d: d, "no such directory"),
    "saved at the step asked": (lambda d: _checkpoint(d, {**GOOD_META, "step": 3}), "--steps 3"),
    "another model": (lambda d: _checkpoint(d, {**GOOD_META, "model": {**GOOD_META["model"], "heads": 8}}),
                      "another model"),
    "another precision": (lambda d: _checkpoint(d, {**GOOD_META, "precision": "bf16-mixed"}),
                          "another precision"),
}


@pytest.mark.parametrize("case", list(RESUME))
def test_resume_of_what_is_not_a_checkpoint_is_one_line(case, tmp_path, capsys):
    make, word = RESUME[case]
    d = make(tmp_path / "ckpt")
    line = refused(["run", "--steps", "3", "--layers", "4", "--resume", str(d)], capsys)
    assert "--resume" in line or "--steps" in line, line
    assert word in line, line


SAVE = {  # (what --save names, a word the line must contain)
    "a link loop": (lambda d: (os.symlink("loop", d / "loop"), d / "loop")[-1], "must be a directory"),
    "a dangling link": (lambda d: (os.symlink("nowhere", d / "gone"), d / "gone")[-1], "must be a directory"),
    "a file": (lambda d: ((d / "f").write_text("x"), d / "f")[-1], "must be a directory"),
    "latest a directory": (lambda d: ((d / "ck" / "latest").mkdir(parents=True), d / "ck")[-1], "not a file"),
    "step already saved": (lambda d: ((d / "ck" / "step_3").mkdir(parents=True), d / "ck")[-1], "already saved"),
}


@pytest.mark.parametrize("case", list(SAVE))
def test_save_where_no_checkpoint_can_go_is_one_line(case, tmp_path, capsys):
    make, word = SAVE[case]
    line = refused(["run", "--steps", "3", "--save", str(make(tmp_path))], capsys)
    assert "--save" in line and word in line, line


def test_a_good_meta_passes_the_checks(tmp_path):
    """The same reading accepts what checkpoint.py writes (so the cases above fail for their
    reason, not for any meta.json)."""
    import pickle
    from parallel_mini.runtime.preflight import check_flags, file_digests, resolve
    d = _checkpoint(tmp_path / "ckpt", GOOD_META)
    assert resolve(str(d)) == (str(d / "step_2"), GOOD_META)
    (d / "step_2" / ".metadata").write_bytes(pickle.dumps({}))  # (names no class: inert)
    meta = {**GOOD_META, "files": file_digests(str(d / "step_2"))}  # what a save adds
    (d / "step_2" / "meta.json").write_text(json.dumps(meta))
    check_flags(RunConfig(steps=3, resume=str(d)))


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------
PLAN = [
    (["--model", ""], "--model"), (["--model", "gpt5"], "--model"),
    (["--global-batch", str(10 ** 15)], "--global-batch"), (["--global-batch", "1e15"], "--global-batch"),
    (["--global-batch", "0"], "--global-batch"), (["--global-batch", HUGE], "--global-batch"),
    (["--published", "--gpus", "8"], "--gpus"), (["--published", "--model", "llama3-8b"], "--model"),
    (["--published", "--top", "3"], "--top"), (["--published", "--optimizer", "adam"], "--optimizer"),
    (["--top-k", "2"], "--top-k"), (["--moe-every", "2"], "--moe-every"),
    (["--model", "llama3-70b", "--top-k", "2"], "--top-k"), (["--experts", "4", "--top-k", "5"], "--top-k"),
    (["--json", "/tmp"], "--json"), (["--json", "/dev/full"], "--json"), (["--json", LONG], "--json"),
    (["--json", "/proc/plan.json"], "--json"), (["--json", ""], "--json"),
    (["--json", "/nonexistent/plan.json"], "--json"),
    (["--gpus", "0"], "--gpus"), (["--gpus", HUGE], "--gpus"), (["--gpus", "8", "--nodes-of", "3"], "--gpus"),
    (["--layers", HUGE], "--layers"), (["--layers", "100000"], "--layers"), (["--seq", "0"], "--seq"),
    (["--experts", "-1"], "--experts"),
    (["--d-model", "10", "--heads", "3"], "--d-model"), (["--gpu", "tpu-v5"], "--gpu"),
    (["--top", "-1"], "--top"), (["--gpus", "abc"], "--gpus"), (["--precision", "fp8"], "--precision"),
    (["--gpu", "cpu", "--gpus", "32"], "--gpus"),
]
if os.path.isdir("/sys/kernel"):
    PLAN.append((["--json", READ_ONLY], "--json"))


@pytest.mark.parametrize("argv,word", PLAN, ids=[_id(a) for a, _ in PLAN])
def test_bad_plan_exits_2_with_one_line(argv, word, capsys):
    assert word in refused(["plan", *argv], capsys)


def test_at_least_150_cases():
    assert len(BAD) + len(RESUME) + len(SAVE) + len(PLAN) >= 150


# ---------------------------------------------------------------------------------------------
# faults met while running: one line, exit 1
# ---------------------------------------------------------------------------------------------
class _Report:
    def to_json(self, indent=None):
        return json.dumps({"losses": [1.0]}, indent=indent)


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_an_output_that_fails_after_the_run_is_one_line_exit_1(flag, monkeypatch, capsys):
    """A disk that fills during the run (written to /dev/full, which the checks before the run
    refuse: so the write is tried here directly): the run finished, its output did not."""
    import dataclasses

    from parallel_mini.__main__ import COURSE

    def write_chrome_trace(report, path):  # (the real one needs a real report)
        with open(path, "w") as fh:
            fh.write("{}")
    course = dataclasses.replace(COURSE, write_trace=write_chrome_trace)
    args = SimpleNamespace(json="/dev/full" if flag == "--json" else None,
                           trace="/dev/full" if flag == "--trace" else None)
    assert _write_outputs(_Report(), args, course) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} /dev/full:") and "space" in lines[0], err


def test_a_diverged_rank_is_one_line_exit_1(monkeypatch, capsys):
    """engine._train raises FloatingPointError at the first non-finite loss; the CLI prints its
    message as the one line (the real run: the slow test below)."""
    import parallel_mini.runtime.launch
    from parallel_mini.runtime.launch import RankError

    def run(cfg):
        raise RankError(1, "Traceback (most recent call last):\n  ...\nFloatingPointError: step 9: "
                           "the loss is nan; the run diverged (lower --lr, ...)\n")
    monkeypatch.setattr(parallel_mini.runtime.launch, "run", run)
    line = refused(["run", "--steps", "2"], capsys, rc_wanted=1)
    assert line == "error: step 9: the loss is nan; the run diverged (lower --lr, ...)", line


def test_a_refusal_inside_the_run_is_one_line_exit_2(monkeypatch, capsys):
    """launch.run checks again after torch's import (which took memory: issue 26's --seq 4638,
    accepted by the CLI, then refused with a traceback): its ConfigError is the one line too."""
    import parallel_mini.runtime.launch
    from parallel_mini.config import ConfigError

    def run(cfg):
        raise ConfigError("this run needs about 9.1 GB of memory (...); lower --batch")
    monkeypatch.setattr(parallel_mini.runtime.launch, "run", run)
    line = refused(["run", "--steps", "2"], capsys)
    assert line == "error: this run needs about 9.1 GB of memory (...); lower --batch", line


@pytest.mark.slow
def test_a_diverging_run_stops_at_the_first_non_finite_loss(capsys):
    """--lr 10 with SGD is within the limits and diverges: the run stops at the first NaN/inf
    loss with one line and exit 1 (it used to end with NaN losses and exit 0)."""
    line = refused(["run", "--optimizer", "sgd", "--lr", "10", "--steps", "60", "--layers", "1",
                    "--d-model", "16", "--heads", "2", "--seq", "8", "--vocab", "32", "--batch", "4"],
                   capsys, rc_wanted=1)
    assert "diverged" in line and "the loss is" in line, line


# ---------------------------------------------------------------------------------------------
# before torch: the refusals do not import it (a usage error answers at once)
# ---------------------------------------------------------------------------------------------
CHILD = """
import json, sys
from parallel_mini.__main__ import main
seen = {}
for argv in json.loads(sys.argv[1]):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    seen[" ".join(argv)] = [rc, "torch" in sys.modules]
print(json.dumps(seen))
"""


def test_refusals_never_import_torch(tmp_path):
    """One fresh interpreter tries a usage error, bad values, bad outputs, a garbage checkpoint
    and bad plans: each exits 2 and torch is still not imported afterwards (so a refusal costs
    the parser and the checks, not torch's import; measured in the report, not asserted)."""
    garbage = _checkpoint(tmp_path / "g", b"{not json")
    cases = [["run", "--dpp", "2"], ["run", "--dp", "0"], ["run", "--seq", HUGE],
             ["run", "--batch", "10000000"], ["run", "--json", "/dev/full"],
             ["run", "--resume", str(garbage)], ["run", "--pp", "2", "--layers", "3"],
             ["plan", "--model", ""], ["plan", "--json", "/tmp"]]
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen == {" ".join(a): [2, False] for a in cases}, seen
    assert "Traceback" not in proc.stderr
