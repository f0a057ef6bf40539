"""Mixture of experts: the MLP of a block replaced by E expert MLPs and a router that sends each
token to k of them (Shazeer et al., 2017; GShard, Lepikhin et al., 2020; Switch Transformer,
Fedus et al., 2022). Parameters grow E-fold, the compute per token only k-fold.

Read in this order, each a pure function the lesson runs by itself:
1. `route`: a softmax over the E router logits of every token; the k most probable experts win
   (ties go to the lower expert index: a stable sort), and their probabilities, renormalised to
   sum to 1, are the gates that weigh the experts' outputs.
2. capacity and dropping: an expert takes at most C = ceil(F * tokens * k / E) tokens of a routing
   group (F = the capacity factor; 1.0 = exactly its fair share). Its queue is filled first with
   every token's first choice in token order, then the second choices, ...; an assignment whose
   place in the queue is >= C is dropped: that expert does not see the token, and if all its
   choices were dropped the token passes the layer through the residual connection alone.
   A routing group here is one whole sequence, whatever the layout: when context parallel or
   sequence parallel splits sequences between ranks, the `whole_sequences` seam
   (parallel/expert.py) lets every rank route the whole sequence and keep its own tokens, so every
   parallel run drops exactly the tokens the single-process reference drops.
3. `dispatch_order`: the kept assignments sorted by expert, so that each expert's tokens are one
   contiguous run of rows (and, under expert parallel, each destination rank's rows too).
4. the losses that keep the router honest, added to the training loss through `AuxLoss`:
   - load balancing (Switch eq. 4): E * sum_e f_e * P_e, f_e the share of assignments expert e
     got, P_e the mean router probability for e. It is 1 when routing is uniform, up to E when
     everything goes to one expert: without it a few experts win early and starve the rest.
   - router z-loss (ST-MoE, Zoph et al., 2022): mean (logsumexp of the logits)^2, keeps the
     logits small (bf16 softmax stays exact).

The MoE layer has two seams: `experts`, the module that turns the dispatched rows into outputs
(here all E experts are local; expert parallel, parallel/expert.py, puts in one that holds E/P of
them and moves the rows to their expert's rank with all-to-all), and `routing`, the function
`route` (a lesson's exercise puts the learner's own in its place).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .meters import ComputeTimer, log_routing


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots per expert for a routing group of `tokens` tokens: ceil(F * tokens * k / E)."""
    return math.ceil(factor * tokens * top_k / experts)


@dataclass
class Routing:
    expert: torch.Tensor  # [g, t, k] int64: the k experts each token chose, most probable first
    gate: torch.Tensor    # [g, t, k] fp32: their probabilities renormalised over the k
    slot: torch.Tensor    # [g, t, k] int64: the assignment's place in its expert's queue
    keep: torch.Tensor    # [g, t, k] bool: slot < capacity (False: dropped)
    probs: torch.Tensor   # [g, t, E] fp32: the router's softmax

    def at(self, positions: torch.Tensor) -> "Routing":
        """The same decisions for the tokens at `positions` of every group only."""
        return Routing(*(t[:, positions] for t in (self.expert, self.gate, self.slot, self.keep,
                                                   self.probs)))


def route(logits: torch.Tensor, top_k: int, cap: int) -> Routing:
    """logits [g, t, E] (g routing groups of t tokens) -> who goes where, and what is dropped."""
    E = logits.shape[-1]
    probs = logits.float().softmax(-1)  # [g, t, E]
    # stable: equal probabilities keep index order, so ties go to the lower expert, on every rank
    p_sorted, e_sorted = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_p, expert = p_sorted[..., :top_k], e_sorted[..., :top_k]  # [g, t, k]
    gate = top_p / top_p.sum(-1, keepdim=True)
    # the queues: all first choices in token order, then all second choices, ...
    onehot = F.one_hot(expert.transpose(1, 2), E)  # [g, k, t, E]
    before = onehot.flatten(1, 2).cumsum(1).view_as(onehot) - onehot  # assignments queued before
    slot = (before * onehot).sum(-1).transpose(1, 2)  # [g, t, k]
    return Routing(expert, gate, slot, slot < cap, probs)


def dispatch_order(r: Routing, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept assignments sorted by (expert, group, slot): for each, the token's row in the
    flattened [g*t, h] input and its gate; and the rows per expert [E]."""
    g, t, k = r.expert.shape
    group = torch.arange(g, device=r.expert.device).view(g, 1, 1).expand(g, t, k)
    token = torch.arange(g * t, device=r.expert.device).view(g, t, 1).expand(g, t, k)
    expert, slot = r.expert[r.keep], r.slot[r.keep]  # [n]
    key = (expert * g + group[r.keep]) * (t * k) + slot  # unique per kept assignment
    order = key.argsort()
    counts = torch.bincount(expert, minlength=E)  # [E]
    return token[r.keep][order], r.gate[r.keep][order], counts


def load_balancing_loss(r: Routing) -> torch.Tensor:
    """Switch Transformer's auxiliary loss per routing group, averaged over the groups."""
    g, t, k = r.expert.shape
    E = r.probs.shape[-1]
    f = F.one_hot(r.expert, E).sum((1, 2)).float() / (t * k)  # [g, E] share of assignments
    P = r.probs.mean(1)  # [g, E] mean probability
    return (E * (f * P).sum(-1)).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2."""
    return logits.float().logsumexp(-1).square().mean()


class AuxLoss(torch.autograd.Function):
    """Adds a loss term to the objective without carrying it to the head: the output passes
    unchanged, and backward gives the term the gradient `scale` (Megatron-LM's
    MoEAuxLossAutoScaler). The runner divides each micro-batch's loss by the micro-batches it
    accumulates; `scale` is that same 1/m, so the term is weighted exactly as in one process."""

    @staticmethod
    def forward(ctx, out, term, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class Experts(nn.Module):
    """`n` expert MLPs [h -> 4h -> h] with their weights stacked along a first expert dimension, so
    that expert parallel keeps a slice of them under the same names. `first`: the global index
    of the first expert held here."""

    def __init__(self, n: int, d_model: int, first: int = 0):
        super().__init__()
        h = d_model
        self.first = first
        self.timer = ComputeTimer("experts")  # forward seconds and backward marks, for the report
        self.backward_marks = self.timer.backward_marks
        self.fc_weight = nn.Parameter(torch.empty(n, 4 * h, h))
        self.fc_bias = nn.Parameter(torch.zeros(n, 4 * h))
        self.proj_weight = nn.Parameter(torch.empty(n, h, 4 * h))
        self.proj_bias = nn.Parameter(torch.zeros(n, h))

    def __len__(self) -> int:
        return self.fc_weight.shape[0]

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [n, h], the first counts[0] for expert 0 here, ... -> [n, h]. Every expert runs,
        even on no rows: its gradient is then zeros, on every rank alike."""
        rows = self.timer.enter(rows)
        outs = []
        for e, x in enumerate(rows.split(counts)):
            hidden = F.gelu(F.linear(x, self.fc_weight[e], self.fc_bias[e]))  # [n_e, 4h]
            outs.append(F.linear(hidden, self.proj_weight[e], self.proj_bias[e]))  # [n_e, h]
        return self.timer.leave(torch.cat(outs))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [n, h] sorted by expert, counts [E] -> [n, h] (all E experts are here)."""
        return self.compute(rows, counts.tolist())


class MoE(nn.Module):
    """Router + experts in place of a block's MLP: [b, s, h] -> [b, s, h]."""

    log = None  # a list, set by apply_expert_parallel: one entry per forward (counts, losses)
    clock = None  # () -> the current step, for the log
    routing = staticmethod(route)  # (logits [g, t, E], k, capacity) -> Routing
    loss_scale = 1.0  # AuxLoss's gradient: 1 / micro-batches per step (set by the engine)
    # logits [b, s, E] of this rank's tokens -> (the whole sequences' [b, S, E], this rank's
    # positions in them), and its `loss_parts` (below): None when the rank holds whole sequences
    # (no context or sequence parallel)
    whole_sequences = None

    def __init__(self, d_model: int, experts: int, top_k: int, capacity_factor: float,
                 aux_loss_weight: float, z_loss_weight: float, layer: int):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.aux_loss_weight, self.z_loss_weight, self.layer = aux_loss_weight, z_loss_weight, layer
        self.router = nn.Linear(d_model, experts, bias=False)  # [h] -> [E] logits
        self.experts = Experts(experts, d_model)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        logits = self.router(x)  # [b, s, E]: each whole sequence is one routing group
        whole, mine, parts = logits, None, 1
        if self.whole_sequences is not None:  # cp and/or sp: s = S/(C T) tokens of each sequence
            whole, mine = self.whole_sequences(logits, self.layer)  # [b, S, E], [s]
            parts = self.whole_sequences.loss_parts
        cap = capacity(whole.shape[1], self.n_experts, self.top_k, self.capacity_factor)
        r = self.routing(whole, self.top_k, cap)
        # The losses of the whole sequences; only this rank's tokens carry gradient, so each rank
        # holding a part of a sequence gets that part's share of the term's gradient, and the
        # shares must add up to one whole. Over cp they do not: gradients are averaged over the
        # C ranks of dp x cp (the main loss is a mean over each rank's own tokens), so the term
        # is weighted x C (`loss_parts`). Over tp (sp) they do: a tp rank's shares reach the
        # parameters as they are (its own tokens' activations feed the attention's gradients,
        # router and expert gradients are summed over tp, nothing is averaged), so x 1.
        aux, z = load_balancing_loss(r), router_z_loss(whole)
        if mine is not None:
            r = r.at(mine)  # [b, s, k]: this rank's tokens
        token, gate, counts = dispatch_order(r, self.n_experts)  # [n], [n], [E]
        rows = x.reshape(b * s, h)[token]  # [n, h] grouped by expert
        y = self.experts(rows, counts) * gate.to(x.dtype)[:, None]  # [n, h], weighted
        out = torch.zeros_like(x.reshape(b * s, h)).index_add(0, token, y).view(b, s, h)
        if self.log is not None:  # what routing did, for the lessons and the app
            log_routing(self, r, counts, cap, aux, z, mine)
        term = parts * (self.aux_loss_weight * aux + self.z_loss_weight * z)
        return AuxLoss.apply(out, term, self.loss_scale)


def init_experts(m: Experts) -> None:
    """As nn.Linear weights in model.py: normal(0, 0.02), zero biases."""
    nn.init.normal_(m.fc_weight, std=0.02)
    nn.init.normal_(m.proj_weight, std=0.02)
