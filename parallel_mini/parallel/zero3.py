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
SIGSEGV (measured: `model.state_dict()`, or `w.norm()` between steps). So nothing may:
- a parameter used *outside* its unit's forward (the root calling F.linear with the embedding's
  weight, a layer's weight read after the layer ran) is gathered on use: while the root's forward
  runs, a TorchFunctionMode sees every op's tensors; one that views a unit outside that unit's own
  forward gathers the unit first, and the op's outputs gather it again when their gradient arrives,
  before the op's backward reads it;
- while its unit is freed a parameter wears the class `FreedParameter`, whose __torch_function__
  lets metadata through (shape, grad, hooks) and turns any read of its elements (between steps,
  `state_dict()`, a loss term added after the forward) into an error that names it and the fix:
  read full weights with `full_parameters()` (on every rank), or use them inside the forward.
  (FSDP2 refuses the same reads: outside the forward its parameters are DTensor shards.)
- in backward a unit is freed when every gradient of its parameters has arrived *and* the gradient
  of its inputs is complete (FSDP2's post-backward trigger): an op of the unit that reads a weight
  but gives it no gradient (h * w.detach()) may run after the weight's gradient arrived;
- a unit read outside its forward with autograd off (inside a custom autograd.Function's forward,
  whose backward the TorchFunctionMode cannot see) stays gathered until the step's gradients are
  synchronised.

Units over other ranks (FSDP2's nested fully_shard, as torchtitan applies it to MoE experts): a
module named in `apart` is a unit of its own, taken out of the unit that contains it, sharded,
gathered and reduced over its own axes. Expert parallel needs it: a layer's experts differ between
the ep ranks, so they cannot share a flat buffer with the block around them (sharded over all of
dp x cp); their replicas are the edp ranks (parallel/expert.py). Each unit knows its own groups,
and nothing else changes: the same hooks gather and free both, one optimizer steps every slice.

Frozen parameters (requires_grad=False) are in no unit: replicated, never communicated (as DDP and
FSDP2 treat them). Parameters that get no gradient in a step: see `find_unused_parameters` below.
Not supported: a unit whose forward runs on some ranks and not on others (a top-level child called
only for some data). Its all-gather would meet a different collective on the other ranks (measured:
the ranks wait on each other until run_ranks' timeout names the deadlock); FSDP2 has the same rule
for its units, and no rank can tell before the data arrive. Keep such a branch inside a unit that
always runs (a block's layer), as AnyModule in tests/test_any_module.py does.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from itertools import chain

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..comm import Comm
from ..optim import make_optimizer
from .zero import (FlatLayout, UsedParameters, piece_grads, piece_views, refuse_unsupported,
                   step_with)


def plan_units(model: torch.nn.Module, apart=()) -> list[tuple[torch.nn.Module,
                                                             list[torch.nn.Parameter]]]:
    """[(module, its trainable parameters)]: the root unit first when it has any, then each
    top-level child (a ModuleList: each member) that keeps a parameter of its own, then each
    module of `apart` (its parameters are its own unit's, not the child's around it)."""
    modules = []
    for child in model.children():
        modules += list(child) if isinstance(child, torch.nn.ModuleList) else [child]
    holders: dict[torch.nn.Parameter, list[int]] = {}  # parameter -> the modules that hold it
    for k, m in enumerate(modules):
        for p in m.parameters():  # a module lists a parameter once, however often it holds it
            holders.setdefault(p, []).append(k)
    modules += list(apart)
    for k, m in enumerate(apart, start=len(modules) - len(apart)):
        for p in m.parameters():
            holders[p] = [k]  # the innermost unit holds it
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


# Tensor attributes and methods that read no element: a freed parameter still answers them.
READS_NO_ELEMENT = frozenset({
    "__hash__", "grad", "_grad", "requires_grad", "requires_grad_", "is_leaf", "grad_fn",
    "retains_grad", "shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device",
    "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_floating_point",
    "is_complex", "element_size", "itemsize", "stride", "is_contiguous", "storage_offset", "names",
    "_base", "_is_view", "untyped_storage", "register_hook", "register_post_accumulate_grad_hook",
    "_backward_hooks", "_post_accumulate_grad_hooks", "__class__"})


def _attribute_name(func) -> str:
    """'sum' for Tensor.sum, 'grad' for the getter and setter of Tensor.grad."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class FreedParameter(torch.nn.Parameter):
    """What a parameter is while its unit is freed: its storage has no bytes, so an op that read it
    would read freed memory (SIGSEGV). Metadata still answers; anything else is refused, naming
    the parameter. The unit gives the parameter its own class back when it gathers."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _attribute_name(func) not in READS_NO_ELEMENT:
            freed = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FreedParameter)]
            names = [getattr(t, "_zero3_name", "a parameter") for t in freed]
            raise RuntimeError(
                f"ZeRO-3: {', '.join(names)} is sharded here (each rank holds a slice; the full "
                f"weights exist only while its unit computes), so {_attribute_name(func)!r} "
                f"cannot read it. Use parameters inside the model's forward (they are gathered "
                f"there), read full weights with full_parameters() (every rank calls it), and load "
                f"weights before wrapping the model.")
        with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors, as Parameter's
            return func(*args, **kwargs)


def freed_class(cls: type) -> type:
    """The class a parameter of class `cls` wears while freed (a subclass of both)."""
    if cls is torch.nn.Parameter:
        return FreedParameter
    return type(f"Freed{cls.__name__}", (FreedParameter, cls), {})


class UnitCall:
    """One call of a unit's forward, seen from backward: it *starts* when the gradient reaches its
    outputs and *ends* when the gradient of its inputs is complete. In between the unit must stay
    gathered. (A pipeline runs several forwards before their backwards: each call is its own.)"""

    def __init__(self, zero3: "Zero3DataParallel", unit: "Unit"):
        self.zero3, self.unit, self.state = zero3, unit, "forward"

    def start(self) -> None:
        if self.state == "forward":
            self.state = "backward"
            self.unit.in_backward.add(self)

    def end(self, in_backward: bool) -> None:
        if self.state != "ended":
            self.state = "ended"
            self.unit.in_backward.discard(self)
            if in_backward:  # (a graph dropped unused frees nothing and issues no collective)
                self.zero3._maybe_done(self.unit)


class InputsGradDone(torch.autograd.Function):
    """Identity on a unit's inputs. Its backward runs once their gradient is complete: after every
    op of the unit that lies on their path (FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, call: UnitCall, *xs):
        ctx.call = call
        weakref.finalize(ctx, call.end, False)  # the graph freed: the call can wait no more
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.call.end(True)
        return (None, *grads)


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
    """Some parameters as one sharded flat buffer, over its own axes: `axis` (its data-parallel
    ranks: the gradient is averaged over them), `shard_axis` (the ranks holding its slices) and
    `replicate_axis` (HYBRID_SHARD: the ranks holding the same slice; None without)."""

    def __init__(self, module, params, comm: Comm, axes: dict, param_dtype, mixed, names):
        self.axis, self.shard_axis = axes["axis"], axes["shard_axis"]
        self.replicate_axis = axes.get("replicate_axis")
        n, r = comm.size(self.shard_axis), comm.rank(self.shard_axis)
        self.module, self.params, self.n, self.r = module, params, n, r
        self.dp = comm.size(self.axis)  # what its gradient is averaged over
        self.classes = [type(p) for p in params]  # worn while gathered
        self.freed_classes = [freed_class(c) for c in self.classes]  # worn while freed
        self.layout = FlatLayout(self.params, n)
        device = self.params[0].device
        self.full = torch.zeros(self.layout.padded, dtype=param_dtype, device=device)  # [padded]
        for p, view in zip(self.params, self.layout.views(self.full)):
            view.copy_(p.data)  # (each parameter is in one unit only: never from a freed buffer)
            p.data = view
            p._zero3_name = names[p]  # for FreedParameter's error
        self.storage = self.full.untyped_storage()  # held: one Python object, a stable identity
        self.shard = self.layout.shard(self.full, r).clone()  # [k], persistent
        self.master = self.shard.float() if mixed else self.shard  # fp32 copy when mixed
        self.pieces = self.layout.pieces(r)  # my slice, cut at parameter boundaries
        self.grad_shard: torch.Tensor | None = None  # [k], accumulated over micro-steps
        self.ready: set = set()  # parameters whose gradient arrived in this backward
        self.active = False  # inside the module's own forward
        self.call: UnitCall | None = None  # the forward call under way
        self.in_backward: set = set()  # calls whose backward has started and not ended
        self.sticky = False  # read with autograd off outside its forward: kept until the sync
        self.later: set = set()  # parameters whose gradient a zero-bubble W computes, after B
        self.accumulated: set = set()  # those W has accumulated since the unit's last reduce
        self.gathered = True
        self.free()

    def free(self) -> None:
        if self.gathered:
            self.storage.resize_(0)  # bytes released; views stay attached
            for p, cls in zip(self.params, self.freed_classes):
                p.__class__ = cls  # from now on an op that would read it is refused
            self.gathered = False

    def gather(self, comm: Comm) -> None:
        if self.gathered:
            return
        self.storage.resize_(self.layout.padded * self.full.element_size())
        comm.all_gather(self.full, self.shard, self.shard_axis)  # n x [k] -> [padded]
        for p, cls in zip(self.params, self.classes):
            p.__class__ = cls  # readable again
        self.gathered = True


class GatherOnUse(TorchFunctionMode):
    """Active while the root's forward runs: an op reading a unit outside that unit's forward
    gathers it first; the op's outputs gather it again before the op's backward."""

    def __init__(self, zero3: "Zero3DataParallel"):
        super().__init__()
        self.zero3 = zero3
        self.training = torch.is_grad_enabled()  # the root's forward builds a graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        units = self.zero3.units_read_outside(chain(args, kwargs.values()))
        for u in units:
            self.zero3.gather(u)
            self.zero3.ran.add(u)
            # autograd off inside a training forward: a custom Function's forward, maybe saving
            # the weights for a backward no hook of ours precedes. Keep them until the sync.
            u.sticky = u.sticky or (self.training and not torch.is_grad_enabled())
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
                 find_unused_parameters: bool = False, apart: dict | None = None):
        """`axis`: the data-parallel axis (batch split, gradient average). HYBRID_SHARD: shard over
        `shard_axis`, all-reduce the reduced slices over `replicate_axis` (see ZeroDataParallel).
        `find_unused_parameters` (DDP's): parameters may get no gradient on some ranks or on all.
        Which units are complete when then depends on each rank's data, so every reduce-scatter
        waits for finish_gradient_sync, where all units go in a fixed order, zeros where a gradient
        did not arrive; a parameter no rank used is not stepped. The price: full gradients live
        until then (ZeRO-2's gradient memory), and micro-steps accumulate them before reducing.
        Without it, a parameter that will get no gradient is an error as soon as the forward that
        left it out ends.
        `apart` {module: its axes, a dict of axis, shard_axis, replicate_axis}: modules that are
        units of their own over other ranks (expert parallel's experts over edp; see above)."""
        refuse_unsupported(model, "ZeRO-3")
        apart = apart or {}
        if find_unused_parameters and apart:  # its 0/1 map would mix parameters of other ranks
            raise ValueError("ZeRO-3: find_unused_parameters with units over other axes (apart) "
                             "is not supported; use one of them")
        self.model, self.comm = model, comm
        self.axis, self.shard_axis, self.replicate_axis = axis, shard_axis, replicate_axis
        self.n, self.r = comm.size(shard_axis), comm.rank(shard_axis)
        self.dp = comm.size(axis)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full layers alive at once, and the max
        self.mixed = param_dtype != torch.float32
        axes = dict(axis=axis, shard_axis=shard_axis, replicate_axis=replicate_axis)
        self._start_alike(model, axes, apart)
        plan = plan_units(model, list(apart))
        names = {p: name for name, p in model.named_parameters()}
        self.units = [Unit(m, ps, comm, apart.get(m, axes), param_dtype, self.mixed, names)
                      for m, ps in plan]
        self.root = self.units[0] if plan[0][0] is model else None
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._unit_of_storage = {id(u.storage): u for u in self.units}
        self.find_unused = find_unused_parameters
        self.used = UsedParameters([p for u in self.units for p in u.params])
        self.unused: set = set()  # parameters no rank used this step: not stepped
        self._mode: GatherOnUse | None = None
        self.ran: set = set()  # the units the root's current (or last) forward ran or read
        model.register_forward_pre_hook(self._before_root_forward)
        model.register_forward_hook(self._after_root_forward, always_call=True)
        for u in self.units:
            if u is not self.root:
                u.module.register_forward_pre_hook(
                    lambda mod, args, kwargs, u=u: self._before_forward(u, args, kwargs),
                    with_kwargs=True)
                u.module.register_forward_hook(
                    lambda mod, args, out, u=u: self._after_forward(u, out))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        views = [v for u in self.units for v in piece_views(u.master, u.pieces)]
        self.optimizer = make_optimizer(optimizer, views, lr)  # one, over every unit's pieces

    def _start_alike(self, model, axes: dict, apart: dict) -> None:
        """Every rank starts from its data-parallel group's first rank's weights, as in data
        parallel: each parameter over its unit's axis (an expert's replicas: edp)."""
        axis_of = {p: a["axis"] for m, a in apart.items() for p in m.parameters()}
        step, self.comm.step = self.comm.step, -1  # one-time setup traffic
        for p in model.parameters():
            axis = axis_of.get(p, axes["axis"])
            if self.comm.size(axis) > 1:
                self.comm.broadcast(p.data, axis, src=0)
        self.comm.step = step

    # -- gathering and freeing ------------------------------------------------------------------
    def gather(self, *units: Unit) -> None:
        for unit in units:
            if not unit.gathered:
                unit.gather(self.comm)
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
                if isinstance(t, torch.nn.Parameter) and t in self._unit_of:
                    u = self._unit_of[t]  # (a freed one too: FreedParameter)
                elif type(t) is torch.Tensor:  # a view of a unit's storage made in the forward
                    u = self._unit_of_storage.get(id(t.untyped_storage()))
                else:
                    continue  # (another subclass: it may have no storage)
                if u is not None and not u.active and u is not self.root and u not in found:
                    found.append(u)
        return found

    # -- forward hooks ----------------------------------------------------------------------------
    def _before_root_forward(self, module, args) -> None:
        # Every forward starts from the same state on every rank, whatever the last backward left
        # gathered (a unit whose parameters did not all get a gradient): all units freed.
        for u in self.units:
            self._free(u)
        self.ran = {self.root} if self.root is not None else set()
        if self.root is not None:
            self.gather(self.root)
        self._mode = GatherOnUse(self)
        self._mode.__enter__()

    def _after_root_forward(self, module, args, out) -> None:
        if self._mode is not None:  # (always_call: also when the forward raised)
            self._mode.__exit__(None, None, None)
            self._mode = None
        for u in self.units:  # units gathered on use; the root unit stays for backward
            if not torch.is_grad_enabled() or (u is not self.root and not u.sticky):
                self._free(u)
        if out is not None and torch.is_grad_enabled() and not self.find_unused:
            self._check_every_parameter_reached(out)

    def _check_every_parameter_reached(self, out) -> None:
        """DDP's rule, checked before backward issues a collective: without find_unused_parameters
        every trainable parameter must get a gradient (a rank whose unit waits for a gradient that
        never comes would pair its collectives with the wrong ones of its peers). Of the units this
        forward ran: a pipeline rank holding several chunks (interleaved, zbv) runs one per forward."""
        reached = reachable_parameters(out)
        missing = [p for u in self.units if u in self.ran for p in u.params if p not in reached]
        if missing:
            names = [n for n, p in self.model.named_parameters() if any(p is m for m in missing)]
            raise RuntimeError(
                f"ZeRO-3: parameters will receive no gradient this step: {names[:5]}. Like DDP, "
                f"pass find_unused_parameters=True, or freeze them (requires_grad=False).")

    def _before_forward(self, unit: Unit, args, kwargs):
        unit.active = True  # first: the all-gather itself is an op GatherOnUse sees
        self.ran.add(unit)
        self.gather(unit)
        unit.call = None
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None  # no backward to wait for (or a recomputation inside backward)
        return self._end_call_with_inputs_grad(unit, args, kwargs)

    def _end_call_with_inputs_grad(self, unit: Unit, args, kwargs):
        """The unit's inputs that need a gradient, passed through InputsGradDone."""
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not keys and not at:
            return None  # (token ids into an embedding): its parameters' gradients suffice
        unit.call = UnitCall(self, unit)
        outs = InputsGradDone.apply(unit.call, *[args[i] for i in at], *[kwargs[k] for k in keys])
        args, kwargs = list(args), dict(kwargs)
        for i, t in zip(at, outs):
            args[i] = t
        kwargs.update(zip(keys, outs[len(at):]))
        return tuple(args), kwargs

    def _after_forward(self, unit: Unit, out) -> None:
        unit.active = False
        if torch._C._current_graph_task_id() != -1:
            return  # recomputed inside backward (checkpointing): the backward reads it next
        self._free(unit)
        if torch.is_grad_enabled():  # when the gradient reaches an output, gather for backward
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit, c=unit.call: self._backward_starts(u, c))

    def _backward_starts(self, unit: Unit, call: UnitCall | None) -> None:
        self.gather(unit)
        if call is not None:
            call.start()

    # -- backward ---------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        unit = self._unit_of[p]
        unit.ready.add(p)
        self._maybe_done(unit)

    def _maybe_done(self, unit: Unit) -> None:
        """Every gradient of the unit arrived and its inputs' gradient is complete: no op of this
        backward reads its weights again. Reduce (unless find_unused_parameters) and free."""
        if unit.in_backward or len(unit.ready) < len(unit.params):
            return
        unit.ready.clear()
        # (find_unused: which units complete here differs between ranks; zero bubble: W reduces)
        if not self.find_unused and not unit.later:
            self._reduce(unit)
        if not unit.sticky:
            self._free(unit)

    # -- zero-bubble pipelines: weight gradients after backward (parallel/pipeline.py, W ops) ------
    # B computes only the inputs' gradient dX = dY W (it needs the gathered weights) and queues
    # X and dY; a later W computes dW = dY^T X into p.grad outside autograd, so no hook of ours sees
    # it. W reads no weight: the unit is freed when B is done, as after a full backward, and W
    # does not gather it again. Its reduce-scatter waits for W: then, per micro-batch as under
    # 1F1B, the same 3 Psi, and the full weight gradient lives only inside W. What B left in p.grad
    # (the LayerNorms') waits there, full size, and rides along; a B of the next micro-batch may
    # add to it first, which changes nothing: a reduce-scatter of a sum is the sum of two. (A unit
    # with no Linear, the embeddings, is reduced by B as before.)
    # (torch.distributed.pipelining keeps an FSDP2 stage unsharded for W instead, and reduce-scatters
    # once after the last micro-batch: full gradients and weights for the whole step.)
    def grad_deferred(self, p: torch.nn.Parameter) -> None:
        """B queued p's weight gradient for a W: for this backward it counts as arrived (the unit
        may be freed), and from now on the unit is reduced by W (`grad_accumulated`), not by B."""
        self._unit_of[p].later.add(p)
        self._on_grad_ready(p)

    def grad_accumulated(self, p: torch.nn.Parameter) -> None:
        """W added its micro-batch's gradient to p.grad. Once it has for every parameter B left
        to it, the unit holds that micro-batch's whole gradient: reduce-scatter it (the unit stays
        freed: reducing reads p.grad, not p)."""
        unit = self._unit_of[p]
        unit.accumulated.add(p)
        if len(unit.accumulated) == len(unit.later):
            unit.accumulated.clear()
            if not self.find_unused:
                self._reduce(unit)

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
        yield  # every micro-step reduce-scatters (as FSDP does by default; with
        # find_unused_parameters, finish_gradient_sync does): nothing to defer

    def finish_gradient_sync(self) -> None:
        """With find_unused_parameters: every unit reduce-scatters now, in unit order, on every
        rank; then one 0/1 map says which parameters no rank used."""
        if not self.find_unused:
            for u in self.units:
                if u.grad_shard is None or u.ready or u.accumulated:
                    names = [n for n, p in self.model.named_parameters()
                             if p in self._unit_of and self._unit_of[p] is u and p.grad is None]
                    raise RuntimeError(f"ZeRO-3: unit {type(u.module).__name__} got no complete "
                                       f"gradient this step (missing: {names[:5]}); pass "
                                       f"find_unused_parameters=True")
        else:
            for u in self.units:
                self._reduce(u)
                u.ready.clear()
        for u in self.units:  # (sticky ones were kept for a custom Function's backward)
            u.sticky = False
            self._free(u)
        if self.find_unused:
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

    # -- what this rank owns (interfaces.GradientStrategy.owned: checkpoints read it) -----------
    def owned(self, held) -> list:
        """My slice of every unit's flat buffer, as boxes of the full tensors (one optimizer
        steps every unit's pieces, in unit order)."""
        out = []
        for u in self.units:
            out += u.layout.owned(held, u.r, self.optimizer, first=len(out))
        return out

    @torch.no_grad()
    def loaded(self) -> None:
        """bf16-mixed: the compute slices from the fp32 masters a checkpoint filled."""
        if self.mixed:
            for u in self.units:
                u.shard.copy_(u.master)
