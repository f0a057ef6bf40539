"""Collectives over the axes of a mesh, and the ring all-reduce they rest on, written on send/recv.

`Comm` is what every strategy calls: all-reduce, all-gather, reduce-scatter, all-to-all and
broadcast over a named mesh axis ("dp", "tp", ...), point-to-point sends and receives, and
host <-> device copies. Each call also leaves a record (meters.CommMeter: payload bytes, the ring
model's wire bytes, the bytes really written to the sockets, wall and CPU time) in `comm.records`,
which lessons, the app and tests read. Below Comm, `ring_all_reduce` builds an all-reduce out of
sends to a neighbour alone (lesson 01), and a probe watches any ring by what it actually sends.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import theory
from .mesh import Mesh
from .meters import CommMeter


# torch 2.13 renamed the flat-tensor collectives; keep working on older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Recorded collectives over the axes of a Mesh. One per rank; pass it explicitly."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.step = 0  # set by the training loop; "setup" records use -1
        self.meter = CommMeter(dist.get_backend() if dist.is_initialized() else None)
        self.records, self.p2p_log = self.meter.records, self.meter.p2p_log  # what others read
        self._posted: dict = {}  # (axis, src) -> (tensor, work): a receive posted early (sendrecv)
        self._landing: dict = {}  # (dtype, device, which) -> a receive buffer kept (landing)

    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def rank(self, axis: str) -> int:
        return self.mesh.local_rank(axis)

    def _collective(self, op, axis, payload, call, async_op, tags, wire=None, rank_in_chain=0):
        """Run `call(group of axis)`, recorded with payload S = `payload`; a group of one moves
        nothing (the copies the caller made did the work)."""
        n = self.size(axis)
        if wire is None:  # the ring model (theory.wire_bytes)
            wire = theory.wire_bytes(op, _nbytes(payload), n, rank_in_chain)
        rec = self.meter.record(op, axis, payload, payload.numel(), wire, self.step,
                                async_op=async_op, **tags)
        if n == 1:
            return self.meter.nothing_moved(rec, async_op)
        self.meter.begin(rec)
        return self.meter.end(rec, call(self.mesh.groups[axis]), async_op)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor, axis: str, op=dist.ReduceOp.SUM, async_op=False, **tags):
        """In place: every rank ends with the sum. Payload S = the tensor."""
        return self._collective("all_reduce", axis, tensor, lambda g: dist.all_reduce(
            tensor, op=op, group=g, async_op=async_op), async_op, tags)

    def all_gather(self, output, tensor, axis: str, async_op=False, **tags):
        """output = concat of every rank's `tensor` along dim 0. Payload S = the output."""
        if self.size(axis) == 1:
            output.copy_(tensor)
        return self._collective("all_gather", axis, output, lambda g: _all_gather(
            output, tensor, group=g, async_op=async_op), async_op, tags)

    def reduce_scatter(self, output, tensor, axis: str, op=dist.ReduceOp.SUM, async_op=False,
                       **tags):
        """output = this rank's 1/N slice of the sum of every rank's `tensor`. Payload S = input."""
        if self.size(axis) == 1:
            output.copy_(tensor)
        return self._collective("reduce_scatter", axis, tensor, lambda g: _reduce_scatter(
            output, tensor, op=op, group=g, async_op=async_op), async_op, tags)

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
        return self._collective("all_to_all", axis, tensor, lambda g: dist.all_to_all_single(
            output, tensor, out_splits, in_splits, group=g, async_op=async_op), async_op,
            {**tags, "in_splits": in_splits} if in_splits else tags, wire=wire)

    def broadcast(self, tensor, axis: str, src: int = 0, async_op=False, **tags):
        """Every rank gets `src`'s tensor (src is the axis-local rank). Payload S = the tensor."""
        n = self.size(axis)
        chain_pos = (self.rank(axis) - src) % n if n > 1 else 0
        return self._collective("broadcast", axis, tensor, lambda g: dist.broadcast(
            tensor, self.mesh.global_rank(axis, src), group=g, async_op=async_op), async_op,
            tags, rank_in_chain=chain_pos)

    def transfer(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        """Copy between device and host memory ("d2h" / "h2d"), recorded on the "pcie" link:
        offload's traffic is not collective, but it is bytes that cost time on a real bus."""
        rec = self.meter.record(direction, "pcie", _nbytes(src), src.numel(), _nbytes(src),
                                self.step, wire_bytes_measured=None)  # a memory copy, no socket
        self.meter.begin(rec, sockets=False)
        dst.copy_(src)
        self.meter.end(rec)

    def landing(self, numel: int, like: torch.Tensor, which: int = 0) -> torch.Tensor:
        """A buffer of `numel` elements of `like`'s dtype and device to receive into, kept between
        calls (grown when too small); `which` tells apart buffers that must not overlap; one ring
        at a time per Comm. Why keep it: a fresh tensor of many MB is memory the OS maps and
        zeroes page by page when it is first written. `python -m parallel_mini.bench ring` on two
        idle cores, 4 ranks: 0.55-1.02 of gloo's bus bandwidth with fresh buffers, 0.86-1.06 with
        kept ones (docs/gpu.md, section 4). gloo's ring, too, allocates only two segments of at
        most 1 MiB (gloo/allreduce.cc, ring())."""
        key = (like.dtype, like.device, which)
        if key not in self._landing or self._landing[key].numel() < numel:
            self._landing[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._landing[key][:numel]

    # -- point to point ------------------------------------------------------------------------
    def _send_record(self, tensor, axis: str, dst: int, **tags) -> dict:
        wire = theory.wire_bytes("send", _nbytes(tensor), self.size(axis))
        return self.meter.record("send", axis, tensor, tensor.numel(), wire, self.step, peer=dst,
                                 **tags)

    def _recv_record(self, tensor, axis: str, src: int, **tags) -> dict:
        return self.meter.record("recv", axis, tensor, tensor.numel(), 0, self.step, peer=src,
                                 wire_bytes_measured=0, **tags)  # a receive writes nothing

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, axis: str,
                 then_recv: torch.Tensor | None = None, **log):
        """Send `send` to axis-rank `dst` while receiving `recv` from axis-rank `src`.

        Posting both before waiting is what lets a ring of blocking ranks make progress. Any
        keyword arguments (step, phase, chunk...) are kept in the send's log entry.

        `then_recv`: the tensor this rank's *next* sendrecv on `axis` receives into, from the same
        `src` (a ring's next step): its receive is posted now, before this step waits. Why: gloo
        sends a message only once the receiver has announced a receive for it (a rendezvous);
        a sender that gets there first waits one more round trip for the announcement. Announced a
        whole step early, the receive is there when the neighbour sends; gloo's own ring keeps its
        receives posted ahead the same way. Receives are matched in the order they were posted."""
        sent, got = self._send_record(send, axis, dst), self._recv_record(recv, axis, src)
        g, left = self.mesh.groups[axis], self.mesh.global_rank(axis, src)
        self.meter.begin(sent)
        receiving = self._posted.pop((axis, src), None)
        if receiving is not None and receiving[0] is not recv:
            raise ValueError("sendrecv: `recv` is not the tensor the previous call's then_recv "
                             "posted a receive into (pass that same tensor)")
        work = receiving[1] if receiving else dist.irecv(recv, left, group=g)
        if then_recv is not None:
            self._posted[(axis, src)] = (then_recv, dist.irecv(then_recv, left, group=g))
            got["next_posted"] = True
        sending = dist.isend(send, self.mesh.global_rank(axis, dst), group=g)
        work.wait()
        sending.wait()
        self.meter.end(sent)
        got["end"] = sent["end"]
        self.meter.sent(sent, send, self.rank(axis), dst, **log)

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
        work = dist.irecv(tensor, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
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
    Every step moves one chunk, X/N bytes: 2(N-1)/N * X per rank in all, whatever N."""
    n, r = comm.size(axis), comm.rank(axis)
    if n == 1:
        return x
    chunks = list(x.view(-1).tensor_split(n))  # views: writing a chunk writes x
    right, left = (r + 1) % n, (r - 1) % n
    # where each of the 2(N-1) steps' incoming chunk lands: reduce-scatter into a buffer (added to
    # the chunk after), two of them in turn so that the next step's receive can be posted while
    # this step's buffer is still being added; all-gather straight into the chunk. Every step posts
    # the next step's receive early (sendrecv's then_recv). No landing place is still being sent
    # when its receive is posted, except at N = 2 (the one all-gather chunk is the reduce-scatter's
    # send), where the neighbour sends into it only after it has received all of that send. The
    # two buffers are kept by comm from call to call (Comm.landing says why)
    incoming = [comm.landing(chunks[0].numel(), x, i) for i in range(2)]  # chunk 0: the largest
    lands = [incoming[step % 2][: chunks[(r - step - 1) % n].numel()] for step in range(n - 1)]
    lands += [chunks[(r - step) % n] for step in range(n - 1)]
    for step in range(n - 1):  # reduce-scatter
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        comm.sendrecv(chunks[send_i], right, lands[step], left, axis, then_recv=lands[step + 1],
                      step=step, phase="reduce-scatter", chunk=send_i)
        chunks[recv_i] += lands[step]
    for step in range(n - 1):  # all-gather
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        last = n - 1 + step == len(lands) - 1
        comm.sendrecv(chunks[send_i], right, lands[n - 1 + step], left, axis,
                      then_recv=None if last else lands[n + step], step=n - 1 + step,
                      phase="all-gather", chunk=send_i)
    return x


# ---------------------------------------------------------------------------------------------
# Probe: watch any ring implementation by what it actually sends
# ---------------------------------------------------------------------------------------------
def probe_input(numel: int, rank: int, n: int) -> torch.Tensor:
    """x[p] = p * 2^n + 2^rank (int64). A sum over a set S of ranks at position p is
    |S|*p*2^n + mask(S): the low n bits say *whose* data a message carries, the rest *where*."""
    return torch.arange(numel, dtype=torch.int64) * (1 << n) + (1 << rank)
