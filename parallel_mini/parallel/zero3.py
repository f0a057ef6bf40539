"""ZeRO stage 3 (FSDP's FULL_SHARD): the parameters are sharded too (ZeRO: Rajbhandari et al., SC
2020; FSDP: Zhao et al., VLDB 2023).

Between uses, rank r keeps only slice r of every unit's weights: 1/N of the parameters, gradients
and optimizer states (16P/N bytes with mixed-precision Adam). A unit exists in full only while
it computes:
    forward:  all-gather the unit's slices -> full weights -> compute -> free
    backward: all-gather again -> compute gradients -> reduce-scatter them -> free
3 Psi on the wire per step (1.5x data parallel), for memory that falls as 1/N.

Prefetch (FSDP's forward and backward prefetch): while unit k computes, the all-gather of the unit
that comes next (k+1 in forward, k-1 in backward) is already on the wire, so a unit's forward waits
only for what compute did not hide. The price: two units gathered at once instead of one. The order
is the one the last forward ran (`_order`); the first step, which has none, gathers on demand.

Read `plan_units` (what moves together: each block, the embedding, the head; tied or root
parameters in a root unit; modules in `apart` over their own axes, as torchtitan shards MoE
experts), `Unit` (one sharded flat buffer: `gather`, `free`), then `Zero3DataParallel`: forward
hooks gather and free, gradient hooks reduce-scatter and free.

Freeing is `storage.resize_(0)`, as FSDP's first version: parameters and autograd's saved
references keep pointing at the storage, which gets its bytes back when gathered. What makes that
safe on any module is in zero3_guards.py, each guard called here with a one-line why. Not supported
(as in FSDP2): a unit whose forward runs on some ranks only (its all-gather would deadlock).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_leaves

from ..comm import Comm
from ..optim import make_optimizer
from . import zero3_guards as guards
from .offload_disk import DiskMethods, UnitsOnDisk
from .zero import (FlatLayout, UsedParameters, piece_grads, piece_views, refuse_unsupported,
                   step_with)


def plan_units(model: torch.nn.Module, apart=()) -> list[tuple[torch.nn.Module, list]]:
    """[(module, its trainable parameters)]: the root unit if any, each top-level child (of a
    ModuleList: each member), then each module of `apart`; frozen parameters are in none."""
    modules = [m for child in model.children()
               for m in (child if isinstance(child, torch.nn.ModuleList) else [child])]
    home: dict[torch.nn.Parameter, int | None] = {}  # parameter -> its module; None: shared
    for k, m in enumerate(modules + list(apart)):
        for p in m.parameters():  # a module lists a parameter once, however often it holds it
            home[p] = k if k >= len(modules) or p not in home else None  # apart: innermost wins
    on_root = set(model.parameters(recurse=False))
    members: list[list[torch.nn.Parameter]] = [[] for _ in modules + list(apart)]
    root = []
    for p in model.parameters():  # every parameter once (a tied one too), in registration order
        if p.requires_grad:  # (frozen: replicated, never sharded)
            k = home.get(p)  # on the root, or shared by two units: the root unit holds it
            (root if k is None or p in on_root else members[k]).append(p)
    units = [(model, root)] if root else []
    return units + [(m, ps) for m, ps in zip(modules + list(apart), members) if ps]


class Unit:
    """Some parameters as one sharded flat buffer over its own axes: `axis` (gradient averaged),
    `shard_axis` (holding its slices), `replicate_axis` (HYBRID_SHARD: the same slice; or None)."""

    def __init__(self, module, params, comm: Comm, axes: dict, param_dtype, mixed, names):
        self.axis, self.shard_axis = axes["axis"], axes["shard_axis"]
        self.replicate_axis = axes.get("replicate_axis")
        self.module, self.params, self.dp = module, params, comm.size(self.axis)  # dp: grad / dp
        self.n, self.r = comm.size(self.shard_axis), comm.rank(self.shard_axis)
        self.layout = FlatLayout(self.params, self.n)
        self.full = params[0].new_zeros(self.layout.padded, dtype=param_dtype)  # [padded]
        for p, view in zip(self.params, self.layout.views(self.full)):
            view.copy_(p.data)  # (each parameter is in one unit only: never from a freed buffer)
            p.data = view
        self.storage = self.full.untyped_storage()  # held: one Python object, a stable identity
        self.shard = self.layout.shard(self.full, self.r).clone()  # [k], persistent
        self.master = self.shard.float() if mixed else self.shard  # fp32 copy when mixed
        self.pieces = self.layout.pieces(self.r)  # my slice, cut at parameter boundaries
        self.grad_shard: torch.Tensor | None = None  # [k], accumulated over micro-steps
        self.ready: set = set()  # parameters whose gradient arrived in this backward
        self.pending = None  # the Work of an all-gather on the wire (prefetched), until waited on
        self.active = False  # inside the module's own forward
        self.guard = guards.UnitGuards(params, names)  # the guards' state (numbered as there)
        self.free()

    def free(self) -> None:
        self.wait()  # (a prefetch never used: the all-gather must not land in freed bytes)
        self.storage.resize_(0)  # bytes released; views stay attached
        self.guard.wear(freed=True)  # 1: from now on an op that would read it is refused
        self.gathered = False

    def gather(self, comm: Comm, shard: torch.Tensor, async_op: bool = False) -> None:
        """All-gather the slices (shard: my slice [k]) into the full buffer; `async_op`: return at
        once, and `wait` before the weights are read."""
        self.storage.resize_(self.layout.padded * self.full.element_size())
        # n x [k] -> [padded]; async_op: a Work, the bytes on their way
        self.pending = comm.all_gather(self.full, shard, self.shard_axis, async_op=async_op)
        self.gathered = True
        if self.pending is None:
            self.guard.wear(freed=False)  # readable again

    def wait(self) -> None:
        """A prefetched all-gather: wait until its bytes have landed."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.guard.wear(freed=False)  # readable again


class Zero3DataParallel(guards.ZeroBubbleUnits, DiskMethods):  # 6: W's hooks; disk: report, close
    """ZeRO-3 over the data-parallel axes it is given; owns the optimizer (GradientStrategy)."""

    def __init__(self, model: torch.nn.Module, comm: Comm, optimizer: str = "adam",
                 lr: float = 3e-3, param_dtype: torch.dtype = torch.float32, axis: str = "dp",
                 shard_axis: str = "dp", replicate_axis: str | None = None,
                 find_unused_parameters: bool = False, apart: dict | None = None,
                 offload_disk: str = "", prefetch: bool = True):
        """`axis`: batch split, gradient average; HYBRID_SHARD: shard over `shard_axis`, all-reduce
        over `replicate_axis`. `apart` {module: {axis, shard_axis, replicate_axis}}: units over
        other ranks (experts over edp). `find_unused_parameters`: DDP's (zero3_guards.py, 5).
        `offload_disk`: ZeRO-Infinity's file for the masters and moments (offload_disk.py).
        `prefetch`: all-gather the next unit while this one computes (False: one at a time)."""
        refuse_unsupported(model, "ZeRO-3")
        apart = apart or {}
        if find_unused_parameters and apart:  # its 0/1 map would mix parameters of other ranks
            raise ValueError("ZeRO-3: find_unused_parameters with apart units: use one of them")
        self.model, self.comm, self.axis = model, comm, axis
        self.find_unused, self.mixed = find_unused_parameters, param_dtype != torch.float32
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full layers alive at once, and the max
        axes = dict(axis=axis, shard_axis=shard_axis, replicate_axis=replicate_axis)
        self._start_alike(model, axes, apart)
        plan = plan_units(model, list(apart))
        names = {p: name for name, p in model.named_parameters()}
        self.units = [Unit(m, ps, comm, apart.get(m, axes), param_dtype, self.mixed, names)
                      for m, ps in plan]
        self.root = self.units[0] if plan[0][0] is model else None
        self._unit_of = {p: u for u in self.units for p in u.params}
        self.used = UsedParameters([p for u in self.units for p in u.params])
        self.unused: set = set()  # parameters no rank used this step: not stepped
        self.ran: set = set()  # the units the root's current (or last) forward ran or read
        self.prefetch = prefetch
        self._order: dict = {}  # unit -> the unit whose forward ran next, in the last forward
        self._last = None  # the unit whose forward started last in this root forward
        self._register_hooks(model)
        views = [v for u in self.units for v in piece_views(u.master, u.pieces)]
        self.disk = offload_disk  # the units' slices live in its file, not in RAM: gather reads it
        self.optimizer = (UnitsOnDisk(offload_disk, optimizer, lr, self.units, views,
                                      lambda: comm.step) if offload_disk
                          else make_optimizer(optimizer, views, lr))  # over every unit's pieces

    def _start_alike(self, model, axes: dict, apart: dict) -> None:
        """Every rank starts from its data-parallel group's first rank's weights (per unit axis)."""
        axis_of = {p: a["axis"] for m, a in apart.items() for p in m.parameters()}
        step, self.comm.step = self.comm.step, -1  # one-time setup traffic
        for p in model.parameters():
            axis = axis_of.get(p, axes["axis"])
            if self.comm.size(axis) > 1:
                self.comm.broadcast(p.data, axis, src=0)
        self.comm.step = step

    def _register_hooks(self, model) -> None:
        guards.RootForward(self)  # every forward starts with all units freed; guards 2, 3, 5
        for u in self.units:
            if u is not self.root:
                u.module.register_forward_pre_hook(
                    lambda mod, args, kwargs, u=u: self._before_forward(u, args, kwargs),
                    with_kwargs=True)
                u.module.register_forward_hook(lambda mod, a, out, u=u: self._after_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- gathering and freeing ------------------------------------------------------------------
    def gather(self, *units: Unit) -> None:
        for unit in units:
            unit.wait()  # (prefetched: it may still be on the wire)
            if not unit.gathered:
                unit.gather(self.comm, self._my_slice(unit))
                self._count_gathered(unit)

    def _prefetch(self, unit: Unit | None) -> None:
        """Put `unit`'s all-gather on the wire now; `gather` waits for it when the unit is used."""
        if self.prefetch and unit is not None and not unit.gathered:
            unit.active = True  # (as in _before_forward: our own reads of it are no use, guard 2)
            unit.gather(self.comm, self._my_slice(unit), async_op=True)
            unit.active = False
            self._count_gathered(unit)

    def _my_slice(self, unit: Unit) -> torch.Tensor:
        """What this rank sends to the unit's all-gather: its slice [k] (--offload-disk: read back
        from the file)."""
        return self.optimizer.shard(unit) if self.disk else unit.shard

    def _count_gathered(self, unit: Unit) -> None:
        self.gathered_bytes += unit.storage.nbytes()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def forward_starts(self) -> None:
        """The root's forward starts: the order of this forward is recorded anew."""
        self._last = None

    def _next_in_order(self, unit: Unit) -> Unit | None:
        """Records that `unit` ran after the last one, and says which unit ran after it last time
        (the same model runs its units in the same order every step, on every rank: FSDP2's
        assumption too, which keeps the prefetched all-gathers in the same order everywhere)."""
        self._order[self._last] = unit  # (None -> the first unit)
        self._last = unit
        return self._order.get(unit)

    def _previous_in_order(self, unit: Unit) -> Unit | None:
        """The unit whose forward ran just before `unit`'s: backward needs it next."""
        return next((u for u, v in self._order.items() if v is unit and u is not None), None)

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            self.gathered_bytes -= unit.storage.nbytes()
            unit.free()

    # -- forward: gather each unit as its forward starts, free it as it ends -------------------
    def _before_forward(self, unit: Unit, args, kwargs):
        unit.active = True  # first: the all-gather itself is an op GatherOnUse sees
        self.ran.add(unit)
        self.gather(unit)
        unit.guard.call = None
        in_backward = torch._C._current_graph_task_id() != -1  # a recomputation (checkpointing)
        if not in_backward:  # (a recomputation runs in backward's order: it records nothing)
            self._prefetch(self._next_in_order(unit))  # on the wire while this unit computes
        if not torch.is_grad_enabled() or in_backward:
            return None  # no backward to wait for (or a recomputation inside backward)
        # 4: in backward, free only once the gradient of the unit's inputs is complete too
        unit.guard.call, inputs = guards.through_inputs_grad_done(unit, self._maybe_done, args,
                                                                  kwargs)
        return inputs

    def _after_forward(self, unit: Unit, out) -> None:
        unit.active = False
        if torch._C._current_graph_task_id() != -1:
            return  # recomputed inside backward (checkpointing): the backward reads it next
        self._free(unit)
        if torch.is_grad_enabled():  # when the gradient reaches an output, gather for backward
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=unit, c=unit.guard.call:
                                    self._backward_starts(u, c))

    def _backward_starts(self, unit: Unit, call) -> None:
        self.gather(unit)
        self._prefetch(self._previous_in_order(unit))  # on the wire while this unit's backward runs
        if call is not None:
            call.start()

    # -- backward: reduce-scatter each unit's gradient once complete, free it ------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        self._unit_of[p].ready.add(p)
        self._maybe_done(self._unit_of[p])

    def _maybe_done(self, unit: Unit) -> None:
        """Its gradients and its inputs' gradient are complete: nothing reads it again."""
        if unit.guard.in_backward or len(unit.ready) < len(unit.params):
            return  # 4: an op of a call's backward may still read the weights
        unit.ready.clear()
        # (find_unused: which units complete here differs between ranks; 6: a W reduces it)
        if not self.find_unused and not unit.guard.later:
            self._reduce(unit)
        if not unit.guard.sticky:  # 3: a custom Function's backward may still read it
            self._free(unit)

    def _reduce(self, unit: Unit) -> None:
        """Reduce-scatter the unit's gradient (zeros where none arrived), add it to my slice."""
        dtype, device = unit.full.dtype, unit.full.device
        flat_grad = torch.zeros(unit.layout.padded, dtype=dtype, device=device)  # [padded]
        for q, view in zip(unit.params, unit.layout.views(flat_grad)):
            if q.grad is not None:
                view.copy_(q.grad)
            q.grad = None  # the full gradient is not kept: only my reduced slice is
        piece = torch.empty(unit.layout.shard_numel, dtype=dtype, device=device)  # [k]
        self.comm.reduce_scatter(piece, flat_grad, unit.shard_axis)  # [padded] -> [k], summed
        if unit.replicate_axis:  # HYBRID_SHARD: sum the same slice across replicas
            self.comm.all_reduce(piece, unit.replicate_axis)
        piece /= unit.dp
        unit.grad_shard = piece if unit.grad_shard is None else unit.grad_shard.add_(piece)

    # -- the training-loop interface ------------------------------------------------------------
    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard = None
        self.used.here.clear()

    @contextmanager
    def sync(self, enabled: bool = True):
        yield  # every micro-step reduce-scatters (as FSDP does by default): nothing to defer

    def finish_gradient_sync(self) -> None:
        """find_unused_parameters: every unit reduces now, in unit order; a 0/1 map says unused."""
        if not self.find_unused:
            guards.check_units_complete(self.units, self.model)  # 5: DDP's rule
        for u in self.units:
            if self.find_unused:
                self._reduce(u)
                u.ready.clear()
            u.guard.sticky = False  # 3: kept for a custom Function's backward until now
            self._free(u)
        if self.find_unused:
            self.unused = self.used.unused_everywhere(self.comm, self.axis)

    def step(self) -> None:
        grads = []
        for u in self.units:
            grad = u.grad_shard.float() if self.mixed else u.grad_shard  # [k]
            grads += piece_grads(u.pieces, u.params, grad, self.unused)
        if self.disk:  # streamed from the file, window by window
            self.optimizer.step_grads(grads)
        else:
            step_with(self.optimizer, grads)
        for u in self.units:
            if u.shard is not u.master:  # bf16-mixed: the compute slice from the fp32 master
                u.shard.copy_(u.master)

    # -- measurement and comparison -------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        opt = [t for st in self.optimizer.state.values() for t in st.values()]
        opt += [u.master for u in self.units if u.master is not u.shard]  # bf16-mixed
        return {"params": [u.shard for u in self.units if u.shard is not None],
                "grads": [u.grad_shard for u in self.units if u.grad_shard is not None],
                "optimizer": opt}

    def transient_bytes(self) -> int:
        """The most gathered (full) units alive at once; --offload-disk's window."""
        return self.peak_gathered_bytes + sum(b.nbytes for b in self.buffers())

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full (collective: all ranks call it); frozen ones are replicated."""
        out = {}
        for u in self.units:
            was_gathered = u.gathered
            self.gather(u)
            out.update({p: p.detach().clone() for p in u.params})
            if not was_gathered:
                self._free(u)
        return {name: out[p] if p in out else p.detach()
                for name, p in self.model.named_parameters()}

    # -- what this rank owns (interfaces.GradientStrategy.owned: checkpoints read it) -----------
    def owned(self, held) -> list:
        """My slice of every unit's flat buffer, as boxes of the full tensors, in unit order."""
        out, opt = [], self.owned_states()  # (DiskMethods: on disk, the states read into RAM)
        for u in self.units:
            out += u.layout.owned(held, u.r, opt, first=len(out))
        return out

    @torch.no_grad()
    def loaded(self) -> None:
        """After a checkpoint filled the masters: the file (--offload-disk) or the bf16 slices."""
        self.disk_loaded()
        for u in self.units:
            if u.shard is not u.master:  # (fp32: the same tensor; --offload-disk: neither in RAM)
                u.shard.copy_(u.master)
