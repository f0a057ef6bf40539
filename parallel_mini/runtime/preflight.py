"""Before any rank starts: what this machine and the files on disk allow a run whose values
RunConfig.validate accepted. Torch-free, like config.py, so that the command line refuses a bad
run in a fraction of a second; whoever launches ranks asks (the CLI, launch.run).

    check(cfg)          everything below that applies (raises ConfigError: one line)
    check_fits(cfg)     theory's memory estimate against this machine's available memory
    check_flags(cfg)    --save/--resume: the directories, and the checkpoint's meta.json
    resolve(path)       a checkpoint's folder and meta.json, read without trusting either
    resume_path(cfg)    the folder a run resumes from, or None: its own empty --save directory
    verify(path, meta)  every file's size and sha256, and DCP's .metadata's names (unpickled inert)
    check_output(f, p)  a report or trace file can be written at p (before the run, not after)
    check_offload_disk  --offload-disk DIR: exists, writable, free of this run's files, big enough
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import stat
import sys
import tempfile

from ..config import GPTConfig, ConfigError, offload_file, under_torchrun


class CheckpointError(ConfigError):
    """A bad --save/--resume: one line, before any rank starts (or a checkpoint that lies)."""


class RunComplete(CheckpointError):
    """--resume DIR --save DIR where DIR/latest is at --steps already: the job finished before (a
    relaunch of its command line, or torchrun restarting a group that died after its last save).
    Not an error: the CLI says so in one line and exits 0."""


def check(cfg) -> None:
    """Every check of this module that applies to `cfg` (validated already)."""
    if cfg.pp > 1 and cfg.extra.get("ops"):  # a schedule written out op by op (an exercise's)
        from ..parallel.schedules import for_config
        try:
            for_config(cfg)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the schedule's ops: {e}") from None
    if not under_torchrun():  # torchrun's nodes are not this machine
        check_fits(cfg)
    if cfg.save or cfg.resume:
        check_flags(cfg)
    if cfg.offload_disk:
        check_offload_disk(cfg)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------
def check_fits(cfg) -> None:
    """Refuse a local run that would not fit in this machine's memory, with the estimate
    (theory.local_run_bytes_estimate), instead of letting it swap, die or time out."""
    from ..theory import local_run_bytes_estimate
    available = available_memory()
    if available is None:
        return
    est = local_run_bytes_estimate(cfg)
    if est["total"] > available / 2:
        parts = ", ".join(f"{k.replace('_', ' ')} {_gb(est[k])}" for k in ESTIMATE_PARTS
                          if est[k] > 2 ** 20)
        report = f" + the report {_gb(est['report'])}" if est["report"] > 2 ** 20 else ""
        raise ConfigError(f"this run needs about {_gb(est['total'])} of memory ({cfg.world_size} "
                          f"rank{'s' * (cfg.world_size > 1)} x {_gb(est['per_rank'])}: {parts}"
                          f"{report}), more than half of the {_gb(available)} this machine has "
                          f"available; lower --batch, --seq, --vocab, --d-model, --layers or --steps")


# the named parts of theory.local_run_bytes_estimate a refusal lists (those over 1 MB)
ESTIMATE_PARTS = ("activations", "moe_activations", "logits", "states", "transients",
                  "layer_objects", "logs", "moe_heap", "data")


def available_memory() -> int | None:
    """Bytes of memory available to new processes (Linux MemAvailable), else the physical total."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.1f} GB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.0f} MB"


# ---------------------------------------------------------------------------------------------
# checkpoints: what --resume reads before any rank starts (checkpoint.py writes them)
# ---------------------------------------------------------------------------------------------
META_TYPES = {"step": int, "world_size": int, "model": dict, "seed": int, "optimizer": str,
              "precision": str}
_JSON_NAMES = {int: "whole number", dict: "JSON object", str: "string", list: "list",
               float: "number", bool: "true/false", type(None): "null"}


def resolve(path: str) -> tuple[str, dict]:
    """(the checkpoint folder, its meta.json) for DIR (through DIR/latest) or DIR/step_N. Every
    way these files can be wrong (missing, binary, not JSON, the wrong shape, a `latest` that
    points out of DIR) is a CheckpointError naming the file, never a traceback."""
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        if not os.path.isfile(latest):
            raise _bad(path, f"{latest} is not a file")
        name = _read_text(path, latest, 256).strip()
        if not name or "/" in name or name in (".", "..") or not name.isprintable():
            raise _bad(path, f"{latest} does not name a step_N folder ({name[:40]!r})")
        path = os.path.join(path, name)
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise CheckpointError(f"--resume {path}: no checkpoint there (neither DIR/latest nor "
                              f"DIR/step_N/meta.json); give the --save directory of a finished run")
    try:
        meta = json.loads(_read_text(path, meta_file, 2 ** 20))
    except ValueError as e:
        raise _bad(path, f"{meta_file} is not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise _bad(path, f"{meta_file} holds a {_JSON_NAMES.get(type(meta), '?')}, not a JSON object")

    def typed(keys):
        for key in keys:
            typ = META_TYPES[key]
            if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
                got = "nothing" if key not in meta else _JSON_NAMES.get(type(meta[key]), "?")
                raise _bad(path, f"{meta_file}: '{key}' should be a {_JSON_NAMES[typ]}, found {got}")
    typed(["step", "world_size", "model", "seed", "optimizer"])
    if meta["step"] < 0:
        raise _bad(path, f"{meta_file}: 'step' {meta['step']} is negative")
    missing = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in meta["model"]]
    if missing:
        raise _bad(path, f"{meta_file}: the model lacks {missing}")
    typed(["precision"])
    return path, meta


def _read_text(path: str, file: str, most: int) -> str:
    try:
        with open(file, "rb") as fh:
            data = fh.read(most + 1)
    except OSError as e:
        raise _bad(path, f"cannot read {file} ({e.strerror})") from None
    if len(data) > most:
        raise _bad(path, f"{file} is larger than a checkpoint's ({most:,} bytes at most)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(path, f"{file} is binary, not text") from None


def _bad(path: str, why: str) -> CheckpointError:
    return CheckpointError(f"--resume {path}: not a checkpoint this library wrote: {why}")


def saved_layers(path: str) -> int | None:
    """The checkpoint's --layers (the CLI's default with --resume), None if it cannot be read."""
    try:
        layers = resolve(path)[1]["model"]["layers"]
    except (CheckpointError, OSError):
        return None
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else None


def check_flags(cfg) -> None:
    """--save/--resume refused before any rank starts (raises CheckpointError, one line)."""
    for flag, v in (("--save", cfg.save), ("--resume", cfg.resume)):
        if not isinstance(v, str):
            raise CheckpointError(f"{flag} {v!r}: must be a directory name (a string)")
    if cfg.pp > 1 and cfg.schedule.startswith("pipedream"):
        raise CheckpointError(f"--save/--resume with --schedule {cfg.schedule}: PipeDream's stashed "
                              f"weight versions are not in a checkpoint yet; checkpoints work with "
                              f"data parallel, ZeRO 1/2/3, tensor, context, expert parallel and "
                              f"the synchronous pipeline schedules")
    if cfg.resume and under_torchrun() and os.environ.get("RANK") == "0" \
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" \
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("note: torchrun's workers share its agents' store: a restarted group can read the "
              "last group's keys and fail again (pytorch issue 135712); set "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun", file=sys.stderr)
    start = 0
    if cfg.resume and not _first_launch(cfg):
        if not os.path.isdir(cfg.resume):
            raise CheckpointError(f"--resume {cfg.resume}: no such directory")
        path, meta = resolve(cfg.resume)
        start = meta["step"]
        if meta["step"] == cfg.steps and _same_dir(cfg.save, cfg.resume):
            raise RunComplete(f"--resume {cfg.resume}: {path} was saved after step {cfg.steps} = "
                              f"--steps: this run is complete, nothing left to train")
        if meta["step"] >= cfg.steps:
            raise CheckpointError(f"--steps {cfg.steps}: the checkpoint in {cfg.resume} was saved "
                                  f"after step {meta['step']}; --steps is the step to train up to, "
                                  f"give more than {meta['step']}")
        mine = {"model": vars(GPTConfig.from_run(cfg)), "seed": cfg.seed, "optimizer": cfg.optimizer,
                "precision": cfg.precision}  # (fp32 master weights resumed as bf16: not the run)
        for k, v in mine.items():
            if meta[k] != v:
                diff = {f: (meta[k].get(f), v[f]) for f in v if meta[k].get(f) != v[f]} \
                    if k == "model" else (meta[k], v)
                raise CheckpointError(f"--resume {cfg.resume}: saved with another {k} (saved, "
                                      f"now: {diff}); resume with the same {k}")
        verify(path, meta)
    if cfg.save:
        parent = os.path.dirname(os.path.abspath(cfg.save))
        if not os.path.isdir(parent) or (os.path.lexists(cfg.save) and not os.path.isdir(cfg.save)):
            raise CheckpointError(f"--save {cfg.save}: must be a directory inside an existing one "
                                  f"({parent})")  # (lexists: a dangling link or a loop too)
        latest = os.path.join(cfg.save, "latest")
        if os.path.lexists(latest) and not os.path.isfile(latest):
            raise CheckpointError(f"--save {cfg.save}: {latest} is not a file (the save ends by "
                                  f"pointing it at the new step); remove it or choose another directory")
        every = cfg.save_every or cfg.steps  # (engine: after every step that K divides)
        points = set(range((start // every + 1) * every, cfg.steps, every))
        taken = sorted(n for n in points | {cfg.steps}
                       if os.path.isdir(os.path.join(cfg.save, f"step_{n}")))
        if taken and not _same_dir(cfg.save, cfg.resume):  # (resuming there: a restart's own)
            raise CheckpointError(f"--save {cfg.save}: step_{taken[0]} is already saved there; "
                                  f"choose another directory or remove it")
        # Tried for real, as check_output does (a read-only file system, /proc): a uniquely named
        # probe, since under torchrun every rank of the node asks at once.
        where = cfg.save if os.path.isdir(cfg.save) else parent
        try:
            if len(os.fsencode(os.path.basename(os.path.abspath(cfg.save)))) > \
                    os.pathconf(parent, "PC_NAME_MAX"):
                raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
            os.rmdir(tempfile.mkdtemp(dir=where, prefix=".write-probe-"))
        except OSError as e:
            raise CheckpointError(f"--save {cfg.save}: cannot write there ({e.strerror})") from None


def _same_dir(a: str, b: str) -> bool:
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def resume_path(cfg) -> str | None:
    """The checkpoint folder a run resumes from (DIR/step_N), or None for a run that starts from
    step 0: one whose --resume is its own --save directory and that directory holds no checkpoint
    yet (no DIR/latest; missing is fine). So one command line serves every launch of a job that
    torchrun restarts: the first starts, every later one resumes."""
    return None if _first_launch(cfg) else resolve(cfg.resume)[0]


def _first_launch(cfg) -> bool:
    return _same_dir(cfg.save, cfg.resume) and not os.path.lexists(os.path.join(cfg.resume, "latest"))


# ---------------------------------------------------------------------------------------------
# checkpoints: every file's checksum, and DCP's pickled .metadata read without running it
# ---------------------------------------------------------------------------------------------
def file_digests(folder: str) -> dict:
    """{name: {"bytes": n, "sha256": hex}} for every file in a checkpoint folder but meta.json
    (which holds this). Anything that is not a regular file (a link, a FIFO) is an error."""
    return {name: _digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name != "meta.json"}


def _digest(file: str) -> dict:
    st = os.lstat(file)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file (a link, a FIFO or a device)", file)
    h = hashlib.sha256()
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # (never blocks on a FIFO)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # (swapped after the lstat)
            raise OSError(errno.EINVAL, "not a regular file", file)
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": st.st_size, "sha256": h.hexdigest()}


def verify(path: str, meta: dict) -> None:
    """Every file meta.json lists is there, a regular file, of its size and checksum; and DCP's
    .metadata names only DCP's own classes (read_dcp_metadata). Raises CheckpointError naming the
    first file that differs."""
    files = meta.get("files")
    if not isinstance(files, dict):  # (a save before checksums: it cannot be verified)
        raise _bad(path, f"meta.json: 'files' (every file's checksum) should be a JSON object, "
                         f"found {'nothing' if files is None else _JSON_NAMES.get(type(files), '?')}")
    if ".metadata" not in files:
        raise _bad(path, "meta.json lists no .metadata (DCP's index of the shards)")
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        if os.path.basename(name) != name or name in (".", "..", "meta.json") \
                or not isinstance(want, dict):
            raise _bad(path, f"meta.json lists a file {name[:60]!r} that is not one of its own")
        if not os.path.lexists(file):
            raise CheckpointError(f"--resume {path}: {name} is missing; the checkpoint is "
                                  f"incomplete (resume from another step_N or save again)")
        try:
            got = _digest(file)
        except OSError as e:
            raise CheckpointError(f"--resume {path}: cannot read {name} ({e.strerror})") from None
        if got["bytes"] != want.get("bytes"):
            raise CheckpointError(f"--resume {path}: {name} holds {got['bytes']:,} bytes, "
                                  f"{want.get('bytes')!r} were saved (truncated or overwritten); "
                                  f"resume from another step_N or save again")
        if got["sha256"] != want.get("sha256"):
            raise CheckpointError(f"--resume {path}: {name} does not match its checksum (sha256) "
                                  f"in meta.json: the file was changed or corrupted after the save; "
                                  f"resume from another step_N or save again")
    read_dcp_metadata(os.path.join(path, ".metadata"))


# What DCP pickles into .metadata (torch 2.x): its own dataclasses, torch.Size, dtypes, layouts,
# a path. Nothing else may be named: unpickling a name is how a pickle runs code.
DCP_NAMES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "StorageMeta",
                                              "TensorProperties", "_MEM_FORMAT_ENCODING",
                                              "ChunkStorageMetadata", "BytesStorageMetadata",
                                              "MetadataIndex"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
              "int8", "uint8", "bool"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


def allowed_name(path: str, module: str, name: str) -> None:
    """Raises CheckpointError unless module.name is one DCP_NAMES allows."""
    if name not in DCP_NAMES.get(module, ()):
        raise CheckpointError(f"--resume {os.path.dirname(path)}: .metadata names "
                              f"{module[:60]}.{name[:60]}, which DCP's metadata never holds; "
                              f"refused unread (unpickling it could run code)")


class _Inert:
    """Stands for every object of a pickle read torch-free: takes any arguments, does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()


class _NamesOnly(pickle.Unpickler):
    """Walks a pickle with every allowed name replaced by _Inert: checks the names, runs nothing."""

    def __init__(self, fh, path: str):
        super().__init__(fh)
        self.path = path

    def find_class(self, module, name):
        allowed_name(self.path, module, name)
        return _Inert

    def persistent_load(self, pid):
        raise CheckpointError(f"--resume {os.path.dirname(self.path)}: .metadata holds a "
                              f"persistent reference, which DCP's metadata never holds")


def read_dcp_metadata(path: str) -> None:
    """Check DCP's .metadata torch-free: a pickle whose every named class is one of DCP_NAMES
    (checkpoint.py then reads it with the real classes, through the same allow-list)."""
    try:
        with open(path, "rb") as fh:
            _NamesOnly(fh, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (a garbled pickle raises anything)
        raise CheckpointError(f"--resume {os.path.dirname(path)}: .metadata is not DCP's metadata "
                              f"({type(e).__name__})") from None


# ---------------------------------------------------------------------------------------------
# output files
# ---------------------------------------------------------------------------------------------
def check_output(flag: str, path: str | None) -> None:
    """A report or trace file can be written at `path`: refused now, in one line, rather than
    after the ranks have run. Tried for real (opened for appending, then the probe removed if it
    was not there before): the only way to know for a read-only file system, /proc, a name too
    long or a directory one may not write, whoever runs it (root passes every access() test)."""
    if path is None:
        return
    if path == "":
        raise ConfigError(f"{flag} '': give a file name" + (" (or - for standard output)"
                                                             if flag == "--json" else ""))
    if path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the directory {folder} does not exist; create it first")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a directory; give a file name inside it")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: not a regular file (a device, a pipe or a socket); give "
                          f"a file name" + (" or - for standard output" if flag == "--json" else ""))
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write a file there ({e.strerror})") from None
    if not existed:
        with contextlib.suppress(FileNotFoundError):  # (torchrun: another rank's probe removed it)
            os.remove(path)


# ---------------------------------------------------------------------------------------------
# --offload-disk: the directory each rank's optimizer states go to (parallel/offload_disk.py)
# ---------------------------------------------------------------------------------------------
def check_offload_disk(cfg) -> None:
    """The directory exists, can be written, holds none of this run's files yet, and has room for
    what every rank will keep there (theory's `disk` bytes, summed over the ranks)."""
    where = cfg.offload_disk
    if not os.path.isdir(where):
        raise ConfigError(f"--offload-disk {where}: no such directory; create it first (each "
                          f"rank keeps its optimizer states in a file there)")
    try:
        os.rmdir(tempfile.mkdtemp(dir=where, prefix=".write-probe-"))  # tried for real, as --save
    except OSError as e:
        raise ConfigError(f"--offload-disk {where}: cannot write there ({e.strerror}); choose a "
                          f"directory you may write") from None
    ranks = [int(os.environ["RANK"])] if under_torchrun() else range(cfg.world_size)
    for r in ranks:
        if os.path.lexists(offload_file(where, r)):
            raise ConfigError(f"--offload-disk {where}: {offload_file(where, r)} exists already (a "
                              f"run with --keep-offload, or one still running?); remove it or "
                              f"choose another directory")
    need = offload_disk_bytes(cfg)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ConfigError(f"--offload-disk {where}: the ranks' optimizer states need "
                          f"{need:,} bytes and the file system has {free:,} free; free some "
                          f"space, choose another directory or a smaller model")


def offload_disk_bytes(cfg) -> int:
    """Bytes every rank together keeps in --offload-disk files (theory's `disk`, per rank)."""
    from ..theory import run_theory
    th = run_theory(cfg, 0)
    stages = th.get("stages", [th])  # a pipeline's ranks differ by stage; the others do not
    return cfg.world_size // len(stages) * sum(s["memory"]["disk"] for s in stages)


def remove_offload_files(directory: str, ranks) -> None:
    """After the run (or its failure): the files its ranks wrote, and nothing else."""
    for r in ranks:
        with contextlib.suppress(FileNotFoundError):
            os.remove(offload_file(directory, r))
