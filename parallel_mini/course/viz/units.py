"""What every chart shares: readable units (binary bytes, decimal bytes, bandwidth, time), the
autosize that keeps a chart the size it asks for, and the grouped bars that put a measurement
beside this library's exact count and Korthikanti et al.'s estimate (memory and tensor parallel).
"""
from __future__ import annotations

import altair as alt
import pandas as pd

# Every chart keeps the size it asks for, axes and legends added around it (Vega-Lite's default).
# Streamlit otherwise applies "fit", which squeezes charts whose content lies outside the plot.
PAD = alt.AutoSizeParams(type="pad", contains="padding")


def bytes_unit(max_bytes: float) -> tuple[float, str]:
    """(divisor, name) of the binary unit that keeps `max_bytes` readable: B, KiB, MiB, GiB or
    TiB."""
    for div, name in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if max_bytes >= div:
            return div, name
    return 1, "B"


def rate_unit(max_bytes_s: float) -> tuple[float, str]:
    """(divisor, name) for a bandwidth, decimal like NCCL's busbw: GB/s, MB/s or KB/s."""
    for div, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")):
        if max_bytes_s >= div:
            return div, name
    return 1, "B/s"


def decimal_bytes_unit(max_bytes: float) -> tuple[float, str]:
    """(divisor, name) in decimal units, as GPU capacities and the ZeRO paper's table count: PB,
    TB, GB, MB, KB."""
    for div, name in ((1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if max_bytes >= div:
            return div, name
    return 1, "B"


def format_bytes(b: float, decimal: bool = False) -> str:
    """A byte count for a sentence or a metric, in the unit the charts use (binary, or decimal as
    GPU capacities are quoted): 4 significant digits, never an exponent ("12.07 TB", not
    "1.207e+04 GB"); under 1 KB(KiB) the whole count."""
    div, unit = (decimal_bytes_unit if decimal else bytes_unit)(abs(b))
    if div == 1:
        return f"{b:,.0f} B"
    value = b / div
    return f"{value:,.0f} {unit}" if abs(value) >= 1000 else f"{value:.4g} {unit}"


def time_unit(max_seconds: float) -> tuple[float, str]:
    """(divisor, name) that keeps a duration readable: s, ms or µs."""
    for div, name in ((1.0, "s"), (1e-3, "ms")):
        if max_seconds >= div:
            return div, name
    return 1e-6, "µs"


# activation bytes come from three sources, drawn side by side by the memory and the tensor charts
ACTIVATION_SOURCES = ["measured", "ours (exact)", "Korthikanti et al."]
ACTIVATION_COLORS = ["#4c78a8", "#9ecae9", "#bab0ac"]


def bars_by_source(df: pd.DataFrame, group: str, x_title, y_title: str, width_per: int,
                   title: str, subtitle) -> alt.LayerChart:
    """Grouped bars: one group per value of `group`, one bar per ACTIVATION_SOURCES entry."""
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    groups = list(dict.fromkeys(df[group]))
    sources = [s for s in ACTIVATION_SOURCES if s in set(df["source"])]
    colors = [dict(zip(ACTIVATION_SOURCES, ACTIVATION_COLORS))[s] for s in sources]
    base = alt.Chart(df).encode(
        x=alt.X(f"{group}:N", title=x_title, sort=groups,
                axis=alt.Axis(labelAngle=0, labelFontSize=12, labelLimit=220)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("value:Q", title=f"{y_title} ({unit})"),
        tooltip=[f"{group}:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources,
                                               scale=alt.Scale(domain=sources, range=colors))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=width_per * len(groups), height=260,
                 title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))
