"""What every page shares for the classroom: presentation mode, controls that keep their values
when you leave a page and come back, and the one call that draws a chart.

Presentation mode (a sidebar toggle, on every page): the navigation moves to the top bar, each
page's controls and its "Run live" button move to the sidebar, the page's introduction folds into
an expander, and every chart is drawn with text of at least 16 px and as wide as the page
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
# the plot width a chart fills in presentation mode: the main column is about 980 px at 1440 px
# with the sidebar open; axes and a legend take the rest
PAGE_CHART_PX = 680
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
</style>"""


def on() -> bool:
    """Is presentation mode on (for this browser session)?"""
    return bool(st.session_state.get(MODE_KEY, False))


def mode_toggle() -> None:
    """The sidebar toggle; the entry script draws it on every page, so its value is kept."""
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
    """A page's introduction: in full, or folded in presentation mode."""
    if on():
        st.expander("What this page shows").markdown(markdown)
    else:
        st.markdown(markdown)


class Controls:
    """Where a page puts its controls: `columns` (st.columns, or the sidebar in presentation mode),
    `area` for a control outside the columns, and `run_button`, drawn at the top of the sidebar in
    presentation mode so that it is on the first screen, with `run_area` under it: where run_live
    draws the run's status box and progress bar (None outside presentation mode: where run_live is
    called), so that they do not push the page's first chart below the first screen. A page with more controls than one
    sidebar column holds on 900 px asks for `sidebar_columns=2`: a wider sidebar, the page's
    columns dealt alternately into two (and its charts a little narrower)."""

    def __init__(self, spec: int | list, sidebar_columns: int = 1):
        n = spec if isinstance(spec, int) else len(spec)
        st.session_state[_CHART_PX] = PAGE_CHART_PX
        self.run_area = None
        if on():
            self._slot = st.sidebar.container()
            self.area = st.sidebar
            if sidebar_columns == 2:
                st.html(_WIDE_SIDEBAR_CSS)
                st.session_state[_CHART_PX] = PAGE_CHART_PX - (WIDE_SIDEBAR_PX - SIDEBAR_PX)
                pair = st.sidebar.columns(2)
                self.columns = [pair[i % 2] for i in range(n)]
            else:
                self.columns = [st.sidebar] * n
        else:
            self._slot = None
            self.area = st
            self.columns = st.columns(spec)

    def run_button(self, label: str = "Run live", **kwargs) -> bool:
        if self._slot is None:
            return st.button(label, type="primary", **kwargs)
        pressed = self._slot.button(label, type="primary", **kwargs)
        self.run_area = self._slot.container()
        return pressed


def chart(chart, where=st, share: float = 1.0) -> None:
    """Draw a viz chart: as built, or in presentation mode with text >= 16 px and widths scaled to
    fill `share` of the page's width (e.g. 0.5 in one of two columns)."""
    if on():
        # imported here: the entry script imports this module on every page, Home included, and
        # altair costs seconds on a cold server
        from parallel_mini.course.viz.style import presentation

        width = st.session_state.get(_CHART_PX, PAGE_CHART_PX)
        where.vega_lite_chart(presentation(chart, width_px=round(width * share)),
                              width="content")
    else:
        where.altair_chart(chart, width="content")
