"""The plain step runner: forward and backward over gradient-accumulation micro-batches, then the
gradient strategy's sync and update. Used whenever there is no pipeline (--pp 1).

Gradient accumulation: the rank's share of the batch [b/dp, s] is cut into k micro-batches
[b/(dp k), s]; each loss is divided by k so that the accumulated gradient is the mean over the
whole share, and only the last micro-step synchronises (`strategy.sync(False)` before it).
"""
from __future__ import annotations

import torch

from .data import shard
from .interfaces import GradientStrategy
from .mesh import rank_device
from .meters import ActivationMeter, Timeline


class PlainStep:
    """StepRunner (interfaces.py) for a model that is whole on this rank (or sharded by TP/ZeRO)."""

    reference_per_microbatch = False

    def __init__(self, model: torch.nn.Module, grad_accum: int, timeline: Timeline,
                 act: ActivationMeter):
        self.model, self.k, self.timeline, self.act = model, grad_accum, timeline, act
        self.strategy: GradientStrategy | None = None

    def attach(self, strategy: GradientStrategy) -> None:
        self.strategy = strategy

    def train_step(self, step: int, batch) -> float:
        strategy, k, loss_sum = self.strategy, self.k, 0.0
        strategy.zero_grad()
        for micro in range(k):
            x, y = (t.to(rank_device()) for t in shard(batch, micro, k))  # [b/(dp*k), s]
            with strategy.sync(micro == k - 1):
                with self.timeline.op("forward", step, micro), self.act.forward():
                    loss = self.model(x, y) / k  # mean over the micro-batch, scaled for accumulation
                with self.timeline.op("backward", step, micro):
                    loss.backward()
            loss_sum += loss.item()
        with self.timeline.op("grad_sync", step):
            strategy.finish_gradient_sync()
        with self.timeline.op("optimizer", step):
            strategy.step()
        return loss_sum

    def activation_peak(self) -> int:
        return self.act.peak

    def report(self) -> dict:
        return {}
