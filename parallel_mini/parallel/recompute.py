"""Activation checkpointing: keep less for backward, compute it again when backward needs it.

Backward needs the forward's intermediate tensors; keeping all of them is what makes activation
memory grow with layers x batch x sequence. Checkpointing (Chen et al., 2016, "Training Deep Nets
with Sublinear Memory Cost") keeps only a segment's input and re-runs the segment's forward inside
backward.
- full: every transformer block is a segment: per block only its input [b, s, h] is kept, and the
  whole block's forward runs twice (about one extra forward pass, ~33% more compute).
- selective (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
  Models"): only the attention core (scores, mask, softmax, weighted sum) is recomputed. It holds
  the [b, a, s, s] tensors, the 5as/h term of the activation formula, yet costs few FLOPs to redo.

Built on torch.utils.checkpoint (non-reentrant). The segment's forward is replaced on the instance,
so module and parameter names do not change and every other strategy applies unchanged.
Recomputation is measured, not assumed: segments count their forward calls made during backward.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..model import GPT


class RecomputeCounter:
    """Counts forward calls of checkpointed segments: first passes and recomputations."""

    def __init__(self):
        self.forward_calls = 0
        self.recomputed_calls = 0
        self.in_backward = False

    def hit(self) -> None:
        if self.in_backward:
            self.recomputed_calls += 1
        else:
            self.forward_calls += 1


def _checkpoint_forward(module: torch.nn.Module, counter: RecomputeCounter) -> None:
    inner = module.forward  # the original bound forward

    def run(*args):
        counter.hit()
        return inner(*args)

    def forward(*args):
        return checkpoint(run, *args, use_reentrant=False)

    module.forward = forward


def apply_checkpointing(model: GPT, mode: str) -> RecomputeCounter:
    """Checkpoint each block (full) or each attention core (selective)."""
    counter = RecomputeCounter()
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"checkpointing {mode!r}: choose none, full or selective")
    for block in model.blocks:
        if mode == "full":
            _checkpoint_forward(block, counter)
        elif mode == "selective":
            _checkpoint_forward(block.attn.core, counter)
    return counter


def backward(loss: torch.Tensor, counter: RecomputeCounter) -> None:
    """loss.backward(), with the counter told that backward is running."""
    counter.in_backward = True
    try:
        loss.backward()
    finally:
        counter.in_backward = False
