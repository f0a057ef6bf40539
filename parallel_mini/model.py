"""A tiny GPT (Radford et al., 2019; layout after nanoGPT): token + position embeddings, L pre-LN
blocks of causal multi-head attention and a 4h MLP, a final LayerNorm and an untied LM head.

Parameter count: see `theory.gpt_param_count` (tested). Attention is written out (scores, mask,
softmax) rather than fused, so its activations are visible to the memory meter and match the
Korthikanti et al. accounting the memory lesson uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 4

    @classmethod
    def from_run(cls, cfg) -> "GPTConfig":
        return cls(cfg.vocab, cfg.seq, cfg.d_model, cfg.heads, cfg.layers)


class AttentionCore(nn.Module):
    """softmax(Q K^T / sqrt(d), causal) V. No parameters; its own module so that selective
    checkpointing can recompute exactly this part (it holds the [b, a, s, s] tensors)."""

    def forward(self, q, k, v):  # q, k, v: [b, a, s, d]
        s = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [b, a, s, s]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v  # [b, a, s, d]


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads, self.head_dim = c.heads, c.d_model // c.heads
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.core = AttentionCore()
        self.proj = nn.Linear(c.d_model, c.d_model)

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
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.proj = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x):  # [b, s, h] -> [b, s, 4h] -> [b, s, h]
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.d_model), CausalSelfAttention(c)
        self.ln2, self.mlp = nn.LayerNorm(c.d_model), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab, c.d_model)
        self.pos_emb = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.apply(_init_weights)

    def forward(self, idx, targets=None):  # idx: [b, s] token ids
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [b, s, v]
        if targets is None:
            return logits
        # mean over b*s tokens, computed in fp32 even when the model runs in bf16
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _init_weights(m):
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
