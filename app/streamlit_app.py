"""parallel_mini classroom app: `make app` (streamlit run app/streamlit_app.py).

Every page runs real ranks (gloo on CPU) when "Run live" is pressed, and draws what they measured
beside the formula from `parallel_mini.theory`. The charts come from `parallel_mini.course.viz`, the same
functions the lessons use.
"""
import sys
from pathlib import Path

import streamlit as st

# Pages import the app's helpers (live_runs.py) by name; `streamlit run` puts this folder on
# sys.path, AppTest does not.
APP_DIR = str(Path(__file__).resolve().parent)
if APP_DIR not in sys.path:
    sys.path.insert(0, APP_DIR)

# The pages live in app_pages/, not pages/: a folder named pages/ next to this script switches
# Streamlit to its old file-based navigation for any session that opens a page URL (e.g. /ring)
# before anyone has opened the home page: this script would not run, and the sidebar would list
# file names.
st.set_page_config(page_title="parallel_mini", layout="wide")

import presentation  # noqa: E402  (after APP_DIR is on sys.path)

presentation.keep_widget_values()  # every page's controls keep their values across page changes
presentation.mode_toggle()

pages = {
    "parallel_mini": [st.Page("app_pages/home.py", title="Home", icon="🏠", default=True)],
    "Topics": [
        st.Page("app_pages/ring.py", title="Ring all-reduce", icon="🔁", url_path="ring"),
        st.Page("app_pages/data_parallel.py", title="Data parallel", icon="🧮",
                url_path="data_parallel"),
        st.Page("app_pages/memory.py", title="Memory per GPU", icon="🧠", url_path="memory"),
        st.Page("app_pages/tensor.py", title="Tensor parallel", icon="🧩", url_path="tensor"),
        st.Page("app_pages/pipeline.py", title="Pipeline bubbles", icon="🫧", url_path="pipeline"),
        st.Page("app_pages/long_sequences.py", title="Long sequences", icon="🧵",
                url_path="long_sequences"),
        st.Page("app_pages/experts.py", title="Experts", icon="🔀", url_path="experts"),
        st.Page("app_pages/plan.py", title="Plan a run", icon="🗺️", url_path="plan"),
    ],
}
# presentation mode: the page list moves to the top bar, leaving the sidebar to the page's controls
st.navigation(pages, position="top" if presentation.on() else "sidebar").run()
