"""The collectives (lesson 01, the Ring all-reduce page): the ring all-reduce step by step as the
ranks really sent it, its step times and bandwidth beside the formula, and each collective's
tensors before and after the call.

    ring_animation(exp)    the ring all-reduce step by step, decoded from the probe run's messages
                           (a 'step' slider; frame=k starts it at step k, for the app's Play)
    ring_step_times(exp)   wall time of each of the 2(N-1) ring steps (rank 0, timed run)
    bandwidth_bars(exp)    bus bandwidth: our ring vs the backend's all-reduce
    ring_time_bars(exp)    all-reduce time: measured ring, measured backend, 2(N-1)/N * X / B
    primitives_frame(rows) / primitives_table(rows)   each collective, before and after, per rank

`exp` is a `collectives.ring_experiment` dict, `rows` are `collectives.primitives_demo` rows.
"""
from __future__ import annotations

from typing import Callable

import altair as alt
import pandas as pd

from .units import PAD, rate_unit

PHASE_COLORS = {"reduce-scatter": "#4c78a8", "all-gather": "#f58518"}


def ranks_label(mask: int, n: int, per_line: int | None = None) -> str:
    """'0+1+3' for the ranks in a bitmask; 'all N' once every rank's data is in; a new line after
    every `per_line` ranks ('0+1+2+3+\n4+5+6'), so that a cell stays narrow at N = 8."""
    ranks = [str(r) for r in range(n) if mask >> r & 1]
    if len(ranks) == n and n > 3:
        return f"all {n}"
    per_line = per_line or len(ranks) or 1
    return "+\n".join("+".join(ranks[i:i + per_line]) for i in range(0, len(ranks), per_line))


def _ranks_set(mask: int, n: int) -> str:
    return "{" + ", ".join(str(r) for r in range(n) if mask >> r & 1) + "}"


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}–{last}"


def _phase_of_step(step: int, n: int) -> str:
    return "reduce-scatter" if step <= n - 1 else "all-gather"


def ring_frames_frame(exp: dict, moves_in_label: bool = True) -> pd.DataFrame:
    """One row per (frame, rank, chunk) of the decoded probe run: whose data the chunk holds, and
    whether it was sent or received in that frame's step (also in the label, "← from r6" and
    "→ to r0", unless `moves_in_label` is False)."""
    n = exp["world_size"]
    rows = []
    for i, fr in enumerate(exp["frames"]):
        sent = {(m["src"], m["chunk"]): m for m in fr["moves"]}
        got = {(m["dst"], m["chunk"]): m for m in fr["moves"]}
        for r, row in enumerate(fr["state"]):
            for c, mask in enumerate(row):
                mv = got.get((r, c))
                rows.append({"frame": i, "step": fr["step"], "phase": fr["phase"], "rank": r,
                             "chunk": c, "mask": mask, "contributors": bin(mask).count("1"),
                             "label": ranks_label(mask, n, 4 if n > 5 else None)
                             + (f"\n← from r{mv['src']}" if mv and moves_in_label else "")
                             + (f"\n→ to r{sent[(r, c)]['dst']}"
                                if (r, c) in sent and moves_in_label else ""),
                             "holds": _ranks_set(mask, n),
                             "received_from": mv["src"] if mv else None,
                             "sent_to": sent[(r, c)]["dst"] if (r, c) in sent else None})
    return pd.DataFrame(rows)


def ring_moves_text(exp: dict, columns: int = 1) -> list[str] | list[list[str]]:
    """Per frame, the caption: the step, its phase and every message, as decoded from the run
    (2 + N lines, the start frame's padded to as many: every frame takes the same room).
    `columns` > 1: per frame, that many texts side by side, the step and phase over the first, the
    messages dealt into them in order, each in short ("r3 → r4: chunk 2 of 1+2+3")."""
    n, total = exp["world_size"], len(exp["frames"]) - 1
    if columns > 1:
        per = -(-n // columns)
        out = []
        for fr in exp["frames"]:
            if fr["phase"] == "start":
                head = [f"step 0 of {total} · start: every rank holds only its own data"]
                lines = []
            else:
                verb = "summed into" if fr["phase"] == "reduce-scatter" else "copied over"
                head = [f"step {fr['step']} of {total} · {fr['phase']} "
                        f"(each received chunk is {verb} the local one)"]
                lines = [f"rank {m['src']} → rank {m['dst']}: chunk {m['chunk']} of "
                         f"{ranks_label(m['mask'], n)}"
                         for m in sorted(fr["moves"], key=lambda m: m["src"])]
            texts = []
            for i in range(columns):
                part = lines[i * per:(i + 1) * per]
                top = head if i == 0 else [" "]
                texts.append("\n".join(top + part + [" "] * (per - len(part))))
            out.append(texts)
        return out
    out = []
    for fr in exp["frames"]:
        if fr["phase"] == "start":
            out.append(f"step 0 of {total} · start: every rank holds only its own data")
            continue
        verb = "summed into" if fr["phase"] == "reduce-scatter" else "copied over"
        lines = [f"step {fr['step']} of {total} · {fr['phase']}",
                 f"(each received chunk is {verb} the local one)"]
        lines += [f"rank {m['src']} → rank {m['dst']}: chunk {m['chunk']} carrying "
                  f"{_ranks_set(m['mask'], n)}" for m in sorted(fr["moves"], key=lambda m: m["src"])]
        out.append("\n".join(lines))
    most = max(text.count("\n") for text in out)
    # the browser sizes the chart from the frame it draws first: with the start frame as tall as
    # the others, the message list of a later step is not cut off below the grid
    return [text + "\n " * (most - text.count("\n")) for text in out]


def ring_animation(exp: dict, cell_width: int | None = None, cell_height: int = 40,
                   frame: int = 0, drawn_font: Callable[[int], float] | None = None,
                   compact: bool = False) -> alt.LayerChart:
    """The ring all-reduce, one frame per step, as decoded from the messages of the live probe run.

    Grid: rank (rows) x chunk (columns). Colour: how many ranks' data the chunk holds (1..N); label:
    which ranks ("0+1+3"). Black outline: the chunk this rank received in the step (and from whom);
    orange dashed: the chunk it sent (and to whom). Below the grid, every message of the step. A
    slider ("step", starting at `frame`) moves through the frames in the browser; frame 0 is the
    start, frames 1..N-1 reduce-scatter, N..2(N-1) all-gather. The app's Play redraws the chart with
    the next `frame`. Cells are sized for their labels (at least `cell_height` tall); `drawn_font(f)`:
    the size a text of f px will be drawn at when the spec is restyled after it is built (the app's
    presentation mode: style.scaled_font). `compact`: shorter, for one screen at N = 8: the cells
    say whose data they hold (the outlines say which were sent and received), the messages are
    listed in two columns, each in short."""
    n, frames = exp["world_size"], exp["frames"]
    cells = ring_frames_frame(exp, moves_in_label=not compact)
    marks = pd.concat([
        cells.dropna(subset=["received_from"]).assign(role="received"),
        cells.dropna(subset=["sent_to"]).assign(role="sent"),
    ])[["frame", "rank", "chunk", "role"]]
    columns = 2 if compact and n > 3 else 1
    texts = ring_moves_text(exp, columns)
    captions = pd.DataFrame([{"frame": i, "column": j, "caption": text}
                             for i, frame_texts in enumerate(texts)
                             for j, text in enumerate(frame_texts if columns > 1 else [frame_texts])])
    font = 11 if n <= 5 else 10
    drawn = (drawn_font or float)(font)
    lines = [line for label in cells["label"] for line in label.split("\n")]
    cell_width = cell_width or max(78, int(0.62 * drawn * max(map(len, lines))) + 12)
    line_px = 1.2 * drawn  # set on the mark: a restyle enlarges fonts, not line heights
    cell_height = max(cell_height, int(line_px * (cells["label"].str.count("\n").max() + 1)
                                       + (4 if compact else 10)))
    width, height = max(cell_width * n, 330), cell_height * n  # room for the caption below
    if compact:  # the messages in `columns` columns under the grid: as wide as their longest line
        caption_drawn = (drawn_font or float)(12)
        longest = max(len(line) for t in captions["caption"] for line in t.split("\n")[1:] + [""])
        width = max(width, int(columns * (0.58 * caption_drawn * longest + 16)))

    if not 0 <= frame < len(frames):
        raise ValueError(f"ring_animation: frame {frame} is not one of 0..{len(frames) - 1}")
    step = alt.param(name="step", value=frame,
                     bind=alt.binding_range(min=0, max=len(frames) - 1, step=1, name="step "))
    in_frame = alt.datum.frame == step
    x = alt.X("chunk:O", title=f"chunk (1/{n} of the tensor; sizes {exp['chunk_sizes']} elements)",
              axis=alt.Axis(orient="top", labelAngle=0))
    y = alt.Y("rank:O", title="rank (process)")

    fill = alt.Chart(cells).mark_rect(stroke="white", strokeWidth=1).encode(
        x=x, y=y,
        # viridis, light to dark: hue and lightness both change, so that 8 counts stay apart
        color=alt.Color("contributors:O", title="ranks summed in",
                        scale=alt.Scale(scheme="viridis", reverse=True,
                                        domain=list(range(1, n + 1)))),
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("phase:N"), alt.Tooltip("rank:O"),
                 alt.Tooltip("chunk:O"), alt.Tooltip("holds:N", title="holds data of ranks"),
                 alt.Tooltip("received_from:Q", title="received from rank"),
                 alt.Tooltip("sent_to:Q", title="sent to rank")],
    ).transform_filter(in_frame)
    # Vega puts a multi-line text's first line at the cell's middle: one layer per line count,
    # each moved up by half its extra lines
    cells["lines"] = cells["label"].str.count("\n") + 1
    text = [alt.Chart(cells).mark_text(fontSize=font, lineBreak="\n", lineHeight=line_px,
                                       dy=-line_px * (k - 1) / 2).encode(
        x=x, y=y, text="label:N",
        color=alt.condition(alt.datum.contributors > n / 2, alt.value("white"), alt.value("black")),
    ).transform_filter(in_frame & (alt.datum.lines == k)) for k in sorted(set(cells["lines"]))]
    role_stroke = alt.Stroke("role:N", title="this step", scale=alt.Scale(
        domain=["received", "sent"], range=["black", "#f58518"]))
    received = alt.Chart(marks).mark_rect(fill=None, strokeWidth=3).encode(
        x=x, y=y, stroke=role_stroke,
    ).transform_filter(in_frame & (alt.datum.role == "received"))
    sent = alt.Chart(marks).mark_rect(fill=None, strokeWidth=3, strokeDash=[6, 3]).encode(
        x=x, y=y, stroke=role_stroke,
    ).transform_filter(in_frame & (alt.datum.role == "sent"))
    caption = [alt.Chart(captions).mark_text(align="left", baseline="top", lineBreak="\n",
                                             fontSize=12, dy=0).encode(
        x=alt.value(j * width / len(set(captions["column"]))), y=alt.value(height + 10),
        text="caption:N",
    ).transform_filter(in_frame & (alt.datum.column == j)) for j in sorted(set(captions["column"]))]

    # autosize "pad": the caption lies below the plot; "fit" would shrink the grid to make room
    return alt.layer(fill, received, sent, *text, *caption).add_params(step).properties(
        width=width, height=height, autosize=PAD,
        title=alt.TitleParams(
            f"Ring all-reduce on {n} ranks, {exp['numel']} elements: "
            + ("whose data each chunk holds (live run)" if compact else
               "what really moved (live run)"),
            subtitle=[f"{_steps(1, n - 1)}: reduce-scatter · {_steps(n, 2 * (n - 1))}: all-gather "
                      f"(move the 'step' slider)"]
            + ([] if compact else
               ["colour/label: whose data each rank's chunk holds, decoded from the messages"]),
            anchor="start"),
    )


def ring_step_times(exp: dict) -> alt.Chart:
    """Wall time of each ring step on rank 0 in the last timed repeat (ms from the first send),
    coloured by phase. A step is one send + one receive of a 1/N chunk."""
    n = exp["world_size"]
    df = pd.DataFrame([{"step": i, "phase": _phase_of_step(i, n),
                        "start_ms": 1e3 * e["start"], "end_ms": 1e3 * e["end"],
                        "duration_ms": 1e3 * (e["end"] - e["start"]), "bytes": e["bytes"]}
                       for i, e in enumerate(exp["step_times"], start=1)])
    return alt.Chart(df).mark_bar(height=14).encode(
        x=alt.X("start_ms:Q", title="time from the first send (ms)"),
        x2="end_ms:Q",
        y=alt.Y("step:O", title="ring step"),
        color=alt.Color("phase:N", title="phase", scale=alt.Scale(
            domain=list(PHASE_COLORS), range=list(PHASE_COLORS.values()))),
        tooltip=["step:O", "phase:N", alt.Tooltip("duration_ms:Q", format=".3f", title="ms"),
                 alt.Tooltip("bytes:Q", title="bytes sent (payload, counted)")],
    ).properties(autosize=PAD, width=480, height=max(80, 22 * len(df)), title=alt.TitleParams(
        f"Rank 0's {len(df)} ring steps (2(N−1) = {2 * (n - 1)}) on a "
        f"{exp['timed_bytes'] / 2 ** 20:.3g} MiB tensor", anchor="start"))


def bandwidth_bars(exp: dict, link_bandwidth: float | None = None) -> alt.LayerChart:
    """Bus bandwidth (2(N-1)/N * X / time, NCCL's busbw) of our send/recv ring and of the backend's
    own all-reduce on the same tensor. `link_bandwidth` (bytes/s), if given, is drawn as a rule."""
    div, unit = rate_unit(max(exp["busbw_ring"], exp["busbw_backend"], link_bandwidth or 0))
    df = pd.DataFrame([
        {"impl": "our ring (send/recv)", "busbw": exp["busbw_ring"] / div,
         "time_ms": 1e3 * exp["time_ring_s"]},
        {"impl": "backend all_reduce", "busbw": exp["busbw_backend"] / div,
         "time_ms": 1e3 * exp["time_backend_s"]},
    ])
    top = 1.2 * max(df["busbw"].max(), (link_bandwidth or 0) / div)  # room for the labels
    base = alt.Chart(df).encode(
        y=alt.Y("impl:N", title=None, sort=None, axis=alt.Axis(labelLimit=260)),
        x=alt.X("busbw:Q", title=f"bus bandwidth ({unit})", scale=alt.Scale(domain=[0, top])),
        tooltip=["impl:N", alt.Tooltip("busbw:Q", format=".3g", title=unit),
                 alt.Tooltip("time_ms:Q", format=".3f", title="median time (ms)")])
    layers = [base.mark_bar(color="#4c78a8"),
              base.mark_text(align="left", dx=4).encode(text=alt.Text("busbw:Q", format=".3g"))]
    if link_bandwidth:
        rule = pd.DataFrame({"B": [link_bandwidth / div], "label": ["B (link)"]})
        layers.append(alt.Chart(rule).mark_rule(color="#e45756", strokeDash=[4, 3]).encode(
            x="B:Q", tooltip=[alt.Tooltip("B:Q", format=".3g", title=f"B ({unit})")]))
    return alt.layer(*layers).properties(autosize=PAD, width=300, height=90, title=alt.TitleParams(
        f"Bus bandwidth on {exp['world_size']} ranks, {exp['timed_bytes'] / 2 ** 20:.3g} MiB tensor",
        subtitle="busbw = 2(N−1)/N · X / measured time", anchor="start"))


def ring_time_bars(exp: dict, bandwidth: float | None = None) -> alt.LayerChart:
    """All-reduce time: measured (our ring, backend) beside the theory T = 2(N-1)/N * X / B.

    B defaults to the backend's measured bus bandwidth, so that theory bar equals the backend's time
    by construction; the gap to the ring bar is what our Python ring loses against it."""
    from ... import theory  # pure formulas, no torch.distributed

    n, x_bytes = exp["world_size"], exp["timed_bytes"]
    b = bandwidth or exp["busbw_backend"]
    t_theory = theory.ring_all_reduce_time(x_bytes, n, b) if b else 0.0
    bdiv, bunit = rate_unit(b)
    df = pd.DataFrame([
        {"what": "our ring (measured)", "ms": 1e3 * exp["time_ring_s"], "kind": "measured"},
        {"what": "backend all_reduce (measured)", "ms": 1e3 * exp["time_backend_s"], "kind": "measured"},
        {"what": f"theory 2(N−1)/N·X/B, B={b / bdiv:.3g} {bunit}", "ms": 1e3 * t_theory,
         "kind": "theory"},
    ])
    base = alt.Chart(df).encode(
        y=alt.Y("what:N", title=None, sort=None, axis=alt.Axis(labelLimit=260)),
        x=alt.X("ms:Q", title="all-reduce time (ms, median of repeats)",
                scale=alt.Scale(domain=[0, 1.2 * df["ms"].max()])),
        tooltip=["what:N", alt.Tooltip("ms:Q", format=".3f")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("kind:N", title=None, legend=None, scale=alt.Scale(
            domain=["measured", "theory"], range=["#4c78a8", "#bab0ac"]))),
        base.mark_text(align="left", dx=4).encode(text=alt.Text("ms:Q", format=".3g")),
    ).properties(autosize=PAD, width=300, height=110, title=alt.TitleParams(
        f"All-reduce of {x_bytes / 2 ** 20:.3g} MiB on {n} ranks", anchor="start"))


def _fmt_values(values: list, per_line: int = 4) -> str:
    """'[0, 1, 2, 3]'; longer lists wrap every `per_line` values so 8 ranks still fit a screen."""
    parts = [f"{v:g}" for v in values]
    lines = [", ".join(parts[i:i + per_line]) for i in range(0, len(parts), per_line)] or [""]
    return "[" + ",\n ".join(lines) + "]"


def primitives_frame(rows: list[dict], per_line: int | None = None) -> pd.DataFrame:
    """The primitives demo as a table: one row per (op, rank), before/after as short strings
    (wrapped every `per_line` values when given)."""
    def fmt(values):
        return _fmt_values(values, per_line or max(1, len(values)))

    return pd.DataFrame([{"op": r["op"], "rank": r["rank"], "before": fmt(r["before"]),
                          "after": fmt(r["after"]), "wire_bytes_model": r["wire_bytes_model"],
                          "note": r["note"]} for r in rows])


def primitives_table(rows: list[dict]) -> alt.LayerChart:
    """Each collective as two rows (before, after) x one column per rank: the tensor every rank
    held before the call and after it, from the live run; hover for the op's ring-model bytes."""
    df = primitives_frame(rows, per_line=4)
    ops = list(dict.fromkeys(df["op"]))
    long = df.melt(id_vars=["op", "rank", "wire_bytes_model", "note"], value_vars=["before", "after"],
                   var_name="when", value_name="tensor")
    long["row"] = long["op"] + " · " + long["when"]
    order = [f"{op} · {w}" for op in ops for w in ("before", "after")]
    n = df["rank"].nunique()
    longest_line = max(len(line) for t in long["tensor"] for line in t.split("\n"))
    lines = max(t.count("\n") + 1 for t in long["tensor"])
    col_w = max(70, 7 * longest_line)
    base = alt.Chart(long).encode(
        x=alt.X("rank:O", title="rank", axis=alt.Axis(orient="top", labelAngle=0)),
        y=alt.Y("row:N", title="collective · before/after the call", sort=order,
                axis=alt.Axis(labelLimit=220)),
        tooltip=["op:N", "rank:O", "when:N", "tensor:N", "note:N",
                 alt.Tooltip("wire_bytes_model:Q", title="ring-model bytes (this rank, counted)")])
    return alt.layer(
        base.mark_rect(stroke="white").encode(color=alt.Color(
            "when:N", title=None, scale=alt.Scale(domain=["before", "after"],
                                                  range=["#f2f2f2", "#d6e6f5"]))),
        base.mark_text(fontSize=11, lineBreak="\n").encode(text="tensor:N"),
    ).properties(autosize=PAD, width=col_w * n, height=(8 + 14 * lines) * len(order), title=alt.TitleParams(
        f"Collectives on {n} ranks: each rank's tensor before and after (live run)", anchor="start"))
