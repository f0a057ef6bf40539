"""The rank grid: named axes, and the combined axes strategies communicate over.

The world is laid out as a grid pp x dp_rep x dp_shard x cp x tp, tp varying fastest (torchtitan's
ParallelDims order). Why that order: neighbouring ranks share a node, and tensor parallel (an
all-reduce per layer) needs the fastest links, so tp is innermost; pipeline stages (point-to-point
only) are outermost (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters"). world = dp x tp x pp x cp, with dp = dp_rep x dp_shard (dp_rep > 1 only for
FSDP's HYBRID_SHARD: shard inside groups of dp_shard ranks, replicate across them).

Strategies do not talk over grid axes alone; they talk over *combined* axes, each the ranks that
differ only in a set of grid coordinates:
    dp     = dp_rep x dp_shard        the batch is split over it (data parallel)
    dp_cp  = dp x cp                  the loss is a mean over it (every token of the step)
    shard  = dp_shard x cp            ZeRO / FSDP shard their states over it
    ep     = a slice of dp x cp       expert parallel: experts sharded over ep ranks
    edp    = (dp x cp) / ep           an expert's replicas: its gradients are averaged over it
A combined axis whose ranks equal a simpler axis's is that axis (same process group, same name in
the comm records): `Mesh.axis_for(role)` names the plainest one.

Each axis gets one process group per line of the grid. Groups are created once, here, by every rank
in the same order (new_group is collective); the Mesh is passed explicitly to whoever
communicates: no global singleton.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

GRID = ("pp", "dp_rep", "dp_shard", "cp", "tp")  # outermost first
COMBINED = {"dp": ("dp_rep", "dp_shard"), "dp_cp": ("dp_rep", "dp_shard", "cp"),
            "shard": ("dp_shard", "cp")}
REPORTED = ("dp", "tp", "pp", "cp", "ep")  # a rank's coordinates in the run report


@dataclass
class Mesh:
    shape: dict[str, int]  # axis (grid, combined or carved) -> degree
    rank: int
    groups: dict[str, object] = field(default_factory=dict)  # axis -> ProcessGroup (None: size 1)
    members: dict[str, list[int]] = field(default_factory=dict)  # axis -> global ranks, in order

    @property
    def world_size(self) -> int:
        n = 1
        for a in GRID:
            n *= self.shape[a]
        return n

    @property
    def coords(self) -> dict[str, int]:
        """This rank's place on the reported axes ({dp, tp, pp, cp, ep})."""
        return {a: self.local_rank(a) for a in REPORTED}

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def local_rank(self, axis: str) -> int:
        """This rank's index along `axis` (its position among the axis group's members)."""
        return self.members[axis].index(self.rank)

    def global_rank(self, axis: str, local: int) -> int:
        return self.members[axis][local]

    def axis_for(self, role: str) -> str | None:
        """The plainest axis name with the ranks of a role: "batch", "loss", "shard", "replicate"
        (None when nothing is replicated), "expert", "expert_dp"."""
        plain = {"batch": "dp", "loss": "dp_cp", "shard": "shard", "replicate": "dp_rep",
                 "expert": "ep", "expert_dp": "edp"}[role]
        if role == "replicate" and self.shape["dp_rep"] == 1:
            return None
        for simpler in ("dp", "dp_shard", "dp_rep", "cp"):  # same ranks, a name the reader knows
            if simpler != plain and self.members.get(simpler) == self.members[plain]:
                return simpler
        return plain


def grid_shape(cfg) -> dict[str, int]:
    shard = cfg.dp_shard if 0 < getattr(cfg, "dp_shard", 0) < cfg.dp else cfg.dp
    return {"pp": cfg.pp, "dp_rep": cfg.dp // shard, "dp_shard": shard, "cp": cfg.cp, "tp": cfg.tp}


def coords_of(rank: int, shape: dict[str, int]) -> dict[str, int]:
    coords = {}
    for axis in reversed(GRID):  # tp varies fastest
        coords[axis] = rank % shape[axis]
        rank //= shape[axis]
    return {a: coords[a] for a in GRID}


def rank_of(coords: dict[str, int], shape: dict[str, int]) -> int:
    rank = 0
    for axis in GRID:
        rank = rank * shape[axis] + coords[axis]
    return rank


def lines(axes: tuple[str, ...], shape: dict[str, int]) -> list[list[int]]:
    """All groups along the grid axes `axes`: for every setting of the other coordinates, the ranks
    that differ only in `axes`, ordered with the last axis fastest."""
    others = [a for a in GRID if a not in axes]
    out = []
    for fixed in itertools.product(*(range(shape[a]) for a in others)):
        base = dict(zip(others, fixed))
        out.append([rank_of({**base, **dict(zip(axes, idx))}, shape)
                    for idx in itertools.product(*(range(shape[a]) for a in axes))])
    return out


def carve_experts(loss_lines: list[list[int]], ep: int) -> dict[str, list[list[int]]]:
    """Expert parallel carved out of the dp x cp ranks (as Megatron-LM and torchtitan do): each
    loss line splits into consecutive blocks of ep ranks (ep groups); ranks at the same place in
    those blocks replicate the same experts (edp groups)."""
    ep_groups, edp_groups = [], []
    for line in loss_lines:
        blocks = [line[i:i + ep] for i in range(0, len(line), ep)]
        ep_groups += blocks
        edp_groups += [list(g) for g in zip(*blocks)]
    return {"ep": ep_groups, "edp": edp_groups}


def _add_axis(mesh: Mesh, axis: str, groups: list[list[int]], made: dict) -> None:
    """Record `axis` and make its process groups (every rank, every group, in the same order).
    Rank sets that already have a group share it: combined axes often equal a grid axis."""
    world = mesh.world_size
    for ranks in groups:
        key = tuple(ranks)
        if key not in made:
            size = len(ranks)
            made[key] = dist.group.WORLD if size == world else None if size == 1 else dist.new_group(ranks)
        if mesh.rank in ranks:
            mesh.groups[axis], mesh.members[axis] = made[key], list(ranks)
    mesh.shape[axis] = len(groups[0])


def build_mesh(cfg) -> Mesh:
    """Collective: every rank calls it with the same config. Uses the default process group."""
    shape = grid_shape(cfg)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != cfg.world_size:
        raise ValueError(f"the config's layout needs {cfg.world_size} ranks "
                         f"(dp*tp*pp*cp) but {world} were launched")
    mesh = Mesh(dict(shape), rank)
    made: dict[tuple, object] = {}
    for axis in GRID:
        _add_axis(mesh, axis, lines((axis,), shape), made)
    for axis, parts in COMBINED.items():
        _add_axis(mesh, axis, lines(parts, shape), made)
    ep = getattr(cfg, "ep", 1)
    for axis, groups in carve_experts(lines(COMBINED["dp_cp"], shape), ep).items():
        _add_axis(mesh, axis, groups, made)
    return mesh
