"""Expert parallelism: each of P ranks holds E/P of a mixture-of-experts layer's experts, and the
tokens travel to their expert's rank and back with two all-to-alls (GShard, Lepikhin et al., 2020;
Switch Transformer, Fedus et al., 2022). Read moe.py first: routing, capacity, dispatch order.

The ep ranks are carved out of the data-parallel ranks (mesh.py): they see different tokens, and
between them they hold every expert once. Per MoE layer and micro-batch, on each ep rank:
1. route its own tokens (moe.py); its kept rows are sorted by expert, hence by destination rank
   (rank p holds experts [p E/P, (p+1) E/P)).
2. counts: one small all-to-all of the rows per expert [E], so that every rank knows how many rows
   it will receive from whom (the splits of step 3 are uneven and data-dependent).
3. dispatch: all_to_all_single with uneven splits: rows [n, h] -> the rows for my experts [m, h],
   by source rank, then regrouped by expert.
4. the E/P local experts run on their rows.
5. combine: the inverse all-to-all brings each output home, where the gates weigh it and it is
   added back at its token's place (moe.py). Backward runs the two all-to-alls the other way.
Bytes: each all-to-all moves a rank's rows for other ranks: with uniform routing and no drops
(P-1)/P of its tokens*k rows of h elements, four times per layer and micro-batch (dispatch and
combine, forward and backward): theory.ep_wire_bytes_per_step.

With context parallel a rank holds S/C tokens of every sequence, with sequence parallel a tp rank
holds 1/T of those, but a routing group is a whole sequence (its capacity, its queues in token
order). `WholeSequences`: the ranks holding parts of a sequence all-gather their router logits
(b S E numbers, no gradient; over tp, then over cp), each routes the whole sequences alike and
keeps its own tokens' decisions; gradient flows only through its own tokens' logits.

Gradients. An expert's weight gradient on its rank sums the contributions of every token routed to
it from the P ranks of its ep group, each rank's loss already a mean over its own tokens. The
expert's replicas (the same experts in the other ep groups: the "edp" axis, (dp x cp)/P ranks)
average over edp; the extra 1/P (a hook on the expert weights) makes the whole 1/(dp x cp), as the
dense weights get by averaging over all data-parallel ranks. So the strategy (plain data parallel
or ZeRO-1/2) is built twice: once over the dense parameters and the dp x cp ranks, once over the
expert parameters and the edp ranks (`ExpertAndDense`); ZeRO shards each over its own group.
ZeRO-3, which gathers per module, needs no second strategy: each layer's experts are a unit of
their own over edp (zero3.py, `apart`; FSDP2's nested fully_shard). With HYBRID_SHARD an expert's
edp replicas split into edp_shard x edp_rep, as the dense ranks into shard x replicate (mesh.py).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
import torch.nn as nn

from ..comm import Comm
from ..meters import RoutingLog
from ..interfaces import GradientStrategy, Held, Piece
from ..moe import MoE, Experts
from ..placement import Block, split
from .context import positions_of
from .tensor import sum_gradients_over_tp


class _AllToAll(torch.autograd.Function):
    """rows [n, h] -> [sum(out_splits), h]: in_splits[p] rows to rank p, out_splits[p] from it.
    Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, comm: Comm, axis: str, out_splits: list[int], in_splits: list[int], tags):
        ctx.args = comm, axis, out_splits, in_splits, tags
        return _exchange(x, comm, axis, out_splits, in_splits, tags)

    @staticmethod
    def backward(ctx, grad):
        comm, axis, out_splits, in_splits, tags = ctx.args
        back = _exchange(grad, comm, axis, in_splits, out_splits, {**tags, "pass": "backward"})
        return back, None, None, None, None, None


def _exchange(x, comm, axis, out_splits, in_splits, tags):
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    comm.all_to_all(out, x.contiguous(), axis, out_splits, in_splits, **tags)
    return out


class ShardedExperts(Experts):
    """E/P of the experts (the same names, a slice along the expert dimension), and the all-to-all
    that brings them their rows from every rank of the ep group."""

    def __init__(self, full: Experts, comm: Comm, axis: str, layer: int):
        # (plain attributes may be set before nn.Module's __init__: placement needs them)
        self.full_shapes = {name: tuple(p.shape) for name, p in full.named_parameters()}
        self.comm, self.axis, self.n_total, self.layer = comm, axis, len(full), layer
        (block,) = self.placement("fc_weight")
        super().__init__(block.full.sizes[0], full.fc_weight.shape[2], first=block.full.offsets[0])
        self.to(full.fc_weight)  # the run's dtype and device
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(getattr(full, name)[self.placement(name)[0].full.index()])

    def placement(self, p_name: str) -> list[Block]:
        """Experts [first, first + E/P) of every stacked expert tensor."""
        return split(self.full_shapes[p_name], 0, self.comm.size(self.axis),
                     self.comm.rank(self.axis))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        P, n, tags = self.comm.size(self.axis), len(self), {"layer": "moe", "block": self.layer}
        # 2. counts: received[p, j] = rows rank p sends to my j-th expert
        received = torch.empty_like(counts)
        self.comm.all_to_all(received, counts, self.axis, **tags, phase="counts")
        received = received.view(P, n)
        send_splits = counts.view(P, n).sum(1).tolist()  # my rows for rank p's experts
        recv_splits = received.sum(1).tolist()
        # 3. dispatch: [n_rows, h] -> [m, h] ordered (source rank, expert); regroup by expert
        mine = _AllToAll.apply(rows, self.comm, self.axis, recv_splits, send_splits,
                               {**tags, "phase": "dispatch"})
        by_expert = _source_to_expert_order(received)  # [m] indices
        # 4. the local experts
        y = self.compute(mine[by_expert], received.sum(0).tolist())  # [m, h]
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(len(by_expert), device=by_expert.device)
        # 5. combine: outputs home, in the order their rows left
        return _AllToAll.apply(y[back], self.comm, self.axis, send_splits, recv_splits,
                               {**tags, "phase": "combine"})


def _source_to_expert_order(received: torch.Tensor) -> torch.Tensor:
    """received [P, n] rows per (source, expert), laid out source-major; the row indices that
    list them expert-major (expert 0's rows from rank 0, rank 1, ..., then expert 1's)."""
    P, n = received.shape
    offsets = torch.cat([received.new_zeros(1), received.flatten().cumsum(0)[:-1]]).view(P, n)
    runs = [torch.arange(offsets[p, j], offsets[p, j] + received[p, j])
            for j in range(n) for p in range(P)]
    return torch.cat(runs) if runs else received.new_zeros(0)


class WholeSequences:
    """MoE.whole_sequences when sequences are split between ranks: this rank's router logits
    [b, n, E] -> the whole sequences' [b, S, E] (the other parts all-gathered, detached) and this
    rank's positions in them. `levels`, innermost first, each (axis, positions of each of its
    ranks' parts in the sequence one level up):
    - sequence parallel (tp): tp rank t holds the t-th contiguous 1/T of what the level above
      holds (tensor.py's LayerNorm/residual regions, [b, s/T, h]);
    - context parallel (cp): cp rank c holds S/C positions, zigzag or contiguous (context.py).
    Under cp x sp the two nest: [b, S/(C T), E] -> over tp [b, S/C, E] -> over cp [b, S, E]."""

    def __init__(self, comm: Comm, levels: list[tuple[str, list[torch.Tensor]]],
                 loss_parts: int):
        self.comm, self.levels = comm, levels
        self.loss_parts = loss_parts  # ranks the term's gradient is averaged over (moe.MoE.forward)
        self.mine = None  # this rank's positions in the whole sequence, level by level outwards
        for axis, positions in levels:
            here = positions[comm.rank(axis)]
            self.mine = here if self.mine is None else here[self.mine]

    def __call__(self, logits: torch.Tensor, layer: int):
        whole = logits.detach()
        for axis, positions in self.levels:
            whole = self._gather(whole, axis, positions, layer)
        mine = self.mine.to(logits.device)
        return whole.index_copy(1, mine, logits), mine  # my rows: the ones with gradient

    def _gather(self, part: torch.Tensor, axis: str, positions, layer: int) -> torch.Tensor:
        b, n, E = part.shape
        parts = part.new_empty(len(positions) * b, n, E)  # [R b, n, E] by rank of `axis`
        self.comm.all_gather(parts, part.contiguous(), axis, layer="moe_routing", block=layer)
        out = part.new_empty(b, n * len(positions), E)  # [b, R n, E]
        for p, pos in zip(parts.split(b), positions):
            out[:, pos.to(part.device)] = p
        return out


class ExpertParallel:
    """What apply_expert_parallel did: the MoE layers, their logs, and the expert parameters."""

    def __init__(self, layers: list[MoE], comm: Comm, axis: str | None):
        self.layers, self.comm, self.axis = layers, comm, axis
        self.sharded = axis is not None and comm.size(axis) > 1

    def route_whole_sequences(self, context, seq: int, sp_axis: str | None = None) -> None:
        """Context parallel (context.ContextParallel) and sequence parallel (over `sp_axis`, the
        tp ranks) split sequences of `seq` tokens: route them whole. Under sp each tp rank
        dispatches only its own tokens (the expert work is split over tp, not repeated), so its
        router and expert gradients cover only those: the true gradient is their sum over tp, as
        for the other parameters sp applies to sequence shards (tensor.py). Megatron-Core's
        dispatchers also start from a tp rank's b s/tp tokens, but cap each rank's tokens on their
        own (only the load-balancing loss sums its counts over the tp x cp group); routing whole
        sequences keeps the reference's drops. ("MoE parallel folding", Liu et al., 2025, folds tp
        into the experts' data-parallel ranks, which reduce their gradients once per step; here
        the sum over tp runs every micro-step, apart from the average over edp.)"""
        levels, comm = [], self.comm
        T = comm.size(sp_axis) if sp_axis is not None else 1
        if T > 1:
            here = seq // context.c  # [b, S/C] of a cp rank, cut into T contiguous chunks
            levels.append((sp_axis, list(torch.arange(here).chunk(T))))
            for moe in self.layers:  # see moe.MoE.forward for why the aux term needs no x T
                params = list(moe.router.parameters()) + list(moe.experts.parameters())
                sum_gradients_over_tp(params, comm, sp_axis)
        if context.c > 1:
            layout = "zigzag" if context.impl == "zigzag" else "contiguous"
            levels.append((context.axis, [positions_of(layout, seq, context.c, r)
                                          for r in range(context.c)]))
        if levels:
            whole = WholeSequences(comm, levels, loss_parts=context.c)
            for moe in self.layers:
                moe.whole_sequences = whole

    def expert_parameter_names(self, model: nn.Module) -> set[str]:
        return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, Experts)
                for p, _ in m.named_parameters()}

    def report(self) -> dict:
        """The MoE layers that ran here (a pipeline stage has only its own) and their logs."""
        ran = [m for m in self.layers if m.log]
        if not ran:
            return {}
        return {"moe": {"layers": [m.layer for m in ran],
                        "log": [entry for m in ran for entry in m.log],
                        "experts_here": {m.layer: [m.experts.first, len(m.experts)] for m in ran},
                        "backward_marks": {m.layer: m.experts.backward_marks for m in ran}}}


def apply_expert_parallel(model: nn.Module, comm: Comm, axis: str | None,
                          loss_scale: float = 1.0) -> ExpertParallel:
    """Give every MoE layer its log and aux-loss scale, and, over `axis` (ep > 1), replace its
    experts by this rank's slice of them."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    P = comm.size(axis) if axis is not None else 1
    for moe in layers:
        moe.log, moe.clock, moe.loss_scale = RoutingLog(), (lambda: comm.step), loss_scale
        if P > 1:
            moe.experts = ShardedExperts(moe.experts, comm, axis, moe.layer)
            for p in moe.experts.parameters():  # see the module's docstring: 1/P, then the edp mean
                p.register_hook(lambda g, P=P: g / P)
    return ExpertParallel(layers, comm, axis if P > 1 else None)


# ---------------------------------------------------------------------------------------------
# Two gradient strategies, one model: dense parameters over dp x cp, experts over edp
# ---------------------------------------------------------------------------------------------
class ParameterSubset(nn.Module):
    """Some of a model's parameters under their names in the model: what a gradient strategy wraps
    when the parameters of one model reduce over different groups. It has no forward."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        super().__init__()
        self._named = named  # a plain list: not registered as this module's own

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from self._named

    def parameters(self, recurse: bool = True):
        yield from (p for _, p in self._named)

    def buffers(self, recurse: bool = True):
        return iter(())


def split_parameters(model: nn.Module, expert_names: set[str]) -> tuple[ParameterSubset, ParameterSubset]:
    named = list(model.named_parameters())
    return (ParameterSubset([(n, p) for n, p in named if n not in expert_names]),
            ParameterSubset([(n, p) for n, p in named if n in expert_names]))


class ExpertAndDense(GradientStrategy):
    """GradientStrategy (interfaces.py) made of two: one for the dense parameters, one for the
    experts. Every call goes to both, dense first, in the same order on every rank."""

    def __init__(self, dense, experts):
        self.parts = (dense, experts)
        self.optimizer = dense.optimizer  # (PipeDream, which steps it itself, is refused with EP)

    def zero_grad(self) -> None:
        for s in self.parts:
            s.zero_grad()

    @contextmanager
    def sync(self, enabled: bool = True):
        with ExitStack() as stack:
            for s in self.parts:
                stack.enter_context(s.sync(enabled))
            yield

    def finish_gradient_sync(self) -> None:
        for s in self.parts:
            s.finish_gradient_sync()

    def step(self) -> None:
        for s in self.parts:
            s.step()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for s in self.parts:
            for k, v in s.state_tensors().items():
                out.setdefault(k, []).extend(v)
        return out

    def buffers(self) -> list[torch.Tensor]:
        return [b for s in self.parts for b in s.buffers()]

    def transient_bytes(self) -> int:
        return sum(s.transient_bytes() for s in self.parts)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {k: v for s in self.parts for k, v in s.full_parameters().items()}

    def owned(self, held: Held) -> list[Piece]:
        return [piece for s in self.parts for piece in s.owned(held)]

    def loaded(self) -> None:
        for s in self.parts:
            s.loaded()

    def grad_deferred(self, p: nn.Parameter) -> None:
        for s in self.parts:
            s.grad_deferred(p)

    def grad_accumulated(self, p: nn.Parameter) -> None:
        for s in self.parts:
            s.grad_accumulated(p)
