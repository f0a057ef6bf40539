"""The "Memory per GPU" page, driven headless with AppTest: the seed's ZeRO row for 7B on 8 GPUs,
the fits / does-not-fit verdict against the GPU's capacity, and a live toy run at all four ZeRO
stages whose measured model states equal the formula to the byte. Expected numbers are computed
here by hand (bytes per parameter x parameters / N), not read back from the library."""
from __future__ import annotations

import pytest
import streamlit as st

from parallel_mini.launch import RankError
from test_app import _app, _assert_clean, _chart, _charts, _rows_with, _widget

PAGE = "app_pages/memory.py"
STAGES = ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
# the default toy ("toy: 4 layers x d64", vocab 128, seq 32): v*h + s*h + L(12h^2 + 13h) + 2h + h*v
H, V, S, L = 64, 128, 32, 4
TOY_PARAMS = V * H + S * H + L * (12 * H * H + 13 * H) + 2 * H + H * V


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
    # the TP and PP degrees are there, disabled, with the reason
    tp_pp = [w for w in at.number_input if "parallel degree" in w.label]
    assert len(tp_pp) == 2 and all(w.disabled for w in tp_pp)
    assert any("arrives with tensor/pipeline parallel" in c.value for c in at.caption)


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


def test_live_toy_run_measures_model_states_equal_to_theory_at_every_stage():
    at = _page()
    _set(at, "select_slider", "GPUs", 2)
    _set(at, "radio", "Precision", "fp32")
    _set(at, "radio", "Optimizer", "adam")
    at.button[0].click().run()
    _assert_clean(at)

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
    assert list(table["every rank the same"]) == ["yes"] * 4
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


def test_failed_live_run_shows_one_line_error(monkeypatch):
    from parallel_mini import engine

    def failing_run(cfg, average_fn=None):
        raise RankError(1, "Traceback (most recent call last):\n  File \"x.py\"\n"
                           "RuntimeError: out of memory on rank 1\n")

    monkeypatch.setattr(engine, "run", failing_run)
    at = _page()
    at.button[0].click().run()
    assert not at.exception
    (err,) = at.error
    assert err.value == "Rank 1 failed: RuntimeError: out of memory on rank 1"
    assert [c["spec"]["title"]["text"] for c in _charts(at)] == [
        "Memory per GPU by ZeRO stage (predicted)"]  # no measured chart
