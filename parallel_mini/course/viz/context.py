"""Context parallel (lesson 06, the Long sequences page): every chart drawn from a live run's
report (`launch.run(RunConfig(cp=C, cp_impl=...))`, a RunReport or its `to_dict()`), the formula
that predicts it beside it.

    ring_kv_animation(report, frame=0)     K/V blocks going round the ring, one frame per ring step
                                           (forward, then backward with dK, dV), from the sends the
                                           ranks recorded; a "frame" slider moves through them
    tile_map(report) / tile_maps(reports)  per rank, which (query chunk, key chunk) tiles it computed
                                           and at which ring step, fully masked tiles as skipped;
                                           tile_maps puts layouts (contiguous, zigzag) one above the
                                           other, rank under rank
    cp_work_bars(reports)                  attention scores each rank computed (query x key token
                                           pairs): measured from the tile map vs the formula
    cp_comm_timeline(report)               the cp group's messages on a time axis, one lane per
                                           rank: the ring's sends or Ulysses' all-to-alls
    cp_bytes_chart(rows)                   bytes each rank sends per step per implementation:
                                           written to sockets (measured), counted from the
                                           records, and theory.cp_wire_bytes_per_step
    cp_activation_curve(points, theory)    activation bytes per layer per rank vs sequence length:
                                           the formulas as lines, live runs as points

Data helpers: cp_ranks(report), ring_kv_frames(report), tile_map_frame(report),
cp_comm_frame(report), cp_sent_bytes(report), tiles_theory(layout, c, rank).
"""
from __future__ import annotations

import math
from typing import Callable

import altair as alt
import pandas as pd

from .units import PAD, bytes_unit

BLOCK_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6",
                "#9d755d"]  # K/V block of rank b (its owner), the same in every chart
SKIPPED_COLOR = "#d9d9d9"
CP_COMM_KINDS = {  # kind -> legend label, in drawing order
    "kv": "ring send: K, V (forward)",
    "kv+dkv": "ring send: K, V + dK, dV so far (backward)",
    "dkv": "ring send: dK, dV home (backward, last hop)",
    "a2a_qkv": "all-to-all: q, k, v, sequence → head shards (forward)",
    "a2a_out": "all-to-all: output, head → sequence shards (forward)",
    "a2a_dout": "all-to-all: d output, sequence → head shards (backward)",
    "a2a_dqkv": "all-to-all: dq, dk, dv, head → sequence shards (backward)",
}
CP_COMM_COLORS = ["#4c78a8", "#f58518", "#e45756", "#54a24b", "#9ecae9", "#b279a2", "#ffbf79"]


# ---------------------------------------------------------------------------------------------
# reading the report
# ---------------------------------------------------------------------------------------------
def _block_colors(c: int) -> list[str]:
    return [BLOCK_COLORS[b % len(BLOCK_COLORS)] for b in range(c)]


def _as_dict(report) -> dict:
    return report.to_dict() if hasattr(report, "to_dict") else report


def cp_ranks(report) -> list[dict]:
    """The ranks of the first context-parallel group (every other mesh coordinate 0), in cp order."""
    rep = _as_dict(report)
    ranks = [r for r in rep["ranks"] if all(v == 0 for k, v in r["coords"].items() if k != "cp")]
    return sorted(ranks, key=lambda r: r["coords"].get("cp", 0))


def _cp_records(rank: dict, step: int | None = None) -> list[dict]:
    """This rank's ring sends and Ulysses all-to-alls (training steps only), in start order."""
    recs = [c for c in rank["comm"] if c.get("layer") in ("ring", "ulysses")
            and c["op"] in ("send", "all_to_all") and c.get("step", -1) >= 0]
    if step is not None:
        recs = [c for c in recs if c["step"] == step]
    return sorted(recs, key=lambda c: c["start"])


def _last_step(report) -> int:
    steps = [c["step"] for r in cp_ranks(report) for c in _cp_records(r)]
    return max(steps, default=0)


def _impl(report) -> str:
    return _as_dict(report)["config"]["cp_impl"]


def _layout(report) -> str:
    return "zigzag" if _impl(report) == "zigzag" else "contiguous"


def cp_sent_bytes(report, kind: str = "model") -> list[float | None]:
    """Per cp rank, the bytes it sent per training step for attention (ring sends or Ulysses
    all-to-alls; the gradient all-reduce excluded), mean over the steps. kind "model": counted from
    its records (`wire_bytes_model`: a send's payload, an all-to-all's (C-1)/C of it); "measured":
    what its process wrote to its sockets during them (`wire_bytes_measured`: that plus gloo's
    framing of each message), None for a rank where it could not be read (NCCL, not Linux)."""
    key = {"model": "wire_bytes_model", "measured": "wire_bytes_measured"}[kind]
    out: list[float | None] = []
    for r in cp_ranks(report):
        recs = _cp_records(r)
        steps = {c["step"] for c in recs} or {0}
        values = [c.get(key) for c in recs]
        out.append(None if None in values else sum(values) / len(steps))
    return out


def tiles_theory(layout: str, c: int, rank: int) -> tuple[int, int]:
    """(tiles computed, tiles in the map) of rank `rank` under a causal mask, by the formula:
    contiguous: r + 1 of C (rank C-1 sees everything, rank 0 its own chunk only); zigzag (chunks r
    and 2C-1-r): 2C + 1 of 4C on every rank."""
    return (2 * c + 1, 4 * c) if layout == "zigzag" else (rank + 1, c)


# ---------------------------------------------------------------------------------------------
# the ring, animated
# ---------------------------------------------------------------------------------------------
def ring_kv_frames(report) -> list[dict]:
    """The ring's frames as the run recorded them, for one layer: frames 0..C-1 the forward's ring
    steps, C..2C-1 the backward's. Each: {frame, phase, ring_step, holds {cp rank: K/V block},
    tiles {cp rank: (computed, skipped)} (forward), messages [{src, dst, block, carries,
    payload_bytes, wire_bytes_model, ms}]}. The forward is the first layer's (its first C-1 "kv"
    sends), the backward the first one run (the last layer's: C-1 "kv+dkv" sends and one "dkv")."""
    rep = _as_dict(report)
    if _impl(rep) == "ulysses":
        raise ValueError("ring_kv_frames: a Ulysses run has no ring (use cp_comm_timeline)")
    ranks = cp_ranks(rep)
    c = len(ranks)
    step = _last_step(rep)
    fwd, bwd, tiles = {}, {}, {}
    for r in ranks:
        k = r["coords"]["cp"]
        sends = [x for x in _cp_records(r, step) if x["op"] == "send"]
        fwd[k] = [x for x in sends if x["carries"] == "kv"][:c - 1]
        bwd[k] = [x for x in sends if x["carries"] in ("kv+dkv", "dkv")][:c]
        tiles[k] = r.get("context", {}).get("tiles", [])

    def msg(k, x):
        return {"src": k, "dst": x["peer"], "block": x["block"], "carries": x["carries"],
                "payload_bytes": x["payload_bytes"], "wire_bytes_model": x["wire_bytes_model"],
                "ms": 1e3 * (x["end"] - x["start"])}

    frames = []
    for t in range(c):
        holds, counts = {}, {}
        for k in fwd:
            mine = [x for x in tiles[k] if x["ring_step"] == t]
            holds[k] = mine[0]["from"] if mine else (k - t) % c
            counts[k] = (sum(x["computed"] for x in mine), sum(not x["computed"] for x in mine))
        frames.append({"frame": t, "phase": "forward", "ring_step": t, "holds": holds,
                       "tiles": counts,
                       "messages": [msg(k, fwd[k][t]) for k in fwd if t < len(fwd[k])]})
    for t in range(c):
        holds = {k: bwd[k][t]["block"] if t < len(bwd[k]) else (k - t) % c for k in bwd}
        frames.append({"frame": c + t, "phase": "backward", "ring_step": t, "holds": holds,
                       "tiles": {}, "messages": [msg(k, bwd[k][t]) for k in bwd if t < len(bwd[k])]})
    return frames


def _fmt_b(b: float) -> str:
    div, unit = bytes_unit(b)
    return f"{b / div:.3g} {unit}" if div > 1 else f"{b:,.0f} B"


_CARRIES = {"kv": "K/V", "kv+dkv": "K/V+dK/dV", "dkv": "dK/dV"}


def _frame_caption(fr: dict, c: int) -> str:
    t = fr["ring_step"]
    if fr["phase"] == "forward":
        head = (f"frame {fr['frame']} of {2 * c - 1} · forward, ring step {t}: each rank computes "
                f"its queries against the K/V block it holds"
                + (", while sending that block on" if t < c - 1 else " (the last block: no send)"))
    else:
        head = (f"frame {fr['frame']} of {2 * c - 1} · backward, ring step {t}: "
                + ("each block travels with its dK, dV so far" if t < c - 1
                   else "the last hop takes dK, dV home to the block's owner"))
    lines = [head]
    for m in sorted(fr["messages"], key=lambda m: m["src"]):
        lines.append(f"rank {m['src']} → rank {m['dst']}: {_CARRIES[m['carries']]} of block "
                     f"{m['block']}, {m['payload_bytes']:,} B payload, {m['ms']:.2f} ms measured")
    return "\n".join(lines)


def _ring_xy(k: int, c: int, radius: float = 1.0) -> tuple[float, float]:
    a = math.pi / 2 - 2 * math.pi * k / c  # rank 0 on top, clockwise
    return radius * math.cos(a), radius * math.sin(a)


def ring_kv_animation(report, frame: int = 0, size: int = 380) -> alt.LayerChart:
    """K/V blocks going round the cp ring, from a ring or zigzag run's recorded sends.

    Ranks sit on a circle (rank 0 on top, the ring clockwise); each rank's disc has the colour of
    the K/V block it holds in that frame (block b = rank b's keys and values, the same colour in
    every chart of this module) and says how many tiles it computed with it (forward). Arrows: the
    sends of the frame's ring step as recorded (what, payload bytes, measured time), the block in
    flight drawn on the arrow. Below: every message of the frame. A "frame" slider (initial value
    `frame`) moves through the 2C frames in the browser: 0..C-1 forward, C..2C-1 backward."""
    rep = _as_dict(report)
    frames = ring_kv_frames(rep)
    c = len(frames) // 2
    nodes, arrows = [], []
    for fr in frames:
        for k, b in fr["holds"].items():
            x, y = _ring_xy(k, c)
            if abs(x) > 0.5:  # beside the disc, on the outside
                lx, ly, align = x + math.copysign(0.33, x), y, "left" if x > 0 else "right"
            else:  # above or below it
                lx, ly, align = x, y + math.copysign(0.45, y), "center"
            done = fr["tiles"].get(k)
            nodes.append({"frame": fr["frame"], "rank": k, "x": x, "y": y, "lx": lx, "ly": ly,
                          "align": align,
                          "block": f"block {b}", "label": f"K/V {b}",
                          "rank_label": f"rank {k}" + (f"\n{done[0]} tiles, {done[1]} skipped"
                                                       if done else ""),
                          "phase": fr["phase"], "ring_step": fr["ring_step"]})
        for m in fr["messages"]:
            (x0, y0), (x1, y1) = _ring_xy(m["src"], c), _ring_xy(m["dst"], c)
            dx, dy = x1 - x0, y1 - y0
            n = math.hypot(dx, dy) or 1.0
            ux, uy = dx / n, dy / n
            px, py = uy, -ux  # to the right of the direction of travel
            off, trim = 0.07, min(0.27, 0.3 * n)
            side = 1 if c == 2 else -1  # labels outside the ring (both sides of the line for C = 2)
            ax0, ay0 = x0 + ux * trim + px * off, y0 + uy * trim + py * off
            ax1, ay1 = x1 - ux * trim + px * off, y1 - uy * trim + py * off
            mx, my = (ax0 + ax1) / 2, (ay0 + ay1) / 2
            arrows.append({
                "frame": fr["frame"], "src": m["src"], "dst": m["dst"], "x": ax0, "y": ay0,
                "x2": ax1, "y2": ay1, "mx": mx, "my": my,
                "tx": mx + side * px * 0.42, "ty": my + side * py * 0.42,
                "angle": math.degrees(math.atan2(ux, uy)), "block": f"block {m['block']}",
                "carries": _CARRIES[m["carries"]], "payload_bytes": m["payload_bytes"],
                "ms": m["ms"],
                "label": f"{_CARRIES[m['carries']]} {m['block']}\n{_fmt_b(m['payload_bytes'])}, "
                         f"{m['ms']:.2f} ms"})
    nodes, arrows = pd.DataFrame(nodes), pd.DataFrame(arrows, columns=[
        "frame", "src", "dst", "x", "y", "x2", "y2", "mx", "my", "tx", "ty", "angle", "block",
        "carries", "payload_bytes", "ms", "label"])
    captions = pd.DataFrame({"frame": [f["frame"] for f in frames],
                             "caption": [_frame_caption(f, c) for f in frames]})

    param = alt.param(name="frame", value=frame,
                      bind=alt.binding_range(min=0, max=2 * c - 1, step=1, name="frame "))
    now = alt.datum.frame == param
    lim, xlim = 1.85, 2.45  # room for the rank labels beside the discs
    x = alt.X("x:Q", scale=alt.Scale(domain=[-xlim, xlim]), axis=None)
    y = alt.Y("y:Q", scale=alt.Scale(domain=[-lim, lim]), axis=None)
    blocks = [f"block {b}" for b in range(c)]
    color = alt.Color("block:N", title="K/V block of rank", sort=blocks, scale=alt.Scale(
        domain=blocks, range=_block_colors(c)),
        legend=alt.Legend(orient="right", symbolType="circle", symbolStrokeWidth=0,
                          labelExpr="replace(datum.label, 'block ', '')"))
    ring = alt.Chart(pd.DataFrame({"t": range(121)})).transform_calculate(
        x="cos(2 * PI * datum.t / 120)", y="sin(2 * PI * datum.t / 120)",
    ).mark_line(color="#e0e0e0", strokeWidth=1).encode(x=x, y=y, order="t:Q")
    tip = [alt.Tooltip("rank:O"), alt.Tooltip("phase:N"), alt.Tooltip("ring_step:O"),
           alt.Tooltip("label:N", title="holds")]
    discs = alt.Chart(nodes).mark_circle(size=2200, opacity=1, stroke="white", strokeWidth=2
                                         ).encode(x=x, y=y, color=color, tooltip=tip
                                                  ).transform_filter(now)
    disc_text = alt.Chart(nodes).mark_text(fontSize=13, fontWeight="bold", color="white").encode(
        x=x, y=y, text="label:N").transform_filter(now)
    rank_text = [alt.Chart(nodes).mark_text(fontSize=11, lineBreak="\n", align=a).encode(
        x=alt.X("lx:Q", scale=alt.Scale(domain=[-xlim, xlim]), axis=None),
        y=alt.Y("ly:Q", scale=alt.Scale(domain=[-lim, lim]), axis=None),
        text="rank_label:N").transform_filter(now & (alt.datum.align == a))
        for a in ("left", "center", "right")]
    lines = alt.Chart(arrows).mark_rule(strokeWidth=2.5, color="#555").encode(
        x=x, y=y, x2="x2:Q", y2="y2:Q").transform_filter(now)
    heads = alt.Chart(arrows).mark_point(shape="triangle-up", filled=True, size=140, opacity=1,
                                         color="#555").encode(
        x=alt.X("x2:Q", scale=alt.Scale(domain=[-xlim, xlim]), axis=None),
        y=alt.Y("y2:Q", scale=alt.Scale(domain=[-lim, lim]), axis=None),
        angle=alt.Angle("angle:Q", scale=None)).transform_filter(now)
    msg_tip = [alt.Tooltip("src:O", title="from rank"), alt.Tooltip("dst:O", title="to rank"),
               alt.Tooltip("carries:N"), alt.Tooltip("block:N"),
               alt.Tooltip("payload_bytes:Q", format=",", title="payload (bytes)"),
               alt.Tooltip("ms:Q", format=".3f", title="send time (ms, measured)")]
    flying = alt.Chart(arrows).mark_square(size=260, opacity=1, stroke="white", strokeWidth=1).encode(
        x=alt.X("mx:Q", scale=alt.Scale(domain=[-xlim, xlim]), axis=None),
        y=alt.Y("my:Q", scale=alt.Scale(domain=[-lim, lim]), axis=None),
        color=color, tooltip=msg_tip).transform_filter(now)
    msg_text = alt.Chart(arrows).mark_text(fontSize=10, lineBreak="\n", color="#333").encode(
        x=alt.X("tx:Q", scale=alt.Scale(domain=[-xlim, xlim]), axis=None),
        y=alt.Y("ty:Q", scale=alt.Scale(domain=[-lim, lim]), axis=None),
        text="label:N").transform_filter(now)
    caption = alt.Chart(captions).mark_text(align="left", baseline="top", lineBreak="\n",
                                            fontSize=12).encode(
        x=alt.value(0), y=alt.value(size + 12), text="caption:N").transform_filter(now)
    impl = _impl(rep)
    cfg = rep["config"]
    return alt.layer(ring, lines, heads, flying, discs, disc_text, *rank_text, msg_text, caption
                     ).add_params(param).properties(
        width=round(size * xlim / lim), height=size, autosize=PAD,
        title=alt.TitleParams(
            f"K/V blocks around the ring: {impl} on {c} ranks, s = {cfg['seq']} (live run)",
            subtitle=[f"frames 0–{c - 1}: forward · frames {c}–{2 * c - 1}: backward, dK and dV "
                      "travelling with their block",
                      "colour: whose K/V block (its owner rank) · move the 'frame' slider",
                      "arrows: the sends the ranks recorded, with their bytes and measured time"],
            anchor="start"))


# ---------------------------------------------------------------------------------------------
# the tile maps
# ---------------------------------------------------------------------------------------------
def tile_map_frame(report) -> pd.DataFrame:
    """One row per (cp rank, tile) of one layer's last forward, as the run recorded it: the query
    and key chunk, their token ranges, the ring step and the K/V block it came from, computed or
    skipped (fully masked: every key after every query)."""
    rep = _as_dict(report)
    c, seq = rep["config"]["cp"], rep["config"]["seq"]
    layout = _layout(rep)
    size = seq // (2 * c if layout == "zigzag" else c)
    rows = []
    for r in cp_ranks(rep):
        k = r["coords"]["cp"]
        for t in r.get("context", {}).get("tiles", []):
            diag = t["q_chunk"] == t["k_chunk"]
            rows.append({
                "layout": layout, "rank": k, "ring_step": t["ring_step"], "from": t["from"],
                "q_chunk": t["q_chunk"], "k_chunk": t["k_chunk"], "computed": t["computed"],
                "q0": t["q_chunk"] * size, "q1": (t["q_chunk"] + 1) * size,
                "k0": t["k_chunk"] * size, "k1": (t["k_chunk"] + 1) * size,
                "block": f"block {t['from']}" if t["computed"] else "skipped (fully masked)",
                "label": str(t["ring_step"]) if t["computed"] else "×",
                "what": ("computed, causal mask inside (diagonal)" if diag and t["computed"] else
                         "computed" if t["computed"] else "skipped: every key after every query"),
                "pairs": size * size if t["computed"] else 0})
    return pd.DataFrame(rows, columns=[
        "layout", "rank", "ring_step", "from", "q_chunk", "k_chunk", "computed", "q0", "q1", "k0",
        "k1", "block", "label", "what", "pairs"])


def _tile_panel(df: pd.DataFrame, seq: int, c: int, rank: int, panel: int) -> alt.LayerChart:
    mine = df[df["rank"] == rank]
    comp, total = int(mine["computed"].sum()), len(mine)
    blocks = [f"block {b}" for b in range(c)] + ["skipped (fully masked)"]
    colors = _block_colors(c) + [SKIPPED_COLOR]
    sx, sy = alt.Scale(domain=[0, seq], nice=False), alt.Scale(domain=[0, seq], nice=False,
                                                                 reverse=True)
    frame = alt.Chart(pd.DataFrame({"x": [0], "x2": [seq], "y": [0], "y2": [seq]})).mark_rect(
        fill="white", stroke="#bbb").encode(
        x=alt.X("x:Q", scale=sx, title="key position (token)"), x2="x2:Q",
        y=alt.Y("y:Q", scale=sy, title="query position (token)"), y2="y2:Q")
    tiles = alt.Chart(mine).mark_rect(stroke="white", strokeWidth=1).encode(
        x=alt.X("k0:Q", scale=sx), x2="k1:Q", y=alt.Y("q0:Q", scale=sy), y2="q1:Q",
        color=alt.Color("block:N", title="K/V block of rank (label: ring step)", sort=blocks,
                        scale=alt.Scale(domain=blocks, range=colors),
                        legend=alt.Legend(orient="bottom", titleLimit=400, labelExpr=(
                            "indexof(datum.label, 'block') == 0 ? "
                            "'block of rank ' + replace(datum.label, 'block ', '') : datum.label"))),
        tooltip=[alt.Tooltip("rank:O"), alt.Tooltip("ring_step:O", title="ring step"),
                 alt.Tooltip("from:O", title="K/V block of rank"),
                 alt.Tooltip("q_chunk:O", title="query chunk"),
                 alt.Tooltip("k_chunk:O", title="key chunk"), alt.Tooltip("what:N")])
    tile_px = panel * int((mine["q1"] - mine["q0"]).max()) / seq if len(mine) else panel
    labels = alt.Chart(mine).mark_text(fontSize=10 if tile_px >= 16 else 8, color="white").encode(
        x=alt.X("kx:Q", scale=sx), y=alt.Y("qy:Q", scale=sy), text="label:N").transform_calculate(
        kx="(datum.k0 + datum.k1) / 2", qy="(datum.q0 + datum.q1) / 2")
    diag = alt.Chart(pd.DataFrame({"x": [0, seq], "y": [0, seq]})).mark_line(
        color="#333", strokeDash=[3, 3], strokeWidth=1).encode(x=alt.X("x:Q", scale=sx),
                                                               y=alt.Y("y:Q", scale=sy))
    return alt.layer(frame, tiles, labels, diag).properties(
        width=panel, height=panel,
        title=alt.TitleParams(f"rank {rank}: {comp} of {total} tiles", fontSize=12, anchor="start"))


def tile_maps(reports: dict, title: str = "Causal attention tiles per rank: which each computed",
              subtitle: str | list[str] | None = None, panel: int = 150) -> alt.VConcatChart:
    """Tile maps of several runs, one row per run (e.g. {"contiguous (ring)": ring_report,
    "zigzag": zigzag_report}), one panel per cp rank: the s x s attention matrix in tokens, the
    rank's (query chunk, key chunk) tiles coloured by whose K/V block they used and labelled with
    the ring step they were computed at; fully masked tiles grey with ×; the dashed diagonal is the
    causal boundary (keys right of it are masked). Other ranks' queries are left white."""
    rows = []
    for name, rep in reports.items():
        rep = _as_dict(rep)
        df = tile_map_frame(rep)
        c, seq = rep["config"]["cp"], rep["config"]["seq"]
        panels = [_tile_panel(df, seq, c, k, panel) for k in sorted(df["rank"].unique())]
        comp = df.groupby("rank")["computed"].sum().astype(int).tolist()
        rows.append(alt.hconcat(*panels, spacing=14).properties(title=alt.TitleParams(
            f"{name}: tiles computed per rank {comp} (of {len(df) // max(1, len(comp))} each)",
            anchor="start", fontSize=13)))
    first = _as_dict(next(iter(reports.values())))
    c = first["config"]["cp"]
    subtitle = subtitle if subtitle is not None else [
        f"C = {c} ranks, s = {first['config']['seq']} tokens, one layer's forward as recorded; "
        "label: the ring step a tile was computed at; ×: fully masked, skipped",
        f"formula: contiguous, rank r computes r + 1 of {c} tiles; zigzag (chunks r and "
        f"2C − 1 − r), every rank 2C + 1 = {2 * c + 1} of 4C = {4 * c}"]
    return alt.vconcat(*rows, spacing=18).properties(
        autosize=PAD, title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def tile_map(report, title: str | None = None, subtitle=None, panel: int = 150) -> alt.VConcatChart:
    """tile_maps of one run: one panel per cp rank."""
    rep = _as_dict(report)
    name = f"{_layout(rep)} ({_impl(rep)})"
    return tile_maps({name: rep}, title or f"Causal attention tiles per rank: {name}", subtitle,
                     panel)


def cp_work_theory_bars(layout: str, c: int, seq: int) -> alt.LayerChart:
    """Attention scores (query x key token pairs) each cp rank computes in one layer's forward, by
    the formula alone (tiles_theory x tile size²), before any run: what `cp_work_bars` then draws
    beside a run's measured work."""
    size = seq // (2 * c if layout == "zigzag" else c)  # a chunk: zigzag cuts 2C of them
    df = pd.DataFrame([{"rank": f"rank {k}", "pairs": tiles_theory(layout, c, k)[0] * size ** 2}
                       for k in range(c)])
    base = alt.Chart(df).encode(
        x=alt.X("rank:N", title="cp rank", sort=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("pairs:Q", title="attention scores computed (query × key pairs)"),
        tooltip=["rank:N", alt.Tooltip("pairs:Q", format=",")])
    return alt.layer(base.mark_bar(color="#9ecae9"),
                     base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("pairs:Q", format=","))
                     ).properties(autosize=PAD, width=max(240, 48 * c), height=200,
                                  title=alt.TitleParams(
                                      f"Work per rank (formula): {layout}, C = {c}, s = {seq}",
                                      subtitle="tiles_theory × tile size²; most/least = "
                                               f"{df['pairs'].max() / df['pairs'].min():.2g}",
                                      anchor="start"))


def cp_work_bars(reports: dict, title: str = "Attention work per rank: measured vs formula",
                 subtitle: str | list[str] | None = None) -> alt.LayerChart:
    """Grouped bars per cp rank: query x key token pairs each rank scored in one layer's forward,
    per run in `reports` ({label: report}), measured (the run's computed tiles x tile size²) beside
    the formula (tiles_theory x tile size²). Contiguous chunks load the last rank most; zigzag
    evens the work."""
    rows = []
    for name, rep in reports.items():
        rep = _as_dict(rep)
        df = tile_map_frame(rep)
        c, seq = rep["config"]["cp"], rep["config"]["seq"]
        layout = _layout(rep)
        size = seq // (2 * c if layout == "zigzag" else c)
        for k in range(c):
            rows.append({"rank": f"rank {k}", "run": name, "source": f"{name}: measured",
                         "pairs": int(df.loc[df["rank"] == k, "pairs"].sum())})
            rows.append({"rank": f"rank {k}", "run": name, "source": f"{name}: formula",
                         "pairs": tiles_theory(layout, c, k)[0] * size * size})
    df = pd.DataFrame(rows)
    sources = list(dict.fromkeys(df["source"]))
    palette = ["#4c78a8", "#9ecae9", "#f58518", "#ffbf79", "#54a24b", "#98df8a"]
    base = alt.Chart(df).encode(
        x=alt.X("rank:N", title="cp rank", axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("pairs:Q", title="attention scores computed (query × key token pairs)"),
        tooltip=["rank:N", "source:N", alt.Tooltip("pairs:Q", format=",")])
    first = _as_dict(next(iter(reports.values())))
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources, scale=alt.Scale(
            domain=sources, range=palette[:len(sources)]), legend=alt.Legend(orient="bottom",
                                                                             columns=2))),
        base.mark_text(dy=-5, fontSize=9).encode(text=alt.Text("pairs:Q", format=",")),
    ).properties(autosize=PAD, width=max(300, 30 * len(df)), height=240, title=alt.TitleParams(
        title, anchor="start", subtitle=subtitle if subtitle is not None else [
            "measured: the tiles the run computed (its tile map) × tile size²; formula: "
            "tiles_theory × tile size²",
            f"one layer, per sequence and head; s = {first['config']['seq']}: the causal half of "
            f"s² = {first['config']['seq'] ** 2:,} pairs, plus the diagonal tiles' masked halves"]))


# ---------------------------------------------------------------------------------------------
# the wire: ring sends vs Ulysses all-to-alls
# ---------------------------------------------------------------------------------------------
def cp_comm_frame(report) -> pd.DataFrame:
    """One row per cp message of the last training step, per cp rank: the ring's sends (with what
    they carry and whose block) or Ulysses' all-to-alls (forward: q, k, v then the output; backward
    the reverse), start and end in ms from the step's first cp message, bytes. Ulysses' records
    carry no direction: the first half of the step's all-to-alls is named forward, which holds
    without activation checkpointing (a recomputed forward repeats its all-to-alls in backward)."""
    rep = _as_dict(report)
    step = _last_step(rep)
    rows = []
    for r in cp_ranks(rep):
        k = r["coords"]["cp"]
        recs = _cp_records(r, step)
        a2a = [x for x in recs if x["op"] == "all_to_all"]
        big = max((x["payload_bytes"] for x in a2a), default=0)
        for i, x in enumerate(recs):
            if x["op"] == "send":
                kind, block = x["carries"], x["block"]
            else:
                fwd = a2a.index(x) < len(a2a) // 2
                qkv = x["payload_bytes"] == big
                kind = ("a2a_qkv" if qkv else "a2a_out") if fwd else ("a2a_dqkv" if qkv else "a2a_dout")
                block = None
            rows.append({"rank": k, "lane": f"rank {k}", "kind": kind, "what": CP_COMM_KINDS[kind],
                         "block": block, "peer": x.get("peer"), "start": x["start"], "end": x["end"],
                         "payload_bytes": x["payload_bytes"], "wire_bytes_model": x["wire_bytes_model"],
                         "wire_bytes_measured": x.get("wire_bytes_measured")})
    df = pd.DataFrame(rows, columns=["rank", "lane", "kind", "what", "block", "peer", "start",
                                     "end", "payload_bytes", "wire_bytes_model",
                                     "wire_bytes_measured"])
    t0 = df["start"].min() if len(df) else 0.0
    df["x"], df["x2"] = 1e3 * (df["start"] - t0), 1e3 * (df["end"] - t0)
    df["ms"] = df["x2"] - df["x"]
    return df


def cp_comm_timeline(report, title: str | None = None, subtitle: str | list[str] = "",
                     width: int = 440, x_max: float | None = None) -> alt.Chart:
    """The cp group's messages of one training step on a time axis, one lane per rank (measured):
    a ring run's sends (K/V forward, K/V + dK/dV backward, dK/dV home), or a Ulysses run's four
    all-to-alls per layer. Bars last from the message's start to its completion. `x_max`: a common
    time axis (ms) for two charts side by side."""
    rep = _as_dict(report)
    df = cp_comm_frame(rep)
    kinds = [k for k in CP_COMM_KINDS if k in set(df["kind"])]
    labels = [CP_COMM_KINDS[k] for k in kinds]
    colors = [dict(zip(CP_COMM_KINDS, CP_COMM_COLORS))[k] for k in kinds]
    lanes = [f"rank {k}" for k in sorted(df["rank"].unique())]
    n = len(df) // max(1, len(lanes))
    impl = _impl(rep)
    return alt.Chart(df).mark_bar(height=18, stroke="white", strokeWidth=0.5).encode(
        x=alt.X("x:Q", title="time from the step's first cp message (ms)",
                scale=alt.Scale(domain=[0, x_max]) if x_max else alt.Undefined),
        x2="x2:Q",
        y=alt.Y("lane:N", title=None, sort=lanes),
        color=alt.Color("what:N", title=None, sort=labels, scale=alt.Scale(domain=labels,
                                                                        range=colors),
                        legend=alt.Legend(orient="bottom", columns=1, labelLimit=400)),
        tooltip=["lane:N", "what:N", alt.Tooltip("block:Q", title="K/V block of rank"),
                 alt.Tooltip("peer:Q", title="to rank"),
                 alt.Tooltip("payload_bytes:Q", format=",", title="payload (bytes)"),
                 alt.Tooltip("wire_bytes_model:Q", format=",", title="sent, counted (bytes)"),
                 alt.Tooltip("wire_bytes_measured:Q", format=",.0f",
                             title="written to sockets, measured (bytes)"),
                 alt.Tooltip("ms:Q", format=".3f", title="duration (ms)")],
    ).properties(autosize=PAD, width=width, height=30 * len(lanes), title=alt.TitleParams(
        title or f"{impl}: the cp messages of one step (measured)",
        subtitle=subtitle or f"{n} messages per rank ({rep['config']['layers']} layer(s), "
                             "forward and backward)", anchor="start"))


CP_BYTE_SOURCES = {"measured (written to sockets)": "#4c78a8", "counted": "#9ecae9",
                   "theory": "#bab0ac"}


def cp_bytes_chart(rows: list[dict], title: str = "Bytes each rank sends per step for attention",
                   subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per implementation: bytes one rank sends per training step for attention,
    "measured (written to sockets)" (the records' `wire_bytes_measured`: payload and gloo's framing),
    "counted" (the records' `wire_bytes_model`: what the code handed to send / all-to-all) and
    "theory" (theory.cp_wire_bytes_per_step). `rows`: {impl, source (one of CP_BYTE_SOURCES),
    bytes}; a source without rows (written bytes off Linux) is left out."""
    df = pd.DataFrame(rows, columns=["impl", "source", "bytes"])
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    impls = list(dict.fromkeys(df["impl"]))
    sources = [s for s in CP_BYTE_SOURCES if s in set(df["source"])]
    base = alt.Chart(df).encode(
        x=alt.X("impl:N", title=None, sort=impls, axis=alt.Axis(labelAngle=0, labelFontSize=12,
                                                                labelLimit=240)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("value:Q", title=f"bytes sent per rank per step ({unit})"),
        tooltip=["impl:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources, scale=alt.Scale(
            domain=sources, range=[CP_BYTE_SOURCES[s] for s in sources]),
            legend=alt.Legend(orient="bottom", labelLimit=300))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=max(220, 170 * len(impls)), height=240,
                 title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


# ---------------------------------------------------------------------------------------------
# activation memory vs sequence length
# ---------------------------------------------------------------------------------------------
def cp_activation_curve(points: list[dict], theory: dict[str, Callable[[int], float]],
                        seqs: list[int] | None = None,
                        title: str = "Activation bytes per layer per rank vs sequence length",
                        subtitle: str | list[str] = "") -> alt.LayerChart:
    """Lines: each series' formula (`theory` {series: f(seq) -> bytes}, e.g. a lambda over
    theory.gpt_activation_bytes_per_layer) at every sequence length in `seqs` (default: 16 points
    up to the longest measured); points: live measurements `points` [{series, seq, bytes}] (a layer's
    bytes as the difference of two runs with 1 and 2 layers). The same series name links a point
    to its line."""
    pts = pd.DataFrame(points, columns=["series", "seq", "bytes"])
    top = int(max(pts["seq"].max() if len(pts) else 0, max(seqs or [0]), 16))
    seqs = seqs or sorted({max(1, round(top * i / 16)) for i in range(1, 17)})
    lines = pd.DataFrame([{"series": name, "seq": s, "bytes": float(f(s))}
                          for name, f in theory.items() for s in seqs])
    # two fields, so that the lines and the points each get a legend entry of their own
    lines["source"], pts["source"] = "theory (formula)", "measured (live run)"
    lines["line"], pts["point"] = lines["source"], pts["source"]
    div, unit = bytes_unit(max(lines["bytes"].max() if len(lines) else 0,
                               pts["bytes"].max() if len(pts) else 0))
    lines["value"], pts["value"] = lines["bytes"] / div, pts["bytes"] / div
    names = list(theory) + [s for s in dict.fromkeys(pts["series"]) if s not in theory]
    color = alt.Color("series:N", title=None, sort=names, scale=alt.Scale(
        domain=names, range=["#bab0ac", "#4c78a8", "#f58518", "#54a24b", "#e45756"][:len(names)]
        if len(names) <= 5 else alt.Undefined), legend=alt.Legend(orient="bottom", columns=1,
                                                                  labelLimit=420))
    x = alt.X("seq:Q", title="sequence length s (tokens)")
    y = alt.Y("value:Q", title=f"activations kept per layer, one rank ({unit})")
    tip = ["series:N", "source:N", alt.Tooltip("seq:Q", title="s (tokens)"),
           alt.Tooltip("bytes:Q", format=",.0f", title="bytes")]
    line = alt.Chart(lines).mark_line(strokeWidth=2).encode(
        x=x, y=y, color=color, strokeDash=alt.StrokeDash("line:N", title=None, legend=alt.Legend(
            orient="bottom")), tooltip=tip)
    dots = alt.Chart(pts).mark_point(size=90, filled=True, opacity=1, stroke="black",
                                     strokeWidth=1).encode(
        x=x, y=y, color=color, shape=alt.Shape("point:N", title=None, legend=alt.Legend(
            orient="bottom")), tooltip=tip)
    return alt.layer(line, dots).resolve_scale(color="shared").properties(
        autosize=PAD, width=520, height=300,
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))
