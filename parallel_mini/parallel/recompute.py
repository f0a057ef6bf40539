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

Built on torch.utils.checkpoint (non-reentrant). Full sets each block's `checkpoint` seam;
selective replaces each attention core by a checkpointed one (it has no parameters, so no name
changes): every other strategy applies unchanged. Recomputation is measured, not assumed: each
checkpointed call counts how often its segment ran; the second run of the same call is the
recomputation, whoever drives backward (a plain step or a pipeline schedule).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..model import GPT


class RecomputeCounter:
    """Counts forward runs of checkpointed segments: first passes and recomputations."""

    def __init__(self):
        self.forward_calls = 0
        self.recomputed_calls = 0

    def checkpoint(self, body, *args):
        """body(*args) under torch.utils.checkpoint, counting its first run and its rerun."""
        runs = 0

        def counted(*a):
            nonlocal runs
            runs += 1
            if runs == 1:
                self.forward_calls += 1
            else:  # autograd re-running the segment to rebuild what backward needs
                self.recomputed_calls += 1
            return body(*a)

        return checkpoint(counted, *args, use_reentrant=False)


class CheckpointedCore(torch.nn.Module):
    """An attention core whose scores and softmax are recomputed in backward (selective)."""

    def __init__(self, core: torch.nn.Module, counter: RecomputeCounter):
        super().__init__()
        self.inner, self.counter = core, counter

    def forward(self, q, k, v):  # [b, a, s, d] x 3 -> [b, a, s, d]
        return self.counter.checkpoint(self.inner, q, k, v)


def apply_checkpointing(model: GPT, mode: str) -> RecomputeCounter:
    """Checkpoint each block (full) or each attention core (selective)."""
    counter = RecomputeCounter()
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"checkpointing {mode!r}: choose none, full or selective")
    for block in model.blocks:
        if mode == "full":
            block.checkpoint = counter.checkpoint
        elif mode == "selective":
            block.attn.core = CheckpointedCore(block.attn.core, counter)
    return counter
