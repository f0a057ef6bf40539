"""Meters: everything that only measures, so that each core file keeps only its topic.

    memory          tensors_bytes, model_state_bytes, ActivationMeter, LiveBytes (engine.py)
    op events       Timeline: kind, step, micro-batch, stage, wall and CPU time (runners),
                    and GPU time from CUDA events on a CUDA device
    communication   CommMeter, WireMeter: one record per collective, bytes as the ring model
                    says and as written to the sockets (comm.py's Comm calls them)
    experts         ComputeTimer, log_routing, RoutingLog: compute time, the routing log,
                    its bounded sample of token choices (moe.py)
    ring attention  RingHop, hidden_fraction: each hop's posted/computed/arrived (context.py)
    pipelines       HeldBytes: what a stage holds after each op (parallel/pipeline.py)

Memory is counted from tensor storages, not from the process's RSS (which carries ~90 MiB of
allocator and library noise and cannot be split by category):
- model states (`params`, `grads`, `optimizer`): bytes of the storages the model and optimizer own;
- `activations_peak`: bytes a forward pass leaves alive for backward (live bytes after minus
  before), the largest over the micro-batches of the metered step;
- `total_peak`: the peak of all live storages during a step (a TorchDispatchMode sees every
  allocation an op makes and a finaliser sees every free), starting from the model states.
"""
from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def tensors_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (a view or a shared weight counts once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def model_state_bytes(states: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes by category from a strategy's `state_tensors()`: {"params": [...], "grads": [...],
    "optimizer": [...]}, each storage counted once."""
    return {category: tensors_bytes(tensors) for category, tensors in states.items()}


def _cuda_storages(tensors) -> dict[int, torch.UntypedStorage]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors
            if t.is_cuda and t.untyped_storage().nbytes()}


def _rounded(tensors) -> int:
    """Bytes of the distinct CUDA storages among `tensors` as the caching allocator hands them
    out: in blocks of 512 bytes."""
    return sum(-(-st.nbytes() // 512) * 512 for st in _cuda_storages(tensors).values())


def cuda_allocator_view(states: dict[str, list[torch.Tensor]], buffers, base: int) -> dict:
    """On a CUDA device: what the caching allocator holds beside the meter's model states.
    `allocated`: torch.cuda.memory_allocated() minus `base` (read before the model was built);
    `rounded_512`: each category's storages rounded up to the allocator's 512-byte blocks;
    `other_blocks`: sizes of live blocks that are none of these storages (libraries' workspaces),
    and the same after asking PyTorch to free its cuBLAS workspaces."""
    torch.cuda.synchronize()
    gc.collect()
    everything = [t for ts in states.values() for t in ts] + list(buffers)
    known = set(_cuda_storages(everything))

    def other_blocks():
        sizes = []
        for seg in torch.cuda.memory_snapshot():
            address = seg["address"]
            for block in seg["blocks"]:
                if block["state"] == "active_allocated" and address not in known:
                    sizes.append(block["size"])
                address += block["size"]
        return sorted(sizes, reverse=True)
    view = {"allocated": torch.cuda.memory_allocated() - base, "rounded_512_total": _rounded(everything),
            "rounded_512": {**{k: _rounded(ts) for k, ts in states.items()}, "buffers": _rounded(buffers)},
            "storages": {k: len(_cuda_storages(ts)) for k, ts in states.items()},
            "other_blocks": other_blocks()}
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
        view["other_blocks_after_clearing_cublas_workspaces"] = other_blocks()
        view["allocated_after_clearing_cublas_workspaces"] = torch.cuda.memory_allocated() - base
    return view


def cuda_bytes_freed(states: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Free each category's CUDA storages (resize to 0 bytes: the allocator takes the block back)
    and read how far torch.cuda.memory_allocated() falls: the allocator's own count of what the
    category held. Destroys the states: the last thing a rank does (tests/test_gpu.py)."""
    torch.cuda.synchronize()
    freed, done = {}, set()
    for kind in ("optimizer", "grads", "params"):
        before = torch.cuda.memory_allocated()
        for ptr, st in _cuda_storages(states.get(kind, [])).items():
            if ptr not in done:
                done.add(ptr)
                st.resize_(0)
        freed[kind] = before - torch.cuda.memory_allocated()
    return freed


class ActivationMeter:
    """Bytes a forward pass leaves alive for backward: live bytes after it minus before it.

    Counting what is still allocated (rather than what autograd's saved-tensor hooks see) also
    catches what checkpointing keeps: a checkpointed segment's input is held by the checkpoint,
    not by a saved-tensor hook. Needs the LiveBytes meter to be active; otherwise it records
    nothing (the engine meters the last step, where every state exists)."""

    def __init__(self, live: "LiveBytes"):
        self.live = live
        self.peak = 0

    @contextmanager
    def forward(self):
        """Wrap one micro-batch's forward. Python's cycle collector is paused during it: a
        collection that happened to run inside the forward would free older garbage and shift
        the difference by its bytes (seen once: 1 KiB less). Pausing alone let cyclic garbage made
        inside the forward count as kept (seen once: 1 KiB more), so the youngest generation is
        collected before both readings: cheap, unlike a full collection (~0.5 s a run)."""
        if not self.live.active:
            yield
            return
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            gc.collect(0)  # young cyclic garbage from before: gone from both readings
            before = self.live.current
            yield
            gc.collect(0)  # cycles the forward made and dropped (all young: gc was off)
            self.peak = max(self.peak, self.live.current - before)
        finally:
            if was_enabled:
                gc.enable()


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of every storage an op allocates until it is freed; `peak` is the maximum.

    Outputs that share a storage with an input (views, in-place ops) allocate nothing and are
    skipped; storages that existed before (model states) are registered with `add_existing`.
    Storages are keyed by identity (torch keeps one Python object per live storage), so a storage
    whose bytes are released with `resize_(0)` and refilled later (ZeRO-3 does this) stays one entry;
    `UntypedStorage.resize_` is not an op the dispatcher sees, so it is watched directly while the
    meter is active."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.active = False

    def add_existing(self, tensors, freeable: bool = False):
        """Storages that exist before the meter starts. `freeable`: they may die during the step
        (last step's gradients, released by zero_grad), so their bytes leave when they do."""
        for t in tensors:
            if t is not None:
                self._track(t.untyped_storage(), finalize=freeable)

    def _set(self, key: int, nbytes: int) -> None:
        self.current += nbytes - self.live.get(key, 0)
        self.live[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _track(self, st, finalize=True):
        key = id(st)
        if key in self.live:
            return
        self._set(key, st.nbytes())
        if finalize:
            weakref.finalize(st, self._free, key)

    def _free(self, key):
        self.current -= self.live.pop(key, 0)

    def __enter__(self):
        original = self._original_resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage, nbytes):
            out = original(storage, nbytes)
            if id(storage) in meter.live:
                meter._set(id(storage), storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in _tensors((args, tuple((kwargs or {}).values())))}
        for t in _tensors(out):
            if id(t.untyped_storage()) not in inputs:
                self._track(t.untyped_storage())
        return out


def _tensors(x):
    """The tensors in an op's arguments or results: aten's schemas nest at most lists of
    (optional) tensors in a tuple. A hand walk: torch's general tree_flatten, called twice for
    every op of every step, took 0.07 s of the 0.65 s a rank of the toy spent training 3 steps at
    dp 4 with ZeRO-1 (cProfile; 0.02 s so)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)


class Timeline:
    """Op events for one rank: kind, step, microbatch, stage, wall start/end, own CPU seconds.

    Wall times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux, shared by all local ranks, so
    ranks line up); `cpu` is this thread's CPU time, what the op would take on a device of its own.
    On a CUDA device the host only queues kernels, so wall time says when an op was *launched*:
    each op also records two CUDA events on the current stream, and `resolve()` (after the last
    step) turns them into `gpu_start`/`gpu_end` on the same clock, when the GPU really ran it."""

    def __init__(self, device: torch.device | None = None):
        self.events: list[dict] = []
        self._cuda = device is not None and device.type == "cuda"
        if self._cuda:  # the origin: an event recorded when the host clock reads `_t0`
            torch.cuda.synchronize(device)
            self._origin, self._t0 = torch.cuda.Event(enable_timing=True), time.perf_counter()
            self._origin.record()

    @contextmanager
    def op(self, kind: str, step: int = 0, microbatch: int | None = None, stage: int = 0, **extra):
        start, cpu0 = time.perf_counter(), time.thread_time()
        marks = self._mark() if self._cuda else None
        yield
        if marks:
            marks[1].record()
        # CPU clock read before the wall clock here (after it at the start): the CPU window lies
        # inside the wall window, so an op's CPU time never exceeds its wall time. Read the other
        # way round, a busy op's CPU exceeded its wall by ~1 us (the clock reads themselves).
        cpu = time.thread_time() - cpu0
        self.events.append({"kind": kind, "step": step, "microbatch": microbatch, "stage": stage,
                            "start": start, "end": time.perf_counter(), "cpu": cpu, **extra,
                            **({"_cuda": marks} if marks else {})})

    @staticmethod
    def _mark():
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin, end

    def resolve(self) -> None:
        """CUDA events -> seconds on the host clock (waits for the GPU once; events cannot be
        pickled, so this runs before the rank returns its records)."""
        if not self._cuda:
            return
        torch.cuda.synchronize()
        for e in self.events:
            begin, end = e.pop("_cuda")
            e["gpu_start"] = self._t0 + self._origin.elapsed_time(begin) / 1e3
            e["gpu_end"] = self._t0 + self._origin.elapsed_time(end) / 1e3


# ---------------------------------------------------------------------------------------------
# Communication: one record per collective (comm.py's Comm calls these)
# ---------------------------------------------------------------------------------------------
class WireMeter:
    """Bytes this process really wrote to its sockets, per op: Linux counts every byte passed to
    write()/send() by any thread of the process in `wchar` of /proc/self/io, gloo's I/O threads
    included. The counter is read when an op starts and when it ends (for an async op: when gloo
    reports it done, or at wait; for ops in a row, such as a ring's steps, once at each end of the
    row: in_a_row); the bytes written in between belong to the ops in flight. An op
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
        self.run: list[dict] | None = None  # inside in_a_row(): the ops begun so far
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
        # Kept to O(ops in flight) per reading: a pipeline stage's sends stay in flight until the
        # step ends (24 a step at pp 2 interleaved), and every send reads the counter; recomputing
        # the sum per op and each record's set of groups made a reading with 24 in flight cost
        # 23-24 us, now 10-11 (docs/bench-2cpu-2026-12-07, section 8).
        weights = [max(r["wire_bytes_model"], 1) for r in self.inflight]
        total, shared = sum(weights), len(self.inflight) > 1
        groups = sorted({r["group"] for r in self.inflight}) if shared else None
        for r, w in zip(self.inflight, weights):
            r["wire_bytes_measured"] += delta * w / total
            if shared:
                r["wire_shared"] = True
                seen = r.get("wire_shared_with")
                if seen != groups:  # mostly the groups it already has: nothing to merge
                    r["wire_shared_with"] = sorted(set(seen or ()) | set(groups))

    def begin(self, rec: dict) -> None:
        if self.fd is None:
            rec["wire_bytes_measured"] = None
            return
        with self.lock:
            if self.run is None:
                self._settle()
            else:  # read once, when the run ends
                self.run.append(rec)
            rec["wire_bytes_measured"] = 0
            self.inflight.append(rec)

    def end(self, rec: dict) -> None:
        if self.fd is None:
            return
        with self.lock:
            if self.run is not None and any(r is rec for r in self.run):
                return  # settled when the run ends
            if any(r is rec for r in self.inflight):
                self._settle()
                self.inflight = [r for r in self.inflight if r is not rec]
                if not rec.get("wire_shared"):
                    rec["wire_bytes_measured"] = int(rec["wire_bytes_measured"])

    @contextmanager
    def in_a_row(self):
        """Ops that follow one another with nothing written between them (a ring's 2(N-1) steps)
        read the counter once at each end of the run instead of at each end of every op; they
        share the run's bytes as overlapping ops do (`wire_shared`), and the run's total is exact.
        Why: in a running ring one reading cost ~35 us of CPU (3.5 us alone), and with 4 ranks on
        2 cores each rank's CPU lengthens every hop (docs/bench-2cpu-2026-12-07, section 3)."""
        if self.fd is None or self.run is not None:  # nothing to read, or already in a run
            yield
            return
        with self.lock:
            self._settle()
            self.run = []
        try:
            yield
        finally:
            with self.lock:
                run, self.run = self.run, None
                self._settle()  # the run's bytes, shared by its ops (and any other in flight)
                self.inflight = [r for r in self.inflight if not any(r is x for x in run)]
                for rec in run:
                    if not rec.get("wire_shared"):  # a run of one op: its own bytes
                        rec["wire_bytes_measured"] = int(rec["wire_bytes_measured"])


# A rank with a core of its own waits for a collective by polling, as MPI libraries do by default.
# Blocked in work.wait(), the rank sleeps until gloo's thread wakes it. On the 2-core machine that
# wake-up came late whenever the rank had been idle or computing just before: a 512-float
# all-reduce on 2 ranks took 2-3.4 ms blocked and 0.15-0.23 ms polled (sleep, then the op:
# always ~3.9 ms in all, as if the wake-up waited for the kernel's next 4 ms tick;
# docs/bench-2cpu-2026-11-28, section 6). Spinning costs a rank nothing when the core is its
# own: each turn yields it to gloo's threads. Ranks that share cores block instead: there the
# spin would take the core the other ranks need (4 ranks on 2 cores: 11-22 ms polled, 4-6 ms
# blocked). Comm decides which (Comm.polls).
POLLED = frozenset({"all_reduce", "all_gather", "all_to_all", "broadcast"})  # gloo's
# reduce-scatter and point-to-point Work report completion only once waited on: never polled
POLL_S = 0.01  # then block anyway: a guard, should a Work never report completion


def wait_for(work, poll: bool = False) -> None:
    """work.wait(); with `poll`, spin on work.is_completed() first (yielding the core each turn)."""
    if poll:
        start = time.perf_counter()
        while not work.is_completed() and time.perf_counter() - start < POLL_S:
            os.sched_yield()
    work.wait()


class _Handle:
    """Wraps a torch.distributed Work; records when the op really completed: when the backend
    finishes it where the Work has a future (`future`: collectives; NCCL's sends too), else when
    it is waited on (gloo's point-to-point Work has none). `poll`: wait by polling (wait_for)."""

    def __init__(self, work, record: dict, meter: WireMeter, future=None, poll: bool = False):
        self.work, self.record, self.meter, self.poll = work, record, meter, poll
        if future is not None:
            future.then(self._done)

    def _done(self, fut):
        self.record["end"] = time.perf_counter()
        self.meter.end(self.record)
        return None

    def wait(self):
        wait_for(self.work, self.poll)
        self.meter.end(self.record)
        self.record.setdefault("end", time.perf_counter())
        self.record["waited_until"] = time.perf_counter()


class _Done:
    """The handle of an op that moved nothing (a group of one)."""

    def wait(self):
        pass


class CommMeter:
    """The records of one rank's collectives, for Comm (comm.py). Each record: op, group (a mesh
    axis), count (elements), payload bytes S, `wire_bytes_model` (the model: what this rank sends
    under the ring algorithm, `theory.wire_bytes`), `wire_bytes_measured` (what this process really
    wrote to its sockets during the op, see WireMeter; None where that cannot be read), the step,
    and wall/CPU time. Lessons and the app read these records; tests compare them with theory.

    Asynchronous calls return a handle whose completion time is taken by a callback when the
    backend finishes, not when someone waits: that is what makes overlap with backward visible."""

    def __init__(self, backend: str | None):
        self.records: list[dict] = []
        self.p2p_log: list[dict] = []  # every send, in order, with the first element (see ring)
        self.wire = WireMeter(backend)
        self._cpu0: dict[int, float] = {}  # id(record) -> this thread's CPU time at its start
        self._no_future: set[str] = set()  # ops whose Work raised on get_future (see _future)

    def record(self, op: str, axis: str, payload, count: int, wire: int, step: int,
               **extra) -> dict:
        """A record for an op on `payload` (a tensor, or its bytes), started now."""
        nbytes = payload if isinstance(payload, int) else payload.numel() * payload.element_size()
        rec = {"op": op, "group": axis, "count": count, "payload_bytes": nbytes,
               "wire_bytes_model": wire, "step": step, "start": time.perf_counter(), **extra}
        self.records.append(rec)
        return rec

    def begin(self, rec: dict, sockets: bool = True) -> dict:
        """The op is about to run: its CPU clock starts; `sockets`: it writes to them (a receive
        writes nothing, a memory copy is not a socket)."""
        self._cpu0[id(rec)] = time.thread_time()
        if sockets:
            self.wire.begin(rec)
        return rec

    def end(self, rec: dict, work=None, async_op: bool = False, poll: bool = False):
        """The call returned: a handle to wait on for an async op (`poll`: by polling), else the op
        is done (None)."""
        rec["cpu"] = time.thread_time() - self._cpu0.pop(id(rec))
        if async_op:
            return _Handle(work, rec, self.wire, self._future(work, rec["op"]), poll)
        self.wire.end(rec)
        rec["end"] = time.perf_counter()
        return None

    def _future(self, work, op: str):
        """The Work's future, or None where the backend gives none for `op`. Why this meter
        remembers which ops raised: gloo's point-to-point Work has no future and get_future raises,
        ~8 us of CPU per message (measured, 2 gloo ranks), paid on every send and posted receive
        of a pipeline; a backend's Work for one op either has a future or not, so it asks once."""
        if op in self._no_future:
            return None
        try:
            return work.get_future()
        except (AttributeError, RuntimeError):
            self._no_future.add(op)
            return None

    def nothing_moved(self, rec: dict, async_op: bool):
        """A group of one: nothing moves (the copies the caller made did the work)."""
        rec["end"], rec["cpu"], rec["wire_bytes_measured"] = time.perf_counter(), 0.0, 0
        return _Done() if async_op else None

    def sent(self, rec: dict, tensor: torch.Tensor, src: int, dst: int, **log) -> dict:
        """A ring step's send (Comm.sendrecv, Comm.exchange), in the p2p log with its first element
        (see comm.probe_input); its "end" is the record's (None while the send is in flight:
        Comm.exchange sets it when the step's receive arrives)."""
        entry = {"seq": len(self.p2p_log), "src": src, "dst": dst, "numel": tensor.numel(),
                 "bytes": rec["payload_bytes"], "start": rec["start"], "end": rec.get("end"),
                 "peek": _peek(tensor), **log}
        self.p2p_log.append(entry)
        return entry


def _peek(t: torch.Tensor):
    """The first element of an integer message: lets a probe run decode what was sent (ring)."""
    if t.numel() and not t.is_floating_point() and not t.is_complex():
        return int(t.reshape(-1)[0])
    return None



# ---------------------------------------------------------------------------------------------
# Mixture of experts: the experts' compute time and the routing log (moe.py calls these)
# ---------------------------------------------------------------------------------------------
class _Mark(torch.autograd.Function):
    """Identity that notes the time backward passes it."""

    @staticmethod
    def forward(ctx, x, marks: list, key: str):
        ctx.marks, ctx.key = marks, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.marks.append((ctx.key, time.perf_counter()))
        return grad, None, None


class ComputeTimer:
    """Wall time of one piece of compute: `enter` wraps its input, `leave` its output. The forward
    time is taken directly (`last_forward_s`); backward passes the two marks in reverse order, so
    `backward_marks` gets ("NAME-backward-start", t) then ("NAME-backward-end", t')."""

    def __init__(self, name: str):
        self.name, self.backward_marks, self.last_forward_s, self._t0 = name, [], 0.0, 0.0

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        self._t0 = time.perf_counter()
        return _Mark.apply(x, self.backward_marks, f"{self.name}-backward-end")

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        y = _Mark.apply(y, self.backward_marks, f"{self.name}-backward-start")
        self.last_forward_s = time.perf_counter() - self._t0
        return y


# The token-by-token routing (which experts each token chose, whether each was kept) is what the
# routing chart draws; kept for at most this many steps per layer, and this many tokens of a step
# (whole sequences, the first ones): a bounded sample, so that a long or wide run's log does not
# grow by every token of every step (issue 26: ~48 MB a step, a report past 8 GB). The counts per
# expert are logged for every forward.
ROUTING_SAMPLE_STEPS = 16
ROUTING_SAMPLE_TOKENS = 512


class RoutingLog(list):
    """One MoE layer's log: a list of entries (one per forward), and `sampled`, the entries that
    keep their tokens' choices. The steps sampled: always the latest, and before it the steps that
    are multiples of a stride, the smallest power of two that keeps at most ROUTING_SAMPLE_STEPS
    of them (the stride doubles as the run goes on: 0, 1, 2, ..., then 0, 2, 4, ..., ...). The
    same steps on every rank: the choice depends on the step only."""

    def __init__(self):
        super().__init__()
        self.sampled: list[dict] = []

    def keep_choices(self, step: int, entry: dict) -> None:
        stride = 1
        while -(-step // stride) > ROUTING_SAMPLE_STEPS:  # multiples of stride in [0, step)
            stride *= 2
        kept = []
        for e in self.sampled:
            if e["step"] % stride == 0:
                kept.append(e)
            else:
                for key in ("choices", "kept_mask", "positions", "tokens_sampled"):
                    e.pop(key, None)
        self.sampled = kept + [entry]


def log_routing(moe, r, counts: torch.Tensor, cap: int, aux, z, mine=None) -> None:
    """One entry in `moe.log` per forward of an MoE layer (none for activation checkpointing's
    re-run inside backward): tokens routed and kept per expert, drops, the two losses, the
    experts' compute time. On the first micro-batch of a sampled step (RoutingLog) also the
    first ROUTING_SAMPLE_TOKENS tokens' choices and whether kept (whole sequences: `choices`,
    `kept_mask`, [token][choice]), where those tokens sit in their sequences (`positions`; None:
    whole sequences from position 0) and `tokens_sampled` (of how many this rank routed)."""
    if torch._C._current_graph_task_id() != -1:
        return  # inside backward: a recomputation, not a new forward
    routed = torch.nn.functional.one_hot(r.expert, moe.n_experts).sum((0, 1, 2))  # [E], pre-drop
    step = moe.clock() if moe.clock is not None else None
    first_of_step = not moe.log or moe.log[-1]["step"] != step
    entry = {"step": step, "layer": moe.layer, "routed": routed.tolist(),
             "kept": counts.tolist(), "dropped": int(routed.sum() - counts.sum()),
             "capacity": cap, "aux": aux.item(), "z": z.item(),
             "compute_s": moe.experts.timer.last_forward_s}
    if first_of_step:
        b, s = r.expert.shape[:2]
        seqs = max(1, min(b, ROUTING_SAMPLE_TOKENS // s))  # whole sequences, at least one
        n = min(s, ROUTING_SAMPLE_TOKENS)  # (one sequence longer than the sample: its start)
        where = None if mine is None else mine[:n].tolist()
        if mine is None and n < s:
            where = list(range(n))
        entry.update(choices=r.expert[:seqs, :n].flatten(0, 1).tolist(),
                     kept_mask=r.keep[:seqs, :n].flatten(0, 1).tolist(), positions=where,
                     tokens_sampled=[seqs * n, b * s])
        if isinstance(moe.log, RoutingLog) and isinstance(step, int):
            moe.log.keep_choices(step, entry)
    moe.log.append(entry)



# ---------------------------------------------------------------------------------------------
# Ring attention: how much of each hop's transfer its compute hid (parallel/context.py)
# ---------------------------------------------------------------------------------------------
class RingHop:
    """One hop around a ring, posted when made: `handles` are its send and receive; `wait` notes
    when the compute that overlapped it ended, waits, and notes the arrival, in `log` (None: not
    logged). Waiting past `computed` is transfer time the compute did not hide."""

    def __init__(self, log: list | None, **tags):
        self.log, self.tags, self.posted, self.handles = log, tags, time.perf_counter(), ()

    def wait(self) -> None:
        computed = time.perf_counter()
        for h in self.handles:
            h.wait()
        if self.log is not None:
            self.log.append({**self.tags, "posted": self.posted, "computed": computed,
                             "arrived": time.perf_counter()})


def hidden_fraction(hops: list[dict]) -> float:
    """Of the time from posting each hop to its block's arrival, the share the current block's
    compute covered (1: every transfer hid behind compute; 0: none did). Measured per hop."""
    total = sum(h["arrived"] - h["posted"] for h in hops)
    exposed = sum(h["arrived"] - h["computed"] for h in hops)
    return 1 - exposed / total if total > 0 else 1.0



# ---------------------------------------------------------------------------------------------
# Pipelines: what a stage holds between its ops (parallel/pipeline.py)
# ---------------------------------------------------------------------------------------------
class HeldBytes:
    """After each op of a pipeline stage, while the live meter runs: the bytes held beyond the
    model states (activations waiting for their backward, queued weight-gradient inputs,
    messages), noted on the op's event as `held_bytes`; `peak` is the largest."""

    def __init__(self, live: LiveBytes | None, timeline: Timeline):
        self.live, self.timeline, self.peak = live, timeline, 0

    @contextmanager
    def after(self, strategy):
        """Wrap one op (outside its timeline event, so that the event exists when it ends)."""
        yield
        if self.live is not None and self.live.active and strategy is not None:
            states = [t for ts in strategy.state_tensors().values() for t in ts]
            held = self.live.current - tensors_bytes(states)
            self.timeline.events[-1]["held_bytes"] = held  # the op that just ended
            self.peak = max(self.peak, held)
