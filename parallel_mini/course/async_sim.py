"""Asynchronous SGD's schedule without ranks: the real ParameterServer loop (parallel/async_ps.py)
against simulated workers whose step times are chosen, not measured. Which gradient lands on
which version, the staleness histogram, the pulls held by --max-staleness: counted from the
server's own records, in a fraction of a second, for a widget that redraws at once or a lesson's
prediction. The numbers are "simulated" (step times given, no clock read), never "measured";
the gradients pushed are zeros (the schedule does not depend on them).
"""
from __future__ import annotations

import torch

from .. import theory
from ..meters import Timeline
from ..model import build_model
from ..parallel.async_ps import PUSH_HEADER, STOP, ParameterServer, summary


class _Sent:
    def wait(self) -> None:
        pass


class SimulatedWorkers:
    """The Comm a ParameterServer talks to, with workers in place of ranks: a grant starts the
    worker's step, which takes `step_time[worker]` simulated seconds; `recv_any` returns the push
    of the in-flight worker that finishes first (the lowest-numbered on a tie)."""

    def __init__(self, step_time: dict[int, float]):
        self.step_time, self.clock, self.step = dict(step_time), 0.0, 0
        self.flight: dict[int, tuple[float, float, int]] = {}  # worker -> (finish, version, step)
        self.steps = {w: 0 for w in step_time}  # steps granted to each worker
        self.stops: list[int] = []
        self.finished_at: list[float] = []  # simulated time of each push, in order

    def isend(self, tensor: torch.Tensor, w: int, axis: str) -> _Sent:
        version = float(tensor[0])
        assert w not in self.stops and w not in self.flight, f"worker {w} was not waiting"
        if version == STOP:
            self.stops.append(w)
        else:
            self.flight[w] = (self.clock + self.step_time[w], version, self.steps[w])
            self.steps[w] += 1
        return _Sent()

    def recv_any(self, msg: torch.Tensor, axis: str) -> int:
        w = min(self.flight, key=lambda k: (self.flight[k][0], k))
        self.clock, version, step = self.flight.pop(w)
        self.finished_at.append(self.clock)
        msg.zero_()
        msg[:PUSH_HEADER] = torch.tensor([version, step, 0.0])  # (a loss of 0: none computed)
        return w


def simulate(cfg, step_time: dict[int, float]) -> dict:
    """The report's "async" section for `cfg` (dp, steps, max_staleness; its straggler is not read:
    slow a worker by its step time), with workers 1..dp-1 taking `step_time[w]` each step.
    `time` is the simulated clock; there are no losses."""
    assert sorted(step_time) == list(range(1, cfg.dp)), "one step time per worker, 1..dp-1"
    sim = SimulatedWorkers(step_time)
    server = ParameterServer(build_model(cfg), sim, cfg, Timeline())
    server.serve(0.0)
    assert sorted(sim.stops) == sorted(step_time) and not sim.flight
    for u, t in zip(server.updates, sim.finished_at):
        u["time"] = t
    out = summary(cfg, server.updates, {w: 0.0 for w in step_time}, sim.clock)
    for key in ("loss_vs_time", "loss_vs_samples", "held_s_per_worker"):
        out.pop(key)  # no losses; held time is not simulated
    for u in out["updates"]:
        u.pop("loss")
    out["updates_per_s"] = len(server.updates) / sim.clock  # per simulated second
    times = sorted(step_time.values())
    if len(times) > 1 and times[:-1] == [times[0]] * (len(times) - 1):  # one straggler at most
        out["theory"] = theory.async_staleness(len(times), times[-1] / times[0], cfg.max_staleness)
    out["simulated"] = {"step_time": {str(w): t for w, t in step_time.items()}}
    return out
