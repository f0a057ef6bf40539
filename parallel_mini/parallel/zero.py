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
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..comm import Comm
from ..optim import make_optimizer
from .data import AXIS, broadcast_parameters


class FlatLayout:
    """Where each parameter sits in a flat buffer of `padded` elements split into n shards."""

    def __init__(self, params: list[torch.Tensor], n: int):
        self.params, self.n = params, n
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append((off, off + p.numel()))
            off += p.numel()
        self.numel = off
        self.padded = -(-off // n) * n  # round up to a multiple of n
        self.shard_numel = self.padded // n

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b].view_as(p) for p, (a, b) in zip(self.params, self.offsets)]

    def shard(self, flat: torch.Tensor, r: int) -> torch.Tensor:
        return flat[r * self.shard_numel:(r + 1) * self.shard_numel]  # [k], a view


class ZeroDataParallel:
    """ZeRO stage 1 or 2 over the mesh's dp axis; owns the optimizer.

    Use:  zero = ZeroDataParallel(model, comm, stage=2, optimizer="adam", lr=3e-3)
          zero.zero_grad(); loss.backward(); zero.step()
    """

    def __init__(self, model: torch.nn.Module, comm: Comm, stage: int, optimizer: str = "adam",
                 lr: float = 3e-3, param_dtype: torch.dtype = torch.float32,
                 shard_axis: str = AXIS, replicate_axis: str | None = None, offload: bool = False):
        """`shard_axis`/`replicate_axis`: HYBRID_SHARD shards over dp_shard and all-reduces the
        reduced slices over dp_rep; the default shards over the whole dp axis.
        `offload` (ZeRO-Offload, Ren et al., 2021): the fp32 master slice and Adam's moments live
        in host memory and the optimizer steps there; per step the gradient slice crosses to the
        host and the updated parameter slice comes back (PCIe). On a CPU-only machine host and
        device are the same memory: the copies still happen and are counted, the split of bytes
        into device and host is by category."""
        if stage not in (1, 2):
            raise ValueError(f"stage {stage}: ZeroDataParallel does stages 1 and 2")
        self.model, self.comm, self.stage = model, comm, stage
        self.shard_axis, self.replicate_axis = shard_axis, replicate_axis
        self.n, self.r = comm.size(shard_axis), comm.rank(shard_axis)
        self.dp = comm.size(AXIS)  # all replicas x shards: what the gradient is averaged over
        self.mixed = param_dtype != torch.float32
        if self.dp > 1:
            step, comm.step = comm.step, -1  # one-time setup traffic
            broadcast_parameters(model, comm)
            comm.step = step
        self.params = [p for p in model.parameters() if p.requires_grad]
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
        self.optimizer = make_optimizer(optimizer, [self.master], lr)
        self.flat_grads: torch.Tensor | None = None  # [padded], during backward (stage 2) / always (1)
        self.grad_shard: torch.Tensor | None = None  # [k], kept by stage 2 after the step

    # -- the training-loop interface (same as DataParallel + optimizer) --------------------------
    def zero_grad(self) -> None:
        """Fresh flat gradient buffer; every p.grad a view into it, so backward accumulates there."""
        self.flat_grads = torch.zeros_like(self.flat_params)
        for p, view in zip(self.params, self.layout.views(self.flat_grads)):
            p.grad = view
        self.grad_shard = None

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
            self.master.grad = host_grad.float()
        else:
            self.master.grad = self.grad_shard.float() if self.mixed else self.grad_shard
        self.optimizer.step()
        self.master.grad = None
        if self.offload:  # updated slice back to the device, in compute precision
            self.comm.transfer(self.param_shard, self.master.to(self.param_shard.dtype), "h2d")
        elif self.mixed:
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
        if self.mixed or self.offload:
            opt.append(self.master)
        if self.offload:
            return {"params": [self.flat_params], "grads": grads, "optimizer": [], "host": opt}
        return {"params": [self.flat_params], "grads": grads, "optimizer": opt}

    def buffers(self) -> list[torch.Tensor]:
        return []  # the flat buffers are model states, counted by state_tensors

    def transient_bytes(self) -> int:
        return 0

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}
