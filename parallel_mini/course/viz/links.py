"""This machine's links (lesson 01's "This machine's links", the Links page): the time of each
collective against its message size as the ranks measured it, the α–β model fitted to it, and one
all-reduce on this machine beside the source material's links.

    links_frame(result, fit)            one row per op and size: measured median (min and max of the
                                        repeats) and the fitted α–β time at that size
    links_chart(result, fit, ops)       time vs message size, log-log: measured dots, fitted lines
    link_comparison_frame(fit, nbytes, world)
                                        one all-reduce of nbytes over world ranks: this machine
                                        (fitted α–β) and each link of the source material's table
                                        (vendor bandwidth, assumed latency: theory), in seconds
    link_comparison(fit, nbytes, world) the same as bars (log scale), each labelled with its time

`result` is a `course.links.measure_links` dict, `fit` its `course.links.fit_alpha_beta`. The
fitted line and every prediction come from `course.links.predict` (the ring's hop counts), the
other links from `course.links.interconnects`: nothing here measures or launches ranks.
"""
from __future__ import annotations

import math

import altair as alt
import pandas as pd

from .units import PAD

OP_LABELS = {"p2p": "point-to-point", "all_reduce": "all-reduce", "all_gather": "all-gather",
             "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all"}
OP_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"]
THIS_MACHINE = "this machine"
MEASURED, VENDOR = "measured here, fitted α–β", "vendor bandwidth, assumed latency (theory)"
SOURCE_COLORS = {MEASURED: "#4c78a8", VENDOR: "#bab0ac"}

# axis labels in readable units on a log scale (Vega's own ticks would read "1e-5")
_BYTES_LABEL = ("datum.value >= 1073741824 ? format(datum.value / 1073741824, '~g') + ' GiB' : "
                "datum.value >= 1048576 ? format(datum.value / 1048576, '~g') + ' MiB' : "
                "datum.value >= 1024 ? format(datum.value / 1024, '~g') + ' KiB' : "
                "format(datum.value, '~g') + ' B'")
_TIME_LABEL = ("datum.value >= 1 ? format(datum.value, '~g') + ' s' : "
               "datum.value >= 0.001 ? format(datum.value * 1000, '~g') + ' ms' : "
               "datum.value >= 0.000001 ? format(datum.value * 1e6, '~g') + ' µs' : "
               "datum.value >= 1e-9 ? format(datum.value * 1e9, '~g') + ' ns' : "
               "format(datum.value * 1e12, '~g') + ' ps'")


def fmt_seconds(s: float) -> str:
    """A duration in the unit that keeps it readable (3 significant digits): ns, µs, ms or s."""
    for div, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if s >= div:
            return f"{s / div:.3g} {unit}"
    return f"{s * 1e9:.3g} ns" if s >= 1e-9 else f"{s * 1e12:.3g} ps"


def fmt_size(nbytes: float) -> str:
    """A message size in binary units ("4 KiB", "64 MiB", "12 B")."""
    for div, unit in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if nbytes >= div:
            return f"{nbytes / div:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _decades(lo: float, hi: float, most: int = 6) -> list[float]:
    """Tick values for a log time axis: powers of ten from below lo to above hi, every one or, on
    a wide range, every 2nd or 3rd: at most `most` + 1 labels, so that a narrow column holds them."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    step = max(1, math.ceil((last - first) / most))
    return [10.0 ** k for k in range(first, last + 1, step)]


def _share(fraction: float) -> str:
    return "under 1 %" if 0 < fraction < 0.01 else f"{fraction:.0%}".replace("%", " %")


def _predict(op: str, nbytes: float, world: int, alpha_s: float, bandwidth: float) -> float:
    from .. import links  # the α–β model with the ring's hop counts (pure arithmetic)
    return links.predict(op, nbytes, world, alpha_s, bandwidth)


def _ops(result: dict, fit: dict, ops=None) -> list[str]:
    measured = list(dict.fromkeys(row["op"] for row in result["rows"]))
    return [op for op in (ops or measured) if op in measured and op in fit]


def links_frame(result: dict, fit: dict, ops=None) -> pd.DataFrame:
    """One row per measured (op, size): the median over the repeats (each repeat: the slowest
    rank), the fastest and slowest repeat, and the fitted α–β time at the same size."""
    world, keep = result["world"], set(_ops(result, fit, ops))
    rows = []
    for row in result["rows"]:
        if row["op"] not in keep:
            continue
        f = fit[row["op"]]
        rows.append({"op": OP_LABELS.get(row["op"], row["op"]), "bytes": row["bytes"],
                     "measured_s": row["median_s"], "min_s": min(row["seconds"]),
                     "max_s": max(row["seconds"]), "repeats": len(row["seconds"]),
                     "fitted_s": _predict(row["op"], row["bytes"], world, f["alpha_s"],
                                          f["bandwidth_Bps"])})
    return pd.DataFrame(rows)


def fmt_bandwidth(bps: float) -> str:
    """A fitted bandwidth in GB/s; a fit with no bandwidth term (β = 0) says so."""
    return f"{bps / 1e9:.3g} GB/s" if math.isfinite(bps) else "∞ (no bandwidth term fitted)"


def _fit_label(op: str, f: dict) -> str:
    return (f"{OP_LABELS.get(op, op)}: α = {fmt_seconds(f['alpha_s'])}, "
            f"B = {fmt_bandwidth(f['bandwidth_Bps'])}")


def links_chart(result: dict, fit: dict, ops=None, width: int = 520,
                height: int = 300) -> alt.LayerChart:
    """Time of one call against the message size, log-log, one colour per op: dots measured
    (median of the repeats, a bar from the fastest to the slowest repeat), lines fitted
    (t = hops · α + bytes on the wire / B, from course.links.predict with the fitted α and B)."""
    ops = _ops(result, fit, ops)
    world = result["world"]
    df = links_frame(result, fit, ops)
    lo, hi = float(df["bytes"].min()), float(df["bytes"].max())
    points = 40  # the fitted line: log-spaced sizes between the smallest and the largest measured
    line = pd.DataFrame([
        {"op": OP_LABELS.get(op, op), "bytes": size, "fitted_s": _predict(
            op, size, world, fit[op]["alpha_s"], fit[op]["bandwidth_Bps"]),
         "fit": _fit_label(op, fit[op])}
        for op in ops
        for size in (lo * (hi / lo) ** (i / (points - 1)) if hi > lo else lo
                     for i in range(points))])
    df["source"], line["source"] = "measured", "fitted α–β"
    labels = [OP_LABELS.get(op, op) for op in ops]
    color = alt.Color("op:N", title="operation", sort=labels, scale=alt.Scale(
        domain=labels, range=OP_COLORS[:len(labels)]), legend=alt.Legend(labelLimit=300))
    ticks = [2 ** k for k in range(0, 41, 5) if lo / 2 <= 2 ** k <= hi * 2] or None
    x = alt.X("bytes:Q", title="message size S (log scale)",
              scale=alt.Scale(type="log", base=2, nice=False),
              axis=alt.Axis(values=ticks, labelExpr=_BYTES_LABEL, labelFlush=False))
    y_title = "time of one call (log scale)"
    kind = alt.Shape("source:N", title="", scale=alt.Scale(domain=["measured"],
                                                           range=["circle"]))
    dash = alt.StrokeDash("source:N", title=" ", scale=alt.Scale(domain=["fitted α–β"],
                                                                 range=[[6, 3]]))
    spread = alt.Chart(df).mark_rule(opacity=0.6).encode(
        x=x, y=alt.Y("min_s:Q", title=y_title, scale=alt.Scale(type="log"),
                     axis=alt.Axis(labelExpr=_TIME_LABEL, values=_decades(
                         min(df["min_s"].min(), line["fitted_s"].min()),
                         max(df["max_s"].max(), line["fitted_s"].max())))),
        y2="max_s:Q", color=color)
    dots = alt.Chart(df).mark_point(filled=True, size=60, opacity=1).encode(
        x=x, y=alt.Y("measured_s:Q", title=y_title, scale=alt.Scale(type="log")),
        color=color, shape=kind,
        tooltip=["op:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes"),
                 alt.Tooltip("measured_s:Q", format=".3e", title="measured median (s)"),
                 alt.Tooltip("min_s:Q", format=".3e", title="fastest repeat (s)"),
                 alt.Tooltip("max_s:Q", format=".3e", title="slowest repeat (s)"),
                 alt.Tooltip("fitted_s:Q", format=".3e", title="fitted α–β (s)")])
    fitted = alt.Chart(line).mark_line(strokeWidth=2).encode(
        x=x, y=alt.Y("fitted_s:Q", title=y_title, scale=alt.Scale(type="log")),
        color=color, strokeDash=dash, detail="op:N",
        tooltip=["op:N", alt.Tooltip("fit:N", title="fitted")])
    repeats = int(df["repeats"].max())
    return alt.layer(spread, fitted, dots).resolve_scale(shape="independent").properties(
        autosize=PAD, width=width, height=height, title=alt.TitleParams(
            f"This machine's links: {world} ranks, {len(ops)} "
            f"{'operation' if len(ops) == 1 else 'operations'}, measured and fitted",
            subtitle=[f"dots: measured (median of {repeats} runs, each the slowest rank; bar: "
                      f"fastest to slowest run)",
                      "dashed: fitted α–β, t = hops·α + bytes sent / B"],
            anchor="start"))


def link_comparison_frame(fit: dict, nbytes: float, world: int,
                          op: str = "all_reduce") -> pd.DataFrame:
    """One `op` of `nbytes` over `world` ranks: on this machine (that op's fitted α and B) and on
    each link of the source material's table (course.links.interconnects: its bandwidth, and a
    latency per hop that is assumed), the α–β time (theory), its latency share, and its ratio to
    this machine's."""
    from .. import links

    rows = links.interconnects(op, nbytes, world, fit=fit[op])
    rows = rows[-1:] + rows[:-1]  # this machine first
    df = pd.DataFrame(rows)
    df["link"] = [f"{THIS_MACHINE} (gloo, {world} ranks)" if r["stated"] == "fitted" else r["link"]
                  for r in rows]
    df["kind"] = [MEASURED if r["stated"] == "fitted" else VENDOR for r in rows]
    df["latency_share"] = [_predict(op, nbytes, world, r["latency_s"], math.inf) / r["seconds"]
                           for r in rows]
    df["vs_this_machine"] = df["seconds"] / df["seconds"].iloc[0]
    return df


def link_comparison(fit: dict, nbytes: float, world: int, op: str = "all_reduce",
                    width: int = 420) -> alt.LayerChart:
    """link_comparison_frame as bars on a log scale (the links differ by orders of magnitude),
    each labelled with its time: inside a bar that reaches far right, beside a shorter one."""
    df = link_comparison_frame(fit, nbytes, world, op)
    df["label"] = [fmt_seconds(s) for s in df["seconds"]]
    df["gbps"] = [b / 1e9 if math.isfinite(b) else None for b in df["bandwidth_Bps"]]
    df = df.drop(columns="bandwidth_Bps")  # JSON has no infinity (a fit with β = 0)
    order = list(df["link"])
    positive = df["seconds"][df["seconds"] > 0]  # a log axis: a zero time has no bar
    lo, hi = math.log10(positive.min()), math.log10(positive.max())
    domain = [10.0 ** math.floor(lo), 10.0 ** math.ceil(hi + 0.3)]
    reach = (df["seconds"].clip(lower=domain[0]).map(math.log10) - math.log10(domain[0])) / (
        math.log10(domain[1] / domain[0]))
    df["inside"] = reach > 0.7  # beside a bar that short, a label has 30 % of the plot's width
    base = alt.Chart(df).encode(
        y=alt.Y("link:N", title=None, sort=order, axis=alt.Axis(labelLimit=260)),
        x=alt.X("seconds:Q", title=f"time of one {OP_LABELS.get(op, op)} (log scale)",
                scale=alt.Scale(type="log", domain=domain),
                axis=alt.Axis(labelExpr=_TIME_LABEL, values=_decades(*domain))),
        tooltip=["link:N", "source:N", alt.Tooltip("stated:N", title="as stated"),
                 alt.Tooltip("gbps:Q", format=".3g", title="bandwidth B (GB/s, one direction)"),
                 alt.Tooltip("latency_s:Q", format=".3e", title="α per hop (s)"),
                 alt.Tooltip("seconds:Q", format=".3e", title="time (s)"),
                 alt.Tooltip("vs_this_machine:Q", format=".3g", title="× this machine")])
    bars = base.mark_bar().encode(x2=alt.datum(domain[0]), color=alt.Color(
        "kind:N", title=None, sort=list(SOURCE_COLORS),
        scale=alt.Scale(domain=list(SOURCE_COLORS), range=list(SOURCE_COLORS.values())),
        legend=alt.Legend(orient="bottom", labelLimit=400)))
    beside = base.mark_text(align="left", dx=4).encode(text="label:N").transform_filter(
        ~alt.datum.inside)
    inside = base.mark_text(align="right", dx=-4, color="white").encode(
        text="label:N").transform_filter(alt.datum.inside)
    share = df["latency_share"].iloc[0]
    lat = df["latency_s"].iloc[1:]
    assumed = (fmt_seconds(lat.min()) if lat.min() == lat.max() else
               f"{fmt_seconds(lat.min())} to {fmt_seconds(lat.max())}")
    return alt.layer(bars, beside, inside).properties(
        autosize=PAD, width=width, height=28 * len(df), title=alt.TitleParams(
            f"One {OP_LABELS.get(op, op)} of {fmt_size(nbytes)} on {world} ranks",
            subtitle=[f"this machine: its fitted α and B ({_share(share)} of the time is "
                      f"latency, hops·α)",
                      f"the source material's links: their bandwidth (one direction) and an "
                      f"assumed latency per hop ({assumed}; not measured, not quoted)"],
            anchor="start"))
