"""Pipeline parallel (lesson 05, the Pipeline page):

    pipeline_timeline(timed, title)   F/B/W ops per rank as a Gantt chart, idle gaps = the bubble;
                                      each op labelled with its micro-batch (colour, when crowded)
    pipeline_stage_bars(rows, ...)    grouped bars per stage (bytes held, bytes sent)
    bubble_bars(rows)                 the bubble measured (wall clock), replayed, and the formula
    in_flight_chart(report)           activation bytes each stage holds after every op

`timed` records come from `schedules.simulate`, `trace.own_device_replay` or `timelines.wall_view`.
"""
from __future__ import annotations

from typing import Callable

import altair as alt
import pandas as pd

from .units import PAD, bytes_unit

PIPE_KINDS = {"F": "F: forward", "B": "B: backward", "W": "W: weight gradients",
              "send": "sending to a neighbour", "wait": "waiting for a neighbour",
              "idle": "idle (bubble)"}
PIPE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#79706e", "#bab0ac", "#fbe3e3"]
OP_KINDS = ("F", "B", "W")
LABEL_FONTS = (12, 11, 10, 9)  # px; below 9 a label is not read from the back of a room
CHAR_EM = 0.62  # a digit's width in em (Helvetica/Arial, Vega's default font)


def _idle_gaps(timed: list[dict], end: float) -> list[dict]:
    """The stretches of [0, end] in which a rank ran no op: what the bubble is made of."""
    gaps = []
    for rank in sorted({t["rank"] for t in timed}):
        t = 0.0
        for op in sorted((x for x in timed if x["rank"] == rank), key=lambda x: x["start"]):
            if op["start"] > t + 1e-12:
                gaps.append({"rank": rank, "kind": "idle", "microbatch": None, "chunk": None,
                             "start": t, "end": op["start"]})
            t = max(t, op["end"])
        if end > t + 1e-12:
            gaps.append({"rank": rank, "kind": "idle", "microbatch": None, "chunk": None,
                         "start": t, "end": end})
    return gaps


def pipeline_frame(timed: list[dict], seconds: bool = True) -> pd.DataFrame:
    """Rows for pipeline_timeline: every op plus the idle gaps between them, in ms when the times
    are seconds (a replay or a wall view) or as they are (a schedule drawn with unit costs).
    `label`: the op's micro-batch, with its model chunk ("3·c5") when a rank holds several chunks
    (interleaved, zbv); `row`, `row_name`: the op's row in its rank's lane when colour shows the
    micro-batch ("F1": forwards of the rank's first chunk, named "F c1" on rank 1)."""
    end = max((t["end"] for t in timed), default=0.0)
    rows = [dict(t) for t in timed if t["kind"] in PIPE_KINDS]
    rows += _idle_gaps(rows, end)  # neither computing nor (wall view) waiting
    df = pd.DataFrame(rows, columns=["rank", "kind", "microbatch", "chunk", "start", "end"])
    scale = 1e3 if seconds else 1.0
    df["x"], df["x2"] = df["start"] * scale, df["end"] * scale
    df["lane"] = df["rank"].map(lambda r: f"rank {r}")
    df["what"] = df["kind"].map(PIPE_KINDS)
    chunks = df["chunk"].dropna()
    several = bool(len(chunks)) and chunks.nunique() > df["rank"].nunique()
    is_op = df["kind"].isin(OP_KINDS) & df["microbatch"].notna()
    df["label"] = [f"{int(m)}" + (f"·c{int(c)}" if several else "") if op else ""
                   for op, m, c in zip(is_op, df["microbatch"], df["chunk"])]
    df["text"] = df["label"].str.replace("·", "\n")  # drawn on two lines: fits narrower bars
    # the row key: kind and the chunk's place among its rank's chunks (rank 1 of 4 holds chunks
    # 1 and 5: rows "F1", "F2"), so that every lane has the same rows; `row_name` says which chunk
    held = {r: sorted(set(g.dropna().astype(int))) for r, g in df.groupby("rank")["chunk"]}
    place = [held[r].index(int(c)) + 1 if op and several else "" for op, r, c in
             zip(is_op, df["rank"], df["chunk"])]
    df["row"] = [f"{k}{i}" if op else "" for op, k, i in zip(is_op, df["kind"], place)]
    df["row_name"] = [(f"{k} c{int(c)}" if several else k) if op else ""
                      for op, k, c in zip(is_op, df["kind"], df["chunk"])]
    return df


def _fits(df: pd.DataFrame, width: int, x_max: float | None, font_px: float) -> pd.Series:
    """Per row: whether the bar, drawn `width` px wide for the time axis, holds its label drawn at
    `font_px` (a digit is about CHAR_EM of the font wide)."""
    span = x_max or (df["x2"].max() if len(df) else 0) or 1.0
    bar_px = (df["x2"] - df["x"]) / span * width
    chars = df["text"].map(lambda t: max(map(len, t.split("\n"))))
    return (df["label"] != "") & (bar_px >= CHAR_EM * font_px * chars + 3)


def label_font(df: pd.DataFrame, width: int, x_max: float | None = None,
               drawn_font: Callable[[int], float] | None = None) -> int | None:
    """The largest font (px, LABEL_FONTS) at which every op bar holds its label, at `width` px for
    the time axis; None when even the smallest does not fit (colour then shows the micro-batch).
    `drawn_font`: see pipeline_timeline."""
    drawn = drawn_font or float
    ops = df["label"] != ""
    for font in LABEL_FONTS:
        if (_fits(df, width, x_max, drawn(font)) == ops).all():
            return font
    return None


def _x(seconds: bool, x_scale) -> alt.X:
    unit = "ms" if seconds else "time units (one forward = 1)"
    # unit costs are whole numbers: no tick between them (m = 1 would get halves otherwise)
    axis = alt.Axis() if seconds else alt.Axis(tickMinStep=1, format="d")
    return alt.X("x:Q", title=f"time from the step's start ({unit})", scale=x_scale, axis=axis)


def pipeline_timeline(timed: list[dict], title: str, subtitle: str | list[str] = "",
                      seconds: bool = True, width: int = 640, x_max: float | None = None,
                      drawn_font: Callable[[int], float] | None = None) -> alt.LayerChart:
    """Gantt chart of a pipeline step, one lane per rank: F, B, W ops, sends and waits (wall view),
    idle gaps, readable without hovering at any size. Each op bar is labelled with its micro-batch
    ("3", or "3·c5" for micro-batch 3 on model chunk 5 when a rank holds several chunks) in the
    largest font that fits every bar; when no font fits, colour shows the micro-batch instead (a
    legend), each op kind (and chunk) gets a row of its own in the lane, named on the right.
    `timed`: records {rank, kind, microbatch, chunk, start, end} from schedules.simulate,
    trace.own_device_replay or timelines.wall_view. `seconds=False` for unit-cost schedules (integer
    ticks). `x_max`: a common time axis, to set two charts side by side on one scale.
    `drawn_font(f)`: the size a text of f px will be drawn at, when the spec is restyled after it is
    built (the app's presentation mode: style.scaled_font); labels are fitted at that size."""
    df = pipeline_frame(timed, seconds)
    lanes = [f"rank {r}" for r in sorted(df["rank"].unique())]
    x_scale = alt.Scale(domain=[0, x_max]) if x_max else alt.Undefined
    subtitle = [*([subtitle] if isinstance(subtitle, str) and subtitle else subtitle or [])]
    drawn = drawn_font or float
    font = label_font(df, width, x_max, drawn)
    if font is None and df["microbatch"].dropna().nunique() <= 1:  # colour would say nothing
        font = LABEL_FONTS[-1]
        subtitle.append("one micro-batch: every op is micro-batch 0 (labelled where it fits)")
    if font is not None:
        shown = df[_fits(df, width, x_max, drawn(font))]
        chart, height = _labelled_bars(df, shown, lanes, _x(seconds, x_scale), x_scale, font,
                                       drawn(font), seconds)
    else:
        chart, height = _coloured_bars(df, lanes, _x(seconds, x_scale), width, drawn(10), seconds)
        chunks = " and chunk" if df["row_name"].str.contains("c").any() else ""
        subtitle.append("bars too narrow for a label each: colour is the micro-batch; each lane "
                        f"has a row per op kind{chunks}, named on the right")
    return chart.properties(autosize=PAD, width=width, height=height,
                            title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def _tooltip(seconds: bool) -> list:
    unit = "ms" if seconds else "units"
    return ["lane:N", "what:N", "microbatch:Q", "chunk:Q",
            alt.Tooltip("x:Q", format=".3g", title=f"start ({unit})"),
            alt.Tooltip("x2:Q", format=".3g", title=f"end ({unit})")]


def _kind_color(kinds: list[str], legend: alt.Legend) -> alt.Color:
    colors = dict(zip(PIPE_KINDS, PIPE_COLORS))
    names = [PIPE_KINDS[k] for k in kinds]
    return alt.Color("what:N", title=None, sort=names, legend=legend,
                     scale=alt.Scale(domain=names, range=[colors[k] for k in kinds]))


def _labelled_bars(df: pd.DataFrame, shown: pd.DataFrame, lanes: list[str], x: alt.X, x_scale,
                   font: int, font_px: float, seconds: bool) -> tuple[alt.LayerChart, int]:
    """Colour: the op kind; text on the op bars of `shown`: the micro-batch (and chunk), `font`
    px as built, `font_px` as drawn (the bars are made tall enough for its lines)."""
    kinds = [k for k in PIPE_KINDS if k in set(df["kind"])]
    y = alt.Y("lane:N", title=None, sort=lanes)
    lines = 2 if df["text"].str.contains("\n").any() else 1
    bar_px = max(22, round(lines * font_px + 4))
    bars = alt.Chart(df).mark_bar(height=bar_px, stroke="white", strokeWidth=0.5).encode(
        x=x, x2="x2:Q", y=y, tooltip=_tooltip(seconds),
        color=_kind_color(kinds, alt.Legend(orient="bottom", columns=3)))
    labels = alt.Chart(shown).mark_text(
        color="white", fontSize=font, lineBreak="\n", lineHeight=font_px,
        dy=-font_px / 2 * (lines - 1)).encode(  # the lines' middle on the bar's
        x=alt.X("mid:Q", scale=x_scale), y=y, text="text:N",
    ).transform_calculate(mid="(datum.x + datum.x2) / 2")
    return alt.layer(bars, labels), (bar_px + 12) * len(lanes)


def _coloured_bars(df: pd.DataFrame, lanes: list[str], x: alt.X, width: int, name_px: float,
                   seconds: bool) -> tuple[alt.LayerChart, int]:
    """Colour: the micro-batch; each op kind (and chunk) a row of the lane, named on the right;
    idle gaps, sends and waits span the lane in their own colours."""
    ops, rest = df[df["row"] != ""], df[df["row"] == ""]  # one dataset, filtered per layer
    rows = sorted(set(ops["row"]), key=lambda r: (OP_KINDS.index(r[0]), int(r[1:] or 0)))
    row_px = max(13, round(name_px + 3))  # a row holds its name, as drawn
    lane_px = max(34, row_px * len(rows) + 8)
    y = alt.Y("lane:N", title=None, sort=lanes, scale=alt.Scale(paddingInner=0.15))
    kinds = [k for k in PIPE_KINDS if k in set(rest["kind"])]
    gaps = alt.Chart(df).transform_filter(alt.datum.row == "").mark_bar(height=lane_px - 8).encode(
        x=x, x2="x2:Q", y=y, tooltip=_tooltip(seconds),
        color=_kind_color(kinds, alt.Legend(orient="bottom", title=None)))
    m = int(ops["microbatch"].max()) + 1 if len(ops) else 1
    scheme = "tableau10" if m <= 10 else "turbo"
    y_off = alt.YOffset("row:N", sort=rows, scale=alt.Scale(paddingInner=0.2))
    bars = alt.Chart(df).transform_filter(alt.datum.row != "").mark_bar().encode(
        x=x, x2="x2:Q", y=y, yOffset=y_off, tooltip=_tooltip(seconds),
        color=alt.Color("microbatch:O", title="micro-batch", scale=alt.Scale(scheme=scheme),
                        legend=alt.Legend(orient="bottom", columns=min(m, 8))))
    names = ops[["lane", "row", "row_name"]].drop_duplicates()
    row_names = alt.Chart(names).mark_text(align="left", fontSize=10, dx=4).encode(
        x=alt.value(width), y=y, yOffset=y_off, text="row_name:N")
    chart = alt.layer(gaps, bars, row_names).resolve_scale(color="independent")
    return chart, lane_px * len(lanes)


def pipeline_stage_bars(rows: list[dict], value: str, title: str, subtitle, y_title: str,
               label: str | None = None, palette: list[str] | None = None) -> alt.LayerChart:
    """Grouped bars per stage: one bar per `source` (a schedule, or measured / theory); bar labels
    from the column `label`, else the value."""
    df = pd.DataFrame(rows)
    div, unit = bytes_unit(df[value].max() if len(df) else 0)
    df["y"] = df[value] / div
    sources = list(dict.fromkeys(df["source"]))
    palette = palette or ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]
    base = alt.Chart(df).encode(
        x=alt.X("stage:N", title="pipeline stage (rank)", axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("y:Q", title=f"{y_title} ({unit})"),
        tooltip=["stage:N", "source:N", alt.Tooltip(f"{value}:Q", format=",.0f", title="bytes")]
        + ([f"{label}:N"] if label else []))
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources,
                                               scale=alt.Scale(domain=sources,
                                                               range=palette[:len(sources)]),
                                               legend=alt.Legend(orient="bottom",
                                                                 labelLimit=300))),
        base.mark_text(dy=-5, fontSize=10).encode(
            text=alt.Text(f"{label}:N") if label else alt.Text("y:Q", format=".3g")),
    ).properties(autosize=PAD, width=max(240, 96 * df["stage"].nunique()),  # half a page column
                 height=240, title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


BUBBLE_SOURCES = {  # timelines.LABELS: the wall clock is measured; the replay is a simulation
    "measured (wall clock)": "#4c78a8",                               # fed with measured op times
    "replayed (measured op times, own-device schedule)": "#9ecae9",
    "formula": "#e45756"}


def bubble_bars(rows: list[dict],
                title: str = "Pipeline bubble: measured (wall clock), replayed and formula",
                subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per schedule: the bubble fraction measured on the wall clock, replayed (each
    rank's ops with their measured CPU times, as if each rank had its own device: a simulation,
    not a measurement) and the formula's. `rows`: {schedule, source (timelines.LABELS' values),
    bubble (0..1)}."""
    df = pd.DataFrame(rows, columns=["schedule", "source", "bubble"])
    df["percent"] = 100 * df["bubble"]
    groups = list(dict.fromkeys(df["schedule"]))
    order = [s for s in BUBBLE_SOURCES if s in set(df["source"])] + sorted(
        set(df["source"]) - set(BUBBLE_SOURCES))
    palette = BUBBLE_SOURCES
    base = alt.Chart(df).encode(
        x=alt.X("schedule:N", title=None, sort=groups, axis=alt.Axis(labelAngle=0, labelFontSize=12)),
        xOffset=alt.XOffset("source:N", sort=order),
        y=alt.Y("percent:Q", title="share of the step a rank is idle (%)",
                scale=alt.Scale(domain=[0, 100])),
        tooltip=["schedule:N", "source:N", alt.Tooltip("percent:Q", format=".1f", title="%")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=order, scale=alt.Scale(
            domain=order, range=[palette.get(s, "#9d755d") for s in order]),
            legend=alt.Legend(orient="bottom"))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("percent:Q", format=".1f")),
    ).properties(autosize=PAD, width=max(160, 110 * len(groups)), height=260,
                 title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def in_flight_frame(report: dict) -> pd.DataFrame:
    """Bytes each pipeline rank holds beyond its model states after every op of the metered
    (last) step: activations waiting for their backward, queued W inputs, messages."""
    rows = []
    for r in report["ranks"]:
        if r["coords"].get("dp", 0) or "pp" not in r["coords"]:
            continue
        ops = [e for e in r["events"] if "held_bytes" in e]
        for i, e in enumerate(ops):
            rows.append({"stage": f"rank {r['coords']['pp']}", "op_index": i + 1,
                         "op": f"{e['kind']}{e['microbatch']}", "held_bytes": e["held_bytes"]})
    return pd.DataFrame(rows, columns=["stage", "op_index", "op", "held_bytes"])


def in_flight_chart(report: dict, title: str | None = None,
                    subtitle: str | list[str] = "") -> alt.Chart:
    """Step lines: bytes held in flight per pipeline rank after each of its ops (measured)."""
    df = in_flight_frame(report)
    div, unit = bytes_unit(df["held_bytes"].max() if len(df) else 0)
    df["value"] = df["held_bytes"] / div
    schedule = report["config"].get("schedule")
    return alt.Chart(df).mark_line(interpolate="step-after", point=True).encode(
        x=alt.X("op_index:Q", title="op of the step on this rank (F, B, W in schedule order)",
                axis=alt.Axis(tickMinStep=1, format="d")),  # ops are counted: no half ticks
        y=alt.Y("value:Q", title=f"held beyond model states ({unit})"),
        color=alt.Color("stage:N", title=None, legend=alt.Legend(orient="bottom")),
        tooltip=["stage:N", "op:N", alt.Tooltip("held_bytes:Q", format=",.0f", title="bytes")],
    ).properties(autosize=PAD, width=420, height=220, title=alt.TitleParams(
        title or f"Activation memory in flight per stage ({schedule}, measured)",
        subtitle=subtitle, anchor="start"))
