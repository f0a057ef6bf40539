"""Planning a run (the Plan a run page, lesson 09): the planner's ranked layouts and a toy run.

    ranked_layouts(entries, capacity_bytes)   per ranked layout, side by side: memory per GPU
                                              (model states, activations, ZeRO-3's gathered
                                              units) against the GPU's capacity, and the predicted
                                              step time split into compute, bubble and each axis's
                                              exposed communication (theory)
    toy_memory(rows)                          per rank of a live toy run: measured memory beside
                                              the planner's prediction, by category (rows:
                                              guide.ToyVersion.memory_rows)

`entries` are planner.plan(...)["layouts"] items (their "theory" numbers are predictions). Nothing
here runs ranks.
"""
from __future__ import annotations

import altair as alt
import pandas as pd

from .units import PAD, bytes_unit, decimal_bytes_unit, time_unit

MEMORY_PARTS = ["model states", "activations", "ZeRO-3 gathered units"]
MEMORY_COLORS = ["#4c78a8", "#e45756", "#b279a2"]
AXES = ["tp", "cp", "ep", "pp", "dp"]
TIME_PARTS = ["compute", "bubble"] + [f"{a} comm (exposed)" for a in AXES]
TIME_COLORS = ["#54a24b", "#bab0ac", "#f58518", "#72b7b2", "#9d755d", "#eeca3b", "#4c78a8"]
TOY_CATEGORIES = ["params", "grads", "optimizer", "activations"]
TOY_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756"]


def layout_label(entry: dict) -> str:
    """A short name for a ranked layout: its place among every fitting layout (all variants), the
    degrees above 1 (dp always) and the ZeRO stage, e.g. "#14 dp32 tp4 pp4 z2"; the full
    description is entry["describe"]."""
    lay = entry["layout"]
    degrees = [f"dp{lay['dp']}"] + [f"{a}{lay[a]}" for a in ("tp", "pp", "cp", "ep") if lay[a] > 1]
    place = entry.get("rank_among_all_variants") or entry.get("rank")
    rank = f"#{place:,}" if place else "#?"
    return f"{rank} {' '.join(degrees)} z{lay['zero']}"


def layout_memory_frame(entries: list[dict]) -> pd.DataFrame:
    """Rows {layout, describe, part, bytes}: one GPU's memory (the pipeline rank that holds the
    most) as model states (params + grads + optimizer), activations (kept for backward, and the
    logits) and ZeRO-3's gathered units. The parts add up to the prediction's total."""
    rows = []
    for e in entries:
        m = e["theory"]["memory_bytes_per_gpu"]
        parts = {"model states": m["params"] + m["grads"] + m["optimizer"],
                 "activations": m["activations"] + m["logits"],
                 "ZeRO-3 gathered units": m["transient"]}
        for part, b in parts.items():
            rows.append({"layout": layout_label(e), "describe": e["describe"], "part": part,
                         "bytes": float(b)})
    return pd.DataFrame(rows, columns=["layout", "describe", "part", "bytes"])


def layout_time_frame(entries: list[dict]) -> pd.DataFrame:
    """Rows {layout, describe, part, seconds}: the predicted step time split into compute, the
    pipeline's bubble (none when ranks share cores: an idle rank frees its core) and each axis's
    exposed communication (the experts' data parallel counted with dp, DualPipe's exchange between
    a stage's two copies with pp). The parts add up to the
    prediction's step_s."""
    rows = []
    for e in entries:
        t = e["theory"]
        bubble = 0.0 if t["ranks_share_cores"] else t["compute_s"] * t["bubble"]
        parts = {"compute": t["compute_s"] - bubble, "bubble": bubble}
        for axis in AXES:
            parts[f"{axis} comm (exposed)"] = sum(c["exposed_s"] for a, c in t["comm"].items()
                                                  if a == axis or (axis, a) in (("dp", "edp"),
                                                                                ("pp", "pp_copies")))
        for part, s in parts.items():
            rows.append({"layout": layout_label(e), "describe": e["describe"], "part": part,
                         "seconds": float(s)})
    return pd.DataFrame(rows, columns=["layout", "describe", "part", "seconds"])


def ranked_layouts(entries: list[dict], capacity_bytes: float, usable_bytes: float | None = None,
                   highlight: str | None = None, decimal: bool = True,
                   title: str = "Ranked layouts: memory per GPU and step time (theory)",
                   subtitle: str | list[str] = "") -> alt.HConcatChart:
    """Two panels sharing one row per layout (best first): memory per GPU stacked by part with
    the GPU's capacity as a red rule (and the usable share, after the planner's reserve, dashed),
    and the predicted step time stacked by part. `highlight`: a layout label drawn opaque, the
    others faded (the decision guide's layout). `decimal`: GB (GPU capacities) or MiB (the toy)."""
    mem, tim = layout_memory_frame(entries), layout_time_frame(entries)
    order = list(dict.fromkeys(mem["layout"]))
    top = max(mem.groupby("layout")["bytes"].sum().max(), capacity_bytes)
    div, unit = (decimal_bytes_unit if decimal else bytes_unit)(top)
    mem["value"] = mem["bytes"] / div
    tdiv, tunit = time_unit(tim.groupby("layout")["seconds"].sum().max())
    tim["value"] = tim["seconds"] / tdiv
    height = max(120, 26 * len(order))
    opacity = (alt.condition(alt.datum.layout == highlight, alt.value(1.0), alt.value(0.4))
               if highlight else alt.value(1.0))
    y = alt.Y("layout:N", sort=order, title=None, axis=alt.Axis(labelLimit=260, labelFontSize=12))
    mem_bars = alt.Chart(mem).mark_bar().encode(
        y=y, x=alt.X("value:Q", title=f"memory per GPU ({unit})", stack="zero",
                     scale=alt.Scale(domain=[0, 1.05 * top / div])),
        color=alt.Color("part:N", title=None, sort=MEMORY_PARTS,
                        scale=alt.Scale(domain=MEMORY_PARTS, range=MEMORY_COLORS),
                        legend=alt.Legend(orient="bottom", direction="vertical")),
        order=alt.Order("part_index:Q"), opacity=opacity,
        tooltip=["layout:N", "describe:N", "part:N",
                 alt.Tooltip("value:Q", format=",.4g", title=unit),
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes")],
    ).transform_calculate(part_index=f"indexof({MEMORY_PARTS}, datum.part)")
    rules = [{"value": capacity_bytes / div,
              "label": f"GPU memory {capacity_bytes / div:.4g} {unit}"}]
    if usable_bytes and usable_bytes < capacity_bytes:
        rules.append({"value": usable_bytes / div,
                      "label": f"usable {usable_bytes / div:.4g} {unit} "
                               f"({1 - usable_bytes / capacity_bytes:.0%} kept free)"})
    rule_df = pd.DataFrame(rules)
    rule = alt.Chart(rule_df).mark_rule(strokeWidth=2).encode(
        x="value:Q", tooltip=["label:N"],
        stroke=alt.Stroke("label:N", title=None,
                          legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=400),
                          scale=alt.Scale(domain=list(rule_df["label"]),
                                          range=["#c62828", "#c62828"][:len(rule_df)])),
        strokeDash=alt.StrokeDash("label:N", legend=None,
                                  scale=alt.Scale(domain=list(rule_df["label"]),
                                                  range=[[1, 0], [6, 4]][:len(rule_df)])))
    left = alt.layer(mem_bars, rule).properties(width=260, height=height,
                                                title="memory per GPU (theory)")
    parts = [p for p in TIME_PARTS if tim.loc[tim["part"] == p, "seconds"].sum() > 0]
    colors = [dict(zip(TIME_PARTS, TIME_COLORS))[p] for p in parts]
    right = alt.Chart(tim[tim["part"].isin(parts)]).mark_bar().encode(
        y=alt.Y("layout:N", sort=order, title=None, axis=alt.Axis(labels=False, ticks=False)),
        x=alt.X("value:Q", title=f"predicted step time ({tunit})", stack="zero"),
        color=alt.Color("part:N", title=None, sort=parts,
                        scale=alt.Scale(domain=parts, range=colors),
                        legend=alt.Legend(orient="bottom", direction="vertical", columns=2)),
        order=alt.Order("part_index:Q"), opacity=opacity,
        tooltip=["layout:N", "describe:N", "part:N",
                 alt.Tooltip("value:Q", format=",.4g", title=tunit)],
    ).transform_calculate(part_index=f"indexof({parts}, datum.part)").properties(
        width=260, height=height, title="step time (theory)")
    return alt.hconcat(left, right, spacing=12).resolve_scale(color="independent").properties(
        autosize=PAD, title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def toy_memory(rows: list[dict], title: str = "Toy run: memory per rank, measured vs theory",
               subtitle: str | list[str] = "") -> alt.LayerChart:
    """`rows`: {rank, source ("measured" | "theory"), category (params, grads, optimizer,
    activations), bytes}, as guide.ToyVersion.memory_rows pairs a run with the planner. Per rank
    two stacked bars, measured beside the planner's prediction, in binary units (the toy's
    scale)."""
    df = pd.DataFrame(rows, columns=["rank", "source", "category", "bytes"])
    df["rank"] = df["rank"].map(lambda r: f"rank {r}")
    ranks = list(dict.fromkeys(df["rank"]))
    div, unit = bytes_unit(df.groupby(["rank", "source"])["bytes"].sum().max())
    df["value"] = df["bytes"] / div
    cats = [c for c in TOY_CATEGORIES if c in set(df["category"])]
    colors = [dict(zip(TOY_CATEGORIES, TOY_COLORS))[c] for c in cats]
    x = alt.X("rank:N", title=None, sort=ranks, axis=alt.Axis(labelAngle=0, labelFontSize=12))
    xoff = alt.XOffset("source:N", sort=["measured", "theory"])
    bars = alt.Chart(df).mark_bar(stroke="white", strokeWidth=0.5).encode(
        x=x, xOffset=xoff, y=alt.Y("value:Q", title=f"memory per rank ({unit})", stack="zero"),
        color=alt.Color("category:N", title="category", sort=cats,
                        scale=alt.Scale(domain=cats, range=colors)),
        order=alt.Order("cat_index:Q"),
        tooltip=["rank:N", "source:N", "category:N",
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes")],
    ).transform_calculate(cat_index=f"indexof({cats}, datum.category)")
    totals = df.groupby(["rank", "source"], as_index=False)["value"].sum()
    labels = alt.Chart(totals).mark_text(dy=-6, fontSize=11).encode(
        x=x, xOffset=xoff, y="value:Q", text="source:N")
    return alt.layer(bars, labels).properties(
        autosize=PAD, width=140 * len(ranks), height=260,
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))
