"""The planner: ranked layouts for a model on a cluster. Every number it prints is theory.

    python -m parallel_mini plan --model llama3-70b --gpus 512 --gpu h100-80gb [--json -]

It enumerates layouts (dp with ZeRO 0-3, tp inside a node, pp with a schedule and micro-batches,
cp, ep for mixture-of-experts models, activation checkpointing), drops those that do not fit in a
GPU's memory and ranks the rest by predicted step time. One cost model, built on `theory`'s
formulas, the same the lessons check against live runs:
- model states per rank: theory.model_state_bytes over the parameters a rank holds (its
  tensor-parallel slices of its pipeline stage, its E/ep experts), sharded by ZeRO over dp x cp
  (experts over (dp x cp)/ep), exactly as theory.run_theory does for a live run: on the tiny GPT
  the prediction equals the run's measured params/grads/optimizer bytes on every rank
  (validate_on_toy_runs, tests/test_planner.py);
- activations: micro-batches in flight (parallel.schedules.in_flight) x the stage's layers x
  bytes per layer (theory.gpt_activation_bytes_per_layer for the tiny GPT; for real models
  layer_activation_bytes, Korthikanti et al.'s count generalised to GQA, SwiGLU, MoE and MLA);
- bytes per step on each axis: theory.tp_wire_bytes_per_step, cp_wire_bytes_per_step,
  ep_wire_bytes_per_step, pipeline_p2p_bytes_per_step, dp_wire_bytes_per_step and
  zero_wire_bytes_per_step, turned into time on the axis's link: inside a node (tp, and any axis
  whose group fits in one) the GPU-to-GPU link, else the network (theory.INTERCONNECTS);
- compute: 6 FLOPs per parameter and token as at_scale.matmul_time (plus attention's and
  recomputation's) at a stated fraction of the GPU's peak, the pipeline stretched by
  theory.bubble_fraction.

What is approximated (all of it stated where it is computed): transfers run at the vendor's link
bandwidth plus a fixed latency per ring hop; overlap is a rule (tp, ep and the pipeline's fill and
drain are exposed, but DualPipe's F&B pairs hide their share of ep and pp behind the paired
compute; dp/ZeRO hides behind one micro-batch's compute, cp behind attention; on a
machine whose ranks share cores nothing overlaps and a bubble costs nothing: an idle rank frees its
core); matmuls run at a fixed share of peak whatever their size; real
models use FlashAttention (no [s, s] scores kept), sequence parallel whenever tp > 1, uniform
expert routing; memory beyond states, activations and logits (CUDA context, NCCL buffers,
fragmentation) is a flat reserve. None of these numbers is measured, except the rates of the
profile "this machine" (measure_hardware: a matmul and forward + backward sweep of the toy, the
comm calls' own CPU, and course/links.py's alpha-beta fit of this machine's links per op, world
and group size), which `bench plan` predicts with.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from types import SimpleNamespace

from .. import theory
from . import at_scale, links
from ..parallel.schedules import build_schedule, chunk_owner, directions, in_flight

GiB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A transformer's shape, enough for parameters, activations, FLOPs and traffic.

    `toy=True` is parallel_mini's own GPT (model.py: learned positions, LayerNorm, biases, GELU
    MLP of 4h, untied head, MoE blocks every `moe_every`-th with E experts of 8h^2 + 5h): its
    parameters per unit are theory.gpt_unit_sizes exactly, and its layouts can be run here."""
    name: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    global_batch: int  # sequences per optimizer step, when --global-batch is not given
    kv_heads: int = 0  # grouped-query attention; 0 = heads (multi-head)
    head_dim: int = 0  # 0 = d_model // heads
    ffn: int = 0  # MLP hidden size; 0 = 4 d_model
    gated: bool = False  # SwiGLU: gate, up and down matrices (Llama); else fc + GELU + proj
    bias: bool = True
    norm: str = "layernorm"  # "layernorm" (weight and bias) or "rmsnorm" (weight only)
    learned_positions: bool = True  # a [seq, h] position table (GPT); RoPE has none
    tied_embeddings: bool = False  # one [v, h] table for input and output (GPT-3)
    dropout: bool = False  # dropout masks kept for backward (Korthikanti's count has them)
    experts: int = 0  # routed experts per MoE layer
    top_k: int = 1
    moe_every: int = 1  # the toy: every moe_every-th block is MoE
    first_dense: int = 0  # real MoE models: the first k blocks keep a dense MLP (DeepSeek-V3: 3)
    expert_ffn: int = 0  # 0 = ffn
    shared_experts: int = 0  # always-on experts (DeepSeek-V3: 1), split over tp like a dense MLP
    mla: tuple = ()  # DeepSeek's multi-head latent attention: (q_lora, kv_lora, qk_nope, qk_rope, v)
    toy: bool = False
    source: str = ""

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dh(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def fe(self) -> int:
        return self.expert_ffn or self.f

    def is_moe(self, i: int) -> bool:
        if not self.experts:
            return False
        if self.toy:
            return (i + 1) % self.moe_every == 0  # theory.moe_blocks
        return i >= self.first_dense

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.is_moe(i)]


# Published shapes. Llama 3: Dubey et al., 2024, "The Llama 3 Herd of Models", Table 3 (and the
# released configs: vocab 128,256, untied embeddings, RMSNorm, SwiGLU, RoPE, no biases).
# GPT-3 175B: Brown et al., 2020, Table 2.1 (96 layers, d_model 12,288, 96 heads of 128, context
# 2,048); vocabulary 50,257 padded to 51,200 as Megatron-LM pads it for tp 8. DeepSeek-V3:
# DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", section 4.2 (61 layers, hidden 7,168, 128
# heads of 128, MLA with query / KV compression 1,536 / 512 and 64 rotary dims, the first 3 layers
# dense with FFN 18,432, then 1 shared + 256 routed experts of 2,048, top-8; vocabulary 129,280);
# its multi-token-prediction module (14B more) is left out, as the report's 671B leaves it out.
MODELS = {
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 128256, 8192, 1024, kv_heads=8, ffn=14336,
                           gated=True, bias=False, norm="rmsnorm", learned_positions=False,
                           source="Dubey et al. 2024, Table 3"),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 128256, 8192, 1024, kv_heads=8, ffn=28672,
                            gated=True, bias=False, norm="rmsnorm", learned_positions=False,
                            source="Dubey et al. 2024, Table 3"),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 128256, 8192, 2048, kv_heads=8,
                             ffn=53248, gated=True, bias=False, norm="rmsnorm",
                             learned_positions=False, source="Dubey et al. 2024, Table 3"),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 51200, 2048, 1536, tied_embeddings=True,
                           dropout=True, source="Brown et al. 2020, Table 2.1; Megatron-LM's padded vocab"),
    "deepseek-v3": ModelSpec("deepseek-v3", 61, 7168, 128, 129280, 4096, 15360, ffn=18432,
                             gated=True, bias=False, norm="rmsnorm", learned_positions=False,
                             experts=256, top_k=8, first_dense=3, expert_ffn=2048,
                             shared_experts=1, mla=(1536, 512, 128, 64, 128),
                             source="DeepSeek-AI 2024, DeepSeek-V3 Technical Report, 4.2"),
}


def toy_model(layers: int = 4, d_model: int = 64, heads: int = 4, seq: int = 32, vocab: int = 128,
              batch: int = 8, experts: int = 0, top_k: int = 1, moe_every: int = 1) -> ModelSpec:
    """parallel_mini's GPT (RunConfig's model fields; its defaults are RunConfig's)."""
    return ModelSpec("gpt", layers, d_model, heads, vocab, seq, batch, experts=experts,
                     top_k=top_k, moe_every=moe_every, toy=True, source="parallel_mini.model")


# ---------------------------------------------------------------------------------------------
# hardware
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are one direction, per GPU, as vendors quote
    them; `latency_s` is charged per ring hop (a ring all-reduce over N ranks has 2(N-1) hops)."""
    name: str
    memory_bytes: float
    flops: float  # dense peak in the compute precision, FLOP/s
    intra: str  # theory.INTERCONNECTS key: GPU to GPU inside a node
    inter: str  # theory.INTERCONNECTS key: per GPU between nodes
    gpus_per_node: int = at_scale.NVLINK_GPUS_PER_NODE
    intra_bw: float = 0.0  # overrides INTERCONNECTS[intra] (a link theory does not list)
    inter_bw: float = 0.0
    latency_intra_s: float = 5e-6
    latency_inter_s: float = 10e-6
    # A planner constant, not a measurement: the share of peak that large bf16 matmuls sustain.
    matmul_efficiency: float = 0.75
    # CUDA context, NCCL buffers, allocator fragmentation, temporaries: kept free (a rule).
    reserve_fraction: float = 0.10
    cores: int = 0  # "cpu": ranks share this many cores (0: every rank has its own device)
    source: str = ""
    # "cpu" only: a ring hop's seconds when ranks outnumber cores, per rank per core (the hop
    # waits for its receiver to be scheduled): shared_hop_s x ranks / cores.
    shared_hop_s: float = 6e-4
    # Seconds per block per micro-batch (forward + backward) that do not scale with FLOPs: the
    # fixed cost of each of a block's small torch ops (Python, dispatch, autograd). 0: not
    # modelled (GPUs: their kernels are large); measure_hardware measures it on this machine.
    block_overhead_s: float = 0.0
    # Seconds per pipeline chunk per micro-batch (forward + backward) beyond its blocks': a chunk
    # is its own autograd graph (detached input, backward entered with the received gradient).
    chunk_overhead_s: float = 0.0
    # Measured profiles only (0: not modelled). Seconds per block per micro-batch that recomputing
    # costs beyond its FLOPs (the checkpoint machinery: saved inputs, a second forward's small
    # ops), for full and selective activation checkpointing; and one optimizer step over the
    # whole model's parameters on one rank (a rank that updates a share of them pays that share).
    full_recompute_block_s: float = 0.0
    selective_recompute_block_s: float = 0.0
    optimizer_s: float = 0.0
    # Measured profiles only: a rank's thread CPU seconds per comm call it makes (the call, its
    # metering, the autograd function around it), from a tp2 run beside a tp1 run of the same batch.
    call_cpu_s: float = 0.0
    call_cpu_s_per_byte: float = 0.0  # and per byte on the wire (from a tp2 run at batch 1 beside)
    p2p_call_cpu_s: float = 0.0  # the same for a point-to-point call (cp's ring, pp's messages),
    # from a cp2 run beside a cp1 run
    sp_call_cpu_s: float = 0.0  # the same for a tp call with sequence parallel (its all-gathers,
    # reduce-scatters and the small all-reduces of the replicated parameters' gradients), from a
    # tp2 + sp run beside the tp1 run (0: call_cpu_s and call_cpu_s_per_byte stand for them)
    # The same three where ranks outnumber the cores (a call's CPU grows there: its waits are
    # spent switching between ranks), from runs of `shared_world` ranks: dp x tp2, dp x tp2 + sp
    # and dp x cp2 beside dp alone, the same batch; charged to layouts whose ranks share the
    # cores (0: not measured, the figures above stand for them).
    shared_world: int = 0
    shared_call_cpu_s: float = 0.0
    shared_sp_call_cpu_s: float = 0.0
    shared_p2p_call_cpu_s: float = 0.0
    # Measured profiles only: this machine's links fitted per op at each world and group size
    # measured (links.fit_table rows: world, group, op, alpha_s, beta_s_per_byte). With ranks
    # sharing cores a hop's alpha holds the wait for the receiver to get a core, so a layout's
    # calls are charged at the fit of the world and group it runs (links.link_at). Empty:
    # latency_*_s and the bandwidths.
    links: tuple = ()

    def __post_init__(self):  # read back from JSON the rows are lists: keep them hashable
        object.__setattr__(self, "links", tuple(tuple(row) for row in self.links))

    def bandwidth(self, inside_node: bool) -> float:
        if inside_node:
            return self.intra_bw or theory.INTERCONNECTS[self.intra]
        return self.inter_bw or theory.INTERCONNECTS[self.inter]

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * (1 - self.reserve_fraction)


def _cpu_profile() -> Hardware:
    """This machine, for the tiny GPT's local runs (gloo over loopback, one process per rank).

    Constants of the right order for a laptop-class core, chosen once, not fitted per layout:
    8 GFLOP/s sustained per core on the toy's small fp32 matrices, 2 GB/s loopback, 0.1 ms per
    ring hop when every rank has a core, 0.6 ms x (ranks / cores) when ranks share cores (a hop
    waits for its receiver to be scheduled). Memory: 2 GiB per rank, and the tiny GPT's layouts
    must pass RunConfig's own checks (its fit check against this machine's available memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Hardware("cpu", 2 * GiB, 8e9, "loopback", "loopback", gpus_per_node=10 ** 6,
                    intra_bw=2e9, inter_bw=2e9, latency_intra_s=1e-4, latency_inter_s=1e-4,
                    matmul_efficiency=1.0, reserve_fraction=0.0, cores=max(1, cores or 1),
                    source="this machine's cores (assumed rates)")


def _compute_sweep_rank(shape: dict, batches: list[int], repeats: int) -> dict:
    """On one rank (one compute thread, as every rank runs): the toy's matmuls at its shapes, and
    the whole toy's forward + backward at each micro-batch size; CPU time of this thread (the
    rate of a core while it is ours: other processes' load does not enter), fastest of repeats."""
    import time

    import torch

    from ..config import RunConfig
    from ..model import build_model

    def fastest(fn):
        fn()
        best = math.inf
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t0)
        return best

    h, v, s = shape["d_model"], shape["vocab"], shape["seq"]
    mm_flops = mm_s = 0.0
    for b in batches:
        t = b * s
        for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h), (h, v)):
            a, w = torch.randn(t, k), torch.randn(k, n)
            mm_s += fastest(lambda: a @ w)
            mm_flops += 2 * t * k * n
    model = build_model(RunConfig(**{**shape, "batch": max(batches)}))
    sweep = []
    for b in batches:
        x, y = torch.randint(0, v, (b, s)), torch.randint(0, v, (b, s))

        def fwd_bwd():
            model(x, y).backward()

        def chunked():  # as a pipeline runs it: one chunk per block, each its own graph
            ins, outs, h_in = [], [], x
            for i in range(len(model.blocks)):
                h_in = h_in if i == 0 else h_in.detach().requires_grad_()
                ins.append(h_in)
                outs.append(model(h_in, y, blocks=(i, i + 1)))
                h_in = outs[-1]
            grad = None
            for i in reversed(range(len(outs))):
                torch.autograd.backward(outs[i], grad)
                grad = ins[i].grad if i else None
        sweep.append({"batch": b, "seconds": fastest(fwd_bwd), "chunked_s": fastest(chunked)})
    return {"matmul_flops_per_s": mm_flops / mm_s, "fwd_bwd": sweep}


class MeasurementError(RuntimeError):
    """A measurement that cannot stand for what it claims (one line: what was seen, what to do)."""


COMPUTE_FIT_MAX_REL_ERR = 0.25  # a compute sweep the line L x overhead + FLOPs / rate misses by more


def fit_compute(sweep: list[dict], layers: int, flops_per_seq: float,
                max_rel_err: float = COMPUTE_FIT_MAX_REL_ERR) -> tuple[float, float]:
    """(block_overhead_s, seconds per FLOP) fitted (links.fit_relative, relative least squares) to
    a forward + backward sweep, rows {"batch", "seconds"}: t = layers x overhead + batch x
    flops_per_seq x per_flop. Refused (MeasurementError) where the time does not grow with the
    batch (a slope of 0: the timer did not see the work, e.g. CUDA kernels launched but not run
    on this thread) or the line misses a row by more than `max_rel_err`: never an infinite rate."""
    pts = [(layers, flops_per_seq * r["batch"], r["seconds"]) for r in sweep]
    seen = ", ".join(f"{1e3 * r['seconds']:.2f} ms at batch {r['batch']}" for r in sweep)
    if len({r["batch"] for r in sweep}) < 2 or any(t <= 0 for *_, t in pts):
        raise MeasurementError(f"compute sweep: need positive times at 2 or more batch sizes "
                               f"({seen or 'none'})")
    overhead, per_flop = links.fit_relative(pts)
    if per_flop <= 0:
        raise MeasurementError(f"compute sweep: the forward + backward time does not grow with "
                               f"the batch ({seen}): it did not measure the work (ran on a GPU? "
                               f"threads other than the timed one?); measure on CPU ranks")
    err = max(abs(layers * overhead + x * per_flop - t) / t for _, x, t in pts)
    if err > max_rel_err:
        raise MeasurementError(f"compute sweep: t = L x overhead + FLOPs / rate misses a row by "
                               f"{100 * err:.0f}% (> {100 * max_rel_err:.0f}%: {seen}); a loaded "
                               f"or throttled machine? measure again")
    return overhead, per_flop


def hardware_from_measurements(compute: dict, link_fits: dict, shape: dict, cores: int,
                               op_fits: dict | None = None) -> Hardware:
    """measure_hardware's profile from its measurements: `compute` (_compute_sweep_rank's),
    `link_fits` {world: fit_alpha_beta(...)["all"]}, the toy's `shape`, this machine's cores;
    `op_fits` {world or (world, group): fit_alpha_beta(...)} (every op's fit and "all"): the
    profile's links table, which predict charges each call by (without it, the "all" fits' alpha
    per hop)."""
    spec = toy_model(batch=1, **shape)
    per_seq = model_flops_per_token(spec) * spec.seq
    sweep = compute.get("engine_fwd_bwd") or compute["fwd_bwd"]
    overhead, per_flop = fit_compute(sweep, spec.layers, per_seq)
    recompute = {}
    for how, rows in (compute.get("engine_recompute") or {}).items():
        # beyond the no-checkpointing line at the same batch and the recomputed FLOPs at the rate
        extra = [(r["seconds"] - spec.layers * overhead - r["batch"] * per_seq * per_flop
                  - r["batch"] * _recomputed_flops(spec, how) * spec.seq * per_flop) / spec.layers
                 for r in rows]
        recompute[f"{how}_recompute_block_s"] = max(0.0, statistics.median(extra))
    opt = [r["optimizer_s"] for r in sweep if "optimizer_s" in r]
    calls = compute.get("calls") or {}
    own = [w for w in link_fits if w <= cores] or [min(link_fits)]
    shared = [w for w in link_fits if w > cores] or own
    near, far = link_fits[max(own)], link_fits[max(shared)]
    return Hardware("this machine", 2 * GiB, 1.0 / per_flop,
                    "loopback", "loopback", gpus_per_node=10 ** 6,
                    intra_bw=far["bandwidth_Bps"], inter_bw=far["bandwidth_Bps"],
                    latency_intra_s=near["alpha_s"], latency_inter_s=near["alpha_s"],
                    matmul_efficiency=1.0, reserve_fraction=0.0, cores=cores,
                    shared_hop_s=far["alpha_s"] * cores / max(shared),
                    block_overhead_s=overhead, chunk_overhead_s=max(0.0, statistics.median(
                        (r["chunked_s"] - r["seconds"]) / spec.layers for r in compute["fwd_bwd"]
                        if "chunked_s" in r) if any("chunked_s" in r for r in compute["fwd_bwd"])
                        else 0.0),
                    optimizer_s=statistics.median(opt) if opt else 0.0, **recompute,
                    call_cpu_s=_call_cost(calls)[0], call_cpu_s_per_byte=_call_cost(calls)[1],
                    p2p_call_cpu_s=_per_call(calls, "cp2"), sp_call_cpu_s=_per_call(calls, "tp2sp"),
                    **_shared_costs(compute.get("shared_calls") or {}),
                    links=links.fit_table(op_fits) if op_fits else (),
                    source="measured here: the toy's steps on one rank + link fit")


def _shared_costs(shared: dict) -> dict:
    """Hardware's shared_* fields from _measure_shared_call_cpu's result ({}: none measured)."""
    if not shared:
        return {}
    return {"shared_world": shared["world"], "shared_call_cpu_s": _shared_per_call(shared, "tp2"),
            "shared_sp_call_cpu_s": _shared_per_call(shared, "tp2sp"),
            "shared_p2p_call_cpu_s": _shared_per_call(shared, "cp2")}


def _passes_cpu(rep) -> float:
    """A run's forward and backward ops' CPU time, all ranks summed, median of steps 1 and 2."""
    return statistics.median(
        sum(e.get("cpu", 0.0) for r in rep.ranks for e in r["events"]
            if e.get("step") == s and e["kind"] in ("forward", "backward")) for s in (1, 2))


def _measure_call_cpu(shape: dict, batch: int) -> dict:
    """The toy with tp 2 (2 ranks, a core each where there are 2) and with tp 1, same batch, on
    CPU: the forward and backward ops' CPU time (all ranks summed, median of steps 1 and 2), and
    the comm calls tp 2 made in them (counted from comm.py's records)."""
    from ..config import RunConfig
    from ..runtime.launch import run

    out = {}
    for name, degrees, b in (("tp1", {}, batch), ("tp2", {"tp": 2}, batch), ("cp2", {"cp": 2}, batch),
                             ("tp2sp", {"tp": 2, "sp": True}, batch),
                             ("tp1_b1", {}, 1), ("tp2_b1", {"tp": 2}, 1)):
        rep = run(RunConfig(**shape, batch=b, steps=4, backend="gloo", **degrees))
        out[f"{name}_fwd_bwd_cpu_s"] = _passes_cpu(rep)
        out[f"{name}_calls"] = statistics.median(
            len([c for r in rep.ranks for c in r["comm"] if c.get("step") == s]) for s in (1, 2))
        out[f"{name}_wire_bytes"] = statistics.median(
            sum(c.get("wire_bytes_model", 0) for r in rep.ranks for c in r["comm"]
                if c.get("step") == s) for s in (1, 2))
    return out


def _measure_shared_call_cpu(shape: dict, batch: int, world: int) -> dict:
    """`world` ranks on the cores (more ranks than cores): dp x tp2, dp x tp2 + sp and dp x cp2
    beside dp alone, the same batch (the same tokens and blocks per rank): the forward and
    backward ops' CPU (all ranks summed, median of steps 1 and 2) and the tp / cp calls made."""
    from ..config import RunConfig
    from ..runtime.launch import run

    out = {"world": world}
    for name, degrees, axis in (("dp", {}, None), ("tp2", {"tp": 2}, "tp"),
                                ("tp2sp", {"tp": 2, "sp": True}, "tp"), ("cp2", {"cp": 2}, "cp")):
        dp = world // (2 if axis else 1)
        rep = run(RunConfig(**shape, batch=batch, steps=4, backend="gloo", dp=dp, **degrees))
        out[f"{name}_fwd_bwd_cpu_s"] = _passes_cpu(rep)
        out[f"{name}_calls"] = statistics.median(
            len([c for r in rep.ranks for c in r["comm"] if c.get("step") == s
                 and c.get("group") == axis and (axis != "cp" or c["op"] in ("send", "recv"))])
            for s in (1, 2))  # (cp's gradient all-reduce runs after the passes)
    return out


def _shared_per_call(shared: dict, name: str) -> float:
    """Seconds of CPU per tp / cp call with the cores shared: what run `name` added to dp's."""
    if not shared.get(f"{name}_calls"):
        return 0.0
    return max(0.0, (shared[f"{name}_fwd_bwd_cpu_s"] - shared["dp_fwd_bwd_cpu_s"])
               / shared[f"{name}_calls"])


def _call_cost(calls: dict) -> tuple[float, float]:
    """(seconds per call, seconds per wire byte) a tp2 run's passes add to tp1's, from the runs
    at the sweep's largest batch and at batch 1 (the same calls, fewer bytes): two equations."""
    if not calls.get("tp2_b1_calls"):
        return _per_call(calls, "tp2"), 0.0
    rows = [(calls[f"tp2{t}_calls"], calls[f"tp2{t}_wire_bytes"],
             calls[f"tp2{t}_fwd_bwd_cpu_s"] - calls[f"tp1{t}_fwd_bwd_cpu_s"]) for t in ("", "_b1")]
    (n1, b1, d1), (n2, b2, d2) = rows
    det = n1 * b2 - n2 * b1
    per_byte = max(0.0, (n1 * d2 - n2 * d1) / det) if det else 0.0
    per_call = max(0.0, statistics.mean((d - b * per_byte) / n for n, b, d in rows))
    return per_call, per_byte


def _per_call(calls: dict, name: str) -> float:
    """Seconds of CPU per comm call: what run `name` added to tp1's passes, over its calls."""
    if not calls.get(f"{name}_calls"):
        return 0.0
    return max(0.0, (calls[f"{name}_fwd_bwd_cpu_s"] - calls["tp1_fwd_bwd_cpu_s"])
               / calls[f"{name}_calls"])


def _recomputed_flops(spec: ModelSpec, checkpointing: str) -> float:
    """Forward FLOPs per token that a checkpointing mode runs again in the backward: full, every
    block's forward (not the head's); selective, the attention cores."""
    per = [block_flops_per_token(spec, i) for i in range(spec.layers)]
    return {"full": sum(f for f, _ in per), "selective": sum(c for _, c in per)}.get(checkpointing,
                                                                                      0.0)


def measure_hardware(path: str | None = None, worlds=(2, 4, 8), model: dict | None = None,
                     batches=(1, 2, 4, 8, 16), max_bytes: int = 4 * 2 ** 20, repeats: int = 5,
                     progress=None) -> Hardware:
    """"this machine", measured here: a Hardware profile for the tiny GPT's local runs.

    Compute (one rank, one thread, CPU time): a matmul sweep at the toy's shapes (its FLOP/s is
    recorded), the bare toy's forward + backward at micro-batches of `batches` sequences
    (recorded), and the same through the engine (engine.run on one rank on CPU (gloo: where
    there is a GPU a run of one rank would take it, and the host's CPU time would see kernel
    launches only), 4 steps: the forward and backward ops' CPU time of steps 1 and 2, median; the
    meters' hooks included, as every layout's ranks run them), fitted (fit_compute: links' least
    squares in relative error, refused when flat or off by more than COMPUTE_FIT_MAX_REL_ERR) to
    t = L x block_overhead_s + FLOPs / flops: the
    fitted rate covers what scales with tokens (matmuls and the elementwise ops between them),
    block_overhead_s the fixed cost of each block's small ops (embedding and head folded into the
    blocks); the same forward + backward run as a pipeline runs it, one chunk (its own autograd
    graph) per block, gives chunk_overhead_s (median over micro-batch sizes of the difference per
    chunk), charged per chunk a pipeline rank runs. Links (course/links.measure_links, every op, 4 B to max_bytes, medians): at each
    world of `worlds`, with the op run in groups of every power of 2 from 2 to the world (all
    groups at once), fit_alpha_beta per op and over all ops (the rows and fits are kept in the
    JSON): the per-op fits become the profile's links table, and predict charges each call of a
    group of n ranks in a layout of N at the fit measured nearest (N, n) (links.link_at); the older
    summary stays beside it: latency_intra_s is alpha at the largest world with a core per rank,
    shared_hop_s alpha at the largest world beyond the cores x cores / world, the bandwidth that
    world's.
    The same sweep with full and selective checkpointing gives what recomputing costs per block
    beyond its FLOPs; its optimizer op, optimizer_s (charged per rank by its share of the
    optimizer states); a tp2, a tp2 + sp and a cp2 run beside a tp1 one of the same batch, the
    CPU a comm call adds to the passes (call_cpu_s, sp_call_cpu_s, p2p_call_cpu_s; charged per
    call predict counts). Not in the
    profile: the CPU ranks burn waiting for one another when they outnumber the cores, and
    gloo's own threads. With `path`: read the profile from that
    JSON file when it exists, else measure and write it there; without, measure (no file)."""
    import json

    if path and os.path.exists(path):
        with open(path) as fh:
            return Hardware(**json.load(fh)["hardware"])
    from ..config import RunConfig
    from ..runtime.launch import run
    from ..runtime.launch import run_ranks

    say = progress or (lambda msg: None)
    shape = {k: v for k, v in {**VALIDATION_MODEL, **(model or {})}.items() if k != "batch"}
    say("compute: matmul sweep and the toy's forward + backward, one rank")
    comp = run_ranks(_compute_sweep_rank, 1, shape, list(batches), repeats, timeout=600,
                     backend="gloo")[0].value
    comp["engine_fwd_bwd"] = []
    for b in batches:  # the toy as the engine runs it (its meters and hooks on), one rank
        say(f"compute: the engine's forward + backward, batch {b}")
        # gloo: on CPU (a run of one rank would otherwise take a GPU where there is one, and a
        # GPU's kernels run after the host thread has queued them: its CPU time stays flat)
        rep = run(RunConfig(**shape, batch=b, steps=4, backend="gloo"))
        ev = rep.ranks[0]["events"]
        row = {"batch": b}
        for key, kinds in (("seconds", ("forward", "backward")), ("forward_s", ("forward",)),
                           ("optimizer_s", ("optimizer",))):
            row[key] = statistics.median(sum(e.get("cpu", 0.0) for e in ev if e.get("step") == s
                                             and e["kind"] in kinds) for s in (1, 2))
        comp["engine_fwd_bwd"].append(row)
    comp["engine_recompute"] = {}
    for how in ("full", "selective"):  # the same with activation checkpointing: what it adds
        comp["engine_recompute"][how] = []
        for b in batches:
            say(f"compute: the engine's forward + backward, checkpointing {how}, batch {b}")
            rep = run(RunConfig(**shape, batch=b, steps=4, backend="gloo", checkpointing=how))
            comp["engine_recompute"][how].append({"batch": b, "seconds": statistics.median(
                sum(e.get("cpu", 0.0) for e in rep.ranks[0]["events"] if e.get("step") == s
                    and e["kind"] in ("forward", "backward")) for s in (1, 2))})
    comp["calls"] = _measure_call_cpu(shape, max(batches))
    cores = _cpu_profile().cores
    shared = [w for w in worlds if w > cores]
    if shared:  # the calls' own CPU again, with more ranks than cores
        say(f"compute: comm calls' CPU, {max(shared)} ranks on {cores} cores")
        comp["shared_calls"] = _measure_shared_call_cpu(shape, max(batches), max(shared))
    fits = {}
    for w in worlds:
        for g in _powers_of_two_dividing(w, w)[1:]:  # groups of 2 .. w ranks, all at once
            say(f"links: {w} ranks" + (f" in groups of {g}" if g < w else ""))
            res = links.measure_links(w, [x for x in links.DEFAULT_SIZES if x <= max_bytes],
                                      repeats=repeats, group=g)
            by_op = links.fit_alpha_beta(res)
            fits[w, g] = {"fit": by_op["all"], "by_op": by_op, "rows": res["rows"],
                          "load": [res["load_before"], res["load_after"]]}
    hw = hardware_from_measurements(comp, {w: f["fit"] for (w, g), f in fits.items() if g == w},
                                    shape, cores,
                                    {k: f["by_op"] for k, f in fits.items()})
    if path:
        with open(path, "w") as fh:
            json.dump({"hardware": dataclasses.asdict(hw), "compute": comp,
                       "links": {f"{w}/{g}": f for (w, g), f in fits.items()}}, fh, indent=1)
    return hw


# H100 SXM: 989 TFLOP/s dense bf16 (at_scale.H100_BF16_FLOPS), 80 GB HBM3, NVLink 4 inside an HGX
# node of 8, one 400 Gb/s InfiniBand NDR port per GPU. H800: the H100 with NVLink cut; DeepSeek-V3's
# report (3.2.2) quotes 160 GB/s NVLink and 50 GB/s IB per GPU. A100 SXM 80GB: 312 TFLOP/s bf16,
# NVLink 3 (600 GB/s both ways), Selene's 200 Gb/s HDR per GPU (Narayanan et al., 2021).
HARDWARE = {
    "h100-80gb": Hardware("h100-80gb", 80 * GiB, at_scale.H100_BF16_FLOPS, "NVLink 4 (H100)",
                          "InfiniBand NDR", source="NVIDIA H100 SXM5 datasheet"),
    "h200-141gb": Hardware("h200-141gb", 141e9, at_scale.H100_BF16_FLOPS, "NVLink 4 (H100)",
                           "InfiniBand NDR", source="NVIDIA H200 SXM datasheet"),
    "h800-80gb": Hardware("h800-80gb", 80 * GiB, at_scale.H100_BF16_FLOPS, "NVLink (H800)",
                          "InfiniBand NDR", intra_bw=160e9,
                          source="DeepSeek-V3 report 3.2.2 (NVLink 160 GB/s, IB 50 GB/s)"),
    "a100-80gb": Hardware("a100-80gb", 80 * GiB, 312e12, "NVLink 3 (A100)", "InfiniBand HDR",
                          intra_bw=300e9, inter_bw=25e9, source="NVIDIA A100 SXM4 datasheet"),
}


def hardware(name: str) -> Hardware:
    if name == "cpu":
        return _cpu_profile()
    return HARDWARE[name]


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero: int
    schedule: str  # "-" without a pipeline, else 1f1b, interleaved, zb
    virtual: int  # model chunks per pipeline rank
    microbatches: int  # per step and dp rank (grad accumulation steps when pp = 1)
    micro_batch: int  # sequences per micro-batch
    checkpointing: str
    sp: bool

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        """e.g. "dp32 zero2 tp4+sp pp4 interleaved/v4 m32x1 selective": cp and ep when > 1;
        m{micro-batches}x{sequences each} (gradient accumulation without a pipeline)."""
        pipe = "" if self.pp == 1 else f" {self.schedule}" + (f"/v{self.virtual}" if self.virtual > 1 else "")
        extra = (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
        return (f"dp{self.dp} zero{self.zero} tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp}{pipe}"
                f"{extra} m{self.microbatches}x{self.micro_batch} {self.checkpointing}")


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [d for d in (2 ** i for i in range(31)) if d <= limit and n % d == 0]


def enumerate_layouts(spec: ModelSpec, gpus: int, hw: Hardware, global_batch: int,
                      node: int) -> list[Layout]:
    """Every layout the planner considers (before the memory check).

    tp: a power of two dividing the heads, at most a node (tensor parallel needs the node's link);
    cp: for real models while each rank keeps >= 4,096 tokens (below that, attention is too small
    a share to be worth splitting); pp: any divisor up to the layers; dp the rest; ep (MoE): powers
    of two dividing the experts and dp x cp (this library's mesh carves ep out of dp x cp); ZeRO 0-3
    (0 alone when dp x cp = 1: nothing to shard);
    micro-batch 1, 2, 4 or 8 sequences; schedules 1f1b, interleaved (v = 2, 4), zb, and on real
    models dualpipe (even pp, m >= 2 pp; ZeRO 0-2, as the library runs it); checkpointing
    none/selective/full on the tiny GPT, selective/full on real models (their FlashAttention never
    keeps the [s, s] scores: that is selective recomputation). Sequence parallel is on with tp > 1
    (it changes no states or bytes on the wire, only activations), except on the tiny GPT with
    experts: there the library's sp also sums the experts' gradients over tp every micro-step
    (theory.moe_sp_wire_bytes_per_step), traffic these predictions leave out, so its toy layouts
    keep plain tp. The tiny GPT on "cpu" keeps only layouts RunConfig accepts."""
    out = []
    max_tp = min(node, gpus)
    for tp in _powers_of_two_dividing(spec.heads, max_tp):
        if node % tp or (tp > 1 and not spec.toy and spec.kv % tp and tp % spec.kv):
            continue
        if spec.toy and spec.vocab % tp:
            continue
        for cp in _powers_of_two_dividing(gpus // tp, gpus):
            if gpus % (tp * cp):
                continue
            if cp > 1 and (spec.seq % cp or (not spec.toy and spec.seq // cp < 4096)):
                continue
            rest = gpus // (tp * cp)
            for pp in [d for d in range(1, min(rest, spec.layers) + 1) if rest % d == 0]:
                dp = rest // pp
                if global_batch % dp:
                    continue
                eps = [1] + ([e for e in _powers_of_two_dividing(spec.experts, dp * cp) if e > 1]
                             if spec.experts else [])
                per_dp = global_batch // dp
                for ep in eps:
                    for mbs in _powers_of_two_dividing(per_dp, 8):
                        m = per_dp // mbs
                        for schedule, v in _schedules(spec, pp, m):
                            for zero in ((0, 1, 2, 3)[:3 if schedule == "dualpipe" else 4]
                                         if dp * cp > 1 else (0,)):
                                for ckpt in (("none", "selective", "full") if spec.toy
                                             else ("selective", "full")):
                                    sp = tp > 1 and not (spec.toy and spec.experts)
                                    out.append(Layout(dp, tp, pp, cp, ep, zero, schedule, v, m,
                                                      mbs, ckpt, sp))
    return out


def _schedules(spec: ModelSpec, pp: int, m: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("-", 1)]
    out = [("1f1b", 1)]
    for v in (2, 4):
        if m >= pp and m % pp == 0 and pp * v <= spec.layers \
                and (not spec.toy or spec.layers % (pp * v) == 0):
            out.append(("interleaved", v))
    if m >= pp:
        out.append(("zb", 1))
    if not spec.toy and pp % 2 == 0 and m % 2 == 0 and m >= 2 * pp:  # (toy: lessons' matrix)
        out.append(("dualpipe", 2))
    return out


def run_config(spec: ModelSpec, lay: Layout, global_batch: int, precision: str = "fp32",
               optimizer: str = "adam", steps: int = 3):
    """The RunConfig that runs `lay` on the tiny GPT here (RunConfig.validate may refuse it)."""
    from ..config import RunConfig
    return RunConfig(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, zero=lay.zero,
                     schedule=lay.schedule if lay.pp > 1 else "1f1b",
                     virtual_stages=lay.virtual if lay.schedule == "interleaved" else 0,
                     microbatches=lay.microbatches if lay.pp > 1 else 4,
                     grad_accum=lay.microbatches if lay.pp == 1 else 1,
                     checkpointing=lay.checkpointing, sp=lay.sp, layers=spec.layers,
                     d_model=spec.d_model, heads=spec.heads, seq=spec.seq, vocab=spec.vocab,
                     experts=spec.experts, top_k=spec.top_k, moe_every=spec.moe_every,
                     batch=global_batch, steps=steps, precision=precision, optimizer=optimizer)


# ---------------------------------------------------------------------------------------------
# parameters per block, per stage
# ---------------------------------------------------------------------------------------------
def _norm_params(spec: ModelSpec) -> int:
    return (2 if spec.norm == "layernorm" else 1) * spec.d_model


def _attention_params(spec: ModelSpec) -> tuple[int, int]:
    """(split over tp, whole on every tp rank). Column-parallel Q/K/V (and their biases) and the
    row-parallel output are split; the output's bias is whole. MLA: the down-projections to the
    query and KV latents (and their norms) are whole, the up-projections and output split."""
    h, a = spec.d_model, spec.heads
    if spec.mla:
        q_lora, kv_lora, nope, rope, v = spec.mla
        split = q_lora * a * (nope + rope) + kv_lora * a * (nope + v) + a * v * h
        whole = h * q_lora + q_lora + h * (kv_lora + rope) + kv_lora
        return split, whole
    qkv = a * spec.dh + 2 * spec.kv * spec.dh
    split = h * qkv + a * spec.dh * h + (qkv if spec.bias else 0)
    return split, (h if spec.bias else 0)


def _mlp_params(spec: ModelSpec, f: int) -> tuple[int, int]:
    """(split, whole): SwiGLU 3hf; GELU MLP 2hf + f (fc bias, split) + h (proj bias, whole)."""
    h = spec.d_model
    if spec.gated:
        return 3 * h * f, 0
    return 2 * h * f + (f if spec.bias else 0), (h if spec.bias else 0)


def expert_params(spec: ModelSpec) -> int:
    """One routed expert (an MLP of expert_ffn): 8h^2 + 5h on the tiny GPT (theory.mlp_params)."""
    return sum(_mlp_params(spec, spec.fe))


def block_params(spec: ModelSpec, i: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(parameters of block i on one rank, of which routed-expert parameters). Split parts are
    divided by tp once, as theory.gpt_unit_sizes does; routed experts are whole on every tp rank
    (E/ep of them), the router (h x E, no bias) too."""
    split, whole = _attention_params(spec)
    whole += 2 * _norm_params(spec)
    experts = 0
    if spec.is_moe(i):
        whole += spec.d_model * spec.experts
        s, w = _mlp_params(spec, spec.fe)
        split, whole = split + spec.shared_experts * s, whole + spec.shared_experts * w
        experts = spec.experts // ep * expert_params(spec)
    else:
        s, w = _mlp_params(spec, spec.f)
        split, whole = split + s, whole + w
    return split // tp + whole + experts, experts


def embedding_params(spec: ModelSpec, tp: int = 1) -> int:
    return spec.vocab * spec.d_model // tp + (spec.seq * spec.d_model if spec.learned_positions else 0)


def head_params(spec: ModelSpec, tp: int = 1, pp: int = 1) -> int:
    """Final norm and output layer. A tied output layer is the embedding itself on one stage, and
    a copy on the last stage with pp > 1 (as Megatron-LM keeps it)."""
    out = 0 if spec.tied_embeddings and pp == 1 else spec.vocab * spec.d_model // tp
    return _norm_params(spec) + out


def param_count(spec: ModelSpec) -> int:
    """All parameters (every expert counted once, a tied table once)."""
    blocks = sum(block_params(spec, i, 1, 1)[0] for i in range(spec.layers))
    return embedding_params(spec) + blocks + head_params(spec)


def chunk_blocks(spec: ModelSpec, n_chunks: int) -> list[list[int]]:
    """The blocks of each model chunk, in model order. Equal chunks when they divide the layers
    (the tiny GPT, theory.pipeline_stage_units); otherwise the remainder goes to the middle chunks
    and the first and last (which hold the embedding and the head) get one block fewer, as Llama 3
    405B's 126 layers on 16 stages (Dubey et al., 2024, 3.3.2)."""
    L = spec.layers
    base, extra = divmod(L, n_chunks)
    sizes = [base] * n_chunks
    order = list(range(1, n_chunks - 1)) + [0, n_chunks - 1]
    for c in order[:extra]:
        sizes[c] += 1
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out


@functools.lru_cache(maxsize=4096)
def _stages(spec: ModelSpec, tp: int, pp: int, schedule: str, v: int, ep: int) -> tuple:
    """Per pipeline rank: (units: parameters per ZeRO-3 unit, experts: the routed-expert
    parameters inside each unit (0 outside MoE blocks), chunks: the blocks of each chunk it holds,
    holds_embedding, holds_head).
    A twin of placement.py's description, written for any ModelSpec (GQA, SwiGLU, MLA, shared
    experts: shapes the tiny GPT's placement does not have). On the tiny GPT it is proved equal to
    the placement, every rank's units and states on every layout of the composition matrix
    (tests/test_placement.py, check_planner)."""
    n_chunks = pp * v
    owner = chunk_owner(schedule if pp > 1 else "1f1b", pp, v)
    n_chunks //= directions(schedule)  # DualPipe: pp stages, each held twice (chunk c: stage c % pp)
    chunks = chunk_blocks(spec, n_chunks)
    out = []
    for r in range(pp):
        mine = sorted({c % n_chunks for c in range(len(owner)) if owner[c] == r})
        units, experts = [], []
        if 0 in mine:
            units.append(embedding_params(spec, tp))
            experts.append(0)
        for c in mine:
            for i in chunks[c]:
                p, e = block_params(spec, i, tp, ep)
                units.append(p)
                experts.append(e)
        if n_chunks - 1 in mine:
            units.append(head_params(spec, tp, pp))
            experts.append(0)
        out.append((tuple(units), tuple(experts), tuple(tuple(chunks[c]) for c in mine),
                    0 in mine, n_chunks - 1 in mine))
    return tuple(out)


def stage_states(units: tuple, experts: tuple, lay: Layout, precision: str,
                 optimizer: str) -> tuple[dict, dict]:
    """Model-state bytes of one rank and its data-parallel bytes per step, by theory's formulas
    in theory.run_theory's way (_rank_theory): with ep > 1 the dense parameters are ZeRO'd and
    averaged over dp x cp, the E/ep experts over (dp x cp)/ep; else all over dp x cp. `experts`:
    the routed-expert parameters inside each of `units`; with ep > 1 under ZeRO-3 each MoE
    layer's experts are a unit of their own (padded on their own), the rest of the block another.
    Returns (memory {params, grads, optimizer}, wire {"dp": bytes, "edp": bytes}). The twin of
    what the strategies own (placement.owned_by_rank), proved equal with _stages."""
    shard = lay.dp * lay.cp
    if lay.ep > 1 and any(experts):
        parts = [([u - e for u, e in zip(units, experts)], shard, "dp"),
                 ([e for e in experts if e], shard // lay.ep, "edp")]
    else:
        parts = [(list(units), shard, "dp")]
    memory, wire = {"params": 0, "grads": 0, "optimizer": 0}, {}
    for unit_sizes, group, axis in parts:
        count = sum(unit_sizes)
        states = theory.model_state_bytes(count, optimizer, precision, lay.zero, group, unit_sizes)
        for k in memory:
            memory[k] += states[k]
        if group > 1:
            if lay.zero == 0:
                b = theory.dp_wire_bytes_per_step(theory.BYTES_PER_PARAM[precision] * count, group)
            else:
                b = theory.zero_wire_bytes_per_step(lay.zero, count, precision, group, unit_sizes,
                                                    lay.microbatches)
            wire[axis] = wire.get(axis, 0) + b
    return memory, wire


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------
def layer_activation_bytes(s: int, b: int, h: int, a: int, checkpointing: str = "selective",
                           tp: int = 1, sp: bool = False, kv: int = 0, head_dim: int = 0,
                           v_head_dim: int = 0, ffn: int = 0, gated: bool = False,
                           dropout: bool = True, flash: bool = False, elem: int = 2,
                           routed: float = 0.0, expert_ffn: int = 0, shared: int = 0,
                           latent: int = 0) -> float:
    """Bytes one transformer layer keeps for backward, Korthikanti et al. (2022) counted op by op
    and generalised; with the defaults (kv = a, ffn = 4h, GELU, dropout, no flash) it equals
    theory.activation_bytes_per_layer (tests/test_planner.py checks that).
    Kept whole on every tp rank (split by tp with sequence parallel): the two norms' inputs, the
    attention and MLP inputs (4 sbh elements), two residual dropout masks (1 byte each).
    Split by tp: Q, K, V and the attention output (s b (a d + kv d + kv dv + a dv) elements), the
    MLP's hidden tensors (GELU: fc output and GELU output, 2 s b f; SwiGLU: gate, up and their
    product, 3 s b f). Attention core: 5 a s^2 b bytes (softmax, its dropout mask and output) unless
    recomputed (selective) or never stored (flash, which keeps a float32 log-sum-exp per row).
    MoE (uniform routing): `routed` expert computations per token (top-k) of expert_ffn, each
    keeping its dispatched input and its hidden tensors; `shared` experts as a dense MLP; routed
    experts are not split by tp (they are whole on every tp rank), only by sequence parallel.
    MLA: `latent` elements per token (query and KV latents) kept whole.
    Full checkpointing keeps the layer input only: 2 s b h bytes (/tp with sequence parallel)."""
    q = tp if sp else 1
    sbh = s * b * h
    if checkpointing == "full":
        return elem * sbh / q
    kv, d = kv or a, head_dim or h // a
    dv = v_head_dim or d
    f = ffn or 4 * h
    hidden = 3 if gated else 2
    whole = elem * (4 * sbh + latent * s * b) + (2 * sbh if dropout else 0)
    split = elem * s * b * (a * d + kv * d + kv * dv + a * dv)
    if routed or shared:
        split += elem * shared * hidden * s * b * expert_ffn
        whole += elem * routed * s * b * (h + hidden * expert_ffn)  # per token: k copies
    else:
        split += elem * hidden * s * b * f
    out = whole / q + split / tp
    if checkpointing == "none" and not flash:
        out += 5 * a * s * s * b / tp
    elif flash:
        out += 4 * b * (a / tp) * s
    return out


def block_activation_bytes(spec: ModelSpec, i: int, lay: Layout, elem: int) -> float:
    """Bytes block i keeps per micro-batch on one rank (its s/cp tokens)."""
    if spec.toy:  # the library's own block, exact (theory.gpt_activation_bytes_per_layer)
        return theory.gpt_activation_bytes_per_layer(spec.seq, lay.micro_batch, spec.d_model,
                                                     spec.heads, lay.checkpointing, elem, lay.tp,
                                                     lay.sp, lay.cp, "ring")
    s = spec.seq // lay.cp
    moe = spec.is_moe(i)
    dq = spec.mla[2] + spec.mla[3] if spec.mla else spec.dh
    dv = spec.mla[4] if spec.mla else spec.dh
    latent = spec.mla[0] + spec.mla[1] + spec.mla[3] if spec.mla else 0
    return layer_activation_bytes(s, lay.micro_batch, spec.d_model, spec.heads, lay.checkpointing,
                                  lay.tp, lay.sp, spec.kv, dq, dv, spec.f, spec.gated,
                                  spec.dropout, flash=True, elem=elem,
                                  routed=spec.top_k if moe else 0,
                                  expert_ffn=spec.fe if moe else 0,
                                  shared=spec.shared_experts if moe else 0, latent=latent)


def in_flight_per_rank(schedule: str, pp: int, m: int, v: int = 1) -> list[int]:
    """Micro-batches (x chunks) each pipeline rank holds at most, in closed form; equal to
    parallel.schedules.in_flight of the built schedule (tests/test_planner.py checks p <= 8),
    without building schedules of thousands of ops:
        1f1b:        min(p - r, m)                      (rank r's warm-up forwards + 1)
        zb (ZB-H1):  min(p, m) on every rank            (W ops keep the activations)
        interleaved: min(v m, 2 (p - r - 1) + (v - 1) p + 1)   (Megatron-LM's warm-up + 1)"""
    if pp == 1:
        return [1]
    if schedule == "zb":
        return [min(pp, m)] * pp
    if schedule == "interleaved":
        return [min(v * m, 2 * (pp - r - 1) + (v - 1) * pp + 1) for r in range(pp)]
    if schedule == "1f1b":
        return [min(pp - r, m) for r in range(pp)]
    if schedule == "dualpipe":  # the DeepSeek-V3 report's PP + 1 (checked for p <= 10, m >= 2p)
        return [pp + 1] * pp
    return list(in_flight(build_schedule(schedule, pp, m, v)))


def dual_paired_share(pp: int, m: int) -> float:
    """DualPipe: the share of a rank's forwards and backwards that run in F&B pairs
    (schedules.overlapped_pairs), whose communication (the experts' all-to-all, the pipeline's
    sends) runs while the other half of the pair computes. In closed form (tests/test_dualpipe.py
    counts the pairs of the built schedules): half rank h of R = p/2 with n = m/2 micro-batches per
    direction pairs 2(n - 2R + h + 1) times in phase 4 and R - h - 1 times in phase 5, of its 2n
    forwards; the ranks at the ends (h = 0) pair the fewest: (2n - 3R + 1) / 2n."""
    half, n = pp // 2, m // 2
    return (2 * n - 3 * half + 1) / (2 * n)


# ---------------------------------------------------------------------------------------------
# compute
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def block_flops_per_token(spec: ModelSpec, i: int) -> tuple[float, float]:
    """(forward matmul FLOPs of block i per token, of which the attention core). 2 FLOPs per
    weight a token meets (the routed experts: top-k of them, plus shared ones and the router),
    attention 2 s a d (QK^T) + 2 s a dv (AV) over the whole sequence (the usual convention of
    model FLOPs: no discount for the causal mask)."""
    h, a = spec.d_model, spec.heads
    split, whole = _attention_params(spec)
    weights = split + (spec.d_model * (spec.mla[0] + spec.mla[1] + spec.mla[3]) if spec.mla else 0)
    if spec.is_moe(i):
        weights += (spec.top_k + spec.shared_experts) * 3 * h * spec.fe if spec.gated \
            else (spec.top_k + spec.shared_experts) * 2 * h * spec.fe
        weights += h * spec.experts
    else:
        weights += (3 if spec.gated else 2) * h * spec.f
    dq = spec.mla[2] + spec.mla[3] if spec.mla else spec.dh
    dv = spec.mla[4] if spec.mla else spec.dh
    core = 2 * spec.seq * a * (dq + dv)
    return 2 * weights + core, core


@functools.lru_cache(maxsize=None)
def model_flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token, forward + backward = 3 x forward (at_scale.matmul_time's 6 per
    parameter): what MFU divides by (recomputation is not counted in it)."""
    fwd = sum(block_flops_per_token(spec, i)[0] for i in range(spec.layers))
    return 3 * (fwd + 2 * spec.d_model * spec.vocab)


# ---------------------------------------------------------------------------------------------
# one layout's prediction
# ---------------------------------------------------------------------------------------------
def _inside_node(span: int, node: int) -> bool:
    return span <= node


def _hop_time(hw: Hardware, inside: bool, ranks: int) -> float:
    if hw.cores:  # ranks sharing cores: a hop waits for the receiver to be scheduled
        return hw.latency_intra_s if ranks <= hw.cores else hw.shared_hop_s * ranks / hw.cores
    return hw.latency_intra_s if inside else hw.latency_inter_s


@functools.lru_cache(maxsize=None)
def _stage_flops(spec: ModelSpec, blocks: tuple, has_head: bool) -> tuple[float, float]:
    """(forward FLOPs per token of a stage's blocks and head, of which attention cores)."""
    per = [block_flops_per_token(spec, i) for i in blocks]
    head = has_head * 2 * spec.d_model * spec.vocab
    return sum(f for f, _ in per) + head, sum(c for _, c in per)


@functools.lru_cache(maxsize=None)
def _chunk_bytes(spec: ModelSpec, chunk: tuple, lay: Layout, elem: int) -> float:
    return sum(block_activation_bytes(spec, i, lay, elem) for i in chunk)


@functools.lru_cache(maxsize=None)
def _states(units: tuple, experts: tuple, lay: Layout, precision: str, optimizer: str):
    return stage_states(units, experts, lay, precision, optimizer)


def _key(ns: SimpleNamespace) -> tuple:
    return tuple(sorted(vars(ns).items()))


# theory's per-step byte formulas, remembered: the pipeline's middle ranks all ask the same
@functools.lru_cache(maxsize=None)
def _tp_bytes(key: tuple, blocks: int, embed: bool, head: bool, moe: int) -> float:
    return theory.tp_wire_bytes_per_step(SimpleNamespace(**dict(key)), blocks=blocks, embed=embed,
                                         head=head, moe=moe)


@functools.lru_cache(maxsize=None)
def _cp_bytes(key: tuple, blocks: int) -> float:
    return theory.cp_wire_bytes_per_step(SimpleNamespace(**dict(key)), blocks=blocks)


@functools.lru_cache(maxsize=None)
def _ep_bytes(key: tuple, blocks: tuple) -> float:
    return theory.ep_wire_bytes_per_step(SimpleNamespace(**dict(key)), list(blocks))


@functools.lru_cache(maxsize=None)
def _pp_bytes(owner: tuple, rank: int, m: int, boundary: int, stages: int) -> int:
    return theory.pipeline_p2p_bytes_per_step(list(owner), rank, m, boundary, stages)


def _activation_layout(lay: Layout) -> Layout:
    """The fields activations depend on (a cache key): not dp, pp, ep, ZeRO or the schedule."""
    return Layout(1, lay.tp, 1, lay.cp, 1, 0, "-", 1, 1, lay.micro_batch, lay.checkpointing, lay.sp)


def _states_layout(lay: Layout) -> Layout:
    return Layout(lay.dp, 1, 1, lay.cp, lay.ep, lay.zero, "-", 1, lay.microbatches, 1, "none", False)


def predict(spec: ModelSpec, lay: Layout, hw: Hardware, global_batch: int, node: int = 0,
            precision: str = "bf16-mixed", optimizer: str = "adam") -> dict:
    """Theory for one layout: memory per rank (every pipeline rank), bytes and seconds per step on
    each axis, compute, bubble, step time and MFU. Nothing here is measured."""
    node = node or hw.gpus_per_node
    elem = theory.BYTES_PER_PARAM[precision]
    stages = _stages(spec, lay.tp, lay.pp, lay.schedule, lay.virtual, lay.ep)
    dual = lay.schedule == "dualpipe"
    m_rank = lay.microbatches // (2 if dual else 1)  # DualPipe: each stage copy sees half of them
    flight = in_flight_per_rank(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
    ns = SimpleNamespace(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, sp=lay.sp,
                         batch=global_batch // (2 if dual else 1),  # (the sequences a copy sees)
                         seq=spec.seq, d_model=spec.d_model, heads=spec.heads,
                         layers=spec.layers, vocab=spec.vocab, precision=precision,
                         checkpointing=lay.checkpointing, cp_impl="ring",
                         microbatches=m_rank, grad_accum=m_rank,
                         experts=spec.experts, top_k=spec.top_k,
                         moe_every=spec.moe_every if spec.toy else 1)
    ep_ns = SimpleNamespace(**{**vars(ns), "seq": spec.seq // lay.cp, "moe_every": 1})
    boundary = lay.micro_batch * (spec.seq // (lay.cp * (lay.tp if lay.sp else 1))) \
        * spec.d_model * elem
    owner = tuple(chunk_owner(lay.schedule if lay.pp > 1 else "1f1b", lay.pp, lay.virtual))
    # GQA / MLA: K and V blocks of kv heads (theory.cp_wire_bytes_per_step counts a heads of h/a)
    kv_share = (spec.kv * spec.dh / spec.d_model) if not spec.mla \
        else spec.heads * (spec.mla[2] + spec.mla[3] + spec.mla[4]) / 2 / spec.d_model
    act_lay, states_lay = _activation_layout(lay), _states_layout(lay)
    recompute_lay = dataclasses.replace(act_lay, checkpointing="selective")
    per_rank, wires, micro_flops = [], [], []
    tokens_micro = lay.micro_batch * spec.seq / lay.cp  # this rank's tokens per micro-batch
    for r, (units, experts, chunks, has_embed, has_head) in enumerate(stages):
        memory, wire = _states(units, experts, states_lay, precision, optimizer)
        memory, wire = dict(memory), dict(wire)
        blocks = tuple(i for c in chunks for i in c)
        acts = flight[r] * max(_chunk_bytes(spec, c, act_lay, elem) for c in chunks)
        if lay.checkpointing == "full" and not spec.toy:  # one layer recomputed at a time
            acts += _chunk_bytes(spec, blocks[-1:], recompute_lay, elem)
        logits = has_head * tokens_micro * spec.vocab / lay.tp * (elem + 8)  # + fp32 softmax, grad
        transient = 2 * max(units) * elem * (lay.zero == 3)  # ZeRO-3: a unit gathered, one prefetched
        memory.update(activations=acts, logits=logits, transient=transient)
        memory["total"] = sum(memory.values())
        per_rank.append(memory)
        moe_here = [i for i in blocks if spec.is_moe(i)]
        if lay.tp > 1:
            wire["tp"] = _tp_bytes(_key(ns), len(blocks), has_embed, has_head, len(moe_here))
        if lay.cp > 1:
            wire["cp"] = kv_share * _cp_bytes(_key(ns), len(blocks))
        if lay.ep > 1 and moe_here:
            wire["ep"] = _ep_bytes(_key(ep_ns), tuple(moe_here))
        if lay.pp > 1:
            wire["pp"] = _pp_bytes(owner, r, lay.microbatches, boundary, len(owner) // (1 + dual))
        if dual:  # the two copies of a stage sum their gradients before the step
            wire["pp_copies"] = sum(units) * elem
        wires.append(wire)
        fwd, core = _stage_flops(spec, blocks, has_head)
        recompute = {"full": fwd - has_head * 2 * spec.d_model * spec.vocab,
                     "selective": core}.get(lay.checkpointing, 0)
        micro_flops.append({"total": (3 * fwd + recompute) * tokens_micro / lay.tp,
                            "attention": 3 * core * tokens_micro / lay.tp,
                            # seconds that do not scale with FLOPs (measured profiles only)
                            "fixed": len(blocks) * (hw.block_overhead_s + {
                                "full": hw.full_recompute_block_s,
                                "selective": hw.selective_recompute_block_s}.get(
                                    lay.checkpointing, 0.0))
                            + (len(chunks) if lay.pp > 1 else 0) * hw.chunk_overhead_s})

    peak = hw.flops * hw.matmul_efficiency
    # the slowest stage sets the pace; each block also pays its ops' fixed cost (block_overhead_s)
    t_micro = max(f["total"] / peak + f["fixed"] for f in micro_flops)
    t_attn = max(f["attention"] for f in micro_flops) / peak
    bubble = theory.bubble_fraction(lay.schedule, lay.pp, lay.microbatches, lay.virtual) \
        if lay.pp > 1 else 0.0
    shared_cores = bool(hw.cores) and lay.world > hw.cores
    # the optimizer step (measured profiles): each rank pays the share of the whole model's
    # optimizer states it holds (ZeRO and tp / pp shard them)
    opt = [0.0]
    if hw.optimizer_s:
        whole = theory.model_state_bytes(param_count(spec), optimizer, precision)["optimizer"]
        opt = [hw.optimizer_s * m["optimizer"] / whole for m in per_rank]
    if shared_cores:  # all ranks' work on the cores there are; an idle rank frees its core
        replicas = m_rank * lay.dp * lay.cp * lay.tp
        total = sum(f["total"] / peak + f["fixed"] for f in micro_flops)
        compute = (total * replicas + sum(opt) * (lay.world // lay.pp)) / hw.cores
    else:
        compute = t_micro * m_rank / (1 - bubble) + max(opt)
    most = {"blocks": max(len([i for c in s[2] for i in c]) for s in stages),
            "moe_blocks": max(len([i for c in s[2] for i in c if spec.is_moe(i)]) for s in stages),
            "units": max(len(s[0]) for s in stages)}
    comm = _comm_times(spec, lay, hw, node, wires, boundary, t_micro, t_attn, shared_cores, most)
    # each comm call's own CPU (measured profiles): the busiest rank's calls, on shared cores
    # every rank's (as many) over the cores; point-to-point calls at their own measured cost
    calls = _calls_cpu(hw, lay, comm, shared_cores)
    compute += calls * (lay.world / hw.cores if shared_cores else 1)
    step = compute + sum(c["exposed_s"] for c in comm.values())
    tokens = global_batch * spec.seq
    mfu = model_flops_per_token(spec) * tokens / (lay.world * hw.flops * step)
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["total"])
    return {"memory_per_rank": per_rank, "memory_peak_bytes": per_rank[worst]["total"],
            "memory_peak_stage": worst, "fits": per_rank[worst]["total"] <= hw.usable_bytes,
            "compute_s": compute, "bubble": bubble, "comm": comm, "step_s": step, "mfu": mfu,
            "tokens_per_step": tokens, "cores_shared": shared_cores}


def _calls_cpu(hw: Hardware, lay: Layout, comm: dict, shared_cores: bool) -> float:
    """The busiest rank's comm calls' own CPU per step (measured profiles): point-to-point calls
    (cp, pp) at p2p_call_cpu_s, tp's with sp at sp_call_cpu_s, the rest at call_cpu_s and per
    byte; where ranks share the cores, the costs measured with them shared, where measured."""
    shared = shared_cores and hw.shared_world
    p2p = hw.shared_p2p_call_cpu_s if shared else hw.p2p_call_cpu_s
    sp = hw.shared_sp_call_cpu_s if shared else hw.sp_call_cpu_s
    per_call, per_byte = ((hw.shared_call_cpu_s, 0.0) if shared else
                          (hw.call_cpu_s, hw.call_cpu_s_per_byte))
    return sum(c["calls"] * p2p if a in ("cp", "pp") else
               c["calls"] * sp if a == "tp" and lay.sp and sp else
               c["calls"] * per_call + c["bytes"] * per_byte
               for a, c in comm.items())


def _tp_calls(blocks: int, lay: Layout) -> int:
    """A tp rank's comm calls per micro-step, as our tensor parallel makes them (parallel/tensor.py,
    counted by kind in _tp_collectives on the toy). A pipeline stage is charged the whole model's
    fixed calls (its share of the embedding's and head's is less: tp2 pp2 sp counts 63, this 66)."""
    return sum(_tp_collectives(blocks, lay, toy=True))


def _comm_times(spec, lay, hw, node, wires, boundary, t_micro, t_attn, shared_cores,
                most: dict) -> dict:
    """Seconds per step on each axis: the busiest rank's bytes over the axis's link, plus a
    latency per ring hop; and how much of it is exposed (not hidden behind compute):
    tp and ep: all of it (their results are needed by the next op); cp: what attention's compute
    cannot hide (ring attention overlaps each hop with a block of attention); pp: the pipeline's
    fill and drain, 2 (chunks - 1) boundary transfers in a row (steady-state sends overlap);
    dp / ZeRO-1/2: what one micro-batch's compute cannot hide (the gradients' reduce during the
    last backward, ZeRO's parameter all-gather during the next forward); ZeRO-3: per micro-step
    what that micro-step's compute cannot hide. On cores shared by more ranks than cores,
    nothing overlaps (pp: the busiest rank's messages, or the fill and drain chain where longer).
    DualPipe (DeepSeek-V3): in its F&B pairs one micro-batch's all-to-all and pipeline sends run
    while the other computes, so of the ep and pp seconds the paired share (dual_paired_share) is
    hidden up to the paired compute, the rest exposed; the two copies of each stage exchange their
    gradients once (pp_copies, ranks i and p-1-i, hidden like dp's behind the last backward)."""
    dual = lay.schedule == "dualpipe"
    spans = {"tp": lay.tp, "cp": lay.tp * lay.cp, "dp": lay.world // lay.pp,
             "edp": lay.world // lay.pp, "ep": lay.tp * lay.ep, "pp": lay.world,
             "pp_copies": lay.world}
    sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp * lay.cp, "ep": lay.ep,
             "edp": lay.dp * lay.cp // lay.ep, "pp": lay.pp, "pp_copies": 2}
    m, blocks = lay.microbatches // (2 if dual else 1), most["blocks"]  # the busiest rank's
    share = dual_paired_share(lay.pp, lay.microbatches) if dual else 0.0
    out = {}
    for axis in ("tp", "cp", "ep", "pp", "dp", "edp", "pp_copies"):
        nbytes = max(w.get(axis, 0) for w in wires)
        if not nbytes:
            continue
        inside = _inside_node(spans[axis], node)
        n = sizes[axis]
        # (op, ring hops, share of the bytes) of the busiest rank's calls on this axis
        parts = _axis_parts(axis, spec, lay, n, m, blocks, most, nbytes, boundary)
        hops = sum(h for _, h, _ in parts)
        fits = {op: _link(hw, op, lay.world, n, inside) for op, _, _ in parts}
        seconds = sum(h * fits[op][0] + s * nbytes * fits[op][1] for op, h, s in parts)
        calls = {"tp": m * _tp_calls(blocks, lay),  # the busiest rank's comm calls per step
                 "cp": 2 * hops, "pp": 2 * hops,  # a send and a receive per ring step / message
                 "ep": hops / (n - 1), "pp_copies": 2,
                 }.get(axis, hops / (n - 1) / (2 if lay.zero == 0 else 1))
        chain = 0.0
        if axis == "pp":  # fill and drain: 2 (chunks - 1) boundary messages one after another
            alpha, beta = fits["p2p"]
            chain = 2 * (lay.pp * lay.virtual - 1) * (boundary * beta + alpha)
        if dual and not shared_cores and axis in ("ep", "pp"):
            exposed = seconds * (1 - share) + max(0.0, seconds * share - t_micro * m * share)
        elif shared_cores and axis == "pp":  # nothing overlaps, and the chain is serial anyway
            exposed = max(seconds, chain)
        elif shared_cores or axis in ("tp", "ep"):
            exposed = seconds
        elif axis == "cp":
            exposed = max(0.0, seconds - t_attn * m)
        elif axis == "pp":
            exposed = chain
        elif axis == "pp_copies":
            exposed = max(0.0, seconds - t_micro)
        elif lay.zero == 3:
            exposed = m * max(0.0, seconds / m - t_micro)
        else:
            exposed = max(0.0, seconds - t_micro)
        out[axis] = {"bytes": nbytes, "seconds": seconds, "exposed_s": exposed, "calls": calls,
                     "link": (hw.intra if inside else hw.inter), "group": n, "hops": hops}
    return out


def _link(hw: Hardware, op: str, ranks: int, group: int, inside: bool) -> tuple[float, float]:
    """(seconds per ring hop, seconds per byte on the wire) of `op` in groups of `group` ranks in
    a layout of `ranks` ranks: the profile's links fitted per op with the op run in groups of that
    size, all at once, among the measured world nearest `ranks` (measured profiles: with ranks
    sharing cores a hop waits for its ranks to be scheduled, which depends both on how many
    processes share the cores and on how many of them one call spans), else its latency and
    bandwidth."""
    got = links.link_at(hw.links, op, ranks, group) if hw.links else None
    if got:
        return got[0], got[1]
    return _hop_time(hw, inside, ranks), 1.0 / hw.bandwidth(inside)


def _tp_collectives(blocks: int, lay: Layout, toy: bool) -> tuple[float, float]:
    """(all-reduces, all-gathers + reduce-scatters) a tp rank makes per micro-step. Without sp:
    all-reduces only, 4 per block (g forward, f backward, attention and MLP) + 5 (the embedding's,
    the head's, cross-entropy's 3), 1 more per block recomputed under full checkpointing. With sp
    on the toy: 4 all-gathers and 4 reduce-scatters per block + 2 each (embedding, head), 3 more
    per block recomputed under full checkpointing; all-reduces: 6 per block (2 norms' weight and
    bias, 2 output biases) and 3 (the positions and the final norm) for the replicated parameters'
    gradients (parallel/tensor.py's sum_gradients_over_tp, every backward) and cross-entropy's 3. Real
    models (Megatron) reduce those gradients once per step, beside the data-parallel sync: there
    an all-gather + reduce-scatter pair is counted as the all-reduce it replaces."""
    full = lay.checkpointing == "full"
    if lay.sp and toy:
        return 6 * blocks + 6, 8 * blocks + 4 + 3 * blocks * full
    return 4 * blocks + 5 + blocks * full, 0


def _axis_parts(axis, spec, lay, n, m, blocks, most, nbytes, boundary) -> list[tuple]:
    """The busiest rank's calls on one axis per step, by op: [(op, ring hops, share of the
    axis's bytes)]; hops as links.hops counts them (all-reduce 2(n-1), all-gather,
    reduce-scatter and all-to-all n-1, a point-to-point message 1)."""
    if axis == "tp":
        ar, agrs = _tp_collectives(blocks, lay, spec.toy)
        if not agrs:
            return [("all_reduce", m * ar * 2 * (n - 1), 1.0)]
        half = m * agrs / 2 * (n - 1)  # as many all-gathers as reduce-scatters
        return [("all_gather", half, 0.5), ("reduce_scatter", half, 0.5),
                ("all_reduce", m * ar * 2 * (n - 1), 0.0)]  # (their bytes: norms and biases)
    if axis == "cp":  # ring: (c-1) forward, c backward (+ c-1 recomputed) per block
        return [("p2p", m * blocks * ((n - 1) * (2 + (lay.checkpointing != "none")) + 1), 1.0)]
    if axis == "ep":  # 4 all-to-alls and a counts exchange per MoE block
        return [("all_to_all", m * most["moe_blocks"] * 5 * (n - 1), 1.0)]
    if axis == "pp":  # every message the busiest rank sends (each a boundary tensor)
        return [("p2p", round(nbytes / boundary), 1.0)]
    if axis == "pp_copies":  # one exchange with the mirror rank
        return [("p2p", 1, 1.0)]
    # dp / edp: buckets of 25 MiB (0.25 MiB on the toy, RunConfig's), one ring each way
    bucket = (0.25 if spec.toy else 25) * 2 ** 20
    if lay.zero == 3:  # per unit and micro-step: gathered for forward and backward, grads scattered
        calls = most["units"] * m
        return [("all_gather", 2 * calls * (n - 1), 2 / 3), ("reduce_scatter", calls * (n - 1), 1 / 3)]
    calls = math.ceil(nbytes / 2 / bucket)
    if lay.zero in (1, 2):  # the toy: one flat reduce-scatter and all-gather (parallel/zero.py)
        calls = 1 if spec.toy else calls
        return [("reduce_scatter", calls * (n - 1), 0.5), ("all_gather", calls * (n - 1), 0.5)]
    return [("all_reduce", calls * 2 * (n - 1), 1.0)]


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------
class PlanError(ValueError):
    """Bad planner input: one line naming the flag and the fix."""


def plan(spec: ModelSpec, gpus: int, hw: Hardware, global_batch: int | None = None,
         node: int = 0, precision: str | None = None, optimizer: str = "adam",
         top: int = 10, variants: bool = False) -> dict:
    """Every layout considered, predicted; those that fit ranked by step time (then memory).

    Returns {"model", "hardware", "considered", "fit", "layouts": the top `top` to show (each
    degree tuple dp/tp/pp/cp/ep once, at its best ZeRO stage, schedule, micro-batching and
    checkpointing; every variant with `variants`), "all": every fitting (Layout, prediction),
    ranked (for benchmarks), "closest": the layout needing the least memory when none fits}."""
    node = node or min(hw.gpus_per_node, gpus)
    global_batch = spec.global_batch if global_batch is None else global_batch
    precision = precision or ("fp32" if spec.toy else "bf16-mixed")
    _check_inputs(spec, gpus, hw, global_batch, node)
    layouts = enumerate_layouts(spec, gpus, hw, global_batch, node)
    if spec.toy and hw.cores:
        layouts = [lay for lay in layouts if _runnable(spec, lay, global_batch, precision, optimizer)]
    ranked, closest = [], None
    for lay in layouts:
        p = predict(spec, lay, hw, global_batch, node, precision, optimizer)
        if p["fits"]:
            ranked.append((lay, p))
        elif closest is None or p["memory_peak_bytes"] < closest[1]["memory_peak_bytes"]:
            closest = (lay, p)
    ranked.sort(key=lambda lp: (lp[1]["step_s"], lp[1]["memory_peak_bytes"]))
    shown, seen = [], set()
    for i, (lay, p) in enumerate(ranked):
        degrees = (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep)
        if variants or degrees not in seen:
            seen.add(degrees)
            shown.append((i + 1, lay, p))
    return {"model": _model_summary(spec), "hardware": _hardware_summary(hw, gpus, node),
            "global_batch": global_batch, "precision": precision, "optimizer": optimizer,
            "considered": len(layouts), "fit": len(ranked), "degree_tuples": len(seen),
            "variants": variants,
            "layouts": [_entry(n + 1, lay, p, i) for n, (i, lay, p) in enumerate(shown[:top])],
            "all": ranked,
            "closest": None if ranked or closest is None else _entry(None, *closest)}


def _runnable(spec, lay, global_batch, precision, optimizer) -> bool:
    """RunConfig accepts it and it fits this machine's memory (the layouts the library refuses
    are not ranked for the tiny GPT)."""
    from ..config import ConfigError
    from ..runtime.preflight import check_fits
    try:
        check_fits(run_config(spec, lay, global_batch, precision, optimizer).validate())
        return True
    except ConfigError:
        return False


def _check_inputs(spec, gpus, hw, global_batch, node) -> None:
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: must be a whole number >= 1")
    if node < 1 or (gpus > node and gpus % node):
        raise PlanError(f"--gpus {gpus}: must be a multiple of --nodes-of {node} (whole nodes) "
                        f"or fit in one node")
    if global_batch < 1:
        raise PlanError(f"--global-batch {global_batch}: must be a whole number >= 1 (sequences)")
    if spec.d_model % spec.heads:
        raise PlanError(f"--d-model {spec.d_model}: must be divisible by --heads {spec.heads}")
    if spec.experts and spec.top_k > spec.experts:
        raise PlanError(f"--top-k {spec.top_k}: must be at most --experts {spec.experts}")
    if spec.toy and hw.cores and gpus > 16:
        raise PlanError(f"--gpus {gpus} with --gpu cpu: local runs take at most 16 ranks; "
                        f"plan for a GPU (--gpu h100-80gb) instead")


def _entry(rank, lay: Layout, p: dict, rank_all: int | None = None) -> dict:
    """One ranked layout for print and JSON. Every number under "theory" is a prediction."""
    mem = p["memory_per_rank"][p["memory_peak_stage"]]
    return {"rank": rank, "rank_among_all_variants": rank_all, "layout": dataclasses.asdict(lay),
            "describe": lay.describe(),
            "theory": {"memory_bytes_per_gpu": {k: int(round(v)) for k, v in mem.items()},
                       "memory_peak_pipeline_rank": p["memory_peak_stage"],
                       "compute_s": p["compute_s"], "bubble": p["bubble"],
                       "comm": {a: {k: (round(v, 9) if isinstance(v, float) else v)
                                    for k, v in c.items()} for a, c in p["comm"].items()},
                       "step_s": p["step_s"], "mfu": p["mfu"],
                       "tokens_per_s": p["tokens_per_step"] / p["step_s"],
                       "ranks_share_cores": p["cores_shared"]}}


def layout_entry(lay: Layout, p: dict, rank_all: int | None = None) -> dict:
    """One layout's entry as plan()'s "layouts" list it (theory only), for a layout picked from
    plan()["all"] (rank_all: its place there, from 1) or predicted on its own."""
    return _entry(None, lay, p, rank_all)


def _model_summary(spec: ModelSpec) -> dict:
    return {"name": spec.name, "parameters": param_count(spec), "layers": spec.layers,
            "d_model": spec.d_model, "heads": spec.heads, "kv_heads": spec.kv,
            "ffn": spec.f, "gated_mlp": spec.gated, "vocab": spec.vocab, "seq": spec.seq,
            "experts": spec.experts, "top_k": spec.top_k if spec.experts else 0,
            "flops_per_token": model_flops_per_token(spec), "source": spec.source}


def _hardware_summary(hw: Hardware, gpus: int, node: int) -> dict:
    return {"gpu": hw.name, "gpus": gpus, "gpus_per_node": node,
            "memory_bytes": hw.memory_bytes, "usable_bytes": hw.usable_bytes,
            "peak_flops": hw.flops, "matmul_efficiency": hw.matmul_efficiency,
            "intra_node": {"link": hw.intra, "bytes_per_s": hw.bandwidth(True)},
            "inter_node": {"link": hw.inter, "bytes_per_s": hw.bandwidth(False)},
            "cores": hw.cores or None, "source": hw.source}


def _size(n: float) -> str:
    """Bytes for people: decimal GB / MB / kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _capacity(n: float) -> str:
    return f"{n / GiB:.0f} GiB" if n % GiB == 0 else _size(n)


def format_plan(result: dict) -> str:
    m, hw = result["model"], result["hardware"]
    moe = f", {m['experts']} experts top-{m['top_k']}" if m["experts"] else ""
    size = f"{m['parameters'] / 1e9:.1f}B" if m["parameters"] >= 1e8 else f"{m['parameters']:,}"
    if hw["cores"]:
        machine = (f"on {hw['gpus']} local ranks of this machine ({hw['cores']} cores; assumed "
                   f"{hw['peak_flops'] / 1e9:.0f} GFLOP/s per core, loopback "
                   f"{hw['intra_node']['bytes_per_s'] / 1e9:.0f} GB/s)")
    else:
        machine = (f"on {hw['gpus']} x {hw['gpu']} ({_capacity(hw['memory_bytes'])}, "
                   f"{hw['peak_flops'] / 1e12:.0f} TFLOP/s peak, {hw['matmul_efficiency']:.0%} "
                   f"of it sustained), nodes of {hw['gpus_per_node']}: {hw['intra_node']['link']} "
                   f"{hw['intra_node']['bytes_per_s'] / 1e9:.0f} GB/s inside, "
                   f"{hw['inter_node']['link']} {hw['inter_node']['bytes_per_s'] / 1e9:.0f} GB/s "
                   f"per GPU between")
    which = ("every variant" if result["variants"] else
             f"each of {result['degree_tuples']:,} dp/tp/pp/cp/ep tuples at its best variant "
             f"(--variants: all)")
    lines = [
        f"plan: {m['name']} ({size} parameters, {m['layers']} layers, d_model {m['d_model']}, "
        f"{m['heads']} heads / {m['kv_heads']} kv, {'SwiGLU' if m['gated_mlp'] else 'MLP'} "
        f"{m['ffn']}, vocab {m['vocab']}{moe}), seq {m['seq']}, global batch "
        f"{result['global_batch']:,} sequences, {result['precision']} {result['optimizer']}",
        machine,
        "every number below is theory (planner.py on theory.py's formulas), none is measured",
        f"{result['considered']:,} layouts considered, {result['fit']:,} fit in "
        f"{_size(hw['usable_bytes'])} per GPU; ranked by predicted step time, {which}:",
        f"  #  {'layout':<60} {'memory/GPU':>9} = {'states':>8} + {'acts':>8}  {'compute':>8}"
        f"  {'exposed comm s (tp, cp, ep, pp, dp)':<39} bubble   step s    MFU",
    ]
    if result["fit"] and not result["layouts"]:  # --top 0: the counts above, no table
        lines[-1] = "(--top 0: none listed; --top N lists the N fastest)"
    for e in result["layouts"]:
        t = e["theory"]
        mem = t["memory_bytes_per_gpu"]
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        others = mem["total"] - states
        exposed = {a: c["exposed_s"] for a, c in t["comm"].items()}
        if "edp" in exposed:  # the experts' data parallel beside the dense parameters'
            exposed["dp"] = exposed.get("dp", 0) + exposed.pop("edp")
        if "pp_copies" in exposed:  # DualPipe's two copies of a stage summing their gradients
            exposed["pp"] = exposed.get("pp", 0) + exposed.pop("pp_copies")
        comm = " ".join(f"{exposed[a]:7.3g}" if a in exposed else f"{'-':>7}"
                        for a in ("tp", "cp", "ep", "pp", "dp"))
        lines.append(f"{e['rank']:>3}  {e['describe']:<60} {_size(mem['total']):>9} = "
                     f"{_size(states):>8} + {_size(others):>8}  {t['compute_s']:7.3g}s  {comm}  "
                     f"{t['bubble']:6.1%}  {t['step_s']:7.3g}s  {t['mfu']:5.1%}")
    if any(e["theory"]["ranks_share_cores"] for e in result["layouts"]):
        lines.append(f"(ranks share {hw['cores']} cores: compute is all ranks' work over the cores, "
                     f"a bubble costs nothing, nothing overlaps, and a ring hop waits for its "
                     f"receiver to be scheduled)")
    if not result["fit"]:
        c = result["closest"]
        lines.append("no layout fits" + (
            f": the least memory is {_size(c['theory']['memory_bytes_per_gpu']['total'])} per GPU "
            f"({c['describe']}); add GPUs or take a GPU with more memory" if c else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# published layouts
# ---------------------------------------------------------------------------------------------
# Published large runs. Llama 3 405B: Dubey et al., 2024, "The Llama 3 Herd of Models", Table 4:
# 8,192 H100s as tp8 cp1 pp16 (dp64), 16,384 as tp8 cp1 pp16 (dp128), both at seq 8,192 and 16M
# tokens per batch (2,048 sequences), and 16,384 as tp8 cp16 pp16 (dp8) at seq 131,072 (16M
# tokens: 128 sequences); 430, 400 and 380 TFLOP/s per GPU (43%, 40% and 38% of 989). FSDP over
# dp, an interleaved schedule. Megatron-LM's GPT-3 175B: its published example
# examples/gpt3/train_gpt3_175b_distributed.sh (96 layers, hidden 12,288, 96 heads, seq 2,048,
# tp8 pp16, micro-batch 1, global batch 1,536, fp16); the script leaves the GPU count to the
# user: 1,024 A100-80GB assumed here (dp8). DeepSeek-V3: its technical report, 3.2: 2,048 H800s
# as pp16 (DualPipe), ep64 over 8 nodes, ZeRO-1 data parallel, no tensor parallel; 4.2: batch
# up to 15,360 sequences of 4,096. NVIDIA's recipes, as the course's sources quote them: Llama 3
# 70B on 64 GPUs as tp4 pp4 cp2 dp2 (batch not quoted: 128 assumed), DeepSeek-V3 on 1,024 GPUs
# as tp2 pp16 ep64.
PUBLISHED = [
    {"name": "Llama 3 405B, 16,384 H100 (Dubey et al. 2024, Table 4)", "model": "llama3-405b",
     "gpu": "h100-80gb", "gpus": 16384, "global_batch": 2048, "seq": 8192,
     "layout": {"tp": 8, "pp": 16, "cp": 1, "dp": 128, "ep": 1}, "published_tflops": 400,
     "note": "the planner prefers deeper pipelines with more micro-batches (its bubble formulas "
             "take F, B and W as equal and steady-state transfers as hidden; small micro-batches "
             "cost nothing in its matmul efficiency); Meta's pp16 is within its top tuples"},
    {"name": "Llama 3 405B, 8,192 H100 (Dubey et al. 2024, Table 4)", "model": "llama3-405b",
     "gpu": "h100-80gb", "gpus": 8192, "global_batch": 2048, "seq": 8192,
     "layout": {"tp": 8, "pp": 16, "cp": 1, "dp": 64, "ep": 1}, "published_tflops": 430,
     "note": "as above"},
    {"name": "Llama 3 405B, 131K context, 16,384 H100 (Dubey et al. 2024, Table 4)",
     "model": "llama3-405b", "gpu": "h100-80gb", "gpus": 16384, "global_batch": 128,
     "seq": 131072, "layout": {"tp": 8, "pp": 16, "cp": 16, "dp": 8, "ep": 1},
     "published_tflops": 380, "note": "cp16: each rank keeps 8,192 of the 131,072 tokens"},
    {"name": "GPT-3 175B, Megatron-LM's example script (1,024 A100 assumed)", "model": "gpt3-175b",
     "gpu": "a100-80gb", "gpus": 1024, "global_batch": 1536, "seq": 2048,
     "layout": {"tp": 8, "pp": 16, "cp": 1, "dp": 8, "ep": 1}, "published_tflops": None,
     "note": "the script fixes tp8 pp16 and the batch; the GPU count is assumed"},
    {"name": "DeepSeek-V3, 2,048 H800 (DeepSeek-V3 report, 3.2)", "model": "deepseek-v3",
     "gpu": "h800-80gb", "gpus": 2048, "global_batch": 15360, "seq": 4096,
     "layout": {"tp": 1, "pp": 16, "cp": 1, "dp": 128, "ep": 64}, "published_tflops": None,
     "note": "fits, ranked in the middle: the planner models DualPipe (its best schedule here: "
             "two copies of each stage, the F&B pairs hiding their share of the all-to-all "
             "behind the other micro-batch's compute), but with uniform routing (63/64 of every "
             "token's 8 experts off-rank, over InfiniBand) the all-to-all outlasts the compute "
             "that could hide it, and the excess stays exposed; DeepSeek's node-limited routing "
             "(each token to at most 4 nodes, forwarded over NVLink) cuts that traffic, which the "
             "planner does not model, nor the small per-expert matmuls of the layouts it prefers"},
    {"name": "Llama 3 70B, 64 H100, NVIDIA recipe (batch 128 assumed)", "model": "llama3-70b",
     "gpu": "h100-80gb", "gpus": 64, "global_batch": 128, "seq": 8192,
     "layout": {"tp": 4, "pp": 4, "cp": 2, "dp": 2, "ep": 1}, "published_tflops": None,
     "note": ""},
    {"name": "DeepSeek-V3, 1,024 GPUs, NVIDIA recipe", "model": "deepseek-v3",
     "gpu": "h100-80gb", "gpus": 1024, "global_batch": 15360, "seq": 4096,
     "layout": {"tp": 2, "pp": 16, "cp": 1, "dp": 32, "ep": 64}, "published_tflops": None,
     "note": "not representable here: this library carves ep out of dp x cp (32 ranks), while "
             "Megatron-Core folds expert parallel over tp x dp ('MoE parallel folding'); the "
             "planner does not enumerate it"},
]


def check_published(entry: dict) -> dict:
    """Does the published layout fit, and where do the planner's rankings put it? Its degrees
    (tp, pp, cp, dp, ep) are fixed; ZeRO, schedule, micro-batches and checkpointing are the
    planner's best for them. Returns the best such layout's rank among all fitting layouts and
    among distinct degree tuples (each tuple at its best), its prediction, the predicted and
    published TFLOP/s per GPU, and the planner's top layout."""
    want = entry["layout"]
    if (want["dp"] * want["cp"]) % want["ep"]:  # ep is carved out of dp x cp here
        return {"name": entry["name"], "layout": want, "representable": False, "fits": False,
                "note": entry["note"], "published_tflops": entry["published_tflops"]}
    spec = dataclasses.replace(MODELS[entry["model"]], seq=entry["seq"])
    hw = hardware(entry["gpu"])
    result = plan(spec, entry["gpus"], hw, entry["global_batch"], top=0)
    degrees_seen, tuple_rank, best = [], None, None
    for i, (lay, p) in enumerate(result["all"]):
        key = (lay.tp, lay.pp, lay.cp, lay.dp, lay.ep)
        if key not in degrees_seen:
            degrees_seen.append(key)
        if best is None and all(getattr(lay, k) == v for k, v in want.items()):
            best = (i + 1, lay, p)
            tuple_rank = degrees_seen.index(key) + 1
    top_lay, top_p = result["all"][0] if result["all"] else (None, None)
    out = {"name": entry["name"], "layout": want, "representable": True,
           "fits": best is not None, "fitting_layouts": result["fit"],
           "degree_tuples": len(degrees_seen), "published_tflops": entry["published_tflops"],
           "top": top_lay.describe() if top_lay else None,
           "top_step_s": top_p["step_s"] if top_p else None, "note": entry["note"]}
    if best:
        rank, lay, p = best
        out.update(rank=rank, tuple_rank=tuple_rank, best=lay.describe(), step_s=p["step_s"],
                   mfu=p["mfu"], predicted_tflops=p["mfu"] * hw.flops / 1e12,
                   memory_gb=p["memory_peak_bytes"] / 1e9)
        if "ep" in p["comm"]:  # what the step would be were the all-to-all hidden (DualPipe)
            out["step_s_all_to_all_hidden"] = p["step_s"] - p["comm"]["ep"]["exposed_s"]
    return out


def format_published(rows: list[dict]) -> str:
    lines = ["published layouts against the planner (theory; the published figures are the "
             "papers')"]
    for r in rows:
        d = r["layout"]
        degrees = " ".join(f"{k}{d[k]}" for k in ("dp", "tp", "pp", "cp", "ep"))
        lines.append(f"- {r['name']}: {degrees}")
        if not r["representable"]:
            lines.append(f"    {r['note']}")
            continue
        if not r["fits"]:
            lines.append("    does not fit in the planner's memory model")
            continue
        pub = (f"; published {r['published_tflops']} TFLOP/s per GPU"
               if r["published_tflops"] else "")
        lines.append(f"    fits ({r['memory_gb']:.1f} GB per GPU as {r['best']}); its degrees rank "
                     f"{r['tuple_rank']} of {r['degree_tuples']} tuples (layout {r['rank']} of "
                     f"{r['fitting_layouts']:,}); predicted {r['predicted_tflops']:.0f} TFLOP/s per "
                     f"GPU{pub}; the planner's first: {r['top']}")
        if "step_s_all_to_all_hidden" in r:
            lines.append(f"    predicted step {r['step_s']:.1f} s; with its all-to-all hidden "
                         f"{r['step_s_all_to_all_hidden']:.1f} s, against {r['top_step_s']:.1f} s "
                         f"for the planner's first")
        if r["note"]:
            lines.append(f"    {r['note']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# validation against live runs of the tiny GPT
# ---------------------------------------------------------------------------------------------
VALIDATION_MODEL = dict(layers=8, d_model=64, heads=8, seq=32, vocab=128, batch=16)


def measured_step_s(report) -> float:
    """Median wall-clock span of a step over all ranks (first op start to last op end), steps 1
    to n-2: step 0 warms up, the last one runs under the memory meter (report's metered_step)."""
    spans = []
    for s in range(1, report.config["steps"] - 1):
        ev = [e for r in report.ranks for e in r["events"] if e.get("step") == s]
        spans.append(max(e["end"] for e in ev) - min(e["start"] for e in ev))
    return statistics.median(spans)


def measured_cpu_s(report) -> float:
    """Median over the same steps as measured_step_s of the CPU time (each op's thread CPU time,
    meters.Timeline) all ranks spent in the step's ops, summed: the work the cores had to do. Over
    the cores, a step's wall time if our ranks had the cores to themselves and never waited
    (other processes' load and scheduling waits are not in it; gloo's own threads neither)."""
    sums = []
    for s in range(1, report.config["steps"] - 1):
        sums.append(sum(e.get("cpu", 0.0) for r in report.ranks for e in r["events"]
                        if e.get("step") == s))
    return statistics.median(sums)


def measured_cpu_by_kind(report) -> dict:
    """measured_cpu_s split by op kind (median over the same steps of each kind's CPU, all ranks
    summed): which ops the cores' work went to (forward / backward / F / B / W: compute, and what
    the collectives called inside them cost this thread; the rest: comm and the optimizer)."""
    out = {}
    for kind in {e["kind"] for r in report.ranks for e in r["events"]}:
        out[kind] = statistics.median(
            sum(e.get("cpu", 0.0) for r in report.ranks for e in r["events"]
                if e.get("step") == s and e["kind"] == kind)
            for s in range(1, report.config["steps"] - 1))
    return out


def measured_comm_calls(report) -> dict:
    """Counted and measured, median over measured_step_s's steps, all ranks summed: the comm
    calls a step made (comm.py's records, p2p and collectives) and their own thread CPU time (the
    call and its metering; gloo's threads not included). Not modelled by predict (yet): the
    compute term's passes hold the tp / cp / ZeRO-3 calls made inside them."""
    steps = range(1, report.config["steps"] - 1)
    recs = [[c for r in report.ranks for c in r["comm"] if c.get("step") == s] for s in steps]
    return {"measured_comm_calls": statistics.median(len(x) for x in recs),
            "measured_comm_calls_cpu_s": statistics.median(sum(c.get("cpu", 0.0) for c in x)
                                                           for x in recs)}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def validate_on_toy_runs(layouts: list[Layout] | None = None, gpus: int = 8, steps: int = 6,
                         model: dict | None = None, progress=None, hw: Hardware | None = None,
                         sample: int = 0) -> dict:
    """Run layouts of the tiny GPT here and compare with the planner (a benchmark, not a timed test).

    Without `layouts`: every memory class the planner ranks for `gpus` ranks on "cpu" (layouts
    with the same degrees, ZeRO stage and chunk placement hold the same states; each class is run
    once, as its best-ranked layout). Per layout: the predicted model states of every rank
    (pipeline rank r's) against the run's measured params/grads/optimizer bytes, to the byte; the
    predicted step time beside the measured one (measured_step_s). Returns the rows, the number
    of byte-equal layouts, and Spearman's rank correlation of predicted and measured step times.
    `hw`: the profile that predicts (default "cpu", assumed rates; measure_hardware() for this
    machine measured); with another than "cpu", each row also has the "cpu" profile's prediction
    (predicted_assumed_step_s). `sample` > 0: that many of the classes, evenly spaced along the
    ranking (every class without)."""
    from ..runtime.launch import RankError, run
    cfg_model = {**VALIDATION_MODEL, **(model or {})}
    batch = cfg_model.pop("batch")
    spec = toy_model(batch=batch, **cfg_model)
    assumed = hardware("cpu")
    hw = hw or assumed
    if layouts is None:
        result = plan(spec, gpus, hw, batch, top=0)
        seen, layouts = set(), []
        for lay, _ in result["all"]:
            key = (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.zero, lay.schedule, lay.virtual)
            if key not in seen:
                seen.add(key)
                layouts.append(lay)
        if 0 < sample < len(layouts):
            layouts = [layouts[round(i * (len(layouts) - 1) / (sample - 1))] if sample > 1
                       else layouts[0] for i in range(sample)]
    rows = []
    for lay in layouts:
        p = predict(spec, lay, hw, batch, precision="fp32")
        cfg = run_config(spec, lay, batch, steps=steps)
        try:
            report = run(cfg)
        except RankError as e:  # recorded, not hidden: the planner ranked a layout that fails
            rows.append({"layout": lay.describe(), "fields": dataclasses.asdict(lay),
                         "error": str(e).splitlines()[-1]})
            if progress:
                progress(rows[-1])
            continue
        mismatches = []
        for rank in report.ranks:
            want = p["memory_per_rank"][rank["coords"]["pp"]]
            got = rank["memory"]
            for k in ("params", "grads", "optimizer"):
                if got[k] != want[k]:
                    mismatches.append({"rank": rank["rank"], "category": k, "measured": got[k],
                                       "theory": want[k]})
        act_pred = max(m["activations"] for m in p["memory_per_rank"])
        act_meas = max(r["memory"]["activations_peak"] for r in report.ranks)
        row = {"layout": lay.describe(), "fields": dataclasses.asdict(lay),
               "states_equal": not mismatches, "mismatches": mismatches,
               "predicted_step_s": p["step_s"], "measured_step_s": measured_step_s(report),
               "predicted_compute_s": p["compute_s"], "measured_cpu_s": measured_cpu_s(report),
               "measured_cpu_by_kind": measured_cpu_by_kind(report),
               **measured_comm_calls(report),
               "predicted_comm_s": {a: c["exposed_s"] for a, c in p["comm"].items()},
               "predicted_comm": {a: {k: c[k] for k in ("group", "hops", "calls", "bytes",
                                                        "seconds", "exposed_s")}
                                  for a, c in p["comm"].items()},
               "activations_theory_bytes": act_pred, "activations_measured_bytes": act_meas}
        if hw is not assumed:
            row["predicted_assumed_step_s"] = predict(spec, lay, assumed, batch,
                                                      precision="fp32")["step_s"]
        rows.append(row)
        if progress:
            progress(row)
    ran = [r for r in rows if "error" not in r]
    pred = [r["predicted_step_s"] for r in ran]
    meas = [r["measured_step_s"] for r in ran]
    return {"layouts": len(rows), "failed": len(rows) - len(ran),
            "states_equal": sum(r["states_equal"] for r in ran),
            "spearman_step_time": spearman(pred, meas) if len(ran) > 2 else None,
            "rows": rows, "model": {**cfg_model, "batch": batch}, "ranks": gpus,
            "cores": hw.cores, "hardware": dataclasses.asdict(hw)}


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
SHAPE_FLAGS = ("layers", "d_model", "heads", "seq", "vocab", "experts", "top_k", "moe_every")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `plan` on the CLI's sub-parsers."""
    ap = sub.add_parser("plan", help="rank layouts for a model on a cluster (theory only)",
                        description="Rank parallel layouts by predicted step time; every number "
                                    "is theory, none measured.")
    ap.add_argument("--model", help=f"a named model ({', '.join(MODELS)}); without it, "
                    "parallel_mini's GPT of --layers/--d-model/...")
    for name in SHAPE_FLAGS:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8)")
    ap.add_argument("--gpu", default="h100-80gb", help=f"{', '.join(HARDWARE)}, or cpu (this "
                    "machine: the tiny GPT's local runs)")
    ap.add_argument("--nodes-of", type=int, default=0, help="GPUs per node (default: the GPU's "
                    "server, 8)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    ap.add_argument("--precision", choices=("fp32", "bf16-mixed"), default=None)
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--top", type=int, default=10, help="layouts to print")
    ap.add_argument("--variants", action="store_true", help="every ZeRO/schedule/micro-batch/"
                    "checkpointing variant, not only each degree tuple's best")
    ap.add_argument("--json", metavar="PATH", help="write the plan as JSON to PATH ('-' = stdout)")
    ap.add_argument("--published", action="store_true", help="check published large runs' "
                    "layouts against the planner instead (Llama 3, GPT-3, DeepSeek-V3)")
    return ap


# The largest values the command line takes: beyond them a plan is not a question anyone asks (the
# largest published runs: 16k GPUs, 2k sequences a step, 126 layers), theory's floats would
# overflow, and every pipeline split of 10^5 layers takes minutes to try.
MOST = {"gpus": 2 ** 20, "nodes_of": 2 ** 20, "global_batch": 2 ** 24,
        **{k: 2 ** 31 - 1 for k in SHAPE_FLAGS}, "layers": 1024}


def spec_from_args(args) -> ModelSpec:
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    for k, v in given.items():
        if v < (0 if k == "experts" else 1):
            raise PlanError(f"--{k.replace('_', '-')} {v}: must be a whole number >= "
                            f"{0 if k == 'experts' else 1}")
    if args.model is not None:
        if args.model not in MODELS:
            raise PlanError(f"--model {args.model!r}: choose one of {', '.join(MODELS)}, or give "
                            f"--layers --d-model --heads --seq --vocab for parallel_mini's GPT")
        if {"moe_every"} & set(given) or ("experts" in given and not MODELS[args.model].experts):
            raise PlanError(f"--experts/--moe-every with --model {args.model}: a named model keeps "
                            f"its own experts; drop them, or describe a GPT without --model")
        spec = dataclasses.replace(MODELS[args.model], **given)
    else:
        spec = toy_model(batch=8 if args.global_batch is None else args.global_batch, **given)
    unread = [k for k in ("top_k", "moe_every") if k in given]
    if unread and not spec.experts:
        flags = " ".join(f"--{k.replace('_', '-')}" for k in unread)
        raise PlanError(f"{flags}: a dense model has no experts to route to; add --experts E "
                        f"or drop {flags}")
    return spec


def _check_args(args, given: set) -> None:
    """What the parser cannot say: ranges, flags that would be ignored, where --json goes."""
    from ..runtime.preflight import check_output
    if args.published:
        ignored = sorted(given - {"command", "published", "json"})
        if ignored:
            flags = " ".join("--" + k.replace("_", "-") for k in ignored)
            raise PlanError(f"{flags}: --published checks the published runs' own models and "
                            f"layouts and would ignore them; drop them (or --published)")
    for k, most in MOST.items():
        v = getattr(args, k)
        if v is not None and v > most:
            raise PlanError(f"--{k.replace('_', '-')} {v if len(str(v)) < 20 else str(v)[:12] + '...'}"
                            f": must be at most {most:,} (far beyond any published run)")
    if args.gpu != "cpu" and args.gpu not in HARDWARE:
        raise PlanError(f"--gpu {args.gpu!r}: choose one of {', '.join(HARDWARE)}, cpu")
    if args.top < 0:
        raise PlanError(f"--top {args.top}: must be >= 0")
    check_output("--json", args.json)


def cli(args, given: set = frozenset()) -> int:
    """`plan`; `given`: the flags written out on the command line (to refuse those ignored)."""
    from ..config import ConfigError
    try:
        _check_args(args, set(given))
        if args.published:
            rows = [check_published(e) for e in PUBLISHED]
            text = json.dumps({"kind": "theory", "published": rows}, indent=1)
            return _write(args.json, text, format_published(rows), 0)
        spec = spec_from_args(args)
        result = plan(spec, args.gpus, hardware(args.gpu), args.global_batch, args.nodes_of,
                      args.precision, args.optimizer, args.top, args.variants)
    except (PlanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.pop("all")
    rc = 0 if result["layouts"] or args.top == 0 and result["fit"] else 1
    return _write(args.json, json.dumps({"kind": "theory", **result}, indent=1), format_plan(result), rc)


def _write(path: str | None, text: str, table: str, rc: int) -> int:
    """JSON to stdout ('-') or to a file (the table printed then), else the table; a write that
    fails anyway (a disk that filled meanwhile) is one line and exit 1."""
    try:
        if path == "-":
            sys.stdout.write(text + "\n")
            return rc
        if path:
            with open(path, "w") as fh:
                fh.write(text)
    except OSError as e:
        print(f"error: --json {path}: could not write the plan ({e.strerror or e})", file=sys.stderr)
        return 1
    print(table)
    return rc
