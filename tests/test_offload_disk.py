"""--offload-disk (ZeRO-Infinity's offload to disk, parallel/offload_disk.py): equal to the
reference; RAM and disk bytes equal to theory to the byte; the bytes read and written per step
counted equal to theory's formula and measured by the thread's I/O counters (/proc); refused
before any rank starts when the directory cannot take the files; no file left behind (unless
--keep-offload), even when a rank fails."""
import os
import subprocess
import sys

import pytest

from parallel_mini import placement, theory
from parallel_mini.runtime import preflight
from parallel_mini.config import ConfigError, RunConfig, offload_file
from parallel_mini.runtime.launch import run
from parallel_mini.runtime.launch import RankError

PAGE = os.sysconf("SC_PAGE_SIZE")


def _block_backed(directory) -> bool:
    """Whether the file system's pages go to a device (tmpfs: read_bytes and write_bytes stay 0)."""
    with open("/proc/mounts") as fh:
        mounts = [line.split() for line in fh]
    path = os.path.realpath(directory)
    best = max((m for m in mounts if path == m[1] or path.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]))
    return best[2] not in ("tmpfs", "ramfs", "overlay")


def check_offload(report, cfg, directory):
    """Everything --offload-disk promises, on every rank of `report`."""
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail
    for rank in report.ranks:  # (a pipeline's stages differ: each rank against its stage's)
        th = report.theory["stages"][rank["coords"]["pp"]] if cfg.pp > 1 else report.theory
        io_theory = th["disk_io_per_step"]
        m = rank["memory"]
        assert {k: m[k] for k in th["memory"]} == th["memory"]  # params, grads, optimizer, disk
        assert m["optimizer"] == 0 and (m["params"] == 0) == (cfg.zero == 3)
        disk = rank["disk"]
        assert disk["path"] == offload_file(directory, rank["rank"])
        assert disk["bytes"] == m["disk"] == 4 * len(disk["planes"]) * disk["elements"]
        steps = [rec for rec in disk["io"] if isinstance(rec["step"], int)]
        assert [rec["step"] for rec in steps] == list(range(cfg.steps))
        for rec in steps:
            assert {"read": rec["read"], "written": rec["written"]} == io_theory
            got = rec["measured"]  # the thread's counters around every pread/pwrite
            assert (got["rchar"], got["wchar"]) == (rec["read"], rec["written"])
            if _block_backed(directory):
                # The storage layer moves whole pages: every byte read comes from a page read from
                # disk (the step starts with none cached), every byte written dirties a page; a
                # call's range may cover a page in part at each end, and a page can be counted
                # again when the kernel wrote it back before the next window dirtied it.
                assert rec["read"] <= got["read_bytes"] <= rec["read"] + 2 * PAGE * rec["reads"]
                assert rec["written"] <= got["write_bytes"] <= \
                    rec["written"] + 2 * PAGE * rec["writes"]
    assert sum(r["memory"]["disk"] for r in report.ranks) == preflight.offload_disk_bytes(cfg)
    for rank in report.ranks:  # the one placement: the file holds what owned() says, the twin's
        twin = [[[r.name, list(r.box.offsets), list(r.box.sizes)] for r in piece]
                for piece in placement.owned_by_rank(cfg, rank["rank"])]
        assert [[[n, list(o), list(z)] for n, o, z in p["regions"]] for p in rank["owned"]] == twin
        moments = len(rank["disk"]["planes"]) - 1  # (read back from the file: Adam 2, SGD 0)
        assert all(p["states"] == [p["numel"]] * moments for p in rank["owned"])
        assert sum(p["numel"] for p in rank["owned"]) == rank["disk"]["elements"]


CHEAP = [dict(dp=2, zero=1), dict(dp=2, zero=3)]
MATRIX = [dict(dp=dp, zero=z) for z in (0, 1, 2, 3) for dp in (1, 2, 4)
          if dict(dp=dp, zero=z) not in CHEAP] + [
    dict(dp=2, zero=2, precision="bf16-mixed"), dict(dp=2, zero=3, optimizer="sgd"),
    dict(dp=2, zero=3, grad_accum=2), dict(dp=2, pp=2, zero=1, microbatches=2, layers=2),
    dict(dp=2, ep=2, experts=4, zero=3), dict(tp=2, dp=2, zero=1), dict(cp=2, dp=2, zero=3),
    dict(dp=2, zero=3, checkpointing="full"), dict(pp=2, schedule="1f1b", layers=2, zero=3)]


def _run_checked(tmp_path, kw, keep=False):
    cfg = RunConfig(steps=2, reference=True, offload_disk=str(tmp_path), keep_offload=keep,
                    extra={"owned": True}, **kw)
    report = run(cfg)
    if kw.get("precision") == "bf16-mixed":  # the tolerance of test_zero's bf16 runs
        report.max_abs_diff = 0 if report.max_abs_diff_detail["params"] <= 2 ** -6 else 1
    check_offload(report, cfg, tmp_path)
    return report


@pytest.mark.parametrize("kw", CHEAP, ids=str)
def test_offload_disk_equals_reference_and_its_formulas(tmp_path, kw):
    """ZeRO-1 keeps the files (--keep-offload): they are there, of theory's size; ZeRO-3 (the
    parameter slices too) leaves the directory empty."""
    keep = kw["zero"] == 1
    report = _run_checked(tmp_path, kw, keep)
    files = sorted(os.listdir(tmp_path))
    if keep:
        assert files == [f"rank{r}.states" for r in range(2)]
        assert [os.path.getsize(tmp_path / f) for f in files] == \
            [r["memory"]["disk"] for r in report.ranks]
    else:
        assert files == []


@pytest.mark.slow
@pytest.mark.parametrize("kw", MATRIX, ids=str)
def test_offload_disk_matrix(tmp_path, kw):
    _run_checked(tmp_path, kw)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-nostash"])
def test_pipedream_steps_from_disk_as_in_ram(tmp_path, schedule):
    """PipeDream updates after every micro-batch (its stale weights make it differ from the
    one-process reference by design, 0.04 here): from disk it is the same run to the bit."""
    kw = dict(pp=2, layers=2, schedule=schedule, steps=2, reference=True)
    disk, ram = run(RunConfig(offload_disk=str(tmp_path), **kw)), run(RunConfig(**kw))
    assert disk.losses == ram.losses and disk.max_abs_diff == ram.max_abs_diff
    assert disk.ranks[0]["memory"]["optimizer"] == 0 < disk.ranks[0]["memory"]["disk"]
    assert os.listdir(tmp_path) == []


def test_a_failed_run_leaves_no_file(tmp_path):
    """A rank fails after its file exists (a learner's averaging function raising): the run
    fails, and the directory is empty afterwards."""
    where = str(tmp_path)

    def broken_average(params, comm):
        assert os.path.isfile(os.path.join(where, f"rank{comm.mesh.rank}.states"))
        raise RuntimeError("broken on purpose")

    with pytest.raises(RankError, match="broken on purpose"):
        run(RunConfig(dp=2, dp_mode="naive", steps=1, offload_disk=where),
            average_fn=broken_average)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # (two runs each, ~5 s: the default suite keeps the cheaper cases above)
@pytest.mark.parametrize("before,after", [
    (dict(dp=2, zero=1, offload_disk=True), dict(dp=2, zero=3, offload_disk=True)),
    (dict(dp=2, zero=3, offload_disk=True), dict(dp=1)),
    (dict(dp=2, offload_disk=True), dict(dp=2, zero=2, offload_disk=True)),
    (dict(dp=2), dict(dp=2, zero=1, offload_disk=True))],
    ids=["zero1-disk->zero3-disk", "zero3-disk->dp1", "dp2-disk->zero2-disk", "dp2->zero1-disk"])
def test_checkpoints_save_and_resume_the_states_on_disk(tmp_path, before, after):
    """owned() reads the file into RAM for the save (its I/O recorded as "checkpoint", not as a
    step's), a resume fills it and loaded() writes it back: saved under one layout, resumed under
    another, the run equals the uninterrupted reference; no offload file is left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    ck = str(tmp_path / "ck")
    where = lambda kw: {**kw, "offload_disk": str(disk) if kw.get("offload_disk") else ""}
    first = run(RunConfig(steps=2, save=ck, **where(before)))
    resumed = run(RunConfig(steps=3, resume=ck, reference=True, **where(after)))
    assert resumed.max_abs_diff <= 1e-5, resumed.max_abs_diff_detail
    for rep, kw in ((first, before), (resumed, after)):
        if kw.get("offload_disk"):
            io = rep.ranks[0]["disk"]["io"]
            assert [r["step"] for r in io] == ["setup", *range(len(rep.losses)), "checkpoint"] \
                if rep is first else ["setup", "checkpoint", *range(len(rep.losses))]
            assert all(r["read"] == rep.theory["disk_io_per_step"]["read"]
                       for r in io if isinstance(r["step"], int))
    assert os.listdir(disk) == []


def test_theory_disk_is_12_bytes_per_owned_parameter_and_leaves_ram():
    """Adam's fp32 master and two moments, 12 bytes per parameter a rank owns: 12P/N with ZeRO
    (P padded), 12P at ZeRO-0; the optimizer's RAM goes to 0 (ZeRO-3: the parameter slices too)."""
    p, n = 1000, 4
    for zero in (0, 1, 2, 3):
        ram = theory.model_state_bytes(p, "adam", "bf16-mixed", zero, n)
        disk = theory.model_state_bytes(p, "adam", "bf16-mixed", zero, n, disk=True)
        assert disk["disk"] == (12 * p if zero == 0 else 12 * p // n)
        assert disk["optimizer"] == 0 and disk["grads"] == ram["grads"]
        assert disk["params"] == (0 if zero == 3 else ram["params"])
        assert ram["optimizer"] == disk["disk"]  # mixed: the master was in RAM already
    assert theory.model_state_bytes(1001, "sgd", "fp32", 1, 4, disk=True)["disk"] == 4 * 1004 // 4


# -- refused before any rank starts ----------------------------------------------------------
def test_refuses_a_missing_or_unwritable_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        preflight.check(RunConfig(offload_disk=str(tmp_path / "nope")).validate())
    with pytest.raises(ConfigError, match="cannot write there"):
        preflight.check(RunConfig(offload_disk="/proc/self").validate())
    (tmp_path / "rank1.states").write_bytes(b"")
    with pytest.raises(ConfigError, match="exists already"):
        preflight.check(RunConfig(dp=2, offload_disk=str(tmp_path)).validate())
    assert sorted(os.listdir(tmp_path)) == ["rank1.states"]  # (the probe removed, the file kept)


def test_refuses_a_directory_too_small(tmp_path, monkeypatch):
    cfg = RunConfig(dp=2, zero=1, offload_disk=str(tmp_path)).validate()
    need = preflight.offload_disk_bytes(cfg)
    assert need == 2 * theory.run_theory(cfg, 0)["memory"]["disk"] > 0
    real = os.statvfs(tmp_path)

    class Small:
        f_frsize, f_bavail = 1, need - 1

    monkeypatch.setattr(preflight.os, "statvfs", lambda path: Small if path == str(tmp_path)
                        else real)
    with pytest.raises(ConfigError, match=f"need {need:,} bytes and the file system has "
                                          f"{need - 1:,} free"):
        preflight.check(cfg)
    Small.f_bavail = need
    preflight.check(cfg)


@pytest.mark.parametrize("kw,why", [
    (dict(keep_offload=True), "give --offload-disk DIR"),
    (dict(dp=2, zero=1, offload=True, offload_disk="/tmp"), "--offload-disk with --offload"),
    (dict(offload_disk="/tmp", precision="bf16-mixed", fp32_grad_accum=True),
     "--offload-disk with --fp32-grad-accum"),
    (dict(dp=2, experts=2, ep=2, offload_disk="/tmp"), "--offload-disk with --ep 2"),
])
def test_refused_combinations(kw, why):
    with pytest.raises(ConfigError, match=why) as e:
        RunConfig(**kw).validate()
    assert "\n" not in str(e.value)


def test_cli_refuses_in_one_line_without_torch(tmp_path):
    code = ("import sys; from parallel_mini.__main__ import main\n"
            "rc = main(sys.argv[1:])\nassert 'torch' not in sys.modules, 'torch imported'\n"
            "sys.exit(rc)\n")
    out = subprocess.run([sys.executable, "-c", code, "run", "--offload-disk", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "--offload-disk" in out.stderr
    assert "Traceback" not in out.stderr
