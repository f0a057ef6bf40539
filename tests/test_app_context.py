"""The "Long sequences" page (context parallel), driven headless with AppTest. Nothing runs before
"Run live"; bad settings show RunConfig's one-line error and start nothing. A live run (C = 4,
s = 32, 4 heads: ring, zigzag and Ulysses) puts on the page what the ranks did, checked here
against counts made by hand: which K/V block each rank holds at every ring step and whom it sends
it to, the bytes of every hop, the tiles each rank computed (contiguous r + 1 of C, zigzag 2C + 1 of
4C), the ring's and Ulysses' bytes per step, activations per layer (formula lines at once, the
measured points behind their own button: the ring's linear in s, none's not), and losses equal
to the single-process reference. The bar said "Step i of n" for each of the runs. The animation
plays in the browser (a timer in its spec, a "play" checkbox); switching the layout redraws
without a run; a changed knob marks the result stale."""
from __future__ import annotations

import pytest
import streamlit as st

from parallel_mini import theory
from test_app import (_app, _assert_clean, _chart, _charts, _rows_with, _widget, assert_steps,
                      record_steps)

PAGE = "app_pages/long_sequences.py"
BATCH, D, VOCAB = 4, 64, 128  # the page's toy


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _set(at, kind: str, label_start: str, value):
    _widget(getattr(at, kind), label_start).set_value(value)
    at.run()


def _titles(at) -> list[str]:
    """Each chart's title, whole (a title wider than its column is wrapped on the page: its whole
    text is kept in the spec's usermeta, viz.style.fit_width)."""
    return [c["spec"].get("usermeta", {}).get("title") or c["spec"]["title"]["text"]
            for c in _charts(at)]


def _block(c: int, s: int, a: int) -> int:
    """One K (or V) block [b, a, s/C, d] in fp32 bytes."""
    return BATCH * a * (s // c) * (D // a) * 4


def test_page_before_any_run_and_bad_settings():
    at = _app(PAGE)
    _assert_clean(at)
    assert at.title[0].value == "Long sequences"
    assert [b.label for b in at.button] == ["Run live"]
    assert any("Press **Run live**" in i.value for i in at.info)
    assert not at.get("vega_lite_chart")

    # s = 36 on 4 ranks: ring cuts 4 chunks (fine), zigzag 8 (refused), Ulysses 4 (fine)
    _set(at, "number_input", "Sequence length", 36)
    assert not at.exception
    (err,) = at.error
    assert err.value.startswith("zigzag (balanced ring): invalid settings: --seq 36")
    assert "choose a multiple of 8" in err.value and "\n" not in err.value.strip()
    assert at.button[0].disabled
    # 2 heads cannot be split over 4 ranks by Ulysses
    _set(at, "radio", "Attention heads", 2)
    assert len(at.error) == 2
    assert any(e.value.startswith("Ulysses (all-to-all): invalid settings: --heads 2")
               and "divisible by 4" in e.value for e in at.error)
    _set(at, "radio", "Context-parallel ranks", 2)  # C = 2: 36 = 9 x 4, 2 heads / 2: all fine
    _assert_clean(at)
    assert not at.button[0].disabled
    assert not at.get("vega_lite_chart")


def test_live_ring_zigzag_ulysses_on_four_ranks(monkeypatch):
    at = _app(PAGE)
    c, s, a = 4, 32, 4
    blk = _block(c, s, a)
    steps = record_steps(monkeypatch)
    at.button[0].click().run()
    _assert_clean(at)
    # Run live: the 3 runs with the reference, nothing else (the curve has its own button)
    assert_steps(at, steps, [f"{impl}: {c} ranks, s = {s}, and the single-process reference…"
                             for impl in ("ring (contiguous chunks)", "zigzag (balanced ring)",
                                          "Ulysses (all-to-all)")])
    assert [b.label for b in at.button] == ["Run live", "Measure the activation curve"]
    assert _titles(at)[0] == f"K/V blocks around the ring: ring on {c} ranks, s = {s} (live run)"

    # --- the animation: 2C frames, every hop as the ranks recorded it -------------------------
    anim = _chart(at, "K/V blocks around the ring: ring")
    (frame,) = [p for p in anim["spec"]["params"] if p["name"] == "frame"]
    assert frame["bind"]["input"] == "range" and frame["bind"]["max"] == 2 * c - 1
    assert frame["value"] == 0
    nodes = _rows_with(anim, "rank_label")
    assert len(nodes) == 2 * c * c
    for n in nodes:  # forward step t (frame t) and backward step t (frame C + t): r holds r - t
        t = n["frame"] % c
        assert n["block"] == f"block {(n['rank'] - t) % c}", n
    arrows = _rows_with(anim, "carries")
    assert len(arrows) == c * (c - 1) + c * c  # forward C-1 hops, backward C, every rank
    for m in arrows:
        fwd = m["frame"] < c
        t = m["frame"] % c
        assert m["dst"] == (m["src"] + 1) % c
        assert m["block"] == f"block {(m['src'] - t) % c}"
        # K, V forward (2 blocks); K, V, dK, dV backward (4); dK, dV home at the last hop (2)
        want = 2 * blk if fwd or t == c - 1 else 4 * blk
        assert m["payload_bytes"] == want and m["ms"] > 0, m
        assert m["carries"] == ("K/V" if fwd else "dK/dV" if t == c - 1 else "K/V+dK/dV")
    # per layer: 2(C-1) + 4(C-1) + 2 blocks leave every rank
    ring_bytes = (6 * (c - 1) + 2) * blk
    assert ring_bytes == 163_840
    assert _widget(at.metric, "Ring bytes each rank sends per step: counted").value == \
        f"{ring_bytes:,} B"
    assert _widget(at.metric, "Ring bytes per step: theory").value == f"{ring_bytes:,} B"
    written = _widget(at.metric, "Ring bytes rank 0 wrote to its sockets").value
    if written != "not measurable here":  # payloads plus gloo's framing of 2(C-1)+1 messages
        assert ring_bytes < int(written.split()[0].replace(",", "")) < ring_bytes + 7 * 1024
    assert 0 <= int(_widget(at.metric, "Forward hop time covered").value.rstrip("%")) <= 100

    # --- tile maps: contiguous r + 1 of C, zigzag 2C + 1 of 4C ---------------------------------
    tiles = _chart(at, "Causal attention tiles per rank")
    rows = _rows_with(tiles, "q_chunk")
    for layout, per, want in (("contiguous", c, [r + 1 for r in range(c)]),
                              ("zigzag", 4 * c, [2 * c + 1] * c)):
        mine = [t for t in rows if t["layout"] == layout]
        # each panel draws its rank's rows: count each (rank, q, k) once
        uniq = {(t["rank"], t["q_chunk"], t["k_chunk"]): t for t in mine}
        assert len(uniq) == per * c
        got = [sum(t["computed"] for (r, _, _), t in uniq.items() if r == k) for k in range(c)]
        assert got == want, (layout, got)
        # skipped exactly when every key lies after every query
        assert all(t["computed"] == (t["k_chunk"] <= t["q_chunk"]) for t in uniq.values())
    assert _widget(at.metric, "Tiles computed per rank: contiguous (ring), measured").value == \
        "1, 2, 3, 4"
    assert _widget(at.metric, "Tiles computed per rank: zigzag, measured").value == "9, 9, 9, 9"
    assert _widget(at.metric, "Tiles computed per rank: zigzag, formula").value == "9, 9, 9, 9"
    work = {(r["rank"], r["source"]): r["pairs"]
            for r in _rows_with(_chart(at, "Attention work per rank"), "pairs")}
    for k in range(c):
        for src in ("measured", "formula"):
            assert work[f"rank {k}", f"contiguous: {src}"] == (k + 1) * (s // c) ** 2
            assert work[f"rank {k}", f"zigzag: {src}"] == (2 * c + 1) * (s // (2 * c)) ** 2

    # --- the wire: the ring's 7 sends per rank beside Ulysses' 4 all-to-alls --------------------
    ring_tl = _chart(at, "ring (contiguous chunks): the cp messages")
    uly_tl = _chart(at, "Ulysses (all-to-all): the cp messages")
    ring_msgs = _rows_with(ring_tl, "what")
    uly_msgs = _rows_with(uly_tl, "what")
    assert len(ring_msgs) == c * (2 * (c - 1) + 1)
    assert len(uly_msgs) == c * 4
    assert {m["kind"] for m in uly_msgs} == {"a2a_qkv", "a2a_out", "a2a_dout", "a2a_dqkv"}
    # an all-to-all keeps 1/C of its payload: q, k, v are 3 blocks, the output 1
    assert {(m["kind"], m["wire_bytes_model"]) for m in uly_msgs} == {
        ("a2a_qkv", 3 * blk * (c - 1) // c), ("a2a_dqkv", 3 * blk * (c - 1) // c),
        ("a2a_out", blk * (c - 1) // c), ("a2a_dout", blk * (c - 1) // c)}
    bars = {(r["impl"], r["source"]): r["bytes"]
            for r in _rows_with(_chart(at, "Bytes each rank sends per step"), "source")}
    uly_bytes = 8 * blk * (c - 1) // c
    for impl, want in (("ring (contiguous chunks)", ring_bytes),
                       ("zigzag (balanced ring)", ring_bytes), ("Ulysses (all-to-all)", uly_bytes)):
        assert bars[impl, "counted"] == bars[impl, "theory"] == want, impl
        if (impl, "measured (written to sockets)") in bars:  # not on NCCL or off Linux
            messages = 4 if impl.startswith("Ulysses") else 2 * (c - 1) + 1
            assert want < bars[impl, "measured (written to sockets)"] < want + messages * 1024
            assert any("gloo's framing" in cap.value for cap in at.caption)
    for impl in ("ring", "zigzag", "ulysses"):
        assert _widget(at.metric, f"Ranks whose counted bytes = formula: {impl}").value == \
            "4 of 4"

    # --- activations per layer vs s: the formula's lines, then measured points on them ---------
    curve = _chart(at, "Activation bytes per layer per rank vs sequence length")
    assert {p["source"] for p in _rows_with(curve, "source")} == {"theory (formula)"}
    assert not [m for m in at.metric if m.label.endswith(f"s = {s}: measured")]
    steps.clear()
    _widget(at.button, "Measure the activation curve").click().run()
    _assert_clean(at)
    # 3 series x 3 lengths x 1 and 2 layers
    assert_steps(at, steps, [f"activations: {name}, s = {q}, {layers} layer(s)…"
                             for name in ("no context parallel (C = 1)", f"ring / zigzag, C = {c}",
                                          f"Ulysses, C = {c}") for q in (s, 2 * s, 4 * s)
                             for layers in (1, 2)])
    curve = _chart(at, "Activation bytes per layer per rank vs sequence length")
    points = {(p["series"], p["seq"]): p["bytes"] for p in _rows_with(curve, "source")
              if p["source"] == "measured (live run)"}
    series = {"no context parallel (C = 1)": (1, "ring"), "ring / zigzag, C = 4": (c, "ring"),
              "Ulysses, C = 4": (c, "ulysses")}
    assert set(points) == {(name, q) for name in series for q in (32, 64, 128)}
    for (name, q), got in points.items():
        cp, impl = series[name]
        assert got == theory.gpt_activation_bytes_per_layer(q, BATCH, D, a, "none", 4, cp=cp,
                                                             cp_impl=impl), (name, q)
    ring = "ring / zigzag, C = 4"
    # the ring keeps no [s, s] scores: twice the tokens, exactly twice the bytes
    assert points[ring, 64] == 2 * points[ring, 32] and points[ring, 128] == 2 * points[ring, 64]
    none = "no context parallel (C = 1)"
    assert points[none, 128] - points[none, 64] > 2 * (points[none, 64] - points[none, 32])
    lines = [p for p in _rows_with(curve, "source") if p["source"] == "theory (formula)"]
    assert {p["seq"] for p in lines} == set(range(2 * c, 129, 2 * c))
    for name in series:
        assert _widget(at.metric, f"{name}, s = {s}: measured").delta == "equal to the formula"

    for impl in ("ring", "zigzag", "ulysses"):
        assert float(_widget(at.metric, f"max |run − reference| (losses, final params): {impl}")
                     .value) <= 1e-5

    # --- the zigzag layout in the animation: redrawn from the same runs -------------------------
    _set(at, "radio", "Layout in the animation", "zigzag")
    _assert_clean(at)
    zig = _chart(at, "K/V blocks around the ring: zigzag")
    nodes = [n for n in _rows_with(zig, "rank_label") if n["frame"] < c]
    # forward: every rank computes 2 of the 4 tiles of a block it does not own, 3 with its own
    for n in nodes:
        own = n["block"] == f"block {n['rank']}"
        assert n["rank_label"].endswith("3 tiles, 1 skipped" if own else "2 tiles, 2 skipped"), n

    # --- it plays in the browser: Vega's timer advances the frame slider (viz.animate) ---------
    params = {p["name"]: p for p in _chart(at, "K/V blocks around the ring: zigzag")["spec"]["params"]}
    assert params["play"]["value"] is True and params["frame"]["value"] == 0
    assert params["tick"]["on"][0]["events"]["type"] == "timer"
    assert params["frame"]["on"][0]["update"].endswith(f"(frame + 1) % {2 * c} : frame")
    assert not [b for b in at.button if "Play" in b.label]  # no server round-trip per frame

    # a knob that changes the runs starts nothing: the page says the result is stale
    _set(at, "radio", "Context-parallel ranks", 2)
    _assert_clean(at)
    assert any("settings changed" in w.value for w in at.warning)
    assert _chart(at, "K/V blocks around the ring: zigzag on 4 ranks")  # the last run, as shown


def test_live_two_ranks_two_heads_longer_sequence():
    """C = 2, s = 64, 2 heads: the same formulas with other numbers (zigzag: 5 of 8 tiles)."""
    at = _app(PAGE)
    c, s, a = 2, 64, 2
    _set(at, "radio", "Context-parallel ranks", c)
    _set(at, "number_input", "Sequence length", s)
    _set(at, "radio", "Attention heads", a)
    at.button[0].click().run()
    _assert_clean(at)
    blk = _block(c, s, a)
    assert _widget(at.metric, "Ring bytes each rank sends per step: counted").value == \
        f"{(6 * (c - 1) + 2) * blk:,} B"
    assert _widget(at.metric, "Tiles computed per rank: contiguous (ring), measured").value == "1, 2"
    assert _widget(at.metric, "Tiles computed per rank: zigzag, measured").value == "5, 5"
    bars = {(r["impl"], r["source"]): r["bytes"]
            for r in _rows_with(_chart(at, "Bytes each rank sends per step"), "source")}
    assert bars["Ulysses (all-to-all)", "counted"] == 8 * blk * (c - 1) // c
    anim = _chart(at, "K/V blocks around the ring: ring on 2 ranks")
    assert len(_rows_with(anim, "carries")) == c * (c - 1) + c * c
    _widget(at.button, "Measure the activation curve").click().run()
    _assert_clean(at)
    points = {(p["series"], p["seq"]) for p in _rows_with(
        _chart(at, "Activation bytes per layer"), "source") if p["source"] == "measured (live run)"}
    assert {q for _, q in points} == {64, 128, 256}
    for impl in ("ring", "zigzag", "ulysses"):
        assert float(_widget(at.metric, f"max |run − reference| (losses, final params): {impl}")
                     .value) <= 1e-5
