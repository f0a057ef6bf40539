"""Tensor and sequence parallel (lesson 04, the Tensor parallel page):

    tp_weight_shards(shards)        the MLP's weights as each rank holds its shard
    tp_comm_by_layer(rows, theory)  bytes per step by layer tag (f, g, SP, loss): counted vs theory
    tp_activation_bars(rows)        activation bytes per layer with and without SP
    tp_link_times(rows)             the step's tp traffic, timed on each interconnect
"""
from __future__ import annotations

import altair as alt
import pandas as pd

from .units import ACTIVATION_SOURCES, PAD, bars_by_source, bytes_unit, time_unit

TP_COMM_KINDS = {  # (layer tag, op) -> legend label, in drawing order
    ("g", "all_reduce"): "g: all-reduce, forward, after a row-parallel layer",
    ("f", "all_reduce"): "f: all-reduce, backward, before a column-parallel layer",
    ("sp", "all_gather"): "SP: all-gather, before a column-parallel layer (bwd: reduce-scatter)",
    ("sp", "reduce_scatter"): "SP: reduce-scatter, after a row-parallel layer (bwd: all-gather)",
    ("ce", "all_reduce"): "ce: vocab-parallel cross-entropy (max, target, sum exp)",
    ("sp-grads", "all_reduce"): "sp-grads: LayerNorm / bias / position grads summed over tp",
}
TP_COMM_COLORS = ["#4c78a8", "#9ecae9", "#f58518", "#ffbf79", "#54a24b", "#b279a2"]
TP_ACTIVATION_SOURCES = ACTIVATION_SOURCES  # the same three sources, per tp/SP setting


def weight_shard_cells(weight, rank: int, matrix: str, row_start: int = 0, col_start: int = 0,
                       block: int = 1) -> list[dict]:
    """One rank's shard of a weight as heatmap cells in the *full* matrix's coordinates: each cell
    the mean of a `block` x `block` patch (1: every weight), with its row/column index range."""
    import numpy as np

    w = np.asarray(weight, dtype=np.float64)
    rows, cols = w.shape
    label = f"rank {rank}: [{row_start}:{row_start + rows}, {col_start}:{col_start + cols}]"
    cells = []
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            cells.append({"matrix": matrix, "rank": rank, "panel": label,
                          "shard_rows": rows, "shard_cols": cols,
                          "row0": row_start + i, "row1": row_start + min(i + block, rows),
                          "col0": col_start + j, "col1": col_start + min(j + block, cols),
                          "value": float(w[i:i + block, j:j + block].mean())})
    return cells


def tp_weight_shards_frame(shards: list[dict], max_cells: int = 64) -> pd.DataFrame:
    """`shards`: {rank, matrix ('fc' | 'proj'), weight (2-D), row_start, col_start, full_shape}.
    One row per heatmap cell; patches are averaged so that the full matrix's long side has at most
    `max_cells` cells (the same patch size for every rank and both matrices)."""
    longest = max(max(s["full_shape"]) for s in shards)
    block = max(1, -(-longest // max_cells))
    rows = [c for s in shards for c in weight_shard_cells(
        s["weight"], s["rank"], s["matrix"], s["row_start"], s["col_start"], block)]
    df = pd.DataFrame(rows)
    df["block"] = block
    return df


def tp_weight_shards(shards: list[dict], title: str = "MLP weight shards, as the ranks hold them",
                     subtitle: str | list[str] = "", cell_px: int = 7,
                     max_cells: int = 64, proj_columns: int | None = None) -> alt.HConcatChart:
    """Megatron-LM's picture redrawn from a live run's shards. Left: the MLP's fc weight [4h, h]
    (column-parallel: rank r holds rows r*4h/t..(r+1)*4h/t, its slice of the output features),
    one panel per rank stacked in place. Right: proj [h, 4h] (row-parallel: rank r holds the
    matching columns, its slice of the input features), panels side by side (in rows of
    `proj_columns` panels, when given, so that 4 ranks fit a narrower page). Axes: the full
    matrix's indices, so the panels laid together are the whole weight. Colour: the weight value
    (patch mean when the matrix is larger than `max_cells`)."""
    df = tp_weight_shards_frame(shards, max_cells)
    block = int(df["block"].iloc[0])
    m = float(df["value"].abs().max()) or 1.0
    color = alt.Color("value:Q", title="weight value", scale=alt.Scale(
        scheme="redblue", domain=[-m, m], reverse=True), legend=alt.Legend(orient="bottom"))
    tooltip = ["panel:N", alt.Tooltip("row0:Q", title="first row"),
               alt.Tooltip("col0:Q", title="first column"),
               alt.Tooltip("value:Q", format=".4f",
                           title="weight" + (" (patch mean)" if block > 1 else ""))]
    charts = []
    for matrix, facet_dim in (("fc", "row"), ("proj", "column")):
        part = df[df["matrix"] == matrix]
        shape = next(s["full_shape"] for s in shards if s["matrix"] == matrix)
        panels = list(dict.fromkeys(part.sort_values("rank")["panel"]))
        n = len(panels)
        rows_cells = -(-shape[0] // block) // (n if facet_dim == "row" else 1)
        cols_cells = -(-shape[1] // block) // (n if facet_dim == "column" else 1)
        out_in = ("output feature (row)", "input feature (column)")
        base = alt.Chart(part).mark_rect().encode(
            x=alt.X("col0:Q", title=out_in[1], scale=alt.Scale(zero=False, nice=False)),
            x2="col1:Q",
            y=alt.Y("row0:Q", title=out_in[0],
                    scale=alt.Scale(zero=False, nice=False, reverse=True)),
            y2="row1:Q", color=color, tooltip=tooltip,
        ).properties(width=cols_cells * cell_px, height=rows_cells * cell_px)
        header = alt.Header(labelAngle=0, labelAlign="left", labelFontSize=11, labelOrient="top",
                            titleFontSize=12)
        name = (f"fc.weight [{shape[0]}, {shape[1]}], column-parallel: split by rows"
                if matrix == "fc" else
                f"proj.weight [{shape[0]}, {shape[1]}], row-parallel: split by columns")
        if facet_dim == "row":
            chart = base.facet(row=alt.Row("panel:N", sort=panels, title=None, header=header),
                               spacing=12).resolve_scale(y="independent")
        elif proj_columns and proj_columns < n:
            chart = base.facet(facet=alt.Facet("panel:N", sort=panels, title=None, header=header),
                               columns=proj_columns, spacing=12).resolve_scale(x="independent")
        else:
            chart = base.facet(column=alt.Column("panel:N", sort=panels, title=None, header=header),
                               spacing=12).resolve_scale(x="independent")
        charts.append(chart.properties(title=alt.TitleParams(name, fontSize=12, anchor="start")))
    sub = ([subtitle] if isinstance(subtitle, str) and subtitle else list(subtitle or []))
    if block > 1:
        sub.append(f"each cell: the mean of a {block}×{block} patch of weights")
    # svg, not canvas: Streamlit switches to canvas above 2,000 marks unless told, and the shards'
    # panels should stay inspectable (and testable) as SVG
    return alt.hconcat(*charts, spacing=30).resolve_scale(color="shared").properties(
        autosize=PAD, title=alt.TitleParams(title, subtitle=sub, anchor="start"),
        usermeta={"embedOptions": {"renderer": "svg"}})


def tp_comm_frame(rows: list[dict]) -> pd.DataFrame:
    """`rows`: {run, layer, op, calls, bytes} per step (one rank); adds the legend label."""
    df = pd.DataFrame(rows, columns=["run", "layer", "op", "calls", "bytes"])
    df["kind"] = [TP_COMM_KINDS.get((lay, op), f"{lay}: {op}")
                  for lay, op in zip(df["layer"], df["op"])]
    return df


def tp_comm_by_layer(rows: list[dict], theory_bytes: dict[str, float],
                     title: str = "Tensor-parallel bytes per step, by layer tag: "
                                  "counted vs theory",
                     subtitle: str | list[str] = "") -> alt.LayerChart:
    """One stacked bar per run (e.g. SP off, SP on): the bytes one rank sent on the tp group per
    training step, counted from its comm records (`wire_bytes_model`, the ring model of the calls it
    made, not a socket measurement), split by what sent them (the records' layer tag and op). The black
    tick on each bar: `theory.tp_wire_bytes_per_step` of that run (`theory_bytes`: run -> bytes)."""
    df = tp_comm_frame(rows)
    runs = list(dict.fromkeys(df["run"]))
    totals = df.groupby("run", as_index=False)["bytes"].sum()
    th = pd.DataFrame([{"run": r, "bytes": float(b)} for r, b in theory_bytes.items()],
                      columns=["run", "bytes"])
    top_bytes = max(totals["bytes"].max() if len(totals) else 0,
                    th["bytes"].max() if len(th) else 0)
    div, unit = bytes_unit(top_bytes)
    df["value"] = df["bytes"] / div
    kinds = [k for k in TP_COMM_KINDS.values() if k in set(df["kind"])] + sorted(
        set(df["kind"]) - set(TP_COMM_KINDS.values()))
    palette = dict(zip(TP_COMM_KINDS.values(), TP_COMM_COLORS))
    y = alt.Y("run:N", title=None, sort=runs, axis=alt.Axis(labelLimit=200, labelFontSize=12))
    top = 1.3 * top_bytes / div
    bars = alt.Chart(df).mark_bar(height=28).encode(
        y=y, x=alt.X("value:Q", title=f"bytes sent per step, one rank, counted ({unit})", stack="zero",
                     scale=alt.Scale(domain=[0, top or 1])),
        color=alt.Color("kind:N", title="sent by", sort=kinds, scale=alt.Scale(
            domain=kinds, range=[palette.get(k, "#bab0ac") for k in kinds]),
            legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=520)),
        order=alt.Order("kind_index:Q"),
        tooltip=["run:N", "kind:N", alt.Tooltip("calls:Q", format=".3g", title="calls per step"),
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes per step")],
    ).transform_calculate(kind_index=f"indexof({kinds}, datum.kind)")
    totals["value"] = totals["bytes"] / div
    totals["label"] = totals["bytes"].map(lambda b: f"counted {b:,.0f} B")
    total_text = alt.Chart(totals).mark_text(align="left", dx=6, fontSize=11).encode(
        y=y, x="value:Q", text="label:N")
    layers = [bars, total_text]
    if len(th):
        th["value"] = th["bytes"] / div
        th["label"] = th["bytes"].map(lambda b: f"theory {b:,.0f} B")
        layers.append(alt.Chart(th).mark_tick(color="black", thickness=3, size=40).encode(
            y=y, x="value:Q", tooltip=["run:N", alt.Tooltip("bytes:Q", format=",.0f",
                                                             title="theory (bytes per step)")]))
        layers.append(alt.Chart(th).mark_text(align="left", dx=6, dy=13, fontSize=10, color="#555")
                      .encode(y=y, x="value:Q", text="label:N"))
    return alt.layer(*layers).properties(
        autosize=PAD, width=520, height=70 * len(runs),
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def tp_activation_bars(rows: list[dict],
                       title: str = "Activation bytes per layer on one rank",
                       subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per setting (e.g. tp = 1, tp = t, tp = t + SP): the bytes one transformer
    layer keeps for backward on one rank, measured (difference of live runs with L and L+1
    layers) beside this library's exact count and Korthikanti et al.'s estimate. `rows`:
    {setting, source, bytes}, source one of ACTIVATION_SOURCES."""
    df = pd.DataFrame(rows, columns=["setting", "source", "bytes"])
    return bars_by_source(df, "setting", None, "activation bytes per layer, one rank", 170,
                          title, subtitle)


def tp_link_times(rows: list[dict], compute_s: float | None = None,
                  title: str = "Tensor-parallel comm time per step, by link",
                  subtitle: str | list[str] = "") -> alt.LayerChart:
    """Horizontal bars: seconds the tp traffic of one step takes on each link. `rows`:
    {link, seconds, source ('predicted' = bytes / link bandwidth, 'measured' = this machine)}.
    `compute_s`, if given: a dashed rule at the step's compute time, to compare against."""
    df = pd.DataFrame(rows, columns=["link", "seconds", "source"])
    top = max(df["seconds"].max() if len(df) else 0, compute_s or 0)
    div, unit = time_unit(top)
    df["value"] = df["seconds"] / div
    df["label"] = df["value"].map(lambda v: f"{v:.3g} {unit}")
    links = list(dict.fromkeys(df["link"]))
    y = alt.Y("link:N", title=None, sort=links, axis=alt.Axis(labelLimit=280, labelFontSize=12))
    x = alt.X("value:Q", title=f"time per step ({unit})",
              scale=alt.Scale(domain=[0, 1.25 * top / div or 1]))
    base = alt.Chart(df).encode(y=y, x=x, tooltip=["link:N", "source:N", alt.Tooltip(
        "seconds:Q", format=".3g", title="seconds")])
    sources = [x for x in ("predicted", "measured") if x in set(df["source"])]
    palette = {"predicted": "#4c78a8", "measured": "#bab0ac"}
    layers = [base.mark_bar(height=18).encode(color=alt.Color(
                  "source:N", title=None,
                  legend=alt.Legend(orient="bottom") if len(sources) > 1 else None,
                  scale=alt.Scale(domain=sources, range=[palette[x] for x in sources]))),
              base.mark_text(align="left", dx=4, fontSize=11).encode(text="label:N")]
    if compute_s:
        rule = pd.DataFrame({"value": [compute_s / div],
                             "label": [f"compute {compute_s / div:.3g} {unit}"]})
        layers.append(alt.Chart(rule).mark_rule(color="#e45756", strokeDash=[6, 4], strokeWidth=2)
                      .encode(x="value:Q", tooltip=["label:N"]))
        layers.append(alt.Chart(rule).mark_text(color="#e45756", align="left", dx=4, dy=-6,
                                                baseline="bottom").encode(
            x="value:Q", y=alt.value(0), text="label:N"))
    return alt.layer(*layers).properties(
        autosize=PAD, width=460, height=30 * len(links),
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))
