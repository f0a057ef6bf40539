"""Collectives that keep a record of themselves, and ring all-reduce written on send/recv.

Every call through `Comm` appends one record: op, group (a mesh axis), count (elements), payload
bytes S, `wire_bytes_model` (the model: what this rank sends under the ring algorithm,
`theory.wire_bytes`), `wire_bytes_measured` (what this process really wrote to its sockets during
the op, see WireMeter; None where that cannot be read), the step, and wall/CPU time. Lessons and
the app read these records; tests compare them with theory.

Asynchronous calls return a handle whose completion time is taken by a callback when the backend
finishes, not when someone waits: that is what makes overlap with backward visible.
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from . import theory
from .mesh import Mesh


# torch 2.13 renamed the flat-tensor collectives; keep working on older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class WireMeter:
    """Bytes this process really wrote to its sockets, per op: Linux counts every byte passed to
    write()/send() by any thread of the process in `wchar` of /proc/self/io, gloo's I/O threads
    included. The counter is read when an op starts and when it ends (for an async op: when gloo
    reports it done, or at wait); the bytes written in between belong to the ops in flight. An op
    that ran alone gets exactly its own bytes; ops that overlapped (bucketed all-reduces during
    backward, a pipeline's sends) share each interval's bytes in proportion to their model bytes
    and are marked `wire_shared` (with the groups they overlapped: `wire_shared_with`). A step's
    total is exact either way; a group's sum is exact when none of its ops overlapped another
    group's. Unavailable (None) off Linux and on NCCL, whose bytes go through
    the GPU's own engines, not this process's sockets."""

    def __init__(self, backend: str | None):
        try:
            self.fd = os.open("/proc/self/io", os.O_RDONLY) if backend == "gloo" else None
        except OSError:
            self.fd = None
        self.lock = threading.Lock()
        self.inflight: list[dict] = []
        self.last = self._read() if self.fd is not None else 0

    def _read(self) -> int:
        for line in os.pread(self.fd, 1024, 0).splitlines():
            if line.startswith(b"wchar:"):
                return int(line.split()[1])
        return 0

    def _settle(self) -> None:
        """Hand the bytes written since the last reading to the ops in flight (lock held)."""
        now = self._read()
        delta, self.last = now - self.last, now
        if not self.inflight:
            return  # written while no op ran (a print, a file): not communication
        weights = [max(r["wire_bytes_model"], 1) for r in self.inflight]
        groups = sorted({r["group"] for r in self.inflight})
        for r, w in zip(self.inflight, weights):
            r["wire_bytes_measured"] += delta * w / sum(weights)
            if len(self.inflight) > 1:
                r["wire_shared"] = True
                r["wire_shared_with"] = sorted(set(r.get("wire_shared_with", [])) | set(groups))

    def begin(self, rec: dict) -> None:
        if self.fd is None:
            rec["wire_bytes_measured"] = None
            return
        with self.lock:
            self._settle()
            rec["wire_bytes_measured"] = 0
            self.inflight.append(rec)

    def end(self, rec: dict) -> None:
        if self.fd is None:
            return
        with self.lock:
            if any(r is rec for r in self.inflight):
                self._settle()
                self.inflight = [r for r in self.inflight if r is not rec]
                if not rec.get("wire_shared"):
                    rec["wire_bytes_measured"] = int(rec["wire_bytes_measured"])


class _Handle:
    """Wraps a torch.distributed Work; records when the op really completed."""

    def __init__(self, work, record: dict, meter: WireMeter):
        self.work, self.record, self.meter = work, record, meter
        try:
            fut = work.get_future()
        except (AttributeError, RuntimeError):  # gloo's point-to-point work has no future
            fut = None
        if fut is not None:
            fut.then(self._done)

    def _done(self, fut):
        self.record["end"] = time.perf_counter()
        self.meter.end(self.record)
        return None

    def wait(self):
        self.work.wait()
        self.meter.end(self.record)
        self.record.setdefault("end", time.perf_counter())
        self.record["waited_until"] = time.perf_counter()


class Comm:
    """Recorded collectives over the axes of a Mesh. One per rank; pass it explicitly."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.records: list[dict] = []
        self.step = 0  # set by the training loop; "setup" records use -1
        self.p2p_log: list[dict] = []  # every send, in order, with the first element (see ring)
        self.wire = WireMeter(dist.get_backend() if dist.is_initialized() else None)

    # -- bookkeeping ---------------------------------------------------------------------------
    def size(self, axis: str) -> int:
        return self.mesh.size(axis)

    def rank(self, axis: str) -> int:
        return self.mesh.local_rank(axis)

    def _record(self, op, axis, tensor_or_bytes, count, wire, **extra) -> dict:
        payload = tensor_or_bytes if isinstance(tensor_or_bytes, int) else \
            tensor_or_bytes.numel() * tensor_or_bytes.element_size()
        rec = {"op": op, "group": axis, "count": count, "payload_bytes": payload,
               "wire_bytes_model": wire, "step": self.step, "start": time.perf_counter(), **extra}
        self.records.append(rec)
        return rec

    def _finish(self, rec, work, async_op, cpu0):
        rec["cpu"] = time.thread_time() - cpu0
        if async_op:
            return _Handle(work, rec, self.wire)
        self.wire.end(rec)
        rec["end"] = time.perf_counter()
        return None

    def _collective(self, op, axis, payload_tensor, count, call, async_op, rank_in_chain=0,
                    tags=None, wire=None):
        n = self.size(axis)
        nbytes = payload_tensor.numel() * payload_tensor.element_size()
        if wire is None:
            wire = theory.wire_bytes(op, nbytes, n, rank_in_chain)
        rec = self._record(op, axis, payload_tensor, count, wire, async_op=async_op,
                           **(tags or {}))
        if n == 1:  # a group of one: nothing moves (the copies above did the work)
            rec["end"], rec["cpu"], rec["wire_bytes_measured"] = time.perf_counter(), 0.0, 0
            return _Done() if async_op else None
        cpu0 = time.thread_time()
        self.wire.begin(rec)
        work = call(self.mesh.groups[axis])
        return self._finish(rec, work, async_op, cpu0)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor, axis: str, op=dist.ReduceOp.SUM, async_op=False, **tags):
        """In place: every rank ends with the sum. Payload S = the tensor."""
        return self._collective("all_reduce", axis, tensor, tensor.numel(),
                                lambda g: dist.all_reduce(tensor, op=op, group=g, async_op=async_op),
                                async_op, tags=tags)

    def all_gather(self, output, tensor, axis: str, async_op=False, **tags):
        """output = concat of every rank's `tensor` along dim 0. Payload S = the output."""
        if self.size(axis) == 1:
            output.copy_(tensor)
        return self._collective("all_gather", axis, output, output.numel(),
                                lambda g: _all_gather(output, tensor, group=g, async_op=async_op), async_op, tags=tags)

    def reduce_scatter(self, output, tensor, axis: str, op=dist.ReduceOp.SUM, async_op=False, **tags):
        """output = this rank's 1/N slice of the sum of every rank's `tensor`. Payload S = input."""
        if self.size(axis) == 1:
            output.copy_(tensor)
        return self._collective("reduce_scatter", axis, tensor, tensor.numel(),
                                lambda g: _reduce_scatter(output, tensor, op=op, group=g,
                                                          async_op=async_op), async_op, tags=tags)

    def all_to_all(self, output, tensor, axis: str, out_splits=None, in_splits=None, async_op=False, **tags):
        """Rank i's j-th slice goes to rank j's i-th slot. Payload S = this rank's input. Uneven
        splits (in_splits[j] rows of `tensor` to rank j; expert parallel's tokens): what this rank
        sends is every row but its own slice, not (N-1)/N of S."""
        n, wire = self.size(axis), None
        if n == 1:
            output.copy_(tensor)
        elif in_splits is not None:
            row_bytes = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
            wire = row_bytes * (sum(in_splits) - in_splits[self.rank(axis)])
        return self._collective("all_to_all", axis, tensor, tensor.numel(),
                                lambda g: dist.all_to_all_single(output, tensor, out_splits,
                                                                 in_splits, group=g,
                                                                 async_op=async_op), async_op,
                                tags={**tags, "in_splits": in_splits} if in_splits else tags,
                                wire=wire)

    def broadcast(self, tensor, axis: str, src: int = 0, async_op=False, **tags):
        """Every rank gets `src`'s tensor (src is the axis-local rank). Payload S = the tensor."""
        n = self.size(axis)
        chain_pos = (self.rank(axis) - src) % n if n > 1 else 0
        return self._collective("broadcast", axis, tensor, tensor.numel(),
                                lambda g: dist.broadcast(tensor, self.mesh.global_rank(axis, src),
                                                         group=g, async_op=async_op),
                                async_op, rank_in_chain=chain_pos, tags=tags)

    def transfer(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        """Copy between device and host memory ("d2h" / "h2d"), recorded on the "pcie" link:
        offload's traffic is not collective, but it is bytes that cost time on a real bus."""
        nbytes = src.numel() * src.element_size()
        rec = self._record(direction, "pcie", nbytes, src.numel(), nbytes)
        rec["wire_bytes_measured"] = None  # a memory copy here, not a socket
        cpu0 = time.thread_time()
        dst.copy_(src)
        rec["end"], rec["cpu"] = time.perf_counter(), time.thread_time() - cpu0

    # -- point to point ------------------------------------------------------------------------
    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, axis: str,
                 **log):
        """Send `send` to axis-rank `dst` while receiving `recv` from axis-rank `src`.

        Posting both before waiting is what lets a ring of blocking ranks make progress. Any
        keyword arguments (step, phase, chunk...) are kept in the send's log entry."""
        rec = self._record("send", axis, send, send.numel(), theory.wire_bytes(
            "send", send.numel() * send.element_size(), self.size(axis)), peer=dst)
        self._record("recv", axis, recv, recv.numel(), 0, peer=src, wire_bytes_measured=0)
        cpu0 = time.thread_time()
        self.wire.begin(rec)
        g = self.mesh.groups[axis]
        ops = [dist.P2POp(dist.isend, send, self.mesh.global_rank(axis, dst), g),
               dist.P2POp(dist.irecv, recv, self.mesh.global_rank(axis, src), g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        self._finish(rec, None, False, cpu0)
        self.records[-1]["end"] = rec["end"]
        self.p2p_log.append({"seq": len(self.p2p_log), "src": self.rank(axis), "dst": dst,
                             "numel": send.numel(), "bytes": rec["payload_bytes"],
                             "start": rec["start"], "end": rec["end"],
                             "peek": _peek(send), **log})


    def isend(self, tensor: torch.Tensor, dst: int, axis: str, **tags):
        """Start sending `tensor` to axis-rank `dst`; returns a handle to wait on before the tensor
        may be reused. A pipeline stage sends and goes on computing (its receiver pulls)."""
        rec = self._record("send", axis, tensor, tensor.numel(), theory.wire_bytes(
            "send", tensor.numel() * tensor.element_size(), self.size(axis)), peer=dst,
            async_op=True, **tags)
        cpu0 = time.thread_time()
        self.wire.begin(rec)
        work = dist.isend(tensor, self.mesh.global_rank(axis, dst), group=self.mesh.groups[axis])
        return self._finish(rec, work, True, cpu0)

    def irecv(self, tensor: torch.Tensor, src: int, axis: str, **tags):
        """Start receiving into `tensor` from axis-rank `src`; returns a handle to wait on. Ring
        attention posts the next block's receive, then computes on the current one."""
        rec = self._record("recv", axis, tensor, tensor.numel(), 0, peer=src, async_op=True,
                           wire_bytes_measured=0, **tags)  # a receive writes nothing
        cpu0 = time.thread_time()
        work = dist.irecv(tensor, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        return self._finish(rec, work, True, cpu0)

    def recv(self, tensor: torch.Tensor, src: int, axis: str, **tags) -> None:
        """Receive into `tensor` from axis-rank `src`, blocking: the time spent here is waiting."""
        rec = self._record("recv", axis, tensor, tensor.numel(), 0, peer=src,
                           wire_bytes_measured=0, **tags)
        cpu0 = time.thread_time()
        dist.recv(tensor, self.mesh.global_rank(axis, src), group=self.mesh.groups[axis])
        self._finish(rec, None, False, cpu0)


class _Done:
    def wait(self):
        pass


def _peek(t: torch.Tensor):
    """The first element of an integer message: lets a probe run decode what was sent (ring)."""
    if t.numel() and not t.is_floating_point() and not t.is_complex():
        return int(t.reshape(-1)[0])
    return None


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
    incoming = torch.empty_like(chunks[0])  # chunk 0 is (one of) the largest
    for step in range(n - 1):  # reduce-scatter
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        buf = incoming[: chunks[recv_i].numel()]
        comm.sendrecv(chunks[send_i], right, buf, left, axis, step=step,
                      phase="reduce-scatter", chunk=send_i)
        chunks[recv_i] += buf
    for step in range(n - 1):  # all-gather
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        comm.sendrecv(chunks[send_i], right, chunks[recv_i], left, axis, step=n - 1 + step,
                      phase="all-gather", chunk=send_i)
    return x


# ---------------------------------------------------------------------------------------------
# Probe: watch any ring implementation by what it actually sends
# ---------------------------------------------------------------------------------------------
def probe_input(numel: int, rank: int, n: int) -> torch.Tensor:
    """x[p] = p * 2^n + 2^rank (int64). A sum over a set S of ranks at position p is
    |S|*p*2^n + mask(S): the low n bits say *whose* data a message carries, the rest *where*."""
    return torch.arange(numel, dtype=torch.int64) * (1 << n) + (1 << rank)


def decode_probe(value: int, n: int) -> tuple[int, int]:
    """(position, contributor mask) of a probe value."""
    mask = value % (1 << n)
    k = bin(mask).count("1")
    return (value >> n) // max(k, 1), mask


def chunk_of(position: int, numel: int, n: int) -> int:
    """Which of torch.tensor_split's n chunks holds `position`."""
    q, rem = divmod(numel, n)
    big = rem * (q + 1)  # the first `rem` chunks hold one extra element
    return position // (q + 1) if position < big else rem + (position - big) // max(q, 1)
