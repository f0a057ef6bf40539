"""Animations that play in the browser: a chart's frame slider advanced by Vega's own timer.

`autoplay(chart, param, frames)` takes a chart whose frames are chosen by a bound range parameter
(`ring_animation`'s "step", `ring_kv_animation`'s "frame") and returns its Vega-Lite spec (a dict)
with three more controls drawn under the chart, beside the slider: a "play" checkbox (ticked: the
animation plays as soon as it is drawn; unticked: it holds the frame shown), a "speed" radio, and a
timer that advances the slider's parameter one frame every `speed` ticks, from the last frame back
to the first. Everything happens in the browser: no server round-trip per frame, so a loaded server
does not slow the animation, and moving the slider by hand works while it plays or not.

Vega-Lite has no timer parameter of its own; a variable parameter's other properties are passed to
the Vega signal it compiles to, so an `on` handler with a `timer` event stream is one (the reason
this returns a dict: Altair's schema would refuse `on`). The chart also carries an invisible text,
"timer tick N", the count of the timer's ticks: a test waits for it to advance to know that time
has passed (e.g. that a paused animation held its frame over several ticks) without sleeping.
"""
from __future__ import annotations

import copy

import altair as alt

from .style import spec_of

TICK_MS = 250
SPEEDS = {"slow": 6, "normal": 3, "fast": 1}  # timer ticks per frame: 1.5 s, 0.75 s, 0.25 s
TICK_TEXT = "timer tick "


def autoplay(chart: alt.TopLevelMixin | dict, param: str, frames: int, playing: bool = True,
             speed: str = "normal") -> dict:
    """The chart's spec, playing its `frames` frames through the bound parameter `param` in the
    browser (see the module docstring). `playing`: whether it starts playing; `speed`: one of
    SPEEDS."""
    if isinstance(chart, dict):
        spec = copy.deepcopy(chart)
    else:
        spec = spec_of(chart)
    params = spec.setdefault("params", [])
    frame = next((p for p in params if p.get("name") == param), None)
    if frame is None:
        raise ValueError(f"autoplay: the chart has no top-level parameter {param!r}")
    if speed not in SPEEDS:
        raise ValueError(f"autoplay: speed {speed!r} is not one of {', '.join(SPEEDS)}")
    params += [
        {"name": "play", "value": bool(playing), "bind": {"input": "checkbox", "name": "play "}},
        {"name": "speed", "value": SPEEDS[speed],
         "bind": {"input": "radio", "options": list(SPEEDS.values()), "labels": list(SPEEDS),
                  "name": "speed "}},
        {"name": "tick", "value": 0,
         "on": [{"events": {"type": "timer", "throttle": TICK_MS}, "update": "tick + 1"}]},
    ]
    frame["on"] = [{"events": {"signal": "tick"},
                    "update": f"play && tick % speed == 0 ? ({param} + 1) % {frames} : {param}"}]
    # the tick count, drawn invisible at the chart's corner (for tests; see the module docstring)
    spec.setdefault("layer", []).append({
        "data": {"values": [{}]},
        "mark": {"type": "text", "opacity": 0, "align": "left", "baseline": "top"},
        "encoding": {"x": {"value": 0}, "y": {"value": 0},
                     "text": {"value": {"expr": f"'{TICK_TEXT}' + tick"}}}})
    return spec
