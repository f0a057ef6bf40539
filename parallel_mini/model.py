"""A tiny GPT (Radford et al., 2019; layout after nanoGPT): token + position embeddings, L pre-LN
blocks of causal multi-head attention and a 4h MLP, a final LayerNorm and an untied LM head.

The model is three kinds of module with seams between them, so that every strategy changes the
model by replacing a module or passing an argument, never by rewriting a forward:
    embed  (Embedding: tokens + positions)       [b, s] ids      -> [b, s, h]
    blocks (Block x L)                           [b, s, h]       -> [b, s, h]
    head   (LMHead: final LayerNorm, logits, loss) [b, s, h]     -> loss (or [b, s, v] logits)
- tensor parallel replaces embed, head and the attention's Linear layers by their parallel
  versions, and a plain MLP's too (a mixture of experts stays whole on every tp rank;
  parallel/tensor.py);
- a pipeline stage runs a slice of the same modules: `model(x, targets, blocks=(i, j))` runs the
  embedding only when i == 0 and the head only when j == L (parallel/pipeline.py);
- checkpointing sets a block's `checkpoint` function or replaces the attention core
  (parallel/recompute.py); context parallel replaces the attention core and sets the
  embedding's `positions` (parallel/context.py);
- a mixture-of-experts block has a MoE (moe.py) in place of its MLP (`--experts E`), and expert
  parallel replaces the MoE's experts by a slice of them that talks all-to-all (parallel/expert.py).

Parameter count: see `theory.gpt_param_count` (tested). Attention is written out (scores, mask,
softmax) rather than fused, so its activations are visible to the memory meter and match the
Korthikanti et al. accounting the memory lesson uses.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPTConfig  # the model's shape (torch-free: the CLI checks it before importing torch)
from .moe import MoE, Experts, init_experts


class Linear(nn.Linear):
    """nn.Linear with one seam: zero-bubble pipelines set `weight_grads` (a WeightGradStore) so
    that backward computes only the input's gradient now and queues the weight's for a later W op.
    Tensor parallel's column/row-parallel layers have the same seam."""

    weight_grads = None

    def forward(self, x):
        return linear(x, self.weight, self.bias, self)


def linear(x, weight, bias, layer):
    """x W^T + b, through `layer.weight_grads` when a zero-bubble schedule split its backward."""
    if layer.weight_grads is None:
        return F.linear(x, weight, bias)
    return layer.weight_grads.linear(x, weight, bias, layer)


class Embedding(nn.Module):
    """Token plus position embeddings. `positions` says which positions the tokens are at: the
    argument, else the `positions` seam (context parallel sets this rank's), else 0..s-1."""

    positions = None

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)

    def forward(self, idx, positions=None):  # idx: [b, s] -> [b, s, h]
        return self.tok(idx) + self.pos(token_positions(self, idx, positions))


def token_positions(embed, idx, positions=None):
    """[s] positions of the tokens in idx [b, s] (see Embedding)."""
    if positions is None:
        positions = embed.positions
    if positions is None:
        return torch.arange(idx.shape[1], device=idx.device)
    return positions.to(idx.device)


class AttentionCore(nn.Module):
    """softmax(Q K^T / sqrt(d), causal) V. No parameters; its own module so that selective
    checkpointing and context parallel can replace exactly this part: it holds the
    [b, a, s, s] tensors."""

    def forward(self, q, k, v):  # q, k, v: [b, a, s, d]
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [b, a, s, s]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v  # [b, a, s, d]


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads, self.head_dim = c.heads, c.d_model // c.heads
        self.qkv = Linear(c.d_model, 3 * c.d_model)
        self.core = AttentionCore()
        self.proj = Linear(c.d_model, c.d_model)

    def forward(self, x):  # x: [b, s, h]
        qkv = self.qkv(x)  # [b, s, 3h]; under tensor parallel [b, s, 3h/tp]: this rank's heads
        b, s = qkv.shape[:2]
        q, k, v = qkv.chunk(3, dim=-1)  # 3 x [b, s, a*d], a = the heads this rank holds
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).reshape(b, s, -1)  # [b, s, a*d]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc = Linear(c.d_model, 4 * c.d_model)
        self.proj = Linear(4 * c.d_model, c.d_model)

    def forward(self, x):  # [b, s, h] -> [b, s, 4h] -> [b, s, h]
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block. `checkpoint`, when set (full activation checkpointing), runs the
    block's body through torch.utils.checkpoint: only the input is kept for backward."""

    checkpoint = None

    def __init__(self, c: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.d_model), CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = MoE(c.d_model, c.experts, c.top_k, c.capacity_factor, c.aux_loss_weight,
                       c.z_loss_weight, layer) if c.is_moe(layer) else MLP(c)

    def forward(self, x):  # [b, s, h] -> [b, s, h]
        if self.checkpoint is not None:
            return self.checkpoint(self.body, x)
        return self.body(x)

    def body(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm, logits over the vocabulary and the mean cross-entropy."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(c.d_model)
        self.out = Linear(c.d_model, c.vocab, bias=False)

    def forward(self, x, targets=None):  # x: [b, s, h]
        logits = self.out(self.norm(x))  # [b, s, v]
        if targets is None:
            return logits
        return self.loss(logits, targets)

    def loss(self, logits, targets):
        # mean over b*s tokens, computed in fp32 even when the model runs in bf16
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.embed = Embedding(c)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.layers))
        self.head = LMHead(c)
        self.apply(_init_weights)

    def forward(self, x, targets=None, blocks: tuple[int, int] | None = None):
        """The whole model, or the slice of it one pipeline chunk runs: blocks [i, j), with the
        embedding when i == 0 (x: token ids [b, s]; else x: activations [b, s, h]) and the head
        when j == L (returns the loss given targets, else the logits; else activations)."""
        i, j = blocks if blocks is not None else (0, len(self.blocks))
        if i == 0:
            x = self.embed(x)  # [b, s, h]
        for block in self.blocks[i:j]:
            x = block(x)
        if j < len(self.blocks):
            return x
        return self.head(x, targets)


def _init_weights(m):
    if isinstance(m, Experts):
        init_experts(m)
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def build_model(cfg, seed: int | None = None) -> GPT:
    """The same weights on every rank that passes the same seed (default: the run's seed),
    initialised in fp32 and then cast to the run's compute dtype (bf16 for bf16-mixed)."""
    from .optim import PARAM_DTYPE
    torch.manual_seed(cfg.seed if seed is None else seed)
    return GPT(GPTConfig.from_run(cfg)).to(PARAM_DTYPE[getattr(cfg, "precision", "fp32")])
