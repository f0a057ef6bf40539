"""Bad input at the command line: every one of these invocations exits 2 with exactly one line on
stderr ("error: ..." naming the flag), nothing on stdout, no traceback, before any rank starts.
(In process: the same `main` the CLI runs; argparse's own errors arrive as SystemExit(2).)"""
from __future__ import annotations

import pytest
import torch

from parallel_mini.__main__ import main as cli_main

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
    *([(["--backend", "nccl"], "--backend")] if not torch.cuda.is_available() else []),  # no GPU here
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
    # too many local ranks; outputs that cannot be written
    (["--dp", "17", "--batch", "17"], "world size"),
    (["--json", "/nonexistent/dir/report.json"], "--json"), (["--trace", "/nonexistent/t.json"], "--trace"),
    (["--json", "/"], "--json"),
    # unknown flags and missing values (argparse)
    (["--dpp", "2"], "unrecognized"), (["--dp"], "--dp"), (["--lr", "fast"], "--lr"),
]


def test_at_least_sixty():
    assert len(BAD) >= 60


@pytest.mark.parametrize("argv,word", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocation_exits_2_with_one_line(argv, word, capsys):
    try:
        rc = cli_main(["run", *argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], err
    assert "Traceback" not in err
