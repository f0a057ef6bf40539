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
    "step/...@...+..."                            Adam's step count for that box (an int)
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

Atomicity: the ranks write into DIR/step_N.tmp; after a barrier rank 0 adds meta.json, renames it
to DIR/step_N and only then points DIR/latest at it (written aside, then os.replace). A rank killed
during a save leaves step_N.tmp half written and `latest` on the previous checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from .interfaces import Piece
from .model import GPTConfig
from .placement import PADDING, Box, Region, held_by
# What --resume reads before any rank starts (`latest`, meta.json) is read torch-free, without
# trusting the files, by the CLI before it imports torch: preflight.py.
from .preflight import CheckpointError, resolve

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
def save(directory: str, step: int, model, strategy, mesh, cfg, kill_rank: int | None = None) -> str:
    """Every rank writes its boxes of params and Adam state into DIR/step_N.tmp (collective);
    rank 0 then renames it to DIR/step_N and points DIR/latest at it. Returns DIR/step_N.
    `kill_rank` (tests): that rank dies after writing its part, before the checkpoint is whole."""
    import torch.distributed.checkpoint as dcp  # here: importing it costs every run ~1-2 s
    final = os.path.join(directory, f"step_{step}")
    tmp = final + ".tmp"
    if mesh.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died before: never loaded
    dist.barrier()
    state = {}
    for pc, reg in _boxes([pc for pc in strategy.owned(held_by(model)) if pc.saved]):
        st = pc.optimizer.state.get(pc.index, {}) if pc.optimizer is not None else {}
        tensors = {"param": pc.values.float(), **{k: st[k].view(-1) for k in MOMENTS if k in st}}
        for kind, t in tensors.items():
            state[_key(kind, reg.name, reg.box)] = pc.view(reg, t).detach().to("cpu", copy=True)
        steps = getattr(pc.optimizer, "param_steps", {}).get(pc.index)
        if steps is not None:
            state[_key("step", reg.name, reg.box)] = steps
    state[f"rng/{mesh.rank}"] = torch.get_rng_state()
    dcp.save(state, checkpoint_id=tmp)
    if kill_rank == mesh.rank:
        os._exit(9)  # the test's crash: this rank's file is written, the checkpoint is not whole
    dist.barrier()
    if mesh.rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(_meta(cfg, step), fh, indent=1)
        os.rename(tmp, final)
        with open(os.path.join(directory, "latest.tmp"), "w") as fh:
            fh.write(f"step_{step}\n")
        os.replace(os.path.join(directory, "latest.tmp"), os.path.join(directory, "latest"))
    dist.barrier()
    return final


@torch.no_grad()
def load(path: str, model, strategy, mesh) -> int:
    """Fill this rank's parameters and Adam state, in its own layout, from the checkpoint at
    `path` (DIR or DIR/step_N); returns the step it was saved after (collective)."""
    import torch.distributed.checkpoint as dcp
    path, meta = resolve(path)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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
                    wanted[key] = 0 if kind == "step" else torch.empty(box.sizes)
    if meta["world_size"] == mesh.world_size:
        wanted[f"rng/{mesh.rank}"] = torch.empty_like(torch.get_rng_state())
    dcp.load(wanted, checkpoint_id=path)
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


def _ensure_state(pc: Piece, todo, index, wanted) -> None:
    """Adam state for a piece: its step count from the saved boxes it overlaps (they must agree),
    zeroed moments to fill (none when the saved run had not stepped it yet)."""
    counts = {wanted[key] for p2, reg in todo if p2 is pc
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
