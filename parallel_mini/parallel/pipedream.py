"""PipeDream (Narayanan et al., SOSP 2019): 1F1B without the flush, an update per micro-batch.

The synchronous schedules (pipeline.py) add up the gradients of all m micro-batches and update once,
after the pipeline has drained: the bubble is the price of that exactness. PipeDream keeps the pipe
full instead: every stage applies an optimizer step right after each micro-batch's backward. But on
stage r a micro-batch's backward comes p-1-r updates after its forward: the weights its forward
used are gone (staleness), and different stages saw different versions of the model.
- With weight stashing, a stage keeps the version each forward used and computes that
  micro-batch's gradient against it: a true gradient, of stale weights. It costs a stashed copy of
  the stage's weights per micro-batch in flight (up to p - r on stage r).
- Without it, the backward multiplies by whatever weights are current, while the activations came
  from older ones: the result is the gradient of no function at all.
Neither equals synchronous training, by design. The fair comparison is the same micro-batches
applied one after another on one process (`reference.train_reference(..., per_microbatch=True)`).
Each run records every micro-batch's staleness: updates between its forward and its backward.

Simplification: the pipeline still drains at the end of each training step, so steps can be
compared one by one; inside a step the 1F1B steady state runs as PipeDream's does.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from .pipeline import PipelineRunner, chunk_layers


class PipeDreamRunner(PipelineRunner):
    """The 1F1B runner with an optimizer step after every backward (`stash`: weight stashing)."""

    reference_per_microbatch = True  # compare with one update per micro-batch, in order

    def __init__(self, model, comm, schedule, timeline, live=None, stash: bool = True,
                 axis: str = "pp"):
        super().__init__(model, comm, schedule, timeline, live, axis=axis)
        self.stash = stash
        self.weights = dict(model.named_parameters())  # the live (latest) version
        self.updates = 0  # optimizer steps this stage has taken
        self.staleness: list[dict] = []  # per micro-batch: updates between its F and its B
        self.peak_versions = 0  # most weight versions held at once (stashed copies)

    def _forward(self, op) -> None:
        x = self._input(op)
        last = op.chunk == self.schedule.n_chunks - 1
        # the version this forward sees: a copy, so later in-place updates cannot touch it
        version = {n: w.detach().clone().requires_grad_() for n, w in self.weights.items()}
        with self._sampling(), self._event(op):
            layers = chunk_layers(op.chunk, self.schedule.n_chunks, len(self.model.blocks))
            out = functional_call(self.model, version,  # the chunk, run with that version's weights
                                  (x, self.targets[op.microbatch] if last else None),
                                  {"blocks": (layers.start, layers.stop)})
            if last:
                self.loss += out.item() / self.schedule.microbatches  # the step's mean, for the log
        if not last:
            self._send(("act", op.microbatch, op.chunk + 1), out.detach())
        self.saved[(op.microbatch, op.chunk)] = (x, out, version, self.updates)
        self.peak_versions = max(self.peak_versions, len(self.saved))

    def _backward(self, op) -> None:
        grad = self._output_grad(op)
        with self._sampling(), self._event(op):
            x, out, version, seen = self.saved.pop((op.microbatch, op.chunk))
            if not self.stash:  # no stash: backward multiplies by the current weights instead.
                for n, v in version.items():  # .data: autograd does not see this swap
                    v.data.copy_(self.weights[n].data)
            torch.autograd.backward(out, grad)
            for n, w in self.weights.items():
                w.grad = version[n].grad
            self.strategy.optimizer.step()  # one update per micro-batch: PipeDream's
            self.strategy.optimizer.zero_grad()
        if op.chunk > 0:
            self._send(("grad", op.microbatch, op.chunk - 1), x.grad)
        self.staleness.append({"step": self.step, "microbatch": op.microbatch,
                               "updates_between": self.updates - seen})
        self.updates += 1


    def _update(self, step: int) -> None:
        pass  # every backward has already updated its stage

    def report(self) -> dict:
        return {"pipedream": {"staleness": self.staleness, "peak_versions": self.peak_versions}}


def expected_staleness(pp: int, rank: int, microbatch: int) -> int:
    """Updates between a micro-batch's forward and backward on `rank` under 1F1B, the pipe
    drained at each step's start: the warm-up ones see fewer, the steady state p - 1 - rank."""
    return min(microbatch, pp - 1 - rank)
