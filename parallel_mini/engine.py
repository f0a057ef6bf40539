"""One training run, composed from the parallel/ pieces for a RunConfig.

`train_rank` is what each rank executes: build the mesh, the model and the parallel wrapper, run the
steps while the meters watch, and return this rank's measurements. `run` launches the ranks (or,
under torchrun, is one of them) and merges the per-rank results into a RunReport.
Composition order, as it grows (torchtitan's order): TP/SP -> PP -> CP -> EP -> ZeRO/DP.
"""
from __future__ import annotations

import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .comm import Comm
from .config import RunConfig
from .data import global_batch, shard
from .launch import init_from_env, rank_device, run_ranks, under_torchrun
from .mesh import build_mesh
from .meters import ActivationMeter, LiveBytes, Timeline, model_state_bytes
from .model import build_model
from .optim import PARAM_DTYPE, make_optimizer
from .parallel.data import DataParallel, accumulate_grads_in_fp32
from .parallel.pipedream import PipeDreamRunner
from .parallel.pipeline import PipelineRunner, gather_stage_parameters
from .parallel.schedules import for_config
from .parallel.recompute import apply_checkpointing, backward
from .parallel.tensor import apply_tensor_parallel, gather_full_parameters
from .parallel.zero import ZeroDataParallel
from .parallel.zero3 import Zero3DataParallel
from .reference import max_abs_diff, train_reference
from .report import RunReport, merge_rank_results


class PlainDataParallel:
    """DataParallel plus its optimizer behind the same loop interface as the ZeRO strategies."""

    def __init__(self, model, comm, cfg, average_fn=None):
        self.model = model
        if cfg.fp32_grad_accum:
            accumulate_grads_in_fp32(model.parameters())
        self.dp = DataParallel(model, comm, mode=cfg.dp_mode, bucket_mb=cfg.bucket_mb,
                               average_fn=average_fn)
        self.optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
        self.sync = self.dp.sync
        self.finish_gradient_sync = self.dp.finish_gradient_sync
        self.zero_grad = self.optimizer.zero_grad
        self.step = self.optimizer.step

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        grads += [p.main_grad for p in params if hasattr(p, "main_grad")]
        return {"params": params, "grads": grads,
                "optimizer": self.optimizer.state_tensors()}

    def buffers(self) -> list[torch.Tensor]:
        """Transient-but-allocated-once buffers (the gradient buckets)."""
        return [b.flat for b in self.dp.buckets]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


def parallelize(model, comm, cfg, average_fn=None):
    """Apply the strategies for `cfg` (torchtitan's fixed order as topics land: TP/SP, PP, CP, EP,
    then data parallel last). Today: data parallel, plain or ZeRO stage 1/2/3."""
    dtype = PARAM_DTYPE[cfg.precision]
    if cfg.zero == 0:
        return PlainDataParallel(model, comm, cfg, average_fn)
    hybrid = 0 < cfg.dp_shard < cfg.dp  # FSDP's HYBRID_SHARD: shard in groups, replicate across
    axes = dict(shard_axis="dp_shard", replicate_axis="dp_rep") if hybrid else {}
    if cfg.zero in (1, 2):
        return ZeroDataParallel(model, comm, cfg.zero, cfg.optimizer, cfg.lr, dtype,
                                offload=cfg.offload, **axes)
    return Zero3DataParallel(model, comm, cfg.optimizer, cfg.lr, dtype, **axes)


def _mean_over_dp(value: float, mesh) -> float:
    """Global loss for the log: a metric, not training traffic, so it bypasses the comm records."""
    if mesh.size("dp") == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, group=mesh.groups["dp"])
    return t.item() / mesh.size("dp")


def _train_step(cfg, step, model, strategy, act, timeline, mesh, recompute) -> float:
    """Forward/backward over the grad-accumulation micro-batches, gradient sync, optimizer step."""
    dp_rank, dp_size, k = mesh.local_rank("dp"), mesh.size("dp"), cfg.grad_accum
    local = shard(global_batch(cfg, step), dp_rank, dp_size)  # [b/dp, s] x 2
    step_loss = 0.0
    strategy.zero_grad()
    for micro in range(k):
        x, y = (t.to(rank_device()) for t in shard(local, micro, k))  # [b/(dp*k), s]
        with strategy.sync(micro == k - 1):
            with timeline.op("forward", step, micro), act.forward():
                loss = model(x, y) / k  # mean over the micro-batch, scaled for accumulation
            with timeline.op("backward", step, micro):
                backward(loss, recompute)
        step_loss += loss.item()
    with timeline.op("grad_sync", step):
        strategy.finish_gradient_sync()
    with timeline.op("optimizer", step):
        strategy.step()
    return _mean_over_dp(step_loss, mesh)


def _pipeline_step(cfg, step, runner, strategy, timeline, mesh) -> float:
    """One step through the pipeline: the schedule's ops over m micro-batches, then (after the
    flush) gradient sync over dp and the optimizer step, as in _train_step."""
    local = shard(global_batch(cfg, step), mesh.local_rank("dp"), mesh.size("dp"))  # [b/dp, s] x 2
    m = cfg.microbatches
    micro = [shard(local, i, m) for i in range(m)]  # m x ([b/(dp*m), s] x 2)
    strategy.zero_grad()
    with strategy.sync(False):  # gradients accumulate over the micro-batches ...
        loss = runner.run(step, [x.to(rank_device()) for x, _ in micro],
                          [y.to(rank_device()) for _, y in micro])
    with timeline.op("grad_sync", step):  # ... and are averaged over dp after the flush
        strategy.finish_gradient_sync()
    if not isinstance(runner, PipeDreamRunner):  # PipeDream has updated after every backward
        with timeline.op("optimizer", step):
            strategy.step()
    return _mean_over_dp(_from_last_stage(loss, runner, mesh), mesh)


def _from_last_stage(value: float, runner, mesh) -> float:
    """The loss is known where the last chunk runs; a metric, so not a recorded collective."""
    t = torch.tensor([value], dtype=torch.float64, device=rank_device())
    src = mesh.global_rank("pp", runner.schedule.owner[-1])
    dist.broadcast(t, src, group=mesh.groups["pp"])
    return t.item()


def train_rank(cfg_dict: dict, init_seed_offset: int = 0, average_fn=None) -> dict:
    """Runs on every rank. `init_seed_offset` (tests) makes ranks initialise differently, to show
    that the start-up broadcast makes them agree anyway. `average_fn(params, comm)` replaces the
    naive mode's gradient averaging (a learner's exercise runs through here)."""
    cfg = RunConfig.from_dict(cfg_dict)
    mesh = build_mesh(cfg)
    comm, timeline = Comm(mesh), Timeline()
    device = rank_device()
    model = build_model(cfg, seed=cfg.seed + init_seed_offset * mesh.rank).to(device)
    recompute = apply_checkpointing(model, cfg.checkpointing)
    apply_tensor_parallel(model, comm, cfg.sp)  # TP first, then data parallel over the shards
    live = LiveBytes()
    act = ActivationMeter(live)
    runner = None
    if cfg.pp > 1:  # keeps this rank's stage only; data parallel then runs over its parameters
        if cfg.schedule.startswith("pipedream"):
            runner = PipeDreamRunner(model, comm, for_config(cfg), timeline, live,
                                     stash=cfg.schedule == "pipedream")
        else:
            runner = PipelineRunner(model, comm, for_config(cfg), timeline, live)
    strategy = parallelize(model, comm, cfg, average_fn)
    if runner is not None:
        runner.state_tensors = lambda: [t for ts in strategy.state_tensors().values() for t in ts]
        runner.optimizer = strategy.optimizer  # PipeDream steps it after every backward

    losses = []
    dist.barrier()  # line the ranks up so their timelines share a start
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        comm.step = step
        # The live-bytes meter slows every op ~4x, so it watches only the last step: by then every
        # state (optimizer moments included) exists, so that step holds the run's peak.
        metered = step == cfg.steps - 1
        if metered:
            states = strategy.state_tensors()
            live.add_existing(states["params"] + states["optimizer"] + _buffers(strategy))
        with live if metered else nullcontext():
            if runner is None:
                losses.append(_train_step(cfg, step, model, strategy, act, timeline, mesh, recompute))
            else:
                losses.append(_pipeline_step(cfg, step, runner, strategy, timeline, mesh))
        if cfg.extra.get("progress") and mesh.rank == 0:
            print(f"step {step + 1}/{cfg.steps}  loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t_start

    memory = model_state_bytes(strategy.state_tensors())
    memory["transient"] = _transient_bytes(strategy)
    memory["activations_peak"] = act.peak if runner is None else runner.peak_held
    memory["total_peak"] = live.peak
    comm.step = -1  # gathering for the comparison below is bookkeeping, not training traffic
    full = strategy.full_parameters()  # collective under ZeRO-3: every rank takes part
    full = gather_full_parameters(model, full, comm)  # and over tp: slices -> whole weights
    full = gather_stage_parameters(full, mesh)  # and over pp: stages -> the whole model
    out = {"rank": mesh.rank, "coords": mesh.coords, "losses": losses, "memory": memory,
           "comm": comm.records, "events": timeline.events, "wall_s": wall,
           "n_params": sum(p.numel() for p in full.values()),
           "recompute": {"segment_forwards": recompute.forward_calls,
                         "recomputed_forwards": recompute.recomputed_calls}}
    if isinstance(runner, PipeDreamRunner):
        out["pipedream"] = {"staleness": runner.staleness, "peak_versions": runner.peak_versions}
    if cfg.reference and mesh.rank == 0:  # PipeDream: the same micro-batches, one update each
        ref_losses, ref_params = train_reference(cfg, device, per_microbatch=isinstance(
            runner, PipeDreamRunner))
        out["reference_losses"] = ref_losses
        out["max_abs_diff"] = max_abs_diff(losses, full, ref_losses, ref_params)
    return out


def _buffers(strategy) -> list[torch.Tensor]:
    return strategy.buffers() if hasattr(strategy, "buffers") else []


def _transient_bytes(strategy) -> int:
    """Bytes a strategy holds only around communication: DP's buckets, ZeRO-3's gathered layers."""
    if hasattr(strategy, "peak_gathered_bytes"):
        return strategy.peak_gathered_bytes
    return sum(t.numel() * t.element_size() for t in _buffers(strategy))


def run(cfg: RunConfig, average_fn=None) -> RunReport:
    """Launch `cfg.world_size` local ranks (or join torchrun's) and return the merged report."""
    cfg.validate()
    t0 = time.perf_counter()
    if under_torchrun():
        init_from_env(None if cfg.backend == "auto" else cfg.backend, cfg.timeout_s)
        mine = train_rank(cfg.to_dict(), average_fn=average_fn)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        per_rank = gathered
    else:
        backend = None if cfg.backend == "auto" else cfg.backend
        results = run_ranks(train_rank, cfg.world_size, cfg.to_dict(), timeout=cfg.timeout_s,
                            pg_timeout=min(cfg.timeout_s, 60.0), backend=backend,
                            average_fn=average_fn)
        per_rank = [r.value for r in results]
    return merge_rank_results(cfg, per_rank, wall_s=time.perf_counter() - t0)
