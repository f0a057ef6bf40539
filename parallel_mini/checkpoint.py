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

Two steps per strategy turn its layout into full-model coordinates:
    pieces(strategy)    flat ranges [lo, hi) of the rank's *local* parameters, with the tensor the
                        optimizer steps for that range and its Adam state (one per optimizer piece)
    placements(model)   where each local parameter sits in its full tensor: tensor parallel's
                        rows/columns (QKV's three row blocks), expert parallel's experts
A flat range of a row-major tensor is at most a few boxes (`flat_boxes`).

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
import math
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model import GPTConfig
from .moe import Experts
from .optim import MasterWeights
from .parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
# What --resume reads before any rank starts (`latest`, meta.json) is read torch-free, without
# trusting the files, by the CLI before it imports torch: preflight.py.
from .preflight import CheckpointError, resolve

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state per element (SGD keeps none)


# ---------------------------------------------------------------------------------------------
# 1. where a local parameter sits in its full tensor
# ---------------------------------------------------------------------------------------------
def placements(model: torch.nn.Module) -> dict:
    """{local parameter: (full name, [(local offsets, sizes, full offsets)])}: the blocks of the
    local tensor and where each lies in the full one (one block, except QKV under tensor
    parallel: its rows are [q_r | k_r | v_r], three blocks of the full [q | k | v])."""
    out = {}
    for mod_name, m in model.named_modules():
        for p_name, p in m.named_parameters(recurse=False):
            shape, zeros = tuple(p.shape), (0,) * p.dim()
            full = [(zeros, shape, _offset(m, p_name, p))]
            if isinstance(m, ColumnParallelLinear) and mod_name.endswith("attn.qkv"):
                full = _qkv_blocks(m, shape)
            out[p] = (f"{mod_name}.{p_name}" if mod_name else p_name, full)
    return out


def _offset(m, p_name: str, p) -> tuple[int, ...]:
    """Full-tensor offset of a local parameter that is one block of its full tensor."""
    o = [0] * p.dim()
    if isinstance(m, ColumnParallelLinear):  # rows r of [out, in], and of the bias [out]
        o[0] = m.comm.rank(m.axis) * p.shape[0]
    elif isinstance(m, RowParallelLinear) and p_name == "weight":  # columns r of [out, in]
        o[1] = m.comm.rank(m.axis) * p.shape[1]
    elif isinstance(m, VocabParallelEmbedding):  # rows [start, start + v/tp) of the table
        o[0] = m.start
    elif isinstance(m, Experts):  # experts [first, first + E/ep) (ShardedExperts; 0 when whole)
        o[0] = m.first
    return tuple(o)


def _qkv_blocks(m, shape) -> list:
    n, r = m.comm.size(m.axis), m.comm.rank(m.axis)
    per = shape[0] // 3  # h/tp rows of each of q, k, v
    h = per * n
    rest = tuple(0 for _ in shape[1:])
    return [((j * per, *rest), (per, *shape[1:]), (j * h + r * per, *rest)) for j in range(3)]


# ---------------------------------------------------------------------------------------------
# 2. what each strategy owns: flat ranges of local parameters
# ---------------------------------------------------------------------------------------------
@dataclass
class Piece:
    """Elements [lo, hi) of local parameter `param` (flattened), as a strategy holds them:
    `value` [hi-lo] the values the optimizer steps (fp32: master copies under bf16-mixed), and
    the optimizer whose state[index] / param_steps[index] belong to this range (None: no state
    here, e.g. ZeRO-1/2's replicated full parameters, loaded but not saved)."""
    param: torch.nn.Parameter
    lo: int
    hi: int
    value: torch.Tensor
    optimizer: object = None
    index: int | None = None


def pieces(strategy) -> list[Piece]:
    """The pieces a rank saves; a strategy that cannot say is refused (see `supported`)."""
    kind = type(strategy).__name__
    if kind == "ExpertAndDense":  # dense over dp x cp, experts over edp: the two lists
        return [pc for part in strategy.parts for pc in pieces(part)]
    if kind == "PlainDataParallel":
        opt = strategy.optimizer
        inner, values = (opt.inner, opt.masters) if isinstance(opt, MasterWeights) else (opt, opt.params)
        return [Piece(p, 0, p.numel(), v.view(-1), inner, j)
                for j, (p, v) in enumerate(zip(opt.params, values))]
    if kind == "ZeroDataParallel":  # my slice of the flat buffer, cut at parameter boundaries
        return _flat_pieces(strategy.params, strategy.layout, strategy.r, strategy.pieces,
                            strategy.optimizer, 0)
    if kind == "Zero3DataParallel":  # my slice of each unit; one optimizer over all units
        out, j = [], 0
        for u in strategy.units:
            out += _flat_pieces(u.params, u.layout, u.r, u.pieces, strategy.optimizer, j)
            j += len(u.pieces)
        return out
    raise CheckpointError(f"checkpoints: the gradient strategy {kind} cannot export its layout")


def _flat_pieces(params, layout, r, my_pieces, opt, first: int) -> list[Piece]:
    """A slice r of a FlatLayout: piece (i, lo, hi) is elements r*k + lo - offset_i ... of param i.
    The padding piece (i None) holds no model state."""
    start = r * layout.shard_numel
    return [Piece(params[i], start + lo - layout.offsets[i][0], start + hi - layout.offsets[i][0],
                  opt.params[first + j], opt, first + j)
            for j, (i, lo, hi) in enumerate(my_pieces) if i is not None]


def _also_loaded(strategy) -> list[Piece]:
    """Parameters a strategy holds whole beside its pieces (ZeRO-1/2's replicated flat buffer):
    read whole on load, never saved (their owners' pieces are)."""
    kind = type(strategy).__name__
    if kind == "ExpertAndDense":
        return [pc for part in strategy.parts for pc in _also_loaded(part)]
    if kind == "ZeroDataParallel":
        return [Piece(p, 0, p.numel(), p.data.view(-1)) for p in strategy.params]
    return []


@torch.no_grad()
def _after_load(strategy) -> None:
    """Compute copies from the fp32 values just loaded (bf16-mixed: the rounding the step does)."""
    kind = type(strategy).__name__
    if kind == "ExpertAndDense":
        for part in strategy.parts:
            _after_load(part)
    elif kind == "PlainDataParallel" and isinstance(strategy.optimizer, MasterWeights):
        for p, m in zip(strategy.optimizer.params, strategy.optimizer.masters):
            p.copy_(m)
    elif kind == "Zero3DataParallel" and strategy.mixed:
        for u in strategy.units:
            u.shard.copy_(u.master)


# ---------------------------------------------------------------------------------------------
# 3. flat ranges -> boxes of the full tensors
# ---------------------------------------------------------------------------------------------
def flat_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """[(offsets, sizes)]: boxes of a row-major tensor of `shape` that tile elements [lo, hi), in
    order, each contiguous (a partial first row, whole rows, a partial last row; recursively)."""
    if hi <= lo:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    a, b = -(-lo // inner), hi // inner  # the whole slabs along dim 0: [a, b)
    rest = len(shape) - 1
    if a > b:  # inside one slab
        i = lo // inner
        return [((i, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo - i * inner, hi - i * inner)]
    head = [((a - 1, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo - (a - 1) * inner, inner)] \
        if lo < a * inner else []
    body = [((a, *(0,) * rest), (b - a, *shape[1:]))] if b > a else []
    tail = [((b, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, hi - b * inner)] \
        if hi > b * inner else []
    return head + body + tail


def _intersect(o1, s1, o2, s2):
    lo = [max(a, b) for a, b in zip(o1, o2)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(o1, s1, o2, s2)]
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi))


def _window(t: torch.Tensor, t_offsets, offsets, sizes) -> torch.Tensor:
    """The view of `t` (a box at t_offsets) that covers the box (offsets, sizes)."""
    return t[tuple(slice(o - to, o - to + n) for o, to, n in zip(offsets, t_offsets, sizes))]


@dataclass
class View:
    """Where a box of the full tensor lies in a piece's tensors: the contiguous run
    [start, start + prod(size)) of the piece is the local box (off, size); the full tensor's box is
    its window (h_off, h_size)."""
    start: int
    off: tuple
    size: tuple
    h_off: tuple
    h_size: tuple

    def __call__(self, t: torch.Tensor) -> torch.Tensor:  # t: [hi - lo], one of the piece's
        box = t[self.start:self.start + math.prod(self.size)].view(self.size)
        return _window(box, self.off, self.h_off, self.h_size)


def regions(piece: Piece, where) -> list[tuple[str, tuple, tuple, View]]:
    """[(full name, full offsets, sizes, view)]: the piece cut into boxes of its full tensor;
    view(t) is the window of t [hi-lo] (one of the piece's tensors) that holds each box."""
    name, blocks = where
    shape, out = tuple(piece.param.shape), []
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for off, size in flat_boxes(shape, piece.lo, piece.hi):
        start = sum(o * s for o, s in zip(off, strides)) - piece.lo  # contiguous from here
        for local_off, local_size, full_off in blocks:  # (QKV under TP: three blocks)
            hit = _intersect(off, size, local_off, local_size)
            if hit is None:
                continue
            h_off, h_size = hit
            full = tuple(f + h - lo_ for f, h, lo_ in zip(full_off, h_off, local_off))
            out.append((name, full, h_size, View(start, off, size, h_off, h_size)))
    return out


def _key(kind: str, name: str, offsets, sizes) -> str:
    return f"{kind}/{name}@{','.join(map(str, offsets))}+{','.join(map(str, sizes))}"


def _parse(key: str):
    kind, rest = key.split("/", 1)
    name, box = rest.rsplit("@", 1)
    off, size = box.split("+")
    as_tuple = lambda s: tuple(int(x) for x in s.split(",")) if s else ()  # noqa: E731
    return kind, name, as_tuple(off), as_tuple(size)


# ---------------------------------------------------------------------------------------------
# 4. save and load
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
    where, state = placements(model), {}
    for pc in pieces(strategy):
        st = pc.optimizer.state.get(pc.index, {}) if pc.index is not None else {}
        steps = getattr(pc.optimizer, "param_steps", {}).get(pc.index)
        tensors = {"param": pc.value.float(), **{k: st[k].view(-1) for k in MOMENTS if k in st}}
        for name, off, size, view in regions(pc, where[pc.param]):
            for kind, t in tensors.items():
                state[_key(kind, name, off, size)] = view(t).detach().to("cpu", copy=True)
            if steps is not None:
                state[_key("step", name, off, size)] = steps
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
    index: dict[tuple[str, str], list] = {}  # (kind, name) -> [(key, offsets, sizes)]
    for key in saved:
        if "@" in key:
            kind, name, off, size = _parse(key)
            index.setdefault((kind, name), []).append((key, off, size))
    where, todo = placements(model), []
    mine = pieces(strategy)
    for pc in mine + _also_loaded(strategy):
        for name, off, size, view in regions(pc, where[pc.param]):
            todo.append((pc, name, off, size, view))
    wanted = {}
    for _, name, off, size, _ in todo:
        for kind in ("param", *MOMENTS, "step"):
            for key, k_off, k_size in index.get((kind, name), []):
                if _intersect(off, size, k_off, k_size) is not None:
                    wanted[key] = 0 if kind == "step" else torch.empty(k_size)
    if meta["world_size"] == mesh.world_size:
        wanted[f"rng/{mesh.rank}"] = torch.empty_like(torch.get_rng_state())
    dcp.load(wanted, checkpoint_id=path)
    for pc in mine:
        _ensure_state(pc, todo, index, wanted)
    for pc, name, off, size, view in todo:
        _fill(view(pc.value), "param", name, off, size, index, wanted)
        if pc.index is not None and pc.index in pc.optimizer.state:
            for k in MOMENTS:
                _fill(view(pc.optimizer.state[pc.index][k].view(-1)), k, name, off, size, index, wanted)
    _after_load(strategy)
    if f"rng/{mesh.rank}" in wanted:
        torch.set_rng_state(wanted[f"rng/{mesh.rank}"])
    return meta["step"]


def _ensure_state(pc: Piece, todo, index, wanted) -> None:
    """Adam state for a piece: its step count from the saved boxes it overlaps (they must agree),
    zeroed moments to fill (none when the saved run had not stepped it yet)."""
    counts = {wanted[key] for p2, name, off, size, _ in todo if p2 is pc
              for key, k_off, k_size in index.get(("step", name), [])
              if _intersect(off, size, k_off, k_size) is not None}
    if not counts or pc.index is None:
        return
    if len(counts) > 1:
        raise CheckpointError(f"checkpoint: parts of one optimizer piece were stepped a different "
                              f"number of times ({sorted(counts)}); cannot resume it as one piece")
    pc.optimizer.param_steps[pc.index] = counts.pop()
    pc.optimizer.state[pc.index] = {k: torch.zeros_like(pc.optimizer.params[pc.index])
                                    for k in MOMENTS}


def _fill(dst: torch.Tensor, kind, name, off, size, index, wanted) -> None:
    """Copy every saved box of (kind, name) that overlaps (off, size) into dst; all of it must be
    covered (the saved boxes of one tensor do not overlap: replicas were written once)."""
    covered = 0
    for key, k_off, k_size in index.get((kind, name), []):
        hit = _intersect(off, size, k_off, k_size)
        if hit is not None:
            _window(dst, off, *hit).copy_(_window(wanted[key], k_off, *hit))
            covered += math.prod(hit[1])
    if covered != math.prod(size):
        raise CheckpointError(f"checkpoint: {kind} of {name} at {off} size {size} is not in the "
                              f"checkpoint ({covered} of {math.prod(size)} elements found)")


# ---------------------------------------------------------------------------------------------
# 5. what a checkpoint says about itself (preflight.py reads it back before a resume)
# ---------------------------------------------------------------------------------------------
LAYOUT = ("dp", "tp", "pp", "cp", "ep", "zero", "dp_shard", "sp", "schedule", "virtual_stages")


def _meta(cfg, step: int) -> dict:
    return {"step": step, "world_size": cfg.world_size, "model": vars(GPTConfig.from_run(cfg)),
            "seed": cfg.seed, "optimizer": cfg.optimizer, "precision": cfg.precision,
            "layout": {k: getattr(cfg, k) for k in LAYOUT}}
