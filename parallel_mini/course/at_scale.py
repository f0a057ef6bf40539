"""Big models on real hardware, theory only: what the course's tables, the planner and the app
draw beside the toy runs (nothing here runs on this machine). The formulas for bytes on the wire,
model states and activations are theory.py's; this adds the hardware (an H100's peak, a node of
NVLink GPUs), the headline models and the GPU capacities, and the memory table built from them.
"""
from __future__ import annotations

from ..theory import activation_bytes_per_layer, model_state_bytes

H100_BF16_FLOPS = 989e12  # dense bf16 peak of one H100 SXM, FLOP/s
NVLINK_GPUS_PER_NODE = 8  # an HGX H100 node: 8 GPUs on one NVSwitch


def matmul_time(n_params: float, tokens: float, gpus: int = 1,
                flops: float = H100_BF16_FLOPS) -> float:
    """Lower bound on one training step's compute per GPU: 6 FLOPs per parameter per token (2
    forward + 4 backward; Kaplan et al., 2020), shared by `gpus`, at peak throughput."""
    return 6 * n_params * tokens / gpus / flops


# Model presets for theory-only rows (too big to run here). Shapes after the public Llama configs;
# n_params is the headline size the memory table uses.
PRESETS = {
    "1B": {"n_params": 1_000_000_000, "layers": 16, "d_model": 2048, "heads": 32, "vocab": 128256},
    "7B": {"n_params": 7_000_000_000, "layers": 32, "d_model": 4096, "heads": 32, "vocab": 32000},
    "70B": {"n_params": 70_000_000_000, "layers": 80, "d_model": 8192, "heads": 64, "vocab": 32000},
    "405B": {"n_params": 405_000_000_000, "layers": 126, "d_model": 16384, "heads": 128,
             "vocab": 128256},
}

GPU_MEMORY_GB = {"24 GB (RTX 4090)": 24, "40 GB (A100 40G)": 40, "80 GB (A100/H100 80G)": 80,
                 "141 GB (H200)": 141}


def model_parallel_params(n_params: int, tp: int = 1, pp: int = 1) -> int:
    """Parameters on one GPU after tensor and pipeline parallel split the model, before ZeRO:
    Psi/(tp*pp), rounded up to a whole parameter. An approximation: it ignores that one pipeline
    stage holds the embeddings (and another the LM head), so stages are not equal, and that under
    TP the LayerNorms and row-parallel biases stay whole on every rank (gpt_unit_sizes counts our
    GPT exactly)."""
    return -(-n_params // (tp * pp))


def memory_per_gpu(n_params: int, gpus: int, zero: int, precision: str = "bf16-mixed",
                   optimizer: str = "adam", layers: int = 0, d_model: int = 0, heads: int = 1,
                   seq: int = 0, micro_batch: int = 0, checkpointing: str = "none",
                   offload: bool = False, tp: int = 1, pp: int = 1, sp: bool = False) -> dict:
    """Bytes per GPU by category for a big model (theory only) on N = `gpus` data-parallel ranks
    x tp x pp GPUs in all.

    Model states: TP and PP divide the parameters first, Psi/(tp*pp) per GPU (model_parallel_params:
    an approximation that ignores which pipeline stage holds the embeddings and LM head, and the
    LayerNorm / bias parameters TP replicates), then ZeRO shards what is left over the N
    data-parallel ranks (model_state_bytes at that stage).
    Activations (Korthikanti et al., 2022): L x activation_bytes_per_layer(s, b, h, a, tp, sp), i.e.
    sbh(34 + 5as/h) at tp = 1, sbh(10 + 24/t + 5as/(ht)) with TP, (sbh/t)(34 + 5as/h) with TP + SP.
    PP does not change them under 1F1B: the first stage keeps p micro-batches in flight, each
    through its L/p layers, i.e. L layers' worth of one micro-batch whatever p (their section
    4.2.3); the other stages hold less. ZeRO does not shard activations."""
    states = model_state_bytes(model_parallel_params(n_params, tp, pp), optimizer, precision, zero,
                               gpus, offload=offload and zero in (1, 2))
    states.pop("host", None)
    acts = layers * activation_bytes_per_layer(seq, micro_batch, d_model, heads, checkpointing,
                                               tp=tp, sp=sp) \
        if layers and seq and micro_batch else 0
    return {**states, "activations": acts}
