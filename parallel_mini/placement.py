"""Placement: which part of every full tensor a rank holds, and which part it owns.

The single-process reference names every tensor (`blocks.0.attn.qkv.weight`) and gives it a full
shape. Parallelism cuts them: tensor parallel keeps rows or columns, expert parallel E/ep experts,
a pipeline stage its blocks; then a gradient strategy *owns* (steps, saves) some of what its rank
holds: plain data parallel all of it, ZeRO a slice of one flat buffer (stages 1-2) or of each
unit's (stage 3). All of it is said here in one vocabulary, a `Box` of the full tensor (offsets and
sizes per dimension), so that checkpoints, the gather for the reference comparison, theory's unit
sizes and the tiling test read one description instead of re-deriving it:
    held     {name: [Block]}   the parallel modules' cuts (tensor.py, expert.py call `split`)
    owned    [Owned]           a strategy's flat slices (`flat_owned`), as boxes of named tensors

Pure Python (no torch): theory and the planner use it too. `gpt_held` and `owned_by_rank` are the
tiny GPT's placement computed from the config alone; tests/test_placement.py proves them equal to
what live modules and strategies report, and checks on every layout of the composition matrix
that the boxes all ranks own tile every full tensor, each element the same number of times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


# ---------------------------------------------------------------------------------------------
# 1. boxes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Box:
    """Elements [offsets[d], offsets[d] + sizes[d]) along every dimension d of a full tensor."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + n, b + m) for a, n, b, m in
                   zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))

    def index(self) -> tuple[slice, ...]:
        """Its index in the full tensor: t[box.index()] is the box."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))

    def within(self, outer: "Box") -> tuple[slice, ...]:
        """The index of this box in a tensor that holds the box `outer`."""
        return tuple(slice(o - to, o - to + n)
                     for o, to, n in zip(self.offsets, outer.offsets, self.sizes))

    def key(self) -> str:
        """'64,0+32,64': offsets + sizes (checkpoint keys)."""
        return f"{','.join(map(str, self.offsets))}+{','.join(map(str, self.sizes))}"

    @classmethod
    def parse(cls, text: str) -> "Box":
        off, size = text.split("+")
        as_tuple = lambda s: tuple(int(x) for x in s.split(",")) if s else ()  # noqa: E731
        return cls(as_tuple(off), as_tuple(size))


@dataclass(frozen=True)
class Block:
    """The part of a local tensor at offsets `local` that is the box `full` of the full tensor."""
    local: tuple[int, ...]
    full: Box


def whole(shape: tuple) -> list[Block]:
    """A tensor held whole: one block, everywhere the same."""
    zeros = (0,) * len(shape)
    return [Block(zeros, Box(zeros, tuple(shape)))]


def split(shape: tuple, dim: int, n: int, r: int, parts: int = 1) -> list[Block]:
    """Rank r of n's cut of a tensor of full `shape` along `dim`. The full tensor is `parts` equal
    blocks along dim (QKV's rows: [q | k | v], parts=3), each cut into n; rank r holds the r-th
    cut of every block, one after the other ([q_r | k_r | v_r]: whole heads)."""
    per = shape[dim] // (parts * n)
    out = []
    for j in range(parts):
        local = tuple(j * per if d == dim else 0 for d in range(len(shape)))
        off = tuple((j * n + r) * per if d == dim else 0 for d in range(len(shape)))
        size = tuple(per if d == dim else s for d, s in enumerate(shape))
        out.append(Block(local, Box(off, size)))
    return out


def local_shape(blocks: list[Block]) -> tuple[int, ...]:
    return tuple(max(b.local[d] + b.full.sizes[d] for b in blocks)
                 for d in range(len(blocks[0].local)))


def full_shape(boxes: list[Box]) -> tuple[int, ...]:
    """A full tensor's shape from boxes that together cover it: how far they reach per dimension."""
    return tuple(max(b.offsets[d] + b.sizes[d] for b in boxes) for d in range(len(boxes[0].sizes)))


def flat_boxes(shape: tuple, lo: int, hi: int) -> list[Box]:
    """Boxes of a row-major tensor of `shape` that tile its elements [lo, hi), in order, each
    contiguous (a partial first row, whole rows, a partial last row; recursively)."""
    if hi <= lo:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    a, b = -(-lo // inner), hi // inner  # the whole slabs along dim 0: [a, b)
    rest = len(shape) - 1

    def slab(i, lo_, hi_):  # part of slab i, recursively
        return [Box((i, *x.offsets), (1, *x.sizes)) for x in flat_boxes(shape[1:], lo_, hi_)]
    if a > b:  # inside one slab
        i = lo // inner
        return slab(i, lo - i * inner, hi - i * inner)
    head = slab(a - 1, lo - (a - 1) * inner, inner) if lo < a * inner else []
    body = [Box((a, *(0,) * rest), (b - a, *shape[1:]))] if b > a else []
    tail = slab(b, 0, hi - b * inner) if hi > b * inner else []
    return head + body + tail


# ---------------------------------------------------------------------------------------------
# 2. what a strategy owns: slices of flat buffers, as boxes of named full tensors
# ---------------------------------------------------------------------------------------------
PADDING = ""  # the name of a flat buffer's padding: elements of no tensor


@dataclass(frozen=True)
class Region:
    """Part of a flat piece that is the box `box` of the full tensor `name`: the piece's elements
    [start, start + run.numel) are the contiguous box `run` of the local tensor, and its box
    `local` (inside run) is that box of the full tensor. Padding: name PADDING, box its elements
    of the slice, no run."""
    name: str
    box: Box
    start: int = 0
    run: Box | None = None
    local: Box | None = None


def regions(name: str, blocks: list[Block], lo: int, hi: int) -> list[Region]:
    """Elements [lo, hi) of a local tensor (flattened) as boxes of its full tensor: at most a few
    contiguous runs (flat_boxes), each cut by the blocks it overlaps (QKV under TP: three)."""
    shape = local_shape(blocks)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = []
    for run in flat_boxes(shape, lo, hi):
        start = sum(o * s for o, s in zip(run.offsets, strides)) - lo
        for b in blocks:
            hit = run.intersect(Box(b.local, b.full.sizes))
            if hit is not None:
                full = tuple(f + h - l for f, h, l in zip(b.full.offsets, hit.offsets, b.local))
                out.append(Region(name, Box(full, hit.sizes), start, run, hit))
    return out


def flat_layout(numels: list[int], n: int) -> tuple[list[tuple[int, int]], int]:
    """Where each of `numels` sits in a flat buffer padded to a multiple of n: ([(a, b)], padded)."""
    offsets, off = [], 0
    for k in numels:
        offsets.append((off, off + k))
        off += k
    return offsets, -(-off // n) * n


def flat_pieces(numels: list[int], n: int, r: int) -> list[tuple[int | None, int, int]]:
    """Slice r of n of the flat buffer, cut at tensor boundaries: (i, lo, hi), offsets into the
    slice [k = padded/n], i the index of the tensor, None for the padding at the end."""
    offsets, padded = flat_layout(numels, n)
    k, numel = padded // n, sum(numels)
    start, end = r * k, (r + 1) * k
    out = [(i, max(a, start) - start, min(b, end) - start)
           for i, (a, b) in enumerate(offsets) if max(a, start) < min(b, end)]
    if max(numel, start) < end:
        out.append((None, max(numel, start) - start, end - start))
    return out


def flat_owned(held: list[tuple[str, list[Block]]], n: int, r: int) -> list[list[Region]]:
    """What rank r of n owns of a flat buffer of the tensors `held` (name, their blocks), in
    order: per piece of its slice (flat_pieces), the regions of full tensors it is; the padding
    piece is one Region named PADDING whose box is its elements of the slice."""
    numels = [math.prod(local_shape(b)) for _, b in held]
    offsets, padded = flat_layout(numels, n)
    start = r * (padded // n)
    out = []
    for i, lo, hi in flat_pieces(numels, n, r):
        if i is None:
            out.append([Region(PADDING, Box((lo,), (hi - lo,)))])
            continue
        name, blocks = held[i]
        a = offsets[i][0]
        out.append(regions(name, blocks, start + lo - a, start + hi - a))
    return out


# ---------------------------------------------------------------------------------------------
# 3. the tiny GPT's placement from its config alone (model.py, tensor.py, expert.py, zero3.py)
# ---------------------------------------------------------------------------------------------
def gpt_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter of model.GPT, by name, with its full shape, in registration order."""
    v, s, h, E = cfg.vocab, cfg.seq, cfg.d_model, getattr(cfg, "experts", 0)
    out = {"embed.tok.weight": (v, h), "embed.pos.weight": (s, h)}
    for i in range(cfg.layers):
        b = f"blocks.{i}."
        out |= {b + "ln1.weight": (h,), b + "ln1.bias": (h,), b + "attn.qkv.weight": (3 * h, h),
                b + "attn.qkv.bias": (3 * h,), b + "attn.proj.weight": (h, h),
                b + "attn.proj.bias": (h,), b + "ln2.weight": (h,), b + "ln2.bias": (h,)}
        if E and (i + 1) % getattr(cfg, "moe_every", 1) == 0:
            out |= {b + "mlp.router.weight": (E, h), b + "mlp.experts.fc_weight": (E, 4 * h, h),
                    b + "mlp.experts.fc_bias": (E, 4 * h), b + "mlp.experts.proj_weight": (E, h, 4 * h),
                    b + "mlp.experts.proj_bias": (E, h)}
        else:
            out |= {b + "mlp.fc.weight": (4 * h, h), b + "mlp.fc.bias": (4 * h,),
                    b + "mlp.proj.weight": (h, 4 * h), b + "mlp.proj.bias": (h,)}
    return out | {"head.norm.weight": (h,), "head.norm.bias": (h,), "head.out.weight": (v, h)}


# tensor parallel's cuts (apply_tensor_parallel): name suffix -> (dim, parts); the rest is whole
TP_CUTS = {"embed.tok.weight": (0, 1), "attn.qkv.weight": (0, 3), "attn.qkv.bias": (0, 3),
           "attn.proj.weight": (1, 1), "mlp.fc.weight": (0, 1), "mlp.fc.bias": (0, 1),
           "mlp.proj.weight": (1, 1), "head.out.weight": (0, 1)}


def gpt_held(cfg, tp: tuple[int, int] = (1, 0), ep: tuple[int, int] = (1, 0),
             blocks=None) -> dict[str, list[Block]]:
    """What one rank holds of every tensor: tp = (degree, its tp rank), ep likewise, `blocks` the
    blocks its pipeline stage keeps (None: all, with the embedding and the head; else a pair
    (block indices, (holds the embedding, holds the head)))."""
    out = {}
    for name, shape in gpt_tensors(cfg).items():
        if blocks is not None and not _on_stage(name, *blocks):
            continue
        cut = next((c for suffix, c in TP_CUTS.items() if name.endswith(suffix)), None)
        if ".experts." in name and ep[0] > 1:
            out[name] = split(shape, 0, *ep)
        elif cut is not None and tp[0] > 1:
            out[name] = split(shape, cut[0], *tp, parts=cut[1])
        else:
            out[name] = whole(shape)
    return out


def stage_blocks(owner: list[int], layers: int, stage: int,
                 stages: int | None = None) -> tuple[set[int], tuple[bool, bool]]:
    """gpt_held's `blocks` for pipeline rank `stage`: the blocks of the chunks it owns (owner[c]:
    the rank of chunk c, each of layers/len(owner) blocks), and whether it holds the embedding
    (chunk 0) and the head (the last chunk) (pipeline.partition). `stages`: the model's stages
    when fewer than the chunks (DualPipe: chunk c is a copy of stage c % stages)."""
    n = stages or len(owner)
    per = layers // n
    chunks = {c % n for c in range(len(owner)) if owner[c] == stage}
    return {i for c in chunks for i in range(c * per, (c + 1) * per)}, (0 in chunks, n - 1 in chunks)


def _on_stage(name: str, indices, ends) -> bool:
    if name.startswith("blocks."):
        return int(name.split(".")[1]) in indices
    return ends[0] if name.startswith("embed.") else ends[1]


def unit_of(name: str, experts_apart: bool = False) -> str:
    """ZeRO-3's unit (zero3.plan_units on the GPT): the embedding, each block, the head; with
    expert parallel each layer's experts apart ('blocks.3.mlp.experts')."""
    parts = name.split(".")
    if experts_apart and ".experts." in name:
        return ".".join(parts[:4])
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def gpt_units(held: dict[str, list[Block]], experts_apart: bool = False
              ) -> list[tuple[str, list[str]]]:
    """[(unit, its tensors)] in zero3.plan_units' order: the top-level children (each block),
    then the units apart."""
    units: dict[str, list[str]] = {}
    for name in held:
        units.setdefault(unit_of(name, experts_apart), []).append(name)
    order = sorted(units, key=lambda u: ".experts" in u)  # stable: apart ones last
    return [(u, units[u]) for u in order]


def held_numel(blocks: list[Block]) -> int:
    """Elements a rank holds of one tensor."""
    return sum(b.full.numel for b in blocks)


# ---------------------------------------------------------------------------------------------
# 4. a live model: each module says what it holds
# ---------------------------------------------------------------------------------------------
def held_by(model) -> dict:
    """{local parameter: (its full tensor's name, [Block])}. A parallel module says which part of
    each of its parameters it holds (`placement(p_name)`: tensor.py's layers, expert.py's
    ShardedExperts); any other module holds its parameters whole."""
    out = {}
    for mod_name, m in model.named_modules():
        cut = getattr(m, "placement", None)
        for p_name, p in m.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            out[p] = (name, cut(p_name) if cut is not None else whole(tuple(p.shape)))
    return out


# ---------------------------------------------------------------------------------------------
# 5. what every rank owns, from the config alone (what the live strategies' `owned` list)
# ---------------------------------------------------------------------------------------------
def rank_held(cfg, rank: int) -> dict[str, list[Block]]:
    """gpt_held for `rank` of cfg's mesh: its tp and ep coordinates and its pipeline stage."""
    members = rank_groups(cfg, rank)
    blocks = None
    if cfg.pp > 1:
        from .parallel.schedules import chunk_owner, directions, virtual_stages  # pure Python
        owner = chunk_owner(cfg.schedule, cfg.pp, virtual_stages(cfg.schedule, cfg.virtual_stages))
        blocks = stage_blocks(owner, cfg.layers, members["pp"].index(rank),
                              len(owner) // directions(cfg.schedule))
    ep = _size_rank(members, "expert", rank) if getattr(cfg, "ep", 1) > 1 else (1, 0)
    return gpt_held(cfg, _size_rank(members, "tp", rank), ep, blocks)


def owned_by_rank(cfg, rank: int) -> list[list[Region]]:
    """The regions of each piece `rank` owns, in the order its strategy lists them: plain data
    parallel every tensor it holds, whole; ZeRO-1/2 its slice of one flat buffer; ZeRO-3 its slice
    of each unit's. With expert parallel the experts go apart, over the expert_shard ranks: a
    second flat buffer (ZeRO-1/2, engine's ExpertAndDense) or units of their own (ZeRO-3)."""
    held, members = rank_held(cfg, rank), rank_groups(cfg, rank)
    apart = getattr(cfg, "ep", 1) > 1
    shard = _size_rank(members, "shard", rank)
    expert_shard = _size_rank(members, "expert_shard", rank) if apart else shard
    if cfg.zero == 3:
        return [piece for unit, names in gpt_units(held, apart)
                for piece in flat_owned([(n, held[n]) for n in names],
                                        *(expert_shard if ".experts" in unit else shard))]
    groups = [[n for n in held if not (apart and ".experts." in n)],
              [n for n in held if apart and ".experts." in n]]
    out = []
    for names, (n, r) in zip(groups, (shard, expert_shard)):
        if cfg.zero == 0:
            out += [regions(name, held[name], 0, math.prod(local_shape(held[name])))
                    for name in names]
        elif names:
            out += flat_owned([(name, held[name]) for name in names], n, r)
    return out


def rank_groups(cfg, rank: int) -> dict[str, list[int]]:
    """{axis: the ranks of rank's group along it} (mesh.py's grid arithmetic, no process group)."""
    from .mesh import plan_groups
    return {axis: next(g for g in groups if rank in g) for axis, groups in plan_groups(cfg).items()}


def _size_rank(members: dict, role: str, rank: int) -> tuple[int, int]:
    """(size, rank's index) of the group playing `role` ("tp" is its own role)."""
    from .mesh import plainest
    group = members["tp"] if role == "tp" else members[plainest(role, members)]
    return len(group), group.index(rank)
