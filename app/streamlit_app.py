"""parallel_mini classroom app: `make app` (streamlit run app/streamlit_app.py).

Every page runs real ranks (gloo on CPU) when "Run live" is pressed, and draws what they measured
beside the formula from `parallel_mini.theory`. The charts come from `parallel_mini.course.viz`, the same
functions the lessons use. Each page's default setting is measured once in the background when the
first session opens the app (live_runs.start_warmup), so that a class pressing "Run live" at the
default controls reads a shared result at once.
"""
# Everything runs in main(), under `__name__ == "__main__"` (as Streamlit and AppTest run it):
# Streamlit installs each script run's module as sys.modules["__main__"], and a rank started by
# another session's run at that moment re-imports it as "__mp_main__" (multiprocessing's way with a
# parent's main module; the launcher hides the one it sees, not one installed a moment later): the
# rank then skips the app instead of running it (seen: four ranks each importing the app, a ring's
# rendezvous timing out after 30 s).

# (script, title, Material icon, url path): icons from Streamlit's Material Symbols, drawn by the
# app's own font, so they render on a machine without an emoji font. The warm-up measures the
# cheap pages first.
TOPICS = [
    ("app_pages/ring.py", "Ring all-reduce", ":material/autorenew:", "ring"),
    ("app_pages/links.py", "This machine's links", ":material/speed:", "links"),
    ("app_pages/data_parallel.py", "Data parallel", ":material/content_copy:", "data_parallel"),
    ("app_pages/memory.py", "Memory per GPU", ":material/memory:", "memory"),
    ("app_pages/tensor.py", "Tensor parallel", ":material/grid_view:", "tensor"),
    ("app_pages/pipeline.py", "Pipeline bubbles", ":material/view_timeline:", "pipeline"),
    ("app_pages/long_sequences.py", "Long sequences", ":material/straighten:", "long_sequences"),
    ("app_pages/experts.py", "Experts", ":material/alt_route:", "experts"),
    ("app_pages/barrier.py", "Without a barrier", ":material/hourglass_disabled:", "barrier"),
    ("app_pages/plan.py", "Plan a run", ":material/map:", "plan"),
]


def main() -> None:
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

    import live_runs  # noqa: E402  (after APP_DIR is on sys.path)
    import presentation  # noqa: E402


    presentation.keep_widget_values()  # every page's controls keep their values across page changes
    presentation.mode_toggle()
    try:
        live_runs.start_warmup([(title, url, str(Path(APP_DIR) / script))
                                for script, title, _, url in TOPICS], str(Path(__file__).resolve()))
    except ValueError as err:  # a bad PARALLEL_MINI_WARM: said in one line, the app still runs
        st.sidebar.error(f"No warm-up: {err}")

    pages = {
        "parallel_mini": [st.Page("app_pages/home.py", title="Home", icon=":material/home:",
                                  default=True)],
        "Topics": [st.Page(script, title=title, icon=icon, url_path=url)
                   for script, title, icon, url in TOPICS],
    }
    # presentation mode: the page list moves to the top bar, the sidebar keeps the page's controls
    st.navigation(pages, position="top" if presentation.on() else "sidebar").run()


if __name__ == "__main__":
    main()
