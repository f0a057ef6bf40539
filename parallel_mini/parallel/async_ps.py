"""Asynchronous SGD with a parameter server (Dean et al., 2012, "Downpour SGD"), its staleness
bounded as in Stale Synchronous Parallel (Ho et al., 2013).

Synchronous data parallel ends every step at a barrier, the all-reduce: the fastest rank waits
for the slowest. Here nobody waits for anybody:
- rank 0 is the **server**: it holds the parameters and the optimizer, and does nothing else;
- ranks 1..dp-1 are **workers**: each pulls the current weights, computes a gradient on its own
  batch and pushes it; the server applies every gradient the moment it arrives (one optimizer
  step each) and sends that worker the weights as they are now: its next pull.
Each application makes a new *version* (the number of updates applied so far). While a worker
computed on version v, the others pushed: at apply time the server is at version u >= v, and
u - v is the gradient's **staleness**: how many updates it did not see. With W workers of equal
speed each one's gradient misses about one update from every other: W - 1 on average.

Bounded staleness (SSP): `--max-staleness K` lets a worker start its step c only once every
worker has pushed c - K gradients (it runs at most K steps ahead of the slowest); the server
holds its pull until then. K = 0 is a barrier every step (Ho et al.'s BSP): each round's W
gradients are all computed on one version and applied in turn, staleness exactly 0..W-1. K = -1
is no bound. Staleness in versions is then at most (W - 1)(2K + 1).

Why a dedicated server rank, not rank 0 serving and computing too: a server that computes holds
every worker's push for a whole forward and backward, adding waiting (and staleness) that is the
server's, not asynchrony's; Dean et al.'s servers are machines of their own.

`--straggler RANK:FACTOR` makes one rank a slow device: after its forward and backward it sleeps
(FACTOR - 1) times their measured wall time. Synchronous DP waits for it every step
(`Straggler`, around any step runner); the asynchronous workers do not.

The oracle (reference.replay_updates) needs no luck: which batch an update used is a pure
function of (seed, worker, its local step) (`worker_batch`), and the server records, per update,
the worker, its step and the version it computed on. Replaying that order in one process, each
gradient taken at its recorded version, gives the run's losses and weights (fp32, 1e-5),
whatever order the ranks happened to take.

Messages (fp32; the header's whole numbers are exact below 2^24, and --steps <= 10000):
    grant  server -> worker   [version, *parameters]           version -1: stop
    push   worker -> server   [version, step, loss, *gradient]
"""
from __future__ import annotations

import collections
import math
import sys
import time

import torch
import torch.distributed as dist

from .. import theory
from ..config import straggler_of
from ..data import global_batch, shard
from ..optim import make_optimizer
from ..reference import max_abs_diff, replay_updates

SERVER = 0
STOP = -1.0
PUSH_HEADER = 3  # version, step, loss


def workers_of(cfg) -> list[int]:
    return list(range(1, cfg.dp))


def worker_batch(cfg, worker: int, step: int):
    """Worker `worker`'s batch for its local step `step`: its slice of step `step`'s global batch
    (batch / W sequences). Under K = 0 round c trains on exactly step c's global batch."""
    workers = cfg.dp - 1
    return shard(global_batch(cfg, step), worker - 1, workers)


def may_start(step: int, pushed: dict[int, int], bound: int) -> bool:
    """SSP: a worker may start its `step` once the slowest has pushed step - bound gradients."""
    return bound < 0 or step - min(pushed.values()) <= bound


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflat(vector: torch.Tensor, like) -> list[torch.Tensor]:
    """Views of `vector`, one per tensor of `like`, in its shapes."""
    return [v.view_as(t) for v, t in zip(vector.split([t.numel() for t in like]), like)]


class ParameterServer:
    """Rank 0: the parameters, the optimizer, and the loop that applies pushes as they come."""

    def __init__(self, model, comm, cfg, timeline, axis: str = "dp"):
        self.model, self.comm, self.cfg, self.timeline, self.axis = model, comm, cfg, timeline, axis
        self.params = list(model.parameters())
        self.optimizer = make_optimizer(cfg.optimizer, self.params, cfg.lr)
        self.n = sum(p.numel() for p in self.params)
        self.workers = workers_of(cfg)
        self.budget = cfg.steps * len(self.workers)  # updates: as many samples as --dp --steps
        self.version = 0  # updates applied so far
        self.granted = 0  # steps handed out (each becomes exactly one update)
        self.pushed = {w: 0 for w in self.workers}  # each worker's clock: gradients applied
        self.held: dict[int, float] = {}  # worker -> when its pull began to wait for the bound
        self.held_s = {w: 0.0 for w in self.workers}
        self.updates: list[dict] = []  # one per applied gradient, in order
        self.sending: dict[int, tuple] = {}  # worker -> its last grant in flight, and its buffer

    def serve(self, t0: float) -> None:
        for w in self.workers:
            self._dispatch(w)
        running, msg = len(self.workers), torch.empty(PUSH_HEADER + self.n)
        while running:
            self.comm.step = self.version
            with self.timeline.op("wait", self.version):
                w = self.comm.recv_any(msg, self.axis)
            with self.timeline.op("apply", self.version, worker=w):
                self._apply(w, msg, t0)
            for v in [w] + sorted(x for x in self.held if x != w):
                running -= self._dispatch(v) == "stopped"
        for handle, _ in self.sending.values():
            handle.wait()

    def _apply(self, w: int, msg: torch.Tensor, t0: float) -> None:
        version, step, loss = (float(x) for x in msg[:PUSH_HEADER])
        if not math.isfinite(loss):
            raise FloatingPointError(f"update {self.version + 1}: the loss is {loss}; the run "
                                     f"diverged (lower --lr)")
        for p, g in zip(self.params, unflat(msg[PUSH_HEADER:], self.params)):
            p.grad = g  # a view of the message: stepped before the next receive overwrites it
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.updates.append({"update": self.version, "worker": w, "step": int(step),
                             "computed_on": int(version), "staleness": self.version - int(version),
                             "loss": loss, "time": time.perf_counter() - t0})
        self.version += 1
        self.pushed[w] += 1
        if self.cfg.extra.get("progress"):
            print(f"update {self.version}/{self.budget}  worker {w} step {int(step)}  staleness "
                  f"{self.updates[-1]['staleness']}  loss {loss:.4f}", file=sys.stderr, flush=True)

    def _dispatch(self, w: int) -> str:
        """Worker w's next pull: stop (the budget is spent), hold (it is too far ahead), or grant."""
        if self.granted < self.budget and not may_start(self.pushed[w], self.pushed,
                                                        self.cfg.max_staleness):
            self.held.setdefault(w, time.perf_counter())
            return "held"
        if w in self.held:
            self.held_s[w] += time.perf_counter() - self.held.pop(w)
        if self.granted >= self.budget:
            self._send(w, STOP)
            return "stopped"
        self.granted += 1
        self._send(w, float(self.version))
        return "granted"

    def _send(self, w: int, version: float) -> None:
        if w in self.sending:  # (done: w received it before it pushed)
            self.sending[w][0].wait()
        grant = torch.cat([torch.tensor([version]), flat(self.params)])  # this version's weights
        self.sending[w] = (self.comm.isend(grant, w, self.axis), grant)


class Worker:
    """Ranks 1..dp-1: pull, compute a gradient on the own batch, push; until told to stop."""

    def __init__(self, model, comm, cfg, timeline, rank: int, axis: str = "dp"):
        self.model, self.comm, self.cfg, self.timeline, self.axis = model, comm, cfg, timeline, axis
        self.rank, self.params = rank, list(model.parameters())
        straggler = straggler_of(cfg.straggler) if cfg.straggler else None
        self.factor = straggler[1] if straggler and straggler[0] == rank else 1.0
        self.slept_s = 0.0

    def run(self) -> int:
        n, step = sum(p.numel() for p in self.params), 0
        grant = torch.empty(1 + n)
        while True:
            self.comm.step = step
            with self.timeline.op("pull", step):
                self.comm.recv(grant, SERVER, self.axis)
            version = float(grant[0])
            if version == STOP:
                return step
            with torch.no_grad():
                for p, w in zip(self.params, unflat(grant[1:], self.params)):
                    p.copy_(w)  # the server's version `version` of the model
            x, y = worker_batch(self.cfg, self.rank, step)
            start = time.perf_counter()
            with self.timeline.op("forward", step):
                loss = self.model(x, y)
            with self.timeline.op("backward", step):
                for p in self.params:
                    p.grad = None
                loss.backward()
            self._straggle(step, time.perf_counter() - start)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            push = torch.cat([torch.tensor([version, step, loss.item()]), flat(grads)])
            with self.timeline.op("push", step):
                self.comm.isend(push, SERVER, self.axis).wait()
            step += 1

    def _straggle(self, step: int, compute_s: float) -> None:
        if self.factor > 1:
            with self.timeline.op("straggle", step):
                time.sleep((self.factor - 1) * compute_s)
            self.slept_s += (self.factor - 1) * compute_s


class Straggler:
    """A StepRunner around another (synchronous data parallel): after each step it sleeps
    (factor - 1) times the wall time of that step's forward and backward ops, so the rank is a
    device `factor` times slower. The others meet it at the next all-reduce, and wait there."""

    def __init__(self, runner, factor: float, timeline):
        self.runner, self.factor, self.timeline = runner, factor, timeline
        self.reference_per_microbatch = runner.reference_per_microbatch
        self.slept_s = 0.0

    def attach(self, strategy) -> None:
        self.runner.attach(strategy)

    def train_step(self, step: int, batch) -> float:
        first = len(self.timeline.events)
        loss = self.runner.train_step(step, batch)
        compute = sum(e["end"] - e["start"] for e in self.timeline.events[first:]
                      if e["kind"] in ("forward", "backward"))
        with self.timeline.op("straggle", step):
            time.sleep((self.factor - 1) * compute)
        self.slept_s += (self.factor - 1) * compute
        return loss

    def activation_peak(self) -> int:
        return self.runner.activation_peak()

    def report(self) -> dict:
        return {**self.runner.report(), "straggler_slept_s": self.slept_s}


def slow_down(runner, cfg, rank: int, timeline):
    """The runner, wrapped in a Straggler on the rank --straggler names (synchronous runs)."""
    straggler = straggler_of(cfg.straggler) if cfg.straggler else None
    if straggler is None or straggler[0] != rank:
        return runner
    return Straggler(runner, straggler[1], timeline)


def train_async(cfg, mesh, comm, timeline, model) -> dict:
    """One rank of an asynchronous run: the server on rank 0, a worker elsewhere. Returns the
    rank's part of the report (launch.run merges them; the server's "async" is the run's)."""
    dist.barrier()  # everyone built the same model; the clock starts together
    t0 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    params_bytes = 4 * n_params
    out = {"rank": mesh.rank, "coords": mesh.coords, "comm": comm.records,
           "events": timeline.events, "n_params": n_params, "resumed_from_step": 0,
           "metered_step": None}
    if mesh.rank == SERVER:
        server = ParameterServer(model, comm, cfg, timeline)
        server.serve(t0)
        losses = [u["loss"] for u in server.updates]
        out.update(losses=losses, wall_s=time.perf_counter() - t0, memory={
            "params": params_bytes, "grads": params_bytes,  # the pushed gradient, a message
            "optimizer": sum(t.numel() * t.element_size()
                             for t in server.optimizer.state_tensors())})
        out["async"] = summary(cfg, server.updates, server.held_s, out["wall_s"])
        if cfg.reference:
            ref_losses, ref_params = replay_updates(cfg, server.updates, worker_batch)
            mine = {name: p.detach() for name, p in model.named_parameters()}
            out["reference_losses"] = ref_losses
            out["max_abs_diff"] = max_abs_diff(losses, mine, ref_losses, ref_params)
    else:
        worker = Worker(model, comm, cfg, timeline, mesh.rank)
        steps = worker.run()
        out.update(losses=[], wall_s=time.perf_counter() - t0, steps=steps,
                   straggler_slept_s=worker.slept_s,
                   memory={"params": params_bytes, "grads": params_bytes, "optimizer": 0})
    return out


def summary(cfg, updates: list[dict], held_s: dict[int, float], wall_s: float) -> dict:
    """The report's "async" section: what was counted from the server's records, measured on its
    clock, and theory's expectation beside them."""
    workers = workers_of(cfg)
    per_sample = cfg.batch // len(workers)
    stale = [u["staleness"] for u in updates]
    hist = collections.Counter(stale)
    straggler = straggler_of(cfg.straggler) if cfg.straggler else None
    by_worker = {w: [u["staleness"] for u in updates if u["worker"] == w] for w in workers}
    return {
        "server_rank": SERVER, "workers": workers, "max_staleness": cfg.max_staleness,
        "straggler": {"rank": straggler[0], "factor": straggler[1]} if straggler else None,
        "samples_per_update": per_sample,
        "updates": updates,  # counted: worker, its step, version computed on, staleness, loss, time
        "staleness_histogram": {str(s): hist[s] for s in range(max(stale, default=0) + 1)},
        "staleness_mean": sum(stale) / max(1, len(stale)),
        "staleness_mean_by_worker": {str(w): (sum(s) / len(s) if s else None)
                                     for w, s in by_worker.items()},
        "updates_per_worker": {str(w): len(s) for w, s in by_worker.items()},
        "held_s_per_worker": {str(w): held_s[w] for w in workers},  # measured: pulls held by K
        "loss_vs_time": [[u["time"], u["loss"]] for u in updates],  # measured, server's clock
        "loss_vs_samples": [[(i + 1) * per_sample, u["loss"]] for i, u in enumerate(updates)],
        "updates_per_s": len(updates) / wall_s if wall_s else None,  # measured
        "theory": theory.async_staleness(len(workers), straggler[1] if straggler else 1.0,
                                         cfg.max_staleness),
    }
