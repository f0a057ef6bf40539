"""Predictions: pure formulas, no torch.distributed. Every measured number is drawn beside one of these.

Byte counts use the ring algorithm's per-rank send volume (Patarasuk & Yuan, 2009), the model the
course uses for every collective:
    all-reduce      2(N-1)/N * S   (reduce-scatter phase + all-gather phase)
    all-gather      (N-1)/N * S    (S = the full, gathered tensor)
    reduce-scatter  (N-1)/N * S    (S = the full, unreduced tensor)
    all-to-all      (N-1)/N * S    (S = everything this rank holds before the exchange)
    broadcast       S, sent by every rank of the pipelined chain but the last
    send            S;  recv 0     (what *this* rank puts on the wire)
"""
from __future__ import annotations

from types import SimpleNamespace

from .mesh import role_names  # axis names, grid arithmetic only (mesh.py imports no torch here)
from .placement import gpt_held, gpt_units, held_numel, stage_blocks  # what a rank holds


def wire_bytes(op: str, payload_bytes: int, n: int, rank_in_chain: int = 0) -> int:
    """Bytes one rank sends for `op` over a group of `n` ranks with payload S = `payload_bytes`.

    The ring's model value: an int when n divides S, else the exact fraction as a float (real chunks
    differ by one element; the ring implementation measures its own)."""
    if n <= 1:
        return 0
    num, den = {  # the factor as numerator / denominator
        "all_reduce": (2 * (n - 1), n),
        "all_gather": (n - 1, n),
        "reduce_scatter": (n - 1, n),
        "all_to_all": (n - 1, n),
        "send": (1, 1),
        "recv": (0, 1),
        "broadcast": (1 if rank_in_chain < n - 1 else 0, 1),
    }[op]
    # Integers, not Fractions: Comm calls this for every op (a Fraction cost ~1.9 us a call, this
    # ~0.2 us, measured); int / int is correctly rounded, as float(Fraction) is.
    whole, rest = divmod(payload_bytes * num, den)
    return whole if rest == 0 else payload_bytes * num / den


# Link bandwidths in bytes/s, one direction, as the vendors quote them. Predictions turn measured
# bytes into time with these; the lessons say which link each parallelism crosses and why.
INTERCONNECTS = {
    "PCIe Gen4 x16": 32e9,       # GPU <-> CPU (offload); ~25 GB/s achieved in practice
    "PCIe Gen5 x16": 64e9,
    "NVLink 4 (H100)": 450e9,    # 900 GB/s bidirectional: 18 links x 25 GB/s each way
    "NVLink 5 (B200)": 900e9,    # 1.8 TB/s bidirectional
    "InfiniBand NDR": 50e9,      # 400 Gb/s per port
    "InfiniBand XDR": 100e9,     # 800 Gb/s per port
    "Ethernet 100G": 12.5e9,
}


def transfer_time(nbytes: float, link: str) -> float:
    """Seconds to move `nbytes` over `link` at its full bandwidth (a lower bound)."""
    return nbytes / INTERCONNECTS[link]


def ring_steps(n: int) -> int:
    """A ring all-reduce takes 2(N-1) steps: N-1 to reduce-scatter, N-1 to all-gather."""
    return 2 * (n - 1)


def ring_all_reduce_time(nbytes: float, n: int, bandwidth_bytes_s: float,
                         latency_s: float = 0.0) -> float:
    """T = 2(N-1)/N * X / B  (+ 2(N-1) latency terms). Nearly independent of N for large N."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth_bytes_s + 2 * (n - 1) * latency_s


# ---------------------------------------------------------------------------------------------
# the tiny GPT
# ---------------------------------------------------------------------------------------------
def gpt_param_count(vocab: int, seq: int, d_model: int, layers: int, experts: int = 0,
                    moe_every: int = 1) -> int:
    """Parameters of parallel_mini's GPT (untied LM head, learned positions, biases, LayerNorms).

    The textbook count h*v + L(12h^2 + 13h) + 2h ties the LM head to the embedding and leaves out
    position embeddings. Ours adds both, so that pipeline stages own disjoint weights:
        v*h (tokens) + s*h (positions) + L(12h^2 + 13h) + 2h (final LN) + h*v (LM head, no bias)
    Per block 12h^2 + 13h: QKV 3h^2+3h, attention out h^2+h, MLP 4h^2+4h and 4h^2+h, 2 LNs 4h.
    A mixture-of-experts block (see moe_blocks) has E expert MLPs (8h^2 + 5h each) and a router
    (h*E, no bias) in place of its MLP."""
    h, v, s, L = d_model, vocab, seq, layers
    moe = len(moe_blocks(layers, experts, moe_every))
    return v * h + s * h + L * (12 * h * h + 13 * h) + 2 * h + h * v \
        + moe * (h * experts + (experts - 1) * mlp_params(h))


def mlp_params(d_model: int) -> int:
    """One MLP [h -> 4h -> h] with biases: 8h^2 + 5h (a dense block's, or one expert's)."""
    return 8 * d_model * d_model + 5 * d_model


def moe_blocks(layers: int, experts: int, moe_every: int = 1) -> list[int]:
    """The blocks whose MLP is a mixture of experts: every moe_every-th (model.GPTConfig.is_moe)."""
    return [i for i in range(layers) if experts and (i + 1) % moe_every == 0]


def expert_unit_sizes(cfg, blocks) -> list[int]:
    """The E/ep experts of each MoE block among `blocks`, one entry per block: with expert parallel
    each is a unit of their own under ZeRO-3 (and one group of parameters under the other
    strategies), over the edp ranks (parallel/expert.py). Counted from the placement."""
    held = gpt_held(cfg, (1, 0), (getattr(cfg, "ep", 1), 0))
    return [sum(held_numel(held[n]) for n in names) for unit, names in gpt_units(held, True)
            if ".experts" in unit and int(unit.split(".")[1]) in blocks]


def ep_wire_bytes_per_step(cfg, blocks=None) -> float:
    """Expert parallel's all-to-all, per rank and step, if routing were uniform and nothing dropped:
    per MoE layer and micro-step a rank holds t = (b/dp/m)*s/cp tokens (/tp with sequence
    parallel), t*k rows of h elements, (P-1)/P of which leave for other ranks in each of four
    all-to-alls (dispatch and combine, forward and backward), plus the rows-per-expert counts
    (E int64) in forward. Full checkpointing runs the forward's two (and the counts) again. Real
    routing is uneven and drops tokens: the run reports what its splits sent beside this."""
    P = getattr(cfg, "ep", 1)
    if P == 1:
        return 0.0
    steps = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    # this rank's tokens (sequence parallel: its tp rank's shard, which it alone dispatches)
    tokens = cfg.batch // (cfg.dp * steps) * cfg.seq // getattr(cfg, "cp", 1) \
        // (cfg.tp if getattr(cfg, "sp", False) else 1)
    rows = wire_bytes("all_to_all", tokens * cfg.top_k * cfg.d_model * BYTES_PER_PARAM[cfg.precision], P)
    counts = wire_bytes("all_to_all", cfg.experts * 8, P)
    again = cfg.checkpointing == "full"
    n = len([i for i in moe_blocks(cfg.layers, cfg.experts, cfg.moe_every)
             if blocks is None or i in blocks])
    return steps * n * ((4 + 2 * again) * rows + (1 + again) * counts)


def expert_axes(cfg) -> dict[str, str | None]:
    """The comm records' names for the experts' data-parallel groups, keyed as the expert strategy
    of one group (cp = 1) names them: "dp" the edp ranks, "dp_shard" and "dp_rep" HYBRID_SHARD's
    edp_shard and edp_rep. Labels, not numbers: they come from the mesh's grid arithmetic
    (mesh.role_names, no process group), as Mesh.axis_for names them in a run."""
    names = role_names(cfg)
    return {"dp": names["expert_dp"], "dp_shard": names["expert_shard"],
            "dp_rep": names["expert_replicate"]}


def dp_wire_bytes_per_step(grad_bytes: int, dp: int) -> int:
    """Data parallel moves every gradient once per optimizer step: 2(N-1)/N * gradient bytes,
    whatever the bucketing (buckets only change *when* bytes move) and however many micro-steps
    are accumulated (only the last one syncs)."""
    return wire_bytes("all_reduce", grad_bytes, dp)


def padded(numel: int, n: int) -> int:
    """Elements after padding to a multiple of n (so that n equal shards exist)."""
    return -(-numel // n) * n


def gpt_unit_sizes(vocab: int, seq: int, d_model: int, layers: int, tp: int = 1, experts: int = 0,
                   moe_every: int = 1, ep: int = 1, experts_apart: bool = False) -> list[int]:
    """Parameters per ZeRO-3 unit on one rank (each gathered as one flat buffer): the embedding
    (token and position tables), each block, the head (final LayerNorm and output layer). With
    tensor parallel t the vocabulary tables and the blocks' matrices (and column-parallel biases)
    hold 1/t; per block (12h^2 + 7h)/t + 6h: row-parallel biases and LayerNorms stay whole.
    A mixture-of-experts block: attention (4h^2 + 3h)/t + h, LayerNorms 4h, the router h*E and
    E/ep experts, all whole on every tp rank; `experts_apart` (expert parallel: the experts are
    units of their own, expert_unit_sizes) leaves the experts out.
    Counted, not re-derived: the elements of the blocks placement.gpt_held says a rank holds (the
    cuts the parallel modules make), grouped into zero3's units (placement.gpt_units)."""
    model = SimpleNamespace(vocab=vocab, seq=seq, d_model=d_model, layers=layers, experts=experts,
                            moe_every=moe_every)
    return _unit_sizes(gpt_held(model, (tp, 0), (ep, 0)), experts_apart)


def _unit_sizes(held: dict, experts_apart: bool) -> list[int]:
    return [sum(held_numel(held[n]) for n in names) for unit, names in gpt_units(held, experts_apart)
            if ".experts" not in unit]


def gpt_local_param_count(vocab: int, seq: int, d_model: int, layers: int, tp: int = 1) -> int:
    """Parameters one tensor-parallel rank holds (= gpt_param_count when tp = 1)."""
    return sum(gpt_unit_sizes(vocab, seq, d_model, layers, tp))


def tp_wire_bytes_per_step(cfg, blocks: int | None = None, embed: bool = True, head: bool = True,
                           moe: int | None = None) -> float:
    """Megatron TP without sequence parallel, per micro-step: forward all-reduces after each
    row-parallel layer (attention out, MLP proj: 2 per block) and after the vocabulary-parallel
    embedding (1); backward all-reduces before each column-parallel layer (QKV, fc: 2 per block)
    and before the LM head (1): 4L + 2 all-reduces of [b, s, h] activations. Full checkpointing
    re-runs each block's forward in backward, but torch's (non-reentrant) checkpoint stops as soon
    as every tensor backward needs is back: the MLP's closing all-reduce feeds nothing that is
    saved, so only the attention one runs again: L more (measured, not assumed). The
    vocabulary-parallel cross-entropy adds 3 all-reduces of b*s fp32 numbers (max, target logit,
    sum of exponentials).
    A pipeline stage holds `blocks` of the blocks, the embedding only on the first stage and the
    head only on the last, and runs m micro-batches of b/(dp m) sequences per step. `moe` of them
    are mixture-of-experts blocks (default: the whole model's count): their experts are not split
    over tp, so they have the attention's two all-reduces only."""
    steps = cfg.microbatches if getattr(cfg, "pp", 1) > 1 else cfg.grad_accum  # micro-steps
    micro = cfg.batch // (cfg.dp * steps)
    seq = cfg.seq // getattr(cfg, "cp", 1)  # context parallel: this rank's tokens
    act = micro * seq * cfg.d_model * BYTES_PER_PARAM[cfg.precision]
    t, h = cfg.tp, cfg.d_model
    L = cfg.layers if blocks is None else blocks
    if moe is None:
        moe = len(moe_blocks(cfg.layers, getattr(cfg, "experts", 0), getattr(cfg, "moe_every", 1)))
    per_micro = (4 * L - 2 * moe + embed + head) * wire_bytes("all_reduce", act, t) \
        + head * 3 * wire_bytes("all_reduce", micro * seq * 4, t)
    again = cfg.checkpointing == "full"
    if again:
        # re-run up to the last saved tensor (the MLP's GELU output): without SP the attention
        # all-reduce; with SP the two all-gathers (before QKV and fc) and the attention
        # reduce-scatter (a mixture-of-experts block has no fc all-gather: 2)
        per_micro += (3 * L - moe if cfg.sp else L) * wire_bytes(
            "all_gather" if cfg.sp else "all_reduce", act, t)
    if cfg.sp:
        # SP swaps each all-reduce for an all-gather + reduce-scatter: the same bytes. Added: the
        # gradients of the parameters used on sequence shards, summed over tp per micro-step: the
        # position embeddings, the final LayerNorm, per dense block 2 LayerNorms and 2 row-parallel
        # biases, per mixture-of-experts block 2 LayerNorms and the attention's bias (its router
        # and experts: moe_sp_wire_bytes_per_step)
        sp_params = embed * cfg.seq * h + 6 * h * (L - moe) + 5 * h * moe + head * 2 * h
        per_micro += wire_bytes("all_reduce", sp_params * BYTES_PER_PARAM[cfg.precision], t)
    return steps * per_micro


def moe_sp_wire_bytes_per_step(cfg, moe: int | None = None) -> float:
    """This library's mixture of experts under sequence parallel, on the tp axis, per step: a tp
    rank routes and dispatches only its own tokens (parallel/expert.py), so per MoE block (`moe`
    of them; default: the whole model's) and micro-step
    - forward all-gathers the router logits of the sequence's other tp shards, [b, s/t, E] each
      (WholeSequences; full checkpointing runs it again);
    - backward sums the router's (h E) and the E/ep experts' gradients over tp, as the other
      parameters used on sequence shards (tensor.py's hook).
    Kept apart from tp_wire_bytes_per_step, which the planner also applies to real models: their
    MoE layers (Megatron's, expert tensor parallel 1) fold tp into the experts' data-parallel
    group and reduce those gradients once per step instead."""
    E, t = getattr(cfg, "experts", 0), cfg.tp
    if not (E and getattr(cfg, "sp", False) and t > 1):
        return 0.0
    if moe is None:
        moe = len(moe_blocks(cfg.layers, E, getattr(cfg, "moe_every", 1)))
    steps = cfg.microbatches if getattr(cfg, "pp", 1) > 1 else cfg.grad_accum  # micro-steps
    elem = BYTES_PER_PARAM[cfg.precision]
    logits = cfg.batch // (cfg.dp * steps) * cfg.seq // getattr(cfg, "cp", 1) * E * elem
    grads = (cfg.d_model * E + E // getattr(cfg, "ep", 1) * mlp_params(cfg.d_model)) * elem
    per_block = (1 + (cfg.checkpointing == "full")) * wire_bytes("all_gather", logits, t) \
        + wire_bytes("all_reduce", grads, t)
    return steps * moe * per_block


def cp_wire_bytes_per_step(cfg, blocks: int | None = None, moe: int | None = None) -> float:
    """Context parallel, per block and micro-step, with one K/V block = [b, a/t, s/C, d]:
    - ring / zigzag (point to point, the payload is what is sent): forward, C-1 hops carrying K and
      V (2 blocks); backward, C-1 hops carrying K, V, dK, dV (4) and a last hop taking dK, dV home
      (2). A checkpoint that recomputes attention (full or selective) runs the forward's hops again.
    - ulysses: forward, an all-to-all of q, k, v (3 blocks) and one of the output (1); backward
      the same two in reverse; (C-1)/C of each on the wire. Recomputation repeats the forward's.
    - a mixture-of-experts block (`moe` of the blocks) routes whole sequences: its forward
      all-gathers the router logits [b, s, E] of the sequences' other parts, (C-1)/C on the wire
      (parallel/expert.py WholeSequences); full checkpointing runs it again."""
    c = cfg.cp
    steps = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    micro = cfg.batch // (cfg.dp * steps)
    block = micro * (cfg.heads // cfg.tp) * (cfg.seq // c) * (cfg.d_model // cfg.heads) \
        * BYTES_PER_PARAM[cfg.precision]
    recompute = cfg.checkpointing != "none"
    if cfg.cp_impl == "ulysses":
        per_block = (8 + 4 * recompute) * wire_bytes("all_to_all", block, c)
    else:
        per_block = (2 * (c - 1) * (1 + recompute) + 4 * (c - 1) + 2) * block
    if moe is None:
        moe = len(moe_blocks(cfg.layers, getattr(cfg, "experts", 0), getattr(cfg, "moe_every", 1)))
    logits = micro * cfg.seq * getattr(cfg, "experts", 0) * BYTES_PER_PARAM[cfg.precision]
    per_moe = (1 + (cfg.checkpointing == "full")) * wire_bytes("all_gather", logits, c)
    return steps * ((cfg.layers if blocks is None else blocks) * per_block + moe * per_moe)


BYTES_PER_PARAM = {"fp32": 4, "bf16-mixed": 2}  # parameters and gradients in compute precision


def optimizer_bytes_per_param(optimizer: str, precision: str) -> int:
    """Adam: two fp32 moments (8); mixed precision adds the fp32 master copy (4)."""
    return {"adam": 8, "sgd": 0}[optimizer] + (4 if precision != "fp32" else 0)


def model_state_bytes(n_params: int, optimizer: str = "adam", precision: str = "fp32",
                      zero: int = 0, n: int = 1, unit_sizes: list[int] | None = None,
                      offload: bool = False, fp32_grad_accum: bool = False,
                      disk: bool = False) -> dict:
    """Persistent bytes per rank after an optimizer step, by category (the memory table).

    Unsharded: b*P + b*P + o*P (b = 4 fp32 / 2 bf16; o = 8 Adam fp32, 12 Adam bf16-mixed): 16P mixed.
    ZeRO-1: b*P' + b*P' + o*P'/N      (4P + 12P/N mixed)      P' = P padded to a multiple of N
    ZeRO-2: b*P' + (b + o)*P'/N       (2P + 14P/N mixed)
    ZeRO-3: (2b + o)*Q/N              (16P/N mixed)           Q = sum of the units' padded sizes
    `disk` (--offload-disk, ZeRO-Infinity): the fp32 master and the moments leave RAM for a file,
    d = 4 + 8 (Adam; SGD 4) bytes per element the rank owns, whatever the compute precision:
    ZeRO-0 d*P, ZeRO-1/2 d*P'/N (12P'/N), ZeRO-3 d*Q/N with its parameter slices (params 0)."""
    b, o = BYTES_PER_PARAM[precision], optimizer_bytes_per_param(optimizer, precision)
    if disk:
        return _disk_state_bytes(n_params, optimizer, b, zero, n, unit_sizes)
    if zero == 0:  # fp32_grad_accum: + an fp32 gradient buffer (20 bytes/param with Adam)
        grads = (b + 4 * fp32_grad_accum) * n_params
        return {"params": b * n_params, "grads": grads, "optimizer": o * n_params}
    if zero in (1, 2):
        pp = padded(n_params, n)
        grads = b * pp if zero == 1 else b * pp // n
        if offload:  # host: an fp32 master slice + the moments, whatever the compute precision
            host = (optimizer_bytes_per_param(optimizer, "fp32") + 4) * pp // n
            return {"params": b * pp, "grads": grads, "optimizer": 0, "host": host}
        return {"params": b * pp, "grads": grads, "optimizer": o * pp // n}
    q = sum(padded(u, n) for u in (unit_sizes or [n_params]))
    return {"params": b * q // n, "grads": b * q // n, "optimizer": o * q // n}


def disk_owned_elements(n_params: int, zero: int, n: int, unit_sizes: list[int] | None) -> int:
    """Elements whose optimizer states a rank keeps (in its --offload-disk file)."""
    if zero == 0:
        return n_params
    if zero in (1, 2):
        return padded(n_params, n) // n
    return sum(padded(u, n) for u in (unit_sizes or [n_params])) // n


def _disk_state_bytes(n_params, optimizer, b, zero, n, unit_sizes) -> dict:
    on_disk = (optimizer_bytes_per_param(optimizer, "fp32") + 4) * \
        disk_owned_elements(n_params, zero, n, unit_sizes)
    if zero == 0:
        return {"params": b * n_params, "grads": b * n_params, "optimizer": 0, "disk": on_disk}
    if zero in (1, 2):
        pp = padded(n_params, n)
        return {"params": b * pp, "grads": b * pp if zero == 1 else b * pp // n, "optimizer": 0,
                "disk": on_disk}
    q = sum(padded(u, n) for u in (unit_sizes or [n_params]))
    return {"params": 0, "grads": b * q // n, "optimizer": 0, "disk": on_disk}


def disk_io_bytes_per_step(cfg, n_params: int, unit_sizes: list[int], n: int) -> dict:
    """--offload-disk's traffic per step: the step reads and writes every plane (master and
    moments: 12 bytes per owned element with Adam); ZeRO-3 also reads each unit's master slice
    (4 bytes per element) for each of its two gathers per micro-step (forward, backward)."""
    owned = disk_owned_elements(n_params, cfg.zero, n, unit_sizes)
    per_element = optimizer_bytes_per_param(cfg.optimizer, "fp32") + 4  # every plane's 4 bytes
    read = written = per_element * owned
    if cfg.zero == 3:
        micro_steps = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
        read += 2 * micro_steps * 4 * owned
    return {"read": read, "written": written}


def zero_wire_bytes_per_step(zero: int, n_params: int, precision: str, n: int,
                             unit_sizes: list[int], grad_accum: int = 1) -> float:
    """ZeRO-1/2: reduce-scatter + all-gather of the padded flat buffer = 2(N-1)/N * Psi, as DP.
    ZeRO-3: per micro-step, every unit is all-gathered for forward and again for backward and its
    gradient reduce-scattered: 3(N-1)/N * Psi (Psi over padded units)."""
    b = BYTES_PER_PARAM[precision]
    if zero in (1, 2):
        s = b * padded(n_params, n)
        return wire_bytes("reduce_scatter", s, n) + wire_bytes("all_gather", s, n)
    per_micro = sum(2 * wire_bytes("all_gather", b * padded(u, n), n)
                    + wire_bytes("reduce_scatter", b * padded(u, n), n) for u in unit_sizes)
    return grad_accum * per_micro


def hybrid_replica_wire_bytes(zero: int, n_params: int, precision: str, shard: int, reps: int,
                              unit_sizes: list[int], grad_accum: int = 1) -> float:
    """HYBRID_SHARD's second dimension: each reduced gradient slice (1/shard of Psi) is all-reduced
    across the `reps` replicas: 2(R-1)/R * Psi/S per reduction (per micro-step at ZeRO-3)."""
    b = BYTES_PER_PARAM[precision]
    if zero in (1, 2):
        return wire_bytes("all_reduce", b * padded(n_params, shard) // shard, reps)
    return grad_accum * sum(wire_bytes("all_reduce", b * padded(u, shard) // shard, reps)
                            for u in unit_sizes)


def local_sgd_wire_bytes_per_step(cfg, n_params: int) -> float:
    """Local SGD (parallel/local_sgd.py): one all-reduce of the fp32 parameters (with
    --sync-optimizer, of Adam's two moments too) after every H-th of T steps and after the last,
    ceil(T/H) in all: per step ceil(T/H)/T x 2(N-1)/N x 4P(1 + states), about DDP's bytes / H."""
    states = 2 if cfg.sync_optimizer and cfg.optimizer == "adam" else 0
    averages = -(-cfg.steps // cfg.sync_every)
    return averages * wire_bytes("all_reduce", 4 * n_params * (1 + states), cfg.dp) / cfg.steps


def async_staleness(workers: int, factor: float = 1.0, max_staleness: int = -1) -> dict:
    """Expected staleness of asynchronous SGD with a parameter server (parallel/async_ps.py): W
    workers, one of them `factor` times slower (1: none). Unbounded (K = -1), every worker always
    has a gradient in flight, so one on a step of time t_i misses t_i * sum_(j != i) 1/t_j
    updates: W - 1 for all without a straggler; with one, F(W-1) for it and W - 2 + 1/F for the
    others, and still W - 1 on average over updates. K = 0: each round's W gradients come from one
    version and are applied in turn, 0..W-1: (W - 1)/2 exactly. No formula for 0 < K: the bound
    (W - 1)(2K + 1) holds for every K >= 0."""
    W, F = workers, factor
    out = {"bound": None if max_staleness < 0 else (W - 1) * (2 * max_staleness + 1)}
    if max_staleness == 0:
        return {**out, "mean": (W - 1) / 2, "straggler": None, "others": None}
    if max_staleness > 0:
        return {**out, "mean": None, "straggler": None, "others": None}
    slow = F * (W - 1) if F != 1 else None
    return {**out, "mean": W - 1, "straggler": slow,
            "others": (W - 2 + 1 / F) if F != 1 else W - 1}


def async_server_wire_bytes_per_step(cfg, n_params: int) -> float:
    """Bytes the server sends per --steps step: a grant of [version, weights] (fp32) per update,
    --steps x W of them, and a last one to each worker that says stop."""
    workers = cfg.dp - 1
    return (cfg.steps * workers + workers) * 4 * (n_params + 1) / cfg.steps


def run_theory(cfg, n_params: int) -> dict:
    """The predictions for one RunConfig, as they go into the run report. With pipeline stages the
    ranks differ: `stages` holds one entry per pipeline rank, and the top level is stage 0's."""
    if cfg.pp > 1:
        return _pipeline_theory(cfg)
    apart = getattr(cfg, "ep", 1) > 1  # expert parallel: the experts' states go over edp
    units = gpt_unit_sizes(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers, cfg.tp, **_moe(cfg),
                           experts_apart=apart)
    out = _rank_theory(cfg, units, expert_unit_sizes(cfg, range(cfg.layers)) if apart else [])
    if getattr(cfg, "asynchronous", False):  # a parameter server's grants, not an all-reduce
        out["wire_bytes_per_step"] = {"dp": async_server_wire_bytes_per_step(cfg, sum(units))}
    micro = cfg.batch // (cfg.dp * cfg.grad_accum)  # sequences per forward pass on a rank
    if getattr(cfg, "sync_every", 0):  # local SGD: parameters averaged, not gradients
        out["wire_bytes_per_step"] = {"dp": local_sgd_wire_bytes_per_step(cfg, sum(units))}
    if getattr(cfg, "federated", False):  # a step is a round: one all-reduce of the weights
        out["wire_bytes_per_step"] = {"dp": wire_bytes("all_reduce", 4 * sum(units), cfg.dp)}
    if cfg.tp > 1:
        out["wire_bytes_per_step"]["tp"] = tp_wire_bytes_per_step(cfg) \
            + moe_sp_wire_bytes_per_step(cfg)
    if cfg.cp > 1:  # on the cp group: attention's traffic (plus the gradients' when dp = 1)
        wire = out["wire_bytes_per_step"]
        wire["cp"] = wire.get("cp", 0) + cp_wire_bytes_per_step(cfg)
    if getattr(cfg, "ep", 1) > 1:
        out["ep_all_to_all_uniform"] = ep_wire_bytes_per_step(cfg)
    return {"n_params": gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers,
                                        getattr(cfg, "experts", 0), getattr(cfg, "moe_every", 1)),
            **out, "activations_per_layer": _activations_per_layer(cfg, micro)}


def _moe(cfg) -> dict:
    return {"experts": getattr(cfg, "experts", 0), "moe_every": getattr(cfg, "moe_every", 1),
            "ep": getattr(cfg, "ep", 1)}


def _rank_theory(cfg, units: list[int], expert_units: list[int] = ()) -> dict:
    """Model states and data-parallel traffic of one rank holding `units` (parameters per unit).
    With expert parallel (ep > 1) it also holds `expert_units` (each MoE layer's E/ep experts,
    left out of `units`): their states are ZeRO'd over, and their gradients averaged over, the
    edp ranks ((dp x cp)/ep), the rest's over dp x cp."""
    if getattr(cfg, "ep", 1) > 1 and expert_units:
        return _expert_rank_theory(cfg, units, list(expert_units))
    n_params = sum(units)  # what one rank holds: all of it, its tensor-parallel slices, its stage
    micro_steps = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum  # forward+backward passes
    hybrid = 0 < cfg.dp_shard < cfg.dp  # HYBRID_SHARD: shard in groups, replicate across them
    # ZeRO's shard group: dp_shard x cp (context parallel ranks hold the same weights too)
    shard = (cfg.dp_shard if hybrid else cfg.dp) * getattr(cfg, "cp", 1)
    disk = bool(getattr(cfg, "offload_disk", ""))
    states = model_state_bytes(n_params, cfg.optimizer, cfg.precision, cfg.zero, shard, units,
                               cfg.offload, cfg.fp32_grad_accum, disk)
    wire: dict[str, float] = {}
    names = role_names(cfg)  # the comm records' names of the loss, shard and replica groups
    if cfg.zero == 0:
        grad_bytes = 4 if cfg.fp32_grad_accum else BYTES_PER_PARAM[cfg.precision]  # reduced dtype
        wire[names["loss"]] = dp_wire_bytes_per_step(grad_bytes * n_params, cfg.dp * cfg.cp)
        padding = 0
    else:
        wire[names["shard"]] = zero_wire_bytes_per_step(cfg.zero, n_params, cfg.precision, shard,
                                                        units, micro_steps)
        if hybrid:  # ("dp" when dp_shard = 1: every replica group is all of dp)
            wire[names["replicate"]] = hybrid_replica_wire_bytes(
                cfg.zero, n_params, cfg.precision, shard, cfg.dp // cfg.dp_shard, units, micro_steps)
        padding = (padded(n_params, shard) - n_params if cfg.zero < 3
                   else sum(padded(u, shard) - u for u in units))
        if cfg.offload:  # gradient slice to the host, updated parameter slice back, every step
            slice_bytes = BYTES_PER_PARAM[cfg.precision] * padded(n_params, shard) // shard
            wire["pcie"] = 2 * slice_bytes
    wire = {g: (b if cfg.dp * cfg.cp > 1 or g == "pcie" else 0) for g, b in wire.items()}
    out = {"n_params_per_rank": n_params, "padding_elements": padding, "memory": states,
           "wire_bytes_per_step": wire}
    if disk:
        out["disk_io_per_step"] = disk_io_bytes_per_step(cfg, n_params, units, shard)
    return out


def _expert_rank_theory(cfg, units: list[int], expert_units: list[int]) -> dict:
    """The dense units over dp x cp, the experts' as one data-parallel group of edp ranks (cp 1).
    HYBRID_SHARD (mesh.split_expert_replicas): an ep group inside a shard group of S = dp_shard x
    cp ranks leaves S/ep of an expert's replicas in each shard group, which shard its states;
    an ep group spanning whole shard groups leaves one (the experts are replicated, not sharded)."""
    dense = _rank_theory(SimpleNamespace(**{**vars(cfg), "ep": 1}), units)
    edp = cfg.dp * cfg.cp // cfg.ep
    shard = cfg.dp_shard * cfg.cp
    edp_shard = (shard // cfg.ep if shard % cfg.ep == 0 else 1) if 0 < cfg.dp_shard < cfg.dp else 0
    expert = _rank_theory(SimpleNamespace(**{**vars(cfg), "ep": 1, "dp": edp, "cp": 1,
                                             "dp_shard": edp_shard}), expert_units)
    names = expert_axes(cfg)  # the expert group's "dp", "dp_shard", "dp_rep": edp's parts
    wire = dict(dense["wire_bytes_per_step"])
    for g, b in expert["wire_bytes_per_step"].items():
        g = names.get(g) or g
        wire[g] = wire.get(g, 0) + b
    experts_held = sum(expert_units)
    out = {"n_params_per_rank": sum(units) + experts_held, "expert_params_per_rank": experts_held,
           "padding_elements": dense["padding_elements"] + expert["padding_elements"],
           "memory": {k: dense["memory"].get(k, 0) + expert["memory"].get(k, 0)
                      for k in dense["memory"] | expert["memory"]},
           "wire_bytes_per_step": wire}
    if "disk_io_per_step" in dense:  # --offload-disk (ZeRO-3: one file holds both)
        out["disk_io_per_step"] = {k: v + expert["disk_io_per_step"][k]
                                   for k, v in dense["disk_io_per_step"].items()}
    return out


def _activations_per_layer(cfg, micro: int) -> dict:
    elem = BYTES_PER_PARAM[cfg.precision]  # activations are kept in the compute precision
    return {"ours": gpt_activation_bytes_per_layer(cfg.seq, micro, cfg.d_model, cfg.heads,
                                                   cfg.checkpointing, elem, cfg.tp, cfg.sp,
                                                   cfg.cp, cfg.cp_impl),
            "korthikanti": activation_bytes_per_layer(cfg.seq, micro, cfg.d_model, cfg.heads,
                                                      cfg.checkpointing, tp=cfg.tp, sp=cfg.sp)}


def _pipeline_theory(cfg) -> dict:
    from .parallel.schedules import for_config, in_flight  # pure Python, no torch

    schedule = for_config(cfg)
    micro = cfg.batch // (cfg.dp * cfg.microbatches)  # sequences per micro-batch
    seq = cfg.seq // (cfg.cp * (cfg.tp if cfg.sp else 1))  # CP, SP: stages pass [b, s/(cp tp), h]
    boundary = micro * seq * cfg.d_model * BYTES_PER_PARAM[cfg.precision]  # [b, s, h]
    stages = []
    apart = getattr(cfg, "ep", 1) > 1  # expert parallel: the experts' states go over edp
    for r in range(cfg.pp):
        units = pipeline_stage_units(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers, schedule.owner, r,
                                     cfg.tp, **_moe(cfg), experts_apart=apart,
                                     stages=schedule.stages)
        mine = sorted(stage_blocks(schedule.owner, cfg.layers, r, schedule.stages)[0])  # its blocks
        stage = _rank_theory(cfg, units, expert_unit_sizes(cfg, mine) if apart else [])
        if getattr(cfg, "ep", 1) > 1:
            stage["ep_all_to_all_uniform"] = ep_wire_bytes_per_step(cfg, mine)
        stage["wire_bytes_per_step"]["pp"] = pipeline_p2p_bytes_per_step(
            schedule.owner, r, cfg.microbatches, boundary, schedule.stages)
        if schedule.directions == 2:  # DualPipe: the stage copies' gradients, one exchange a step
            held = sum(units) + (sum(expert_unit_sizes(cfg, mine)) if apart else 0)  # + E/ep experts
            stage["wire_bytes_per_step"]["pp"] += held * BYTES_PER_PARAM[cfg.precision]
        chunks = [schedule.stage_of(c) for c, o in enumerate(schedule.owner) if o == r]
        blocks = len(chunks) * cfg.layers // schedule.stages  # the stage's blocks
        moe_here = len(set(mine) & set(moe_blocks(cfg.layers, getattr(cfg, "experts", 0),
                                                  getattr(cfg, "moe_every", 1))))
        if cfg.tp > 1:
            stage["wire_bytes_per_step"]["tp"] = tp_wire_bytes_per_step(
                cfg, blocks=blocks, embed=0 in chunks, head=schedule.stages - 1 in chunks,
                moe=moe_here) + moe_sp_wire_bytes_per_step(cfg, moe_here)
        if cfg.cp > 1:
            wire = stage["wire_bytes_per_step"]
            wire["cp"] = wire.get("cp", 0) + cp_wire_bytes_per_step(cfg, blocks=blocks, moe=moe_here)
        if schedule.directions == 2:  # DualPipe: a rank's blocks see half the micro-batches
            for k, v in stage["wire_bytes_per_step"].items():
                stage["wire_bytes_per_step"][k] = v / 2 if k in ("tp", "cp") else v
            if "ep_all_to_all_uniform" in stage:
                stage["ep_all_to_all_uniform"] /= 2
        stage["microbatches_in_flight"] = in_flight(schedule)[r]
        stages.append(stage)
    return {"n_params": gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers,
                                        getattr(cfg, "experts", 0), getattr(cfg, "moe_every", 1)),
            **stages[0],
            "stages": stages, "activations_per_layer": _activations_per_layer(cfg, micro),
            "bubble": bubble_fraction(cfg.schedule, cfg.pp, cfg.microbatches, schedule.virtual)}


# ---------------------------------------------------------------------------------------------
# activations (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
# Models"): bytes per transformer layer for a micro-batch of b sequences of s tokens, hidden h,
# a heads, 16-bit activations with dropout, as the paper counts them
# ---------------------------------------------------------------------------------------------
def activation_bytes_per_layer(s: int, b: int, h: int, a: int, checkpointing: str = "none",
                               tp: int = 1, sp: bool = False) -> float:
    """none:      s*b*h*(34 + 5*a*s/h)                 (tp=1)
                  s*b*h*(10 + 24/t + 5*a*s/(h*t))      (tensor parallel t, no SP)
                  s*b*h/t*(34 + 5*a*s/h)               (tensor + sequence parallel)
    selective:    the 5as/h attention-core term is recomputed, not kept: 34*s*b*h (/t with SP)
    full:         only the layer input is kept: 2*s*b*h (/t with SP)"""
    sbh = s * b * h
    if checkpointing == "full":
        return 2 * sbh / (tp if sp else 1)
    attention_core = 0 if checkpointing == "selective" else 5 * a * s / h
    if tp == 1 or sp:
        return sbh / tp * (34 + attention_core)
    return sbh * (10 + 24 / tp + attention_core / tp)


def gpt_activation_bytes_per_layer(s: int, b: int, h: int, a: int, checkpointing: str = "none",
                                   elem_bytes: int = 4, tp: int = 1, sp: bool = False,
                                   cp: int = 1, cp_impl: str = "ring") -> float:
    """What parallel_mini's own block keeps for backward on one rank, exactly (derived op by op,
    tested to the byte against the meter). e = bytes per activation element (4 fp32, 2 bf16),
    t = tensor-parallel degree, q = t with sequence parallel else 1:
        none:       e*(2sbh/q + 2sbh + 12sbh/t + 4sb/q + a*s*s*b/t) + s*s
        selective:  e*(2sbh/q + 2sbh + 12sbh/t + 4sb/q)
        full:       e*sbh/q
    2sbh/q: the two LayerNorms' inputs (sequence-sharded with SP). 2sbh: the inputs of QKV and fc,
    whole on every rank (replicated without SP; all-gathered with SP, and kept gathered: Megatron
    saves the shard and gathers again in backward, we do not). 12sbh/t: QKV output (3), attention
    output (1), fc output (4) and GELU output (4), split by heads / features. a*s*s*b/t: the
    softmax output of this rank's heads. 4sb/q: LayerNorm mean and 1/std. s*s: the boolean mask.
    Against Korthikanti's 34 sbh + 5 a s^2 b (2-byte activations): their count adds dropout masks
    (2 sbh + a s^2 b bytes) and the attention dropout's output (2 a s^2 b, what multiplies V);
    ours has no dropout and PyTorch's softmax backward needs only its output.
    Context parallel (cp = C): every term is of this rank's s/C tokens, except attention's. The ring
    keeps no [s, s] scores at all, only its output and log-sum-exp (e*(s/C)bh/t + e*b(a/t)(s/C));
    Ulysses keeps the scores of a/(tC) heads over the whole sequence (e*a*s*s*b/(tC) + s*s)."""
    if cp > 1 and checkpointing == "none":
        local = gpt_activation_bytes_per_layer(s // cp, b, h, a, "selective", elem_bytes, tp, sp)
        if cp_impl == "ulysses":
            return local + elem_bytes * a * s * s * b / (tp * cp) + s * s
        return local + elem_bytes * ((s // cp) * b * h / tp + b * (a / tp) * (s // cp))
    s = s // cp
    sbh, q = s * b * h, (tp if sp else 1)
    if checkpointing == "full":
        return elem_bytes * sbh / q  # only the block's input
    kept = elem_bytes * (2 * sbh / q + 2 * sbh + 12 * sbh / tp + 4 * s * b / q)
    if checkpointing == "selective":
        return kept
    return kept + elem_bytes * a * s * s * b / tp + s * s


RANK_BASELINE_BYTES = 400 * 2 ** 20  # one rank's interpreter, torch and gloo, measured ~300 MB
# What a rank holds beyond its tensors' bytes, named (issue 26: 20,000 layers used 4.2 GB against
# 0.8 GB estimated). Measured as the growth of a rank's peak RSS (VmHWM) with --layers, 1 rank,
# 2 steps: d_model 16, 0.315 MB a block (0.08 MB estimated before); d_model 64, 2.13 MB (1.02).
LAYER_OBJECT_BYTES = 384 * 2 ** 10  # per block: its modules, and its ~12 parameters' tensors
#   (parameter, gradient, two moments, step), the autograd graph's saved tensors and the hooks,
#   each a Python object, a TensorImpl and a storage (~0.24 MB measured at d_model 16)
TRANSIENT_BYTES_PER_PARAM = 24  # beyond the 20 of `states`: the full parameters gathered after
#   the last step (4), Adam's foreach temporaries and the heap's slack (~18 B measured at d_model 64)
EXPERT_OBJECT_BYTES = 128 * 2 ** 10  # more per expert an MoE block holds: its 4 parameters'
#   tensors and its own autograd nodes (a 4-expert block grew 1.2 MB more than a dense one at
#   d_model 32, of which the estimate's states and transients covered ~0.8)
RECORD_BYTES = 1024  # one comm record or timeline event, a Python dict (~0.6-1 KB)
RECORDS_PER_LAYER_STEP = 8  # records per block and micro-batch of a step, an upper bound (comm
#   records per gradient bucket or parameter, events per op; dp 2, 400 blocks: 6 measured)


def _local_params(cfg) -> int:
    """sum(gpt_unit_sizes(...)) for the run, counted on one period of blocks (every moe_every-th
    is an MoE block; the others alike) and multiplied out: counting all of a 1,000,000-block
    model block by block took 2 minutes and 4.5 GB, for a refusal that must answer at once."""
    sizes = lambda n: gpt_unit_sizes(cfg.vocab, cfg.seq, cfg.d_model, n, cfg.tp, **_moe(cfg))
    period = max(1, getattr(cfg, "moe_every", 1))
    if cfg.layers <= 2 * period:
        return sum(sizes(cfg.layers))
    one = sizes(period)  # [embedding, the period's blocks, head]
    blocks = one[1:-1]
    whole, rest = divmod(cfg.layers, period)
    return one[0] + one[-1] + whole * sum(blocks) + sum(blocks[:rest])


# An MoE block's native memory beyond its tensors: a rank's RSS rises over its first ~100-200
# steps and levels off. Its cause is torch's own, not a log of ours: every step routes the tokens
# anew, so each expert's matmuls see a row count they may not have seen before, and native memory
# in use (glibc mallinfo2, not Python objects: gc and tracemalloc see nothing) grows with each new
# shape. Bisected in one process, 2 MoE blocks: 113 KB/step in use over steps 20-59; the same with
# every step routed alike, 0.1 KB/step; the experts' F.linear forward and backward alone on 8,192
# rows split 4 ways at random, 51 KB/step, split evenly, 0; a dense model, 0. Measured in a rank
# (2 MoE blocks of 4 experts top-2, 4,096 tokens a step, routing log off, RSS after each step): 255 -> 266 (step 25) -> 276 (100) -> 279 (200) ->
# 282 MB (256) -> 282 MB (298), 0.45 -> 0.12 -> 0.03 -> 0.006 MB/step; the same dense run stays
# at 247-248 MB. At batch 64 (16,384 tokens, 4 blocks, issue 26's run): 262 -> 289 (20) -> 321
# (60) -> 329 (100) -> 337 MB (198): malloc in use flat at 116 MB from step 60 on, its free holes
# still growing ~0.06 MB/step at the end (75 MB against this part's 192 MB).
# The part: 16 MB per block and 2 KB per token a block routes a step (27 MB over 2 blocks of
# 4,096 tokens measured; that it scales with the tokens is assumed, not yet measured).
MOE_HEAP_BYTES_PER_BLOCK = 16 * 2 ** 20
MOE_HEAP_BYTES_PER_TOKEN = 2 * 2 ** 10


def moe_run_bytes(cfg, b: int) -> tuple[int, int]:
    """(moe_activations, moe_heap) of one rank for `b` sequences per rank: what an MoE block keeps
    for backward beyond a dense MLP's (top-k: k rows per token through a [h -> 4h -> h] expert
    instead of one, the weighted outputs, the router's and the dispatch's [tokens, E] and
    [tokens, k] tensors), an upper bound with nothing dropped, fp32:
        4*s*b*h*(9(k-1) + 2k) + s*b*(40E + 64k)
    (measured, activations_peak per block minus a dense block's, seq 128, batch 8, d_model 64:
    3.47 MB at E4 top-2 against 3.70 from this; 0.57 at E4 top-1 against 0.75; 2.31 at E8 top-2
    against 3.87); and the native heap it grows to (MOE_HEAP_BYTES_PER_BLOCK/_PER_TOKEN)."""
    if not getattr(cfg, "experts", 0):
        return 0, 0
    blocks = -(-len(moe_blocks(cfg.layers, cfg.experts, cfg.moe_every)) // cfg.pp)  # a stage's most
    sb, k, E = (cfg.seq // cfg.cp) * b, cfg.top_k, cfg.experts
    acts = 4 * sb * cfg.d_model * (9 * (k - 1) + 2 * k) + sb * (40 * E + 64 * k)
    heap = MOE_HEAP_BYTES_PER_BLOCK + MOE_HEAP_BYTES_PER_TOKEN * sb
    return blocks * acts, blocks * heap


def local_run_bytes_estimate(cfg) -> dict:
    """A generous estimate of what one local run needs in all, to refuse a run that cannot fit
    before any rank starts. Per rank: 20 bytes per parameter it holds (fp32 Adam plus a spare
    gradient buffer), every block's activations for the rank's whole share of the batch (as if
    every micro-batch were in flight), the logits three times (logits, softmax, gradient), the
    global batch of token ids (inputs and targets, int64: every rank draws it), and
    RANK_BASELINE_BYTES; then what is not tensors' bytes: `transients` (TRANSIENT_BYTES_PER_PARAM),
    `layer_objects` (LAYER_OBJECT_BYTES per block the rank holds, EXPERT_OBJECT_BYTES more per
    expert of an MoE block) and `logs` (the comm records
    and op events of every step, RECORDS_PER_LAYER_STEP per block and micro-batch, and the MoE
    log: its counts per forward and its bounded sample of token choices, meters.RoutingLog).
    The launching process holds every rank's logs once more in the merged report, and its JSON
    (`report`). An MoE run adds `moe_activations` and `moe_heap` (moe_run_bytes). Returns the
    parts and the total over the world's ranks."""
    local_params = _local_params(cfg)
    b = cfg.batch // cfg.dp
    acts = cfg.layers * gpt_activation_bytes_per_layer(cfg.seq, b, cfg.d_model, cfg.heads, "none",
                                                       4, cfg.tp, cfg.sp, cfg.cp, cfg.cp_impl)
    logits = 3 * 4 * b * (cfg.seq // cfg.cp) * (cfg.vocab // cfg.tp)
    data = 2 * 8 * cfg.batch * cfg.seq
    blocks = -(-cfg.layers // cfg.pp)  # the most a pipeline stage holds
    micro = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    layer_objects = LAYER_OBJECT_BYTES * blocks
    # (+1: the full parameters' gathering after the last step is recorded too)
    logs = (cfg.steps + 1) * micro * (blocks + 2) * RECORDS_PER_LAYER_STEP * RECORD_BYTES
    if getattr(cfg, "experts", 0):
        moe_layers = len(moe_blocks(cfg.layers, cfg.experts, cfg.moe_every))
        tokens = min(512, b * cfg.seq)  # meters.ROUTING_SAMPLE_TOKENS
        per_token = 2 * (56 + 8 * cfg.top_k) + 3 * 8  # two lists of k, their pointers, a position
        logs += moe_layers * (cfg.steps * micro * RECORD_BYTES + 17 * tokens * per_token)
        layer_objects += -(-moe_layers // cfg.pp) * cfg.experts // cfg.ep * EXPERT_OBJECT_BYTES
    moe_acts, moe_heap = moe_run_bytes(cfg, b)
    per_rank = {"states": 20 * local_params, "activations": int(acts), "logits": logits,
                "data": data, "baseline": RANK_BASELINE_BYTES,
                "transients": TRANSIENT_BYTES_PER_PARAM * local_params,
                "layer_objects": layer_objects, "logs": logs,
                "moe_activations": moe_acts, "moe_heap": moe_heap}
    report = 2 * cfg.world_size * logs  # the merged report's dicts, and its JSON text
    return {**per_rank, "per_rank": sum(per_rank.values()), "report": report,
            "total": cfg.world_size * sum(per_rank.values()) + report}


# ---------------------------------------------------------------------------------------------
# pipeline parallel
# ---------------------------------------------------------------------------------------------
def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1, costs: dict | None = None) -> float:
    """Share of the pipeline's time a rank computes nothing, stages balanced, transfers free.

    naive (one micro-batch in the pipe): (p-1)/p.
    gpipe and 1f1b: (p-1)(F+B) idle beside m(F+B) busy: (p-1)/(m+p-1).
    interleaved, v chunks per rank each 1/v of the work: (p-1)/(v*m + p-1)
      (Narayanan et al. give (p-1)/(v*m) relative to the busy time; this is the same bubble as a
      share of the total).
    zb (ZB-H1, Qi et al., 2024): (p-1)(F+B-W) idle beside m(F+B+W) busy, with the op costs F, B, W
      given in `costs` (default: equal, which gives (p-1)/(3m+p-1), a third of 1F1B's bubble).
    zbv: its greedy order has no closed form; the value is that order replayed with `costs`.
    dualpipe, dualpipev: the DeepSeek-V3 report's (PP/2-1)(F&B+B-3W) (dualpipe_idle) beside each
      rank's busy time, PP the model's stages (dualpipe: p; dualpipev: 2p chunks of half a stage)."""
    p = pp
    if p == 1:
        return 0.0
    if schedule == "naive":
        return (p - 1) / p
    if schedule in ("gpipe", "1f1b", "pipedream", "pipedream-nostash"):
        return (p - 1) / (m + p - 1)  # PipeDream here drains at each step's end, as 1F1B does
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb":
        c = costs or {"F": 1.0, "B": 1.0, "W": 1.0}
        idle = max(0.0, (p - 1) * (c["F"] + c["B"] - c["W"]))
        return idle / (idle + m * (c["F"] + c["B"] + c["W"]))
    if schedule in ("dualpipe", "dualpipev"):
        c = costs or {"F": 1.0, "B": 1.0, "W": 1.0}
        stages = p if schedule == "dualpipe" else 2 * p
        idle = dualpipe_idle(stages, c)
        busy = (m if schedule == "dualpipe" else 2 * m) * (c["F"] + c["B"] + c["W"])
        return idle / (idle + busy)
    if schedule == "zbv":  # a greedy order has no closed form: replay it with the costs given
        from .parallel.schedules import build_schedule, idle_fractions, simulate
        c = costs or {"F": 1.0, "B": 1.0, "W": 1.0}
        s = build_schedule("zbv", p, m)
        return sum(idle_fractions(simulate(s, lambda r, op: c[op.kind]), p)) / p
    raise ValueError(f"no bubble formula for schedule {schedule!r}")


def pipeline_stage_units(vocab: int, seq: int, d_model: int, layers: int, owner: list[int],
                         rank: int, tp: int = 1, experts: int = 0, moe_every: int = 1,
                         ep: int = 1, experts_apart: bool = False,
                         stages: int | None = None) -> list[int]:
    """Parameters per unit on one pipeline rank. The model is cut into len(owner) chunks of
    layers/len(owner) blocks; the first chunk also holds the token and position embeddings, the last
    one the final LayerNorm and the LM head (as in Megatron-LM): those two stages are heavier.
    Counted from the placement of the rank's stage (placement.gpt_held), as gpt_unit_sizes.
    `stages`: DualPipe's model has fewer stages than chunks (each stage twice, placement.stage_blocks)."""
    model = SimpleNamespace(vocab=vocab, seq=seq, d_model=d_model, layers=layers, experts=experts,
                            moe_every=moe_every)
    stage = stage_blocks(owner, layers, rank, stages)
    return _unit_sizes(gpt_held(model, (tp, 0), (ep, 0), stage), experts_apart)


def zero3_gathered_peak(chunks: list[list[int]], prefetch: bool = True) -> int:
    """Elements ZeRO-3 holds gathered at most at once: the largest unit; with prefetch, the largest
    two units that run one after the other (the next one's all-gather is on the wire while one
    computes, in forward and in backward). `chunks`: each forward's units in the order it runs them,
    padded sizes (a pipeline rank's chunks run in forwards of their own: never one pair)."""
    pairs = [a + b for units in chunks for a, b in zip(units, units[1:])] if prefetch else []
    return max(pairs + [u for units in chunks for u in units])


def pipeline_p2p_bytes_per_step(owner: list[int], rank: int, m: int, boundary_bytes: int,
                                stages: int | None = None) -> int:
    """Bytes this rank sends per step: each micro-batch's activation [b, s, h] forward out of every
    chunk whose successor lives elsewhere, and its gradient backward out of every chunk whose
    predecessor does. Point to point: what is sent is the payload itself. DualPipe (`stages` =
    len(owner)/2): each copy carries half the micro-batches, and the two copies of a stage sum
    their gradients (pipeline._sum_copies: one exchange of the rank's gradients, not counted here)."""
    n = stages or len(owner)
    per_chunk = m * n // len(owner)  # micro-batches through each chunk
    sends = 0
    for c, r in enumerate(owner):
        if r != rank:
            continue
        sends += c % n + 1 < n and owner[c + 1] != rank
        sends += c % n > 0 and owner[c - 1] != rank
    return sends * per_chunk * boundary_bytes


# ---------------------------------------------------------------------------------------------
# DualPipe beside 1F1B and zero bubble: the DeepSeek-V3 report's table (DeepSeek-AI, 2024, table
# 2; DualPipeV: Sea AI Lab's "cut-in-half", 2025). PP is the number of pipeline STAGES (DualPipeV
# runs them on PP/2 devices). The report's B is the full backward (our B + W), W the weight part,
# and F&B a forward and a backward of two micro-batches run as one overlapped unit: F + B + W
# when nothing overlaps (the toy: one CPU), less when one's communication hides behind the other.
# ---------------------------------------------------------------------------------------------
def dualpipe_idle(stages: int, costs: dict, overlapped: float | None = None) -> float:
    """Idle time per device: (PP/2-1)(F&B + B_full - 3W). `overlapped`: F&B's time (default
    F + B_full, no overlap). The eight phases of parallel/schedules.py replayed with each F&B pair
    as one unit and equal op costs (the report's figure) give exactly this (tests/test_dualpipe.py);
    with unequal costs the formula is the report's estimate, off by a fraction of an op (replay
    the order for the toy's own costs: schedules.simulate)."""
    full = costs["B"] + costs["W"]
    fb = costs["F"] + full if overlapped is None else overlapped
    return max(0.0, (stages / 2 - 1) * (fb + full - 3 * costs["W"]))


def pipeline_table(stages: int, costs: dict | None = None, overlapped: float | None = None) -> list[dict]:
    """The report's rows for `stages` pipeline stages: bubble (idle time per device, in the costs'
    unit), parameters per device (x one stage's), activations per device (micro-batches of one
    stage's activations held at the peak), devices. Theory: formulas, not measured."""
    c = costs or {"F": 1.0, "B": 1.0, "W": 1.0}
    full = c["B"] + c["W"]
    dual = dualpipe_idle(stages, c, overlapped)
    return [
        {"method": "1F1B", "bubble": (stages - 1) * (c["F"] + full), "parameters": 1,
         "activations": stages, "devices": stages},
        {"method": "ZB1P", "bubble": (stages - 1) * (c["F"] + full - 2 * c["W"]), "parameters": 1,
         "activations": stages, "devices": stages},
        {"method": "DualPipe", "bubble": dual, "parameters": 2, "activations": stages + 1,
         "devices": stages},
        {"method": "DualPipeV", "bubble": dual, "parameters": 2, "activations": stages + 1,
         "devices": stages // 2},
    ]
