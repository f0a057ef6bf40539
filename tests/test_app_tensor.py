"""The "Tensor parallel" page, driven headless with AppTest: a live tp run equals the single-process
reference, its tp traffic equals the formula (computed here by hand: (4L+2) all-reduces of b*s*h
fp32 activations, 3 of b*s for the cross-entropy, SP's gradient all-reduce), SP moves the same
activation bytes with fewer activations kept, and the weight-shard heatmaps hold each rank's real
slice (fc rows 4h/t, proj columns 4h/t)."""
from __future__ import annotations

import pytest
import streamlit as st

from parallel_mini.runtime.launch import RankError
from test_app import (_app, _assert_clean, _chart, _charts, _rows_with, _widget, assert_steps,
                      record_steps)

PAGE = "app_pages/tensor.py"
# the default toy ("4 layers × d64 × 4 heads", vocab 128), micro-batch 4 x 32 tokens, fp32
H, A, S, B, L, V = 64, 4, 32, 4, 4, 128


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _all_reduce(nbytes: float, t: int) -> float:
    return 2 * (t - 1) / t * nbytes


def tp_bytes_by_hand(t: int, sp: bool, b: int = B, s: int = S, h: int = H,
                     layers: int = L) -> float:
    """Per step, one rank: g after each row-parallel layer and the embedding (2L + 1), f before each
    column-parallel layer and the head (2L + 1), 3 cross-entropy all-reduces of b*s fp32 numbers;
    SP: the same activation bytes as all-gathers + reduce-scatters, plus one all-reduce of the
    gradients used on sequence shards (positions s*h, 2 LayerNorms + 2 biases per block: 6h,
    ln_f 2h)."""
    total = (4 * layers + 2) * _all_reduce(4 * b * s * h, t) + 3 * _all_reduce(4 * b * s, t)
    if sp:
        total += _all_reduce(4 * (s * h + 6 * h * layers + 2 * h), t)
    return total


def ours_per_layer_by_hand(t: int, sp: bool, b: int = B, s: int = S, h: int = H, a: int = A) -> int:
    """Our block, fp32, no checkpointing: LayerNorm inputs 2sbh/q, QKV and fc inputs 2sbh (whole on
    every rank), QKV/attention/fc/GELU outputs 12sbh/t, LayerNorm stats 4sb/q, softmax a*s*s*b/t,
    plus the s x s boolean mask (q = t with SP, else 1)."""
    q = t if sp else 1
    sbh = s * b * h
    kept = 2 * sbh // q + 2 * sbh + 12 * sbh // t + 4 * s * b // q + a * s * s * b // t
    return 4 * kept + s * s


def _set(at, kind: str, label_start: str, value):
    _widget(getattr(at, kind), label_start).set_value(value)
    at.run()
    _assert_clean(at)


def _count(at, label_start: str) -> float:
    return float(_widget(at.metric, label_start).value.split()[0].replace(",", ""))


def _comm_rows(at) -> list[dict]:
    return _rows_with(_chart(at, "Tensor-parallel bytes per step"), "kind")


def _shard_cells(at) -> list[dict]:
    return _rows_with(_chart(at, "MLP weight shards"), "panel")


def _check_shards(at, t: int, h: int = H):
    cells = _shard_cells(at)
    for matrix in ("fc", "proj"):
        mine = [c for c in cells if c["matrix"] == matrix]
        assert {c["rank"] for c in mine} == set(range(t))
        for r in range(t):
            rc = [c for c in mine if c["rank"] == r]
            lo, hi = r * 4 * h // t, (r + 1) * 4 * h // t
            rows = (min(c["row0"] for c in rc), max(c["row1"] for c in rc))
            cols = (min(c["col0"] for c in rc), max(c["col1"] for c in rc))
            if matrix == "fc":  # column-parallel: rows r*4h/t .. (r+1)*4h/t of [4h, h]
                assert {(c["shard_rows"], c["shard_cols"]) for c in rc} == {(4 * h // t, h)}
                assert rows == (lo, hi) and cols == (0, h)
            else:  # row-parallel: columns r*4h/t .. (r+1)*4h/t of [h, 4h]
                assert {(c["shard_rows"], c["shard_cols"]) for c in rc} == {(h, 4 * h // t)}
                assert rows == (0, h) and cols == (lo, hi)
            # the patches tile the shard exactly once
            area = sum((c["row1"] - c["row0"]) * (c["col1"] - c["col0"]) for c in rc)
            assert area == 4 * h * h // t
    table = at.dataframe[0].value
    assert list(table["rank"]) == list(range(t))
    assert list(table["fc.weight shard"]) == [
        f"[{4 * h // t}, {h}] = rows {r * 4 * h // t}:{(r + 1) * 4 * h // t}" for r in range(t)]
    assert (table["max |Y_r − Y[:, slice]|"] == 0).all()
    assert (table["max |Σ_r Y_r B_r − Z|"] <= 1e-5).all()
    if t > 1:  # one rank's partial product alone is not the output: the all-reduce is needed
        assert (table["max |Y_r B_r − Z|"] > 1e-3).all()
    assert any("max |concat − W| = 0" in s.value for s in at.success)


def test_tensor_page_renders_with_the_at_scale_theory_only():
    at = _app(PAGE)
    _assert_clean(at)
    assert at.title[0].value == "Tensor parallel"
    assert [b.label for b in at.button] == ["Run live"]
    assert any("Press **Run live**" in i.value for i in at.info)
    # before any run: the theory-only chart alone, 70B on tp = 8 by default
    (chart,) = _charts(at)
    assert chart["spec"]["title"]["text"].startswith("70B, tp = 8")
    # by hand: 80 layers x 4 + 2 all-reduces of 4096 x 8192 bf16 activations, 7/4 of each on the
    # wire, and 3 cross-entropy all-reduces of 4096 fp32 numbers
    nbytes = (4 * 80 + 2) * 7 / 4 * (4096 * 8192 * 2) + 3 * 7 / 4 * (4096 * 4)
    assert f"{nbytes / 1e9:.4g} GB" in (chart["spec"].get("usermeta", {}).get("title")
                                        or chart["spec"]["title"]["text"])
    bars = {r["link"].rsplit(" (", 1)[0]: r["seconds"] for r in _rows_with(chart, "link")}
    assert bars["NVLink 4 (H100)"] == pytest.approx(nbytes / 450e9)
    assert bars["InfiniBand NDR"] == pytest.approx(nbytes / 50e9)
    assert bars["InfiniBand NDR"] > 6 * 70e9 * 4096 / 8 / 989e12 > bars["NVLink 4 (H100)"]


def test_live_tp2_equals_reference_and_theory_and_sp_moves_the_same_bytes(monkeypatch):
    at = _app(PAGE)
    _set(at, "radio", "Tensor-parallel degree", 2)
    steps = record_steps(monkeypatch)
    at.button[0].click().run()
    _assert_clean(at)
    assert_steps(at, steps, [f"SP {sp}, {layers} layers: training on 2 rank(s)…"
                             for sp in ("off", "on") for layers in (L, L + 1)]
                 + ["reading every rank's weight shards…"])

    assert float(_widget(at.metric, "max |run − reference|").value) <= 1e-5
    expected = tp_bytes_by_hand(2, sp=False)
    assert expected == 591_360
    assert _count(at, "TP bytes per step, rank 0: counted (ring model of the ops run)") == expected
    assert _count(at, "TP bytes per step: theory") == expected
    written = _widget(at.metric, "TP bytes per step, rank 0: measured (written to sockets)").value
    if written != "not measurable here":  # SP off, t = 2: all-reduces, the ring's bytes + headers
        assert expected < int(written.split()[0].replace(",", "")) < 1.1 * expected
    assert _widget(at.metric, "Ranks sending exactly that").value == "2 of 2"

    rows = _comm_rows(at)
    by = {(r["run"], r["layer"], r["op"]): r for r in rows}
    assert set(by) == {("SP off", "g", "all_reduce"), ("SP off", "f", "all_reduce"),
                       ("SP off", "ce", "all_reduce"), ("SP on", "sp", "all_gather"),
                       ("SP on", "sp", "reduce_scatter"), ("SP on", "ce", "all_reduce"),
                       ("SP on", "sp-grads", "all_reduce")}
    assert by["SP off", "g", "all_reduce"]["calls"] == 2 * L + 1
    assert by["SP off", "f", "all_reduce"]["calls"] == 2 * L + 1
    act_off = by["SP off", "g", "all_reduce"]["bytes"] + by["SP off", "f", "all_reduce"]["bytes"]
    act_on = by["SP on", "sp", "all_gather"]["bytes"] + by["SP on", "sp", "reduce_scatter"]["bytes"]
    assert act_off == act_on == (4 * L + 2) * 4 * B * S * H  # t = 2: 2(t-1)/t = 1
    sp_grads = by["SP on", "sp-grads", "all_reduce"]["bytes"]
    assert sp_grads == 4 * (S * H + 6 * H * L + 2 * H)
    total = {run: sum(r["bytes"] for r in rows if r["run"] == run) for run in ("SP off", "SP on")}
    assert total["SP on"] == total["SP off"] + sp_grads == tp_bytes_by_hand(2, sp=True)
    ticks = {r["run"]: r["bytes"] for r in _rows_with(_chart(at, "Tensor-parallel bytes"), "run")
             if "kind" not in r and "label" in r and str(r["label"]).startswith("theory")}
    assert ticks == {"SP off": tp_bytes_by_hand(2, False), "SP on": tp_bytes_by_hand(2, True)}

    acts = {(r["setting"], r["source"]): r["bytes"]
            for r in _rows_with(_chart(at, "Activation bytes per layer"), "setting")}
    for label, sp in (("SP off", False), ("SP on", True)):
        assert acts[label, "measured"] == ours_per_layer_by_hand(2, sp)
        assert acts[label, "ours (exact)"] == ours_per_layer_by_hand(2, sp)
    assert acts["SP on", "measured"] < acts["SP off", "measured"]
    assert acts["SP off", "measured"] < acts["tp = 1 (theory)", "ours (exact)"]
    assert acts["tp = 1 (theory)", "ours (exact)"] == ours_per_layer_by_hand(1, False)
    # Korthikanti, tp = 2: sbh(10 + 24/t + 5as/(ht)); with SP: sbh/t (34 + 5as/h)
    sbh = S * B * H
    assert acts["SP off", "Korthikanti et al."] == sbh * (10 + 12 + 5 * A * S / (2 * H))
    assert acts["SP on", "Korthikanti et al."] == sbh / 2 * (34 + 5 * A * S / H)
    peak_off = _widget(at.metric, "Activation peak per rank, whole model: SP off").value
    peak_on = _widget(at.metric, "Activation peak per rank, whole model: SP on")
    assert float(peak_on.value.split()[0]) < float(peak_off.split()[0])
    assert peak_on.proto.delta.startswith("-")
    assert _widget(at.metric, "Measured per layer = ours").value == "yes, to the byte"

    _check_shards(at, 2)
    links = {r["link"].rsplit(" (", 1)[0]: r["seconds"]
             for r in _rows_with(_chart(at, "TP traffic of one step"), "link")}
    assert links["NVLink 4 (H100)"] == pytest.approx(expected / 450e9)
    assert links["Ethernet 100G"] == pytest.approx(expected / 12.5e9)

    # SP on: both runs exist, so ticking it switches the numbers without a new run
    _widget(at.checkbox, "Sequence parallel").check().run()
    _assert_clean(at)
    assert not at.warning
    assert _count(at, "TP bytes per step, rank 0: counted (ring model of the ops run)") == tp_bytes_by_hand(2, sp=True)
    assert _count(at, "TP bytes per step: theory") == tp_bytes_by_hand(2, sp=True)
    # a knob that changes the runs starts nothing: the page says the result is stale
    _set(at, "select_slider", "Sequence length (tokens)", 64)
    assert any("settings changed" in w.value for w in at.warning)
    assert _chart(at, "MLP weight shards")


def test_live_tp4_with_sp_shards_and_bytes():
    at = _app(PAGE)
    _set(at, "radio", "Tensor-parallel degree", 4)
    assert _widget(at.radio, "Data-parallel replicas").disabled  # 4 x 2 ranks would be too many
    _widget(at.checkbox, "Sequence parallel").check().run()
    at.button[0].click().run()
    _assert_clean(at)
    assert float(_widget(at.metric, "max |run − reference|").value) <= 1e-5
    expected = tp_bytes_by_hand(4, sp=True)
    assert _count(at, "TP bytes per step, rank 0: counted (ring model of the ops run)") == expected
    assert _count(at, "TP bytes per step: theory") == expected
    assert _widget(at.metric, "Ranks sending exactly that").value == "4 of 4"
    acts = {(r["setting"], r["source"]): r["bytes"]
            for r in _rows_with(_chart(at, "Activation bytes per layer"), "setting")}
    assert acts["SP on", "measured"] == ours_per_layer_by_hand(4, True)
    assert acts["SP off", "measured"] == ours_per_layer_by_hand(4, False)
    _check_shards(at, 4)
    # another block: the same layout, other values
    before = [c["value"] for c in _shard_cells(at)]
    _set(at, "selectbox", "Block shown", 2)
    assert "block 2" in _chart(at, "MLP weight shards")["spec"]["title"]["text"]
    _check_shards(at, 4)
    assert [c["value"] for c in _shard_cells(at)] != before


def test_live_tp2_dp2_adds_data_parallel_over_the_shards():
    at = _app(PAGE)
    _set(at, "radio", "Tensor-parallel degree", 2)
    _set(at, "radio", "Data-parallel replicas", 2)
    _set(at, "select_slider", "Micro-batch", 2)
    at.button[0].click().run()
    _assert_clean(at)
    assert float(_widget(at.metric, "max |run − reference|").value) <= 1e-5
    assert _count(at, "TP bytes per step, rank 0: counted (ring model of the ops run)") == tp_bytes_by_hand(2, False, b=2)
    assert _widget(at.metric, "Ranks sending exactly that").value == "4 of 4"
    # each rank's gradients: its tp slices (v*h/2 tokens, s*h positions, per block
    # (12h^2 + 7h)/2 + 6h, 2h final LayerNorm, h*v/2 head), all-reduced over dp = 2: 4 bytes each
    local = V * H // 2 + S * H + L * ((12 * H * H + 7 * H) // 2 + 6 * H) + 2 * H + H * V // 2
    (cap,) = [c.value for c in at.caption if "Data parallel over the tp shards" in c.value]
    assert f"{local:,} gradient elements" in cap
    assert f"{4 * local:,} B per step counted from the all-reduces it ran (ring model), theory {4 * local:,} B" in cap


def test_failed_live_run_shows_one_line_error(monkeypatch):
    from parallel_mini.runtime import launch

    def failing_run(cfg, average_fn=None):
        raise RankError(1, "Traceback (most recent call last):\n  File \"x.py\"\n"
                           "RuntimeError: gloo timed out on rank 1\n")

    monkeypatch.setattr(launch, "run", failing_run)
    at = _app(PAGE)
    at.button[0].click().run()
    assert not at.exception
    (err,) = at.error
    assert err.value == "Rank 1 failed: RuntimeError: gloo timed out on rank 1"
    assert [c["spec"]["title"]["text"].split(",")[0] for c in _charts(at)] == ["70B"]
