"""PyTorch's own versions of our strategies, built on our tiny GPT: the peers that the benchmarks
(`python -m parallel_mini.bench`) time ours against and the peer tests prove ours equal to.

    zero_peer(cfg, kind)        ZeroRedundancyOptimizer (+DDP) or FSDP2 fully_shard     ZeRO-1/2/3
    dtensor_tp_plan / _model    DTensor parallelize_module (torchtitan's plan, +SP)     TP, SP
    TorchPipeline               torch.distributed.pipelining, a PipelineStage per chunk PP
    OurPipeline                 our PipelineRunner driven the same way, to run beside it

Everything here runs on a rank (inside `launch.run_ranks`), over the default process group, on CPU
tensors (gloo). Each peer uses torch.optim.Adam with our eps and foreach=False, so that its update
is ours to the last bit; data parallel's peer is torch's DDP itself, used as is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Comm
from ..data import shard
from ..mesh import build_mesh
from ..model import build_model
from ..optim import Adam


def peer_adam(params, cfg) -> torch.optim.Adam:
    """torch's Adam with our arithmetic (eps 1e-5, one tensor at a time)."""
    return torch.optim.Adam(params, lr=cfg.lr, eps=1e-5, foreach=False)


# ---------------------------------------------------------------------------------------------
# ZeRO: ZeroRedundancyOptimizer and FSDP2
# ---------------------------------------------------------------------------------------------
# our ZeRO stage -> (its peer's label, the `kind` zero_peer builds)
ZERO_PEERS = {1: ("ZeroRedundancyOptimizer", "ZeroRedundancyOptimizer"),
              2: ("FSDP2 (reshard_after_forward=False)", "FSDP2_keep"),
              3: ("FSDP2", "FSDP2")}


def zero_peer(cfg, kind: str):
    """(module, optimizer) of one of torch's sharded peers on a fresh model, sharded over every
    rank: "ZeroRedundancyOptimizer" (with DDP; ZeRO-1), "FSDP2_keep" (fully_shard with
    reshard_after_forward=False; the ZeRO-2 analogue) or "FSDP2" (fully_shard; ZeRO-3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(cfg)
    if kind == "ZeroRedundancyOptimizer":
        module = DDP(model, bucket_cap_mb=cfg.bucket_mb)
        return module, ZeroRedundancyOptimizer(module.parameters(),
                                               optimizer_class=torch.optim.Adam,
                                               lr=cfg.lr, eps=1e-5, foreach=False)
    if kind not in ("FSDP2", "FSDP2_keep"):
        kinds = [k for _, k in ZERO_PEERS.values()]
        raise ValueError(f"unknown ZeRO peer {kind!r}: one of {kinds}")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = kind == "FSDP2"
    for block in model.blocks:  # one unit per block, then the rest (embed, head) as the root's
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, peer_adam(model.parameters(), cfg)


# ---------------------------------------------------------------------------------------------
# tensor (and sequence) parallel: DTensor parallelize_module
# ---------------------------------------------------------------------------------------------
def dtensor_tp_plan(cfg, sp: bool = False, vocab: bool = False) -> dict:
    """PyTorch's tensor parallel for our GPT, as a `parallelize_module` plan (rows of each block's
    QKV weight first put in `qkv_rows_by_rank` order, so the contiguous split gives whole heads).

    sp=False: the blocks only; QKV and fc column-wise, the projections row-wise (all-reduce).
    sp=True: Megatron sequence parallel as torchtitan writes it: the LayerNorms run on sequence
    shards (`SequenceParallel`), QKV/fc all-gather them (`ColwiseParallel(input_layouts=Shard(1))`),
    the projections reduce-scatter back (`RowwiseParallel(output_layouts=Shard(1))`), so residual
    adds happen on [b, s/tp, h] local tensors. To start the blocks on shards, the token table
    (`embed.tok`) is vocabulary-split and reduce-scattered (`RowwiseParallel(output_layouts=
    Shard(1))`) and each rank slices its own positions out of the replicated position table
    (`embed.pos`: Replicate -> Shard(0) of [s, h], no communication; backward all-gathers the
    gradient). The head's LayerNorm (`head.norm`) runs on shards too; its projection (`head.out`)
    all-gathers the sequence and is vocabulary-split, its logits gathered
    (`ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())`, no loss_parallel).
    vocab=True (with sp=False): the vocabulary split as ours splits it, so that both do the same
    work: the token table row-wise (`RowwiseParallel`, one all-reduce), the head column-wise with its
    logits left sharded over the vocabulary (`Shard(-1)`), and the loss computed under
    `loss_parallel()` (`dtensor_loss`), torch's vocabulary-parallel cross-entropy."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    if vocab and sp:  # the sp plan splits the token table and head already (gathering logits)
        raise ValueError("dtensor_tp_plan: vocab=True is the plan without sp")
    seq = Shard(1) if sp else Replicate()
    plan = {}
    for i in range(cfg.layers):
        b = f"blocks.{i}"
        plan.update({f"{b}.attn.qkv": ColwiseParallel(input_layouts=seq),
                     f"{b}.attn.proj": RowwiseParallel(output_layouts=seq),
                     f"{b}.mlp.fc": ColwiseParallel(input_layouts=seq),
                     f"{b}.mlp.proj": RowwiseParallel(output_layouts=seq)})
        if sp:
            plan.update({f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel()})
    if vocab and not sp:
        plan.update({"embed.tok": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Replicate()),
                     "head.out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    if sp:
        plan.update({
            "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "embed.pos": PrepareModuleOutput(output_layouts=Replicate(),
                                             desired_output_layouts=Shard(0)),  # [s/tp, h]
            "head.norm": SequenceParallel(),
            "head.out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    return plan


def dtensor_loss(vocab: bool):
    """The context a vocab=True model's forward and backward run in (torch's loss_parallel)."""
    from contextlib import nullcontext
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if vocab else nullcontext()


def dtensor_tp_model(cfg, sp: bool = False, vocab: bool = False):
    """A fresh model sharded with `dtensor_tp_plan` over a 1-D CPU mesh of cfg.tp ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from ..parallel.tensor import qkv_rows_by_rank

    model = build_model(cfg)
    order = qkv_rows_by_rank(cfg.tp)  # so that DTensor's contiguous row split gives whole heads
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.copy_(order(block.attn.qkv.weight))
            block.attn.qkv.bias.copy_(order(block.attn.qkv.bias))
    return parallelize_module(model, init_device_mesh("cpu", (cfg.tp,)),
                              dtensor_tp_plan(cfg, sp, vocab))


# ---------------------------------------------------------------------------------------------
# pipeline parallel: torch.distributed.pipelining on our stage split
# ---------------------------------------------------------------------------------------------
# our schedule -> torch's class on the same chunks. ZBV is not ZB-H1 (ours): it holds 2 chunks per
# rank in a V (r and 2p-1-r) and splits every backward into input and weight gradients.
TORCH_PP_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                      "interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
                      "dualpipev": "ScheduleDualPipeV"}  # torch has no bidirectional DualPipe
V_SHAPED = ("zbv", "dualpipev")


def torch_stage_chunks(name: str, pp: int, rank: int) -> list[int]:
    """The chunks (model order) rank `rank` holds under torch's schedule `name` (a key of
    TORCH_PP_SCHEDULES): one for gpipe/1f1b, r and r+p for interleaved (ours), r and 2p-1-r (V)."""
    if name in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank, rank + pp] if name == "interleaved" else [rank]


class ChunkModule(torch.nn.Module):
    """One chunk of the GPT as its own module, for a torch PipelineStage: a fresh model with every
    other chunk's parts dropped by our `partition`, run by our `forward_chunk` (the model's own
    slice, `model(x, blocks=(i, j))`). Without targets the last chunk returns the logits
    [b, s, v]; the schedule's loss_fn takes it from there. Parameter names are the full model's
    with a `model.` prefix."""

    def __init__(self, cfg, chunk: int, n_chunks: int):
        from ..parallel.pipeline import partition
        from ..parallel.schedules import Schedule

        super().__init__()
        if n_chunks < 2:
            raise ValueError("a one-chunk pipeline is not a pipeline")
        model = build_model(cfg)
        only = Schedule("one chunk", n_chunks, cfg.microbatches, 1,
                        [0 if c == chunk else 1 for c in range(n_chunks)], [])
        partition(model, only, 0)  # keeps chunk `chunk` alone
        self.model, self.chunk, self.n_chunks = model, chunk, n_chunks

    def forward(self, x):  # token ids [b, s] on chunk 0, else [b, s, h]
        from ..parallel.pipeline import forward_chunk
        return forward_chunk(self.model, self.chunk, self.n_chunks, x)  # [b, s, h] or [b, s, v]


def pipeline_loss(logits, targets):
    """The GPT's loss on one micro-batch: the mean over its tokens (torch's schedules then divide
    the gradients by m, scale_grads=True, so they sum to the whole batch's mean)."""
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TorchPipeline:
    """torch.distributed.pipelining on our stage split, on this rank: a PipelineStage per chunk it
    holds, torch's schedule `name` (a key of TORCH_PP_SCHEDULES) over cfg.microbatches, and
    torch.optim.Adam with our eps. Every rank of the default group is a pipeline rank."""

    def __init__(self, cfg, name: str):
        from torch.distributed import pipelining

        pp, rank = dist.get_world_size(), dist.get_rank()
        self.name, self.n_chunks = name, 2 * pp if name in ("interleaved", *V_SHAPED) else pp
        self.chunks = torch_stage_chunks(name, pp, rank)
        self.modules = [ChunkModule(cfg, c, self.n_chunks) for c in self.chunks]
        self.stages = [pipelining.PipelineStage(m, c, self.n_chunks, torch.device("cpu"))
                       for m, c in zip(self.modules, self.chunks)]
        cls = getattr(pipelining, TORCH_PP_SCHEDULES[name])
        self.schedule = cls(self.stages[0] if len(self.stages) == 1 else self.stages,
                            n_microbatches=cfg.microbatches, loss_fn=pipeline_loss)
        self.optimizer = peer_adam([p for m in self.modules for p in m.parameters()], cfg)
        self.first, self.last = 0 in self.chunks, self.n_chunks - 1 in self.chunks

    def step(self, x, y) -> float | None:
        """One training step on the whole batch (torch splits it into m micro-batches along the
        batch dim, as `data.shard` does); the step's loss (mean of the micro-batch losses) on the
        rank holding the last chunk, else None."""
        self.optimizer.zero_grad()
        losses = [] if self.last else None
        # contiguous: torch >= 2.11's stages check input strides against the first micro-batch
        # (x = tokens[:, :-1] is a view with stride s + 1)
        x, y = x.contiguous(), y.contiguous()
        self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                           losses=losses)
        self.optimizer.step()
        return torch.stack(losses).mean().item() if self.last else None

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("model."): p.detach().clone()
                for m in self.modules for k, p in m.named_parameters()}


class OurPipeline:
    """Our PipelineRunner with schedule `name` on a fresh model (partitioned in the runner's
    constructor), our Adam, with TorchPipeline's interface (`step`, `parameters_by_name`) so the
    two run side by side; every rank of the default group is a pipeline rank."""

    def __init__(self, cfg, name: str):
        from ..meters import Timeline
        from ..parallel.pipeline import PipelineRunner
        from ..parallel.schedules import build_schedule

        cfg = cfg.replace(pp=dist.get_world_size(), schedule=name)
        self.cfg, self.model = cfg, build_model(cfg)
        self.comm, self.timeline = Comm(build_mesh(cfg)), Timeline()
        self.runner = PipelineRunner(self.model, self.comm,
                                     build_schedule(name, cfg.pp, cfg.microbatches), self.timeline)
        self.optimizer = Adam(self.model.parameters(), lr=cfg.lr)  # this rank's stage only
        self.last = self.runner.schedule.owner[-1] == dist.get_rank()

    def step(self, x, y, step: int = 0) -> float | None:
        m = self.cfg.microbatches
        micro = [shard((x, y), i, m) for i in range(m)]  # m x ([b/m, s] x 2)
        self.optimizer.zero_grad()
        self.comm.step = step
        loss = self.runner.run(step, [a for a, _ in micro], [b for _, b in micro])
        self.optimizer.step()
        # a benchmark keeps no history: the last step's events and sends only
        self.last_events, self.timeline.events = self.timeline.events, []
        self.sends = sum(r["op"] == "send" for r in self.comm.records)
        self.comm.records.clear()
        self.comm.p2p_log.clear()
        return loss if self.last else None

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# context parallel: torch's own ring attention (private API; the public context_parallel API
# fails for causal attention on CPU in torch 2.13, this template runs)
# ---------------------------------------------------------------------------------------------
def torch_ring_attention(q, k, v, grad_out, group, load_balance: bool):
    """Forward and backward of torch's ring attention on this rank's [b, a, s/C, d] tokens (laid
    out contiguous, or zigzag when `load_balance`); returns (out, dq, dk, dv)."""
    from torch.distributed.tensor.experimental._attention import _templated_ring_attention
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _cp_options, _templated_ring_attention_backward)
    aten = torch.ops.aten
    _cp_options.enable_load_balance = load_balance
    out, lse = _templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                         q, k, v, is_causal=True)[:2]
    grads = _templated_ring_attention_backward(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
        logsumexp=lse, is_causal=True, dropout_p=0.0)
    return (out, *grads[:3])
