"""Local SGD: every data-parallel rank trains alone for H steps, then the ranks average weights.

Data parallel (data.py) averages the *gradients* after every backward: the ranks step together,
and every step pays an all-reduce of the whole model. Local SGD (Stich, 2019, "Local SGD converges
fast and communicates little"; Lin et al., 2020, "Don't use large mini-batches, use local SGD")
lets each rank step its own optimizer on its own share of every batch and averages the
*parameters* only after every H-th step (`--sync-every H`): the same all-reduce, H times less often,
so the bytes per step fall by H. Between averages the replicas drift apart; what that costs in
loss is for the lesson to measure.

    H = 1      data parallel that averages parameters instead of gradients: the same update for
               SGD (the mean of p - lr g_r is p - lr mean(g_r)), not for Adam, whose step is not
               linear in the gradient
    H = steps  every rank trains its own model; they are averaged once, at the end

The run also averages after its last step (whatever H), so that it ends with one model.
`--sync-optimizer` averages Adam's two moments with the parameters (three times the bytes);
without it each rank keeps its own moments, as in Lin et al.

What is averaged is read from `owned` (placement.py): the tensors this rank's optimizer steps and
their optimizer states, the same description checkpoints use. The single-process twin, N replicas
stepped one after another, is reference.simulate_local_sgd; a run equals it to 1e-5.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..comm import Comm
from ..interfaces import GradientStrategy, Held, Piece
from ..optim import make_optimizer
from ..placement import held_by
from .data import broadcast_parameters, copy_masters, whole_pieces


class LocalSteps(GradientStrategy):
    """GradientStrategy: a whole optimizer on every rank, stepped on this rank's gradients alone.
    Nothing is synchronised at a step; `average` makes the ranks' weights (and, optionally, their
    optimizer states) equal, and subclasses say when (local SGD) or with which weights (federated
    averaging, federated.py)."""

    def __init__(self, model: torch.nn.Module, comm: Comm, cfg, axis: str = "dp"):
        self.model, self.comm, self.axis, self.cfg = model, comm, axis, cfg
        step, comm.step = comm.step, -1  # one-time setup: every replica starts from rank 0's
        broadcast_parameters(model, comm, axis)
        comm.step = step
        self.optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
        self.held = held_by(model)
        self.flat_bytes = 0  # the largest flat buffer averaged so far (transient_bytes)

    # -- a step: this rank's gradients, this rank's optimizer ------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sync(self, enabled: bool = True):
        return nullcontext()  # a gradient never leaves its rank

    def finish_gradient_sync(self) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()

    # -- averaging ------------------------------------------------------------------------------
    def averaged_tensors(self, with_states: bool) -> list[torch.Tensor]:
        """What this rank owns, in the same order on every rank: each piece's values (the fp32
        master under bf16-mixed), then, `with_states`, each piece's optimizer states."""
        pieces = self.owned(self.held)
        out = [pc.values for pc in pieces]
        if with_states:
            out += [t for pc in pieces for t in pc.optimizer.state.get(pc.index, {}).values()]
        return out

    @torch.no_grad()
    def flat(self, with_states: bool = False) -> torch.Tensor:
        """A copy of averaged_tensors in one flat buffer: [P] (+ the states' elements)."""
        flat = torch.cat([t.reshape(-1) for t in self.averaged_tensors(with_states)])
        self.flat_bytes = max(self.flat_bytes, flat.numel() * flat.element_size())
        return flat

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor, with_states: bool = False) -> None:
        """The inverse of `flat`: write a flat buffer back into the owned tensors."""
        offset = 0
        for t in self.averaged_tensors(with_states):
            t.view(-1).copy_(flat[offset:offset + t.numel()])
            offset += t.numel()
        self.loaded()

    def average(self, with_states: bool = False, **tags) -> None:
        """Every rank's weights (and states) := their mean over the axis: one all-reduce."""
        flat = self.flat(with_states)  # [P] or [3P]: parameters (+ Adam's two moments)
        self.comm.all_reduce(flat, self.axis, **tags)
        self.load_flat(flat / self.comm.size(self.axis), with_states)

    # -- what the engine and checkpoints read ---------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": self.optimizer.state_tensors()}

    def buffers(self) -> list[torch.Tensor]:
        return []

    def transient_bytes(self) -> int:
        """The flat buffer an average all-reduces (parameters, + states with them)."""
        return self.flat_bytes

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def owned(self, held: Held) -> list[Piece]:
        """Every parameter whole, as the optimizer steps it (bf16-mixed: its fp32 master)."""
        return whole_pieces(self.optimizer, held)

    def loaded(self) -> None:
        copy_masters(self.optimizer)


class LocalSGD(LocalSteps):
    """Local SGD: average the parameters (`sync_optimizer`: and the optimizer states) over the axis
    after every `every`-th optimizer step and after the run's last (`steps`)."""

    def __init__(self, model, comm, cfg, axis: str = "dp"):
        super().__init__(model, comm, cfg, axis)
        self.every, self.sync_optimizer, self.steps = cfg.sync_every, cfg.sync_optimizer, cfg.steps
        self.taken = 0  # optimizer steps so far

    def step(self) -> None:
        self.optimizer.step()
        self.taken += 1
        if self.taken % self.every == 0 or self.taken == self.steps:
            self.average(self.sync_optimizer, kind="local-sgd")


def summary(report) -> dict:
    """What a local-SGD run's report adds (RunReport.extra["local_sgd"]): its averages and the
    bytes rank 0 sent per step and per sample (a sample is one sequence of the global batch),
    counted from the comm records (the ring model of the all-reduces run), predicted (theory)
    and written to the sockets (measured; None where it cannot be read)."""
    cfg = report.config
    counted = report.wire_bytes_per_step().get("dp", 0)
    measured = report.wire_bytes_per_step(kind="measured").get("dp", 0)
    theory = report.theory["wire_bytes_per_step"].get("dp", 0)
    per_step = {"counted": counted, "theory": theory, "measured": measured}
    return {"sync_every": cfg["sync_every"], "sync_optimizer": cfg["sync_optimizer"],
            "averages": sum(1 for r in report.ranks[0]["comm"] if r.get("kind") == "local-sgd"),
            "bytes_per_step": per_step,
            "bytes_per_sample": {k: (None if v is None else v / cfg["batch"])
                                 for k, v in per_step.items()}}
