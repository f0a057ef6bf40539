"""ZeRO stage 3 (FSDP's FULL_SHARD): the parameters are sharded too (Rajbhandari et al., SC 2020).

Between uses, rank r keeps only slice r of every layer's weights: 1/N of the parameters, of the
gradients and of the optimizer states, 16P/N bytes with mixed-precision Adam. A layer's weights
exist in full only while it computes:
    forward:  all-gather the unit's slices -> full weights -> compute -> free
    backward: all-gather again -> compute gradients -> reduce-scatter them -> free
Per step that is all-gather (Psi) + all-gather (Psi) + reduce-scatter (Psi): 3 Psi on the wire, 1.5x
what data parallel moves, in exchange for memory that falls as 1/N.

Units: the model's top-level modules (each embedding, each transformer block, the final norm, the
head) are gathered and freed as one flat buffer each. Freeing uses `storage.resize_(0)`, as FSDP's
first version did: the parameters and autograd's saved references keep pointing at the same storage,
which is given its bytes back (and refilled) when the unit is gathered for backward.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..comm import Comm
from ..optim import make_optimizer
from .data import AXIS
from .zero import FlatLayout


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Top-level children with parameters; a ModuleList (the blocks) contributes each member."""
    units = []
    for child in model.children():
        members = list(child) if isinstance(child, torch.nn.ModuleList) else [child]
        units += [m for m in members if any(p.requires_grad for p in m.parameters())]
    return units


class Unit:
    """One module's trainable parameters as a sharded flat buffer."""

    def __init__(self, module, n, r, param_dtype, mixed):
        self.module, self.n, self.r = module, n, r
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.layout = FlatLayout(self.params, n)
        device = self.params[0].device
        self.full = torch.zeros(self.layout.padded, dtype=param_dtype, device=device)  # [padded]
        for p, view in zip(self.params, self.layout.views(self.full)):
            view.copy_(p.data)
            p.data = view
        self.shard = self.layout.shard(self.full, r).clone()  # [k], persistent
        self.master = self.shard.float() if mixed else self.shard  # fp32 copy when mixed
        self.grad_shard: torch.Tensor | None = None  # [k], accumulated over micro-steps
        self.ready: set = set()
        self.gathered = True
        self.free()

    def free(self) -> None:
        if self.gathered:
            self.full.untyped_storage().resize_(0)  # bytes released; views stay attached
            self.gathered = False

    def gather(self, comm: Comm, axis: str) -> None:
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.layout.padded * self.full.element_size())
        comm.all_gather(self.full, self.shard, axis)  # n x [k] -> [padded]
        self.gathered = True


class Zero3DataParallel:
    """ZeRO-3 over the dp axis; owns the optimizer. Same loop interface as ZeroDataParallel."""

    def __init__(self, model: torch.nn.Module, comm: Comm, optimizer: str = "adam",
                 lr: float = 3e-3, param_dtype: torch.dtype = torch.float32,
                 shard_axis: str = AXIS, replicate_axis: str | None = None):
        """HYBRID_SHARD: shard over `shard_axis`, all-reduce the reduced slices over
        `replicate_axis` (see ZeroDataParallel)."""
        self.model, self.comm = model, comm
        self.shard_axis, self.replicate_axis = shard_axis, replicate_axis
        self.n, self.r = comm.size(shard_axis), comm.rank(shard_axis)
        self.dp = comm.size(AXIS)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full layers alive at once, and the max
        self.mixed = param_dtype != torch.float32
        if self.dp > 1:  # every rank starts from rank 0's weights, as in data parallel
            step, comm.step = comm.step, -1
            for p in model.parameters():
                comm.broadcast(p.data, AXIS, src=0)
            comm.step = step
        self.units = [Unit(m, self.n, self.r, param_dtype, self.mixed) for m in shard_units(model)]
        covered = {id(p) for u in self.units for p in u.params}
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
        if missing:
            raise ValueError(f"ZeRO-3 units do not cover parameters {missing}")
        self._unit_of = {p: u for u in self.units for p in u.params}
        for u in self.units:
            u.module.register_forward_pre_hook(lambda mod, args, u=u: self._gather(u))
            u.module.register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.optimizer = make_optimizer(optimizer, [u.master for u in self.units], lr)

    # -- hooks ------------------------------------------------------------------------------------
    def _gather(self, unit: Unit) -> None:
        if not unit.gathered:
            unit.gather(self.comm, self.shard_axis)
            self.gathered_bytes += unit.full.untyped_storage().nbytes()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            self.gathered_bytes -= unit.full.untyped_storage().nbytes()
            unit.free()

    def _after_forward(self, unit: Unit, out: torch.Tensor) -> None:
        self._free(unit)
        if out.requires_grad:  # when the gradient reaches this unit's output, gather for backward
            out.register_hook(lambda grad: self._gather(unit))

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        unit = self._unit_of[p]
        unit.ready.add(p)
        if len(unit.ready) < len(unit.params):
            return
        flat_grad = torch.zeros(unit.layout.padded, dtype=p.grad.dtype, device=p.grad.device)
        for q, view in zip(unit.params, unit.layout.views(flat_grad)):
            view.copy_(q.grad)
            q.grad = None  # the full gradient is not kept: only my reduced slice is
        piece = torch.empty(unit.layout.shard_numel, dtype=flat_grad.dtype, device=flat_grad.device)
        self.comm.reduce_scatter(piece, flat_grad, self.shard_axis)  # [padded] -> [k], summed
        if self.replicate_axis:  # HYBRID_SHARD: sum the same slice across replicas
            self.comm.all_reduce(piece, self.replicate_axis)
        piece /= self.dp
        unit.grad_shard = piece if unit.grad_shard is None else unit.grad_shard.add_(piece)
        unit.ready.clear()
        self._free(unit)

    # -- the training-loop interface ------------------------------------------------------------
    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard = None

    @contextmanager
    def sync(self, enabled: bool = True):
        yield  # every micro-step reduce-scatters (as FSDP does by default): nothing to defer

    def finish_gradient_sync(self) -> None:
        for u in self.units:
            if u.grad_shard is None:
                raise RuntimeError(f"ZeRO-3 unit {type(u.module).__name__} got no gradient this step")

    def step(self) -> None:
        for u in self.units:
            u.master.grad = u.grad_shard.float() if self.mixed else u.grad_shard
        self.optimizer.step()
        for u in self.units:
            u.master.grad = None
            if self.mixed:
                u.shard.copy_(u.master)

    # -- measurement and comparison -------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        opt = [t for st in self.optimizer.state.values() for t in st.values()]
        if self.mixed:
            opt += [u.master for u in self.units]
        return {"params": [u.shard for u in self.units],
                "grads": [u.grad_shard for u in self.units if u.grad_shard is not None],
                "optimizer": opt}

    def buffers(self) -> list[torch.Tensor]:
        return []

    def transient_bytes(self) -> int:
        """The most gathered (full) units alive at once, in bytes."""
        return self.peak_gathered_bytes

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full (collective: all ranks call it), e.g. to compare with the reference."""
        out = {}
        for u in self.units:
            u.gather(self.comm, self.shard_axis)
            for p in u.params:
                out[id(p)] = p.detach().clone()
            u.free()
        return {name: out[id(p)] for name, p in self.model.named_parameters() if id(p) in out}
