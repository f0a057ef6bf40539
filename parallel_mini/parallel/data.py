"""Data parallelism: every rank holds the whole model, sees 1/N of the batch, averages gradients.

Because the loss is a mean over the batch, the mean of N equal-sized shard gradients *is* the
full-batch gradient: after averaging, every rank takes the same optimizer step as one process
would on the whole batch. That equality is tested for every mode below.

Two ways to average (read them in this order):
- naive: after backward, one blocking all-reduce per parameter. Communication starts only when all
  computation has ended.
- bucketed (what PyTorch DDP does; Li et al., "PyTorch Distributed", VLDB 2020): parameters are
  grouped, in reverse order (the order backward produces their gradients), into buckets of about
  `bucket_mb`. A hook fires as each gradient is accumulated; when a bucket is complete its
  all-reduce starts asynchronously while backward carries on with earlier layers: communication
  overlaps computation. Buckets are launched strictly in order so that all ranks issue the same
  collectives in the same sequence.
  Reverse registration order is only a guess at the order backward produces gradients: a model
  that registers its layers in another order than it uses them would complete its first bucket
  last, and nothing would overlap. So, as DDP does, the first step records the order in which
  gradients really became ready, rank 0's order is broadcast (every rank must pack alike), and the
  buckets are rebuilt from it once, before the second step. Each bucket's all-reduce record says
  how many gradients were still pending when it was launched: overlap, counted.

DDP semantics kept: rank 0's parameters are broadcast at start (ranks initialised differently
agree); frozen parameters (requires_grad=False) never communicate; with gradient accumulation
only the last micro-step synchronises (`no_sync` on the others); a parameter that gets no gradient
in a step is an error unless `find_unused_parameters=True`, which then averages it as zero where
unused and leaves it untouched (grad None) if no rank used it.

`PlainDataParallel` (at the end) is the engine's GradientStrategy for it: DataParallel plus a whole
optimizer on every rank.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..comm import Comm
from ..interfaces import GradientStrategy, Held, Piece
from ..optim import MasterWeights, make_optimizer
from .offload_disk import DiskMethods, DiskOptimizer
from ..placement import flat_layout, regions


def broadcast_parameters(model: torch.nn.Module, comm: Comm, axis: str = "dp") -> None:
    """Make every replica start from rank 0's weights (and buffers)."""
    for t in list(model.parameters()) + list(model.buffers()):
        comm.broadcast(t.data, axis, src=0)


def average_gradients(params, comm: Comm, axis: str = "dp") -> None:
    """The naive step: sum each gradient over the dp ranks, then divide by N."""
    n = comm.size(axis)
    for p in params:
        comm.all_reduce(p.grad, axis)  # [same shape as p], in place
        p.grad /= n


def grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient data parallel reduces: the fp32 accumulation buffer when the parameter has one
    (see accumulate_grads_in_fp32), else .grad."""
    return getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad


def accumulate_grads_in_fp32(params) -> None:
    """Megatron-LM's `main_grad`: a persistent fp32 buffer per bf16 parameter into which every
    micro-step's bf16 gradient is added, so long accumulations do not lose bits. The bf16 .grad
    stays allocated (zeroed after each add): 2 (param) + 2 (grad) + 4 (fp32 grad) + 12 (master and
    moments) = 20 bytes per parameter, the variant some frameworks report instead of 16.
    Call before DataParallel: its hooks run after this one and read main_grad."""
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)

        def add(q):
            q.main_grad.add_(q.grad)  # bf16 -> fp32 while adding
            q.grad.zero_()
        p.register_post_accumulate_grad_hook(add)


class Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index, self.params = index, params
        numel = sum(p.numel() for p in params)
        dtype = torch.float32 if hasattr(params[0], "main_grad") else params[0].dtype
        self.flat = torch.zeros(numel, dtype=dtype, device=params[0].device)  # [numel]
        # each parameter's place in flat, shaped like it, in params' order (placement.flat_layout:
        # the arithmetic ZeRO and checkpoints use). Made once: slicing and reshaping at every
        # gradient cost more than the copies themselves (unpacking the toy's 4 buckets: 0.27 ms a
        # step sliced each time, 0.10 ms with these; docs/bench-2cpu-2026-12-07, bucket_views.py)
        offsets, _ = flat_layout([p.numel() for p in params], 1)
        self.views = [self.flat[a:b].view_as(p) for p, (a, b) in zip(params, offsets)]
        self.ready: set = set()
        self.handle = None

    # Why one torch._foreach_copy_ per bucket, not one copy_ per gradient: every copy_ called from
    # Python pays its own dispatch, which DDP's C++ reducer does not; the toy's 53 gradients made
    # 53 calls a step each way. One call a bucket saved 0.2-0.3 ms of an 18-19 ms step at dp 2 on
    # a bare Comm, in two runs (docs/bench-2cpu-2026-12-07, section 7). The bytes copied are the same.
    def pack(self) -> None:
        """Every gradient of the bucket into its place in `flat` (all of them are ready)."""
        torch._foreach_copy_(self.views, [grad_of(p) for p in self.params])

    def unpack(self) -> None:
        """`flat` (averaged) back into every gradient of the bucket."""
        torch._foreach_copy_([grad_of(p) for p in self.params], self.views)


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int,
                 order: list[int] | None = None) -> list[Bucket]:
    """Greedy packing, in `order` (indices into params: the order gradients became ready) or, before
    any backward has been seen, in reverse registration order (a guess at that order)."""
    order = list(reversed(range(len(params)))) if order is None else order
    groups, current, size = [], [], 0
    for p in (params[i] for i in order):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return [Bucket(i, g) for i, g in enumerate(groups)]


class DataParallel:
    """Wraps a model's backward with gradient averaging over the mesh's dp axis.

    Use:  dp = DataParallel(model, comm, mode="bucketed", bucket_mb=0.25)
          with dp.sync(is_last_microstep): loss.backward()
          dp.finish_gradient_sync()   # before optimizer.step()
    """

    def __init__(self, model: torch.nn.Module, comm: Comm, mode: str = "bucketed",
                 bucket_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast: bool = True, average_fn=None, axis: str = "dp"):
        if mode not in ("naive", "bucketed"):
            raise ValueError(f"mode {mode!r}: choose 'naive' or 'bucketed'")
        self.model, self.comm, self.mode = model, comm, mode
        self.find_unused = find_unused_parameters
        # naive mode; a learner's function (params, comm) can replace it (it averages over "dp")
        self.average_fn = average_fn or (lambda params, comm: average_gradients(params, comm, axis))
        self.params = [p for p in model.parameters() if p.requires_grad]  # frozen: never synced
        self.axis = axis  # the ranks whose gradients are averaged: dp, or dp x cp with context parallel
        self.n = comm.size(axis)
        self._syncing = True
        self._grad_before: dict = {}
        if broadcast and self.n > 1:
            step, comm.step = comm.step, -1  # one-time setup, not part of any step's traffic
            broadcast_parameters(model, comm, axis)
            comm.step = step
        self.buckets = make_buckets(self.params, int(bucket_mb * 2 ** 20)) if mode == "bucketed" else []
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next_bucket = 0
        self._bucket_bytes = int(bucket_mb * 2 ** 20)
        self._ready_order: list[int] | None = [] if mode == "bucketed" and self.n > 1 else None
        self._index = {p: i for i, p in enumerate(self.params)}
        self._ready_count = 0  # gradients of this synchronised backward that are ready so far
        if mode == "bucketed" and self.n > 1:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- micro-steps ---------------------------------------------------------------------------
    @contextmanager
    def sync(self, enabled: bool = True):
        """Backward inside `sync(False)` only accumulates locally (DDP's `no_sync`)."""
        self._syncing = enabled
        try:
            yield
        finally:
            self._syncing = True

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self._ready_order is not None and self._index[p] not in self._ready_order:
            self._ready_order.append(self._index[p])  # first step: the order backward really has
        if not self._syncing:
            return
        bucket = self._bucket_of[p]
        bucket.ready.add(p)
        self._ready_count += 1
        if len(bucket.ready) == len(bucket.params):  # complete: its gradients into flat, at once
            bucket.pack()
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            b = self.buckets[self._next_bucket]
            if len(b.ready) < len(b.params):
                return
            pending = len(self.params) - self._ready_count  # > 0: launched during backward
            b.handle = self.comm.all_reduce(b.flat, self.axis, async_op=True, bucket=b.index,
                                            grads_pending=pending)
            self._next_bucket += 1

    # -- after the last backward ---------------------------------------------------------------
    def finish_gradient_sync(self) -> None:
        """Make every trainable parameter's .grad the average over the dp ranks."""
        if self.n == 1:
            return
        unused = [p for p in self.params if p.grad is None]
        if unused and not self.find_unused:
            names = [n for n, p in self.model.named_parameters() if any(p is u for u in unused)]
            raise RuntimeError(
                f"parameters received no gradient this step: {names[:5]}. Like DDP, data parallel "
                f"needs every rank to reduce the same gradients; pass find_unused_parameters=True "
                f"or freeze them (requires_grad=False).")
        used_here = [p.grad is not None for p in self.params]
        if self.mode == "bucketed":  # accumulated under sync(False) only (a pipeline's flush):
            for p in self.params:  # its buckets start now, without overlap
                if p.grad is not None and p not in self._bucket_of[p].ready:
                    self._on_grad_ready(p)
        for p in unused:
            p.grad = torch.zeros_like(p)  # contributes zero where this rank did not use it
            if self.mode == "bucketed":
                self._on_grad_ready(p)
        # Only now has every rank launched every bucket (some during backward, some just above):
        # the used-map all-reduce must come after all of them on every rank, or ranks that used
        # different parameters would pair different collectives.
        used_anywhere = self._used_anywhere(used_here) if self.find_unused else None
        if self.mode == "naive":
            self.average_fn(self.params, self.comm)
        else:
            self._wait_and_unpack()
        if used_anywhere is not None:
            for p, used in zip(self.params, used_anywhere):
                if not used:
                    p.grad = None  # no rank used it: as if it were not trained this step

    def _wait_and_unpack(self) -> None:
        for b in self.buckets:
            b.handle.wait()
            b.flat /= self.n
            b.unpack()
            b.ready.clear()
            b.handle = None
        self._next_bucket = 0
        self._ready_count = 0
        if self._ready_order is not None:  # after the first step: pack as backward really runs
            self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        """Buckets from rank 0's observed order (a one-time broadcast, recorded as setup)."""
        seen = self._ready_order
        order = seen + [i for i in reversed(range(len(self.params))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64)
        step, self.comm.step = self.comm.step, -1
        self.comm.broadcast(order_t, self.axis, src=0, kind="bucket-order")
        self.comm.step = step
        # drop the old flat buffers first (as DDP's reducer does): never two sets of buckets at once
        self.buckets, self._bucket_of = [], {}
        self.buckets = make_buckets(self.params, self._bucket_bytes, order_t.tolist())
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._ready_order = None  # once, as DDP

    def _used_anywhere(self, used_here) -> list[bool]:
        """One small all-reduce of a 0/1 map (as DDP's find_unused_parameters does)."""
        used = torch.tensor(used_here, dtype=torch.int32)
        self.comm.all_reduce(used, self.axis, kind="unused-map")
        return [bool(u) for u in used]


class PlainDataParallel(DiskMethods, GradientStrategy):  # disk: its window, report, close
    """GradientStrategy: DataParallel (gradient averaging) plus a whole optimizer on every rank."""

    def __init__(self, model, comm, cfg, axis: str = "dp", average_fn=None, offload_disk: str = ""):
        """`offload_disk`: a file for the optimizer's fp32 masters and moments (offload_disk.py)."""
        self.model = model
        if cfg.fp32_grad_accum:
            accumulate_grads_in_fp32(model.parameters())
        self.dp = DataParallel(model, comm, mode=cfg.dp_mode, bucket_mb=cfg.bucket_mb,
                               average_fn=average_fn, axis=axis)
        self.disk = offload_disk
        if offload_disk:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = DiskOptimizer(offload_disk, cfg.optimizer, cfg.lr, initial=params,
                                           params=params, step_of=lambda: comm.step)
        else:
            self.optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
        self.sync = self.dp.sync
        self.finish_gradient_sync = self.dp.finish_gradient_sync
        self.zero_grad = self.optimizer.zero_grad
        self.step = self.optimizer.step

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        grads += [p.main_grad for p in params if hasattr(p, "main_grad")]
        return {"params": params, "grads": grads,
                "optimizer": self.optimizer.state_tensors()}

    def buffers(self) -> list[torch.Tensor]:
        """The gradient buckets (and --offload-disk's window): allocated once, held across steps."""
        return [b.flat for b in self.dp.buckets] + super().buffers()

    def transient_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def owned(self, held: Held) -> list[Piece]:
        return whole_pieces(self.owned_states(), held, self.optimizer.params)

    def loaded(self) -> None:
        """--offload-disk: the masters and moments back to the file; then the weights from them."""
        self.disk_loaded()
        copy_masters(self.optimizer)


def whole_pieces(optimizer, held: Held, params=None) -> list[Piece]:
    """What a whole optimizer on every rank owns: every parameter whole, as `optimizer` steps it
    (bf16-mixed: its fp32 master). PlainDataParallel's, local SGD's (local_sgd.py). `params`: the
    model's parameters, when `optimizer` is a snapshot of states kept elsewhere (on disk)."""
    inner, values = ((optimizer.inner, optimizer.masters) if isinstance(optimizer, MasterWeights)
                     else (optimizer, optimizer.params))
    return [Piece(regions(*held[p], 0, p.numel()), v.view(-1), inner, j)
            for j, (p, v) in enumerate(zip(params if params is not None else optimizer.params, values))]


@torch.no_grad()
def copy_masters(optimizer) -> None:
    """bf16-mixed: the compute copies from the fp32 masters just loaded (the step's rounding)."""
    if isinstance(optimizer, MasterWeights):
        for p, m in zip(optimizer.params, optimizer.masters):
            p.copy_(m)
