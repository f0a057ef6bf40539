"""Meters: memory by category in exact bytes, and an op timeline with wall and CPU time.

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
import time
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                self._track(t.untyped_storage())
        return out


class Timeline:
    """Op events for one rank: kind, step, microbatch, stage, wall start/end, own CPU seconds.

    Wall times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux, shared by all local ranks, so
    ranks line up); `cpu` is this thread's CPU time, what the op would take on a device of its own."""

    def __init__(self):
        self.events: list[dict] = []

    @contextmanager
    def op(self, kind: str, step: int = 0, microbatch: int | None = None, stage: int = 0, **extra):
        start, cpu0 = time.perf_counter(), time.thread_time()
        yield
        self.events.append({"kind": kind, "step": step, "microbatch": microbatch, "stage": stage,
                            "start": start, "end": time.perf_counter(),
                            "cpu": time.thread_time() - cpu0, **extra})
