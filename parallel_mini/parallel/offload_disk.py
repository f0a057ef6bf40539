"""Offload to disk: the optimizer's states live in a file, streamed through a small buffer
(ZeRO-Infinity, Rajbhandari et al., SC 2021: "breaking the GPU memory wall" with NVMe).

ZeRO-Offload (zero.py's `offload`) moves Adam's fp32 states from the GPU to CPU RAM. ZeRO-Infinity
goes one level further down: RAM is not needed to *hold* them either, only to pass through. Each
rank keeps the states of what it owns (its `owned` pieces: every parameter for plain data parallel,
its slice for ZeRO-1/2, its slice of every unit for ZeRO-3) in one preallocated file, in planes:

    [ fp32 master | Adam's exp_avg | Adam's exp_avg_sq ]     each plane S elements, 12 S bytes
                                                             (SGD: the master plane only, 4 S)

The step reads a window of `chunk` elements of each plane into a fixed buffer, steps it with the
same window of the gradient, writes it back and copies the updated master into the compute copy in
RAM (or, under ZeRO-3, into nothing: the parameter shard is read from the master plane each time its
unit is gathered). RAM then holds the buffer (12 x chunk bytes), not 12 S bytes: the `disk` category
of the memory meter is what left.

Every byte read and written is counted (per step: the comm records' step numbers) and measured
beside the count from this thread's Linux I/O counters (/proc/thread-self/io): `rchar`/`wchar`
(bytes through read/write calls: equal to the count), `read_bytes`/`write_bytes` (bytes the
storage layer moved, in 4 KiB pages). The page cache would answer reads from RAM, so after each
step the file is synced and its pages dropped (posix_fadvise DONTNEED), as are the pages of a
ZeRO-3 gather's read, and read-ahead is off: the next read comes from the disk, and read_bytes
shows it. A checkpoint reads the file into RAM for as long as it takes (`snapshot`, `restore`).

DeepSpeed's PipelinedOptimizerSwapper (deepspeed/runtime/swap_tensor/) swaps each parameter's
states in and out with asynchronous I/O (libaio handles) through a pool of pinned, I/O-aligned
buffers, one file per state tensor, reading the next parameter's states while the current one
steps. Here every transfer is synchronous and one file holds the rank's states, so that it is easy
to read and to measure; the time that overlap would hide is what the lesson's 7B estimate counts.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

from ..optim import adam_update

CHUNK = 16 * 1024  # elements per window: 64 KiB per plane, 192 KiB of buffer for Adam
PLANES = {"adam": ("master", "exp_avg", "exp_avg_sq"), "sgd": ("master",)}
COUNTERS = ("rchar", "wchar", "read_bytes", "write_bytes")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # the page cache's unit


class IOCounters:
    """This thread's I/O counters (Linux), read around each transfer. Reading the counter file is
    itself a read of a few dozen bytes: they are left out of the deltas."""

    def __init__(self):
        self.fds: dict[int, int] = {}

    def read(self) -> tuple[dict[str, int], int] | None:
        tid = threading.get_native_id()
        try:
            fd = self.fds.get(tid)
            if fd is None:
                fd = self.fds[tid] = os.open(f"/proc/self/task/{tid}/io", os.O_RDONLY)
            text = os.pread(fd, 1024, 0)
        except OSError:
            return None  # not Linux, or no task I/O accounting: measured stays None
        values = dict(line.split(b": ") for line in text.splitlines())
        return {k: int(values[k.encode()]) for k in COUNTERS}, len(text)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class DiskOptimizer:
    """Adam or SGD over pieces whose states are in `path`. `params`: one tensor per piece, in RAM,
    which the step refreshes from the updated master and whose `.grad` it steps with (step_with's
    protocol); None where nothing in RAM mirrors the piece (ZeRO-3 reads it back with `read`).
    `initial`: each piece's starting values (written as the master plane)."""

    def __init__(self, path: str, name: str, lr: float, initial: list[torch.Tensor],
                 params: list[torch.Tensor | None] | None = None, chunk: int = CHUNK,
                 betas=(0.9, 0.999), eps: float = 1e-5, step_of=lambda: -1):
        self.path, self.name, self.lr, self.betas, self.eps = path, name, lr, betas, eps
        self.planes = PLANES[name]
        self.sizes = [t.numel() for t in initial]
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]  # in each plane
        self.numel = sum(self.sizes)  # S: elements this rank owns
        self.params = list(params) if params is not None else [None] * len(initial)
        self.param_steps: dict[int, int] = {}  # Adam's step count per piece, as optim.Adam
        self.state: dict = {}  # nothing of the optimizer's states is in RAM
        self.chunk = max(1, min(chunk, max(self.sizes, default=1)))
        self.buffer = torch.empty(len(self.planes), self.chunk)  # [planes, chunk] fp32: the RAM
        self.io: dict[int, dict] = {}  # step -> {read, written, measured {rchar, ...}}
        self.counters = IOCounters()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # refuse a stray file
        os.posix_fallocate(self.fd, 0, self.nbytes)  # preallocated: a full disk fails here
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: pages asked for
        self.step_of = lambda: "setup"  # writing the masters and the moments' zeros
        with torch.no_grad():
            for i, t in enumerate(initial):
                for lo in range(0, self.sizes[i], self.chunk):
                    hi = min(lo + self.chunk, self.sizes[i])
                    win = self.buffer[:, :hi - lo]  # [planes, window]
                    win[0].copy_(t.detach().reshape(-1)[lo:hi])
                    win[1:].zero_()  # (written, not left to fallocate: an extent never written
                    for k in range(len(self.planes)):  # reads as zeros without touching the disk)
                        self._write(win[k], k, self.starts[i] + lo)
        self._drop_cache()
        self.step_of = step_of  # the step the I/O belongs to (the comm records' numbering)

    @property
    def nbytes(self) -> int:
        """The file: 4 bytes x planes x S."""
        return 4 * len(self.planes) * self.numel

    # -- the transfers: pread/pwrite of one window, counted and measured -------------------------
    def _record(self, before, kind: str, nbytes: int) -> None:
        after = self.counters.read()
        rec = self.io.setdefault(self.step_of(), {"read": 0, "written": 0, "reads": 0,
                                                  "writes": 0, "measured": None})
        rec["read" if kind == "r" else "written"] += nbytes
        rec["reads" if kind == "r" else "writes"] += 1  # calls: each may round up to pages
        if before is None or after is None:
            return
        (b, own), (a, _) = before, after
        got = {k: a[k] - b[k] for k in COUNTERS}
        got["rchar"] -= own  # the counter file's own read, between the two readings
        m = rec["measured"] = rec["measured"] or dict.fromkeys(COUNTERS, 0)
        for k in COUNTERS:
            m[k] += got[k]

    def _read(self, out: torch.Tensor, plane: int, start: int) -> None:
        """Elements [start, start + len(out)) of a plane into `out` (fp32, contiguous)."""
        before = self.counters.read()
        view = memoryview(out.numpy()).cast("B")
        offset = 4 * (plane * self.numel + start)
        done = 0
        while done < len(view):  # (a short read is legal: continue where it stopped)
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: the file ended early (truncated while in use?)")
            done += n
        self._record(before, "r", len(view))

    def _write(self, t: torch.Tensor, plane: int, start: int) -> None:
        before = self.counters.read()
        view = memoryview(t.numpy()).cast("B")
        offset = 4 * (plane * self.numel + start)
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        self._record(before, "w", len(view))

    def _drop_cache(self, start: int = 0, length: int = 0) -> None:
        """Out of the page cache, so that the next read is the disk's. length 0: the whole file,
        written back first (a dirty page cannot be dropped); else the pages of [start, +length),
        widened to whole pages (the kernel keeps a page the range covers only in part; between
        steps nothing is dirty, so a neighbour's page dropped with it only costs a re-read)."""
        if length == 0:
            os.fdatasync(self.fd)
        else:
            start, end = start // PAGE * PAGE, -(-(start + length) // PAGE) * PAGE
            length = end - start
        os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)

    # -- the step: window by window ----------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """step_with's protocol: each piece's gradient is params[i].grad (None: not stepped)."""
        self.step_grads([None if p is None else p.grad for p in self.params])

    @torch.no_grad()
    def step_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Step every piece that has a gradient (None: skipped, as optim.Adam skips it)."""
        for i, g in enumerate(grads):
            if g is None:
                continue
            t = self.param_steps[i] = self.param_steps.get(i, 0) + 1  # (SGD: only "stepped")
            g, p = g.reshape(-1), self.params[i]
            for lo in range(0, self.sizes[i], self.chunk):
                hi = min(lo + self.chunk, self.sizes[i])
                win = self.buffer[:, :hi - lo]  # [planes, window]
                for k in range(len(self.planes)):
                    self._read(win[k], k, self.starts[i] + lo)
                grad = g[lo:hi].float()
                if self.name == "adam":
                    adam_update(win[0], grad, win[1], win[2], t, self.lr, self.betas, self.eps)
                else:
                    win[0].add_(grad, alpha=-self.lr)
                for k in range(len(self.planes)):
                    self._write(win[k].contiguous(), k, self.starts[i] + lo)
                if p is not None:  # the compute copy in RAM, in its precision
                    p.view(-1)[lo:hi].copy_(win[0])
        self._drop_cache()

    @torch.no_grad()
    def read(self, first: int, last: int, out: torch.Tensor) -> torch.Tensor:
        """The masters of pieces [first, last) (contiguous in the plane) into `out` [their numel],
        through the buffer, cast to out's dtype; then out of the page cache."""
        start, n = self.starts[first], sum(self.sizes[first:last])
        for lo in range(0, n, self.chunk):
            hi = min(lo + self.chunk, n)
            win = self.buffer[0, :hi - lo]
            self._read(win, 0, start + lo)
            out[lo:hi].copy_(win)
        self._drop_cache(4 * start, 4 * n)
        return out

    # -- checkpoints: what the rank owns, in RAM for as long as a save or a load takes ----------
    @torch.no_grad()
    def snapshot(self) -> "Snapshot":
        """Every piece's master and moments read into RAM (runtime/checkpoint.py reads and fills them as
        it does an in-RAM optimizer's; `restore` writes them back)."""
        snap = Snapshot(self)
        with self._io_step("checkpoint"):
            for i in range(len(self.sizes)):
                planes = torch.empty(len(self.planes), self.sizes[i])  # [planes, n_i]
                for k in range(len(self.planes)):
                    self._read(planes[k], k, self.starts[i])
                snap.params.append(planes[0])
                if i in self.param_steps:  # Adam's moments exist once the piece has stepped
                    snap.state[i] = dict(zip(self.planes[1:], planes[1:]))
            self._drop_cache()
        return snap

    @torch.no_grad()
    def restore(self, snap: "Snapshot") -> None:
        """Write a snapshot (a checkpoint just filled it) back, and refresh the copies in RAM."""
        with self._io_step("checkpoint"):
            for i, master in enumerate(snap.params):
                st = snap.state.get(i, {})
                for k, name in enumerate(self.planes):
                    t = master if k == 0 else st.get(name, torch.zeros_like(master))
                    self._write(t.contiguous(), k, self.starts[i])
                if self.params[i] is not None:
                    self.params[i].view(-1).copy_(master)
            self._drop_cache()

    def checkpoint_states(self) -> "Snapshot":
        """A strategy's `owned`: the states in RAM while a checkpoint reads or fills them; kept
        until `checkpoint_loaded` writes them back."""
        self.held = self.snapshot()
        return self.held

    def checkpoint_loaded(self) -> None:
        """A strategy's `loaded`: what a checkpoint filled goes back to the file."""
        if getattr(self, "held", None) is not None:
            self.restore(self.held)
            self.held = None

    @contextmanager
    def _io_step(self, name: str):
        """I/O outside the training steps is recorded under its own name."""
        step_of, self.step_of = self.step_of, lambda: name
        try:
            yield
        finally:
            self.step_of = step_of

    def zero_grad(self) -> None:
        for p in self.params:
            if p is not None:
                p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return []  # on disk

    def report(self) -> dict:
        """What the memory meter and the run report show: the file's bytes and, per step, the bytes
        read and written (counted) beside the thread's I/O counters (measured)."""
        return {"path": self.path, "bytes": self.nbytes, "buffer_bytes": self.buffer.nbytes,
                "planes": list(self.planes), "elements": self.numel,
                "io": [{"step": s, **rec} for s, rec in self.io.items()]}  # setup, then steps

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.counters.close()


class DiskMethods:
    """The GradientStrategy methods --offload-disk fills in, for a strategy whose `disk` names its
    file ("" for none) and whose `optimizer` is then a DiskOptimizer (data.py, zero.py, zero3.py)."""

    def buffers(self) -> list[torch.Tensor]:
        return [self.optimizer.buffer] if self.disk else []  # the window the step streams through

    def disk_report(self) -> dict:
        return self.optimizer.report() if self.disk else {}

    def close(self) -> None:
        if self.disk:
            self.optimizer.close()

    def owned_states(self):
        """The optimizer whose states `owned` lists: on disk, the states in RAM while a checkpoint
        reads or fills them (`disk_loaded` writes them back)."""
        return self.optimizer.checkpoint_states() if self.disk else self.optimizer

    def disk_loaded(self) -> None:
        """`loaded`'s part: what a checkpoint filled goes back to the file."""
        if self.disk:
            self.optimizer.checkpoint_loaded()


class UnitsOnDisk(DiskOptimizer):
    """ZeRO-3's optimizer under --offload-disk: the file holds every unit's fp32 master slice and
    moments, and no unit keeps a slice in RAM (zero3.Unit's `shard` and `master` become None): each
    gather reads the unit's slice back from the master plane (`shard`)."""

    def __init__(self, path: str, name: str, lr: float, units: list, views: list[torch.Tensor],
                 step_of):
        super().__init__(path, name, lr, initial=views, step_of=step_of)
        self.pieces_at, first = {}, 0  # unit -> its pieces [first, last), contiguous in a plane
        for u in units:
            self.pieces_at[u], first = (first, first + len(u.pieces)), first + len(u.pieces)
            u.shard = u.master = None

    def shard(self, unit) -> torch.Tensor:
        """My slice of `unit` [k], read from the master plane in the unit's compute precision."""
        out = torch.empty(unit.layout.shard_numel, dtype=unit.full.dtype, device=unit.full.device)
        return self.read(*self.pieces_at[unit], out)


class Snapshot:
    """A DiskOptimizer's states in RAM, shaped as an in-RAM optimizer's: `params` (each piece's
    fp32 master), `state` (index -> its moments), `param_steps` (the optimizer's own counts)."""

    def __init__(self, optimizer: DiskOptimizer):
        self.params: list[torch.Tensor] = []
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        self.param_steps = optimizer.param_steps  # shared: a resume sets the counts in place
