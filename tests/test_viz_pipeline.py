"""The pipeline and ring charts read without hovering, checked on their specs (no ranks start).

Timelines: every op bar carries its micro-batch ("3", or "3·c5" with its model chunk when a rank
holds several) in a font that fits the bar, computed here from the bar's drawn width; when no font
fits (p = 4, m = 16, interleaved v = 3 on the widest chart), colour is the micro-batch and each op
kind and chunk has a named row in its rank's lane. Op-count and unit-time axes tick on integers,
and a timeline gets its own time axis unless a common one is asked for. The ring animation: every
frame's caption takes as many lines as the longest (the message list is never cut off), its
colours come from a multi-hue scale with a legend entry per count, and it starts at the frame asked
for."""
from __future__ import annotations

import pandas as pd
import pytest

from parallel_mini.course import timelines
from parallel_mini.course import viz
from parallel_mini.parallel import schedules as S
from parallel_mini.course.viz import pipeline as P

UNIT = {"F": 1.0, "B": 2.0}
SPLIT = {"F": 1.0, "B": 1.0, "W": 1.0}


def _plan(schedule: str, p: int, m: int, v: int = 0) -> list[dict]:
    sched = S.build_schedule(schedule, p, m, v)
    return timelines.replay_ops(sched, SPLIT if sched.split_backward else UNIT)


def _layers(chart) -> list[dict]:
    return chart.to_dict()["layer"]


def _rows(spec: dict, layer: dict) -> list[dict]:
    return spec["datasets"][layer["data"]["name"]]


def test_every_op_bar_is_labelled_in_a_font_that_fits_it():
    timed = _plan("gpipe", 4, 8)
    chart = viz.pipeline_timeline(timed, "gpipe", seconds=False, width=440)
    spec = chart.to_dict()
    bars, labels = spec["layer"]
    assert "hover" not in str(spec["title"])
    font = labels["mark"]["fontSize"]
    texts = _rows(spec, labels)
    ops = [t for t in timed if t["kind"] in ("F", "B")]
    assert sorted(r["label"] for r in texts) == sorted(str(t["microbatch"]) for t in ops)
    span = max(t["end"] for t in timed)
    for r in texts:  # the bar, in px, holds the label at that font (digits ~0.62 em)
        assert (r["x2"] - r["x"]) / span * 440 >= 0.62 * font * len(r["label"]) + 3
    assert font >= 9


def test_interleaved_labels_name_the_chunk_and_crowded_charts_colour_the_microbatch():
    # p = 4, m = 8, v = 2, one timeline per row: 32 ops per rank, each labelled micro-batch·chunk
    chart = viz.pipeline_timeline(_plan("interleaved", 4, 8, 2), "i", seconds=False, width=960)
    spec = chart.to_dict()
    labels = spec["layer"][1]
    rank0 = {r["label"] for r in _rows(spec, labels) if r["rank"] == 0}
    assert {"0·c0", "0·c4", "7·c4"} <= rank0 and len(_rows(spec, labels)) == 4 * 32
    bar = spec["layer"][0]["mark"]["height"]  # "0" over "c4": the bar holds both lines
    assert bar >= 2 * labels["mark"]["fontSize"] == 2 * labels["mark"]["lineHeight"]
    # drawn larger after it is built (presentation mode: 16 px at least): fitted at that size
    big = viz.pipeline_timeline(_plan("interleaved", 4, 8, 2), "i", seconds=False, width=960,
                                drawn_font=lambda f: max(16, 1.6 * f)).to_dict()
    assert "colour is the micro-batch" in big["title"]["subtitle"][-1]
    big = viz.pipeline_timeline(_plan("gpipe", 4, 8), "g", seconds=False, width=960,
                                drawn_font=lambda f: max(16, 1.6 * f)).to_dict()
    assert big["layer"][1]["mark"]["lineHeight"] >= 16 and big["layer"][0]["mark"]["height"] >= 20
    # the most the page allows: 96 ops per rank, no font fits: colour is the micro-batch
    timed = _plan("interleaved", 4, 16, 3)
    spec = viz.pipeline_timeline(timed, "i", seconds=False, width=960).to_dict()
    assert P.label_font(P.pipeline_frame(timed, False), 960) is None
    assert "colour is the micro-batch" in spec["title"]["subtitle"][-1]
    gaps, bars, names = spec["layer"]
    assert bars["encoding"]["color"]["field"] == "microbatch"
    assert bars["encoding"]["color"]["legend"]["columns"] == 8  # an entry each, in rows of 8
    assert bars["encoding"]["yOffset"]["field"] == "row"
    assert {r["row_name"] for r in _rows(spec, names) if r["lane"] == "rank 1"} == {
        f"{k} c{c}" for k in "FB" for c in (1, 5, 9)}  # rank 1 holds chunks 1, 5 and 9
    assert len([r for r in _rows(spec, bars) if r["kind"] == "F"]) == 4 * 16 * 3
    assert gaps["transform"] == [{"filter": "(datum.row === '')"}]
    assert {r["kind"] for r in _rows(spec, gaps) if r["row"] == ""} == {"idle"}


def test_integer_ticks_and_a_time_axis_of_its_own():
    chart = viz.pipeline_timeline(_plan("gpipe", 2, 1), "m = 1", seconds=False, width=440)
    x = _layers(chart)[0]["encoding"]["x"]
    assert x["axis"] == {"tickMinStep": 1, "format": "d"} and "scale" not in x
    # one micro-batch on a narrow chart: no colour legend of one entry, the kinds keep theirs
    narrow = viz.pipeline_timeline(_plan("gpipe", 4, 1), "m = 1", seconds=False, width=80)
    bars, labels = _layers(narrow)
    assert bars["encoding"]["color"]["field"] == "what"
    assert "every op is micro-batch 0" in narrow.to_dict()["title"]["subtitle"][-1]
    assert 0 < len(narrow.to_dict()["datasets"][labels["data"]["name"]]) < 4 * 2  # B's fit, F's not
    shared = viz.pipeline_timeline(_plan("gpipe", 2, 1), "m = 1", seconds=False, x_max=12)
    assert _layers(shared)[0]["encoding"]["x"]["scale"] == {"domain": [0, 12]}
    report = {"config": {"schedule": "gpipe"}, "ranks": [
        {"coords": {"pp": r, "dp": 0}, "events": [
            {"kind": k, "microbatch": 0, "held_bytes": b} for k, b in (("F", 64), ("B", 0))]}
        for r in range(2)]}
    axis = viz.in_flight_chart(report).to_dict()["encoding"]["x"]["axis"]
    assert axis["tickMinStep"] == 1 and axis["format"] == "d"


def _ring_exp(n: int) -> dict:
    """A ring all-reduce's frames as collectives.ring_frames decodes them (built here: rank r sends
    chunk (r - s + 1) mod n at step s, in both phases)."""
    state = [[1 << r for _ in range(n)] for r in range(n)]
    frames = [{"step": 0, "phase": "start", "moves": [], "state": [row[:] for row in state]}]
    for s in range(1, 2 * n - 1):
        moves = [{"src": r, "dst": (r + 1) % n, "chunk": (r - s + 1) % n,
                  "mask": state[r][(r - s + 1) % n]} for r in range(n)]
        for mv in moves:
            state[mv["dst"]][mv["chunk"]] |= mv["mask"]
        frames.append({"step": s, "phase": "reduce-scatter" if s < n else "all-gather",
                       "moves": moves, "state": [row[:] for row in state]})
    assert all(mask == (1 << n) - 1 for row in state for mask in row)  # the sum is complete
    return {"world_size": n, "frames": frames, "numel": 2 * n, "chunk_sizes": [2] * n}


def test_ring_animation_fits_eight_ranks_and_starts_where_asked():
    n = 8
    exp = _ring_exp(n)
    captions = viz.ring_moves_text(exp)
    assert {c.count("\n") for c in captions} == {n + 1}  # 2 + N lines in every frame
    assert captions[5].splitlines()[-1].startswith("rank 7 → rank 0")
    spec = viz.ring_animation(exp, frame=5).to_dict()
    (step,) = spec["params"]
    assert step["value"] == 5 and step["bind"]["max"] == 2 * (n - 1)
    color = spec["layer"][0]["encoding"]["color"]
    assert color["scale"]["scheme"] == "viridis" and color["scale"]["domain"] == list(range(1, n + 1))
    # the cells hold their labels: 4 ranks a line ("0+1+2+3+" over "4+5+6") and the move
    cells = spec["datasets"][spec["layer"][0]["data"]["name"]]
    assert max(len(line) for c in cells for line in c["label"].split("\n")) <= len("← from r7")
    assert spec["height"] == n * max(40, int(1.2 * 10 * 3 + 10))
    big = viz.ring_animation(exp, drawn_font=lambda f: 16).to_dict()  # presentation mode
    assert big["width"] > spec["width"] and big["height"] == n * int(1.2 * 16 * 3 + 10)
    with pytest.raises(ValueError, match="frame 15 is not one of 0..14"):
        viz.ring_animation(exp, frame=15)
    assert isinstance(viz.ring_frames_frame(exp), pd.DataFrame)
