"""Play / Pause and a speed for an animation drawn by the server, one frame at a time.

A chart's own slider moves through its frames in the browser, but nothing in it plays them (the
timer-driven `time` channel of Vega-Lite works on single views, not on layered charts). So the page
redraws the chart with the next frame: a fragment that reruns itself every `speed` seconds while
playing, the frame and whether it plays kept in `st.session_state`, so that Pause stops it where it
is and Play goes on from there (from the start, after the last frame). Only the fragment reruns
between frames, not the page.

    frame = player("ring", frames=7, draw=lambda f: st.altair_chart(chart(frame=f)))
"""
from __future__ import annotations

from typing import Callable

import streamlit as st

SPEEDS = {"slow": 1.5, "normal": 0.8, "fast": 0.3}  # seconds per frame


def _state(key: str, frames: int) -> dict:
    """The animation's state in the session: {frame, playing, frames}; a new frame count (a new
    run) starts again from frame 0, paused."""
    state = st.session_state.setdefault(f"{key}_player", {"frame": 0, "playing": False,
                                                          "frames": frames})
    if state["frames"] != frames:
        state.update(frame=0, playing=False, frames=frames)
    return state


def _toggle(state: dict) -> None:
    if not state["playing"] and state["frame"] >= state["frames"] - 1:
        state["frame"] = -1  # played to the end: Play starts again (the first tick shows frame 0)
    state["playing"] = not state["playing"]


def player(key: str, frames: int, draw: Callable[[int], None], help: str | None = None,
           where=None) -> int:
    """Play/Pause and speed controls (in `where`, a column beside the page's own control, or a
    row of their own), then `draw(frame)` inside a fragment that advances one frame per tick while
    playing; stops on the last frame. Returns the frame drawn by this run."""
    state = _state(key, frames)
    c1, c2 = st.columns([1, 2, 3])[:2] if where is None else where.columns(2)
    c1.button("⏸ Pause" if state["playing"] else "▶ Play", key=f"{key}_play", on_click=_toggle,
              args=(state,), help=help)
    speed = c2.select_slider("Speed", list(SPEEDS), value="normal", key=f"{key}_speed",
                             format_func=lambda s: f"{s}: {SPEEDS[s]:g} s per step")

    @st.fragment(run_every=SPEEDS[speed] if state["playing"] else None)
    def animate() -> None:
        if state["playing"]:
            state["frame"] = min(state["frame"] + 1, frames - 1)
        frame = max(state["frame"], 0)
        draw(frame)
        if state["playing"] and frame == frames - 1:
            state["playing"] = False
            st.rerun()  # the whole page: the fragment stops ticking, the button says Play again

    animate()
    return max(state["frame"], 0)
