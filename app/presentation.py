"""What every page shares for the classroom: presentation mode, controls that keep their values
when you leave a page and come back, and the one call that draws a chart.

Presentation mode (a sidebar toggle, on every page): the navigation moves to the top bar, each
page's controls and its "Run live" button move to the sidebar, and every chart is drawn with text of at least 16 px and as wide as the page
(`parallel_mini.course.viz.style.presentation`): controls and their result on one 1440 × 900 screen.

Kept values: Streamlit forgets a widget's value when a page that does not draw it runs (a page
change). `kept(key, default)` names a page's widget; the entry script calls `keep_widget_values()`
on every run, which re-assigns those keys so that Streamlit keeps them while another page shows.
Widgets with a kept key take no `value=`/`index=`: their default is set here, once.
"""
from __future__ import annotations

import streamlit as st

MODE_KEY = "presentation_mode"
_KEPT = "_kept_widget_keys"
# the main column is about 980 px wide at 1440 px with the sidebar open (in presentation mode, 820
# with the wide sidebar): charts are built to fit it, so that they fit any wider screen too
MAIN_PX = 980
COLUMN_GAP_PX = 16  # between st.columns
# the plot width a compound chart fills in presentation mode; axes and a legend take the rest
PAGE_CHART_PX = 680
MIN_FONT_PX = 16  # presentation mode: every text on the page
NORMAL_FONT_PX = 12  # chart text outside presentation mode (Vega-Lite's defaults are 10-11 px)
SIDEBAR_PX, WIDE_SIDEBAR_PX = 300, 460
_CHART_PX = "_presentation_chart_px"  # this page's chart width (Controls sets it on every run)
_WIDE_SIDEBAR_CSS = f"""<style>
[data-testid="stSidebar"] {{ width: {WIDE_SIDEBAR_PX}px !important; min-width: {WIDE_SIDEBAR_PX}px; }}
</style>"""
# presentation mode: less blank space above the title and a smaller title, so that the first chart
# fits on the first screen under the page's controls
_CSS = """<style>
[data-testid="stMainBlockContainer"] { padding-top: 4rem; }
h1 { font-size: 2.2rem !important; padding-top: 0 !important; }
[data-testid="stSidebarUserContent"] { padding-top: 0.5rem; }
[data-testid="stSidebarUserContent"] [data-testid="stVerticalBlock"] { gap: 0.35rem; }
/* every text at least 16 px, but headings, metric values and formulas (scaled as a whole) */
:is([data-testid="stMain"], [data-testid="stSidebar"], header)
  :is(p, span, label, li, code, small, strong, em, a, div, input, textarea, button):not(
  :is(h1, h2, h3, h4, h5, h6, [data-testid="stMetricValue"], .katex) *):not(
  h1, h2, h3, h4, h5, h6, [data-testid="stMetricValue"], .katex) { font-size: 16px !important; }
.katex { font-size: 1.5em !important; }
</style>"""


def on() -> bool:
    """Is presentation mode on (for this browser session)?"""
    return bool(st.session_state.get(MODE_KEY, False))


# both modes: inline code as large as the text around it (Streamlit draws it at 0.75 em),
# a chart's own controls (a slider, play, speed) on one row under it, and less blank space above
# the title (Run live and the main chart's top on the first screen)
_CODE_CSS = """<style>
[data-testid="stMain"] code, [data-testid="stSidebar"] code { font-size: 0.95em; }
[data-testid="stMainBlockContainer"] { padding-top: 3rem; }
.vega-bindings { display: flex; flex-wrap: wrap; column-gap: 2rem; align-items: center; }
</style>"""


def mode_toggle() -> None:
    """The sidebar toggle; the entry script draws it on every page, so its value is kept."""
    st.html(_CODE_CSS)
    if on():
        st.html(_CSS)
    st.sidebar.toggle("Presentation mode", key=MODE_KEY,
                      help="For a projector: chart text of at least 16 px, full-width charts, the "
                           "controls in this sidebar beside their result.")


def kept(key: str, default):
    """A widget key whose value survives page changes (see the module docstring); returns key."""
    st.session_state.setdefault(_KEPT, set()).add(key)
    if key not in st.session_state:
        st.session_state[key] = default
    return key


def keep_widget_values() -> None:
    """Re-assign every kept key, so Streamlit does not drop it when its page is not drawn."""
    for key in st.session_state.get(_KEPT, ()):
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]


def reset(key: str, value) -> None:
    """Put a dependent control back to `value` when what it depends on disables it (call before
    the widget is drawn)."""
    st.session_state[key] = value


def intro(markdown: str) -> None:
    """A page's introduction, folded under its title (both modes): the controls, Run live and the
    top of the page's main chart on the first screen of 1440 x 900."""
    st.expander("What this page shows").markdown(markdown)


class Controls:
    """Where a page puts its controls: `columns` (st.columns, or the sidebar in presentation mode),
    `area` for a control outside the columns, and `run_button`, drawn at the top of the sidebar in
    presentation mode so that it is on the first screen, with `run_area` under it: where run_live
    draws the run's status box and progress bar (None outside presentation mode: where run_live is
    called), so that they do not push the page's first chart below the first screen. Outside
presentation mode, `area` and Run live come right under the columns (and the run's status under
Run live), wherever the page calls run_button: Run live stays on the first screen. A page with more controls than one
    sidebar column holds on 900 px asks for `sidebar_columns=2`: a wider sidebar, the page's
    columns dealt alternately into two (and its charts a little narrower)."""

    def __init__(self, spec: int | list, sidebar_columns: int = 1):
        n = spec if isinstance(spec, int) else len(spec)
        st.session_state[_CHART_PX] = MAIN_PX
        self.run_area = None
        if on():
            self._slot = st.sidebar.container()
            self.area = st.sidebar
            if sidebar_columns == 2:
                st.html(_WIDE_SIDEBAR_CSS)
                st.session_state[_CHART_PX] = MAIN_PX - (WIDE_SIDEBAR_PX - SIDEBAR_PX)
                pair = st.sidebar.columns(2)
                self.columns = [pair[i % 2] for i in range(n)]
            else:
                self.columns = [st.sidebar] * n
        else:  # under the columns: what the page puts in `area`, then Run live, on the first screen
            self.columns = st.columns(spec)
            self.area = st.container()
            self._slot = st.container()

    def run_button(self, label: str = "Run live", **kwargs) -> bool:
        pressed = self._slot.button(label, type="primary", **kwargs)
        if not pressed and not kwargs.get("disabled"):
            from live_runs import warming  # the server's warm-up presses every page's Run live
            pressed = warming()
        self.run_area = self._slot.container()
        return pressed


def drawn_font():
    """The size a chart text of f px is drawn at on this page (`chart` enlarges every text after a
    chart is built): for builders that size cells for their labels (`drawn_font=`)."""
    from parallel_mini.course.viz.style import scaled_font

    least = MIN_FONT_PX if on() else NORMAL_FONT_PX
    return lambda size: scaled_font(size, least)


def chart(chart, where=st, share: float = 1.0) -> None:
    """Draw a viz chart (an Altair chart or a Vega-Lite spec) so that it fits its column: `share`
    of the page's main column (e.g. 0.5 in one of two columns). A single or layered view takes its
    column's width; side-by-side panels are narrowed or stacked to fit (viz.style.fit_width). Chart
    text is at least NORMAL_FONT_PX, and in presentation mode at least 16 px, the panels of a
    compound chart widened to fill the page."""
    # imported here: the entry script imports this module on every page, Home included, and
    # altair costs seconds on a cold server
    from parallel_mini.course.viz.style import fit_width, presentation

    main = st.session_state.get(_CHART_PX, MAIN_PX)
    column = round(main * share) - (COLUMN_GAP_PX if share < 1 else 0)
    if on():
        spec = presentation(chart, width_px=round((main - (MAIN_PX - PAGE_CHART_PX)) * share))
    else:
        spec = presentation(chart, min_font_px=NORMAL_FONT_PX)
    spec, stretch = fit_width(spec, column)
    where.vega_lite_chart(spec, width="stretch" if stretch else "content")
