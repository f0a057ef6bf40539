"""Collectives over the axes of a mesh, and the ring all-reduce they rest on, written on send/recv.

`Comm` is what every strategy calls: all-reduce, all-gather, reduce-scatter, all-to-all and
broadcast over a named mesh axis ("dp", "tp", ...), point-to-point sends and receives, and
host <-> device copies. Each call also leaves a record (meters.CommMeter: payload bytes, the ring
model's wire bytes, the bytes really written to the sockets, wall and CPU time) in `comm.records`,
which lessons, the app and tests read. Below Comm, `ring_all_reduce` builds an all-reduce out of
sends to a neighbour alone (lesson 01), and a probe watches any ring by what it actually sends.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import theory
from .mesh import Mesh
from .meters import POLLED, CommMeter, wait_for


# torch 2.13 renamed the flat-tensor collectives; keep working on older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


OWN_CORE = "PARALLEL_MINI_OWN_CORE"  # "1" in a rank that launch.pin_to_core gave a core of its own


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Recorded collectives over the axes of a Mesh. One per rank; pass it explicitly."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.step = 0  # set by the training loop; "setup" records use -1
        backend = dist.get_backend() if dist.is_initialized() else None
        self.meter = CommMeter(backend)
        self.records, self.p2p_log = self.meter.records, self.meter.p2p_log  # what others read
        self._landing: dict = {}  # (dtype, device) -> a receive buffer kept (landing)
        self._last_recv: dict = {}  # (axis, src) -> the latest receive's Work, kept (_posted_recv)
        self._last_step: dict = {}  # (axis, src, dst) -> a sendrecv's two Works, kept (sendrecv)
        # wait for collectives by polling (meters.wait_for says why): gloo, a core of our own
        self.polls = backend == "gloo" and os.environ.get(OWN_CORE) == "1"

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def rank(self, axis: str) -> int:
        return self.mesh.local_rank(axis)

    def _collective(self, op, axis, payload, call, async_op, tags, wire=None, rank_in_chain=0):
        """Run `call(group of axis, async_op)`, recorded with payload S = `payload`; a group of one
        moves nothing (the copies the caller made did the work). With a core of our own, a call
        the caller waits for is started asynchronously and polled (meters.wait_for says why)."""
        n = self.size(axis)
        if wire is None:  # the ring model (theory.wire_bytes)
            wire = theory.wire_bytes(op, _nbytes(payload), n, rank_in_chain)
        rec = self.meter.record(op, axis, payload, payload.numel(), wire, self.step,
                                async_op=async_op, **tags)
        if n == 1:
            return self.meter.nothing_moved(rec, async_op)
        self.meter.begin(rec)
        poll = self.polls and op in POLLED
        if async_op:
            return self.meter.end(rec, call(self.mesh.groups[axis], True), True, poll)
        if poll:  # started asynchronously, then waited for by polling
            wait_for(call(self.mesh.groups[axis], True), poll)
            return self.meter.end(rec)
        return self.meter.end(rec, call(self.mesh.groups[axis], False))

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor, axis: str, op=dist.ReduceOp.SUM, async_op=False, **tags):
        """In place: every rank ends with the sum. Payload S = the tensor."""
        return self._collective("all_reduce", axis, tensor, lambda g, a: dist.all_reduce(
            tensor, op=op, group=g, async_op=a), async_op, tags)

    def all_gather(self, output, tensor, axis: str, async_op=False, **tags):
        """output = concat of every rank's `tensor` along dim 0. Payload S = the output."""
        if self.size(axis) == 1:
            output.copy_(tensor)
        return self._collective("all_gather", axis, output, lambda g, a: _all_gather(
            output, tensor, group=g, async_op=a), async_op, tags)

    def reduce_scatter(self, output, tensor, axis: str, op=dist.ReduceOp.SUM, async_op=False,
                       **tags):
        """output = this rank's 1/N slice of the sum of every rank's `tensor`. Payload S = input."""
        if self.size(axis) == 1:
            output.copy_(tensor)
        return self._collective("reduce_scatter", axis, tensor, lambda g, a: _reduce_scatter(
            output, tensor, op=op, group=g, async_op=a), async_op, tags)

    def all_to_all(self, output, tensor, axis: str, out_splits=None, in_splits=None,
                   async_op=False, **tags):
        """Rank i's j-th slice goes to rank j's i-th slot. Payload S = this rank's input. Uneven
        splits (in_splits[j] rows of `tensor` to rank j; expert parallel's tokens): what this rank
        sends is every row but its own slice, not (N-1)/N of S."""
        n, wire = self.size(axis), None
        if n == 1:
            output.copy_(tensor)
        elif in_splits is not None:
            row_bytes = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
            wire = row_bytes * (sum(in_splits) - in_splits[self.rank(axis)])
        return self._collective("all_to_all", axis, tensor, lambda g, a: dist.all_to_all_single(
            output, tensor, out_splits, in_splits, group=g, async_op=a), async_op,
            {**tags, "in_splits": in_splits} if in_splits else tags, wire=wire)

    def broadcast(self, tensor, axis: str, src: int = 0, async_op=False, **tags):
        """Every rank gets `src`'s tensor (src is the axis-local rank). Payload S = the tensor."""
        n = self.size(axis)
        chain_pos = (self.rank(axis) - src) % n if n > 1 else 0
        return self._collective("broadcast", axis, tensor, lambda g, a: dist.broadcast(
            tensor, self.mesh.global_rank(axis, src), group=g, async_op=a), async_op,
            tags, rank_in_chain=chain_pos)

    def transfer(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        """Copy between device and host memory ("d2h" / "h2d"), recorded on the "pcie" link:
        offload's traffic is not collective, but it is bytes that cost time on a real bus."""
        rec = self.meter.record(direction, "pcie", _nbytes(src), src.numel(), _nbytes(src),
                                self.step, wire_bytes_measured=None)  # a memory copy, no socket
        self.meter.begin(rec, sockets=False)
        dst.copy_(src)
        self.meter.end(rec)

    def landing(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer of `numel` elements of `like`'s dtype and device to receive into, kept between
        calls (grown when too small); one ring at a time per Comm. Why keep it: a fresh tensor of
        many MB is memory the OS maps and zeroes page by page when it is first written.
        `python -m parallel_mini.bench ring` on two idle cores, 4 ranks: 0.55-1.02 of gloo's bus
        bandwidth with fresh buffers, 0.86-1.06 with kept ones (docs/gpu.md, section 4). gloo's
        ring, too, allocates only two segments of at most 1 MiB (gloo/allreduce.cc, ring())."""
        key = (like.dtype, like.device)
        if key not in self._landing or self._landing[key].numel() < numel:
            self._landing[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._landing[key][:numel]

    def in_a_row(self):
        """`with comm.in_a_row():` around ops that follow one another with nothing between them
        (a ring's steps): the bytes written to the sockets are read once at each end of the run,
        not at each end of every op (meters.WireMeter.in_a_row says why); the ops share them."""
        return self.meter.wire.in_a_row()

    # -- point to point ------------------------------------------------------------------------
    def _posted_recv(self, tensor: torch.Tensor, axis: str, src: int):
        """Post a receive from axis-rank `src`; its Work is kept until the next receive from `src`
        has been posted. Why: on gloo, a finished receive whose Work is freed *before* the next
        receive from the same rank is posted makes that next message far slower. Measured on the
        2-core machine, 2 gloo ranks, 2,000 steps of irecv + isend + wait (4 B): 84-99 us a step
        while each receive's Work lives until the next is posted, 700-930 us when it is freed
        first; keeping the send's Work instead does not help. (Where in gloo the time goes was not
        traced.) The ring all-reduce on 2 ranks, 64 KB: 0.58 ms with the Work kept, 3.74 ms
        without (docs/bench-2cpu-2026-11-27-late, section 3, with the scripts that measured it)."""
        work = dist.irecv(tensor, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        self._last_recv[(axis, src)] = work  # the previous one is freed now, after this posting
        return work

    def _send_record(self, tensor, axis: str, dst: int, **tags) -> dict:
        wire = theory.wire_bytes("send", _nbytes(tensor), self.size(axis))
        return self.meter.record("send", axis, tensor, tensor.numel(), wire, self.step, peer=dst,
                                 **tags)

    def _recv_record(self, tensor, axis: str, src: int, **tags) -> dict:
        return self.meter.record("recv", axis, tensor, tensor.numel(), 0, self.step, peer=src,
                                 wire_bytes_measured=0, **tags)  # a receive writes nothing

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, axis: str,
                 **log):
        """Send `send` to axis-rank `dst` while receiving `recv` from axis-rank `src`.

        Posting both before waiting is what lets a ring of blocking ranks make progress. Any
        keyword arguments (step, phase, chunk...) are kept in the send's log entry.

        Both Works are kept until the next sendrecv between the same ranks has waited for its own
        (as _posted_recv keeps a receive's): on gloo, freeing a finished send's Work while the
        next messages are in flight slows them. Measured on the 2-core machine, the ring
        all-reduce on 4 ranks, 64 KB and 1 MB, ms a call: 7.9-8.3 freeing the send's Work at once,
        5.7-6.3 keeping both until after the next waits; on 2
        ranks, an exchange after one whose Works were freed took 2.4-2.7 ms, 0.19 ms after one
        whose Works were kept (docs/bench-2cpu-2026-12-07, section 3)."""
        sent, got = self._send_record(send, axis, dst), self._recv_record(recv, axis, src)
        self.meter.begin(sent)
        receiving = dist.irecv(recv, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        receiving.wait()
        sending.wait()
        self._last_step[(axis, src, dst)] = (receiving, sending)  # the previous two freed now
        self.meter.end(sent)
        got["end"] = sent["end"]
        self.meter.sent(sent, send, self.rank(axis), dst, **log)

    def exchange(self, send: torch.Tensor, dst: int, receiving, axis: str, **log):
        """One step of a ring whose receives were all posted ahead (with `irecv`): start sending
        `send` to axis-rank `dst`, then wait for `receiving`, this step's receive. Returns the
        send's handle: wait on it before `send` is written again. In the p2p log (sendrecv's, with
        the same keyword arguments) the step runs from the send's start to the receive's arrival.
        Its first element is read before the send starts: a receive posted ahead may overwrite
        the tensor once the message has gone (ring_all_reduce's all-gather does)."""
        rec = self._send_record(send, axis, dst, async_op=True)
        entry = self.meter.sent(rec, send, self.rank(axis), dst, **log)
        self.meter.begin(rec)
        sending = self.meter.end(rec, dist.isend(send, self.mesh.global_rank(axis, dst),
                                                 group=self.mesh.groups[axis]), async_op=True)
        receiving.wait()
        entry["end"] = receiving.record["end"]
        return sending

    def isend(self, tensor: torch.Tensor, dst: int, axis: str, **tags):
        """Start sending `tensor` to axis-rank `dst`; returns a handle to wait on before the tensor
        may be reused. A pipeline stage sends and goes on computing (its receiver pulls)."""
        rec = self.meter.begin(self._send_record(tensor, axis, dst, async_op=True, **tags))
        work = dist.isend(tensor, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        return self.meter.end(rec, work, async_op=True)

    def irecv(self, tensor: torch.Tensor, src: int, axis: str, **tags):
        """Start receiving into `tensor` from axis-rank `src`; returns a handle to wait on. Ring
        attention posts the next block's receive, then computes on the current one."""
        rec = self._recv_record(tensor, axis, src, async_op=True, **tags)
        self.meter.begin(rec, sockets=False)
        work = self._posted_recv(tensor, axis, src)
        return self.meter.end(rec, work, async_op=True)

    def recv(self, tensor: torch.Tensor, src: int, axis: str, **tags) -> None:
        """Receive into `tensor` from axis-rank `src`, blocking: the time spent here is waiting."""
        rec = self.meter.begin(self._recv_record(tensor, axis, src, **tags), sockets=False)
        dist.recv(tensor, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        self.meter.end(rec)

    def recv_any(self, tensor: torch.Tensor, axis: str, **tags) -> int:
        """Receive into `tensor` from whichever rank of `axis` sends first, blocking; returns that
        sender's axis-rank. A parameter server serves its workers in the order they push (gloo
        can; NCCL cannot receive from an unnamed source)."""
        rec = self.meter.begin(self._recv_record(tensor, axis, None, **tags), sockets=False)
        sender = dist.recv(tensor, group=self.mesh.groups[axis])  # a global rank
        self.meter.end(rec)
        rec["peer"] = self.mesh.members[axis].index(sender)
        return rec["peer"]


# ---------------------------------------------------------------------------------------------
# Ring all-reduce (Patarasuk & Yuan, 2009; popularised for deep learning by Baidu, 2017)
# ---------------------------------------------------------------------------------------------
def ring_all_reduce(x: torch.Tensor, comm: Comm, axis: str = "dp") -> torch.Tensor:
    """Sum `x` in place over the ranks of `axis`, using only send/recv to ring neighbours.

    The tensor is cut into N chunks (sizes differ by at most one element when N does not divide
    it). Phase 1, reduce-scatter: at step s rank r sends chunk (r-s) to the right and adds the chunk
    (r-s-1) that arrives from the left; after N-1 steps rank r holds the full sum of chunk (r+1).
    Phase 2, all-gather: the finished chunks travel once more around the ring, N-1 steps.
    Every step moves one chunk, X/N bytes: 2(N-1)/N * X per rank in all, whatever N.

    Every receive is posted before the first send. Why: gloo sends a message only once the
    receiver has said that its receive is posted (gloo/transport/tcp/pair.cc, Pair::send); posted
    step by step, every message waits for its receiver to reach that step and say so. Posted
    ahead, a message leaves the moment its sender has it ready (docs/bench-2cpu-2026-12-07,
    section 7, has the figures). The price: N-1 landing slots, (N-1)/N of x, where a ring that
    posts each receive at its step needs one. gloo's ring (gloo/allreduce.cc) posts each receive
    two segments before it waits for it, keeping two segments in flight."""
    n, r = comm.size(axis), comm.rank(axis)
    if n == 1:
        return x
    chunks = list(x.view(-1).tensor_split(n))  # views: writing a chunk writes x
    right, left = (r + 1) % n, (r - 1) % n
    rs = [((r - s) % n, (r - s - 1) % n) for s in range(n - 1)]  # (send, receive) chunk per step
    ag = [((r + 1 - s) % n, (r - s) % n) for s in range(n - 1)]
    # where each step's incoming chunk lands: reduce-scatter into a slot of its own (added to the
    # chunk after; N-1 slots, all receiving at once; kept by comm, Comm.landing says why),
    # all-gather straight into the chunk. Safe to post those early: the message that fills chunk c
    # carries the sum over every rank, this one's chunk c included, so it cannot arrive before
    # this rank's own send of chunk c has been received.
    width = chunks[0].numel()  # chunk 0: the largest
    slots = comm.landing((n - 1) * width, x)
    lands = [slots[s * width: s * width + chunks[i].numel()] for s, (_, i) in enumerate(rs)]
    lands += [chunks[i] for _, i in ag]
    with comm.in_a_row():  # the steps' socket bytes read once for all of them (Comm.in_a_row)
        receiving = [comm.irecv(land, left, axis) for land in lands]
        sending = []
        for step, (send_i, recv_i) in enumerate(rs):  # reduce-scatter
            sending.append(comm.exchange(chunks[send_i], right, receiving[step], axis, step=step,
                                         phase="reduce-scatter", chunk=send_i))
            chunks[recv_i] += lands[step]
        for step, (send_i, _) in enumerate(ag, start=n - 1):  # all-gather
            sending.append(comm.exchange(chunks[send_i], right, receiving[step], axis, step=step,
                                         phase="all-gather", chunk=send_i))
        for handle in sending:  # before x may be written again
            handle.wait()
    return x


# ---------------------------------------------------------------------------------------------
# Probe: watch any ring implementation by what it actually sends
# ---------------------------------------------------------------------------------------------
def probe_input(numel: int, rank: int, n: int) -> torch.Tensor:
    """x[p] = p * 2^n + 2^rank (int64). A sum over a set S of ranks at position p is
    |S|*p*2^n + mask(S): the low n bits say *whose* data a message carries, the rest *where*."""
    return torch.arange(numel, dtype=torch.int64) * (1 << n) + (1 << rank)
