"""Tensor parallel (Megatron): equal to the reference at tp 1, 2, 4 and with DP / ZeRO; per-rank
parameter bytes and tp traffic equal theory; bad layouts refused up front."""
import pytest

from parallel_mini import theory
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.runtime.launch import run


def _check(report, group):
    last = len(report.ranks) - 1
    assert report.wire_bytes_per_step(last).get(group, 0) == report.theory["wire_bytes_per_step"][group]
    m = report.ranks[last]["memory"]
    assert {k: m[k] for k in ("params", "grads", "optimizer")} == report.theory["memory"]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_equals_reference(tp):
    report = run(RunConfig(tp=tp, steps=3, reference=True))
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail
    if tp > 1:
        _check(report, "tp")
        # each rank holds 1/tp of the matrices and vocabulary tables, whole LayerNorms/row biases
        assert report.theory["n_params_per_rank"] == theory.gpt_local_param_count(128, 32, 64, 4, tp)
        assert report.ranks[0]["memory"]["params"] == 4 * report.theory["n_params_per_rank"]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_tp_composes_with_data_parallel_and_zero(zero, shared_run):
    report = shared_run(RunConfig(dp=2, tp=2, zero=zero, steps=2, reference=True))
    assert report.max_abs_diff <= 1e-5
    _check(report, "tp")
    _check(report, "dp")


def test_tp_with_checkpointing_and_accumulation(shared_run):
    """Full checkpointing re-runs one all-reduce per block in backward (measured; see
    theory.tp_wire_bytes_per_step for why not two)."""
    plain = run(RunConfig(tp=2, grad_accum=2, steps=2))
    ck = shared_run(RunConfig(tp=2, grad_accum=2, checkpointing="full", steps=2, reference=True))
    assert ck.max_abs_diff <= 1e-5
    _check(ck, "tp")
    extra = ck.wire_bytes_per_step()["tp"] - plain.wire_bytes_per_step()["tp"]
    activation = 8 // 2 * 32 * 64 * 4  # micro-batch [b/k, s, h] fp32
    assert extra == 2 * 4 * activation * 1  # 2 micro-steps x 4 blocks x one all-reduce (2(t-1)/t = 1)


def test_vocab_parallel_never_builds_full_logits():
    """The head is column-parallel: each rank's logits have vocab/tp columns."""
    import torch

    from parallel_mini.comm import Comm
    from parallel_mini.runtime.launch import run_ranks

    def rank_fn():
        from parallel_mini.mesh import build_mesh
        from parallel_mini.model import build_model
        from parallel_mini.parallel.tensor import apply_tensor_parallel
        cfg = RunConfig(tp=2)
        model = apply_tensor_parallel(build_model(cfg), Comm(build_mesh(cfg)))
        return tuple(model(torch.zeros(2, 32, dtype=torch.long)).shape)

    assert [r.value for r in run_ranks(rank_fn, 2)] == [(2, 32, 64), (2, 32, 64)]


@pytest.mark.parametrize("bad,field", [(dict(tp=3, heads=4), "--heads"),
                                       (dict(tp=4, vocab=126, heads=4), "--vocab")])
def test_bad_layout_refused(bad, field):
    with pytest.raises(ConfigError, match=field):
        RunConfig(**bad).validate()


@pytest.mark.parametrize("kw", [dict(tp=2), dict(tp=4), dict(tp=2, dp=2, zero=3),
                                dict(tp=2, grad_accum=2, checkpointing="full")])
def test_sequence_parallel_equal_same_activation_bytes_less_memory(kw, shared_run):
    """SP: equal to the reference; the activation traffic is the same bytes as plain TP (each
    all-reduce became an all-gather + a reduce-scatter), plus the sequence-sharded parameters'
    gradients; activation memory per rank goes down. The plain run is shared (shared_run) with
    the test above that runs it, where one does (the reference is computed after the steps:
    their measured bytes are the same with it)."""
    sp = run(RunConfig(sp=True, steps=2, reference=True, **kw))
    plain = shared_run(RunConfig(steps=2, reference=True, **kw))
    assert sp.max_abs_diff <= 1e-5
    _check(sp, "tp")
    assert sp.ranks[0]["memory"]["activations_peak"] < plain.ranks[0]["memory"]["activations_peak"]
    ops = {r["op"] for r in sp.ranks[0]["comm"] if r["group"] == "tp" and r.get("layer") == "sp"}
    assert ops == {"all_gather", "reduce_scatter"}


def test_sp_needs_tp_and_divisible_sequence():
    with pytest.raises(ConfigError, match="--sp"):
        RunConfig(sp=True).validate()
    with pytest.raises(ConfigError, match="--seq"):
        RunConfig(tp=4, sp=True, seq=30).validate()


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
@pytest.mark.parametrize("mode", ["none", "full"])
def test_activation_bytes_per_layer_with_tp_and_sp(tp, sp, mode):
    """One more layer adds exactly theory.gpt_activation_bytes_per_layer(..., tp, sp) per rank."""
    shape = dict(tp=tp, sp=sp, checkpointing=mode, batch=8, seq=32, d_model=64, heads=4, steps=1)
    one = run(RunConfig(layers=1, **shape)).ranks[0]["memory"]["activations_peak"]
    two = run(RunConfig(layers=2, **shape)).ranks[0]["memory"]["activations_peak"]
    assert two - one == theory.gpt_activation_bytes_per_layer(32, 8, 64, 4, mode, 4, tp, sp)


@pytest.mark.parametrize("sp", [False, True])
def test_comm_per_layer(sp):
    """Each block, per micro-step: without SP 4 all-reduces (f before QKV and fc in backward, g
    after both projections in forward); with SP each becomes an all-gather + reduce-scatter pair."""
    from collections import Counter
    report = run(RunConfig(tp=2, sp=sp, steps=1))
    per_module = Counter((r["module"], r["op"]) for r in report.ranks[0]["comm"]
                         if r["group"] == "tp" and r.get("module", "").startswith("blocks.0."))
    if not sp:
        assert per_module == {("blocks.0.attn.qkv", "all_reduce"): 1, ("blocks.0.mlp.fc", "all_reduce"): 1,
                              ("blocks.0.attn.proj", "all_reduce"): 1, ("blocks.0.mlp.proj", "all_reduce"): 1}
    else:
        for name in ("attn.qkv", "mlp.fc", "attn.proj", "mlp.proj"):
            assert per_module[(f"blocks.0.{name}", "all_gather")] == 1
            assert per_module[(f"blocks.0.{name}", "reduce_scatter")] == 1
