"""ZeRO stage 3 (FSDP's FULL_SHARD): the parameters are sharded too (Rajbhandari et al., SC 2020).

Between uses, rank r keeps only slice r of every layer's weights: 1/N of the parameters, of the
gradients and of the optimizer states, 16P/N bytes with mixed-precision Adam. A layer's weights
exist in full only while it computes:
    forward:  all-gather the unit's slices -> full weights -> compute -> free
    backward: all-gather again -> compute gradients -> reduce-scatter them -> free
Per step that is all-gather (Psi) + all-gather (Psi) + reduce-scatter (Psi): 3 Psi on the wire, 1.5x
what data parallel moves, in exchange for memory that falls as 1/N.

Units (a fixed wrapping policy): each member of a top-level ModuleList (the blocks) and each other
top-level child with trainable parameters (the embedding, the head) is gathered and freed as one
flat buffer. The parameters registered on the root itself, and any parameter two units share (tied
weights: the embedding table reused as the output projection), form the *root unit*: a parameter
lives in exactly one unit, so a tied weight has one shard and is gathered once. The root unit is
gathered when the root's forward starts and kept until its gradient is reduced (FSDP2 does not
reshard its root after forward either: backward needs it at once). Our GPT has no such parameter:
then there is no root unit, and nothing is spent on it.

Freeing uses `storage.resize_(0)`, as FSDP's first version did: the parameters and autograd's saved
references keep pointing at the same storage, which is given its bytes back (and refilled) when the
unit is gathered for backward. Reading a freed parameter reads memory that is gone: the rank dies of
SIGSEGV. So nothing may, and a parameter used *outside* its unit's forward (the root calling
F.linear with the embedding's weight, a layer's weight read after the layer ran) is gathered on use:
while the root's forward runs, a TorchFunctionMode sees every op's tensors; one that views a unit
outside that unit's own forward gathers the unit first, and the op's outputs gather it again when
their gradient arrives, before the op's backward reads it. Between steps the parameters are freed:
read them with `full_parameters()`.

Frozen parameters (requires_grad=False) are in no unit: replicated, never communicated (as DDP and
FSDP2 treat them). Parameters that get no gradient in a step: see `find_unused_parameters` below.
Not supported: a unit whose forward runs on some ranks and not on others (a top-level child called
only for some data). Its all-gather would meet a different collective on the other ranks; FSDP2 has
the same rule for its units. Keep such a branch inside a unit that always runs (a block's layer).
"""
from __future__ import annotations

from contextlib import contextmanager
from itertools import chain

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..comm import Comm
from ..optim import make_optimizer
from .zero import (FlatLayout, UsedParameters, piece_grads, piece_views, refuse_unsupported,
                   step_with)


def plan_units(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """[(module, its trainable parameters)]: the root unit first when it has any, then each
    top-level child (a ModuleList: each member) that keeps a parameter of its own."""
    modules = []
    for child in model.children():
        modules += list(child) if isinstance(child, torch.nn.ModuleList) else [child]
    holders: dict[torch.nn.Parameter, list[int]] = {}  # parameter -> the modules that hold it
    for k, m in enumerate(modules):
        for p in m.parameters():  # a module lists a parameter once, however often it holds it
            holders.setdefault(p, []).append(k)
    on_root = {p for p in model.parameters(recurse=False)}
    members: list[list[torch.nn.Parameter]] = [[] for _ in modules]
    root = []
    for p in model.parameters():  # every parameter once (a tied one too), in registration order
        if not p.requires_grad:
            continue  # frozen: replicated, never sharded
        ks = holders.get(p, [])
        if len(ks) == 1 and p not in on_root:
            members[ks[0]].append(p)
        else:  # on the root, or shared by two units: the root unit holds it
            root.append(p)
    units = [(model, root)] if root else []
    return units + [(m, ps) for m, ps in zip(modules, members) if ps]


def reachable_parameters(outputs) -> set:
    """The parameters autograd will give a gradient to from `outputs`: the AccumulateGrad nodes
    reachable from their grad_fns (what DDP's find_unused_parameters traverses)."""
    seen, found = set(), set()
    stack = [t.grad_fn for t in tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf's gradient lands here
            found.add(node.variable)
        stack += [nxt for nxt, _ in node.next_functions]
    return found


class Unit:
    """Some parameters as one sharded flat buffer."""

    def __init__(self, module, params, n, r, param_dtype, mixed):
        self.module, self.params, self.n, self.r = module, params, n, r
        self.layout = FlatLayout(self.params, n)
        device = self.params[0].device
        self.full = torch.zeros(self.layout.padded, dtype=param_dtype, device=device)  # [padded]
        for p, view in zip(self.params, self.layout.views(self.full)):
            view.copy_(p.data)  # (each parameter is in one unit only: never from a freed buffer)
            p.data = view
        self.storage = self.full.untyped_storage()  # held: one Python object, a stable identity
        self.shard = self.layout.shard(self.full, r).clone()  # [k], persistent
        self.master = self.shard.float() if mixed else self.shard  # fp32 copy when mixed
        self.pieces = self.layout.pieces(r)  # my slice, cut at parameter boundaries
        self.grad_shard: torch.Tensor | None = None  # [k], accumulated over micro-steps
        self.ready: set = set()  # parameters whose gradient arrived in this backward
        self.active = False  # inside the module's own forward
        self.gathered = True
        self.free()

    def free(self) -> None:
        if self.gathered:
            self.storage.resize_(0)  # bytes released; views stay attached
            self.gathered = False

    def gather(self, comm: Comm, axis: str) -> None:
        if self.gathered:
            return
        self.storage.resize_(self.layout.padded * self.full.element_size())
        comm.all_gather(self.full, self.shard, axis)  # n x [k] -> [padded]
        self.gathered = True


class GatherOnUse(TorchFunctionMode):
    """Active while the root's forward runs: an op reading a unit outside that unit's forward
    gathers it first; the op's outputs gather it again before the op's backward."""

    def __init__(self, zero3: "Zero3DataParallel"):
        super().__init__()
        self.zero3 = zero3

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        units = self.zero3.units_read_outside(chain(args, kwargs.values()))
        for u in units:
            self.zero3.gather(u)
        out = func(*args, **kwargs)
        if units and torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, units=units: self.zero3.gather(*units))
        return out


class Zero3DataParallel:
    """ZeRO-3 over the data-parallel axes it is given; owns the optimizer. Same loop interface
    as ZeroDataParallel."""

    def __init__(self, model: torch.nn.Module, comm: Comm, optimizer: str = "adam",
                 lr: float = 3e-3, param_dtype: torch.dtype = torch.float32, axis: str = "dp",
                 shard_axis: str = "dp", replicate_axis: str | None = None,
                 find_unused_parameters: bool = False):
        """`axis`: the data-parallel axis (batch split, gradient average). HYBRID_SHARD: shard over
        `shard_axis`, all-reduce the reduced slices over `replicate_axis` (see ZeroDataParallel).
        `find_unused_parameters` (DDP's): parameters may get no gradient on some ranks or on all.
        Which units are complete when then depends on each rank's data, so every reduce-scatter
        waits for finish_gradient_sync, where all units go in a fixed order, zeros where a gradient
        did not arrive; a parameter no rank used is not stepped. The price: full gradients live
        until then (ZeRO-2's gradient memory), and micro-steps accumulate them before reducing.
        Without it, a parameter that will get no gradient is an error as soon as the forward that
        left it out ends."""
        refuse_unsupported(model, "ZeRO-3")
        self.model, self.comm = model, comm
        self.axis, self.shard_axis, self.replicate_axis = axis, shard_axis, replicate_axis
        self.n, self.r = comm.size(shard_axis), comm.rank(shard_axis)
        self.dp = comm.size(axis)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full layers alive at once, and the max
        self.mixed = param_dtype != torch.float32
        if self.dp > 1:  # every rank starts from rank 0's weights, as in data parallel
            step, comm.step = comm.step, -1
            for p in model.parameters():
                comm.broadcast(p.data, axis, src=0)
            comm.step = step
        plan = plan_units(model)
        self.units = [Unit(m, ps, self.n, self.r, param_dtype, self.mixed) for m, ps in plan]
        self.root = self.units[0] if plan[0][0] is model else None
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._unit_of_storage = {id(u.storage): u for u in self.units}
        self.find_unused = find_unused_parameters
        self.used = UsedParameters([p for u in self.units for p in u.params])
        self.unused: set = set()  # parameters no rank used this step: not stepped
        self._mode: GatherOnUse | None = None
        model.register_forward_pre_hook(self._before_root_forward)
        model.register_forward_hook(self._after_root_forward, always_call=True)
        for u in self.units:
            if u is not self.root:
                u.module.register_forward_pre_hook(lambda mod, args, u=u: self._before_forward(u))
                u.module.register_forward_hook(
                    lambda mod, args, out, u=u: self._after_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        views = [v for u in self.units for v in piece_views(u.master, u.pieces)]
        self.optimizer = make_optimizer(optimizer, views, lr)  # one, over every unit's pieces

    # -- gathering and freeing ------------------------------------------------------------------
    def gather(self, *units: Unit) -> None:
        for unit in units:
            if not unit.gathered:
                unit.gather(self.comm, self.shard_axis)
                self.gathered_bytes += unit.storage.nbytes()
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            self.gathered_bytes -= unit.storage.nbytes()
            unit.free()

    def units_read_outside(self, args) -> list[Unit]:
        """The units whose storage one of `args` (tensors, or lists of them) views, outside their
        own forward. The root unit is gathered for the whole forward: never outside."""
        found = []
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if type(t) not in (torch.Tensor, torch.nn.Parameter):
                    continue  # (not a subclass either: it may have no storage)
                u = self._unit_of_storage.get(id(t.untyped_storage()))
                if u is not None and not u.active and u is not self.root and u not in found:
                    found.append(u)
        return found

    # -- forward hooks ----------------------------------------------------------------------------
    def _before_root_forward(self, module, args) -> None:
        # Every forward starts from the same state on every rank, whatever the last backward left
        # gathered (a unit whose parameters did not all get a gradient): all units freed.
        for u in self.units:
            self._free(u)
        if self.root is not None:
            self.gather(self.root)
        self._mode = GatherOnUse(self)
        self._mode.__enter__()

    def _after_root_forward(self, module, args, out) -> None:
        if self._mode is not None:  # (always_call: also when the forward raised)
            self._mode.__exit__(None, None, None)
            self._mode = None
        for u in self.units:  # units gathered on use; the root unit stays for backward
            if u is not self.root or not torch.is_grad_enabled():
                self._free(u)
        if out is not None and torch.is_grad_enabled() and not self.find_unused:
            self._check_every_parameter_reached(out)

    def _check_every_parameter_reached(self, out) -> None:
        """DDP's rule, checked before backward issues a collective: without find_unused_parameters
        every trainable parameter must get a gradient (a rank whose unit waits for a gradient that
        never comes would pair its collectives with the wrong ones of its peers)."""
        reached = reachable_parameters(out)
        missing = [p for p in self.used.params if p not in reached]
        if missing:
            names = [n for n, p in self.model.named_parameters() if any(p is m for m in missing)]
            raise RuntimeError(
                f"ZeRO-3: parameters will receive no gradient this step: {names[:5]}. Like DDP, "
                f"pass find_unused_parameters=True, or freeze them (requires_grad=False).")

    def _before_forward(self, unit: Unit) -> None:
        unit.active = True  # first: the all-gather itself is an op GatherOnUse sees
        self.gather(unit)

    def _after_forward(self, unit: Unit, out) -> None:
        unit.active = False
        self._free(unit)
        if torch.is_grad_enabled():  # when the gradient reaches an output, gather for backward
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self.gather(u))

    # -- backward ---------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        unit = self._unit_of[p]
        unit.ready.add(p)
        if len(unit.ready) < len(unit.params):
            return
        unit.ready.clear()  # every gradient of the unit arrived: no op reads its weights again
        if not self.find_unused:  # (with it, which units complete here differs between ranks)
            self._reduce(unit)
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
        self.comm.reduce_scatter(piece, flat_grad, self.shard_axis)  # [padded] -> [k], summed
        if self.replicate_axis:  # HYBRID_SHARD: sum the same slice across replicas
            self.comm.all_reduce(piece, self.replicate_axis)
        piece /= self.dp
        unit.grad_shard = piece if unit.grad_shard is None else unit.grad_shard.add_(piece)

    # -- the training-loop interface ------------------------------------------------------------
    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard = None
        self.used.here.clear()

    @contextmanager
    def sync(self, enabled: bool = True):
        yield  # every micro-step reduce-scatters (as FSDP does by default; with
        # find_unused_parameters, finish_gradient_sync does): nothing to defer

    def finish_gradient_sync(self) -> None:
        """With find_unused_parameters: every unit reduce-scatters now, in unit order, on every
        rank; then one 0/1 map says which parameters no rank used."""
        if not self.find_unused:
            for u in self.units:
                if u.grad_shard is None or u.ready:
                    names = [n for n, p in self.model.named_parameters()
                             if p in self._unit_of and self._unit_of[p] is u and p.grad is None]
                    raise RuntimeError(f"ZeRO-3: unit {type(u.module).__name__} got no complete "
                                       f"gradient this step (missing: {names[:5]}); pass "
                                       f"find_unused_parameters=True")
            return
        for u in self.units:
            self._reduce(u)
            self._free(u)
            u.ready.clear()
        self.unused = self.used.unused_everywhere(self.comm, self.axis)

    def step(self) -> None:
        grads = []
        for u in self.units:
            grad = u.grad_shard.float() if self.mixed else u.grad_shard  # [k]
            grads += piece_grads(u.pieces, u.params, grad, self.unused)
        step_with(self.optimizer, grads)
        if self.mixed:
            for u in self.units:
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
        """Every parameter in full (collective: all ranks call it), e.g. to compare with the
        reference; frozen ones are replicated already."""
        out = {}
        for u in self.units:
            was_gathered = u.gathered
            self.gather(u)
            for p in u.params:
                out[p] = p.detach().clone()
            if not was_gathered:
                self._free(u)
        return {name: out[p] if p in out else p.detach()
                for name, p in self.model.named_parameters()}
