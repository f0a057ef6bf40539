"""Pipeline parallelism: the model cut into stages along its depth, micro-batches flowing through.

Read parallel/schedules.py first: a schedule says, for each rank, which forward (F), backward (B)
and weight-gradient (W) ops to run in which order. This file is the one runner for all of them:
1. `partition` keeps on this rank only the chunks the schedule gives it (blocks
   [c L/n, (c+1) L/n) of chunk c; the embeddings go with chunk 0, the final LayerNorm, LM head and
   loss with the last chunk, as in Megatron-LM). Names stay those of the full model. A chunk runs
   the same modules as the whole model: `model(x, targets, blocks=(i, j))`, so whatever replaced
   a module before (tensor parallel's layers, checkpointing) runs inside the stage unchanged.
2. `PipelineRunner.run` executes the rank's ops. F receives its input (the previous chunk's output
   [b, s, h], or token ids on chunk 0), runs the chunk, and sends the output on. B receives the
   output's gradient, runs autograd through the chunk and sends the input's gradient back.
3. Messages between neighbours are matched by order, not by tags: both sides read the same schedule,
   so the receiver knows the order in which its neighbour will send (`Mailbox`). Sends never block
   (isend) and are "send" events of their own, outside the F or B that made the message; receives
   are posted ahead (irecv) and an op waits for its message: the time it waits is the bubble,
   recorded as a "wait" event.
4. Zero-bubble schedules split B: every linear layer's weight gradient X^T dY (nn.Linear's and
   tensor parallel's column/row-parallel slices alike, through their `weight_grads` seam) is queued
   during B and computed by W (`WeightGradStore`, after Qi et al., 2024); all other gradients are
   cheap and are computed in B. Under ZeRO-3 the store tells the strategy which gradients W owes:
   a layer's weights are gathered for B (dX = dY W) and freed after it, W reads only X and dY, and
   the layer's gradient is reduce-scattered at the end of W (zero3.py, `grad_deferred`). So a W
   op's time includes that collective, as B's includes it under 1F1B.
Gradients accumulate over the micro-batches (each loss is divided by m), so after the flush every
parameter's .grad equals the whole batch's: the optimizer step is the single-process one.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import Comm
from ..data import shard
from ..mesh import rank_device
from ..meters import HeldBytes
from ..model import Linear
from .schedules import Op, Schedule
from .tensor import ColumnParallelLinear, RowParallelLinear


# ---------------------------------------------------------------------------------------------
# 1. stages
# ---------------------------------------------------------------------------------------------
def chunk_layers(chunk: int, n_chunks: int, layers: int) -> range:
    per = layers // n_chunks
    return range(chunk * per, (chunk + 1) * per)


def partition(model, schedule: Schedule, rank: int) -> list[int]:
    """Drop every module this rank's chunks do not use (in place); returns the chunks it holds.
    A chunk runs the layers of its stage (schedule.stage_of: itself, but for DualPipe's copies)."""
    mine = schedule.chunks_of(rank)
    n, layers = schedule.stages, len(model.blocks)
    stages = {schedule.stage_of(c) for c in mine}
    kept = {i for st in stages for i in chunk_layers(st, n, layers)}
    for i in range(layers):
        if i not in kept:
            model.blocks[i] = nn.Identity()  # keeps the indices, hence the parameter names
    if 0 not in stages:
        model.embed = None
    if n - 1 not in stages:
        model.head = None
    return mine


def forward_chunk(model, chunk: int, n_chunks: int, x: torch.Tensor, targets=None):
    """The part of the model that chunk `chunk` owns: its slice of the same modules, so the same
    numbers. x: token ids [b, s] on chunk 0, else activations [b, s, h]; returns [b, s, h], or the
    loss on the last chunk."""
    layers = chunk_layers(chunk, n_chunks, len(model.blocks))
    return model(x, targets, blocks=(layers.start, layers.stop))


# ---------------------------------------------------------------------------------------------
# 2. split backward (zero bubble): weight gradients on demand
# ---------------------------------------------------------------------------------------------
class WeightGradStore:
    """What W needs: for each (micro-batch, chunk), the inputs X and output gradients dY of its
    Linear layers. B fills it; W empties it into the weights' .grad.

    `observer`: a gradient strategy that must hear of gradients autograd does not compute (ZeRO-3
    reduce-scatters a layer's gradient once it is complete, zero3.py): told by B that a weight's
    gradient is left to W (`grad_deferred`), and by W when it is in .grad (`grad_accumulated`)."""

    def __init__(self):
        self.key = None  # the (micro-batch, chunk) whose B is running
        self.pending: dict[tuple, list] = {}
        self.observer = None

    @contextmanager
    def collecting(self, key):
        self.key = key
        try:
            yield
        finally:
            self.key = None

    def put(self, weight, bias, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        """The parameters the op used (a row-parallel layer adds its bias after the all-reduce,
        outside the op: that bias's gradient is autograd's, not W's)."""
        self.pending.setdefault(self.key, []).append((weight, bias, x, grad_out))
        if self.observer is not None:
            for p in (weight, bias):
                if p is not None:
                    self.observer.grad_deferred(p)

    def linear(self, x, weight, bias, layer):
        """x W^T + b for a layer whose weight gradient this store computes later (in W)."""
        return _LinearInputGradOnly.apply(x, weight, bias, self)

    @torch.no_grad()  # X was saved by autograd and still requires grad: dW must not record a graph
    def compute(self, key) -> None:
        for weight, bias, x, grad_out in self.pending.pop(key):
            x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
            _accumulate(weight, g2.t() @ x2, self.observer)  # [out, in]
            if bias is not None:
                _accumulate(bias, g2.sum(0), self.observer)  # [out]


def _accumulate(p: torch.Tensor, grad: torch.Tensor, observer=None) -> None:
    """p.grad += grad. Reads no element of p: under ZeRO-3 p's unit is freed by now."""
    if p.grad is None:
        p.grad = grad
    else:
        p.grad += grad
    if observer is not None:
        observer.grad_accumulated(p)


class _LinearInputGradOnly(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dX = dY W and leaves dW, db to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: [..., out]
        x, weight = ctx.saved_tensors
        grad_in = grad_out @ weight  # dX: [..., in], before put: after it ZeRO-3 may free weight
        ctx.store.put(ctx.weight, ctx.bias, x, grad_out)
        return grad_in, None, None, None


def split_weight_gradients(model, store: WeightGradStore) -> None:
    """Route every linear layer of the (partitioned) model through `_LinearInputGradOnly`, by
    setting its `weight_grads` seam (model.Linear, tensor parallel's column/row-parallel layers)."""
    for module in model.modules():
        if isinstance(module, (Linear, ColumnParallelLinear, RowParallelLinear)):
            module.weight_grads = store


# ---------------------------------------------------------------------------------------------
# 3. messages between stages
# ---------------------------------------------------------------------------------------------
class Mailbox:
    """Point-to-point messages of one step, matched by the order each neighbour sends them in.

    A message is ("act", micro-batch, chunk) going forward into `chunk`, or ("grad", micro-batch,
    chunk) going backward into it. From the schedule every rank derives the sequence of messages
    each neighbour will send it, and receives them in that order, keeping early ones in `inbox`
    until their op runs. Messages between two chunks on the same rank are handed over in memory.

    Receives are posted ahead (`AHEAD` per neighbour, irecv). Why: gloo fills a posted receive on
    its own thread while this one computes, and taking it costs ~3 us; a message whose receive is
    only posted when an op needs it waits in the socket until then, and the blocking recv costs
    ~80 us (measured on 2 cores: read, hand-off, wake-up), on every message of the step."""

    AHEAD = 1  # receives in flight per neighbour: one message's buffer held early, no more

    def __init__(self, comm: Comm, schedule: Schedule, rank: int, shape, dtype, device,
                 axis: str = "pp"):
        self.comm, self.rank, self.shape, self.dtype, self.device = comm, rank, shape, dtype, device
        self.axis = axis
        self.owner = schedule.owner
        self.expected = {src: deque(self._sent_by(schedule, src)) for src in range(schedule.pp)
                         if src != rank}
        self.posted = {src: deque() for src in self.expected}  # (key, buffer, handle), in order
        self.inbox: dict[tuple, torch.Tensor] = {}
        self.sends: list = []
        for src in self.expected:
            for _ in range(self.AHEAD):
                self._post(src)

    def _sent_by(self, schedule: Schedule, src: int):
        """The messages `src` sends to this rank, in its order."""
        last = schedule.stages - 1
        for op in schedule.ops[src]:
            c = op.chunk
            if op.kind == "F" and schedule.stage_of(c) < last and self.owner[c + 1] == self.rank:
                yield ("act", op.microbatch, c + 1)
            elif op.kind == "B" and schedule.stage_of(c) > 0 and self.owner[c - 1] == self.rank:
                yield ("grad", op.microbatch, c - 1)

    def _post(self, src: int) -> None:
        """Post the receive of the next message `src` will send (if any is left this step)."""
        if not self.expected[src]:
            return
        key = self.expected[src].popleft()
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        handle = self.comm.irecv(buf, src, self.axis, message=key[0], microbatch=key[1],
                                 chunk=key[2])
        self.posted[src].append((key, buf, handle))

    def send(self, key: tuple, tensor: torch.Tensor) -> None:
        kind, micro, chunk = key
        dst = self.owner[chunk]
        if dst == self.rank:
            self.inbox[key] = tensor
            return
        tensor = tensor.contiguous()
        self.sends.append((self.comm.isend(tensor, dst, self.axis, message=kind, microbatch=micro,
                                           chunk=chunk), tensor))

    def receive(self, key: tuple) -> torch.Tensor:
        """The message `key`, waiting for it (and for the ones `src` sent before it) if need be."""
        kind, micro, chunk = key
        src = self.owner[chunk - 1] if kind == "act" else self.owner[chunk + 1]
        while key not in self.inbox:
            if src == self.rank or not self.posted[src]:
                raise RuntimeError(f"rank {self.rank} waits for {key} that no schedule op sends")
            next_key, buf, handle = self.posted[src].popleft()
            handle.wait()
            self.inbox[next_key] = buf
            self._post(src)
        return self.inbox.pop(key)

    def finish(self) -> None:
        for handle, _ in self.sends:
            handle.wait()
        self.sends.clear()


# ---------------------------------------------------------------------------------------------
# 4. the runner
# ---------------------------------------------------------------------------------------------
class PipelineRunner:
    """Runs one rank's ops of `schedule` for each training step (a StepRunner, interfaces.py)."""

    reference_per_microbatch = False

    def __init__(self, model, comm: Comm, schedule: Schedule, timeline, live=None,
                 axis: str = "pp", seq_shards: int = 1):
        """`seq_shards`: over how many ranks the sequence of a stage's output is split (tensor
        parallel's sequence parallel keeps [b, s/tp, h] between blocks), to size the messages."""
        self.model, self.comm, self.schedule, self.timeline = model, comm, schedule, timeline
        self.axis, self.seq_shards = axis, seq_shards
        self.rank = comm.rank(axis)
        self.chunks = partition(model, schedule, self.rank)
        self.store = WeightGradStore() if schedule.split_backward else None
        if self.store is not None:
            split_weight_gradients(model, self.store)
        self.held = HeldBytes(live, timeline)  # bytes held after every op, for the report
        self.strategy = None  # the gradient strategy (attach): steps, and the model states' bytes

    # -- the StepRunner interface ---------------------------------------------------------------
    def attach(self, strategy) -> None:
        self.strategy = strategy
        if self.store is not None:  # (ZeRO-3 must hear of the gradients W computes)
            self.store.observer = strategy

    def train_step(self, step: int, batch) -> float:
        """The schedule's ops over m micro-batches of this rank's share [b/dp, s], then, after the
        flush, the gradient sync over data parallel and the optimizer step."""
        m = self.schedule.microbatches
        micro = [shard(batch, i, m) for i in range(m)]  # m x ([b/(dp*m), s] x 2)
        device = rank_device()
        self.strategy.zero_grad()
        with self.strategy.sync(False):  # gradients accumulate over the micro-batches ...
            loss = self.run(step, [x.to(device) for x, _ in micro], [y.to(device) for _, y in micro])
        with self.timeline.op("grad_sync", step):  # ... and are averaged over dp after the flush
            if self.schedule.directions == 2:
                self._sum_copies(step)
            self.strategy.finish_gradient_sync()
        self._update(step)
        return self._from_last_stage(loss)

    def _sum_copies(self, step: int) -> None:
        """DualPipe: every stage lives on two ranks (i and p-1-i hold the same stages i and p-1-i),
        and each copy saw only its direction's half of the micro-batches. Why sum before the step:
        the whole batch's gradient is the sum of the two halves (each loss is already divided by
        m), and only if both copies step with that same gradient do they stay equal, step after
        step, to each other and to the reference's one model. An all-reduce of two ranks is one
        exchange: both send their gradients and add what they get (a + b == b + a, bit for bit)."""
        mirror = self.schedule.pp - 1 - self.rank
        params = [p for _, p in sorted(self.model.named_parameters())]  # the same names on both
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        mine = torch.cat([g.reshape(-1) for g in grads])
        theirs = torch.empty_like(mine)
        self.comm.sendrecv(mine, mirror, theirs, mirror, self.axis, message="stage_copy_grads")
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = g.add_(theirs[offset:offset + n].view_as(g))  # in place: ZeRO's views stay
            offset += n

    def _update(self, step: int) -> None:
        with self.timeline.op("optimizer", step):
            self.strategy.step()

    def _from_last_stage(self, value: float) -> float:
        """The loss is known where a last stage runs (two ranks under DualPipe, each its direction's
        share; the others hold 0): summed over the pipeline. A metric, not a recorded collective."""
        mesh = self.comm.mesh
        if mesh.size(self.axis) == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=rank_device())
        dist.all_reduce(t, group=mesh.groups[self.axis])
        return t.item()

    def activation_peak(self) -> int:
        return self.held.peak

    def report(self) -> dict:
        return {}

    # -- one step's ops -------------------------------------------------------------------------
    def run(self, step: int, micro_inputs: list, micro_targets: list) -> float:
        """All ops of this rank for one step; returns the summed micro-batch losses (last stage)."""
        s, m = self.schedule, self.schedule.microbatches
        x0 = micro_inputs[0]
        shape = (x0.shape[0], x0.shape[1] // self.seq_shards, self.model.config.d_model)  # [b/m, s, h]
        dtype = next(self.model.parameters()).dtype
        self.mailbox = Mailbox(self.comm, s, self.rank, shape, dtype, x0.device, self.axis)
        self.inputs, self.targets = micro_inputs, micro_targets
        self.saved: dict[tuple, tuple] = {}  # (micro-batch, chunk) -> (input, output)
        self.loss = 0.0
        self.step = step
        for op in s.ops[self.rank]:
            {"F": self._forward, "B": self._backward, "W": self._weights}[op.kind](op)
        with self.timeline.op("wait", step, stage=self.rank, waiting_for="sends"):
            self.mailbox.finish()
        return self.loss

    def _event(self, op: Op):
        return self.timeline.op(op.kind, self.step, op.microbatch, op.chunk, rank=self.rank)

    def _send(self, key: tuple, tensor: torch.Tensor) -> None:
        """Hand a message to the link: its own "send" event, outside the F or B that made it (on a
        GPU the copy runs on a communication stream while the next op computes)."""
        kind, micro, to = key
        with self.timeline.op("send", self.step, micro, to - 1 if kind == "act" else to + 1,
                              message=kind, to_chunk=to):
            self.mailbox.send(key, tensor)

    def _input(self, op: Op) -> torch.Tensor:
        if self.schedule.stage_of(op.chunk) == 0:
            return self.inputs[op.microbatch]
        with self.timeline.op("wait", self.step, op.microbatch, op.chunk, waiting_for=f"F{op.microbatch}.{op.chunk - 1}"):
            x = self.mailbox.receive(("act", op.microbatch, op.chunk))
        return x.detach().requires_grad_()  # a leaf: B reads its .grad and sends it back

    def _forward(self, op: Op) -> None:
        x = self._input(op)
        s = self.schedule
        last = s.stage_of(op.chunk) == s.stages - 1
        with self._sampling(), self._event(op):
            out = forward_chunk(self.model, s.stage_of(op.chunk), s.stages, x,
                                self.targets[op.microbatch] if last else None)
            if last:
                out = out / self.schedule.microbatches  # the whole batch's loss is the mean
                self.loss += out.item()
        if not last:
            self._send(("act", op.microbatch, op.chunk + 1), out.detach())
        self.saved[(op.microbatch, op.chunk)] = (x, out)

    def _output_grad(self, op: Op):
        """The gradient of this chunk's output, from the next chunk (None on the last: the loss)."""
        if self.schedule.stage_of(op.chunk) == self.schedule.stages - 1:
            return None
        with self.timeline.op("wait", self.step, op.microbatch, op.chunk,
                              waiting_for=f"B{op.microbatch}.{op.chunk + 1}"):
            return self.mailbox.receive(("grad", op.microbatch, op.chunk))

    def _backward(self, op: Op) -> None:
        key = (op.microbatch, op.chunk)
        grad = self._output_grad(op)
        with self._sampling(), self._event(op):
            x, out = self.saved.pop(key)
            with self.store.collecting(key) if self.store else nullcontext():
                torch.autograd.backward(out, grad)
        if self.schedule.stage_of(op.chunk) > 0:
            self._send(("grad", op.microbatch, op.chunk - 1), x.grad)

    def _weights(self, op: Op) -> None:
        with self._sampling(), self._event(op):
            self.store.compute((op.microbatch, op.chunk))

    def _sampling(self):
        return self.held.after(self.strategy)  # (meters.HeldBytes: the bytes held after the op)
