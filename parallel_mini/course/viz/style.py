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

import sys

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


def spec_of(chart: alt.TopLevelMixin) -> dict:
    """The chart's Vega-Lite spec, every data row inlined. Altair's check of the spec against the
    Vega-Lite schema (jsonschema) is done where pytest is loaded (every test that draws a chart
    still checks it) and skipped in the app and the lessons: it was a third of a warm press's
    server time on the Long sequences page (0.25 of 0.72 s) and finds nothing a test would not."""
    with alt.data_transformers.enable("default", max_rows=None):
        return chart.to_dict(validate="pytest" in sys.modules)


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
    if "facet" in spec and isinstance(spec.get("spec"), dict):  # panels side by side
        facet = spec["facet"] if isinstance(spec["facet"], dict) else {}
        column = facet.get("column") or (facet if "field" in facet else None)
        sort = (column or facet.get("row") or {}).get("sort")
        n = len(sort) if column and isinstance(sort, list) else 1  # a facet by row: one wide
        if "columns" in spec:  # wrapped into rows of `columns` panels
            n = min(n, spec["columns"])
        # a panel is at least as wide as its header's label
        header = (column or facet.get("row") or {}).get("header") or {}
        size = header.get("labelFontSize") or _font(spec, "header", "labelFontSize", 10)
        label = max((len(str(v)) for v in sort), default=0) if isinstance(sort, list) else 0
        inner = max(_plot_width(spec["spec"]), _CHAR_PX * size * label)
        return n * inner + (n - 1) * (spec.get("spacing") or 20)
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
    spec = chart if isinstance(chart, dict) else spec_of(chart)

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


# ---------------------------------------------------------------------------------------------
# fitting a chart to the column it is drawn in
# ---------------------------------------------------------------------------------------------
_CHAR_PX = 0.56  # a text's width per character, in units of its font size (Vega's sans-serif)
_MIN_PANEL_PX = 200  # side-by-side panels narrower than this are stacked instead
_COMPOUND_SLACK_PX = 160


def _font(spec: dict, part: str, key: str, default: float) -> float:
    return spec.get("config", {}).get(part, {}).get(key, default)


def _wrap(text: str, chars: int) -> list[str]:
    """Words of `text` in lines of at most `chars` characters (a word longer than that alone)."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > chars:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def _wrap_titles(spec: dict, width_px: float) -> None:
    """Chart titles and subtitles longer than width_px, wrapped onto more lines (Vega draws a
    title on one line whatever its length)."""
    sizes = {"text": _font(spec, "title", "fontSize", 13),
             "subtitle": _font(spec, "title", "subtitleFontSize", 10)}

    def wrap(node: dict) -> None:
        title = node.get("title")
        if isinstance(title, str) and ("mark" in node or "layer" in node or "hconcat" in node
                                       or "vconcat" in node or "facet" in node):
            title = node["title"] = {"text": title}
        if not isinstance(title, dict) or "text" not in title:
            return
        for key, size in sizes.items():
            value = title.get(key)
            if value is None or isinstance(value, dict):
                continue
            size = title.get("fontSize" if key == "text" else "subtitleFontSize", size)
            chars = max(12, int(width_px / (_CHAR_PX * size)))
            lines = [value] if isinstance(value, str) else list(value)
            wrapped = [part for line in lines for part in _wrap(line, chars)]
            if key == "text" and isinstance(value, str) and len(wrapped) > 1:
                # the title keeps its first line (a string, as it was); the rest of it opens the
                # subtitle, wrapped there in turn; the whole title stays in the spec's usermeta
                if node is spec:
                    spec.setdefault("usermeta", {})["title"] = value
                title["text"] = wrapped[0]
                sub = title.get("subtitle") or []
                title["subtitle"] = [" ".join(wrapped[1:])] + (
                    [sub] if isinstance(sub, str) else list(sub))
                continue
            title[key] = wrapped[0] if len(wrapped) == 1 else wrapped

    _walk(spec, wrap)


def _panels(spec: dict) -> list | None:
    return spec.get("hconcat") or spec.get("concat")


def fit_width(chart: alt.TopLevelMixin | dict, width_px: int) -> tuple[dict, bool]:
    """The chart's spec made to fit `width_px` (the column it is drawn in), and whether it should
    be drawn at its container's width (Streamlit's width="stretch").

    A single or layered view takes its container's width (`width: "container"`, autosize fit-x:
    axes, legend and plot together fit the column, whatever the screen). Side-by-side panels
    (hconcat) whose estimated width passes width_px are narrowed to fit, or stacked (vconcat) when
    that would leave a panel under _MIN_PANEL_PX; the widths of any part wider than width_px are
    scaled down. Titles and subtitles longer than width_px are wrapped."""
    spec = chart if isinstance(chart, dict) else spec_of(chart)
    _wrap_titles(spec, width_px - 10)
    compound = any(k in spec for k in ("hconcat", "vconcat", "concat", "facet", "repeat"))
    if not compound:
        def no_width(node: dict) -> None:
            if node is not spec and "width" in node and ("mark" in node or "layer" in node):
                del node["width"]
        _walk(spec, no_width)
        spec["width"] = "container"
        spec["autosize"] = {"type": "fit-x", "contains": "padding"}
        return spec, True
    width_px -= _COMPOUND_SLACK_PX  # estimated widths: a margin for what the estimate misses
    panels = _panels(spec)
    if panels and len(panels) > 1:
        overhead = PANEL_OVERHEAD_PX * len(panels)
        widths = sum(_plot_width(p) for p in panels)
        if widths + overhead > width_px:
            factor = (width_px - overhead) / max(widths, 1)
            if min(_plot_width(p) for p in panels) * factor < _MIN_PANEL_PX:
                spec["vconcat"] = panels  # stacked: each panel gets the whole width
                spec.pop("hconcat", None)
                spec.pop("concat", None)
            else:
                for p in panels:
                    _scale_widths(p, factor)
    for part in spec.get("vconcat") or [spec]:
        need = _plot_width(part) + PANEL_OVERHEAD_PX
        if need > width_px:
            _scale_widths(part, (width_px - PANEL_OVERHEAD_PX) / max(_plot_width(part), 1))
    return spec, False


def _scale_widths(spec: dict, factor: float) -> None:
    def scale(node: dict) -> None:
        if isinstance(node.get("width"), (int, float)):
            node["width"] = max(40, round(node["width"] * factor))
        elif isinstance(node.get("width"), dict) and "step" in node["width"]:
            node["width"] = {"step": max(4, node["width"]["step"] * factor)}
    _walk(spec, scale)
