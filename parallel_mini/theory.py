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

from fractions import Fraction

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int64": 8}


def wire_bytes(op: str, payload_bytes: int, n: int, rank_in_chain: int = 0) -> int:
    """Bytes one rank sends for `op` over a group of `n` ranks with payload S = `payload_bytes`.

    Exact when S is a multiple of n; otherwise chunks differ by one element and the mean is given
    (rounded down). A rank's own chunk sizes are measured by the ring implementation itself."""
    if n <= 1:
        return 0
    s = Fraction(payload_bytes)
    factor = {
        "all_reduce": Fraction(2 * (n - 1), n),
        "all_gather": Fraction(n - 1, n),
        "reduce_scatter": Fraction(n - 1, n),
        "all_to_all": Fraction(n - 1, n),
        "send": Fraction(1),
        "recv": Fraction(0),
        "broadcast": Fraction(1 if rank_in_chain < n - 1 else 0),
    }[op]
    return int(s * factor)


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
def gpt_param_count(vocab: int, seq: int, d_model: int, layers: int) -> int:
    """Parameters of parallel_mini's GPT (untied LM head, learned positions, biases, LayerNorms).

    The textbook count h*v + L(12h^2 + 13h) + 2h ties the LM head to the embedding and leaves out
    position embeddings. Ours adds both, so that pipeline stages own disjoint weights:
        v*h (tokens) + s*h (positions) + L(12h^2 + 13h) + 2h (final LN) + h*v (LM head, no bias)
    Per block 12h^2 + 13h: QKV 3h^2+3h, attention out h^2+h, MLP 4h^2+4h and 4h^2+h, 2 LNs 4h."""
    h, v, s, L = d_model, vocab, seq, layers
    return v * h + s * h + L * (12 * h * h + 13 * h) + 2 * h + h * v


def dp_wire_bytes_per_step(grad_bytes: int, dp: int) -> int:
    """Data parallel moves every gradient once per optimizer step: 2(N-1)/N * gradient bytes,
    whatever the bucketing (buckets only change *when* bytes move) and however many micro-steps
    are accumulated (only the last one syncs)."""
    return wire_bytes("all_reduce", grad_bytes, dp)


def model_state_bytes(n_params: int, optimizer: str = "adam", precision: str = "fp32") -> dict:
    """Model-state bytes of one full replica (no sharding): the DP row of the memory table."""
    if precision != "fp32":
        raise ValueError(f"precision {precision!r} arrives with the memory topic")
    per_param_opt = {"adam": 8, "sgd": 0}[optimizer]  # Adam: exp_avg + exp_avg_sq in fp32
    return {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": per_param_opt * n_params}


def run_theory(cfg, n_params: int) -> dict:
    """The predictions for one RunConfig, as they go into the run report."""
    states = model_state_bytes(n_params, cfg.optimizer, cfg.precision)
    return {
        "n_params": n_params,
        "memory": states,
        "wire_bytes_per_step": {"dp": dp_wire_bytes_per_step(states["grads"], cfg.dp)},
    }
