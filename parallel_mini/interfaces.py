"""The two interfaces the engine composes (engine.py), declared in one place.

A training step on one rank is: a *step runner* pushes micro-batches forward and backward through
the rank's part of the model (all of it, or its pipeline stage), while a *gradient strategy* decides
what happens to the gradients (averaged over data parallel, reduce-scattered by ZeRO, ...) and
updates the parameters. The engine builds one of each from the RunConfig and calls only what is
declared here: it never asks which class it holds.

    runner.attach(strategy)                # once
    loss = runner.train_step(step, batch)  # per step: calls strategy.zero_grad, strategy.sync,
                                           # strategy.finish_gradient_sync, strategy.step

To add a strategy, implement one of these Protocols (subclass it to inherit the no-op defaults);
docs/architecture.md walks through it. What a strategy owns is said in full-model coordinates,
boxes of the reference's tensors (placement.py): checkpoints read that, never a strategy's insides.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from .placement import Block, Box, Region  # noqa: F401  (the vocabulary of `owned`)

Held = dict  # {local parameter: (its full tensor's name, [Block])}: placement.held_by(model)


@dataclass
class Piece:
    """One tensor this rank's optimizer steps, `values` [numel] (a whole parameter, or a slice of
    a flat buffer; fp32: the master copy under bf16-mixed), and the boxes of full tensors it is
    (`regions`; a padding piece has one region named placement.PADDING). Its optimizer states are
    optimizer.state[index], as many elements as values. `saved` False: a replica beside the owner's
    piece (ZeRO-1/2's gathered parameters): filled on resume, never written."""
    regions: list[Region]
    values: torch.Tensor | None = None
    optimizer: object = None
    index: int | None = None
    saved: bool = True

    def view(self, region: Region, t: torch.Tensor) -> torch.Tensor:
        """The window of t ([numel], values or one of its states) that holds region's box."""
        run = t[region.start:region.start + region.run.numel].view(region.run.sizes)
        return run[region.local.within(region.run)]


class GradientStrategy(Protocol):
    """Owns the optimizer and the gradients' way to the update: plain data parallel
    (parallel/data.py), ZeRO-1/2 (parallel/zero.py), ZeRO-3 / FSDP (parallel/zero3.py)."""

    optimizer: object  # steps this rank's (shard of the) parameters; PipeDream steps it itself

    def zero_grad(self) -> None:
        """Forget the last step's gradients."""

    def sync(self, enabled: bool = True) -> AbstractContextManager:
        """Backward inside `sync(False)` only accumulates locally (DDP's no_sync): gradient
        accumulation and pipeline micro-batches synchronise once, after the last."""

    def finish_gradient_sync(self) -> None:
        """After the step's last backward: every gradient this rank keeps is the batch's."""

    def step(self) -> None:
        """Update the parameters (and re-gather them where they are sharded)."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Model states by category ("params", "grads", "optimizer", optionally "host"): what the
        memory meter counts and theory predicts to the byte."""

    def buffers(self) -> list[torch.Tensor]:
        """Buffers allocated once and held across steps (data parallel's gradient buckets)."""

    def transient_bytes(self) -> int:
        """Bytes held only around communication: buckets, ZeRO-3's gathered layers at peak."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank's model holds, by name, unsharded over the strategy's own axes
        (collective under ZeRO-3): to compare with the single-process reference."""

    def owned(self, held: Held) -> list[Piece]:
        """What this rank owns (steps, and saves in a checkpoint): parameters and optimizer states
        as boxes of the full model's tensors, given where each local parameter sits (`held`)."""

    def loaded(self) -> None:
        """After a checkpoint filled the owned pieces: refresh what is computed from them (the
        bf16 compute copies of fp32 masters). Nothing by default."""

    def disk_report(self) -> dict:
        """--offload-disk (parallel/offload_disk.py): the bytes this rank keeps in its file and the
        bytes read and written per step, counted and measured. {} when nothing is on disk."""
        return {}

    def close(self) -> None:
        """After the run: let go of what outlives a step (--offload-disk's open file)."""

    def grad_deferred(self, p: torch.nn.Parameter) -> None:
        """A zero-bubble pipeline's B left p's weight gradient to a later W (pipeline.py): only a
        strategy that reduces as gradients arrive (ZeRO-3) cares. Nothing by default."""

    def grad_accumulated(self, p: torch.nn.Parameter) -> None:
        """That W has added its micro-batch's gradient to p.grad. Nothing by default."""


class StepRunner(Protocol):
    """Runs one training step on this rank: plain forward/backward over gradient-accumulation
    micro-batches (step.py), a pipeline schedule (parallel/pipeline.py), or PipeDream
    (parallel/pipedream.py)."""

    reference_per_microbatch: bool  # PipeDream: the reference updates after every micro-batch

    def attach(self, strategy: GradientStrategy) -> None:
        """The gradient strategy this runner's steps go through (set once, after both exist)."""

    def train_step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One step on this rank's share of the batch ([b/dp, s] inputs and targets); returns the
        loss of that share (the mean over its tokens), known on every rank of the pipeline."""

    def activation_peak(self) -> int:
        """Peak bytes held for backward in the metered step, beyond the model states."""

    def report(self) -> dict:
        """What this runner adds to the rank's report (e.g. PipeDream's staleness)."""
