"""A checkpoint directory is not trusted: what --resume reads is refused in one line naming the file
(checksums, DCP's pickled .metadata read through an allow-list, another model/optimizer/precision),
a save never writes through a link planted in the directory, and a save that meets a full disk
stops in one line with the previous checkpoint intact."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from parallel_mini.__main__ import main
from parallel_mini.config import RunConfig
from parallel_mini.runtime.preflight import CheckpointError, check, file_digests

SMALL = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One real checkpoint (1 rank, step 1), saved into a directory where links were planted:
    latest.tmp -> a file outside, step_1.tmp -> a directory outside. The save removes the links
    and writes nothing outside."""
    from parallel_mini.runtime.launch import run
    root = tmp_path_factory.mktemp("hygiene")
    outside, victim = root / "outside", root / "victim.txt"
    outside.mkdir()
    victim.write_text("untouched\n")
    ck = root / "ck"
    ck.mkdir()
    os.symlink(victim, ck / "latest.tmp")
    os.symlink(outside, ck / "step_1.tmp")
    run(RunConfig(steps=1, save=str(ck), **SMALL))
    assert victim.read_text() == "untouched\n" and list(outside.iterdir()) == []
    assert sorted(os.listdir(ck)) == ["latest", "step_1"] and not os.path.islink(ck / "step_1")
    return ck


def _copy(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    return ck, ck / "step_1"


def _refused(ck, **changes) -> str:
    with pytest.raises(CheckpointError) as e:
        check(RunConfig(steps=2, resume=str(ck), **{**SMALL, **changes}).validate())
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _shard(step):
    return next(p for p in step.iterdir() if p.name.endswith(".distcp"))


def _rewrite_meta(step, **changes):
    meta = json.loads((step / "meta.json").read_text())
    meta.update(changes)
    (step / "meta.json").write_text(json.dumps(meta))


def test_a_sound_checkpoint_is_accepted(saved):
    check(RunConfig(steps=2, resume=str(saved), **SMALL).validate())
    check(RunConfig(steps=2, resume=str(saved), dp=2, **SMALL).validate())  # any layout


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "bit-flipped", "missing", "fifo",
                                    "link", "no-metadata"])
def test_a_damaged_file_is_refused_naming_it(damage, saved, tmp_path):
    ck, step = _copy(saved, tmp_path)
    shard = step / ".metadata" if damage == "no-metadata" else _shard(step)
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[:len(data) // 2])
    elif damage == "zeroed":
        shard.write_bytes(bytes(len(data)))
    elif damage == "bit-flipped":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage in ("missing", "no-metadata"):
        shard.unlink()
    elif damage == "fifo":  # (opening it to read would block until a writer comes: never opened)
        shard.unlink()
        os.mkfifo(shard)
    elif damage == "link":
        shard.unlink()
        os.symlink(tmp_path / "elsewhere", shard)
    msg = _refused(ck)
    assert shard.name in msg, msg
    want = {"truncated": "bytes", "zeroed": "checksum", "bit-flipped": "checksum",
            "missing": "missing", "fifo": "not a regular file", "link": "not a regular file",
            "no-metadata": "missing"}[damage]
    assert want in msg, msg


class _Planted:
    """What a hostile .metadata holds: unpickling it runs os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_pickle_never_runs(saved, tmp_path):
    """A .metadata that would create a file if unpickled, its checksum updated in meta.json (so
    that only the reading itself stands between it and the ranks): refused before any rank
    starts, and refused by the ranks' own reader too; the file is never created."""
    ck, step = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    _rewrite_meta(step, files=file_digests(str(step)))
    msg = _refused(ck)
    assert ".metadata names posix.system" in msg and "could run code" in msg, msg
    from parallel_mini.runtime.checkpoint import _safe_reader
    with pytest.raises(CheckpointError, match="posix.system"):
        _safe_reader(str(step)).read_metadata()
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Planted(marker)))  # (the sabotage: unpickled, it does run)
    assert marker.exists()


@pytest.mark.parametrize("field, value, words", [
    ("vocab", 128, "another model (saved, now: {'vocab': (64, 128)})"),
    ("layers", 3, "'layers': (2, 3)"), ("d_model", 64, "'d_model': (32, 64)"),
    ("experts", 4, "'experts': (0, 4)"), ("optimizer", "sgd", "another optimizer"),
    ("precision", "bf16-mixed", "another precision (saved, now: ('fp32', 'bf16-mixed'))"),
    ("seed", 1, "another seed")])
def test_another_run_is_refused_naming_what_differs(field, value, words, saved):
    assert words in _refused(saved, **{field: value})


def test_a_meta_without_checksums_or_precision_is_refused(saved, tmp_path):
    ck, step = _copy(saved, tmp_path)
    meta = json.loads((step / "meta.json").read_text())
    for key in ("files", "precision"):
        raw = {k: v for k, v in meta.items() if k != key}
        (step / "meta.json").write_text(json.dumps(raw))
        assert f"'{key}'" in _refused(ck) and "should be a" in _refused(ck)


def test_cli_one_line_exit_2(saved, tmp_path, capsys):
    ck, step = _copy(saved, tmp_path)
    _shard(step).write_bytes(b"\0")
    assert main(["run", "--steps", "2", "--resume", str(ck)] + [
        x for k, v in SMALL.items() for x in (f"--{k.replace('_', '-')}", str(v))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --resume") and "__0_0.distcp" in err[0]


FULL = """
mount -t tmpfs -o size=700k tmpfs "$1" || exit 99
"$2" -m parallel_mini run --layers 2 --d-model 32 --heads 2 --seq 16 --vocab 64 --batch 8 \
  --steps 3 --save "$1/ck" --save-every 1 --json "$3/report.json"
echo "rc=$?"
ls "$1/ck"
"$2" -c "import sys; from parallel_mini.config import RunConfig; from parallel_mini.runtime.preflight import check
check(RunConfig(steps=3, resume=sys.argv[1], layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8))
print('resumable', 'torch' in sys.modules)" "$1/ck"
"""


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A 700 kB tmpfs (in a user and mount namespace of its own: unshare -Urm) holds step_1
    (~550 kB) but not step_2: the run stops with one line and exit 1, step_2.tmp is removed,
    `latest` still names step_1 and it passes every check a resume makes."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Urm", "true"]).returncode:
        pytest.skip("no user namespaces here (unshare -Urm): cannot mount a small tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = subprocess.run(["unshare", "-Urm", "sh", "-c", FULL, "sh", str(mnt), sys.executable,
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert "rc=1" in out.stdout, (out.stdout, out.stderr[-2000:])
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "could not write step_2 (No space left on device" in err[0], err
    assert f"{mnt}/ck/step_1 is intact" in err[0], err
    listing = out.stdout.split("rc=1", 1)[1].split()
    assert listing[:2] == ["latest", "step_1"] and "resumable" in out.stdout, out.stdout
    assert out.stdout.strip().endswith("resumable False")  # (the check is torch-free)


def test_a_save_that_fails_on_rank_0_stops_every_rank_in_one_line(tmp_path):
    """dp2, a checkpoint every step: rank 0 meets EACCES (a directory made unwritable) while
    finishing step_2, after both ranks wrote their parts. Rank 1 does not wait for it forever:
    both stop with the same one line, the one the CLI prints alone (exit 1: the slow full-disk
    test runs the CLI); step_2.tmp is gone and step_1 stays `latest`."""
    from parallel_mini.runtime.cli import ONE_LINE_FAULTS
    from parallel_mini.runtime.launch import run
    from parallel_mini.runtime.launch import RankError
    ck = tmp_path / "ck"
    fault = {"kill": {"rank": 0, "at": "save 2 finishing", "fail": 13}}
    with pytest.raises(RankError) as e:
        run(RunConfig(dp=2, steps=2, save=str(ck), save_every=1, **SMALL, extra=fault))
    name, line = e.value.details.rstrip().splitlines()[-1].split(": ", 1)
    assert name in ONE_LINE_FAULTS, name
    assert line == (f"--save {ck}: could not write step_2 (Permission denied); the run stopped; "
                    f"{ck}/step_1 is intact: --resume {ck} continues from it"), line
    assert sorted(os.listdir(ck)) == ["latest", "step_1"]
    assert (ck / "latest").read_text() == "step_1\n"


def test_a_finished_job_relaunched_is_complete_not_refused(saved, tmp_path, capsys):
    """--save DIR --resume DIR at --steps already (torchrun restarting a group that died after its
    last save, or the same command run again): one line, exit 0, nothing trained. Resumed from
    another directory, or asked for fewer steps, it is still refused."""
    ck, _ = _copy(saved, tmp_path)
    flags = [x for k, v in SMALL.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["run", "--steps", "1", "--save", str(ck), "--resume", str(ck), *flags]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: ") and "complete" in err[0], err
    assert main(["run", "--steps", "1", "--save", str(tmp_path / "new"), "--resume", str(ck),
                 *flags]) == 2
    assert "saved after step 1" in capsys.readouterr().err
