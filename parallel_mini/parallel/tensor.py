"""Tensor parallelism, Megatron-style (Shoeybi et al., 2019, "Megatron-LM").

Split each layer's weight matrices across the tp ranks so that no rank holds (or computes) a whole
layer. Two ways to split Y = X W:
- column-parallel: W = [W_0 | W_1 | ...] (output features split). Rank r computes Y_r = X W_r, a
  slice of Y's columns. Needs the full X on every rank.
- row-parallel: W = [W_0; W_1; ...] (input features split). Rank r holds X's matching slice and
  computes a partial sum X_r W_r; the sum over ranks (an all-reduce) is Y.
Column then row needs no communication in between: the MLP (fc column, GELU, proj row) and
attention (QKV column, i.e. heads split; out-projection row) each cost one all-reduce forward and
one backward. Everything rests on two conjugate operators (autograd functions below):
    f: identity forward, all-reduce backward   (before a column-parallel layer)
    g: all-reduce forward, identity backward   (after a row-parallel layer)
The vocabulary is split too: each rank embeds only its token range (all-reduce to combine), and the
LM head is column-parallel with a vocabulary-parallel cross-entropy, so no rank ever materialises
the full [b, s, v] logits.

Sequence parallelism (Korthikanti et al., 2022): outside the matmuls (LayerNorms, residuals,
dropout) plain TP keeps [b, s, h] replicated on every rank. SP splits those along the sequence,
[b, s/t, h], and swaps each all-reduce for an all-gather (before a column-parallel layer) and a
reduce-scatter (after a row-parallel one): the same bytes (an all-reduce *is* a reduce-scatter
plus an all-gather), activations divided by t. Parameters used on sequence shards (LayerNorms,
row-parallel biases, position embeddings) see only part of the sequence, so their gradients are
summed over tp.

Every rank first builds the full model from the same seed, then keeps its slices: the shards are
exactly the reference's weights, which is what makes equality with one process testable.
`apply_tensor_parallel` changes the model only by replacing modules (the embedding, the head, the
blocks' Linear layers): pipeline stages, checkpointing and data parallel then apply unchanged.
The mesh axis (normally "tp") is passed by name to everything that communicates.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm
from ..model import GPT, MLP, Embedding, LMHead, linear, token_positions
from ..placement import Block, Box, local_shape, split, whole


# ---------------------------------------------------------------------------------------------
# the two conjugate operators
# ---------------------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the input-gradients of the column-parallel slices."""

    @staticmethod
    def forward(ctx, x, comm, axis, module):
        ctx.comm, ctx.axis, ctx.module = comm, axis, module
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, ctx.axis, layer="f", module=ctx.module)
        return grad, None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward sums the row-parallel partial products; identity backward."""

    @staticmethod
    def forward(ctx, x, comm, axis, module):
        x = x.contiguous()
        comm.all_reduce(x, axis, layer="g", module=module)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherSequence(torch.autograd.Function):
    """SP, before a column-parallel layer: all-gather [b, s/t, h] -> [b, s, h]; backward
    reduce-scatters the gradient back to sequence shards."""

    @staticmethod
    def forward(ctx, x, comm, axis, module):
        ctx.comm, ctx.axis, ctx.module = comm, axis, module
        return _seq_all_gather(x, comm, axis, module)

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.comm, ctx.axis, ctx.module), None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """SP, after a row-parallel layer: reduce-scatter the partial sums [b, s, h] -> [b, s/t, h];
    backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, comm, axis, module):
        ctx.comm, ctx.axis, ctx.module = comm, axis, module
        return _seq_reduce_scatter(x, comm, axis, module)

    @staticmethod
    def backward(ctx, grad):
        return _seq_all_gather(grad, ctx.comm, ctx.axis, ctx.module), None, None, None


def _seq_all_gather(x, comm, axis, module=""):  # [b, s/t, h] -> [b, s, h]
    xt = x.transpose(0, 1).contiguous()  # sequence first: collectives concatenate along dim 0
    out = torch.empty((xt.shape[0] * comm.size(axis),) + xt.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather(out, xt, axis, layer="sp", module=module)
    return out.transpose(0, 1)


def _seq_reduce_scatter(x, comm, axis, module=""):  # [b, s, h] -> [b, s/t, h], summed over tp
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] // comm.size(axis),) + xt.shape[1:], dtype=x.dtype,
                      device=x.device)
    comm.reduce_scatter(out, xt, axis, layer="sp", module=module)
    return out.transpose(0, 1)


def copy_to_tp(x, comm, sp=False, module="", axis="tp"):
    """`module` names the layer in the comm records (per-layer accounting)."""
    op = _GatherSequence if sp else _CopyToTP
    return op.apply(x, comm, axis, module)


def reduce_from_tp(x, comm, sp=False, module="", axis="tp"):
    op = _ReduceScatterSequence if sp else _ReduceFromTP
    return op.apply(x, comm, axis, module)


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
def _cut(t: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """This rank's blocks of the full tensor t, each put at its local offsets: a fresh tensor."""
    out = t.new_empty(local_shape(blocks))
    for b in blocks:
        out[Box(b.local, b.full.sizes).index()] = t.detach()[b.full.index()]
    return out


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = f(x)[..., in] @ W_r^T + b_r, W_r = rows r of W [out, in] (a slice of outputs).
    `parts`: W's rows are that many equal blocks (QKV: [q | k | v], 3), each split over tp, so that
    rank r holds [q_r | k_r | v_r]: whole heads."""

    weight_grads = None  # the zero-bubble seam, as model.Linear's

    def __init__(self, layer: nn.Linear, comm: Comm, axis: str = "tp", parts: int = 1,
                 sp: bool = False):
        super().__init__()
        self.comm, self.axis, self.sp, self.parts = comm, axis, sp, parts
        self.full_shapes = {"weight": tuple(layer.weight.shape)}
        self.weight = nn.Parameter(_cut(layer.weight, self.placement("weight")))  # [out/tp, in]
        self.bias = None
        if layer.bias is not None:
            self.full_shapes["bias"] = tuple(layer.bias.shape)
            self.bias = nn.Parameter(_cut(layer.bias, self.placement("bias")))  # [out/tp]
        self.name = ""  # set by apply_tensor_parallel: the layer's name in the comm records

    def placement(self, p_name: str) -> list[Block]:
        """Which rows of the full weight (bias) this rank holds: rows r of each of the parts."""
        return split(self.full_shapes[p_name], 0, self.comm.size(self.axis),
                     self.comm.rank(self.axis), self.parts)

    def forward(self, x):  # x: [b, s, in] (SP: [b, s/tp, in]) -> [b, s, out/tp]
        x = copy_to_tp(x, self.comm, self.sp, self.name, self.axis)
        return linear(x, self.weight, self.bias, self)


class RowParallelLinear(nn.Module):
    """y[..., out] = g(x_r[..., in/tp] @ W_r^T) + b, W_r = columns r of W [out, in]."""

    weight_grads = None

    def __init__(self, layer: nn.Linear, comm: Comm, axis: str = "tp", sp: bool = False):
        super().__init__()
        self.comm, self.axis, self.sp = comm, axis, sp
        self.full_shape = tuple(layer.weight.shape)
        self.weight = nn.Parameter(_cut(layer.weight, self.placement("weight")))  # [out, in/tp]
        self.bias = nn.Parameter(layer.bias.detach().clone()) if layer.bias is not None else None
        self.name = ""

    def placement(self, p_name: str) -> list[Block]:
        """Columns r of the full weight; the bias whole (added once, after the sum)."""
        if p_name == "bias":
            return whole(tuple(self.bias.shape))
        return split(self.full_shape, 1, self.comm.size(self.axis), self.comm.rank(self.axis))

    def forward(self, x):  # x: [b, s, in/tp] -> [b, s, out] (SP: [b, s/tp, out])
        partial = linear(x, self.weight, None, self)
        y = reduce_from_tp(partial, self.comm, self.sp, self.name, self.axis)  # sum over tp
        return y + self.bias if self.bias is not None else y  # bias once, after the sum


class VocabParallelEmbedding(nn.Module):
    """Rank r holds embedding rows [r*v/tp, (r+1)*v/tp); tokens outside its range embed to zero,
    and an all-reduce assembles every token's row."""

    def __init__(self, emb: nn.Embedding, comm: Comm, axis: str = "tp", sp: bool = False):
        super().__init__()
        self.comm, self.axis, self.sp = comm, axis, sp
        self.full_shape = tuple(emb.weight.shape)
        (block,) = self.placement("weight")
        self.per_rank, self.start = block.full.sizes[0], block.full.offsets[0]
        self.weight = nn.Parameter(_cut(emb.weight, [block]))  # [v/tp, h]
        self.name = ""

    def placement(self, p_name: str) -> list[Block]:
        """Rows [start, start + v/tp) of the table."""
        return split(self.full_shape, 0, self.comm.size(self.axis), self.comm.rank(self.axis))

    def forward(self, idx):  # idx: [b, s] -> [b, s, h] (SP: [b, s/tp, h])
        local = idx - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.comm, self.sp, self.name, self.axis)


class ParallelEmbedding(nn.Module):
    """The model's Embedding with the token table split over the vocabulary. With SP the output is
    this rank's slice of the sequence, so it adds the position rows of that slice only."""

    def __init__(self, embed: Embedding, comm: Comm, axis: str = "tp", sp: bool = False):
        super().__init__()
        self.comm, self.axis, self.sp = comm, axis, sp
        self.tok = VocabParallelEmbedding(embed.tok, comm, axis, sp)
        self.pos = embed.pos

    positions = None  # the model's Embedding seam: context parallel sets this rank's positions

    def forward(self, idx, positions=None):  # idx: [b, s] -> [b, s, h] (SP: [b, s/tp, h])
        positions = token_positions(self, idx, positions)
        if self.sp:  # this rank's slice of the positions
            positions = positions.chunk(self.comm.size(self.axis))[self.comm.rank(self.axis)]
        return self.tok(idx) + self.pos(positions)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from logits split over the vocabulary, [N, v/tp] on each rank.

    loss_i = log(sum_j exp z_ij) - z_i,target: the max, the sum of exponentials and the target's
    logit are each combined with one all-reduce over tp (of N numbers, not N*v)."""

    @staticmethod
    def forward(ctx, logits, target, start, comm, axis):  # logits [N, v/tp], target [N]
        logits = logits.float()
        zmax = logits.max(dim=-1).values  # [N]
        comm.all_reduce(zmax, axis, op=torch.distributed.ReduceOp.MAX, layer="ce")
        z = logits - zmax.unsqueeze(-1)
        local_t = target - start
        mine = (local_t >= 0) & (local_t < logits.shape[-1])
        idx = local_t.clamp(0, logits.shape[-1] - 1)
        z_target = torch.where(mine, z.gather(1, idx.unsqueeze(1)).squeeze(1), torch.zeros_like(zmax))
        comm.all_reduce(z_target, axis, layer="ce")
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, axis, layer="ce")
        ctx.save_for_backward(exp, sum_exp, idx, mine)
        loss = (sum_exp.log() - z_target).mean()
        # Gloo's worker thread can hold the last reference to an all-reduced tensor for a while
        # after the op: these two [N] temporaries would then be freed at a moment that depends on
        # thread timing, and the activation meter read 1 KiB (N = 256 fp32) more, now and then.
        for done in (zmax, z_target):
            done.untyped_storage().resize_(0)
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp, sum_exp, idx, mine = ctx.saved_tensors
        p = exp / sum_exp.unsqueeze(-1)  # softmax slice [N, v/tp]
        p[mine, idx[mine]] -= 1.0  # minus the one-hot target, where the target is in my slice
        return p * (grad / p.shape[0]), None, None, None, None


class ParallelLMHead(nn.Module):
    """The model's LMHead with a column-parallel output layer and a vocabulary-parallel loss: no
    rank ever materialises the full [b, s, v] logits."""

    def __init__(self, head: LMHead, comm: Comm, axis: str = "tp", sp: bool = False):
        super().__init__()
        self.comm, self.axis = comm, axis
        self.norm = head.norm
        self.out = ColumnParallelLinear(head.out, comm, axis, sp=sp)
        self.vocab_start = self.out.placement("weight")[0].full.offsets[0]

    def forward(self, x, targets=None):  # x: [b, s, h] (SP: [b, s/tp, h])
        logits = self.out(self.norm(x))  # [b, s, v/tp]: never the full vocabulary
        if targets is None:
            return logits
        return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(),
                                                self.vocab_start, self.comm, self.axis)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
def qkv_rows_by_rank(n):
    """QKV's weight rows are [q (h) | k (h) | v (h)]: reorder so that chunk r holds q, k and v of
    rank r's heads, the rows ColumnParallelLinear(parts=3) cuts (placement.split). Then a
    contiguous row split, DTensor's (course/peers.py), gives each rank whole heads too."""
    def order(t):
        q, k, v = t.chunk(3, dim=0)
        return torch.cat([torch.cat([a.chunk(n, 0)[r] for a in (q, k, v)]) for r in range(n)])
    return order


def apply_tensor_parallel(model: GPT, comm: Comm, sp: bool = False, axis: str = "tp") -> GPT:
    """Shard `model` in place over the mesh axis `axis` (with sequence parallel when `sp`), by
    replacing modules. Layout errors were refused by RunConfig."""
    n = comm.size(axis)
    if n == 1:
        return model
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear(attn.qkv, comm, axis, parts=3, sp=sp)  # q, k, v
        attn.proj = RowParallelLinear(attn.proj, comm, axis, sp=sp)  # attention infers a/tp heads
        # A mixture of experts stays whole on every tp rank. Without SP its input and output
        # gradient are the same on all of them; with SP each routes its own sequence shard
        # (parallel/expert.py, route_whole_sequences).
        if isinstance(mlp, MLP):
            mlp.fc = ColumnParallelLinear(mlp.fc, comm, axis, sp=sp)
            mlp.proj = RowParallelLinear(mlp.proj, comm, axis, sp=sp)
    model.embed = ParallelEmbedding(model.embed, comm, axis, sp=sp)
    model.head = ParallelLMHead(model.head, comm, axis, sp=sp)
    for name, module in model.named_modules():  # each layer names itself in its comm records
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            module.name = name
    if sp:
        sum_gradients_over_tp(sequence_parallel_params(model), comm, axis)
    return model


def sequence_parallel_params(model: GPT) -> list[nn.Parameter]:
    """Replicated parameters that SP applies to sequence shards: each rank's gradient covers only
    its part of the sequence, the true gradient is the sum over tp. (A mixture of experts' router
    and experts are such parameters too, but expert parallel may replace the experts after this:
    parallel/expert.py's route_whole_sequences hooks them once they are final.)"""
    params = list(model.embed.pos.parameters()) + list(model.head.norm.parameters())
    for block in model.blocks:
        params += list(block.ln1.parameters()) + list(block.ln2.parameters())
        params += [block.attn.proj.bias]
        params += [block.mlp.proj.bias] if isinstance(block.mlp, MLP) else []
    return [p for p in params if p is not None]


def sum_gradients_over_tp(params: list[nn.Parameter], comm: Comm, axis: str = "tp") -> None:
    """Each backward, sum these parameters' gradients over the tp ranks (see _sum_over_tp)."""
    for p in params:
        p.register_hook(lambda grad: _sum_over_tp(grad, comm, axis))


def _sum_over_tp(grad: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """Runs on the gradient *before* it is accumulated, once per backward (so accumulation and
    any data-parallel sync downstream see the full gradient)."""
    grad = grad.contiguous()
    comm.all_reduce(grad, axis, layer="sp-grads")
    return grad
