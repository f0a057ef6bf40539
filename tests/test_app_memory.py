"""The "Memory per GPU" page, driven headless with AppTest: the seed's ZeRO row for 7B on 8 GPUs,
the fits / does-not-fit verdict against the GPU's capacity, a live toy run at all four ZeRO
stages whose measured model states equal the formula to the byte, the same with tensor + sequence
parallel (each rank's TP slices sharded by ZeRO), and the pipeline degree (theory: model states
/ PP; live: each stage's states sharded by ZeRO, equal to that stage's formula to the byte). Expected numbers are computed here by
hand (bytes per parameter x parameters / N), not read back from the library."""
from __future__ import annotations

import pytest
import streamlit as st

from parallel_mini.runtime.launch import RankError
from test_app import (_app, _assert_clean, _chart, _charts, _rows_with, _widget, assert_steps,
                      record_steps)

PAGE = "app_pages/memory.py"
STAGES = ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
# the default toy ("toy: 4 layers x d64", vocab 128, seq 32): v*h + s*h + L(12h^2 + 13h) + 2h + h*v
H, V, S, L = 64, 128, 32, 4
TOY_PARAMS = V * H + S * H + L * (12 * H * H + 13 * H) + 2 * H + H * V
# one rank's parameters at tp = 2: vocabulary tables, the blocks' matrices and column-parallel
# biases halved; position embeddings, LayerNorms and row-parallel biases (6h per block) whole
TOY_TP2_PARAMS = V * H // 2 + S * H + L * ((12 * H * H + 7 * H) // 2 + 6 * H) + 2 * H + H * V // 2


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _page():
    return _app(PAGE)


def _metric_of(at, stage: int):
    return _widget(at.metric, f"ZeRO-{stage} model states")


def _set(at, kind: str, label_start: str, value):
    _widget(getattr(at, kind), label_start).set_value(value)
    at.run()
    _assert_clean(at)


def test_memory_page_renders_with_theory_bars_and_a_run_live_button():
    at = _page()
    _assert_clean(at)
    assert at.title[0].value == "Memory per GPU"
    assert [b.label for b in at.button] == ["Run live"]
    assert any("Press **Run live**" in i.value for i in at.info)
    # toy, 2 GPUs, fp32 Adam: ZeRO-0 holds 4P + 4P + 8P, ZeRO-3 a half of it (no padding at N=2)
    bars = _rows_with(_chart(at, "Memory per GPU by ZeRO stage"), "category")
    by = {(r["stage"], r["category"]): r["bytes"] for r in bars}
    assert (by["ZeRO-0", "params"], by["ZeRO-0", "grads"], by["ZeRO-0", "optimizer"]) == (
        4 * TOY_PARAMS, 4 * TOY_PARAMS, 8 * TOY_PARAMS)
    assert by["ZeRO-3", "params"] + by["ZeRO-3", "grads"] + by["ZeRO-3", "optimizer"] == 8 * TOY_PARAMS
    assert {r["stage"] for r in bars} == set(STAGES)
    # the TP and PP degrees are there, enabled, at 1; SP waits for TP > 1
    tp_pp = [w for w in at.radio if "parallel degree" in w.label]
    assert [(w.value, list(w.options), w.disabled) for w in tp_pp] == [
        (1, ["1", "2", "4", "8"], False)] * 2
    assert _widget(at.checkbox, "Sequence parallel").disabled
    assert any("**2 GPU(s)** = N × TP × PP = 2 × 1 × 1" in m.value for m in at.markdown)


def test_seed_row_7b_on_8_gpus_bf16_adam():
    at = _page()
    _set(at, "selectbox", "Model", "7B")
    _set(at, "select_slider", "GPUs", 8)
    _set(at, "radio", "Precision", "bf16-mixed")
    _set(at, "radio", "Optimizer", "adam")
    # 16 bytes/param x 7e9 = 112 GB; 4P + 12P/8; 2P + 14P/8; 16P/8
    assert [_metric_of(at, k).value for k in range(4)] == ["112 GB", "38.5 GB", "26.25 GB", "14 GB"]
    assert any("112 GB → 38.5 GB → 26.25 GB → 14 GB" in m.value for m in at.markdown)
    assert any("Theory only" in i.value for i in at.info)
    assert not at.button  # nothing to run live for a 7B model
    chart = _chart(at, "Memory per GPU by ZeRO stage")
    bars = _rows_with(chart, "category")
    zero3 = {r["category"]: r["bytes"] for r in bars if r["stage"] == "ZeRO-3"}
    assert zero3["params"] == 2 * 7e9 / 8 and zero3["optimizer"] == 12 * 7e9 / 8
    assert zero3["activations"] > 0
    (cap,) = [r for r in _rows_with(chart, "label") if str(r["label"]).startswith("GPU capacity")]
    assert cap["value"] == 80  # the rule, in GB


def test_fits_verdict_flips_with_the_gpu_capacity():
    at = _page()
    _set(at, "selectbox", "Model", "7B")
    _set(at, "select_slider", "GPUs", 1)
    _set(at, "radio", "Precision", "bf16-mixed")
    _set(at, "select_slider", "Micro-batch", 1)
    _set(at, "select_slider", "Sequence length", 1024)
    # 112 GB of states + 32 layers x s*b*h*(34 + 5as/h) = 9.93 GB of activations = 121.9 GB
    acts = 32 * 1024 * 1 * 4096 * (34 + 5 * 32 * 1024 / 4096)
    assert 80e9 < 112e9 + acts < 141e9

    def verdicts():
        out = {k: _metric_of(at, k).proto.delta.split(" (")[0] for k in range(4)}
        fits = {r["stage"]: r["fits"] for r in _rows_with(_chart(at, "Memory per GPU by ZeRO"), "fits")}
        assert {k: ("fits" if fits[f"ZeRO-{k}"] else "does not fit") for k in range(4)} == out
        return out

    _set(at, "selectbox", "GPU capacity", "80 GB (A100/H100 80G)")
    assert _metric_of(at, 0).proto.delta == f"does not fit ({(112e9 + acts) / 1e9:.4g} GB)"
    assert verdicts() == {k: "does not fit" for k in range(4)}  # 1 GPU: nothing is sharded
    assert any(":red[does not fit]" in m.value and "ZeRO-0" in m.value for m in at.markdown)
    _set(at, "selectbox", "GPU capacity", "141 GB (H200)")
    assert verdicts() == {k: "fits" for k in range(4)}
    _set(at, "select_slider", "GPUs", 8)
    _set(at, "selectbox", "GPU capacity", "24 GB (RTX 4090)")
    # 8 GPUs, 24 GB: only ZeRO-3 (14 GB of states + 9.93 GB) squeezes in
    assert verdicts() == {0: "does not fit", 1: "does not fit", 2: "does not fit", 3: "fits"}
    # activations decide: at 2048 tokens ZeRO-3's 14 GB of states + 30.6 GB of activations
    # overflow 40 GB; full checkpointing keeps 2sbh per layer (0.54 GB) and it fits again
    _set(at, "select_slider", "Sequence length", 2048)
    _set(at, "selectbox", "GPU capacity", "40 GB (A100 40G)")
    assert 14e9 < 40e9 < 14e9 + 32 * 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert verdicts()[3] == "does not fit"
    _set(at, "radio", "Activation checkpointing", "full")
    assert verdicts()[3] == "fits"


def _live(at) -> dict[tuple[str, str, str], float]:
    rows = [r for r in _rows_with(_chart(at, "Memory per GPU: measured"), "source") if "category" in r]
    out = {(r["stage"], r["category"], r["source"]): r["bytes"] for r in rows}
    assert len(out) == len(rows)
    return out


def test_live_toy_run_measures_model_states_equal_to_theory_at_every_stage(monkeypatch):
    at = _page()
    _set(at, "select_slider", "GPUs", 2)
    _set(at, "radio", "Precision", "fp32")
    _set(at, "radio", "Optimizer", "adam")
    steps = record_steps(monkeypatch)
    at.button[0].click().run()
    _assert_clean(at)
    assert_steps(at, steps, [f"ZeRO-{z}: training on 2 rank(s)…" for z in range(4)],
                 done="all four stages measured")

    p = TOY_PARAMS  # every unit (8192, 2048, 49984, 128, 8192) is even: no padding at N = 2
    expected = {"ZeRO-0": (4 * p, 4 * p, 8 * p), "ZeRO-1": (4 * p, 4 * p, 8 * p // 2),
                "ZeRO-2": (4 * p, 4 * p // 2, 8 * p // 2), "ZeRO-3": (4 * p // 2, 4 * p // 2, 8 * p // 2)}
    live = _live(at)
    assert {s for s, _, _ in live} == set(STAGES)
    for stage, want in expected.items():
        for cat, b in zip(("params", "grads", "optimizer"), want):
            assert live[stage, cat, "measured"] == b, (stage, cat)
            assert live[stage, cat, "predicted"] == b, (stage, cat)
        assert live[stage, "activations", "measured"] > 0
        # Korthikanti, no checkpointing: L x s*b*h*(34 + 5as/h), micro-batch b = 4, heads a = 4
        assert live[stage, "activations", "predicted"] == L * S * 4 * H * (34 + 5 * 4 * S / H)
    assert live["ZeRO-0", "transient", "measured"] > 0  # DP's gradient buckets
    (ok,) = at.success
    assert "equal to the byte" in ok.value
    table = at.dataframe[0].value
    assert list(table["stage"]) == STAGES
    for cat in ("params", "grads", "optimizer"):
        assert list(table[f"{cat}: measured − predicted (B)"]) == [0, 0, 0, 0]
    assert list(table["every rank = its formula"]) == ["yes"] * 4
    peak = float(_widget(at.metric, "Total live peak").value.split()[0])
    assert peak > 0

    # a knob moved afterwards starts nothing: the page says the result is stale
    _set(at, "radio", "Activation checkpointing", "full")
    assert any("settings changed" in w.value for w in at.warning)
    assert _chart(at, "Memory per GPU: measured")


def test_live_offload_puts_the_optimizer_on_the_host_to_the_byte():
    at = _page()
    _set(at, "select_slider", "GPUs", 2)
    _set(at, "radio", "Precision", "bf16-mixed")
    _set(at, "checkbox", "Offload", True)
    at.button[0].click().run()
    _assert_clean(at)
    p = TOY_PARAMS
    live = _live(at)
    for stage in ("ZeRO-1 + offload", "ZeRO-2 + offload"):
        # host: fp32 master slice + two fp32 moments = 12 bytes per parameter of the 1/2 shard
        assert live[stage, "host", "measured"] == live[stage, "host", "predicted"] == 12 * p // 2
        assert live[stage, "optimizer", "measured"] == 0
    assert ("ZeRO-0", "host", "measured") not in live  # offload applies to stages 1-2 only
    assert "equal to the byte" in at.success[0].value


def _stage_bars(at) -> dict[tuple[str, str], float]:
    bars = _rows_with(_chart(at, "Memory per GPU by ZeRO stage"), "category")
    return {(r["stage"], r["category"]): r["bytes"] for r in bars}


def test_live_tp2_with_sp_shards_each_ranks_slices_to_the_byte_and_shrinks_activations():
    at = _page()
    _set(at, "select_slider", "GPUs", 1)
    _set(at, "radio", "Precision", "fp32")
    _set(at, "radio", "Optimizer", "adam")
    at.button[0].click().run()  # TP = 1 on one rank (the per-rank micro-batch is N-independent)
    _assert_clean(at)
    acts_tp1 = {s: _live(at)[s, "activations", "measured"] for s in STAGES}
    korthikanti_tp1 = L * S * 4 * H * (34 + 5 * 4 * S / H)  # sbh(34 + 5as/h), b = 4, a = 4
    assert _stage_bars(at)["ZeRO-0", "activations"] == korthikanti_tp1

    _set(at, "select_slider", "GPUs", 2)
    _set(at, "radio", "Tensor parallel", 2)
    _set(at, "checkbox", "Sequence parallel", True)
    assert any("runs live here on 4 rank(s) (N × TP × PP = 2 × 2 × 1)" in i.value for i in at.info)
    # Korthikanti with TP + SP: (sbh/t)(34 + 5as/h), half of TP = 1
    korthikanti_sp = L * S * 4 * H / 2 * (34 + 5 * 4 * S / H)
    assert _stage_bars(at)["ZeRO-0", "activations"] == korthikanti_sp == korthikanti_tp1 / 2
    at.button[0].click().run()
    _assert_clean(at)

    p = TOY_TP2_PARAMS  # 111,104; every unit of a rank is even: no padding at N = 2
    expected = {"ZeRO-0": (4 * p, 4 * p, 8 * p), "ZeRO-1": (4 * p, 4 * p, 8 * p // 2),
                "ZeRO-2": (4 * p, 4 * p // 2, 8 * p // 2), "ZeRO-3": (4 * p // 2, 4 * p // 2, 8 * p // 2)}
    live = _live(at)
    bars = _stage_bars(at)
    for stage, want in expected.items():
        for cat, b in zip(("params", "grads", "optimizer"), want):
            assert live[stage, cat, "measured"] == live[stage, cat, "predicted"] == b, (stage, cat)
            assert bars[stage, cat] == b  # the theory bars above predict the run exactly
        assert live[stage, "activations", "predicted"] == korthikanti_sp
        # each rank keeps its heads' and its sequence shard's activations: well under TP = 1's
        assert 0 < live[stage, "activations", "measured"] < 0.6 * acts_tp1[stage], stage
    assert "equal to the byte" in at.success[0].value
    table = at.dataframe[0].value
    assert list(table["every rank = its formula"]) == ["yes"] * 4  # all 4 ranks (2 dp x 2 tp)
    for cat in ("params", "grads", "optimizer"):
        assert list(table[f"{cat}: measured − predicted (B)"]) == [0, 0, 0, 0]


def test_pp_and_tp_divide_a_big_presets_model_states_and_pp_keeps_its_activations():
    at = _page()
    _set(at, "selectbox", "Model", "7B")
    _set(at, "select_slider", "GPUs", 8)
    _set(at, "radio", "Precision", "bf16-mixed")
    _set(at, "radio", "Optimizer", "adam")
    before = _stage_bars(at)
    acts = 32 * 2048 * 1 * 4096 * (34 + 5 * 32 * 2048 / 4096)  # 30.6 GB, micro-batch 1
    assert before["ZeRO-0", "activations"] == acts

    _set(at, "radio", "Pipeline parallel", 2)
    after = _stage_bars(at)
    half = 3.5e9  # Ψ/PP parameters per GPU, then ZeRO over N = 8
    assert [after[f"ZeRO-{k}", "params"] + after[f"ZeRO-{k}", "grads"]
            + after[f"ZeRO-{k}", "optimizer"] for k in range(4)] == [
        16 * half, 4 * half + 12 * half / 8, 2 * half + 14 * half / 8, 16 * half / 8]
    for k in range(4):
        for cat in ("params", "grads", "optimizer"):
            assert after[f"ZeRO-{k}", cat] == before[f"ZeRO-{k}", cat] / 2
        assert after[f"ZeRO-{k}", "activations"] == acts  # 1F1B: stage 0 holds L layers' worth
    assert [_metric_of(at, k).value for k in range(4)] == ["56 GB", "19.25 GB", "13.12 GB", "7 GB"]
    assert _metric_of(at, 0).proto.delta == f"does not fit ({(56e9 + acts) / 1e9:.4g} GB)"
    assert any("**16 GPU(s)** = N × TP × PP = 8 × 1 × 2" in m.value for m in at.markdown)

    # TP = 2 on top: states / 4; activations sbh(10 + 24/t + 5as/(ht)) = 62 sbh, SP: 57 sbh
    _set(at, "radio", "Tensor parallel", 2)
    both = _stage_bars(at)
    assert both["ZeRO-3", "params"] == 2 * 7e9 / 4 / 8
    sbh = 2048 * 4096
    assert both["ZeRO-3", "activations"] == 32 * sbh * (10 + 24 / 2 + 80 / 2)
    _set(at, "checkbox", "Sequence parallel", True)
    assert _stage_bars(at)["ZeRO-3", "activations"] == 32 * sbh / 2 * (34 + 80)
    assert any("**32 GPU(s)** = N × TP × PP = 8 × 2 × 2" in m.value for m in at.markdown)


def test_live_pp2_each_stage_is_sharded_by_zero_and_equals_its_formula_to_the_byte():
    at = _page()
    _set(at, "select_slider", "GPUs", 2)
    _set(at, "radio", "Precision", "fp32")
    _set(at, "radio", "Optimizer", "adam")
    _set(at, "radio", "Pipeline parallel", 2)
    assert any("runs live here on 4 rank(s) (N × TP × PP = 2 × 1 × 2)" in i.value for i in at.info)
    # theory above: Ψ/PP per GPU (218,496 / 2), then ZeRO-0 over N = 2: fp32 Adam, 16 bytes each
    bars = _stage_bars(at)
    assert (bars["ZeRO-0", "params"], bars["ZeRO-0", "optimizer"]) == (
        4 * TOY_PARAMS // 2, 8 * TOY_PARAMS // 2)
    at.button[0].click().run()
    _assert_clean(at)
    # rank 0 holds stage 0: the embeddings and blocks 0-1 (the head is on stage 1), even: no padding
    p = V * H + S * H + 2 * (12 * H * H + 13 * H)
    expected = {"ZeRO-0": (4 * p, 4 * p, 8 * p), "ZeRO-1": (4 * p, 4 * p, 8 * p // 2),
                "ZeRO-2": (4 * p, 4 * p // 2, 8 * p // 2), "ZeRO-3": (4 * p // 2, 4 * p // 2, 8 * p // 2)}
    live = _live(at)
    for stage, want in expected.items():
        for cat, b in zip(("params", "grads", "optimizer"), want):
            assert live[stage, cat, "measured"] == live[stage, cat, "predicted"] == b, (stage, cat)
    assert "equal to the byte" in at.success[0].value
    table = at.dataframe[0].value
    # every rank, stage 1 (the head, no embeddings) too, equals its own stage's formula
    assert list(table["every rank = its formula"]) == ["yes"] * 4


def test_layouts_that_cannot_run_live_on_a_toy_show_theory_and_why():
    at = _page()
    _set(at, "radio", "Pipeline parallel", 2)
    _set(at, "radio", "Tensor parallel", 2)
    assert not at.button  # nothing to press: the bars are theory
    assert [c["spec"]["title"]["text"] for c in _charts(at)] == ["Memory per GPU by ZeRO stage (theory)"]
    # N = 2 x TP = 2 x PP = 2 = 8 ranks: more than this machine runs live
    notes = [i.value for i in at.info if "N × TP × PP = 8" in i.value]
    assert len(notes) == 2  # in the model's box and under "Live"
    # Ψ/(TP·PP) per GPU, then ZeRO-0 over N = 2: fp32 Adam, 16 bytes each
    bars = _stage_bars(at)
    assert (bars["ZeRO-0", "params"], bars["ZeRO-0", "optimizer"]) == (
        4 * TOY_PARAMS // 4, 8 * TOY_PARAMS // 4)
    # with N = 1 the same TP x PP layout runs live: tensor parallel inside pipeline stages
    _set(at, "select_slider", "GPUs", 1)
    assert [b.label for b in at.button] == ["Run live"]
    _set(at, "select_slider", "GPUs", 2)
    # TP = 8 cannot split the toy's 4 heads: RunConfig's own message says so
    _set(at, "radio", "Pipeline parallel", 1)
    _set(at, "radio", "Tensor parallel", 8)
    assert not at.button
    assert any("--heads 4: tensor parallel splits the heads over --tp 8" in i.value for i in at.info)
    # N = 2 x TP = 4 = 8 ranks: more than this machine runs live
    _set(at, "radio", "Tensor parallel", 4)
    assert not at.button
    assert any("at most 4 ranks on this machine, and N × TP × PP = 8" in i.value for i in at.info)


def test_failed_live_run_shows_one_line_error(monkeypatch):
    from parallel_mini.runtime import launch

    def failing_run(cfg, average_fn=None):
        raise RankError(1, "Traceback (most recent call last):\n  File \"x.py\"\n"
                           "RuntimeError: out of memory on rank 1\n")

    monkeypatch.setattr(launch, "run", failing_run)
    at = _page()
    at.button[0].click().run()
    assert not at.exception
    (err,) = at.error
    assert err.value == "Rank 1 failed: RuntimeError: out of memory on rank 1"
    assert [c["spec"]["title"]["text"] for c in _charts(at)] == [
        "Memory per GPU by ZeRO stage (predicted)"]  # no measured chart


def test_disk_choice_moves_the_optimizer_to_a_disk_bar_at_every_stage():
    """Theory: with the optimizer on disk each stage's GPU bar loses its optimizer (ZeRO-3: its
    parameter slices too) and a disk bar holds 12 bytes per parameter the rank owns (fp32 master
    + two moments); the GPU total, and so the fit, counts the GPU's bytes only."""
    at = _page()  # (the page's default: the small toy on 2 GPUs, fp32 Adam)
    _set(at, "checkbox", "Optimizer states to disk", True)
    by = _stage_bars(at)
    p = TOY_PARAMS
    for k, stage in enumerate(STAGES):
        name = f"{stage} + disk"
        assert by[name, "disk"] == (12 * p if k == 0 else 12 * p // 2), name
        assert by.get((name, "optimizer"), 0) == 0
        assert by.get((name, "params"), 0) == (0 if k == 3 else 4 * p)  # fp32 weights
    # model states on the GPU: ZeRO-0 keeps 4P weights + 4P gradients, no optimizer
    from parallel_mini.course.viz.units import bytes_unit
    div, unit = bytes_unit(8 * p)
    assert _metric_of(at, 0).value == f"{8 * p / div:.3f} {unit}"
    # CPU offload and disk are one at a time: ticking the CPU box unticks and greys the disk box
    _set(at, "checkbox", "Offload", True)
    assert not _widget(at.checkbox, "Optimizer states to disk").value
    assert _widget(at.checkbox, "Optimizer states to disk").disabled


@pytest.mark.slow
def test_live_disk_runs_all_four_stages_equal_to_theory_to_the_byte():
    at = _page()
    _set(at, "select_slider", "GPUs", 2)
    _set(at, "checkbox", "Optimizer states to disk", True)
    at.button[0].click().run()
    _assert_clean(at)
    p, live = TOY_PARAMS, _live(at)
    for k, stage in enumerate(STAGES):
        name = f"{stage} + disk"
        want = 12 * p if k == 0 else 12 * p // 2
        assert live[name, "disk", "measured"] == live[name, "disk", "predicted"] == want
        assert live[name, "optimizer", "measured"] == 0
    assert "equal to the byte" in at.success[0].value
    assert _chart(at, "Bytes to and from disk")
