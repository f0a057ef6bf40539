"""Distributed checkpoints that reshard: save under one layout, resume under another.

Every strategy keeps its states in its own layout: plain data parallel whole parameters, ZeRO-1/2
a slice of one flat buffer, ZeRO-3 a slice of each unit's flat buffer (with padding), tensor
parallel a slice of rows or columns, a pipeline stage its blocks, expert parallel E/ep experts.
None of those layouts survives a change of degrees. What does is the *full* model: the names the
single-process reference uses (`blocks.0.attn.qkv.weight`) and their full shapes.

So a checkpoint is written in full-model coordinates (as torchtitan's and DCP's sharded tensors
are): every rank saves the parts it owns as boxes of the full tensors,
    "param/blocks.0.attn.qkv.weight@64,0+32,64"   rows 64..95, columns 0..63 of that weight
    "exp_avg/...", "exp_avg_sq/..."               Adam's moments, the same boxes
    "step/...@...+..."                            Adam's step count for that box (an int64 scalar)
with torch.distributed.checkpoint (DCP): each rank writes its own file, replicas (the same box on
every data-parallel rank) are written once (DCP deduplicates equal keys). On resume each rank
works out the boxes it owns under the *new* layout, reads the saved boxes that overlap them and
copies the overlaps in. Nothing is gathered onto one rank, on save or on load.

Where those boxes come from is said once, in placement.py's vocabulary: each parallel module says
which block of each full tensor it holds (`placement.held_by(model)`), and the gradient strategy
lists what it owns as boxes of those tensors (`strategy.owned(held)`, interfaces.py): pieces of
values the optimizer steps, with their Adam state. This file only writes and reads boxes.

Data position: the synthetic batches are a pure function of (seed, step), so the step *is* the
data position. RNG: a training step draws no random numbers (no dropout); each rank's torch RNG
state is saved anyway and restored when the world size is unchanged. With the same layout a
resumed run is bit-identical to the uninterrupted one; under another it sums gradients in another
order, and equals it within the usual 1e-5.

Atomicity: the ranks write into DIR/step_N.tmp; after every rank's part is written rank 0 adds
meta.json (with every file's size and sha256), renames it to DIR/step_N and only then points
DIR/latest at it (written aside, then os.replace); only then are older checkpoints pruned (all but
the newest --keep). A rank killed at any moment leaves `latest` on a whole checkpoint. --save-every K
saves after every K-th step too, so a run killed at step 900 of 1,000 resumes from the last one;
--resume DIR with --save DIR is one command line for every launch of a job that torchrun restarts
(a DIR without `latest` starts from step 0).

Nothing in a checkpoint directory is trusted: preflight.py checks every file's checksum and DCP's
pickled .metadata's names (an allow-list) before any rank starts, the ranks read .metadata through
the same allow-list, and a save never writes through a link planted in DIR.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import sys

import torch
import torch.distributed as dist

from ..interfaces import Piece
from ..model import GPTConfig
from ..placement import PADDING, Box, Region, held_by
# What --resume reads before any rank starts (`latest`, meta.json) is read torch-free, without
# trusting the files, by the CLI before it imports torch: preflight.py.
from .preflight import CheckpointError, allowed_name, file_digests, resolve, resume_path

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state per element (SGD keeps none)


# ---------------------------------------------------------------------------------------------
# 1. keys: "kind/name@offsets+sizes"
# ---------------------------------------------------------------------------------------------
def _key(kind: str, name: str, box: Box) -> str:
    return f"{kind}/{name}@{box.key()}"


def _parse(key: str) -> tuple[str, str, Box]:
    kind, rest = key.split("/", 1)
    name, box = rest.rsplit("@", 1)
    return kind, name, Box.parse(box)


def _boxes(pieces: list[Piece]):
    """(piece, region) for every box of a full tensor in `pieces` (padding holds none)."""
    return [(pc, reg) for pc in pieces for reg in pc.regions if reg.name != PADDING]


# ---------------------------------------------------------------------------------------------
# 2. save and load
# ---------------------------------------------------------------------------------------------
class CheckpointSaveError(RuntimeError):
    """A save that could not be completed (a full disk, a directory made unwritable): every rank
    raises it with the same one line; the previous checkpoint is untouched."""


def save(directory: str, step: int, model, strategy, mesh, cfg) -> str:
    """Every rank writes its boxes of params and Adam state into DIR/step_N.tmp (collective);
    rank 0 then adds meta.json (with every file's checksum), renames it to DIR/step_N, points
    DIR/latest at it and prunes all but the newest --keep. Returns DIR/step_N. Nothing in DIR is
    followed through a symbolic link: a planted step_N.tmp, step_N or latest.tmp is removed, not
    written through. A failure on any rank ends every rank with one CheckpointSaveError."""
    import torch.distributed.checkpoint as dcp  # here: importing it costs every run ~1-2 s
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)
    final = os.path.join(directory, f"step_{step}")
    tmp = final + ".tmp"
    _agree(mesh, directory, step, lambda: _prepare(directory, tmp) if mesh.rank == 0 else None)
    state = {}
    for pc, reg in _boxes([pc for pc in strategy.owned(held_by(model)) if pc.saved]):
        st = pc.optimizer.state.get(pc.index, {}) if pc.optimizer is not None else {}
        tensors = {"param": pc.values.float(), **{k: st[k].view(-1) for k in MOMENTS if k in st}}
        for kind, t in tensors.items():
            state[_key(kind, reg.name, reg.box)] = pc.view(reg, t).detach().to("cpu", copy=True)
        steps = getattr(pc.optimizer, "param_steps", {}).get(pc.index)
        if steps is not None:  # a tensor, not a Python int: DCP pickles ints (loading runs code)
            state[_key("step", reg.name, reg.box)] = torch.tensor(steps, dtype=torch.int64)
    state[f"rng/{mesh.rank}"] = torch.get_rng_state()
    try:
        dcp.save(state, checkpoint_id=tmp)  # collective: one rank's failure fails them all
        error = None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (DCP wraps the rank's OSError)
        error = _why(e)
    if error is None:
        crash_point(cfg, mesh.rank, f"save {step} written")  # this rank's file is whole, not all
    _agree(mesh, directory, step, lambda: _raise(error))
    _agree(mesh, directory, step, lambda: _finish(directory, step, cfg) if mesh.rank == 0 else None)
    crash_point(cfg, mesh.rank, f"save {step} latest")  # whole and pointed at, not yet pruned
    if mesh.rank == 0:
        _prune(directory, step, cfg.keep)
    dist.barrier()
    return final


def crash_point(cfg, rank: int, point: str) -> None:
    """Tests: this rank dies by SIGKILL at a named moment of the run ("step 3": after training
    step 3, before its save; "save 4 written": its part of step_4 on disk, not the whole;
    "save 4 renamed": step_4 complete, `latest` not yet on it; "save 4 latest": before pruning).
    "save 4 finishing": rank 0, every part written, before meta.json. Asked by cfg.extra["kill"] =
    {"rank": r, "at": point}, or by the environment variable PARALLEL_MINI_KILL (the same as JSON,
    with "once": a file created by the first kill, so that torchrun's restarted group runs
    through). With "fail": errno, the rank raises that OSError there instead (a directory made
    unwritable, a disk that filled)."""
    spec = cfg.extra.get("kill") or json.loads(os.environ.get("PARALLEL_MINI_KILL") or "null")
    if not spec or spec.get("at") != point or spec.get("rank") != rank:
        return
    if spec.get("once"):
        try:
            os.close(os.open(spec["once"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return
    if spec.get("fail"):
        raise OSError(spec["fail"], os.strerror(spec["fail"]))
    os.kill(os.getpid(), signal.SIGKILL)


def _agree(mesh, directory: str, step: int, work) -> None:
    """Run `work` (one rank's part of a save), then every rank learns whether any rank failed:
    all raise the same CheckpointSaveError, or all go on."""
    try:
        work()
        error = None
    except CheckpointSaveError as e:
        error = str(e)
    except OSError as e:
        error = _why(e)
    errors = [None] * mesh.world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first is None:
        return
    if mesh.rank == 0:
        with contextlib.suppress(OSError):
            _remove(os.path.join(directory, f"step_{step}.tmp"))  # (frees what it took)
    try:
        prev = resolve(directory)[0]
        kept = f"{prev} is intact: --resume {directory} continues from it"
    except (CheckpointError, OSError):
        kept = "no earlier checkpoint is there"
    raise CheckpointSaveError(f"--save {directory}: could not write step_{step} ({first}); the run "
                              f"stopped; {kept}")


def _raise(error: str | None) -> None:
    if error:
        raise CheckpointSaveError(error)


def _why(e: BaseException) -> str:
    """The root cause of a failed write in a few words (DCP wraps every rank's exception)."""
    for failure in getattr(e, "failures", {}).values():  # CheckpointException: rank -> (exc, tb)
        e = failure[0] if isinstance(failure, tuple) else failure
        break
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _remove(path: str) -> None:
    """Remove what is at `path` without following a link: a link or a file is unlinked, a directory
    removed with its contents (shutil.rmtree does not follow links inside it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _prepare(directory: str, tmp: str) -> None:
    os.makedirs(directory, exist_ok=True)
    _remove(tmp)  # a save that died before (never loaded), or a link planted there
    os.mkdir(tmp)  # (mkdir never follows a link: something that reappeared is an error)


def _write_new(path: str, text: str) -> None:
    """Write a new file at `path`: whatever was there (a planted link) is removed first, and the
    file is created, never opened through a link (O_EXCL | O_NOFOLLOW)."""
    _remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _finish(directory: str, step: int, cfg) -> None:
    """Rank 0, once every rank's part is written: meta.json, then step_N, then latest."""
    final = os.path.join(directory, f"step_{step}")
    tmp = final + ".tmp"
    crash_point(cfg, 0, f"save {step} finishing")
    meta = {**_meta(cfg, step), "files": file_digests(tmp)}
    _write_new(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
    _remove(final)  # a step this run saved before a restart, never pointed at by latest (preflight)
    os.rename(tmp, final)
    crash_point(cfg, 0, f"save {step} renamed")
    _write_new(os.path.join(directory, "latest.tmp"), f"step_{step}\n")
    os.replace(os.path.join(directory, "latest.tmp"), os.path.join(directory, "latest"))
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename and the new `latest` on disk
    finally:
        os.close(fd)


def _prune(directory: str, step: int, keep: int) -> None:
    """After DIR/latest names step_N: remove all but the newest `keep` step_M (M <= N), and the
    leftovers of saves that died (step_M.tmp, M < N). Checkpoints of later steps (another run's
    in the same directory) are left. A failure here loses nothing: said once, the run goes on."""
    older, dead = [], []
    for name in os.listdir(directory):
        m = re.fullmatch(r"step_(\d+)(\.tmp)?", name)
        if m and int(m.group(1)) < step:
            (dead if m.group(2) else older).append((int(m.group(1)), name))
    doomed = sorted(older)[:max(0, len(older) - (keep - 1))] + dead
    for _, name in doomed:
        try:
            _remove(os.path.join(directory, name))
        except OSError as e:
            print(f"warning: --save {directory}: could not prune {name} ({e.strerror})",
                  file=sys.stderr)


def resume(cfg, model, strategy, mesh) -> int:
    """--resume: the step to start from (collective). Rank 0 says which folder (preflight's
    resume_path: none for a job's first launch into its own empty --save directory), so that every
    rank loads the same one even if `latest` moved meanwhile; then every rank loads its part."""
    where = [resume_path(cfg) if mesh.rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    return load(where[0], model, strategy, mesh) if where[0] else 0


@torch.no_grad()
def load(path: str, model, strategy, mesh) -> int:
    """Fill this rank's parameters and Adam state, in its own layout, from the checkpoint at
    `path` (DIR or DIR/step_N); returns the step it was saved after (collective). Nothing in the
    folder is unpickled but through DCP_NAMES (preflight.py): no code from the checkpoint runs."""
    import torch.distributed.checkpoint as dcp
    path, meta = resolve(path)
    reader = _safe_reader(path)
    saved = reader.read_metadata().state_dict_metadata
    index: dict[tuple[str, str], list[tuple[str, Box]]] = {}  # (kind, name) -> [(key, box)]
    for key in saved:
        if "@" in key:
            kind, name, box = _parse(key)
            index.setdefault((kind, name), []).append((key, box))
    pieces = strategy.owned(held_by(model))
    todo = _boxes(pieces)
    wanted = {}
    for _, reg in todo:
        for kind in ("param", *MOMENTS, "step"):
            for key, box in index.get((kind, reg.name), []):
                if reg.box.intersect(box) is not None:
                    wanted[key] = torch.empty(box.sizes) if kind != "step" else \
                        torch.zeros((), dtype=torch.int64) if hasattr(saved[key], "size") else 0
    if meta["world_size"] == mesh.world_size:
        wanted[f"rng/{mesh.rank}"] = torch.empty_like(torch.get_rng_state())
    dcp.load(wanted, checkpoint_id=path, storage_reader=reader, planner=_safe_planner())
    for pc in pieces:
        if pc.saved:
            _ensure_state(pc, todo, index, wanted)
    for pc, reg in todo:
        _fill(pc.view(reg, pc.values), "param", reg, index, wanted)
        if pc.index is not None and pc.index in pc.optimizer.state:
            for k in MOMENTS:
                _fill(pc.view(reg, pc.optimizer.state[pc.index][k].view(-1)), k, reg, index, wanted)
    strategy.loaded()
    if f"rng/{mesh.rank}" in wanted:
        torch.set_rng_state(wanted[f"rng/{mesh.rank}"])
    return meta["step"]


def _safe_reader(path: str):
    """DCP's FileSystemReader, but its .metadata (a pickle) is unpickled with the real classes
    only where preflight.DCP_NAMES allows them: a planted pickle names something else and is
    refused before anything of it runs."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    file = os.path.join(path, ".metadata")

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            allowed_name(file, module, name)
            return super().find_class(module, name)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(file, "rb") as fh:
                metadata = Restricted(fh).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_planner():
    """DCP's load planner, but bytes entries (ints an older save pickled) are read with
    torch.load(weights_only=True): plain values, never code."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            fqn, loaded = read_item.dest_index.fqn, torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner()


def _ensure_state(pc: Piece, todo, index, wanted) -> None:
    """Adam state for a piece: its step count from the saved boxes it overlaps (they must agree),
    zeroed moments to fill (none when the saved run had not stepped it yet)."""
    counts = {int(wanted[key]) for p2, reg in todo if p2 is pc
              for key, box in index.get(("step", reg.name), []) if reg.box.intersect(box) is not None}
    if not counts or pc.index is None:
        return
    if len(counts) > 1:
        raise CheckpointError(f"checkpoint: parts of one optimizer piece were stepped a different "
                              f"number of times ({sorted(counts)}); cannot resume it as one piece")
    pc.optimizer.param_steps[pc.index] = counts.pop()
    pc.optimizer.state[pc.index] = {k: torch.zeros_like(pc.optimizer.params[pc.index])
                                    for k in MOMENTS}


def _fill(dst: torch.Tensor, kind: str, reg: Region, index, wanted) -> None:
    """Copy every saved box of (kind, reg.name) that overlaps reg.box into dst (that box); all of
    it must be covered (the saved boxes of one tensor do not overlap: replicas were written once)."""
    covered = 0
    for key, box in index.get((kind, reg.name), []):
        hit = reg.box.intersect(box)
        if hit is not None:
            dst[hit.within(reg.box)].copy_(wanted[key][hit.within(box)])
            covered += hit.numel
    if covered != reg.box.numel:
        raise CheckpointError(f"checkpoint: {kind} of {reg.name} at {reg.box.offsets} size "
                              f"{reg.box.sizes} is not in the checkpoint ({covered} of "
                              f"{reg.box.numel} elements found)")


# ---------------------------------------------------------------------------------------------
# 3. what a checkpoint says about itself (preflight.py reads it back before a resume)
# ---------------------------------------------------------------------------------------------
LAYOUT = ("dp", "tp", "pp", "cp", "ep", "zero", "dp_shard", "sp", "schedule", "virtual_stages")


def _meta(cfg, step: int) -> dict:
    return {"step": step, "world_size": cfg.world_size, "model": vars(GPTConfig.from_run(cfg)),
            "seed": cfg.seed, "optimizer": cfg.optimizer, "precision": cfg.precision,
            "layout": {k: getattr(cfg, k) for k in LAYOUT}}
