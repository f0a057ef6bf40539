"""Presentation style: any chart of this package made readable on a projector.

`presentation(chart)` returns the chart's Vega-Lite spec (a dict) with every text at least
`min_font_px` (axis labels and titles, legends, chart titles and subtitles, text marks, also where
a chart builder set a smaller size explicitly: an explicit size wins over Vega-Lite's `config`, so
the spec is walked) and, when `width_px` is given, every width scaled by one factor so that the
plot areas fill about `width_px` (a layered chart, side-by-side panels and stacked rows alike;
heights are kept, so the chart stays on one screen). Proportions between sizes are kept: a title
stays larger than its axis labels.

One hook for every chart (lessons and app): `st.vega_lite_chart(presentation(chart))`, or
`alt.Chart.from_dict(presentation(chart))` where an Altair object is needed.
"""
from __future__ import annotations

import altair as alt

MIN_FONT_PX = 16
# Vega-Lite's own default sizes, where a chart does not set one (axis labels 10, titles 11,
# chart title 13, text marks 11)
_DEFAULTS = {"axis": {"labelFontSize": 10, "titleFontSize": 11},
             "legend": {"labelFontSize": 10, "titleFontSize": 11},
             "header": {"labelFontSize": 10, "titleFontSize": 11},
             "title": {"fontSize": 13, "subtitleFontSize": 10},
             "text": {"fontSize": 11}}
_FONT_KEYS = ("fontSize", "labelFontSize", "titleFontSize", "subtitleFontSize")
_COMPOSITIONS = ("hconcat", "vconcat", "concat", "layer")
PANEL_OVERHEAD_PX = 110  # axis labels and title beside each panel of a row, at presentation size


def scaled_font(size: float, min_font_px: int = MIN_FONT_PX) -> int:
    """The size a font of `size` px gets: Vega-Lite's smallest default (10 px) becomes
    `min_font_px`, larger ones grow by the same factor, so their order is kept."""
    return max(min_font_px, round(size * min_font_px / 10))


def _walk(node, fn):
    """Apply fn(dict) to every dict inside a spec (depth first); returns the node."""
    if isinstance(node, dict):
        fn(node)
        for key, value in node.items():
            if key not in ("datasets", "data", "values"):
                _walk(value, fn)
    elif isinstance(node, list):
        for item in node:
            _walk(item, fn)
    return node


def _plot_width(spec: dict) -> float:
    """The plot areas' width of one (sub)chart as drawn: a row adds its panels, a column takes its
    widest; a panel's axes and labels count PANEL_OVERHEAD_PX each."""
    if "hconcat" in spec or "concat" in spec:
        parts = spec.get("hconcat") or spec.get("concat")
        return sum(_plot_width(p) + PANEL_OVERHEAD_PX for p in parts) - PANEL_OVERHEAD_PX
    if "vconcat" in spec:
        return max(_plot_width(p) for p in spec["vconcat"])
    width = spec.get("width")
    if isinstance(width, (int, float)):
        return width
    if "layer" in spec:
        return max((_plot_width(p) for p in spec["layer"]), default=0)
    return 0


def presentation(chart: alt.TopLevelMixin | dict, min_font_px: int = MIN_FONT_PX,
                 width_px: int | None = None) -> dict:
    """The chart's spec with every text >= min_font_px and, given width_px, widths scaled to fill
    about width_px (see the module docstring)."""
    if isinstance(chart, dict):
        spec = chart
    else:
        with alt.data_transformers.enable("default", max_rows=None):
            spec = chart.to_dict()

    def bigger_fonts(node: dict) -> None:
        for key in _FONT_KEYS:
            if isinstance(node.get(key), (int, float)):
                node[key] = scaled_font(node[key], min_font_px)

    spec = _walk(spec, bigger_fonts)
    config = spec.setdefault("config", {})
    for part, sizes in _DEFAULTS.items():
        section = config.setdefault(part, {})
        for key, size in sizes.items():
            section.setdefault(key, scaled_font(size, min_font_px))
    config["axis"].setdefault("labelLimit", 400)  # bigger labels must not be cut short

    if width_px:
        factor = width_px / max(_plot_width(spec), 1)
        if factor > 1:
            def wider(node: dict) -> None:
                if isinstance(node.get("width"), (int, float)):
                    node["width"] = round(node["width"] * factor)
                elif isinstance(node.get("width"), dict) and "step" in node["width"]:
                    node["width"] = {"step": node["width"]["step"] * factor}
            spec = _walk(spec, wider)
    return spec
