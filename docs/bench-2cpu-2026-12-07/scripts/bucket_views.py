"""Unpacking and packing the toy's 4 buckets (218,496 fp32 gradients, 53 parameters), one process:
slicing the flat buffer at every gradient (as DataParallel did before) against views made once
(Bucket.views). Run from the repository root: python docs/bench-2cpu-2026-12-07/scripts/bucket_views.py"""
import time

import torch

from parallel_mini.config import RunConfig
from parallel_mini.model import build_model
from parallel_mini.parallel.data import make_buckets

model = build_model(RunConfig(dp=1, batch=16).validate())
params = list(model.parameters())
for p in params:
    p.grad = torch.randn_like(p)
buckets = make_buckets(params, int(0.25 * 2 ** 20))
offsets = []
for b in buckets:
    off, o = 0, {}
    for p in b.params:
        o[p] = (off, off + p.numel())
        off += p.numel()
    offsets.append(o)


def unpack_sliced():
    for b, o in zip(buckets, offsets):
        b.flat /= 2
        for p in b.params:
            lo, hi = o[p]
            p.grad.copy_(b.flat[lo:hi].view_as(p))


def unpack_views():
    for b in buckets:
        b.flat /= 2
        for p, view in zip(b.params, b.views):
            p.grad.copy_(view)


def pack_sliced():
    for b, o in zip(buckets, offsets):
        for p in b.params:
            lo, hi = o[p]
            b.flat[lo:hi].copy_(p.grad.view(-1))


def pack_views():
    for b in buckets:
        for p, view in zip(b.params, b.views):
            view.copy_(p.grad)


for f in (unpack_sliced, unpack_views, pack_sliced, pack_views):
    for _ in range(50):
        f()
    t = time.perf_counter()
    for _ in range(1000):
        f()
    print(f"{f.__name__}: {(time.perf_counter() - t):.3f} ms a step (1000 steps)")
