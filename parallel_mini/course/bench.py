"""Benchmarks: how our code compares with PyTorch's own, measured on real ranks.

    python -m parallel_mini.bench dp      # (a) DP step time vs DDP, (b) ring vs gloo all-reduce
    python -m parallel_mini.bench ring    # (b) only
    python -m parallel_mini.bench warm    # p50/p90 of a repeated live run at pages' defaults
    python -m parallel_mini.bench zero    # (c) our ZeRO-1/2/3 vs ZeroRedundancyOptimizer / FSDP2
    python -m parallel_mini.bench tp      # (d) our tensor (+ sequence) parallel vs DTensor
    python -m parallel_mini.bench pp      # (e) our pipeline schedules vs torch.distributed.pipelining
    python -m parallel_mini.bench bubble  # (f) pipeline bubble, wall clock and replayed, vs the formula
    python -m parallel_mini.bench cp      # (g) ring attention vs torch's, K/V transfer hidden
    python -m parallel_mini.bench ep      # (h) expert parallel vs experts replicated; a2a split
    python -m parallel_mini.bench wire    # (i) bytes gloo really writes vs the ring model
    python -m parallel_mini.bench plan    # (j) the planner's 8-rank toy layouts, run: states, order
    python -m parallel_mini.bench app     # (k) the classroom app in a real browser: click -> chart
    python -m parallel_mini.bench async   # (l) a 3x straggler: synchronous DP vs asynchronous SGD
    python -m parallel_mini.bench links   # (m) this machine's links: each op's time, the alpha-beta fit
    python -m parallel_mini.bench dualpipe     # (f2) DualPipe beside 1F1B, ZB-H1, ZBV; and (f3)
    python -m parallel_mini.bench fb-overlap   # (f3) an all-to-all in flight during other compute
    python -m parallel_mini.bench all --json now.json     # dp ring zero tp pp cp ep bubble, ~10 min
    python -m parallel_mini.bench all --compare then.json # ... and each row's ratios against then's
    python -m parallel_mini.bench --compare then.json now.json  # two saved runs, nothing run
    ... --json -                          # the numbers as one JSON object (or --json PATH)

Every benchmark prints the load average before and after it, and repeats its timed steps until
each median has settled (moved < 2 % over the last 3 repeats; at most 3x the asked-for count,
then the row is marked not stable): `median_settled`, `Repeats`. (a) and (b) judge a ratio of
two medians near its goal, so they repeat until that ratio is known to +-4 % (`RatioRepeats`).

(a) Our DataParallel (bucketed and naive) and torch's DistributedDataParallel train the same tiny
    GPT on the same data with the same optimizer (ours, torch.optim.Adam's arithmetic) and the same
    bucket size, in the same launch. Their steps are interleaved (the order rotates every step), so
    a noisy neighbour slows all of them alike. A step's time is the slowest rank's; we report the
    median over the measured steps and the ratio ours / DDP (1.0 = as fast as DDP), with its 90 %
    bootstrap interval; bucketed and DDP steps go on until that interval is within +-4 % of the
    ratio (at most 300 steps), naive's (far slower, judged by no goal) only until its median
    settles.
(b) Our ring all-reduce (send/recv only) against gloo's all-reduce on the same tensor, interleaved
    too. Bus bandwidth = the bytes each rank must send, 2(N-1)/N * S, per second (NCCL's busbw);
    ratio = ours / gloo (1.0 = as fast as gloo), with its 90 % bootstrap interval; each size repeats
    until that interval is within +-4 % (at most 200 repeats).

(c) Our ZeRO-1 vs torch's ZeroRedundancyOptimizer (+DDP), our ZeRO-2 vs FSDP2 fully_shard with
    reshard_after_forward=False, our ZeRO-3 vs FSDP2 fully_shard: same model, data, Adam
    arithmetic (torch.optim.Adam with our eps for the peers), steps interleaved as in (a); our
    ZeRO-3 with --no-prefetch is timed in the same loop (what prefetch buys).
(d) Our tensor parallel, without and with sequence parallel (--sp), vs DTensor parallelize_module
    with the plan `peers.dtensor_tp_plan` builds (torchtitan's, SequenceParallel LayerNorms for sp);
    without sp also against the plan that splits the vocabulary as ours does (loss_parallel).
(e) Our PipelineRunner (GPipe, 1F1B, interleaved with 2 chunks per rank) vs torch's ScheduleGPipe,
    Schedule1F1B, ScheduleInterleaved1F1B, each a PipelineStage per chunk of the same split
    (`peers.TorchPipeline`: our `partition` and `forward_chunk` inside, torch's schedule and p2p
    around), same data and Adam arithmetic, steps interleaved as in (a).
(f) The pipeline's "done means" runs repeated: `run --pp P --microbatches M --schedule S
    --reference` with the CLI's pipeline defaults, N times per schedule, at P x M = 2 x 4 (on a
    machine with 2 cores or more each rank pinned to a core of its own) and 4 x 8. Against the
    formula (points): the bubble measured on the wall clock, how many runs land within 5 points, and
    what the gap is made of (trace.wall_gap: stage imbalance, op-time variation, p2p messages
    (hand-off, latency, receive), between ops, medians); the bubble replayed with the measured op
    CPU times (own-device schedule), within 3 points; and the largest |ours - reference|.
(f3) DualPipe's F&B overlap (`fb-overlap`, also after (f2) `dualpipe`): on --ranks gloo ranks, one
    micro-batch's expert all-to-all posted asynchronously (gloo's worker thread) while another's
    forward and backward compute, against the two one after the other and each alone, the four
    back to back in every round (order reversed every other round), --fb-repeats rounds. Hidden
    fraction per round: (one after the other - overlapped) / all-to-all alone; its median,
    quartiles and range. Whether the cores can show it: ranks x (torch threads + gloo's worker)
    against the CPUs and the load (fewer: the figure measures contention). Then a DualPipe run
    with experts (pp 2 x ep 2) counted from its records: all-to-alls overlapping another
    micro-batch's compute on the same rank (0: the runner runs each rank's ops in order), and its
    asynchronous pipeline sends.
(g) Ring attention (contiguous and zigzag) forward + backward on each rank's tokens, ours against
    torch's private ring template, on the same inputs; and, from our forward's own timing of each
    hop, the share of the hop's time during which the current block was being computed.
(h) A mixture-of-experts GPT trained with its experts sharded over ep = N ranks against the same
    model, data and ranks with every expert replicated (ep 1, plain data parallel), through the
    engine (`launch.run`). Step time: median over the steps after the first (warm-up) and before
    the last (the memory meter watches it and slows it). Per step and rank, from the run's own
    records: the dispatch and combine all-to-alls (forward and backward, wall time of each call),
    the counts exchange, and the experts' compute (forward timed in the layer, backward between
    two autograd marks around the experts).
(i) Each collective on a sweep of sizes and world sizes, on gloo: the bytes this rank's process
    wrote to its sockets during the op (meters.WireMeter: /proc/self/io's wchar, gloo's threads
    included) against the ring model (theory.wire_bytes). Large all-reduces land on 2(N-1)/N; small
    ones write more (per-message headers, and the algorithm gloo picks for small tensors).
(j) The planner against live runs: every memory class of layout it ranks for 8 ranks of the tiny
    GPT (planner.validate_on_toy_runs; --plan-sample N: N of them) is run; each rank's model states
    against the prediction, to the byte, and the step time predicted with the profile "this
    machine" measured first (planner.measure_hardware: the toy's compute through the engine on
    one CPU rank, with and without checkpointing, its optimizer step, a comm call's CPU from tp2,
    tp2 + sp and cp2 runs, links fitted per op at 2, 4 and 8 ranks in groups of 2 up to all of
    them; --hardware-json PATH keeps it) against the measured
    wall-clock step: predicted / measured per layout, how many within 0.7-1.4, Spearman's rank
    correlation (and the assumed "cpu" profile's, beside); and the ranks' summed op CPU time over
    the cores, which other processes' load does not inflate.
(k) The app as a class meets it: a Streamlit server of its own (`streamlit run app/streamlit_app.py`,
    its warm-up off, so that the first press of each page is measured, not read) and Debian's
    chromium at 1440 x 900 (playwright). For every page at its default controls: cold = the first
    press of "Run live" on the fresh server (the page's runs measured, the server's imports paid
    by the first page), then warm = a new browser session's press of the same setting, repeated
    (the server's shared result read), as p50 and p90. Each time runs from the click to the page's
    first chart drawn in the browser (the page's first `stVegaLiteChart` with an SVG or canvas).
    The status line of the cold press says how long the ranks' run itself took.
(l) A straggler (the last of 4 ranks, 3x slower: it sleeps twice its forward and backward's wall
    time after them) against synchronous data parallel (`run --dp 4 --straggler 3:3`: every
    all-reduce waits for it) and asynchronous SGD (`run --dp 4 --async --straggler 3:3`: rank 0
    serves, 3 workers push; with --max-staleness 0 a barrier per step, unbounded without), and
    both without the straggler, one run each: updates and samples per second (measured), time
    and samples to a target loss (smoothed over one global batch), and the loss at equal samples
    against the same updates replayed in one process without staleness (what staleness costs).
(m) This machine's links (course/links.py): point-to-point (one ring step), all-reduce, all-gather,
    reduce-scatter and all-to-all over --world local gloo ranks, message sizes 4 B to --max-mib MiB
    (powers of 4); per size the slowest rank's time of each repeat (a barrier before each), median
    and fastest over repeats. The alpha-beta model t = a(op,N) alpha + b(op,N) bytes beta with the
    ring's hop counts fitted per op and over all ops (least squares in relative error); alpha and
    beta are the link's, so the ops agreeing checks the model. Beside it, the source material's
    interconnect table (vendor figures; latencies assumed) and what one all-reduce of 1 GiB over 8
    ranks takes on each (theory) and on this machine's fitted link.
(a) to (j) run on gloo with CPU tensors (the course's laptop setting) even where GPUs exist.
On a shared CPU machine every number depends on the load: the load average is printed with them.
This is a benchmark, not a test: nothing here asserts a speed. The peers themselves (how each of
PyTorch's versions is built on our GPT) are in `peers.py`, shared with the peer tests.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import theory
from ..comm import Comm, ring_all_reduce
from ..config import MAX_LOCAL_RANKS, RunConfig
from ..data import global_batch, shard
from ..runtime.launch import run_ranks
from ..mesh import build_mesh
from ..model import build_model
from ..optim import Adam
from ..parallel.data import DataParallel
from .peers import (ZERO_PEERS, TORCH_PP_SCHEDULES, OurPipeline, TorchPipeline,
                    dtensor_loss, dtensor_tp_model, peer_adam, zero_peer)

MB = 2 ** 20


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


# ---------------------------------------------------------------------------------------------
# repeats until the median is stable
# ---------------------------------------------------------------------------------------------
# On a shared machine one step can take twice another; a median over a fixed count may still be
# drifting. Every timed loop below therefore keeps measuring after its `least` repeats until each
# series' median has settled: it moved by less than STABLE_TOL over the last STABLE_LAST repeats,
# or `most` repeats were made (then the row says "not stable"). The series are the slowest
# rank's times (one all-reduce MAX), identical on every rank, so every rank takes the same
# decision and no extra message is needed.
STABLE_TOL, STABLE_LAST = 0.02, 3


def median_settled(xs: list[float], last: int = STABLE_LAST, tol: float = STABLE_TOL) -> bool:
    """Whether the median of xs moved by less than `tol` (relative) over its last `last` values:
    the medians of xs[:-1], ..., xs[:-last] are all within tol of the median of xs."""
    if len(xs) <= last:
        return False
    now = statistics.median(xs)
    return all(abs(statistics.median(xs[:len(xs) - j]) - now) < tol * abs(now)
               for j in range(1, last + 1))


class Repeats:
    """How many measured repeats a loop makes: at least `least`, then more until every series'
    median has settled (median_settled), at most `most` (default 3 x least)."""

    def __init__(self, least: int, most: int | None = None):
        self.least = max(1, least)
        self.most = max(self.least, most if most is not None else 3 * self.least)

    def more(self, series) -> bool:
        """True while another repeat is wanted; `series`: the lists of measured values so far."""
        series = list(series)
        n = min(len(xs) for xs in series)
        return n < self.least or (n < self.most and not all(median_settled(xs) for xs in series))

    @staticmethod
    def verdict(series) -> dict:
        series = list(series)
        return {"repeats": min(len(xs) for xs in series),
                "stable": all(median_settled(xs) for xs in series)}


# A ratio of two medians that is judged against a goal 5 % away needs more than a settled median:
# on this 2-core machine one step of the toy takes 18 to 33 ms, and 20 steps leave ours/DDP's 90 %
# interval +-16 % wide (160 steps: +-4 %). RatioRepeats therefore goes on until the ratio's
# interval is within +-4 %: narrow enough to tell a ratio near 1.0 from the goal's 1.05. The
# interval is a bootstrap over the steps, a step's two runners resampled together: they ran back
# to back, on the same state of the machine (docs/bench-2cpu-2026-12-07, section 2).
RATIO_TOL, RATIO_LEVEL, RATIO_MOST = 0.04, 0.90, 300


def ratio_interval(a: list[float], b: list[float], level: float = RATIO_LEVEL,
                   resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """The `level` bootstrap interval of median(a) / median(b), a[i] and b[i] paired (resampled
    together). A fixed seed: every rank, holding the same series, finds the same interval."""
    ta, tb = (torch.tensor(x, dtype=torch.float64) for x in (a, b))
    picks = torch.randint(len(ta), (resamples, len(ta)),  # [resamples, steps]: steps drawn
                          generator=torch.Generator().manual_seed(seed))
    ratios = ta[picks].quantile(0.5, dim=1) / tb[picks].quantile(0.5, dim=1)  # [resamples]
    lo, hi = ratios.quantile(torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return lo.item(), hi.item()


def ratio_settled(a: list[float], b: list[float], tol: float = RATIO_TOL) -> bool:
    """Whether median(a) / median(b) is known to +-tol of itself (its interval, ratio_interval)."""
    if len(a) <= STABLE_LAST:
        return False
    lo, hi = ratio_interval(a, b)
    return hi - lo <= 2 * tol * statistics.median(a) / statistics.median(b)


class RatioRepeats(Repeats):
    """Repeats for a ratio median(a) / median(b): at least `least`, then more until ratio_settled,
    at most `most` (default RATIO_MOST)."""

    def __init__(self, least: int, most: int = RATIO_MOST):
        super().__init__(least, most)

    def more(self, a, b) -> bool:
        n = min(len(a), len(b))
        return n < self.least or (n < self.most and not ratio_settled(a, b))


def _verdict(*series) -> dict:
    """A row's "repeats" (measured per runner) and "stable" (every runner's median settled)."""
    v = Repeats.verdict(series)
    return {"steps_measured": v["repeats"], "repeats": v["repeats"], "stable": v["stable"]}


def _slowest_rank(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---------------------------------------------------------------------------------------------
# (a) data parallel: ours vs DDP
# ---------------------------------------------------------------------------------------------
def _dp_rank(cfg_dict: dict, warmup: int, steps: int, most: int = RATIO_MOST) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = RunConfig.from_dict(cfg_dict)
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = build_mesh(cfg)
    runners = {}
    model = build_model(cfg)
    last_grad = {}  # runner -> when its last gradient was accumulated: backward's compute ends
    ddp = DDP(model, bucket_cap_mb=cfg.bucket_mb)
    ddp_records: list[dict] = []
    ddp.register_comm_hook(None, _timed_allreduce_hook(ddp_records))
    _mark_last_grad(model, last_grad, "ddp")
    runners["ddp"] = (ddp, lambda: None, Adam(model.parameters(), lr=cfg.lr))
    comms = {}
    for mode in ("bucketed", "naive"):
        model = build_model(cfg)
        comms[mode] = Comm(mesh)
        dp = DataParallel(model, comms[mode], mode=mode, bucket_mb=cfg.bucket_mb)
        _mark_last_grad(model, last_grad, mode)
        runners[mode] = (model, dp.finish_gradient_sync, Adam(model.parameters(), lr=cfg.lr))
    names = list(runners)
    times = {k: [] for k in names}
    # per measured step: the share of the all-reduce time (launch to completion) that ran before
    # backward's last gradient, ours from Comm's records, DDP's from a comm hook that times
    # torch's own allreduce_hook: the same measurement for both
    overlap, ddp_overlap = [], []
    # the judged ratio goes on until known to +-RATIO_TOL; naive only until its median settles
    repeats, naive_repeats, i = RatioRepeats(steps, most), Repeats(steps), 0
    agree = {}  # runner -> max |param - DDP's| after the last step both took
    while i < warmup or repeats.more(times["bucketed"], times["ddp"]):
        x, y = shard(global_batch(cfg, i), r, n)
        now = [k for k in names if k != "naive" or i < warmup or naive_repeats.more([times[k]])]
        if "naive" not in now and "naive" not in agree:  # naive stopped after step i - 1
            agree["naive"] = _param_diff(runners, "naive")
        order = now[i % len(now):] + now[:i % len(now)]  # no mode always goes first
        for name in order:
            forward, sync, opt = runners[name]
            if name in comms:
                comms[name].step = i
            dist.barrier()
            t0 = time.perf_counter()
            loss = forward(x, y)
            bw0 = time.perf_counter()
            loss.backward()
            bw1 = time.perf_counter()
            sync()
            if name == "bucketed" and i >= warmup:
                overlap.append(_overlap_with(comms[name].records, i, bw0, last_grad[name]))
            if name == "ddp":
                for rec in ddp_records:
                    rec.setdefault("step", i)
                if i >= warmup:
                    ddp_overlap.append(_overlap_with(ddp_records, i, bw0, last_grad[name]))
                ddp_records.clear()
            opt.step()
            opt.zero_grad()
            dt = _slowest_rank(time.perf_counter() - t0)
            if i >= warmup:
                times[name].append(dt)
        i += 1
    agree = {k: _param_diff(runners, k) for k in names} | agree  # naive's: when it stopped
    return {"times": times, "max_param_diff_vs_ddp": max(agree.values()), "overlap": overlap,
            "ddp_overlap": ddp_overlap,
            "interval": ratio_interval(times["bucketed"], times["ddp"]),
            "repeats": len(times["bucketed"]), "naive_repeats": len(times["naive"]),
            "stable": ratio_settled(times["bucketed"], times["ddp"])
            and median_settled(times["naive"])}


def _param_diff(runners: dict, name: str) -> float:
    """Max |param - DDP's param| of one runner: the replicas trained on the same data from the
    same init, a cheap sanity check."""
    def flat(k):
        model = runners[k][0].module if k == "ddp" else runners[k][0]
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return (flat(name) - flat("ddp")).abs().max().item()


def _timed_allreduce_hook(records: list[dict]):
    """A DDP comm hook that runs torch's default one (allreduce_hook: divide, all-reduce) and notes
    each bucket's launch and completion (the future's callback), as Comm records ours."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        rec = {"op": "all_reduce", "start": time.perf_counter()}
        records.append(rec)

        def done(fut):
            rec["end"] = time.perf_counter()
            return fut.value()
        return default_hooks.allreduce_hook(state, bucket).then(done)
    return hook


def _mark_last_grad(model, marks: dict, name: str) -> None:
    """marks[name] = when the latest gradient of `model` was accumulated (the end of backward's
    compute, whether or not backward then waits for communication, as DDP's does)."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda _, name=name: marks.__setitem__(name, time.perf_counter()))


def _overlap_with(records: list[dict], step: int, start: float, end: float) -> float:
    """Of the all-reduce time of `step` (launch to completion, as the backend reported it), the
    share that ran while backward was still computing [start, end]: the computation lesson 02
    shows (experiments.allreduce_overlap, overlapped_share)."""
    from .experiments import allreduce_overlap, overlapped_share

    return overlapped_share(allreduce_overlap(records, step, start, end))


def bench_dp(dps=(2, 4), warmup: int = 5, steps: int = 20, bucket_mb: float = 0.25,
             batch: int = 16, most: int = RATIO_MOST, **model) -> list[dict]:
    """(a): per dp, DDP, ours bucketed and ours naive; at least `steps` measured steps, at most
    `most` (RatioRepeats)."""
    rows = []
    for n in dps:
        cfg = RunConfig(dp=n, batch=batch, bucket_mb=bucket_mb, steps=warmup + steps,
                        **model).validate()
        out = run_ranks(_dp_rank, n, cfg.to_dict(), warmup, steps, most, timeout=600,
                        backend="gloo")[0].value
        med = {k: statistics.median(v) for k, v in out["times"].items()}
        rows.append({
            "dp": n, "batch": batch, "bucket_mb": bucket_mb, "steps_measured": out["repeats"],
            "n_params": theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers),
            "ddp_ms": 1e3 * med["ddp"], "bucketed_ms": 1e3 * med["bucketed"],
            "naive_ms": 1e3 * med["naive"],
            "bucketed_over_ddp": med["bucketed"] / med["ddp"],
            "bucketed_over_ddp_interval": list(out["interval"]),  # 90 % (RATIO_LEVEL)
            "naive_over_ddp": med["naive"] / med["ddp"],
            "p90_ms": {k: 1e3 * _quantile(v, 0.9) for k, v in out["times"].items()},
            "max_param_diff_vs_ddp": out["max_param_diff_vs_ddp"],
            "allreduce_overlapped": statistics.median(out["overlap"]),
            "ddp_allreduce_overlapped": statistics.median(out["ddp_overlap"]),
            "repeats": out["repeats"], "naive_repeats": out["naive_repeats"],
            "stable": out["stable"],
        })
    return rows


# ---------------------------------------------------------------------------------------------
# (c) ZeRO: ours vs PyTorch's
# ---------------------------------------------------------------------------------------------
def _our_zero_step(cfg: RunConfig):
    """One training step of our strategy for `cfg` (its own model), as a function of (x, y)."""
    from ..engine import parallelize

    model = build_model(cfg)
    ours = parallelize(model, Comm(build_mesh(cfg)), cfg)

    def step(x, y):
        ours.zero_grad()
        model(x, y).backward()
        ours.finish_gradient_sync()
        ours.step()
    return step


def _zero_rank(cfg_dict: dict, warmup: int, steps: int) -> dict:
    base = RunConfig.from_dict(cfg_dict)
    n, r = dist.get_world_size(), dist.get_rank()
    runners = {}
    for stage, (peer, kind) in ZERO_PEERS.items():
        cfg = base.replace(zero=stage)
        our_step = _our_zero_step(cfg)
        module, opt = zero_peer(cfg, kind)

        def peer_step(x, y, module=module, opt=opt):
            opt.zero_grad()
            module(x, y).backward()
            opt.step()

        runners[f"ours ZeRO-{stage}"], runners[peer] = our_step, peer_step
    # what prefetch buys, measured beside it
    runners["ours ZeRO-3 no prefetch"] = _our_zero_step(base.replace(zero=3, no_prefetch=True))
    names = list(runners)
    times = {k: [] for k in names}
    repeats, i = Repeats(steps), 0
    while i < warmup or repeats.more(times.values()):
        x, y = shard(global_batch(base, i), r, n)
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            runners[name](x, y)
            dt = _slowest_rank(time.perf_counter() - t0)
            if i >= warmup:
                times[name].append(dt)
        i += 1
    return times


def bench_zero(dps=(2, 4), warmup: int = 3, steps: int = 10, batch: int = 16) -> list[dict]:
    rows = []
    for n in dps:
        cfg = RunConfig(dp=n, batch=batch, steps=warmup + steps).validate()
        times = run_ranks(_zero_rank, n, cfg.to_dict(), warmup, steps, timeout=600,
                          backend="gloo")[0].value
        med = {k: statistics.median(v) for k, v in times.items()}
        for stage, (peer, _) in ZERO_PEERS.items():
            ours = med[f"ours ZeRO-{stage}"]
            rows.append({"dp": n, "stage": stage, "peer": peer, "ours_ms": 1e3 * ours,
                         "peer_ms": 1e3 * med[peer], "ours_over_peer": ours / med[peer],
                         **_verdict(times[f"ours ZeRO-{stage}"], times[peer])})
            if stage == 3:
                rows[-1]["no_prefetch_ms"] = 1e3 * med["ours ZeRO-3 no prefetch"]
    return rows


# ---------------------------------------------------------------------------------------------
# (d) tensor parallel: ours vs DTensor
# ---------------------------------------------------------------------------------------------
def _tp_rank(cfg_dict: dict, warmup: int, steps: int) -> dict:
    from ..parallel.tensor import apply_tensor_parallel

    cfg = RunConfig.from_dict(cfg_dict)
    runners = {}
    for sp in (False, True):
        c = cfg.replace(sp=sp)
        ours = apply_tensor_parallel(build_model(c), Comm(build_mesh(c)), sp=sp)
        peer = dtensor_tp_model(c, sp)
        runners[("ours", sp)] = (ours, Adam(ours.parameters(), lr=c.lr), False)
        runners[("DTensor", sp)] = (peer, peer_adam(peer.parameters(), c), False)
    vocab = dtensor_tp_model(cfg, False, vocab=True)  # the same split as ours (TP_NOTES)
    runners[("DTensor vocab", False)] = (vocab, peer_adam(vocab.parameters(), cfg), True)
    names = list(runners)
    times = {k: [] for k in names}
    repeats, i = Repeats(steps), 0
    while i < warmup or repeats.more(times.values()):
        x, y = global_batch(cfg, i)
        i += 1
        for name in names[(i - 1) % len(names):] + names[:(i - 1) % len(names)]:  # none always first
            model, opt, loss_parallel = runners[name]
            dist.barrier()
            t0 = time.perf_counter()
            with dtensor_loss(loss_parallel):
                model(x, y).backward()
            opt.step()
            opt.zero_grad()
            dt = _slowest_rank(time.perf_counter() - t0)
            if i > warmup:
                times[name].append(dt)
    return {f"{who} sp={sp}": t for (who, sp), t in times.items()}


TP_NOTES = {False: "ours also splits the vocabulary (embedding, head, loss); the DTensor plan "
                   "shards the blocks only. 'vocab': DTensor with the vocabulary split as ours "
                   "(token table row-wise, head column-wise, loss_parallel): the same work",
            True: "both split the vocabulary of the embedding and head; ours also the loss "
                  "(DTensor gathers the logits)"}


def bench_tp(tps=(2, 4), warmup: int = 3, steps: int = 10) -> list[dict]:
    rows = []
    for n in tps:
        cfg = RunConfig(tp=n, steps=warmup + steps).validate()
        times = run_ranks(_tp_rank, n, cfg.to_dict(), warmup, steps, timeout=600,
                          backend="gloo")[0].value
        med = {k: statistics.median(v) for k, v in times.items()}
        for sp in (False, True):
            ours, peer = med[f"ours sp={sp}"], med[f"DTensor sp={sp}"]
            rows.append({"tp": n, "sp": sp, "ours_ms": 1e3 * ours, "dtensor_ms": 1e3 * peer,
                         "ours_over_dtensor": ours / peer,
                         **_verdict(times[f"ours sp={sp}"], times[f"DTensor sp={sp}"]),
                         "note": TP_NOTES[sp]})
            if not sp:
                vocab = med["DTensor vocab sp=False"]
                rows[-1].update(dtensor_vocab_ms=1e3 * vocab, ours_over_dtensor_vocab=ours / vocab,
                                stable=rows[-1]["stable"] and median_settled(
                                    times["DTensor vocab sp=False"]))
    return rows


# ---------------------------------------------------------------------------------------------
# (e) pipeline parallel: ours vs torch.distributed.pipelining
# ---------------------------------------------------------------------------------------------
def _count_torch_sends() -> dict:
    """torch's schedules post every message through `schedules._batch_p2p` (private): wrapped to
    count the sends, so the table can show both pipelines move the same messages (counted)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    counts = {"isend": 0}
    original = getattr(torch_schedules, "_batch_p2p", None)
    if original is None:  # another torch release: not counted
        return {"isend": None}

    def counting(ops, *args, **kwargs):
        counts["isend"] += sum(getattr(op.op, "__name__", "") == "isend" for op in ops)
        return original(ops, *args, **kwargs)

    torch_schedules._batch_p2p = counting
    return counts


def _runner_split(events: list[dict], wall: float) -> dict:
    """One step of our runner on one rank, from its own timeline (measured): compute (F, B, W),
    handing messages to the link (send events), waiting for them (wait events) and the rest of
    the step's wall time (bookkeeping between ops, zero_grad and the optimizer step)."""
    split = {"compute": 0.0, "send": 0.0, "wait": 0.0}
    for e in events:
        split[e["kind"] if e["kind"] in ("send", "wait") else "compute"] += e["end"] - e["start"]
    split["other"] = wall - sum(split.values())
    return split


def _pp_rank(cfg_dict: dict, schedules, warmup: int, steps: int) -> dict:
    cfg = RunConfig.from_dict(cfg_dict)
    torch_sent = _count_torch_sends()
    runners = {}
    for name in schedules:
        runners[("ours", name)] = OurPipeline(cfg, name)
        runners[("torch", name)] = TorchPipeline(cfg, name)
    names = list(runners)
    times = {k: [] for k in names}
    splits = {name: [] for name in schedules}
    sent = {k: 0 for k in names}
    final_loss = {}
    repeats, i = Repeats(steps), 0
    while i < warmup or repeats.more(times.values()):
        x, y = global_batch(cfg, i)
        i += 1
        for key in names[(i - 1) % len(names):] + names[:(i - 1) % len(names)]:  # none always first
            runner, before = runners[key], torch_sent["isend"]
            dist.barrier()
            t0 = time.perf_counter()
            loss = runner.step(x, y)
            mine = time.perf_counter() - t0
            dt = _slowest_rank(mine)
            if i > warmup:
                times[key].append(dt)
                if key[0] == "ours":
                    splits[key[1]].append(_runner_split(runner.last_events, mine))
            if i == 1:  # the messages of one step, this rank's sends
                sent[key] = runner.sends if key[0] == "ours" else (
                    None if before is None else torch_sent["isend"] - before)
            if loss is not None:
                final_loss[key] = loss
    # both trained on the same data from the same init: their last losses agree (a sanity check)
    parts = [None] * dist.get_world_size()
    split = {name: {k: statistics.median(s[k] for s in v) for k in v[0]} for name, v in splits.items()}
    dist.all_gather_object(parts, (final_loss, split, sent))
    final = {k: v for p in parts for k, v in p[0].items()}
    return {"times": {f"{who} {name}": t for (who, name), t in times.items()},
            "loss_diff": {name: abs(final[("ours", name)] - final[("torch", name)])
                          for name in schedules},
            "split": {name: [p[1][name] for p in parts] for name in schedules},
            "sends": {f"{who} {name}": (None if any(p[2][(who, name)] is None for p in parts)
                                        else sum(p[2][(who, name)] for p in parts))
                      for who, name in names}}


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


def bench_pp(pps=(2, 4), schedules=PP_SCHEDULES, warmup: int = 3,
             steps: int = 10, layers: int = 8, microbatches: int = 8, batch: int = 16) -> list[dict]:
    rows = []
    for n in pps:
        cfg = RunConfig(pp=n, layers=layers, microbatches=microbatches, batch=batch,
                        steps=warmup + steps).validate()
        out = run_ranks(_pp_rank, n, cfg.to_dict(), list(schedules), warmup, steps, timeout=600,
                        backend="gloo")[0].value
        med = {k: statistics.median(v) for k, v in out["times"].items()}
        for name in schedules:
            ours, peer = med[f"ours {name}"], med[f"torch {name}"]
            rows.append({"pp": n, "schedule": name, "torch_schedule": TORCH_PP_SCHEDULES[name],
                         "layers": layers, "microbatches": microbatches, "batch": batch,
                         "ours_ms": 1e3 * ours, "torch_ms": 1e3 * peer,
                         "ours_over_torch": ours / peer,
                         **_verdict(out["times"][f"ours {name}"], out["times"][f"torch {name}"]),
                         "last_loss_diff": out["loss_diff"][name],
                         "messages_per_step": {"ours": out["sends"][f"ours {name}"],
                                               "torch": out["sends"][f"torch {name}"]},
                         "ours_split_ms": [{k: 1e3 * v for k, v in per_rank.items()}
                                           for per_rank in out["split"][name]],
                         "p90_ms": {k: 1e3 * _quantile(v, 0.9) for k, v in out["times"].items()
                                    if k.endswith(f" {name}")}})
    return rows


# ---------------------------------------------------------------------------------------------
# (b) ring all-reduce vs gloo
# ---------------------------------------------------------------------------------------------
def _ring_rank(sizes_mb, repeats: int, most: int) -> list[dict]:
    n, r = dist.get_world_size(), dist.get_rank()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    rows = []
    for mb in sizes_mb:
        numel = int(mb * MB / 4)
        base = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        t_ring, t_gloo = [], []
        # judged as a ratio (ring/gloo bus bandwidth = gloo's time / ours): until it is known
        until, i = RatioRepeats(repeats, most), 0
        while i == 0 or until.more(t_gloo, t_ring):  # the first round warms the connections
            for impl in (("ring", "gloo") if i % 2 == 0 else ("gloo", "ring")):
                x = base.clone()
                dist.barrier()
                t0 = time.perf_counter()
                if impl == "ring":
                    ring_all_reduce(x, comm)
                    ours = x
                else:
                    dist.all_reduce(x)
                    ref = x
                dt = _slowest_rank(time.perf_counter() - t0)
                if i:
                    (t_ring if impl == "ring" else t_gloo).append(dt)
            comm.records.clear(); comm.p2p_log.clear()
            i += 1
        rows.append({"mb": mb, "ring_s": statistics.median(t_ring),
                     "gloo_s": statistics.median(t_gloo), "repeats": len(t_ring),
                     "steps_measured": len(t_ring), "stable": ratio_settled(t_gloo, t_ring),
                     "ring_over_gloo_bw_interval": list(ratio_interval(t_gloo, t_ring)),
                     "max_abs_err": (ours - ref).abs().max().item()})
    latency = _step_latency(comm, max(5, repeats))
    return [dict(row, step_latency_s=latency) for row in rows]


RING_MOST = 200  # repeats at most per size: a small size is ~20 ms a repeat (both), 64 MB ~0.2 s


def _step_latency(comm: Comm, repeats: int, steps: int = 20) -> dict:
    """What bounds a small all-reduce: our whole ring on N floats (one per chunk: 2(N-1) messages
    of 4 B, the ring's latency floor, `ours_ring_floor`) against gloo's all-reduce of one float
    (its ring runs in C++ on gloo's threads); and one step alone, ours (Comm.sendrecv: metered and
    recorded) and bare (torch.distributed's irecv + isend, as sendrecv posts them), whose
    difference is what the metering costs a message. Each sample is `steps` calls back to back
    after a barrier, per call: a single call after a barrier mostly measures which rank left the
    barrier last (on a loaded machine such samples of one and the same call ranged 0.3 to 10 ms).
    The calls alternate, sample by sample. Medians of the slowest rank; `*_cpu` is this thread's
    CPU time per call (what the metering itself costs, whatever the load)."""
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    one, buf, per_chunk = torch.ones(1), torch.empty(1), torch.ones(n)

    kept = []

    def bare():  # both Works outlive the next step's waits, as in Comm.sendrecv
        receiving = dist.irecv(buf, left)
        sending = dist.isend(one, right)
        receiving.wait()
        sending.wait()
        kept[:] = [receiving, sending]

    calls = {"ours_ring_floor": lambda: ring_all_reduce(per_chunk, comm),
             "ours_step": lambda: comm.sendrecv(one, right, buf, left, "dp"),
             "bare_step": bare, "gloo_all_reduce_4B": lambda: dist.all_reduce(buf)}
    times = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    for i in range(repeats + 1):  # the first round warms up
        for name in list(calls)[i % len(calls):] + list(calls)[:i % len(calls)]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                calls[name]()
            c1 = time.thread_time()
            dt = _slowest_rank(time.perf_counter() - t0)
            if i:
                times[name].append(dt / steps)
                cpu[name].append((c1 - c0) / steps)
        per_chunk.fill_(1.0)  # summed in place: keep it small
        comm.records.clear(); comm.p2p_log.clear()
    return {**{name: statistics.median(ts) for name, ts in times.items()},
            **{f"{name}_cpu": statistics.median(cs) for name, cs in cpu.items()}}


def bench_ring(n: int = 4, sizes_mb=(0.0625, 0.25, 1, 4, 16, 64), repeats: int = 5,
               most: int = RING_MOST) -> list[dict]:
    """(b): per size, our ring against gloo's all-reduce, at least `repeats` and at most `most`
    repeats (RatioRepeats), and the latency of one step (_step_latency)."""
    rows = run_ranks(_ring_rank, n, list(sizes_mb), repeats, most, timeout=600,
                     backend="gloo")[0].value
    for row in rows:
        wire = theory.wire_bytes("all_reduce", int(row["mb"] * MB), n)
        row.update(world_size=n,
                   ring_busbw_GBps=wire / row["ring_s"] / 1e9,
                   gloo_busbw_GBps=wire / row["gloo_s"] / 1e9,
                   ring_over_gloo_bw=row["gloo_s"] / row["ring_s"])
    return rows


# ---------------------------------------------------------------------------------------------
# warm path: a repeated small run, as the app's "run live" button does it
# ---------------------------------------------------------------------------------------------
# The pages' default settings, as their "Run live" sends them (app/app_pages/data_parallel.py,
# ring.py): what a class sees first, and what a teacher re-runs with "Fresh measurement".
WARM_RUNS = {
    "Data parallel page, default settings": ("run", {
        "dp": 2, "dp_mode": "bucketed", "bucket_mb": 0.25, "grad_accum": 1, "steps": 4, "batch": 8,
        "reference": True}),
    "Ring all-reduce page, default settings": ("ring", {"n": 4, "numel": 16, "timed_mb": 4}),
    "launch.run(dp=4, steps=2), the figure of issue 15": ("run", {"dp": 4, "steps": 2}),
}


def _warm_call(kind: str, settings: dict):
    """One live run the way the app's cached wrappers make it (app/live_runs.py), minus the cache."""
    from .collectives import ring_experiment
    from ..runtime.launch import run

    if kind == "ring":
        return ring_experiment(settings["n"], settings["numel"], timed_mb=settings["timed_mb"])
    return run(RunConfig.from_dict(settings)).to_dict()


def bench_warm(repeats: int = 10, runs: dict = WARM_RUNS) -> dict:
    """The latency of a repeated live run (forkserver and imports warm): p50 / p90 over `repeats`
    runs of each page's default settings, after a first call that starts the forkserver."""
    rows = []
    for name, (kind, settings) in runs.items():
        t0 = time.perf_counter()
        _warm_call(kind, settings)
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _warm_call(kind, settings)
            times.append(time.perf_counter() - t0)
        rows.append({"run": name, "settings": settings, "repeats": repeats, "first_s": first,
                     "p50_s": _quantile(times, 0.5), "p90_s": _quantile(times, 0.9),
                     "times_s": times})
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# (f) the bubble, measured (wall clock) and replayed, against the formula, over repeated runs
# ---------------------------------------------------------------------------------------------
def bench_bubble(schedules=("gpipe", "1f1b", "interleaved", "zb"), setups=((2, 4), (4, 8)),
                 repeats: int = 5) -> list[dict]:
    from ..runtime.launch import run
    from ..parallel.schedules import pipeline_layers, virtual_stages
    from .trace import GAP_PARTS, PIPELINE_STEPS, bubble

    rows = []
    for pp, m in setups:
        for name in schedules:
            cfg = RunConfig(pp=pp, microbatches=m, schedule=name, reference=True,
                            batch=max(RunConfig.batch, m),  # one sequence per micro-batch at least
                            layers=pipeline_layers(pp, virtual_stages(name)),
                            steps=PIPELINE_STEPS).validate()
            runs = []
            for i in range(repeats):
                report = run(cfg)
                b = bubble(report)
                wall = b["wall"]
                runs.append({"wall": wall["overall"], "replayed": b["replayed"]["overall"],
                             "theory": b["theory"],
                             "wall_points": 100 * (wall["overall"] - b["theory"]),
                             "replayed_points": 100 * (b["replayed"]["overall"] - b["theory"]),
                             "gap_points": {k: 100 * v for k, v in wall["gap_to_formula"].items()},
                             "p2p_latency_median_s": wall["p2p_latency_median_s"],
                             "op_cpu_over_wall_min": min(wall["op_cpu_over_wall_per_rank"]),
                             "ranks_shared_cores": wall["ranks_shared_cores"],
                             "max_abs_diff": report.max_abs_diff})
                print(f"  pp {pp} m {m} {name} run {i + 1}/{repeats}: bubble measured (wall clock) "
                      f"{wall['overall']:.1%}, replayed {b['replayed']['overall']:.1%}, formula "
                      f"{b['theory']:.1%}", file=sys.stderr, flush=True)
            latencies = [r["p2p_latency_median_s"] for r in runs if r["p2p_latency_median_s"] is not None]
            rows.append({
                "schedule": name, "pp": pp, "microbatches": m, "layers": cfg.layers,
                "steps": cfg.steps, "repeats": repeats, "runs": runs,
                "ranks_shared_cores": runs[0]["ranks_shared_cores"],
                "wall_median_points": statistics.median(r["wall_points"] for r in runs),
                "wall_within_5_points": sum(abs(r["wall_points"]) <= 5 for r in runs),
                "gap_median_points": {k: statistics.median(r["gap_points"][k] for r in runs)
                                      for k in GAP_PARTS},
                "p2p_latency_median_s": statistics.median(latencies) if latencies else None,
                "op_cpu_over_wall_min": min(r["op_cpu_over_wall_min"] for r in runs),
                "replayed_median_points": statistics.median(r["replayed_points"] for r in runs),
                "replayed_within_3_points": sum(abs(r["replayed_points"]) <= 3 for r in runs),
                "max_abs_diff": max(r["max_abs_diff"] for r in runs),
                "stable": median_settled([r["wall"] for r in runs])})  # fixed runs, not repeated
    return rows


# ---------------------------------------------------------------------------------------------
# (f2) DualPipe beside 1F1B, ZB-H1 and ZBV: the DeepSeek-V3 report's table and the same run
# ---------------------------------------------------------------------------------------------
DUAL_COMPARED = ("1f1b", "zb", "zbv", "dualpipev", "dualpipe")
TABLE_ROW = {"1f1b": "1F1B", "zb": "ZB1P", "zbv": None, "dualpipev": "DualPipeV", "dualpipe": "DualPipe"}


def bench_dualpipe(pp: int = 4, m: int = 8, layers: int = 8, steps: int = 3) -> list[dict]:
    """The same model, batch and pp ranks under each schedule of DUAL_COMPARED: its bubble (the
    formula, theory; replayed from measured op costs; the wall clock, measured), parameters per
    rank (measured bytes; the table says copies), activations (micro-batches in flight, counted
    from the op list, in units of one pp-way stage; the peak measured in bytes), and the report's
    formula with this run's measured op costs (no F&B overlap on one CPU: F&B = F + B + W)."""
    from ..runtime.launch import run
    from ..parallel.schedules import build_schedule, in_flight
    from .trace import bubble, op_costs

    rows = []
    for name in DUAL_COMPARED:
        cfg = RunConfig(pp=pp, microbatches=m, layers=layers, batch=2 * m, schedule=name,
                        steps=steps, reference=True).validate()
        report = run(cfg)
        s = build_schedule(name, pp, m)
        b, costs = bubble(report), op_costs(report)
        chunk = pp / s.stages  # one chunk's size in pp-way stages (1, or 1/2 in a V)
        stages = pp if name in ("1f1b", "zb", "dualpipe") else 2 * pp
        split = "W" in costs
        table = {r["method"]: r for r in theory.pipeline_table(
            stages, costs if split else {"F": costs["F"], "B": costs["B"], "W": 0.0})}
        rows.append({
            "schedule": name, "pp": pp, "microbatches": m, "layers": layers,
            "table_method": TABLE_ROW[name],
            "table_bubble_s": table[TABLE_ROW[name]]["bubble"] if TABLE_ROW[name] else None,
            "bubble_theory": b["theory"], "bubble_replayed": b["replayed"]["overall"],
            "bubble_wall": b["wall"]["overall"], "ranks_shared_cores": b["wall"]["ranks_shared_cores"],
            "params_bytes_max": max(r["memory"]["params"] for r in report.ranks),
            "activations_peak_bytes_max": max(r["memory"]["activations_peak"] for r in report.ranks),
            "in_flight_stage_units": max(in_flight(s)) * chunk,
            "table_activations": table[TABLE_ROW[name]]["activations"] * chunk if TABLE_ROW[name] else None,
            "max_abs_diff": report.max_abs_diff})
    one = next(r for r in rows if r["schedule"] == "1f1b")
    for r in rows:
        r["params_over_1f1b"] = r["params_bytes_max"] / one["params_bytes_max"]
    return rows


FB_ORDERS = (("comm", "compute", "serial", "overlapped"), ("overlapped", "serial", "compute", "comm"))


def _fb_overlap_rank(cfg_dict: dict, repeats: int) -> dict:
    """One rank of the F&B overlap measurement (see bench_fb_overlap): every round times the
    all-to-all alone, the compute alone, the two one after the other and the two overlapped, back
    to back (the order reversed every other round, so that a drift of the machine's load falls on
    all four alike); each time is the slowest rank's (a barrier first)."""
    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    n, me = comm.size("dp"), comm.rank("dp")
    model = build_model(cfg)
    x, y = shard(global_batch(cfg, 0), me, n)  # micro-batch B: this rank's sequences [b/n, s]

    def compute():  # micro-batch B's forward and backward through the whole toy chunk
        model.zero_grad(set_to_none=True)
        model(x, y).backward()

    def seconds(fn) -> tuple[float, float]:
        """(the slowest rank's wall time, this process's CPU time, all its threads)."""
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return _slowest_rank(wall), cpu

    # micro-batch A's expert dispatch: each token's top-k copies of its hidden vector, rows
    # [tokens * k, h]; scaled (below) until the all-to-all alone lasts about as long as the compute,
    # as DeepSeek-V3's does (its report: computation and all-to-all about 1:1)
    rows = x.numel() * cfg.top_k
    base = torch.randn(rows * n, cfg.d_model, generator=torch.Generator().manual_seed(me))
    send = base
    recv = torch.empty_like(send)
    a2a = lambda: comm.all_to_all(recv, send, "dp")
    for _ in range(2):  # warm both
        compute(), a2a()
    t_comp = statistics.median(seconds(compute)[0] for _ in range(3))
    for scale in (2 ** i for i in range(10)):  # (seconds() lines the ranks up: all agree)
        send = base.repeat(scale, 1)
        recv = torch.empty_like(send)
        if statistics.median(seconds(a2a)[0] for _ in range(3)) >= t_comp / 2:
            break

    def serial():
        comm.all_to_all(recv, send, "dp")
        compute()

    def overlapped():  # A's all-to-all in flight (gloo's worker thread) while B computes
        handle = comm.all_to_all(recv, send, "dp", async_op=True)
        compute()
        handle.wait()

    fns = {"comm": lambda: comm.all_to_all(recv, send, "dp"), "compute": compute,
           "serial": serial, "overlapped": overlapped}
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 1):  # round 0 warms up
        for name in FB_ORDERS[i % 2]:
            wall, c = seconds(fns[name])
            if i:
                times[name].append(wall)
                cpu[name].append(c)
    overlapped()
    got = recv.clone()
    comm.all_to_all(recv, send, "dp")
    return {"times_s": times, "cpu_s": cpu, "payload_bytes": send.numel() * send.element_size(),
            "torch_threads": torch.get_num_threads(),
            "overlapped_equals_blocking": bool(torch.equal(got, recv))}


def fb_overlap_summary(times: dict[str, list[float]]) -> dict:
    """From the per-round times (lists of equal length, round by round): the medians, and each
    round's hidden fraction (serial - overlapped) / all-to-all, paired within the round: 1 when the
    all-to-all hides entirely behind the compute, 0 when the two only take turns, below 0 when
    overlapping them costs more than running them in turn (cores fought over). Its median and
    quartiles say whether the rounds agree."""
    med = {k: statistics.median(v) for k, v in times.items()}
    hidden = [(s - o) / c for s, o, c in zip(times["serial"], times["overlapped"], times["comm"])]
    q = statistics.quantiles(hidden, n=4, method="inclusive") if len(hidden) > 1 else hidden * 3
    return {"median_s": med, "hidden_per_round": hidden, "hidden_fraction": statistics.median(hidden),
            "hidden_q1": q[0], "hidden_q3": q[2], "hidden_min": min(hidden), "hidden_max": max(hidden),
            "rounds_hiding": sum(h > 0 for h in hidden),
            # nothing overlapped: serial = comm + compute (1.0); a full overlap: max(comm, compute)
            "serial_over_sum": med["serial"] / (med["comm"] + med["compute"]),
            "best_possible_fraction": min(med["comm"], med["compute"]) / med["comm"]}


def fb_overlap_cores(ranks: int, torch_threads: int, cpus: int, load: float) -> dict:
    """Has this machine the cores to show the overlap? Each rank needs a core for its compute (torch's
    threads) and one for gloo's worker thread, which copies the all-to-all's bytes through the
    sockets meanwhile: ranks x (threads + 1) cores, beside what other processes use (the load).
    Necessary, not sufficient: on an idle 16-core machine gloo still mostly took turns (docs/gpu.md)."""
    need = ranks * (torch_threads + 1)
    if need > cpus:
        why = (f"cannot show it: {ranks} ranks x ({torch_threads} compute thread(s) + gloo's worker) "
               f"= {need} busy threads > {cpus} cores; the all-to-all's copies and the compute take "
               f"turns on the cores, so what is measured is their contention, not overlap")
    elif need + load > cpus:
        why = (f"may not show it: {need} busy threads fit {cpus} cores, but the load average "
               f"{load:.1f} says other processes want {load:.1f} of them")
    else:
        why = (f"has the cores for it: {need} busy threads on {cpus} cores, load average {load:.1f} "
               "(whether gloo then overlaps is what the rounds measure)")
    return {"threads_needed": need, "cores_enough": need <= cpus, "can_show": need + load <= cpus,
            "cores_verdict": why}


def bench_fb_overlap(ranks: int = 2, repeats: int = 15, timeline: bool = True) -> dict:
    """DualPipe's F&B overlap, on the toy, measured on the wall clock: on each of `ranks` ranks,
    micro-batch A's expert all-to-all (gloo, async: it runs in gloo's worker thread) in flight
    while micro-batch B's forward and backward compute, against the two one after the other, over
    `repeats` interleaved rounds (fb_overlap_summary: the hidden fraction per round, its median
    and spread; fb_overlap_cores: whether this machine has the cores to show it). `timeline`: also
    a DualPipe run with experts (pp 2 x ep 2), its all-to-all records counted against the compute
    ops of other micro-batches on the same rank (experiments.comm_during_other_compute), and its
    pipeline sends the same way."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0]  # before our ranks start
    cfg = RunConfig(dp=ranks, batch=4 * ranks, layers=4, experts=4, top_k=2, steps=1).validate()
    out = run_ranks(_fb_overlap_rank, ranks, cfg.to_dict(), repeats, timeout=600, backend="gloo")
    r0 = out[0].value
    result = {**fb_overlap_summary(r0["times_s"]), **r0, "ranks": ranks, "repeats": repeats,
              "cpus": cpus, "load_average": load,
              "comm_cpu_over_wall": statistics.median(
                  c / w for c, w in zip(r0["cpu_s"]["comm"], r0["times_s"]["comm"])),
              **fb_overlap_cores(ranks, r0["torch_threads"], cpus, load)}
    if timeline:
        from ..runtime.launch import run
        from .experiments import comm_during_other_compute

        run_cfg = RunConfig(pp=2, dp=2, ep=2, experts=4, top_k=2, schedule="dualpipe",
                            microbatches=4, batch=8, layers=2, steps=4, reference=True,
                            backend="gloo").validate()  # CPU ranks, as the micro-benchmark's
        report = run(run_cfg)
        result["timeline"] = {"config": "pp 2 x ep 2 (dp 2), dualpipe, 4 micro-batches, 4 experts",
                              "max_abs_diff": report.max_abs_diff,
                              **{op: {k: v for k, v in comm_during_other_compute(report, op).items()
                                      if k != "rows"} for op in ("all_to_all", "send")}}
    return result


def _print_fb_overlap(r):
    med = r["median_s"]
    print(f"(f3) F&B overlap on the toy ({r['ranks']} ranks, {r['cpus']} CPUs, load {r['load_average']:.1f}): "
          f"an all-to-all of {r['payload_bytes'] / 1024:.0f} KiB per rank in flight during another "
          f"micro-batch's forward and backward, measured on the wall clock ({r['repeats']} rounds, "
          f"the four timings back to back in each, the slowest rank's)")
    print(_table(["all-to-all ms", "compute ms", "one after the other ms", "overlapped ms",
                  "hidden (measured): median", "quartiles", "min..max", "rounds > 0", "same result"],
                 [[f"{1e3 * med['comm']:.1f}", f"{1e3 * med['compute']:.1f}",
                   f"{1e3 * med['serial']:.1f}", f"{1e3 * med['overlapped']:.1f}",
                   f"{r['hidden_fraction']:.0%}", f"{r['hidden_q1']:.0%}..{r['hidden_q3']:.0%}",
                   f"{r['hidden_min']:.0%}..{r['hidden_max']:.0%}",
                   f"{r['rounds_hiding']} of {r['repeats']}", r["overlapped_equals_blocking"]]]))
    print(f"    hidden = (one after the other - overlapped) / all-to-all, per round (at most "
          f"{r['best_possible_fraction']:.0%} here: the shorter of the two); one after the other / "
          f"(all-to-all + compute) = {r['serial_over_sum']:.2f}; the all-to-all's CPU time (this "
          f"process, all threads) is {r['comm_cpu_over_wall']:.0%} of its wall time")
    print(f"    this machine {r['cores_verdict']}")
    t = r.get("timeline")
    if t:
        a, s = t["all_to_all"], t["send"]
        print(f"    the runner's own timelines ({t['config']}; counted from the records): "
              f"{a['overlapping_other']} of {a['records']} all-to-alls overlap another micro-batch's "
              f"compute ({a['inside_own_op']} lie inside the op that issued them: the runner runs "
              f"each rank's ops in order and the experts' all-to-all blocks); pipeline sends "
              f"(asynchronous) outstanding during another op's compute: {s['overlapping_other']} of "
              f"{s['records']}; max |ours - ref| {t['max_abs_diff']:.1e}")


def _print_dualpipe(rows):
    r0 = rows[0]
    print(f"(f2) DualPipe beside 1F1B, ZB-H1 and ZBV on the same run: pp {r0['pp']}, "
          f"{r0['microbatches']} micro-batches, {r0['layers']} layers. Table: the DeepSeek-V3 "
          f"report's formulas with this run's measured op costs (theory; F&B = F+B+W: one CPU "
          f"overlaps nothing)")
    print(_table(["schedule", "table row", "table bubble ms", "bubble theory", "replayed", "wall clock",
                  "params/rank (measured) / 1F1B", "act. in flight (stages)", "table act.",
                  "act. peak KB (measured)", "max |ours - ref|"],
                 [[r["schedule"], r["table_method"] or "-",
                   "-" if r["table_bubble_s"] is None else f"{1e3 * r['table_bubble_s']:.1f}",
                   f"{r['bubble_theory']:.1%}", f"{r['bubble_replayed']:.1%}", f"{r['bubble_wall']:.1%}",
                   f"{r['params_over_1f1b']:.2f}x", f"{r['in_flight_stage_units']:g}",
                   "-" if r["table_activations"] is None else f"{r['table_activations']:g}",
                   f"{r['activations_peak_bytes_max'] / 1024:.0f}", f"{r['max_abs_diff']:.1e}"]
                  for r in rows]))
    print("    the table counts parameters and activations in one stage of its PP stages: DualPipe "
          "holds 2 of the pp stages (2x); DualPipeV's 2 chunks are half-stages (2 x 1/2 = 1x)")


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _table(headers, rows) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _print_dp(rows):
    print(f"(a) data parallel step time, median over its steps "
          f"(slowest rank; repeats per row in the JSON), {rows[0]['n_params']:,} params, global batch {rows[0]['batch']}, "
          f"buckets {rows[0]['bucket_mb']} MB; bucketed/DDP with its {RATIO_LEVEL:.0%} "
          f"bootstrap interval over {', '.join(str(r['repeats']) for r in rows)} steps")
    print(_table(["dp", "DDP ms", "ours bucketed ms", "ours naive ms", "bucketed/DDP",
                  "naive/DDP", "all-reduce overlapped ours (DDP)", "max |param diff|"],
                 [[r["dp"], f"{r['ddp_ms']:.1f}", f"{r['bucketed_ms']:.1f}",
                   f"{r['naive_ms']:.1f}", f"{r['bucketed_over_ddp']:.2f}" + _interval(r),
                   f"{r['naive_over_ddp']:.2f}",
                   f"{r['allreduce_overlapped']:.0%} ({r['ddp_allreduce_overlapped']:.0%})",
                   f"{r['max_param_diff_vs_ddp']:.1e}"]
                  for r in rows]))


def _interval(row, key: str = "bucketed_over_ddp_interval") -> str:
    lo_hi = row.get(key)  # absent from runs saved before it was measured
    return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})" if lo_hi else ""


def _print_ring(rows):
    print(f"(b) all-reduce on {rows[0]['world_size']} ranks, median over the repeats "
          f"(slowest rank; {', '.join(str(r['repeats']) for r in rows)} repeats); bus bandwidth "
          f"= 2(N-1)/N * S / time; ring/gloo with its {RATIO_LEVEL:.0%} bootstrap interval")
    print(_table(["size MB", "ring ms", "gloo ms", "ring GB/s", "gloo GB/s", "ring/gloo bw",
                  "max |ring - gloo|"],
                 [[r["mb"], f"{1e3 * r['ring_s']:.1f}", f"{1e3 * r['gloo_s']:.1f}",
                   f"{r['ring_busbw_GBps']:.2f}", f"{r['gloo_busbw_GBps']:.2f}",
                   f"{r['ring_over_gloo_bw']:.2f}" + _interval(r, "ring_over_gloo_bw_interval"),
                   f"{r['max_abs_err']:.1e}"] for r in rows]))
    lat, n = rows[0]["step_latency_s"], rows[0]["world_size"]
    print(f"    latency (measured, medians of 20 calls back to back): our whole ring on {n} floats "
          f"(one per chunk: 2(N-1) messages of 4 B, its floor) {1e3 * lat['ours_ring_floor']:.2f} "
          f"ms, gloo's all-reduce of 4 B {1e3 * lat['gloo_all_reduce_4B']:.2f} ms. One step alone "
          f"(sendrecv) {1e3 * lat['ours_step']:.2f} ms, this thread's CPU "
          f"{1e6 * lat['ours_step_cpu']:.0f} us (bare irecv + isend {1e3 * lat['bare_step']:.2f} ms, "
          f"CPU {1e6 * lat['bare_step_cpu']:.0f} us: the metering costs the difference). Our ring posts "
          f"every receive before its first send (ring_all_reduce says why); gloo's cuts each chunk "
          f"into segments and posts each receive two segments ahead, in C++ threads that cost "
          f"no Python")


def _print_zero(rows):
    print("(c) ZeRO step time, median over the steps (slowest rank)")
    print(_table(["dp", "ours", "ms", "peer", "ms", "ours/peer", "ours without prefetch ms"],
                 [[r["dp"], f"ZeRO-{r['stage']}", f"{r['ours_ms']:.1f}", r["peer"],
                   f"{r['peer_ms']:.1f}", f"{r['ours_over_peer']:.2f}",
                   f"{r['no_prefetch_ms']:.1f}" if "no_prefetch_ms" in r else "-"] for r in rows]))


def _print_tp(rows):
    print(f"(d) tensor parallel (sp: with sequence parallel) step time, median over the "
          "steps (slowest rank)")
    for sp, note in TP_NOTES.items():
        print(f"    sp={'yes' if sp else 'no'}: {note}")
    print(_table(["tp", "sp", "ours ms", "DTensor ms", "ours/DTensor", "DTensor vocab ms",
                  "ours/DTensor vocab"],
                 [[r["tp"], "yes" if r.get("sp") else "no", f"{r['ours_ms']:.1f}",
                   f"{r['dtensor_ms']:.1f}", f"{r['ours_over_dtensor']:.2f}",
                   f"{r['dtensor_vocab_ms']:.1f}" if "dtensor_vocab_ms" in r else "-",
                   f"{r['ours_over_dtensor_vocab']:.2f}" if "dtensor_vocab_ms" in r else "-"]
                  for r in rows]))


def _print_pp(rows):
    r0 = rows[0]
    print(f"(e) pipeline parallel step time, median over the steps (slowest rank), "
          f"{r0['layers']} layers, global batch {r0['batch']}, {r0['microbatches']} micro-batches; "
          f"torch = torch.distributed.pipelining on the same chunks; messages = sends per step "
          f"over all ranks (counted)")
    print(_table(["pp", "schedule", "ours ms", "torch", "torch ms", "ours/torch", "|loss diff|",
                  "messages ours/torch"],
                 [[r["pp"], r["schedule"], f"{r['ours_ms']:.1f}", r["torch_schedule"],
                   f"{r['torch_ms']:.1f}", f"{r['ours_over_torch']:.2f}",
                   f"{r['last_loss_diff']:.1e}",
                   "{ours}/{torch}".format(**r["messages_per_step"])] for r in rows]))
    print("    ours, where a step's wall time goes on its slowest rank (median ms, from the "
          "runner's own timeline; other = between ops and the optimizer step)")
    print(_table(["pp", "schedule", "compute", "send", "wait", "other"],
                 [[r["pp"], r["schedule"], *(f"{_slowest_split(r)[k]:.1f}"
                                             for k in ("compute", "send", "wait", "other"))]
                  for r in rows]))


def _slowest_split(row) -> dict:
    """The split of the rank whose step took longest (compute + send + wait + other)."""
    return max(row["ours_split_ms"], key=lambda s: sum(s.values()))


def _print_bubble(rows):
    from .trace import GAP_PARTS
    r0 = rows[0]
    print(f"(f) pipeline bubble against the formula: measured (wall clock) and replayed (measured op "
          f"times, own-device schedule), {r0['steps']} steps, {r0['repeats']} runs each")
    print(_table(["pp", "m", "schedule", "cores", "formula", "wall clock (each run)", "median",
                  "within 5", "replayed (each run)", "median", "within 3", "max |ours - ref|"],
                 [[r["pp"], r["microbatches"], r["schedule"],
                   {False: "own", True: "shared", None: "?"}[r["ranks_shared_cores"]],
                   f"{r['runs'][0]['theory']:.1%}",
                   " ".join(f"{x['wall']:.1%}" for x in r["runs"]), f"{r['wall_median_points']:+.1f}",
                   f"{r['wall_within_5_points']}/{r['repeats']}",
                   " ".join(f"{x['replayed']:.1%}" for x in r["runs"]),
                   f"{r['replayed_median_points']:+.1f}",
                   f"{r['replayed_within_3_points']}/{r['repeats']}", f"{r['max_abs_diff']:.1e}"]
                  for r in rows]))
    print("    cores: own = each rank pinned to a core of its own, shared = more ranks than cores; "
          "zb's formula takes each run's measured F, B, W costs")
    print("  wall clock minus formula, what it is made of (trace.wall_gap; points, medians over runs)")
    print(_table(["pp", "m", "schedule", *GAP_PARTS.values(), "p2p latency ms", "op CPU/wall (min)"],
                 [[r["pp"], r["microbatches"], r["schedule"]]
                  + [f"{r['gap_median_points'][k]:+.1f}" for k in GAP_PARTS]
                  + ["-" if r["p2p_latency_median_s"] is None else f"{1e3 * r['p2p_latency_median_s']:.2f}",
                     f"{r['op_cpu_over_wall_min']:.0%}"] for r in rows]))


def _print_warm(w):
    print("warm path: a repeated live run, measured on this machine (cores shared with whatever "
          "else runs: see the load average)")
    print(_table(["live run", "repeats", "p50 s", "p90 s", "first call s"],
                 [[r["run"], r["repeats"], f"{r['p50_s']:.2f}", f"{r['p90_s']:.2f}",
                   f"{r['first_s']:.2f}"] for r in w["rows"]]))


# ---------------------------------------------------------------------------------------------
# (g) context parallel: our ring attention vs torch's, and how much K/V transfer hid behind compute
# ---------------------------------------------------------------------------------------------
def _cp_rank(impl: str, shape: tuple, warmup: int, steps: int) -> dict:
    """Attention forward + backward on this rank's tokens, ours and torch's, on the same inputs."""
    from types import SimpleNamespace

    from ..parallel.context import RingAttentionCore, hidden_fraction, positions_of
    from .peers import torch_ring_attention
    c, r = dist.get_world_size(), dist.get_rank()
    layout = "zigzag" if impl == "zigzag" else "contiguous"
    comm = Comm(build_mesh(SimpleNamespace(dp=1, tp=1, pp=1, cp=c, ep=1, dp_shard=0, world_size=c)))
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(*shape, generator=g) for _ in range(4))  # [b, a, s, d]
    pos = positions_of(layout, shape[2], c, r)
    q, k, v, grad = (t[:, :, pos].contiguous() for t in (q, k, v, grad))  # [b, a, s/C, d]
    core = RingAttentionCore(comm, "cp", layout)

    def ours():
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        core(*mine).backward(grad)
        comm.records.clear()

    def peer():
        torch_ring_attention(q, k, v, grad, dist.group.WORLD, load_balance=impl == "zigzag")

    times, hidden = {"ours": [], "torch": []}, []
    repeats, i = Repeats(steps), 0
    while i < warmup or repeats.more(times.values()):
        i += 1
        for name, fn in ((("ours", ours), ("torch", peer)) if i % 2 else
                         (("torch", peer), ("ours", ours))):  # neither always first
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            elapsed = _slowest_rank(time.perf_counter() - t0)
            if i > warmup:
                times[name].append(elapsed)
        if i > warmup:
            hidden.append(hidden_fraction(core.hops))
    return {"times": times, "hidden": hidden, "split_ms": _tile_split(core, q, k, v, grad)}


def _fastest_ms(fn, repeats: int = 7) -> float:
    """The fastest of `repeats` calls, in ms: on a loaded machine the least disturbed one."""
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def _tile_split(core, q, k, v, grad) -> dict:
    """Where one tile's time goes (ms, the fastest of 7 calls, on this rank; the ranks run this at the same time,
    as they run the ring): the written-out tile's steps (score matmul, the causal mask built and
    applied, log-sum-exp + exp, the P @ V matmul; backward's recomputed P and its four matmuls),
    the fused tile (torch's flash kernel, forward and backward), the online-softmax merge, the copy
    of K and V into one message, and posting one hop's send and receive (the calls returning, not
    the transfer) against the whole hop (post to arrival)."""
    import math

    from ..parallel import context
    size = q.shape[2] // len(context.chunks_of(core.layout, core.c, core.rank))
    qt, kt, vt, dot = (t[:, :, :size] for t in (q, k, v, grad))  # one chunk: [b, a, size, d]
    scores = qt @ kt.transpose(-2, -1) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, -1)
    out = (scores - lse.unsqueeze(-1)).exp() @ vt
    fused_fw, fused_bw = context._FUSED["cpu"]
    split = {
        "score matmul": _fastest_ms(lambda: qt @ kt.transpose(-2, -1) / math.sqrt(q.shape[-1])),
        "causal mask": _fastest_ms(lambda: scores.masked_fill(
            ~torch.ones(size, size, dtype=torch.bool).tril(), float("-inf"))),
        "lse + exp": _fastest_ms(lambda: (scores - torch.logsumexp(scores, -1).unsqueeze(-1)).exp()),
        "P @ V": _fastest_ms(lambda: scores @ vt),
        "written-out backward": _fastest_ms(lambda: _written_backward(context, dot, qt, kt, vt,
                                                                     out, lse)),
        "fused forward": _fastest_ms(lambda: fused_fw(qt, kt, vt, is_causal=False)),
        "fused backward": _fastest_ms(lambda: fused_bw(dot, qt, kt, vt, out, lse, 0.0, False)),
        "merge": _fastest_ms(lambda: context._merge(out, lse, out, lse)),
        "K/V copy": _fastest_ms(lambda: torch.stack([k, v])),
    }
    kv = torch.stack([k, v])
    post, hop_ms = [], []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        hop = core._send(kv, 0, "kv", core._receive(kv, 0, "kv")[1])
        post.append(time.perf_counter() - t0)
        hop.wait()
        hop_ms.append(time.perf_counter() - t0)
    core.comm.records.clear()
    split["post send+recv"] = 1e3 * statistics.median(post)
    split["whole hop"] = 1e3 * statistics.median(hop_ms)
    return split


def _written_backward(context, grad_out, q, k, v, out, lse):
    """The written-out tile backward (context._tile_grads without the fused kernel)."""
    fused, context._FUSED = context._FUSED, {}
    try:
        return context._tile_grads(grad_out, q, k, v, out, lse, False)
    finally:
        context._FUSED = fused


def bench_cp(cps=(2, 4), impls=("ring", "zigzag"), shape=(4, 8, 512, 32), warmup: int = 2,
             steps: int = 6) -> list[dict]:
    rows = []
    for c in cps:
        for impl in impls:
            res = run_ranks(_cp_rank, c, impl, shape, warmup, steps, timeout=600,
                            backend="gloo")[0].value
            ours, peer = (statistics.median(res["times"][k]) for k in ("ours", "torch"))
            rows.append({"cp": c, "impl": impl, "ours_ms": 1e3 * ours, "torch_ms": 1e3 * peer,
                         "ours_over_torch": ours / peer,
                         "kv_hidden": statistics.median(res["hidden"]), "shape": list(shape),
                         "split_ms": res["split_ms"],  # rank 0's
                         **_verdict(res["times"]["ours"], res["times"]["torch"])})
    return rows


def _print_cp(rows):
    print("(g) context parallel: attention forward + backward on each rank's s/C tokens, ours vs "
          "torch's ring attention (private template); kv_hidden = share of each forward hop's "
          "time (post -> arrival) covered by computing the current block, measured")
    print(_table(["cp", "impl", "ours ms", "torch ms", "ours/torch", "kv hidden"],
                 [[r["cp"], r["impl"], f"{r['ours_ms']:.1f}", f"{r['torch_ms']:.1f}",
                   f"{r['ours_over_torch']:.2f}", f"{r['kv_hidden']:.0%}"] for r in rows]))
    parts = list(rows[0]["split_ms"])
    print(f"  where a tile's time goes (ms, fastest of 7 calls on rank 0 of each run; one query chunk against "
          f"one key chunk, [b, a, n, d] = {rows[0]['shape'][:2] + ['s/C or s/2C', rows[0]['shape'][3]]}): "
          "the written-out tile's steps, the fused tile (the ring's), the merge, copies, one hop")
    print(_table(["cp", "impl", *parts],
                 [[r["cp"], r["impl"], *(f"{r['split_ms'][k]:.2f}" for k in parts)] for r in rows]))


def _ep_split(report, rank: int, step: int) -> dict:
    """Seconds of one rank's step spent in the expert-parallel all-to-alls (by phase) and in the
    experts' compute (forward from the layer's log, backward from its autograd marks)."""
    r = report.ranks[rank]
    split = {"counts": 0.0, "dispatch": 0.0, "combine": 0.0, "experts": 0.0}
    for rec in r["comm"]:
        if rec["step"] == step and rec.get("layer") == "moe":
            split[rec["phase"]] += rec["end"] - rec["start"]
    moe = r.get("moe", {})
    split["experts"] += sum(e["compute_s"] for e in moe.get("log", []) if e["step"] == step)
    step_events = [e for e in r["events"] if e["step"] == step]
    t0, t1 = min(e["start"] for e in step_events), max(e["end"] for e in step_events)
    for marks in moe.get("backward_marks", {}).values():
        starts = [t for k, t in marks if k == "experts-backward-start" and t0 <= t <= t1]
        ends = [t for k, t in marks if k == "experts-backward-end" and t0 <= t <= t1]
        split["experts"] += sum(b - a for a, b in zip(starts, ends))
    split["step"] = t1 - t0
    return split


def bench_ep(eps=(2, 4), experts: int = 8, top_k: int = 2, steps: int = 8, batch: int = 16,
             d_model: int = 128) -> list[dict]:
    from ..runtime.launch import run
    rows = []
    for n in eps:
        row = {"ranks": n, "experts": experts, "top_k": top_k}
        for ep in (1, n):
            cfg = RunConfig(dp=n, ep=ep, experts=experts, top_k=top_k, steps=steps, batch=batch,
                            d_model=d_model, backend="gloo", timeout_s=600)
            report = run(cfg)
            measured = range(1, steps - 1)  # not the warm-up, not the metered last step
            splits = [[_ep_split(report, r, s) for r in range(n)] for s in measured]
            slowest = [max(x["step"] for x in per_rank) for per_rank in splits]
            key = "sharded" if ep > 1 else "replicated"
            row[f"{key}_ms"] = 1e3 * statistics.median(slowest)
            row[f"{key}_steps_measured"] = len(slowest)  # fixed: the engine's steps, not repeated
            row[f"{key}_stable"] = median_settled(slowest)
            row[f"{key}_split_ms"] = {k: 1e3 * statistics.median(x[k] for per in splits for x in per)
                                      for k in ("counts", "dispatch", "experts", "combine")}
            row[f"{key}_state_bytes"] = sum(report.ranks[0]["memory"][k]
                                            for k in ("params", "grads", "optimizer"))
            if ep > 1:
                row["a2a_bytes_per_step"] = report.moe_wire_bytes_per_step(0)
                row["a2a_uniform_formula"] = report.theory["ep_all_to_all_uniform"]
        row["sharded_over_replicated"] = row["sharded_ms"] / row["replicated_ms"]
        row["stable"] = row["sharded_stable"] and row["replicated_stable"]
        row["repeats"] = row["sharded_steps_measured"]
        rows.append(row)
    return rows


def _print_ep(rows):
    print("(h) expert parallel: step time with experts sharded over ep = N ranks vs replicated "
          "(ep 1) on the same N data-parallel ranks; per-rank medians of the step's all-to-alls "
          "and expert compute, measured; model states of rank 0")
    print(_table(["ranks", "ep 1 ms", "ep N ms", "N/1", "dispatch ms", "experts ms", "combine ms",
                  "counts ms", "states ep1 / epN", "a2a B/step (uniform formula)"],
                 [[r["ranks"], f"{r['replicated_ms']:.1f}", f"{r['sharded_ms']:.1f}",
                   f"{r['sharded_over_replicated']:.2f}",
                   f"{r['sharded_split_ms']['dispatch']:.1f}",
                   f"{r['sharded_split_ms']['experts']:.1f} ({r['replicated_split_ms']['experts']:.1f})",
                   f"{r['sharded_split_ms']['combine']:.1f}", f"{r['sharded_split_ms']['counts']:.1f}",
                   f"{r['replicated_state_bytes']:,} / {r['sharded_state_bytes']:,}",
                   f"{r['a2a_bytes_per_step']:,.0f} ({r['a2a_uniform_formula']:,.0f})"] for r in rows]))
    print("experts ms: sharded (replicated in brackets)")


WIRE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _wire_rank(sizes: list[int], repeats: int) -> list[dict]:
    """Each op on each size (bytes of the payload S, fp32), `repeats` times; the median ratio."""
    torch.set_num_threads(1)
    n = dist.get_world_size()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    rows = []
    for op in WIRE_OPS:
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            x = torch.ones(numel)
            out = torch.empty(numel // n) if op == "reduce_scatter" else torch.empty(numel)
            calls = {"all_reduce": lambda: comm.all_reduce(x, "dp"),
                     "all_gather": lambda: comm.all_gather(x, x[:numel // n].clone(), "dp"),
                     "reduce_scatter": lambda: comm.reduce_scatter(out, x, "dp"),
                     "all_to_all": lambda: comm.all_to_all(out, x, "dp"),
                     "broadcast": lambda: comm.broadcast(x, "dp", src=0)}
            ratios = []
            for _ in range(repeats):
                dist.barrier()
                calls[op]()
                rec = comm.records[-1]
                if rec["wire_bytes_model"]:
                    ratios.append(rec["wire_bytes_measured"] / rec["wire_bytes_model"])
            rec = comm.records[-1]
            rows.append({"op": op, "ranks": n, "payload_bytes": rec["payload_bytes"],
                         "model_bytes": rec["wire_bytes_model"], "written_bytes": rec["wire_bytes_measured"],
                         "written_over_model": statistics.median(ratios) if ratios else None})
    return rows


def bench_wire(world_sizes=(2, 4), sizes=(4 * 1024, 64 * 1024, MB, 16 * MB), repeats: int = 3
               ) -> list[dict]:
    rows = []
    for n in world_sizes:
        res = run_ranks(_wire_rank, n, list(sizes), repeats, timeout=600, backend="gloo")
        rows += [dict(r, rank=res_i.rank) for res_i in res[:2] for r in res_i.value]
    return rows


def bench_plan(ranks: int = 8, steps: int = 6, hardware_json: str | None = None,
               sample: int = 0) -> dict:
    """(j) Every memory class of layout the planner ranks for `ranks` ranks of the tiny GPT on this
    machine (or `sample` of them, evenly spaced along the ranking), run live
    (planner.validate_on_toy_runs): each rank's params/grads/optimizer bytes against the planner's
    prediction, and the planner's step time, predicted with the profile "this machine" measured
    here first (planner.measure_hardware; read from / written to `hardware_json` when given),
    against the measured one: predicted / measured per layout, Spearman's rank correlation (the
    timings are this machine's, with its cores shared). The assumed "cpu" profile's prediction
    is kept beside it."""
    from . import planner

    say = (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    hw = planner.measure_hardware(hardware_json, progress=say)

    def progress(row):
        print(f"  {row['layout']}: " + (row.get("error") or (
              f"states {'equal' if row['states_equal'] else 'DIFFER'}, step predicted "
              f"{1e3 * row['predicted_step_s']:.1f} ms, measured {1e3 * row['measured_step_s']:.1f} ms")),
              file=sys.stderr, flush=True)

    return planner.validate_on_toy_runs(gpus=ranks, steps=steps, progress=progress, hw=hw,
                                        sample=sample)


COMPUTE_OPS = ("forward", "backward", "F", "B", "W", "optimizer")  # timeline kinds: (j)'s compute
PLAN_GOAL = (0.7, 1.4)  # predicted / measured step time: issue 24's goal for most layouts


def _print_plan(res: dict):
    hw = res.get("hardware") or {}
    print(f"(j) the planner's {res['ranks']}-rank layouts of the tiny GPT, run here on "
          f"{res['cores']} cores: model states equal to the prediction on every rank in "
          f"{res['states_equal']} of {res['layouts'] - res['failed']} layouts"
          + (f" ({res['failed']} failed to run)" if res["failed"] else ""))
    if hw:
        print(f"    profile {hw['name']!r} ({hw['source']}): {hw['flops'] / 1e9:.1f} GFLOP/s per "
              f"core, {1e3 * hw['block_overhead_s']:.2f} ms fixed per block and micro-batch, "
              f"{1e6 * hw['latency_intra_s']:.0f} us per hop with a core per rank, "
              f"{1e6 * hw['shared_hop_s']:.0f} us x ranks/cores when shared, "
              f"{hw['intra_bw'] / 1e9:.2f} GB/s"
              + (f"; recompute +{1e3 * hw.get('full_recompute_block_s', 0):.2f} ms (full) / "
                 f"+{1e3 * hw.get('selective_recompute_block_s', 0):.2f} ms (selective) per block "
                 f"and micro-batch, optimizer step {1e3 * hw.get('optimizer_s', 0):.2f} ms over "
                 f"the whole model" if hw.get("optimizer_s") else ""))
    if hw.get("call_cpu_s"):
        shared = (f"; with {hw['shared_world']} ranks on the cores: tp {1e6 * hw['shared_call_cpu_s']:.0f}"
                  f", tp+sp {1e6 * hw['shared_sp_call_cpu_s']:.0f}, p2p "
                  f"{1e6 * hw['shared_p2p_call_cpu_s']:.0f}" if hw.get("shared_world") else "")
        print(f"    a comm call's own CPU, us (measured): tp {1e6 * hw['call_cpu_s']:.0f}, tp+sp "
              f"{1e6 * hw.get('sp_call_cpu_s', 0):.0f}, p2p {1e6 * hw['p2p_call_cpu_s']:.0f} with a "
              f"core per rank{shared}")
    if hw.get("links"):
        print("    links fitted per op at each world and group size measured, alpha us per hop "
              "(GB/s), charged to each call at its layout's world and its group's size: "
              + _links_table_line(hw["links"]))
    ran = [r for r in res["rows"] if "error" not in r]
    assumed = any("predicted_assumed_step_s" in r for r in ran)
    cpu = all("measured_cpu_s" in r for r in ran)
    kinds = all("measured_cpu_by_kind" in r for r in ran)

    def compute_cpu(r):  # the ops the compute term models: passes and optimizer steps
        return sum(v for k, v in r["measured_cpu_by_kind"].items() if k in COMPUTE_OPS)
    print(_table(["layout", "states = planner", "step predicted ms", "step measured ms",
                  "predicted/measured"]
                 + (["ops' CPU / cores ms", "predicted compute / that"] if cpu else [])
                 + (["compute ops' CPU / cores ms", "predicted compute / that"] if kinds else [])
                 + (["assumed-rates predicted ms"] if assumed else []),
                 [[r["layout"], "yes" if r["states_equal"] else "NO",
                   f"{1e3 * r['predicted_step_s']:.1f}", f"{1e3 * r['measured_step_s']:.1f}",
                   f"{r['predicted_step_s'] / r['measured_step_s']:.2f}"]
                  + ([f"{1e3 * r['measured_cpu_s'] / res['cores']:.1f}",
                      f"{r['predicted_compute_s'] * res['cores'] / r['measured_cpu_s']:.2f}"]
                     if cpu else [])
                  + ([f"{1e3 * compute_cpu(r) / res['cores']:.1f}",
                      f"{r['predicted_compute_s'] * res['cores'] / compute_cpu(r):.2f}"]
                     if kinds else [])
                  + ([f"{1e3 * r['predicted_assumed_step_s']:.1f}"] if assumed else [])
                  for r in ran]))
    if cpu:
        print("    ops' CPU / cores: every rank's CPU time in the step's ops (thread time, measured), "
              "summed, over the cores: the step if our ranks had the cores to themselves and "
              "never waited; other processes' load is not in it (the wall clock's step is)")
    if kinds:
        print(f"    compute ops: {', '.join(COMPUTE_OPS)} (the collectives tp, cp and ZeRO-3 "
              "call inside a pass, and the meters' hooks, included; the predicted compute holds "
              "every comm call's measured CPU); gloo's own threads' CPU is in neither column")
    lo, hi = PLAN_GOAL
    inside = sum(lo <= r["predicted_step_s"] / r["measured_step_s"] <= hi for r in ran)
    print(f"predicted/measured within {lo}-{hi}: {inside} of {len(ran)} layouts")
    rho = res["spearman_step_time"]
    print("Spearman's rank correlation, predicted vs measured step time: "
          + ("n/a (fewer than 3 layouts ran)" if rho is None else f"{rho:+.2f}"))
    if assumed and len(ran) > 2:
        from .planner import spearman
        rho0 = spearman([r["predicted_assumed_step_s"] for r in ran],
                        [r["measured_step_s"] for r in ran])
        print(f"    with the assumed rates (profile 'cpu'): {rho0:+.2f}")


def _links_table_line(table) -> str:
    """A profile's links table (links.fit_table rows) as one line: per world and group size, each
    op's alpha in us per hop and its bandwidth."""
    from . import links

    rows = links.table_rows(table)
    keys = sorted({(int(r[0]), int(r[1])) for r in rows})
    return "; ".join(f"{w} ranks" + (f" in groups of {g}" if g < w else "") + ": " + ", ".join(
        f"{op} {1e6 * a:.0f} ({1e-9 / b:.2f})" if b > 0 else f"{op} {1e6 * a:.0f} (inf)"
        for ww, gg, op, a, b in rows if (int(ww), int(gg)) == (w, g)) for w, g in keys)


def _print_wire(rows):
    print("(i) bytes written to sockets during each op (measured: /proc/self/io wchar, gloo's "
          "threads included) / the ring model's bytes for it; ranks 0 and 1 (a broadcast's root "
          "sends to every rank itself; the model's pipelined chain does not)")
    print(_table(["op", "ranks", "rank", "payload", "model B", "written B", "written/model"],
                 [[r["op"], r["ranks"], r["rank"], f"{r['payload_bytes']:,}", f"{r['model_bytes']:,}",
                   f"{r['written_bytes']:,}" if r["written_bytes"] is not None else "-",
                   f"{r['written_over_model']:.3f}" if r["written_over_model"] else "-"]
                  for r in rows]))


# ---------------------------------------------------------------------------------------------
# (m) this machine's links
# ---------------------------------------------------------------------------------------------
LINKS_EXAMPLE = ("all_reduce", 2 ** 30, 8)  # what one all-reduce of 1 GiB over 8 ranks takes


def bench_links(world: int = 2, max_mib: float = 64, repeats: int = 5) -> dict:
    from . import links

    sizes = [s for s in links.DEFAULT_SIZES if s <= max_mib * MB] or [4]
    res = links.measure_links(world, sizes, repeats=repeats, progress=lambda row: print(
        f"  {row['op']} {row['bytes']:,} B: median {1e6 * row['median_s']:.0f} us",
        file=sys.stderr, flush=True))
    return links_summary(res)


def links_summary(res: dict) -> dict:
    """measure_links' result with its fits (to the medians, and to the fastest repeats) and the
    LINKS_EXAMPLE all-reduce on the source material's links and on the fitted one."""
    from . import links

    res["fit"] = links.fit_alpha_beta(res)
    res["fit_fastest"] = links.fit_alpha_beta(res, stat="min_s")
    op, nbytes, n = LINKS_EXAMPLE
    res["example"] = {"op": op, "bytes": nbytes, "world": n,
                      "rows": links.interconnects(op, nbytes, n, fit=res["fit"]["all"])}
    return res


def _print_links(res: dict):
    from . import links

    n = res["world"]
    print(f"(m) this machine's links: {n} local gloo ranks on {res['cores']} cores (load "
          f"{res['load_before'][0]:.2f} -> {res['load_after'][0]:.2f}); median (fastest) of the "
          f"slowest rank's time per repeat, us (measured)")
    ops = list(dict.fromkeys(r["op"] for r in res["rows"]))
    by = {(r["op"], r["bytes"]): r for r in res["rows"]}
    sizes = sorted({r["bytes"] for r in res["rows"]})
    print(_table(["bytes"] + ops, [[f"{b:,}"] + [
        f"{1e6 * by[o, b]['median_s']:.0f} ({1e6 * by[o, b]['min_s']:.0f})" if (o, b) in by else "-"
        for o in ops] for b in sizes]))
    print("bytes: " + "; ".join(f"{o}: {links.PAYLOAD[o]}" for o in ops))
    small = [by[o, min(b for oo, b in by if oo == o)] for o in ops]
    if all("cpu_all_ranks_s" in r for r in small):
        print(f"the smallest message, median wall us beside every rank's CPU (gloo's threads "
              f"included) / {res['cores']} cores: " + ", ".join(
                  f"{r['op']} {1e6 * r['median_s']:.0f} / {1e6 * r['cpu_all_ranks_s'] / res['cores']:.0f}"
                  for r in small))
    print(f"alpha-beta fit, t = a alpha + b bytes beta with the ring's hop counts at N = {n} "
          "(least squares in relative error); alpha and beta are the link's, so the ops should "
          "agree:")
    rows = []
    for key, label in (("fit", "medians"), ("fit_fastest", "fastest")):
        for op, f in res[key].items():
            rows.append([label, op, "-" if f["a"] is None else f"{f['a']:g}",
                         "-" if f["b"] is None else f"{f['b']:.3g}", f"{1e6 * f['alpha_s']:.1f}",
                         f"{f['bandwidth_Bps'] / 1e9:.2f}", f"{100 * f['max_rel_err']:.0f}%"])
    print(_table(["fitted to", "op", "a", "b", "alpha us", "bandwidth GB/s", "max rel err"], rows))
    ex = res["example"]
    print(f"the source material's interconnect table (vendor figures, from the source material; "
          f"latency per hop assumed, not from it) and one {ex['op'].replace('_', '-')} of "
          f"{ex['bytes'] / 2 ** 30:g} GiB over {ex['world']} ranks on each (alpha-beta model: "
          f"theory; this machine's row: fitted to the medians above):")
    print(_table(["link", "as stated", "GB/s per direction", "latency us", "all-reduce ms"],
                 [[r["link"], r["stated"], f"{r['bandwidth_Bps'] / 1e9:.3g}",
                   f"{1e6 * r['latency_s']:.1f}", f"{1e3 * r['seconds']:.1f}"]
                  for r in ex["rows"]]))


# ---------------------------------------------------------------------------------------------
# (k) the app in a real browser
# ---------------------------------------------------------------------------------------------
APP_PAGES = ["ring", "data_parallel", "memory", "tensor", "pipeline", "long_sequences", "experts",
             "plan"]


@contextlib.contextmanager
def app_server(env: dict, log_path: str | None = None, start_timeout_s: float = 120.0):
    """A `streamlit run` of the app on a free port with `env` added to this environment; yields its
    URL; at the end the server, its forkserver and any rank (one process group) are killed. Its
    output goes to `log_path` (by default a temporary file), named when it fails to start."""
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile
    import urllib.request

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    streamlit = shutil.which("streamlit", path=str(Path(sys.executable).parent)) or "streamlit"
    if log_path is None:
        log_path = tempfile.NamedTemporaryFile(prefix="app_server_", suffix=".log",
                                               delete=False).name
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [streamlit, "run", "app/streamlit_app.py", "--server.address", "127.0.0.1",
             "--server.port", str(port), "--server.headless", "true",
             "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
            cwd=root, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
            start_new_session=True)  # its own process group: the ranks' forkserver goes with it
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not start: {Path(log_path).read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:  # nothing in it to keep: no graceful shutdown to wait for
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


_ALL_CHARTS_DRAWN = """() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
  return charts.length > 0 && charts.every(c => c.querySelector('svg, canvas'));
}"""


def _click_to_chart(page, url: str) -> tuple[float, str]:
    """Open `url` in a new session (a fresh load), press Run live, and time the click to the run's
    charts drawn: its status line says it is done, the script has finished, and every chart of the
    page has its SVG or canvas (pages that draw theory charts before any run would otherwise count
    those); (seconds, the run's status line)."""
    idle = '[data-testid="stApp"][data-test-script-state="notRunning"]'
    page.goto(url)
    button = page.get_by_role("button", name="Run live")
    button.wait_for(timeout=180_000)
    page.locator(idle).wait_for(timeout=180_000)
    t0 = time.perf_counter()
    button.click()
    status = page.locator('[data-testid="stExpander"] summary').filter(
        has_text=re.compile(r"done in|did not complete"))
    status.first.wait_for(timeout=300_000)
    page.locator(idle).wait_for(timeout=300_000)
    page.wait_for_function(_ALL_CHARTS_DRAWN, timeout=300_000)
    took = time.perf_counter() - t0
    line = " ".join(status.first.inner_text().split())
    return took, line[line.find(" ") + 1:] if line.startswith(("check ", "error ")) else line


def bench_app(pages=tuple(APP_PAGES), repeats: int = 5, width: int = 1440, height: int = 900,
              chromium: str = "/usr/bin/chromium") -> list[dict]:
    from playwright.sync_api import sync_playwright

    rows = []
    with app_server({"PARALLEL_MINI_WARM": "none"}) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium)
        try:
            for name in pages:
                ctx = browser.new_context(viewport={"width": width, "height": height})
                page = ctx.new_page()
                cold, cold_status = _click_to_chart(page, f"{url}/{name}")
                warm = []
                for _ in range(repeats):  # a new session each time, as a class's browsers are
                    page.close()
                    ctx.close()
                    ctx = browser.new_context(viewport={"width": width, "height": height})
                    page = ctx.new_page()
                    warm.append(_click_to_chart(page, f"{url}/{name}")[0])
                ctx.close()
                rows.append({"page": name, "cold_s": cold, "cold_status": cold_status,
                             "warm_s": warm, "warm_p50_s": _quantile(warm, 0.5),
                             "warm_p90_s": _quantile(warm, 0.9)})
        finally:
            browser.close()
    return rows


def _print_app(rows):
    print("(k) the app in chromium at its default controls: click -> the run's charts drawn")
    print(_table(["page", "cold s", "warm p50 s", "warm p90 s", "cold press: the status line"],
                 [[r["page"], f"{r['cold_s']:.2f}", f"{r['warm_p50_s']:.2f}",
                   f"{r['warm_p90_s']:.2f}", r["cold_status"]] for r in rows]))


# ---------------------------------------------------------------------------------------------
# (l) a straggler: synchronous data parallel waits for it, asynchronous SGD does not
# ---------------------------------------------------------------------------------------------
def _smoothed(losses: list[float], window: int) -> list[float]:
    """Mean of the last `window` losses at each point: the same number of samples (one global
    batch) behind a point of every run."""
    return [sum(losses[max(0, i + 1 - window):i + 1]) / min(window, i + 1)
            for i in range(len(losses))]


def _sync_curve(report) -> list[dict]:
    """Per step of a synchronous run: when rank 0's optimizer finished it (wall clock from the
    run's first op), samples so far, the global loss."""
    ends = {e["step"]: e["end"] for e in report.ranks[0]["events"] if e["kind"] == "optimizer"}
    batch = report.config["batch"]
    return [{"time": ends[s], "samples": (s + 1) * batch, "loss": loss}
            for s, loss in enumerate(report.losses)]


def _async_curve(report) -> list[dict]:
    a = report.extra["async"]
    smooth = _smoothed(report.losses, len(a["workers"]))
    return [{"time": u["time"], "samples": (i + 1) * a["samples_per_update"], "loss": loss}
            for i, (u, loss) in enumerate(zip(a["updates"], smooth))]


def _first_below(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["loss"] <= target), None)


def _at_samples(curve: list[dict], samples: int) -> float | None:
    """The curve's loss at the last point with at most `samples` samples."""
    before = [p["loss"] for p in curve if p["samples"] <= samples]
    return before[-1] if before else None


def async_runs(ranks: int, factor: float, steps: int, batch: int, seed: int, model: dict) -> dict:
    """The configurations `bench async` compares, by name: the straggler is the last rank."""
    slow = f"{ranks - 1}:{factor:g}"
    common = dict(dp=ranks, steps=steps, batch=batch, seed=seed, backend="gloo", timeout_s=600,
                  **model)
    return {
        "sync DP, straggler": RunConfig(**common, straggler=slow),
        "async K=0, straggler": RunConfig(**common, straggler=slow, asynchronous=True,
                                          max_staleness=0),
        "async, straggler": RunConfig(**common, straggler=slow, asynchronous=True),
        "sync DP": RunConfig(**common),
        "async": RunConfig(**common, asynchronous=True),
    }


def bench_async(ranks: int = 4, factor: float = 3.0, steps: int = 12, batch: int = 48,
                seed: int = 0, target: float | None = None, model: dict | None = None) -> dict:
    """Each configuration of `async_runs` once, through the engine; per run: steps (updates) and
    samples per second on the wall clock (measured), the loss against samples and against time,
    the staleness counted from the server's records beside theory's; for the asynchronous runs the
    same updates replayed in one process without staleness (each gradient on the current
    version: what staleness cost, at equal samples). The target loss, unless given, is the
    highest final smoothed loss of the runs, so that every run reaches it."""
    from ..runtime.launch import run
    from ..parallel.async_ps import worker_batch
    from ..reference import replay_updates
    # 16 sequences of 64 tokens per worker step: compute, not the 0.9 MB messages, sets the pace
    model = model if model is not None else dict(layers=2, d_model=64, heads=4, seq=64, vocab=128)
    rows = []
    for name, cfg in async_runs(ranks, factor, steps, batch, seed, model).items():
        report = run(cfg.validate())
        row = {"run": name, "config": {k: v for k, v in cfg.to_dict().items()
                                       if k in ("dp", "steps", "batch", "straggler",
                                                "asynchronous", "max_staleness")}}
        if cfg.asynchronous:
            a = report.extra["async"]
            curve = _async_curve(report)
            fresh, _ = replay_updates(cfg, a["updates"], worker_batch, fresh=True)
            window = len(a["workers"])
            row["no_staleness_curve"] = [  # computed: one process, same batches, same order
                {"samples": p["samples"], "loss": x}
                for p, x in zip(curve, _smoothed(fresh, window))]
            row.update(workers=len(a["workers"]), staleness_mean=a["staleness_mean"],
                       staleness_theory=a["theory"]["mean"],
                       staleness_mean_by_worker=a["staleness_mean_by_worker"],
                       staleness_histogram=a["staleness_histogram"],
                       updates_per_worker=a["updates_per_worker"], max_abs_diff=None)
            wall = a["updates"][-1]["time"]
        else:
            curve = _sync_curve(report)
            row["workers"] = cfg.dp
            first = min(e["start"] for e in report.ranks[0]["events"])
            wall = curve[-1]["time"] - first
            for p in curve:
                p["time"] -= first
        row.update(curve=curve, wall_s=wall, updates=len(curve),
                   updates_per_s=len(curve) / wall, samples_per_s=curve[-1]["samples"] / wall)
        rows.append(row)
    target = target if target is not None else max(r["curve"][-1]["loss"] for r in rows)
    for r in rows:
        hit = _first_below(r["curve"], target)
        r["time_to_target_s"] = hit and hit["time"]
        r["samples_to_target"] = hit and hit["samples"]
        total = r["curve"][-1]["samples"]
        r["loss_at_samples"] = {str(n): _at_samples(r["curve"], n)
                                for n in (total // 4, total // 2, total)}
        if "no_staleness_curve" in r:
            r["no_staleness_at_samples"] = {str(n): _at_samples(r["no_staleness_curve"], n)
                                            for n in (total // 4, total // 2, total)}
    workers = ranks - 1
    return {"ranks": ranks, "straggler_factor": factor, "target_loss": target, "runs": rows,
            "theory": {  # compute proportional to batch, no overheads
                "async_over_sync_samples_per_s": (factor * (workers - 1) + 1) / ranks,
                "staleness": theory.async_staleness(workers, factor)}}


def _print_async(res: dict):
    print(f"(l) a {res['straggler_factor']:g}x straggler on {res['ranks']} ranks (the last): "
          f"synchronous DP ({res['ranks']} ranks compute, one update per step) against "
          f"asynchronous SGD (rank 0 serves, {res['ranks'] - 1} workers push). Measured wall "
          f"clock; loss smoothed over one global batch; target loss {res['target_loss']:.3f}")
    total = str(res["runs"][0]["curve"][-1]["samples"])
    print(_table(["run", "updates/s", "samples/s", "s to target", "samples to target",
                  f"loss at {total} samples", "no staleness (same updates)", "staleness mean "
                  "(theory)", "updates per worker"],
                 [[r["run"], f"{r['updates_per_s']:.1f}", f"{r['samples_per_s']:.1f}",
                   "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}",
                   r["samples_to_target"] or "-", f"{r['loss_at_samples'][total]:.3f}",
                   f"{r['no_staleness_at_samples'][total]:.3f}" if "no_staleness_at_samples" in r
                   else "", f"{r['staleness_mean']:.2f} ({r['staleness_theory']})"
                   if "staleness_mean" in r else "",
                   " ".join(f"{k}:{v}" for k, v in r.get("updates_per_worker", {}).items())]
                  for r in res["runs"]]))
    print(f"theory: async/sync samples per second with the straggler = (F(W-1)+1)/N = "
          f"{res['theory']['async_over_sync_samples_per_s']:.2f} (compute proportional to batch, "
          f"no overheads); expected staleness without a bound: W-1 = {res['ranks'] - 2} on "
          f"average, the straggler's F(W-1) = {res['theory']['staleness']['straggler']:g}")


# ---------------------------------------------------------------------------------------------
# bench all, and a later run compared with an earlier one
# ---------------------------------------------------------------------------------------------
# Per section: a row's name, and the ratios to follow with the direction that is better. A ratio
# within one run (ours / peer, both measured in the same launch) survives a change of load far
# better than a time does, so that is what a comparison reads.
COMPARED = {
    "dp": (lambda r: f"dp {r['dp']}", [("bucketed/DDP", "bucketed_over_ddp", "lower"),
                                       ("naive/DDP", "naive_over_ddp", "lower"),
                                       ("all-reduce overlapped", "allreduce_overlapped", "higher")]),
    "ring": (lambda r: f"{r['world_size']} ranks {r['mb']:g} MB",
             [("ring/gloo bus bw", "ring_over_gloo_bw", "higher")]),
    "zero": (lambda r: f"dp {r['dp']} ZeRO-{r['stage']}", [("ours/peer", "ours_over_peer", "lower")]),
    "tp": (lambda r: f"tp {r['tp']} sp {'yes' if r['sp'] else 'no'}",
           [("ours/DTensor", "ours_over_dtensor", "lower"),
            ("ours/DTensor vocab", "ours_over_dtensor_vocab", "lower")]),
    "pp": (lambda r: f"pp {r['pp']} {r['schedule']}", [("ours/torch", "ours_over_torch", "lower")]),
    "cp": (lambda r: f"cp {r['cp']} {r['impl']}", [("ours/torch", "ours_over_torch", "lower")]),
    "ep": (lambda r: f"{r['ranks']} ranks", [("ep N/ep 1", "sharded_over_replicated", "lower")]),
    "bubble": (lambda r: f"pp {r['pp']} m {r['microbatches']} {r['schedule']}",
               [("wall - formula (points)", "wall_median_points", "abs"),
                ("replayed - formula (points)", "replayed_median_points", "abs")]),
}
ALL_SECTIONS = tuple(COMPARED) + ("links",)  # `bench all` (not app, warm, wire, plan, async, dualpipe)
WORSE_BY = 0.10  # a ratio 10 % worse (points: 3 points further from the formula) is flagged


def compare(old: dict, new: dict) -> list[dict]:
    """Each row and ratio of COMPARED in the sections both results ran: then, now, now / then
    (points: now - then) and "worse" / "better" past WORSE_BY. A row in only one of them is
    listed as "new" or "gone"."""
    rows = []
    for section, (name_of, metrics) in COMPARED.items():
        if section not in old or section not in new:
            continue
        then = {name_of(r): r for r in old.get(section) or []}
        now = {name_of(r): r for r in new.get(section) or []}
        for name in list(then) + [n for n in now if n not in then]:
            for label, key, better in metrics:
                a = then.get(name, {}).get(key)
                b = now.get(name, {}).get(key)
                if a is None and b is None:
                    continue  # a ratio this row does not have (tp: the vocab peer, sp off only)
                row = {"section": section, "row": name, "ratio": label, "then": a, "now": b,
                       "change": None, "verdict": "" if a is not None and b is not None
                       else ("new" if a is None else "gone")}
                if a is not None and b is not None:
                    if better == "abs":  # points off a formula: further from 0 is worse
                        row["change"] = b - a
                        worse, gain = abs(b) - abs(a) > 100 * WORSE_BY / 3, abs(a) - abs(b) > 100 * WORSE_BY / 3
                    else:
                        row["change"] = b / a if a else float("inf")
                        up = row["change"] > 1 + WORSE_BY
                        down = row["change"] < 1 - WORSE_BY
                        worse, gain = (up, down) if better == "lower" else (down, up)
                    row["verdict"] = "WORSE" if worse else "better" if gain else ""
                rows.append(row)
    return rows


def _print_compare(rows: list[dict], old_path: str, old: dict, new: dict):
    def num(x):
        return "-" if x is None else f"{x:.2f}"

    print(f"compared with {old_path} (ratios within each run; WORSE / better: past "
          f"{WORSE_BY:.0%}, or 3 points for the bubble)")
    for label, a, b in (("only then", old, new), ("only now", new, old)):
        alone = [s for s in COMPARED if s in a and s not in b]
        if alone:
            print(f"    sections {label} (not compared): {', '.join(alone)}")
    print(_table(["section", "row", "ratio", "then", "now", "now/then (points: now-then)", ""],
                 [[r["section"], r["row"], r["ratio"], num(r["then"]), num(r["now"]),
                   "-" if r["change"] is None else (f"{r['change']:+.1f}" if "points" in r["ratio"]
                                                    else f"{r['change']:.2f}x"), r["verdict"]]
                  for r in rows]))
    worse = [f"{r['section']} {r['row']} {r['ratio']}" for r in rows if r["verdict"] == "WORSE"]
    print(f"{len(worse)} worse: " + "; ".join(worse) if worse else "none worse")


def _stability_line(section: str, rows) -> str | None:
    """Which rows' medians settled, for the sections that repeat (COMPARED's row names)."""
    if section not in COMPARED or not isinstance(rows, list) or not rows or "stable" not in rows[0]:
        return None
    name_of = COMPARED[section][0]
    bad = [f"{name_of(r)} ({r.get('repeats', r.get('steps_measured', '?'))} repeats)"
           for r in rows if not r["stable"]]
    rule = (f"median moved < {STABLE_TOL:.0%} over the last {STABLE_LAST} repeats")
    if section == "dp":  # its judged ratio repeats for longer (RatioRepeats)
        rule = (f"bucketed/DDP's {RATIO_LEVEL:.0%} interval within +-{RATIO_TOL:.0%} of it, "
                f"naive's {rule}")
    if section == "ring":
        rule = f"ring/gloo's {RATIO_LEVEL:.0%} interval within +-{RATIO_TOL:.0%} of it"
    return (f"    stable ({rule}): every row" if not bad else
            f"    NOT stable ({rule} not reached at the cap): " + ", ".join(bad))


# Issue 25's goals, each a test of one row: the verdict line under a table, and "goals" in the JSON.
# pp: the goal names interleaved 1F1B (the other schedules are shown beside it, not judged).
# zero, tp, ep: the issue asks to keep them ahead of their peers, so the line says which are not.
GOALS = {
    "dp": ("bucketed/DDP <= 1.05 and all-reduce overlapped >= DDP's, every dp",
           lambda r: r["bucketed_over_ddp"] <= 1.05
           and r["allreduce_overlapped"] >= r["ddp_allreduce_overlapped"],
           lambda r: f"{r['bucketed_over_ddp']:.2f}, {r['allreduce_overlapped']:.0%} "
                     f"({r['ddp_allreduce_overlapped']:.0%})"),
    "ring": ("ring/gloo bus bandwidth >= 0.8 from 64 KB up",
             lambda r: r["mb"] < 0.0625 or r["ring_over_gloo_bw"] >= 0.8,
             lambda r: f"{r['ring_over_gloo_bw']:.2f}" + _at_the_floor(r)),
    "pp": ("interleaved ours/torch <= 1.0 at every pp",
           lambda r: r["schedule"] != "interleaved" or r["ours_over_torch"] <= 1.0,
           lambda r: f"{r['ours_over_torch']:.2f}"),
    "cp": ("ours/torch <= 1.0, every cp and layout", lambda r: r["ours_over_torch"] <= 1.0,
           lambda r: f"{r['ours_over_torch']:.2f}"),
    "zero": ("ours/peer < 1.0 (ahead), every row", lambda r: r["ours_over_peer"] < 1.0,
             lambda r: f"{r['ours_over_peer']:.2f}"),
    "tp": ("ours/DTensor < 1.0 (ahead), every row", lambda r: r["ours_over_dtensor"] < 1.0,
           lambda r: f"{r['ours_over_dtensor']:.2f}" + (
               f" (DTensor with our vocabulary split: {r['ours_over_dtensor_vocab']:.2f})"
               if "ours_over_dtensor_vocab" in r else "")),
    "ep": ("ep N/ep 1 < 1.0, every row", lambda r: r["sharded_over_replicated"] < 1.0,
           lambda r: f"{r['sharded_over_replicated']:.2f}"),
}


# The goals judged on a median ratio that also carry its interval: (the row's interval key, the
# goal's bound, whether the goal is at most (+1) or at least (-1) the bound, which rows the goal
# judges). A row met on its median whose interval reaches past the bound is said so.
GOAL_INTERVALS = {"dp": ("bucketed_over_ddp_interval", 1.05, +1, lambda r: True),
                  "ring": ("ring_over_gloo_bw_interval", 0.8, -1, lambda r: r["mb"] >= 0.0625)}


def _interval_past(row, section: str) -> bool:
    if section not in GOAL_INTERVALS:
        return False
    key, bound, side, judged = GOAL_INTERVALS[section]
    lo_hi = row.get(key)
    return judged(row) and bool(lo_hi) and (lo_hi[1] > bound if side > 0 else lo_hi[0] < bound)


def _at_the_floor(row) -> str:
    """Why a ring row may miss: its time is the latency floor, our whole ring on one float per
    chunk (2(N-1) messages of 4 B, measured in the same run: _step_latency), not bytes. Said when
    the ring took at most 1.25 x that floor."""
    lat, n = row.get("step_latency_s"), row.get("world_size", 0)
    if not lat or n < 2 or "ours_ring_floor" not in lat:
        return ""
    floor = lat["ours_ring_floor"]
    if row["ring_s"] > 1.25 * floor:
        return ""
    return (f" (latency-bound: {1e3 * row['ring_s']:.1f} ms, at most 1.25 x its floor, the ring "
            f"on one float per chunk: {1e3 * floor:.1f} ms)")


def goal_verdict(section: str, rows) -> dict | None:
    """The goal of `section` (GOALS) judged on these rows: {"goal", "met", "missed": [row: value]},
    and "unsettled": the missed rows whose medians had not settled (a verdict they may not keep)."""
    if section not in GOALS or not isinstance(rows, list) or not rows:
        return None
    goal, ok, shown = GOALS[section]
    name_of = COMPARED[section][0]
    missed = [r for r in rows if not ok(r)]
    key = GOAL_INTERVALS.get(section, (None,))[0]
    return {"goal": goal, "met": not missed,
            "missed": [f"{name_of(r)}: {shown(r)}" for r in missed],
            "unsettled": [name_of(r) for r in missed if not r.get("stable", True)],
            "interval_past_goal": [f"{name_of(r)}: {r[key][0]:.2f}-{r[key][1]:.2f}" for r in rows
                                   if ok(r) and _interval_past(r, section)]}


def _goal_line(verdict: dict) -> str:
    past = verdict.get("interval_past_goal")
    past = (f" (on its median; the {RATIO_LEVEL:.0%} interval reaches past the goal at "
            + "; ".join(past) + ")") if past else ""
    if verdict["met"]:
        return f"    goal (issue 25), {verdict['goal']}: met on every row{past}"
    unsettled = (f" (not settled: {', '.join(verdict['unsettled'])})"
                 if verdict["unsettled"] else "")
    return (f"    goal (issue 25), {verdict['goal']}: NOT met at " + "; ".join(verdict["missed"])
            + unsettled)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m parallel_mini.bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=["dp", "ring", "warm", "zero", "tp", "pp", "bubble",
                                                "cp", "ep", "wire", "plan", "app", "async",
                                                "dualpipe", "fb-overlap", "links", "all"],
                    help="all = " + ", ".join(ALL_SECTIONS) + " with fewer repeats (~10 min)")
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="dp degrees for (a)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per mode for (a)")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps first, for (a)")
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="ours and DDP's bucket size")
    ap.add_argument("--batch", type=int, default=16, help="global batch for (a)")
    ap.add_argument("--ring-ranks", type=int, default=4, help="world size for (b)")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[0.0625, 0.25, 1, 4, 16, 64],
                    help="for (b): 64 KB to 64 MB")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats for (b)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pp degrees for (e)")
    ap.add_argument("--pp-schedules", nargs="+", default=list(PP_SCHEDULES), choices=PP_SCHEDULES,
                    help="schedules for (e)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks for fb-overlap (f3)")
    ap.add_argument("--fb-repeats", type=int, default=15, help="interleaved rounds for fb-overlap")
    ap.add_argument("--warm-repeats", type=int, default=10, help="repeated runs for warm")
    ap.add_argument("--bubble-repeats", type=int, default=5, help="runs per schedule for (f)")
    ap.add_argument("--bubble-setups", nargs="+", default=["2x4", "4x8"], metavar="PxM",
                    help="pipeline ranks x micro-batches for (f)")
    ap.add_argument("--bubble-schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb"],
                    help="schedules for (f)")
    ap.add_argument("--app-repeats", type=int, default=5, help="warm presses per page for (k)")
    ap.add_argument("--app-pages", nargs="+", default=APP_PAGES, choices=APP_PAGES,
                    help="pages for (k)")
    ap.add_argument("--async-steps", type=int, default=12, help="steps (x batch samples) for (l)")
    ap.add_argument("--async-batch", type=int, default=48, help="global batch for (l): a "
                    "multiple of 12 (4 ranks, 3 workers)")
    ap.add_argument("--async-factor", type=float, default=3.0, help="the straggler's slowdown, (l)")
    ap.add_argument("--async-target", type=float, help="target loss for (l); default: the "
                    "highest final loss of its runs")
    ap.add_argument("--hardware-json", metavar="PATH", help="(j) plan: read the measured "
                    "'this machine' profile from PATH if it exists, else measure and write it")
    ap.add_argument("--plan-sample", type=int, default=0, metavar="N", help="(j) plan: run N of "
                    "the layout classes, evenly spaced along the ranking (default: all)")
    ap.add_argument("--world", type=int, default=2, help="local ranks for (m) links")
    ap.add_argument("--max-mib", type=float, default=64, help="largest message for (m) links, MiB")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON ('-' = stdout only)")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="OLD.json: after the run, each "
                    "row's ratios now against OLD's; OLD.json NEW.json without a benchmark: "
                    "compare two saved runs")
    return ap


def _sections(args) -> dict:
    """verb -> [(section name, how to run it, how to print it)]; `bench all` runs ALL_SECTIONS
    with the `quick` counts (its whole run in ~10 minutes on 2 idle cores)."""
    quick = args.what == "all"
    least = (lambda full, short: short if quick else full)
    setups = tuple(tuple(int(x) for x in setup.lower().split("x")) for setup in
                   (["2x4"] if quick and args.bubble_setups == ["2x4", "4x8"] else args.bubble_setups))
    return {
        "dp": [("dp", lambda: bench_dp(tuple(args.dp), least(args.warmup, 2),
                                       least(args.steps, 8), args.bucket_mb, args.batch), _print_dp)],
        "ring": [("ring", lambda: bench_ring(args.ring_ranks, tuple(args.sizes_mb),
                                             least(args.repeats, 3)), _print_ring)],
        "zero": [("zero", lambda: bench_zero(tuple(args.dp), least(3, 2), least(10, 4)), _print_zero)],
        "tp": [("tp", lambda: bench_tp(warmup=least(3, 2), steps=least(10, 4)), _print_tp)],
        "pp": [("pp", lambda: bench_pp(tuple(args.pp), tuple(args.pp_schedules),
                                       warmup=least(3, 2), steps=least(10, 4)),
                _print_pp)],
        "dualpipe": [("dualpipe", bench_dualpipe, _print_dualpipe),
                     ("fb_overlap", lambda: bench_fb_overlap(args.ranks, least(args.fb_repeats, 7)),
                      _print_fb_overlap)],
        "fb-overlap": [("fb_overlap", lambda: bench_fb_overlap(args.ranks, args.fb_repeats),
                        _print_fb_overlap)],
        "bubble": [("bubble", lambda: bench_bubble(tuple(args.bubble_schedules), setups,
                                                   least(args.bubble_repeats, 2)), _print_bubble)],
        "cp": [("cp", lambda: bench_cp(warmup=least(2, 1), steps=least(6, 4)), _print_cp)],
        "ep": [("ep", lambda: bench_ep(steps=least(8, 6)), _print_ep)],
        "wire": [("wire", bench_wire, _print_wire)],
        "plan": [("plan", lambda: bench_plan(hardware_json=args.hardware_json,
                                             sample=args.plan_sample), _print_plan)],
        "app": [("app", lambda: bench_app(tuple(args.app_pages), args.app_repeats), _print_app)],
        "async": [("async", lambda: bench_async(4, args.async_factor, args.async_steps,
                                                args.async_batch, target=args.async_target),
                   _print_async)],
        "warm": [("warm", lambda: bench_warm(args.warm_repeats), _print_warm)],
        "links": [("links", lambda: bench_links(args.world, least(args.max_mib, 16),
                                                least(args.repeats, 3)), _print_links)],
    }


def main(argv=None) -> int:
    from .planner import MeasurementError
    args = _parser().parse_args(argv)
    if args.what is None:
        if len(args.compare or []) != 2:
            print("bench: name a benchmark (dp, cp, ..., all), or give --compare OLD.json NEW.json "
                  "to compare two saved runs", file=sys.stderr)
            return 2
        old, new = (json.loads(Path(f).read_text()) for f in args.compare)
        _print_compare(compare(old, new), args.compare[0], old, new)
        return 0
    if args.what in ("links", "all") and not 2 <= args.world <= MAX_LOCAL_RANKS:
        print(f"bench: --world {args.world}: links need 2 to {MAX_LOCAL_RANKS} local ranks (e.g. "
              "--world 2)",
              file=sys.stderr)
        return 2
    if args.what in ("links", "all") and args.max_mib <= 0:
        print(f"bench: --max-mib {args.max_mib:g}: give a positive size in MiB (e.g. --max-mib 64)",
              file=sys.stderr)
        return 2
    if args.compare and len(args.compare) != 1:
        print("bench: --compare takes OLD.json when a benchmark runs (OLD.json NEW.json without "
              "one)", file=sys.stderr)
        return 2
    if args.compare and not Path(args.compare[0]).is_file():  # before minutes of benchmarks
        print(f"bench: --compare {args.compare[0]}: no such file", file=sys.stderr)
        return 2
    out = {"load_average_before": _load(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "what": args.what, "load_average": {}, "seconds": {}}
    to_stdout = args.json == "-"
    say = (lambda *a, **k: None) if to_stdout else print
    table = _sections(args)
    verbs = ALL_SECTIONS if args.what == "all" else (args.what,)
    if args.what == "dp":
        verbs = ("dp", "ring")  # (a) and (b)
    t0 = time.perf_counter()
    for verb in verbs:
        for name, run_it, show in table[verb]:
            before, t1 = _load(), time.perf_counter()
            say(f"[{name}] load average before {before[0]:.2f} {before[1]:.2f} {before[2]:.2f} "
                f"on {out['cpus']} CPUs", flush=True)
            try:
                out[name] = run_it()
            except MeasurementError as e:  # a measurement that cannot stand: said, not used
                print(f"bench {name}: {e}", file=sys.stderr)
                return 1
            after = _load()
            out["load_average"][name] = {"before": before, "after": after}
            out["seconds"][name] = time.perf_counter() - t1
            verdict = goal_verdict(name, out[name])
            if verdict:
                out.setdefault("goals", {})[name] = verdict
            if not to_stdout:
                show(out[name])
                line = _stability_line(name, out[name])
                if line:
                    print(line)
                if verdict:
                    print(_goal_line(verdict))
                print(f"[{name}] load average after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}; "
                      f"{out['seconds'][name]:.0f} s\n", flush=True)
    out["load_average_after"] = _load()
    out["wall_s"] = time.perf_counter() - t0
    if to_stdout:
        print(json.dumps(out, indent=1))
    else:
        print(f"load average before {out['load_average_before'][0]:.2f}, after "
              f"{out['load_average_after'][0]:.2f} on {out['cpus']} CPUs; {out['wall_s']:.0f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    if args.compare:
        old = json.loads(Path(args.compare[0]).read_text())
        _print_compare(compare(old, out), args.compare[0], old, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
