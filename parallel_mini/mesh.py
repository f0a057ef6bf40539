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
    edp_shard, edp_rep                HYBRID_SHARD's two dimensions of edp, for the experts' ZeRO
A combined axis whose ranks equal a simpler axis's is that axis (same process group, same name in
the comm records): `Mesh.axis_for(role)` names the plainest one.

Each axis gets one process group per line of the grid. Groups are created once, here, by every rank
in the same order (new_group is collective); the Mesh is passed explicitly to whoever
communicates: no global singleton.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

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
        (None when nothing is replicated), "expert", "expert_dp", "expert_shard",
        "expert_replicate" (None when no expert is replicated)."""
        return plainest(role, self.members)


ROLES = {"batch": "dp", "loss": "dp_cp", "shard": "shard", "replicate": "dp_rep", "expert": "ep",
         "expert_dp": "edp", "expert_shard": "edp_shard", "expert_replicate": "edp_rep"}


def plainest(role: str, members: dict[str, list[int]]) -> str | None:
    """The name of `role`'s axis for a rank whose groups are `members` (axis -> its ranks)."""
    plain = ROLES[role]
    if role in ("replicate", "expert_replicate") and len(members[plain]) == 1:
        return None
    if role in ("expert_shard", "expert_replicate"):
        if members[plain] == members["edp"]:
            return plainest("expert_dp", members)  # all of edp: the same group, the same name
        if len(members[plain]) == 1:
            return plain  # one rank: no grid axis's name (they would only match by being one)
    for name in ("dp", "dp_shard", "dp_rep", "cp"):  # same ranks, a name the reader knows
        if name != plain and members.get(name) == members[plain]:
            return name
    return plain


def role_names(cfg) -> dict[str, str | None]:
    """Every role's axis name, as Mesh.axis_for gives it on a rank of `cfg`'s mesh (the same on
    every rank: the grid is regular), without a process group: theory labels its bytes with it."""
    members = {axis: groups[0] for axis, groups in plan_groups(cfg).items()}  # rank 0's
    return {role: plainest(role, members) for role in ROLES}


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


def split_expert_replicas(edp_groups: list[list[int]], shape: dict[str, int]
                          ) -> dict[str, list[list[int]]]:
    """HYBRID_SHARD's two dimensions for the experts' ZeRO: each edp group (an expert's replicas)
    splits into edp_shard, its ranks in the same replica of the dense model (same dp_rep: they
    shard the expert's states), and edp_rep, its ranks at the same place in every replica (same
    dp_shard and cp: they all-reduce the reduced slices). Why this split (torchtitan's
    dp_replicate x efsdp): sharding stays inside a shard group, as HYBRID_SHARD means (a node's
    fast links), and only reduced slices cross replicas. Without hybrid sharding edp_shard is
    edp. Their sizes multiply to edp's when an ep group lies inside one shard group or spans
    whole ones (config.py refuses the rest)."""
    shard, rep = [], []
    for group in edp_groups:
        by_replica: dict[int, list[int]] = {}
        by_place: dict[tuple, list[int]] = {}
        for r in group:
            c = coords_of(r, shape)
            by_replica.setdefault(c["dp_rep"], []).append(r)
            by_place.setdefault((c["dp_shard"], c["cp"]), []).append(r)
        if len(by_replica) * len(by_place) != len(group):  # (RunConfig.validate says it first)
            raise ValueError(f"expert replicas {group} form no shard x replicate grid: ep must "
                             f"divide dp_shard x cp or be a multiple of it")
        shard += by_replica.values()
        rep += by_place.values()
    return {"edp_shard": shard, "edp_rep": rep}


def plan_groups(cfg) -> dict[str, list[list[int]]]:
    """Every axis's groups (global ranks), pure arithmetic on the grid: no process group."""
    shape = grid_shape(cfg)
    groups = {axis: lines((axis,), shape) for axis in GRID}
    groups.update({axis: lines(parts, shape) for axis, parts in COMBINED.items()})
    groups.update(carve_experts(groups["dp_cp"], getattr(cfg, "ep", 1)))
    groups.update(split_expert_replicas(groups["edp"], shape))
    return groups


def _add_axis(mesh: Mesh, axis: str, groups: list[list[int]], made: dict) -> None:
    """Record `axis` and make its process groups (every rank, every group, in the same order).
    Rank sets that already have a group share it: combined axes often equal a grid axis."""
    import torch.distributed as dist  # (here: the grid arithmetic above is theory's too, torch-free)
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
    import torch.distributed as dist
    shape = grid_shape(cfg)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != cfg.world_size:
        raise ValueError(f"the config's layout needs {cfg.world_size} ranks "
                         f"(dp*tp*pp*cp) but {world} were launched")
    mesh = Mesh(dict(shape), rank)
    made: dict[tuple, object] = {}
    for axis, groups in plan_groups(cfg).items():  # grid axes, combined, expert axes: in order
        _add_axis(mesh, axis, groups, made)
    return mesh


def rank_device():
    """Where this rank's tensors live: its GPU under NCCL, else the CPU (a torch.device)."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
