"""ZeRO: data parallel without N copies of the model states (Rajbhandari et al., SC 2020).

Plain data parallelism keeps everything on every rank: parameters, gradients and optimizer states,
16 bytes per parameter with mixed-precision Adam. But each rank only *needs* to update 1/N of them.
- Stage 1 shards the optimizer states. Gradients are reduce-scattered (rank r receives the averaged
  gradient of its slice only), rank r steps its slice, an all-gather hands every rank the updated
  whole. Reduce-scatter + all-gather move exactly what one all-reduce moves: 2(N-1)/N * Psi.
- Stage 2 also keeps only its slice of the gradients once they are reduced.
- Stage 3 also shards the parameters (see zero3.py): gathered layer by layer when needed.

Layout: the trainable parameters live in one flat buffer padded to a multiple of N (at most N-1
extra elements, reported); rank r owns elements [r*k, (r+1)*k) with k = padded / N. Parameters and
gradients are *views* into flat buffers, so backward accumulates straight into the buffer that is
reduce-scattered: no packing copies.

Mixed precision (Micikevicius et al., 2018): with bf16 compute, parameters and gradients are bf16,
and each rank keeps an fp32 master copy of its slice next to Adam's two fp32 moments: 2 + 2 + 12/N
bytes per parameter at stage 1, 2 + (2 + 12)/N at stage 2 (16 = 2 + 2 + 4 + 4 + 4 unsharded).

Any module DDP accepts: tied weights are one parameter (model.parameters() lists it once), frozen
ones (requires_grad=False) stay out of the flat buffer and never communicate. The optimizer steps
my slice cut at parameter boundaries, one piece per parameter (as FSDP2's per-parameter shards),
so that with `find_unused_parameters=True` a parameter that no rank used this step is skipped
exactly as torch's Adam skips a parameter whose .grad is None in one process: no update, no
moment decay, no step count (DDP's semantics, see data.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..comm import Comm
from ..interfaces import GradientStrategy, Held, Piece
from ..optim import make_optimizer
from ..placement import flat_layout, flat_owned, flat_pieces, regions
from .data import broadcast_parameters
from .offload_disk import DiskMethods, DiskOptimizer


def refuse_unsupported(model: torch.nn.Module, who: str) -> None:
    """What a flat buffer of one dtype on one device cannot hold, refused before the first step
    (one line naming the fix) rather than failing, or silently differing, inside one."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"{who}: the model has no trainable parameters (requires_grad=True)")
    for name, m in model.named_modules():
        if getattr(m, "sparse", False):
            raise ValueError(f"{who}: {name or 'the model'} ({type(m).__name__}) has sparse "
                             f"gradients, which a flat gradient buffer cannot hold: sparse=False")
    if any(p.is_complex() for p in trainable):
        raise ValueError(f"{who}: complex parameters are not supported (flat real buffer): "
                         f"store them as real pairs (torch.view_as_real)")
    if len({p.device for p in trainable}) > 1:
        raise ValueError(f"{who}: the trainable parameters are on several devices "
                         f"{sorted(str(d) for d in {p.device for p in trainable})}: move the "
                         f"model to one device first")


class FlatLayout:
    """Where each parameter sits in a flat buffer of `padded` elements split into n shards (the
    arithmetic is placement.flat_layout's: the same one checkpoints and theory read)."""

    def __init__(self, params: list[torch.Tensor], n: int):
        self.params, self.n = params, n
        self.offsets, self.padded = flat_layout([p.numel() for p in params], n)
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = self.padded // n

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b].view(p.shape) for p, (a, b) in zip(self.params, self.offsets)]

    def shard(self, flat: torch.Tensor, r: int) -> torch.Tensor:
        return flat[r * self.shard_numel:(r + 1) * self.shard_numel]  # [k], a view

    def pieces(self, r: int) -> list[tuple[int | None, int, int]]:
        """Slice r cut at parameter boundaries: (i, lo, hi), offsets into the slice [k], i the
        index of the parameter the piece belongs to, None for the padding at the end."""
        return flat_pieces([p.numel() for p in self.params], self.n, r)

    def owned(self, held: Held, r: int, optimizer, first: int = 0) -> list[Piece]:
        """Slice r as boxes of the full tensors: one Piece per piece, stepped by
        optimizer.params[first + j] (the padding piece too: its region is named PADDING)."""
        cuts = flat_owned([held[p] for p in self.params], self.n, r)
        return [Piece(cut, optimizer.params[first + j], optimizer, first + j)
                for j, cut in enumerate(cuts)]


def piece_views(slice_: torch.Tensor, pieces) -> list[torch.Tensor]:
    """What the optimizer steps: one view of `slice_` [k] per piece. It updates the slice in place
    and keeps one state per piece (together the same bytes as one state for the whole slice)."""
    return [slice_[lo:hi] for _, lo, hi in pieces]


def piece_grads(pieces, params, grad: torch.Tensor, skip) -> list[torch.Tensor | None]:
    """Each piece's gradient, a view of `grad` [k]; None for a piece of a parameter in `skip`
    (the padding piece always has one: zeros, so it stays zero)."""
    return [None if i is not None and params[i] in skip else grad[lo:hi] for i, lo, hi in pieces]


def step_with(optimizer, grads: list[torch.Tensor | None]) -> None:
    """One optimizer step, each of its tensors given its gradient (None: skipped, as torch's Adam
    skips a parameter without .grad)."""
    for view, g in zip(optimizer.params, grads):
        view.grad = g
    optimizer.step()
    for view in optimizer.params:
        view.grad = None


class UsedParameters:
    """DDP's find_unused_parameters for the sharded strategies: which parameters got a gradient on
    this rank since zero_grad (an autograd hook marks them), then which got one on *any* rank (one
    small all-reduce of a 0/1 map, after the gradients' own collectives so ranks stay paired)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params, self.here = params, set()
        for p in params:
            p.register_post_accumulate_grad_hook(self.here.add)

    def unused_everywhere(self, comm: Comm, axis: str) -> set[torch.nn.Parameter]:
        """The parameters no rank of `axis` used (collective: every rank calls it)."""
        used = torch.tensor([p in self.here for p in self.params], dtype=torch.int32)
        comm.all_reduce(used, axis, kind="unused-map")
        return {p for p, u in zip(self.params, used.tolist()) if not u}


class ZeroDataParallel(DiskMethods, GradientStrategy):  # disk: its window, report, close
    """ZeRO stage 1 or 2 over the mesh's dp axis; owns the optimizer.

    Use:  zero = ZeroDataParallel(model, comm, stage=2, optimizer="adam", lr=3e-3)
          zero.zero_grad(); loss.backward(); zero.finish_gradient_sync(); zero.step()
    """

    def __init__(self, model: torch.nn.Module, comm: Comm, stage: int, optimizer: str = "adam",
                 lr: float = 3e-3, param_dtype: torch.dtype = torch.float32, axis: str = "dp",
                 shard_axis: str = "dp", replicate_axis: str | None = None, offload: bool = False,
                 find_unused_parameters: bool = False, offload_disk: str = ""):
        """`axis`: the data-parallel axis (the batch is split over it, gradients are averaged over
        it). `shard_axis`/`replicate_axis`: HYBRID_SHARD shards over dp_shard and all-reduces the
        reduced slices over dp_rep; the default shards over the whole dp axis.
        `find_unused_parameters` (DDP's): a parameter that gets no gradient on a rank counts as
        zero there, and one that no rank used is not stepped (costs one small all-reduce per step).
        `offload` (ZeRO-Offload, Ren et al., 2021): the fp32 master slice and Adam's moments live
        in host memory and the optimizer steps there; per step the gradient slice crosses to the
        host and the updated parameter slice comes back (PCIe). On a CPU-only machine host and
        device are the same memory: the copies still happen and are counted, the split of bytes
        into device and host is by category.
        `offload_disk` (ZeRO-Infinity: offload_disk.py): a file that holds the fp32 master slice
        and Adam's moments instead of RAM; the step streams them through a small buffer."""
        if stage not in (1, 2):
            raise ValueError(f"stage {stage}: ZeroDataParallel does stages 1 and 2")
        refuse_unsupported(model, f"ZeRO-{stage}")  # before any collective
        self.model, self.comm, self.stage = model, comm, stage
        self.axis, self.shard_axis, self.replicate_axis = axis, shard_axis, replicate_axis
        self.n, self.r = comm.size(shard_axis), comm.rank(shard_axis)
        self.dp = comm.size(axis)  # all replicas x shards: what the gradient is averaged over
        self.mixed = param_dtype != torch.float32
        if self.dp > 1:
            step, comm.step = comm.step, -1  # one-time setup traffic
            broadcast_parameters(model, comm, axis)
            comm.step = step
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied: listed once
        self.layout = FlatLayout(self.params, self.n)
        device = self.params[0].device
        self.flat_params = torch.zeros(self.layout.padded, dtype=param_dtype, device=device)
        for p, view in zip(self.params, self.layout.views(self.flat_params)):
            view.copy_(p.data)
            p.data = view  # the parameter now lives inside the flat buffer
        self.param_shard = self.layout.shard(self.flat_params, self.r)  # [k] view
        # fp32: the optimizer steps the slice in place; bf16: it steps an fp32 master copy
        self.offload = offload
        self.host = torch.device("cpu")
        if offload:  # an fp32 copy of my slice in host memory, whatever the compute precision
            self.master = self.param_shard.detach().to(self.host, torch.float32, copy=True)
        else:  # fp32: step the slice in place; bf16: step an fp32 master copy
            self.master = self.param_shard.float().clone() if self.mixed else self.param_shard
        self.pieces = self.layout.pieces(self.r)  # my slice, cut at parameter boundaries
        if offload_disk:  # the master and moments in a file; the step refreshes the slice
            views = piece_views(self.param_shard, self.pieces)
            self.optimizer = DiskOptimizer(offload_disk, optimizer, lr, initial=views,
                                           params=views, step_of=lambda: comm.step)
            self.master = None
        else:
            self.optimizer = make_optimizer(optimizer, piece_views(self.master, self.pieces), lr)
        self.disk = offload_disk
        self.used = UsedParameters(self.params) if find_unused_parameters else None
        self.unused: set = set()  # parameters no rank used this step: not stepped
        self.flat_grads: torch.Tensor | None = None  # [padded], during backward (stage 2) / always (1)
        self.grad_shard: torch.Tensor | None = None  # [k], kept by stage 2 after the step

    # -- the training-loop interface (same as DataParallel + optimizer) --------------------------
    def zero_grad(self) -> None:
        """Fresh flat gradient buffer; every p.grad a view into it, so backward accumulates there."""
        self.flat_grads = torch.zeros_like(self.flat_params)
        for p, view in zip(self.params, self.layout.views(self.flat_grads)):
            p.grad = view
        self.grad_shard = None
        if self.used is not None:
            self.used.here.clear()

    @contextmanager
    def sync(self, enabled: bool = True):
        yield  # gradients are reduced once, in step(): micro-steps just accumulate in the buffer

    def finish_gradient_sync(self) -> None:
        """Reduce-scatter: rank r receives the dp-average of gradient slice r."""
        grad_shard = torch.empty(self.layout.shard_numel, dtype=self.flat_grads.dtype,
                                 device=self.flat_grads.device)  # [k]
        self.comm.reduce_scatter(grad_shard, self.flat_grads, self.shard_axis)  # [padded] -> [k]
        if self.replicate_axis:  # HYBRID_SHARD: the same slice on every replica, summed across
            self.comm.all_reduce(grad_shard, self.replicate_axis)
        grad_shard /= self.dp
        if self.used is not None:  # zeros where a rank did not use a parameter; skip what none did
            self.unused = self.used.unused_everywhere(self.comm, self.axis)
        if self.stage == 2:  # stage 2 keeps only its slice: the full gradient buffer is released
            for p in self.params:
                p.grad = None
            self.flat_grads = None
        self.grad_shard = grad_shard

    def step(self) -> None:
        """Step my slice, then all-gather every rank's updated slice into the full parameters."""
        if self.offload:
            host_grad = torch.empty(self.grad_shard.shape, dtype=self.grad_shard.dtype,
                                    device=self.host)
            self.comm.transfer(host_grad, self.grad_shard, "d2h")  # gradient slice to the host
            grad = host_grad.float()
        else:
            grad = self.grad_shard.float() if self.mixed else self.grad_shard
        grads = piece_grads(self.pieces, self.params, grad, self.unused)
        if self.disk:  # streamed from the file, window by window; the slice refreshed from it
            self.optimizer.step_grads(grads)
        else:
            step_with(self.optimizer, grads)
        if self.offload:  # updated slice back to the device, in compute precision
            self.comm.transfer(self.param_shard, self.master.to(self.param_shard.dtype), "h2d")
        elif self.mixed and not self.disk:  # (disk: the step refreshed the slice)
            self.param_shard.copy_(self.master)  # fp32 master -> bf16 compute copy
        if self.stage == 1:
            self.grad_shard = None  # stage 1 keeps full gradients, not a reduced slice
        # All-gather into the flat buffer; my own slice is passed as a copy because an input that
        # aliases the output is not allowed by every backend.
        self.comm.all_gather(self.flat_params, self.param_shard.clone(), self.shard_axis)

    # -- measurement ----------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Persistent model states by category, for the memory meter."""
        grads = [self.flat_grads] if self.flat_grads is not None else []
        if self.grad_shard is not None:
            grads.append(self.grad_shard)
        opt = [t for st in self.optimizer.state.values() for t in st.values()]
        if (self.mixed or self.offload) and not self.disk:
            opt.append(self.master)
        if self.offload:
            return {"params": [self.flat_params], "grads": grads, "optimizer": [], "host": opt}
        return {"params": [self.flat_params], "grads": grads, "optimizer": opt}

    # buffers(): --offload-disk's window (DiskMethods); the flat buffers are model states,
    # counted by state_tensors
    def transient_bytes(self) -> int:
        return self.optimizer.buffer.nbytes if self.disk else 0

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def owned(self, held: Held) -> list[Piece]:
        """My slice of the flat buffer (what I step); besides, every parameter whole, a replica
        of what the other ranks own (filled on resume, saved by its owner)."""
        replicas = [Piece(regions(*held[p], 0, p.numel()), p.data.view(-1), saved=False)
                    for p in self.params]
        return self.layout.owned(held, self.r, self.owned_states()) + replicas

    def loaded(self) -> None:
        """--offload-disk: what a checkpoint filled goes back to the file (and the slice)."""
        self.disk_loaded()
