"""One training run, composed from the parallel/ pieces for a RunConfig.

`train_rank` is what each rank executes; runtime/launch.py's `run` starts the ranks (or, under
torchrun, is one of them), each running `train_rank`, and merges their results into a RunReport.

The composition, in this fixed order (torchtitan's: model changes first, data parallel last):
    1. mesh        the rank grid and its named axes (mesh.py)
    2. model       the same seeded GPT on every rank (model.py)
    3. tensor      TP/SP: embedding, head and the blocks' Linear layers replaced by parallel ones
    4. context     CP: the embedding's positions seam set, every attention core replaced (ring,
                   zigzag, Ulysses); batches then give each cp rank its part of every sequence
       experts     EP: every mixture-of-experts layer keeps E/ep of its experts, reached by
                   all-to-all (parallel/expert.py); their gradients go to a second strategy (7)
    5. recompute   activation checkpointing: a block's seam, or a checkpointed attention core
                   (the last model change, so that it wraps whatever core CP put in)
    6. runner      the StepRunner: plain micro-steps, or a pipeline schedule that keeps only this
                   rank's stage (so that what follows sees only the stage's parameters)
    7. strategy    the GradientStrategy over the parameters left: plain data parallel, ZeRO-1/2,
                   ZeRO-3 (FSDP), over the mesh's loss / shard / replicate axes (the loss axis
                   is dp x cp: every rank's loss is the mean over its own tokens)
    8. attach      the runner drives the strategy: zero_grad, sync, finish_gradient_sync, step
Each step is then `runner.train_step(step, batch)`; the two interfaces are in interfaces.py and the
engine calls nothing else on them.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .comm import Comm
from .config import RunConfig, offload_file
from .data import global_batch, shard
from .interfaces import GradientStrategy, StepRunner
from .mesh import Mesh, build_mesh, rank_device
from .meters import (ActivationMeter, LiveBytes, Timeline, cuda_allocator_view, cuda_bytes_freed,
                     model_state_bytes)
from .model import build_model
from .moe import Experts
from .optim import PARAM_DTYPE
from .placement import Box, full_shape, held_by
from .parallel.async_ps import slow_down, train_async
from .parallel.context import ContextParallel, apply_context_parallel
from .parallel.data import PlainDataParallel
from .parallel import federated, local_sgd
from .parallel.expert import ExpertAndDense, ExpertParallel, apply_expert_parallel, split_parameters
from .parallel.pipedream import PipeDreamRunner
from .parallel.pipeline import PipelineRunner
from .parallel.recompute import apply_checkpointing
from .parallel.schedules import for_config
from .parallel.tensor import apply_tensor_parallel
from .parallel.zero import ZeroDataParallel
from .parallel.zero3 import Zero3DataParallel
from .reference import max_abs_diff, train_reference
from .step import PlainStep


def say_progress(step: int, steps: int, loss: float, stream=None) -> None:
    """The CLI's progress line, written in one write() with its newline. Why one: print() writes
    the text and the newline separately, and a rank killed between the two (the CLI ending its
    ranks on SIGTERM) left the line open, so the CLI's "stopped by SIGTERM" landed at its end."""
    stream = stream or sys.stderr
    stream.write(f"step {step}/{steps}  loss {loss:.4f}\n")
    stream.flush()


def parallelize(model, comm, cfg, average_fn=None, experts: ExpertParallel | None = None
                ) -> GradientStrategy:
    """The gradient strategy for `cfg` over the mesh's data-parallel axes (step 7 above). With
    experts sharded over ep, the experts' gradients go over their replicas, edp (HYBRID_SHARD:
    sharded over edp_shard, all-reduced over edp_rep; mesh.py), the dense ones over dp x cp:
    ZeRO-3 makes each layer's experts a unit of their own (FSDP2's nested fully_shard), the
    other strategies are built twice, once per group of parameters (ExpertAndDense)."""
    mesh = comm.mesh
    if cfg.sync_every:  # local SGD: each dp rank steps alone, weights averaged every H steps
        return local_sgd.LocalSGD(model, comm, cfg, mesh.axis_for("loss"))
    if cfg.federated:  # clients step alone, the server averages their weights every round
        return federated.FederatedAveraging(model, comm, cfg, mesh.axis_for("loss"), average_fn)
    axes = dict(axis=mesh.axis_for("loss"), shard_axis=mesh.axis_for("shard"),
                replicate_axis=mesh.axis_for("replicate"))
    if experts is None or not experts.sharded:
        return _strategy(model, comm, cfg, axes, average_fn)
    expert_axes = dict(axis=mesh.axis_for("expert_dp"), shard_axis=mesh.axis_for("expert_shard"),
                       replicate_axis=mesh.axis_for("expert_replicate"))
    if cfg.zero == 3:  # (a pipeline stage holds only its own layers' experts)
        apart = {m: expert_axes for m in model.modules() if isinstance(m, Experts)}
        return _strategy(model, comm, cfg, axes, average_fn, apart)
    dense, expert = split_parameters(model, experts.expert_parameter_names(model))
    return ExpertAndDense(_strategy(dense, comm, cfg, axes, average_fn),
                          _strategy(expert, comm, cfg, expert_axes))


def _strategy(model, comm, cfg, axes: dict, average_fn=None, apart=None) -> GradientStrategy:
    disk = offload_file(cfg.offload_disk, comm.mesh.rank) if cfg.offload_disk else ""
    if cfg.zero == 0:
        return PlainDataParallel(model, comm, cfg, axes["axis"], average_fn, offload_disk=disk)
    dtype = PARAM_DTYPE[cfg.precision]
    if cfg.zero in (1, 2):
        return ZeroDataParallel(model, comm, cfg.zero, cfg.optimizer, cfg.lr, dtype,
                                offload=cfg.offload, offload_disk=disk, **axes)
    return Zero3DataParallel(model, comm, cfg.optimizer, cfg.lr, dtype, apart=apart,
                             offload_disk=disk, prefetch=not cfg.no_prefetch, **axes)


def make_runner(cfg, model, comm, timeline, live, act) -> StepRunner:
    """The step runner for `cfg` (step 6 above). A pipeline keeps only this rank's stage."""
    if cfg.federated:  # a step is a round: the clients on this rank train on their own data
        return federated.FederatedRounds(model, comm, cfg, timeline, act)
    if cfg.pp == 1:
        return PlainStep(model, cfg.grad_accum, timeline, act)
    schedule = for_config(cfg)
    if cfg.schedule.startswith("pipedream"):
        return PipeDreamRunner(model, comm, schedule, timeline, live,
                               stash=cfg.schedule == "pipedream")
    return PipelineRunner(model, comm, schedule, timeline, live,
                          seq_shards=cfg.tp if cfg.sp else 1)  # SP: [b, s/tp, h] of its tokens


def own_blocks(model, local: dict[str, torch.Tensor]) -> dict[str, list]:
    """{full name: [(Block's full box, the elements this rank holds of it)]}, each a tensor of its
    own: a view would pickle its whole storage (a ZeRO flat buffer: every parameter, once per
    view). Measured, the toy at dp 4 with ZeRO-1: 46 MB pickled per rank with views, 0.9 MB with
    clones; the whole 3-step run 2.1 s -> 0.7 s on the 2-core machine."""
    blocks = {name: b for name, b in held_by(model).values()}
    return {name: [(b.full, t.detach()[Box(b.local, b.full.sizes).index()].cpu().clone())
                   for b in blocks[name]] for name, t in local.items()}


def gather_full_parameters(model, local: dict[str, torch.Tensor], mesh: Mesh) -> dict:
    """The whole model on every rank from every rank's blocks of it: `local` is what this rank
    holds, unsharded over its strategy's axes (full_parameters), and each module says which block
    of the full tensor that is (placement.held_by). Bookkeeping outside training: one object
    all-gather over the world, not a recorded collective."""
    got = _gather_lists(own_blocks(model, local), mesh)
    full = {}
    for name, boxes in got.items():
        full[name] = boxes[0][1].new_empty(full_shape([box for box, _ in boxes]))
        for box, t in boxes:
            full[name][box.index()] = t
    return full


def count_full_parameters(model, mesh: Mesh) -> int:
    """The whole model's parameter count from every rank's boxes alone: what a run without the
    reference comparison needs, without shipping a value (gather_full_parameters's price: the
    toy at dp 4, ZeRO-1, 0.16 s of a 0.46 s rank)."""
    mine = {name: [b.full for b in blocks] for name, blocks in held_by(model).values()}
    return sum(math.prod(full_shape(boxes)) for boxes in _gather_lists(mine, mesh).values())


def _gather_lists(mine: dict[str, list], mesh: Mesh) -> dict[str, list]:
    """{name: every rank's items}, the lowest rank's last (a replicated box: its copy is written
    last)."""
    parts = [None] * mesh.world_size
    dist.all_gather_object(parts, mine)
    got: dict[str, list] = {}
    for part in reversed(parts):
        for name, items in part.items():
            got.setdefault(name, []).extend(items)
    return got


def owned_report(strategy: GradientStrategy, model) -> list[dict]:
    """What this rank's strategy owns and saves, JSON-ready: per piece its regions (name, offsets,
    sizes), its elements and its optimizer states' elements (Adam: two moments of as many)."""
    out = []
    for pc in strategy.owned(held_by(model)):
        if pc.saved:
            states = pc.optimizer.state.get(pc.index, {}).values() if pc.optimizer else []
            out.append({"regions": [[r.name, r.box.offsets, r.box.sizes] for r in pc.regions],
                        "numel": pc.values.numel(), "states": [t.numel() for t in states]})
    return out


def _mean_over(value: float, mesh: Mesh, axis: str) -> float:
    """Global loss for the log: a metric, not training traffic, so it bypasses the comm records."""
    if mesh.size(axis) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, group=mesh.groups[axis])
    return t.item() / mesh.size(axis)


def train_rank(cfg_dict: dict, init_seed_offset: int = 0, average_fn=None, checkpoints=None
               ) -> dict:
    """Runs on every rank. `init_seed_offset` (tests) makes ranks initialise differently, to show
    that the start-up broadcast makes them agree anyway. `average_fn(params, comm)` replaces the
    naive mode's gradient averaging (a learner's exercise runs through here); with --federated it
    replaces the server's aggregation (federated.weighted_average's arguments). `checkpoints`
    writes and reads --save/--resume checkpoints: runtime/checkpoint.py, which runtime.launch.run
    hands in (the core imports nothing of the runtime)."""
    cfg = RunConfig.from_dict(cfg_dict)
    if (cfg.save or cfg.resume) and checkpoints is None:
        raise ValueError("--save/--resume: train_rank needs checkpoints=runtime.checkpoint "
                         "(runtime.launch.run passes it)")
    mesh = build_mesh(cfg)  # 1
    device = rank_device()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    comm, timeline, live = Comm(mesh), Timeline(device), LiveBytes()
    act = ActivationMeter(live)
    model = build_model(cfg, seed=cfg.seed + init_seed_offset * mesh.rank).to(device)  # 2
    if cfg.asynchronous:  # a parameter server and its workers instead of steps
        return train_async(cfg, mesh, comm, timeline, model)
    apply_tensor_parallel(model, comm, cfg.sp, axis="tp")  # 3
    context = apply_context_parallel(model, comm, cfg.cp_impl, axis="cp")  # 4
    micro_steps = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum  # losses divided by this
    experts = apply_expert_parallel(model, comm, mesh.axis_for("expert"), 1 / micro_steps)
    experts.route_whole_sequences(context, cfg.seq, "tp" if cfg.sp else None)  # whole sequences
    recompute = apply_checkpointing(model, cfg.checkpointing)  # 5
    runner = slow_down(make_runner(cfg, model, comm, timeline, live, act), cfg, mesh.rank,
                       timeline)  # 6 (--straggler: one rank sleeps after computing)
    strategy = parallelize(model, comm, cfg, average_fn, experts)  # 7
    runner.attach(strategy)  # 8
    start = checkpoints.resume(cfg, model, strategy, mesh) if cfg.resume else 0

    def save(step: int) -> None:  # every --save-every steps and after the last; DCP's own
        checkpoints.save(cfg.save, step, model, strategy, mesh, cfg)  # collectives, not training's

    losses, wall = _train(cfg, runner, strategy, comm, live, mesh, context, start,
                          save if cfg.save else None, checkpoints)
    timeline.resolve()  # CUDA: each op's GPU start/end from its events (no-op on CPU)
    if cfg.save:
        save(cfg.steps)
    memory = model_state_bytes(strategy.state_tensors())
    memory["transient"] = strategy.transient_bytes()
    memory["activations_peak"] = runner.activation_peak()
    memory["total_peak"] = live.peak
    cuda_memory = ({"cuda_memory": cuda_allocator_view(strategy.state_tensors(), strategy.buffers(),
                                                       base)} if device.type == "cuda" else {})
    disk = strategy.disk_report()  # --offload-disk: the states' bytes in this rank's file
    if disk:
        memory["disk"] = disk["bytes"]
    comm.step = -1  # gathering for the comparison below is bookkeeping, not training traffic
    if cfg.reference:
        full = strategy.full_parameters()  # collective under ZeRO-3: every rank takes part
        full = gather_full_parameters(model, full, mesh)  # tp slices, ep experts, pp stages -> whole
        n_params = sum(p.numel() for p in full.values())
    else:  # the count alone: shapes, no values
        n_params = count_full_parameters(model, mesh)
    out = {"rank": mesh.rank, "coords": mesh.coords, "losses": losses, "memory": memory,
           "metered_step": cfg.steps - start - 1,  # ran under the live-bytes meter: slower ops
           "resumed_from_step": start,
           **cuda_memory,
           "comm": comm.records, "events": timeline.events, "wall_s": wall,
           "n_params": n_params,
           **({"disk": disk} if disk else {}),
           "recompute": {"segment_forwards": recompute.forward_calls,
                         "recomputed_forwards": recompute.recomputed_calls},
           **runner.report(), **context.report(), **experts.report()}
    if cfg.extra.get("owned"):  # (tests/test_placement.py: the live description vs the twin)
        out["owned"] = owned_report(strategy, model)
    if cfg.reference and mesh.rank == 0:  # PipeDream: the same micro-batches, one update each
        ref_losses, ref_params = train_reference(cfg, device, runner.reference_per_microbatch)
        out["reference_losses"] = ref_losses[start:]  # uninterrupted, from step 0: these steps
        out["max_abs_diff"] = max_abs_diff(losses, full, ref_losses[start:], ref_params)
    if cuda_memory and cfg.extra.get("cuda_free_states"):  # last: frees every state (test_gpu)
        out["cuda_freed"] = cuda_bytes_freed(strategy.state_tensors())
    strategy.close()
    return out


def _train(cfg, runner: StepRunner, strategy: GradientStrategy, comm: Comm, live: LiveBytes,
           mesh: Mesh, context: ContextParallel, start: int = 0, save=None, checkpoints=None
           ) -> tuple[list[float], float]:
    """The steps after `start` (a resumed run's checkpoint step); the last one under the
    live-bytes meter. Returns the global loss per step and the wall-clock seconds of all steps.
    Records (comm, events) number the steps of this run from 0; the data are those of step
    start + step (batches are a pure function of the step: that is the data position). `save(n)`
    writes the checkpoint after step n every --save-every steps (its time is not the steps')."""
    batch_axis, losses = mesh.axis_for("batch"), []
    dist.barrier()  # line the ranks up so their timelines share a start
    t_start, saving = time.perf_counter(), 0.0
    for step in range(cfg.steps - start):
        comm.step = step
        # The live-bytes meter slows every op ~4x, so it watches only the last step: by then every
        # state (optimizer moments included) exists, so that step holds the run's peak.
        metered = step == cfg.steps - start - 1
        if metered:
            _register_states(live, strategy)
        batch = global_batch(cfg, start + step)
        batch = shard(batch, mesh.local_rank(batch_axis), mesh.size(batch_axis))
        batch = context.split(batch)  # [b/dp, s] -> [b/dp, s/cp]: this cp rank's tokens
        with live if metered else nullcontext():
            local = runner.train_step(step, batch)  # mean loss over this rank's tokens
        losses.append(_mean_over(local, mesh, mesh.axis_for("loss")))
        if not math.isfinite(losses[-1]):  # diverged: stop at once (the CLI says so in one line)
            raise FloatingPointError(f"step {start + step + 1}: the loss is {losses[-1]}; the run "
                                     f"diverged (lower --lr, --aux-loss-weight or --z-loss-weight)")
        if cfg.extra.get("progress") and mesh.rank == 0:
            say_progress(start + step + 1, cfg.steps, losses[-1])
        done = start + step + 1
        if checkpoints is not None:  # (tests: a kill between saves)
            checkpoints.crash_point(cfg, mesh.rank, f"step {done}")
        if save is not None and cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
            t_save = time.perf_counter()
            save(done)
            saving += time.perf_counter() - t_save
    return losses, time.perf_counter() - t_start - saving


def _register_states(live: LiveBytes, strategy: GradientStrategy) -> None:
    """Tell the live-bytes meter about every state that exists before the metered step (the
    host's too: ZeRO-Offload's master and moments). Last step's gradients may be freed by
    zero_grad: their bytes leave when they do, so no reference to them is kept here."""
    states = strategy.state_tensors()
    live.add_existing([t for k, ts in states.items() if k != "grads" for t in ts]
                      + strategy.buffers())
    live.add_existing(states.pop("grads", []), freeable=True)
