"""The rank grid: one world of ranks laid out as pp x dp x cp x ep x tp, tp innermost.

Why that order: neighbouring ranks share a node, and tensor parallel (an all-reduce per layer) needs
the fastest links, so tp varies fastest; pipeline stages (point-to-point only) vary slowest
(Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters").

Each axis gets one process group per line of the grid: ranks that differ only in that coordinate.
Groups are created once, here, by every rank in the same order (new_group is collective) and the
Mesh is passed explicitly to whoever communicates: no global singleton.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

AXES = ("pp", "dp", "cp", "ep", "tp")


@dataclass
class Mesh:
    shape: dict[str, int]  # axis -> degree
    rank: int
    groups: dict[str, object] = field(default_factory=dict)  # axis -> ProcessGroup (None: size 1)
    members: dict[str, list[int]] = field(default_factory=dict)  # axis -> global ranks, in order
    extra_coords: dict[str, int] = field(default_factory=dict)  # derived axes (dp_shard, dp_rep)

    @property
    def world_size(self) -> int:
        n = 1  # the product of the grid's axes (derived axes only re-slice dp)
        for a in AXES:
            n *= self.shape[a]
        return n

    @property
    def coords(self) -> dict[str, int]:
        return coords_of(self.rank, {a: self.shape[a] for a in AXES})

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def local_rank(self, axis: str) -> int:
        if axis in self.extra_coords:
            return self.extra_coords[axis]
        return self.coords[axis]

    def global_rank(self, axis: str, local: int) -> int:
        return self.members[axis][local]


def coords_of(rank: int, shape: dict[str, int]) -> dict[str, int]:
    coords = {}
    for axis in reversed(AXES):  # tp varies fastest
        coords[axis] = rank % shape[axis]
        rank //= shape[axis]
    return {a: coords[a] for a in AXES}


def rank_of(coords: dict[str, int], shape: dict[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * shape[axis] + coords[axis]
    return rank


def lines(axis: str, shape: dict[str, int]) -> list[list[int]]:
    """All groups along `axis`: for every setting of the other coordinates, the ranks along it."""
    others = [a for a in AXES if a != axis]
    out = []
    for fixed in itertools.product(*(range(shape[a]) for a in others)):
        base = dict(zip(others, fixed))
        out.append([rank_of({**base, axis: i}, shape) for i in range(shape[axis])])
    return out


def split_dp(mesh: Mesh, shard: int) -> None:
    """HYBRID_SHARD's 2-D data parallel: the dp axis seen as dp_rep x dp_shard (shard innermost).
    ZeRO shards over `dp_shard` (ranks close together, fast links) and replicates over `dp_rep`.
    Collective, like build_mesh: every rank calls it with the same `shard`."""
    dp, world = mesh.size("dp"), mesh.world_size
    reps = dp // shard
    for line in lines("dp", mesh.shape):  # each dp group, as global ranks in dp order
        shard_groups = [line[i * shard:(i + 1) * shard] for i in range(reps)]
        rep_groups = [line[j::shard] for j in range(shard)]
        for axis, groups in (("dp_shard", shard_groups), ("dp_rep", rep_groups)):
            for ranks in groups:
                size = len(ranks)
                group = dist.group.WORLD if size == world else None if size == 1 else dist.new_group(ranks)
                if mesh.rank in ranks:
                    mesh.groups[axis], mesh.members[axis] = group, ranks
    mesh.shape["dp_shard"], mesh.shape["dp_rep"] = shard, reps
    mesh.extra_coords = {"dp_shard": mesh.coords["dp"] % shard, "dp_rep": mesh.coords["dp"] // shard}


def build_mesh(cfg) -> Mesh:
    """Collective: every rank calls it with the same config. Uses the default process group."""
    shape = {a: getattr(cfg, a) for a in AXES}
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != cfg.world_size:
        raise ValueError(f"the config's layout needs {cfg.world_size} ranks "
                         f"(dp*tp*pp*cp*ep) but {world} were launched")
    mesh = Mesh(dict(shape), rank)
    for axis in AXES:
        for ranks in lines(axis, shape):
            if shape[axis] == world:
                group = dist.group.WORLD
            elif shape[axis] == 1:
                group = None  # a group of one needs no communicator
            else:
                group = dist.new_group(ranks)  # collective: all ranks create every group
            if rank in ranks:
                mesh.groups[axis], mesh.members[axis] = group, ranks
    if getattr(cfg, "dp_shard", 0) and cfg.dp_shard < cfg.dp:
        split_dp(mesh, cfg.dp_shard)
    return mesh
