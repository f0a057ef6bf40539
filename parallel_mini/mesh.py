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

    @property
    def world_size(self) -> int:
        n = 1
        for a in AXES:
            n *= self.shape[a]
        return n

    @property
    def coords(self) -> dict[str, int]:
        return coords_of(self.rank, self.shape)

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def local_rank(self, axis: str) -> int:
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


def build_mesh(cfg) -> Mesh:
    """Collective: every rank calls it with the same config. Uses the default process group."""
    shape = {a: getattr(cfg, a) for a in AXES}
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != cfg.world_size:
        raise ValueError(f"the config's layout needs {cfg.world_size} ranks "
                         f"(dp*tp*pp*cp*ep) but {world} were launched")
    mesh = Mesh(shape, rank)
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
    return mesh
