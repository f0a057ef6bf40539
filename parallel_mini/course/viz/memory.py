"""Memory per GPU (lesson 03, the Memory page), from rows of plain dicts:

    memory_stages(rows, capacity_bytes)   bytes per GPU by category for ZeRO 0-3 side by side,
                                          against the GPU's capacity (theory)
    memory_measured_vs_theory(rows)       per ZeRO stage: measured bars beside predicted ones
    activation_bars(rows)                 activation bytes per layer by checkpointing mode
"""
from __future__ import annotations

import altair as alt
import pandas as pd

from .units import PAD, bars_by_source, bytes_unit, decimal_bytes_unit

STAGE_CATEGORIES = ["params", "grads", "optimizer", "transient", "activations"]
STAGE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"]
HOST_COLOR = "#9d755d"
DISK_COLOR = "#6b6b6b"
# off the GPU: category -> (where, colour, the words above its bar)
OFF_GPU = {"host": ("host (CPU RAM)", HOST_COLOR, "in CPU RAM"),
           "disk": ("disk", DISK_COLOR, "on disk")}


def _color(category: str) -> str:
    return dict(zip(STAGE_CATEGORIES, STAGE_COLORS)).get(category) or OFF_GPU[category][1]


def _stage_unit(max_bytes: float, decimal: bool) -> tuple[float, str]:
    return decimal_bytes_unit(max_bytes) if decimal else bytes_unit(max_bytes)


def memory_stages_frame(rows: list[dict], capacity_bytes: float | None = None) -> pd.DataFrame:
    """`rows`: {stage, category, bytes} per GPU (category `host` = offloaded to CPU RAM, `disk` =
    to a file on disk, not on the GPU). Adds `where` (GPU / host / disk) and, per stage, the GPU
    total and whether it fits."""
    df = pd.DataFrame(rows, columns=["stage", "category", "bytes"])
    df["where"] = df["category"].map(lambda c: OFF_GPU[c][0] if c in OFF_GPU else "GPU")
    gpu_total = df[df["where"] == "GPU"].groupby("stage")["bytes"].sum()
    df["gpu_total"] = df["stage"].map(gpu_total).fillna(0.0)
    if capacity_bytes:
        df["fits"] = df["gpu_total"] <= capacity_bytes
    return df


def memory_stages(rows: list[dict], capacity_bytes: float | None = None,
                  selected: str | None = None, decimal: bool = True,
                  title: str = "Memory per GPU by ZeRO stage",
                  subtitle: str | list[str] = "") -> alt.LayerChart:
    """Stacked bars per ZeRO stage of the bytes one GPU holds (params, grads, optimizer states,
    activations), ZeRO-Offload's host bytes (brown) or --offload-disk's bytes on disk (grey) as a
    separate bar beside the GPU bar, and a red
    rule at the GPU's capacity with "fits" / "does not fit" above each GPU bar. `decimal`: GB/MB
    (the capacity's units) or, for toy models, binary MiB/KiB. `selected` stage drawn opaque."""
    df = memory_stages_frame(rows, capacity_bytes)
    stages = list(dict.fromkeys(df["stage"]))
    top_bytes = max(df.groupby(["stage", "where"])["bytes"].sum().max(), capacity_bytes or 0)
    div, unit = _stage_unit(top_bytes, decimal)
    df["value"] = df["bytes"] / div
    off = [c for c in OFF_GPU if df.loc[df["category"] == c, "bytes"].sum() > 0]
    has_host = bool(off)  # (host or disk: a second bar)
    df = df[(df["where"] == "GPU") | df["category"].isin(off)]
    cats = [c for c in STAGE_CATEGORIES if c in set(df["category"])] + off
    colors = [_color(c) for c in cats]
    x = alt.X("stage:N", title=None, sort=stages, axis=alt.Axis(labelAngle=0, labelFontSize=12))
    offset = ({"xOffset": alt.XOffset("where:N", sort=["GPU"] + [OFF_GPU[c][0] for c in off])}
              if has_host else {})
    opacity = (alt.condition(alt.datum.stage == selected, alt.value(1.0), alt.value(0.45))
               if selected else alt.value(1.0))
    bars = alt.Chart(df).mark_bar().encode(
        x=x, **offset,
        y=alt.Y("value:Q", title=f"memory per GPU ({unit})", stack="zero",
                scale=alt.Scale(domain=[0, 1.15 * top_bytes / div])),
        color=alt.Color("category:N", title="category", sort=cats,
                        scale=alt.Scale(domain=cats, range=colors)),
        order=alt.Order("cat_index:Q"), opacity=opacity,
        tooltip=["stage:N", "where:N", "category:N",
                 alt.Tooltip("value:Q", format=",.4g", title=unit),
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes")],
    ).transform_calculate(cat_index=f"indexof({cats}, datum.category)")
    totals = (df[df["where"] == "GPU"].drop_duplicates("stage")
              [["stage", "gpu_total"] + (["fits"] if capacity_bytes else [])].copy())
    totals["value"] = totals["gpu_total"] / div
    totals["label"] = totals["value"].map(lambda v: f"{v:.4g} {unit}")
    if capacity_bytes:
        totals["label"] += totals["fits"].map(lambda f: " · fits" if f else " · does not fit")
    totals["where"] = "GPU"
    labels = alt.Chart(totals).mark_text(dy=-8, fontSize=11, fontWeight="bold").encode(
        x=x, **offset, y="value:Q", text="label:N",
        color=(alt.condition(alt.datum.fits, alt.value("#2e7d32"), alt.value("#c62828"))
               if capacity_bytes else alt.value("black")))
    layers = [bars, labels]
    for c in off:  # the offloaded bytes live in CPU RAM or on disk: say so above their bar
        host = df[df["category"] == c].groupby(["stage", "where"], as_index=False)["value"].sum()
        host["label"] = host["value"].map(lambda v: f"{v:.4g} {unit} {OFF_GPU[c][2]}")
        layers.append(alt.Chart(host[host["value"] > 0]).mark_text(dy=-8, fontSize=10).encode(
            x=x, **offset, y="value:Q", text="label:N", color=alt.value(OFF_GPU[c][1])))
    if capacity_bytes:
        cap = pd.DataFrame({"value": [capacity_bytes / div],
                            "label": [f"GPU capacity {capacity_bytes / div:.4g} {unit}"]})
        # named in its own legend entry: a label on the plot would collide with some bar's label
        layers.append(alt.Chart(cap).mark_rule(strokeDash=[6, 4], strokeWidth=2).encode(
            y="value:Q", tooltip=["label:N"],
            stroke=alt.Stroke("label:N", title=None,
                              scale=alt.Scale(domain=list(cap["label"]), range=["#c62828"]))))
    return alt.layer(*layers).properties(
        autosize=PAD, width=150 * len(stages), height=300,
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def memory_measured_vs_theory_frame(rows: list[dict]) -> pd.DataFrame:
    """`rows`: {stage, category, source ('measured' | 'predicted'), bytes}. Adds, per stage and
    category, `difference` = measured - predicted (None where one side has no value)."""
    df = pd.DataFrame(rows, columns=["stage", "category", "source", "bytes"])
    wide = df.pivot_table(index=["stage", "category"], columns="source", values="bytes",
                          aggfunc="sum")
    diff = (wide.get("measured") - wide.get("predicted")) if {"measured", "predicted"} <= set(
        wide.columns) else None
    if diff is not None:
        df["difference"] = [diff.get((s, c)) for s, c in zip(df["stage"], df["category"])]
    return df


def memory_measured_vs_theory(rows: list[dict], peaks: list[dict] | None = None,
                              title: str = "Memory per GPU: measured (live run) vs predicted",
                              subtitle: str | list[str] = "") -> alt.LayerChart:
    """Per ZeRO stage, two stacked bars: what rank 0's meters measured by category (params, grads,
    optimizer, transient comm buffers, peak saved activations; host bytes under ZeRO-Offload, disk
    bytes under --offload-disk) and
    what theory predicts (model states: `theory.model_state_bytes`; activations: Korthikanti's
    estimate). `peaks`: {stage, bytes} of the measured peak of all live bytes, drawn as a tick on
    the measured bar. Units: binary (MiB/KiB), the toy's scale."""
    df = memory_measured_vs_theory_frame(rows)
    stages = list(dict.fromkeys(df["stage"]))
    peaks_df = pd.DataFrame(peaks or [], columns=["stage", "bytes"])
    top = max(df.groupby(["stage", "source"])["bytes"].sum().max(),
              peaks_df["bytes"].max() if len(peaks_df) else 0)
    div, unit = bytes_unit(top)
    df["value"] = df["bytes"] / div
    cats = ([c for c in STAGE_CATEGORIES if c in set(df["category"])]
            + [c for c in OFF_GPU if c in set(df["category"])])
    colors = [_color(c) for c in cats]
    # stage names sit below the "measured / predicted" captions drawn under each pair of bars
    x = alt.X("stage:N", title=None, sort=stages,
              axis=alt.Axis(labelAngle=0, labelFontSize=12, labelPadding=20, ticks=False))
    xoff = alt.XOffset("source:N", sort=["measured", "predicted"])
    tooltip = ["stage:N", "source:N", "category:N",
               alt.Tooltip("bytes:Q", format=",.0f", title="bytes")]
    if "difference" in df:
        tooltip.append(alt.Tooltip("difference:Q", format="+,.0f", title="measured − predicted"))
    bars = alt.Chart(df).mark_bar(stroke="white", strokeWidth=0.5).encode(
        x=x, xOffset=xoff,
        y=alt.Y("value:Q", title=f"memory per GPU ({unit})", stack="zero"),
        color=alt.Color("category:N", title="category", sort=cats,
                        scale=alt.Scale(domain=cats, range=colors)),
        opacity=alt.Opacity("source:N", title="bar", sort=["measured", "predicted"],
                            scale=alt.Scale(domain=["measured", "predicted"], range=[1.0, 0.5])),
        order=alt.Order("cat_index:Q"), tooltip=tooltip,
    ).transform_calculate(cat_index=f"indexof({cats}, datum.category)")
    which = df.drop_duplicates(["stage", "source"])[["stage", "source"]].copy()
    which["value"] = 0.0
    which["label"] = which["source"].map({"measured": "measured", "predicted": "predicted"})
    names = alt.Chart(which).mark_text(baseline="top", dy=4, fontSize=10, color="#555").encode(
        x=x, xOffset=xoff, y="value:Q", text="label:N")
    layers = [bars, names]
    if len(peaks_df):
        peaks_df = peaks_df.assign(value=peaks_df["bytes"] / div, source="measured")
        layers.append(alt.Chart(peaks_df).mark_tick(color="black", thickness=3, size=40).encode(
            x=x, xOffset=xoff, y="value:Q",
            tooltip=["stage:N", alt.Tooltip("bytes:Q", format=",.0f",
                                            title="measured peak of all live bytes")]))
    return alt.layer(*layers).properties(
        autosize=PAD, width=170 * len(stages), height=300,
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def activation_bars(rows: list[dict], title: str = "Activation bytes per transformer layer",
                    subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per checkpointing mode (none, selective, full): the measured bytes one layer
    keeps for backward (difference of two live runs with L and L+1 layers) beside this library's
    exact count (`theory.gpt_activation_bytes_per_layer`) and Korthikanti et al.'s estimate
    (`theory.activation_bytes_per_layer`). `rows`: {mode, source, bytes}, source one of
    ACTIVATION_SOURCES."""
    df = pd.DataFrame(rows, columns=["mode", "source", "bytes"])
    return bars_by_source(df, "mode", "activation checkpointing", "bytes kept per layer", 130,
                          title, subtitle)


DISK_SOURCES = ["theory", "counted", "measured: rchar/wchar", "measured: read_bytes/write_bytes"]
DISK_SOURCE_COLORS = ["#bab0ac", "#4c78a8", "#f58518", "#e45756"]


def disk_io_rows(report: dict, rank: int = 0, step: int | None = None) -> list[dict]:
    """Rows for `disk_io_bars` from a run report (dict) made with --offload-disk: one rank's bytes
    read and written in one step (default the last) by theory (`disk_io_per_step`), as counted by
    the transfers, and as the thread's /proc I/O counters measured them."""
    th = report["theory"]
    io = th.get("disk_io_per_step") or th["stages"][0]["disk_io_per_step"]
    recs = [r for r in report["ranks"][rank]["disk"]["io"] if isinstance(r["step"], int)]
    rec = recs[-1] if step is None else next(r for r in recs if r["step"] == step)
    rows = []
    for direction, sys_key, dev_key in (("read", "rchar", "read_bytes"),
                                        ("written", "wchar", "write_bytes")):
        rows += [{"direction": direction, "source": "theory", "bytes": io[direction]},
                 {"direction": direction, "source": "counted", "bytes": rec[direction]}]
        if rec["measured"]:
            rows += [{"direction": direction, "source": "measured: rchar/wchar",
                      "bytes": rec["measured"][sys_key]},
                     {"direction": direction, "source": "measured: read_bytes/write_bytes",
                      "bytes": rec["measured"][dev_key]}]
    return rows


def disk_io_bars(rows: list[dict], title: str = "Bytes to and from disk in one step",
                 subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars, read and written: theory's formula, the transfers' own count, and the
    thread's I/O counters (rchar/wchar: bytes through read/write calls; read_bytes/write_bytes:
    what the storage layer moved, in pages). `rows`: {direction, source, bytes}."""
    df = pd.DataFrame(rows, columns=["direction", "source", "bytes"])
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    sources = [s for s in DISK_SOURCES if s in set(df["source"])]
    colors = [dict(zip(DISK_SOURCES, DISK_SOURCE_COLORS))[s] for s in sources]
    base = alt.Chart(df).encode(
        x=alt.X("direction:N", title=None, sort=["read", "written"],
                axis=alt.Axis(labelAngle=0, labelFontSize=12)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("value:Q", title=f"bytes per step ({unit})"),
        tooltip=["direction:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources,
                                               scale=alt.Scale(domain=sources, range=colors),
                                               legend=alt.Legend(orient="bottom", columns=2))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=360, height=260,
                 title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))
