"""Pipeline parallel (lesson 05, the Pipeline page):

    pipeline_timeline(timed, title)   F/B/W ops per rank as a Gantt chart, idle gaps = the bubble
    pipeline_stage_bars(rows, ...)    grouped bars per stage (bytes held, bytes sent)
    bubble_bars(rows)                 the bubble measured (own device, wall clock) vs the formula
    in_flight_chart(report)           activation bytes each stage holds after every op

`timed` records come from `schedules.simulate`, `trace.own_device_replay` or `trace.wall_view`.
"""
from __future__ import annotations

import altair as alt
import pandas as pd

from .units import PAD, bytes_unit

PIPE_KINDS = {"F": "F: forward", "B": "B: backward", "W": "W: weight gradients",
              "send": "sending to a neighbour", "wait": "waiting for a neighbour",
              "idle": "idle (bubble)"}
PIPE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#79706e", "#bab0ac", "#fbe3e3"]


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
    are seconds (a replay or a wall view) or as they are (a schedule drawn with unit costs)."""
    end = max((t["end"] for t in timed), default=0.0)
    rows = [dict(t) for t in timed if t["kind"] in PIPE_KINDS]
    rows += _idle_gaps(rows, end)  # neither computing nor (wall view) waiting
    df = pd.DataFrame(rows, columns=["rank", "kind", "microbatch", "chunk", "start", "end"])
    scale = 1e3 if seconds else 1.0
    df["x"], df["x2"] = df["start"] * scale, df["end"] * scale
    df["lane"] = df["rank"].map(lambda r: f"rank {r}")
    df["what"] = df["kind"].map(PIPE_KINDS)
    chunks = df["chunk"].dropna()
    several = len(chunks) and chunks.nunique() > df["rank"].nunique()
    df["label"] = [("" if k in ("idle", "wait", "send") or m is None or m != m else
                    f"{int(m)}" + (f".{int(c)}" if several else ""))
                   for k, m, c in zip(df["kind"], df["microbatch"], df["chunk"])]
    return df


def _labels_fit(df: pd.DataFrame, width: int, x_max: float | None) -> bool:
    """Whether most op bars are wide enough for their label (a digit is about 6.5 px)."""
    ops = df[df["label"] != ""]
    span = x_max or (df["x2"].max() if len(df) else 0)
    if not len(ops) or not span:
        return True
    wide = (ops["x2"] - ops["x"]) / span * width >= 6.5 * ops["label"].str.len() + 2
    return wide.mean() >= 0.8


def pipeline_timeline(timed: list[dict], title: str, subtitle: str | list[str] = "",
                      seconds: bool = True, width: int = 640, x_max: float | None = None) -> alt.LayerChart:
    """Gantt chart of a pipeline step, one lane per rank: F, B, W ops labelled with their
    micro-batch (".chunk" when a rank holds several chunks), sends and waits (wall view), idle gaps.
    `timed`: records {rank, kind, microbatch, chunk, start, end} from schedules.simulate,
    trace.own_device_replay or trace.wall_view. `seconds=False` for unit-cost schedules.
    `x_max`: a common time axis, to set two charts side by side on one scale."""
    df = pipeline_frame(timed, seconds)
    lanes = [f"rank {r}" for r in sorted(df["rank"].unique())]
    kinds = [k for k in PIPE_KINDS if k in set(df["kind"])]
    colors = [dict(zip(PIPE_KINDS, PIPE_COLORS))[k] for k in kinds]
    unit = "ms" if seconds else "time units (one forward = 1)"
    x_scale = alt.Scale(domain=[0, x_max]) if x_max else alt.Undefined
    base = alt.Chart(df).encode(
        x=alt.X("x:Q", title=f"time from the step's start ({unit})", scale=x_scale),
        y=alt.Y("lane:N", title=None, sort=lanes))
    bars = base.mark_bar(height=22, stroke="white", strokeWidth=0.5).encode(
        x2="x2:Q",
        color=alt.Color("what:N", title=None, sort=[PIPE_KINDS[k] for k in kinds],
                        scale=alt.Scale(domain=[PIPE_KINDS[k] for k in kinds], range=colors),
                        legend=alt.Legend(orient="bottom", columns=3)),
        tooltip=["lane:N", "what:N", "microbatch:Q", "chunk:Q",
                 alt.Tooltip("x:Q", format=".3g", title=f"start ({'ms' if seconds else 'units'})"),
                 alt.Tooltip("x2:Q", format=".3g", title=f"end ({'ms' if seconds else 'units'})")])
    labels = alt.Chart(df[df["label"] != ""]).mark_text(color="white", fontSize=10).encode(
        x=alt.X("mid:Q", scale=x_scale), y=alt.Y("lane:N", sort=lanes), text="label:N"
    ).transform_calculate(mid="(datum.x + datum.x2) / 2")
    if not _labels_fit(df, width, x_max):  # crowded: the tooltip still names every op
        subtitle = [*([subtitle] if isinstance(subtitle, str) and subtitle else subtitle or []),
                    "too many ops to label: hover a bar for its micro-batch"]
        return alt.layer(bars).properties(autosize=PAD, width=width, height=34 * len(lanes),
                                          title=alt.TitleParams(title, subtitle=subtitle,
                                                                anchor="start"))
    return alt.layer(bars, labels).properties(
        autosize=PAD, width=width, height=34 * len(lanes),
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


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
                                               legend=alt.Legend(orient="bottom"))),
        base.mark_text(dy=-5, fontSize=10).encode(
            text=alt.Text(f"{label}:N") if label else alt.Text("y:Q", format=".3g")),
    ).properties(autosize=PAD, width=max(240, 48 * df["stage"].nunique() * len(sources)),
                 height=240, title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def bubble_bars(rows: list[dict], title: str = "Pipeline bubble: measured vs formula",
                subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per schedule: the bubble fraction measured in the own-device replay, on the
    wall clock, and the formula's. `rows`: {schedule, source, bubble (0..1)}."""
    df = pd.DataFrame(rows, columns=["schedule", "source", "bubble"])
    df["percent"] = 100 * df["bubble"]
    groups = list(dict.fromkeys(df["schedule"]))
    order = [s for s in ("measured (own device)", "measured (wall clock)", "formula")
             if s in set(df["source"])] + sorted(set(df["source"]) - {
                 "measured (own device)", "measured (wall clock)", "formula"})
    palette = {"measured (own device)": "#4c78a8", "measured (wall clock)": "#bab0ac",
               "formula": "#e45756"}
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
        x=alt.X("op_index:Q", title="op of the step on this rank (F, B, W in schedule order)"),
        y=alt.Y("value:Q", title=f"held beyond model states ({unit})"),
        color=alt.Color("stage:N", title=None, legend=alt.Legend(orient="bottom")),
        tooltip=["stage:N", "op:N", alt.Tooltip("held_bytes:Q", format=",.0f", title="bytes")],
    ).properties(autosize=PAD, width=420, height=220, title=alt.TitleParams(
        title or f"Activation memory in flight per stage ({schedule}, measured)",
        subtitle=subtitle, anchor="start"))
