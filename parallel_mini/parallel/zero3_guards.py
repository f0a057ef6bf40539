"""ZeRO-3's guards: what makes zero3.py's "gather before use, free after" safe on any module.

zero3.py frees a unit between uses with `storage.resize_(0)`: its parameters and autograd's saved
references keep pointing at a storage with no bytes. The idea assumes every parameter is read
only inside its own unit's forward and backward; a read of a freed unit reads memory that is gone,
and the rank dies of SIGSEGV (measured: `model.state_dict()`, or `w.norm()` between steps). Real
modules break the assumption in six ways. Each guard below closes one (its section says how and
why), and zero3.py calls it by number with a one-line why:
    1. a read while freed                 the class swap: FreedParameter refuses it, by name
    2. a use outside the unit's forward   GatherOnUse gathers the unit first
    3. ... with autograd off              sticky units: kept gathered until the sync
    4. a weight read after its gradient   InputsGradDone: free once the inputs' gradient is done
    5. a parameter that gets no gradient  DDP's rule, or find_unused_parameters
    6. weight gradients after B (W)       zero-bubble deferral: W, not B, reduces the unit
"""
from __future__ import annotations

import weakref
from itertools import chain

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


# ---------------------------------------------------------------------------------------------
# 1. the class swap (UnitGuards.wear): while its unit is freed a parameter wears FreedParameter,
# which lets metadata through (READS_NO_ELEMENT: shape, grad, hooks) and turns any read of its
# elements (between steps, state_dict(), a loss term added after the forward) into an error naming
# the parameter and the fix. (FSDP2 refuses the same reads: outside the forward its parameters are
# DTensor shards.)
# ---------------------------------------------------------------------------------------------
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
    """What a parameter is while its unit is freed (1): metadata answers, anything else is refused.
    The unit gives the parameter its own class back when it gathers."""

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


class UnitGuards:
    """The guards' state for one unit: 1 the classes its parameters wear, 4 the call under way and
    the calls whose backward has started and not ended, 3 kept gathered until the sync, 6 the
    parameters whose gradient a W computes after B and those W has accumulated since the unit's
    last reduce."""

    def __init__(self, params: list[torch.nn.Parameter], names: dict):
        self.params = params
        self.own = [type(p) for p in params]  # worn while gathered
        self.freed = [freed_class(c) for c in self.own]  # worn while freed
        for p in params:
            p._zero3_name = names[p]  # for FreedParameter's error
        self.call: UnitCall | None = None
        self.in_backward: set = set()
        self.sticky = False
        self.later: set = set()
        self.accumulated: set = set()

    def wear(self, freed: bool) -> None:
        for p, cls in zip(self.params, self.freed if freed else self.own):
            p.__class__ = cls  # a class swap: no copy, the same Parameter object

    def whole_after_w(self, p) -> bool:
        """6: W added p's gradient; True once it has for every parameter B left to it: the unit
        then holds that micro-batch's whole gradient."""
        self.accumulated.add(p)
        if len(self.accumulated) != len(self.later):
            return False
        self.accumulated.clear()
        return True


# ---------------------------------------------------------------------------------------------
# 2. gather on use: a parameter used outside its unit's forward (the root calling F.linear with the
# embedding's weight, a layer's weight read after the layer ran) gathers its unit first, and the
# op's outputs gather it again when their gradient arrives, before the op's backward reads it.
# 3. sticky units: a unit read that way with autograd off (inside a custom autograd.Function's
# forward, whose backward the mode cannot see) stays gathered until the step's gradients are
# synchronised (UnitGuards.sticky, set by GatherOnUse, cleared by finish_gradient_sync).
# (And 5, around the root's forward.)
# ---------------------------------------------------------------------------------------------
class RootForward:
    """Hooks around the root's forward. Before: every forward starts from the same state on every
    rank, whatever the last backward left gathered (a unit whose parameters did not all get a
    gradient): all units freed, the root unit gathered, GatherOnUse active. After: what was
    gathered on use is freed (3: unless sticky; the root unit stays for backward), and 5: a
    parameter that will get no gradient is an error now, before any collective."""

    def __init__(self, zero3):
        self.zero3, self.mode = zero3, None
        zero3.model.register_forward_pre_hook(self.before)
        zero3.model.register_forward_hook(self.after, always_call=True)

    def before(self, module, args) -> None:
        z = self.zero3
        for u in z.units:
            z._free(u)
        z.ran = {z.root} if z.root is not None else set()
        z.forward_starts()  # (the order its units run in: prefetch)
        if z.root is not None:
            z.gather(z.root)
        self.mode = GatherOnUse(z)
        self.mode.__enter__()

    def after(self, module, args, out) -> None:
        z = self.zero3
        if self.mode is not None:  # (always_call: also when the forward raised)
            self.mode.__exit__(None, None, None)
            self.mode = None
        for u in z.units:
            if not torch.is_grad_enabled() or (u is not z.root and not u.guard.sticky):
                z._free(u)
        if out is not None and torch.is_grad_enabled() and not z.find_unused:
            ran = [p for u in z.units if u in z.ran for p in u.params]
            check_every_parameter_reached(out, ran, z.model)


class GatherOnUse(TorchFunctionMode):
    """Guards 2 and 3, active while the root's forward runs."""

    def __init__(self, zero3):
        super().__init__()
        self.zero3 = zero3
        self.training = torch.is_grad_enabled()  # the root's forward builds a graph
        self.unit_of_storage = {id(u.storage): u for u in zero3.units}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        units = self.read_outside(chain(args, kwargs.values()))
        for u in units:
            self.zero3.gather(u)
            self.zero3.ran.add(u)
            # 3. autograd off inside a training forward: a custom Function's forward, maybe saving
            # the weights for a backward no hook of ours precedes. Keep them until the sync.
            u.guard.sticky = u.guard.sticky or (self.training and not torch.is_grad_enabled())
        out = func(*args, **kwargs)
        if units and torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, units=units: self.zero3.gather(*units))
        return out

    def read_outside(self, args) -> list:
        """The units whose storage one of `args` (tensors, or lists of them) views, outside their
        own forward. The root unit is gathered for the whole forward: never outside."""
        z, found = self.zero3, []
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.nn.Parameter) and t in z._unit_of:
                    u = z._unit_of[t]  # (a freed one too: FreedParameter)
                elif type(t) is torch.Tensor:  # a view of a unit's storage made in the forward
                    u = self.unit_of_storage.get(id(t.untyped_storage()))
                else:
                    continue  # (another subclass: it may have no storage)
                if u is not None and not u.active and u is not z.root and u not in found:
                    found.append(u)
        return found


# ---------------------------------------------------------------------------------------------
# 4. FSDP2's post-backward trigger: in backward a unit is freed when every gradient of its
# parameters has arrived *and* the gradient of its inputs is complete: an op of the unit that reads
# a weight but gives it no gradient (h * w.detach()) may run after the weight's gradient arrived.
# ---------------------------------------------------------------------------------------------
class UnitCall:
    """One call of a unit's forward, seen from backward: it *starts* when the gradient reaches its
    outputs and *ends* when the gradient of its inputs is complete. In between the unit must stay
    gathered. (A pipeline runs several forwards before their backwards: each call is its own.)"""

    def __init__(self, unit, on_end):
        self.unit, self.on_end, self.state = unit, on_end, "forward"

    def start(self) -> None:
        if self.state == "forward":
            self.state = "backward"
            self.unit.guard.in_backward.add(self)

    def end(self, in_backward: bool) -> None:
        if self.state != "ended":
            self.state = "ended"
            self.unit.guard.in_backward.discard(self)
            if in_backward:  # (a graph dropped unused frees nothing and issues no collective)
                self.on_end(self.unit)


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


def through_inputs_grad_done(unit, on_end, args, kwargs):
    """(the UnitCall, the unit's (args, kwargs) with its inputs that need a gradient passed
    through InputsGradDone); (None, None) when none does (token ids into an embedding: its
    parameters' gradients suffice)."""
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not keys and not at:
        return None, None
    call = UnitCall(unit, on_end)
    outs = InputsGradDone.apply(call, *[args[i] for i in at], *[kwargs[k] for k in keys])
    args, kwargs = list(args), dict(kwargs)
    for i, t in zip(at, outs):
        args[i] = t
    kwargs.update(zip(keys, outs[len(at):]))
    return call, (tuple(args), kwargs)


# ---------------------------------------------------------------------------------------------
# 5. DDP's rule: without find_unused_parameters a parameter that will get no gradient is an error as
# soon as the forward that left it out ends, before backward issues a collective (a rank whose unit
# waits for a gradient that never comes would pair its collectives with the wrong ones of its
# peers). With find_unused_parameters, which units are complete when depends on each rank's data,
# so every reduce-scatter waits for finish_gradient_sync, where all units go in a fixed order, zeros
# where a gradient did not arrive; a parameter no rank used is not stepped. The price: full
# gradients live until then (ZeRO-2's gradient memory).
# ---------------------------------------------------------------------------------------------
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


def check_every_parameter_reached(out, params: list, model) -> None:
    """After the forward, before backward issues a collective: each of `params` (of the units
    this forward ran: a pipeline rank holding several chunks runs one per forward) is reachable."""
    reached = reachable_parameters(out)
    missing = [p for p in params if p not in reached]
    if missing:
        names = [n for n, p in model.named_parameters() if any(p is m for m in missing)]
        raise RuntimeError(
            f"ZeRO-3: parameters will receive no gradient this step: {names[:5]}. Like DDP, "
            f"pass find_unused_parameters=True, or freeze them (requires_grad=False).")


def check_units_complete(units, model) -> None:
    """At the sync: every unit reduced its whole gradient (none waits for one, none for a W)."""
    for u in units:
        if u.grad_shard is None or u.ready or u.guard.accumulated:
            names = [n for n, p in model.named_parameters()
                     if any(p is q for q in u.params) and p.grad is None]
            raise RuntimeError(f"ZeRO-3: unit {type(u.module).__name__} got no complete "
                               f"gradient this step (missing: {names[:5]}); pass "
                               f"find_unused_parameters=True")


# ---------------------------------------------------------------------------------------------
# 6. zero-bubble deferral (ZeroBubbleUnits, UnitGuards.later, whole_after_w): a zero-bubble
# pipeline's W computes weight gradients after B, outside autograd, so no hook sees them. B
# computes only dX = dY W (it needs the gathered weights) and queues X and dY; W computes
# dW = dY^T X into p.grad and reads no weight: the unit is freed when B is done, as after a full
# backward, and W does not gather it again. Its reduce-scatter waits for W: then, per micro-batch
# as under 1F1B, the same 3 Psi, and the full weight gradient lives only inside W. What B left in
# p.grad (the LayerNorms') waits there, full size, and rides along; a B of the next micro-batch may
# add to it first, which changes nothing: a reduce-scatter of a sum is the sum of two. (A unit with
# no Linear, the embeddings, is reduced by B as before.) torch.distributed.pipelining keeps an FSDP2
# stage unsharded for W instead, and reduce-scatters once after the last micro-batch: full
# gradients and weights for the whole step.
# ---------------------------------------------------------------------------------------------
class ZeroBubbleUnits:
    """Zero3DataParallel's GradientStrategy hooks for a zero-bubble pipeline's W ops (pipeline.py)."""

    def grad_deferred(self, p: torch.nn.Parameter) -> None:
        """B queued p's weight gradient for a W: for this backward it counts as arrived (the unit
        may be freed), and from now on the unit is reduced by W (`grad_accumulated`), not by B."""
        self._unit_of[p].guard.later.add(p)
        self._on_grad_ready(p)

    def grad_accumulated(self, p: torch.nn.Parameter) -> None:
        """W added its micro-batch's gradient to p.grad: once the unit holds that micro-batch's
        whole gradient, reduce-scatter it (the unit stays freed: reducing reads p.grad, not p)."""
        if self._unit_of[p].guard.whole_after_w(p) and not self.find_unused:
            self._reduce(self._unit_of[p])
