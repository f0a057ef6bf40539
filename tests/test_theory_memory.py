"""at_scale.memory_per_gpu with tensor (tp), pipeline (pp) and sequence (sp) parallel: model states
Psi/(tp*pp) per GPU, then ZeRO over the N data-parallel ranks; activations L x Korthikanti's per-layer
count with tp/sp applied and unchanged by pp (1F1B). The expected numbers are computed here by hand
(bytes per parameter x parameters / degrees), not read back from the library."""
from __future__ import annotations

import pytest

from parallel_mini import theory
from parallel_mini.course import at_scale

PSI = 7_000_000_000  # the 7B preset: 32 layers, h = 4096, 32 heads
L, H, A = 32, 4096, 32
S, B = 2048, 1
SEVEN_B = dict(layers=L, d_model=H, heads=A, seq=S, micro_batch=B)


def _states(d: dict) -> float:
    return d["params"] + d["grads"] + d["optimizer"]


def test_old_call_signature_is_unchanged_and_means_tp_pp_1():
    old = at_scale.memory_per_gpu(PSI, 8, 3, "bf16-mixed", "adam", L, H, A, S, B, "none", False)
    assert old == at_scale.memory_per_gpu(PSI, 8, 3, "bf16-mixed", "adam", L, H, A, S, B, "none",
                                        False, tp=1, pp=1, sp=False)
    assert _states(old) == 16 * PSI / 8  # 14 GB, the seed's ZeRO-3 row
    assert old["activations"] == L * S * B * H * (34 + 5 * A * S / H)


def test_tp2_pp2_zero1_on_4_dp_ranks_shards_a_quarter_of_the_model():
    got = at_scale.memory_per_gpu(PSI, 4, 1, "bf16-mixed", "adam", tp=2, pp=2, **SEVEN_B)
    quarter = PSI // 4  # 1.75e9 parameters per GPU after TP x PP
    # ZeRO-1 over N = 4: bf16 params and grads whole (2 + 2 bytes), 12 optimizer bytes sharded
    assert (got["params"], got["grads"], got["optimizer"]) == (
        2 * quarter, 2 * quarter, 12 * quarter // 4)
    assert _states(got) == 12.25e9
    # the same as model_state_bytes of Psi/4 sharded over 4
    ref = theory.model_state_bytes(quarter, "adam", "bf16-mixed", 1, 4)
    assert {k: got[k] for k in ref} == ref


@pytest.mark.parametrize("zero, per_param", [(0, 16), (3, 16 / 8)])
def test_pp_halves_the_model_states_and_leaves_activations(zero, per_param):
    one = at_scale.memory_per_gpu(PSI, 8, zero, **SEVEN_B)
    two = at_scale.memory_per_gpu(PSI, 8, zero, pp=2, **SEVEN_B)
    assert _states(one) == per_param * PSI
    assert _states(two) == per_param * PSI / 2  # 112 GB -> 56 GB at ZeRO-0
    # 1F1B: stage 0 holds p micro-batches of L/p layers = L layers of one micro-batch
    assert two["activations"] == one["activations"] == L * S * B * H * (34 + 80)
    assert at_scale.memory_per_gpu(PSI, 8, zero, pp=8, **SEVEN_B)["activations"] == one["activations"]


def test_70b_zero3_tp8_pp4_on_8_dp_ranks():
    got = at_scale.memory_per_gpu(70_000_000_000, 8, 3, tp=8, pp=4, layers=80, d_model=8192,
                                heads=64, seq=4096, micro_batch=1)
    assert _states(got) == 16 * 70e9 / (8 * 4 * 8)  # 4.375 GB on each of 256 GPUs


def test_activations_with_tp_and_sp_follow_korthikanti():
    sbh = S * B * H
    five_as_h = 5 * A * S / H  # = 80 for the 7B preset at 2048 tokens
    tp2 = at_scale.memory_per_gpu(PSI, 1, 0, tp=2, **SEVEN_B)["activations"]
    tp2_sp = at_scale.memory_per_gpu(PSI, 1, 0, tp=2, sp=True, **SEVEN_B)["activations"]
    assert tp2 == L * sbh * (10 + 24 / 2 + five_as_h / 2)  # 62 sbh per layer
    assert tp2_sp == L * sbh / 2 * (34 + five_as_h)  # 57 sbh per layer
    assert tp2_sp == 32 * 2048 * 4096 * 57
    assert tp2_sp < tp2 < L * sbh * 114
    # checkpointing: selective drops 5as/h, full keeps the layer input (2 sbh, /t with SP)
    sel = at_scale.memory_per_gpu(PSI, 1, 0, tp=4, sp=True, checkpointing="selective", **SEVEN_B)
    assert sel["activations"] == L * 34 * sbh / 4
    full = at_scale.memory_per_gpu(PSI, 1, 0, tp=4, sp=True, checkpointing="full", **SEVEN_B)
    assert full["activations"] == L * 2 * sbh / 4
    # SP is a TP feature: TP=1 with sp=True is plain TP=1
    assert at_scale.memory_per_gpu(PSI, 1, 0, sp=True, **SEVEN_B) == \
        at_scale.memory_per_gpu(PSI, 1, 0, **SEVEN_B)


def test_offload_moves_the_optimizer_off_the_gpu_after_tp_pp():
    got = at_scale.memory_per_gpu(PSI, 4, 2, tp=2, pp=2, offload=True, **SEVEN_B)
    quarter = PSI // 4
    assert (got["params"], got["grads"], got["optimizer"]) == (2 * quarter, 2 * quarter // 4, 0)
    assert "host" not in got


def test_model_parallel_params_rounds_up():
    assert at_scale.model_parallel_params(PSI, 2, 2) == 1_750_000_000
    assert at_scale.model_parallel_params(7, 2, 1) == 4
    assert at_scale.model_parallel_params(12) == 12
