"""Altair chart builders: written once, used by the lessons and by the app.

Every function takes plain data (a `collectives.ring_experiment` dict, `collectives.primitives_demo`
rows, or a `RunReport.to_dict()`) and returns an Altair chart. Nothing here launches ranks or
touches torch.distributed: what is drawn is exactly what the run measured, with the prediction of
`theory` (as carried in the data) beside it.

    ring_animation(exp)    the ring all-reduce step by step, decoded from the probe run's messages
    ring_step_times(exp)   wall time of each of the 2(N-1) ring steps (rank 0, timed run)
    bandwidth_bars(exp)    bus bandwidth: our ring vs the backend's all-reduce
    ring_time_bars(exp)    all-reduce time: measured ring, measured backend, 2(N-1)/N * X / B
    primitives_frame(rows) / primitives_table(rows)   each collective, before and after, per rank
    loss_curves(report)    loss per step: live run vs the single-process reference
    comm_bytes(report)     wire bytes per step per rank: measured vs theory
    memory_bars(report)    memory per rank by category: measured vs theory, with the live peak
    timeline(report)       Gantt of compute and comm per rank (wall clock)
    memory_stages(rows, capacity_bytes)   bytes per GPU by category for ZeRO 0-3 side by side,
                                          against the GPU's capacity (theory)
    memory_measured_vs_theory(rows)       per ZeRO stage: measured bars beside predicted ones
"""
from __future__ import annotations

import altair as alt
import pandas as pd

PHASE_COLORS = {"reduce-scatter": "#4c78a8", "all-gather": "#f58518"}
KIND_ORDER = ["forward", "backward", "grad_sync", "optimizer",
              "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"]
KIND_COLORS = ["#4c78a8", "#f58518", "#b279a2", "#54a24b",
               "#e45756", "#9d755d", "#72b7b2", "#eeca3b", "#ff9da6", "#bab0ac", "#79706e"]
MEMORY_ORDER = ["params", "grads", "optimizer", "transient", "activations_peak"]
MEMORY_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"]
# Every chart keeps the size it asks for, axes and legends added around it (Vega-Lite's default).
# Streamlit otherwise applies "fit", which squeezes charts whose content lies outside the plot.
PAD = alt.AutoSizeParams(type="pad", contains="padding")


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def bytes_unit(max_bytes: float) -> tuple[float, str]:
    """(divisor, name) of the binary unit that keeps `max_bytes` readable: B, KiB or MiB."""
    for div, name in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if max_bytes >= div:
            return div, name
    return 1, "B"


def rate_unit(max_bytes_s: float) -> tuple[float, str]:
    """(divisor, name) for a bandwidth, decimal like NCCL's busbw: GB/s, MB/s or KB/s."""
    for div, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")):
        if max_bytes_s >= div:
            return div, name
    return 1, "B/s"


def ranks_label(mask: int, n: int) -> str:
    """'0+1+3' for the ranks in a bitmask; 'all N' once every rank's data is in."""
    ranks = [r for r in range(n) if mask >> r & 1]
    return f"all {n}" if len(ranks) == n and n > 3 else "+".join(map(str, ranks))


def _ranks_set(mask: int, n: int) -> str:
    return "{" + ", ".join(str(r) for r in range(n) if mask >> r & 1) + "}"


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}–{last}"


def _phase_of_step(step: int, n: int) -> str:
    return "reduce-scatter" if step <= n - 1 else "all-gather"


# ---------------------------------------------------------------------------------------------
# the ring
# ---------------------------------------------------------------------------------------------
def ring_frames_frame(exp: dict) -> pd.DataFrame:
    """One row per (frame, rank, chunk) of the decoded probe run: whose data the chunk holds, and
    whether it was sent or received in that frame's step."""
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
                             "label": ranks_label(mask, n)
                             + (f"\n← from r{mv['src']}" if mv else "")
                             + (f"\n→ to r{sent[(r, c)]['dst']}" if (r, c) in sent else ""),
                             "holds": _ranks_set(mask, n),
                             "received_from": mv["src"] if mv else None,
                             "sent_to": sent[(r, c)]["dst"] if (r, c) in sent else None})
    return pd.DataFrame(rows)


def ring_moves_text(exp: dict) -> list[str]:
    """Per frame, the caption: the step, its phase and every message, as decoded from the run."""
    n, total = exp["world_size"], len(exp["frames"]) - 1
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
    return out


def ring_animation(exp: dict, cell_width: int | None = None, cell_height: int = 40) -> alt.LayerChart:
    """The ring all-reduce, one frame per step, as decoded from the messages of the live probe run.

    Grid: rank (rows) x chunk (columns). Colour: how many ranks' data the chunk holds (1..N); label:
    which ranks ("0+1+3"). Black outline: the chunk this rank received in the step (and from whom);
    orange dashed: the chunk it sent (and to whom). Below the grid, every message of the step. A
    slider ("step") moves through the frames in the browser; frame 0 is the start, frames 1..N-1
    reduce-scatter, N..2(N-1) all-gather."""
    n, frames = exp["world_size"], exp["frames"]
    cells = ring_frames_frame(exp)
    marks = pd.concat([
        cells.dropna(subset=["received_from"]).assign(role="received"),
        cells.dropna(subset=["sent_to"]).assign(role="sent"),
    ])[["frame", "rank", "chunk", "role"]]
    captions = pd.DataFrame({"frame": range(len(frames)), "caption": ring_moves_text(exp)})
    font = 11 if n <= 5 else 10
    cell_width = cell_width or max(78, int(0.62 * font * (2 * n - 1)) + 12)  # fits "0+1+...+6"
    width, height = max(cell_width * n, 330), cell_height * n  # room for the caption below

    step = alt.param(name="step", value=0,
                     bind=alt.binding_range(min=0, max=len(frames) - 1, step=1, name="step "))
    in_frame = alt.datum.frame == step
    x = alt.X("chunk:O", title=f"chunk (1/{n} of the tensor; sizes {exp['chunk_sizes']} elements)",
              axis=alt.Axis(orient="top", labelAngle=0))
    y = alt.Y("rank:O", title="rank (process)")

    fill = alt.Chart(cells).mark_rect(stroke="white", strokeWidth=1).encode(
        x=x, y=y,
        color=alt.Color("contributors:O", title="ranks summed in",
                        scale=alt.Scale(scheme="blues", domain=list(range(1, n + 1)))),
        tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("phase:N"), alt.Tooltip("rank:O"),
                 alt.Tooltip("chunk:O"), alt.Tooltip("holds:N", title="holds data of ranks"),
                 alt.Tooltip("received_from:Q", title="received from rank"),
                 alt.Tooltip("sent_to:Q", title="sent to rank")],
    ).transform_filter(in_frame)
    text = alt.Chart(cells).mark_text(fontSize=font, lineBreak="\n").encode(
        x=x, y=y, text="label:N",
        color=alt.condition(alt.datum.contributors > n / 2, alt.value("white"), alt.value("black")),
    ).transform_filter(in_frame)
    role_stroke = alt.Stroke("role:N", title="this step", scale=alt.Scale(
        domain=["received", "sent"], range=["black", "#f58518"]))
    received = alt.Chart(marks).mark_rect(fill=None, strokeWidth=3).encode(
        x=x, y=y, stroke=role_stroke,
    ).transform_filter(in_frame & (alt.datum.role == "received"))
    sent = alt.Chart(marks).mark_rect(fill=None, strokeWidth=3, strokeDash=[6, 3]).encode(
        x=x, y=y, stroke=role_stroke,
    ).transform_filter(in_frame & (alt.datum.role == "sent"))
    caption = alt.Chart(captions).mark_text(align="left", baseline="top", lineBreak="\n",
                                            fontSize=12, dy=0).encode(
        x=alt.value(0), y=alt.value(height + 10), text="caption:N",
    ).transform_filter(in_frame)

    # autosize "pad": the caption lies below the plot; "fit" would shrink the grid to make room
    return alt.layer(fill, received, sent, text, caption).add_params(step).properties(
        width=width, height=height, autosize=PAD,
        title=alt.TitleParams(
            f"Ring all-reduce on {n} ranks, {exp['numel']} elements: what really moved (live run)",
            subtitle=[f"{_steps(1, n - 1)}: reduce-scatter · {_steps(n, 2 * (n - 1))}: all-gather "
                      f"(move the 'step' slider)",
                      "colour/label: whose data each rank's chunk holds, decoded from the messages"],
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
                 alt.Tooltip("bytes:Q", title="bytes sent")],
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
    from . import theory  # pure formulas, no torch.distributed

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


# ---------------------------------------------------------------------------------------------
# the primitives
# ---------------------------------------------------------------------------------------------
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
                          "after": fmt(r["after"]), "wire_bytes": r["wire_bytes"],
                          "note": r["note"]} for r in rows])


def primitives_table(rows: list[dict]) -> alt.LayerChart:
    """Each collective as two rows (before, after) x one column per rank: the tensor every rank
    held before the call and after it, from the live run; hover for the op's wire bytes."""
    df = primitives_frame(rows, per_line=4)
    ops = list(dict.fromkeys(df["op"]))
    long = df.melt(id_vars=["op", "rank", "wire_bytes", "note"], value_vars=["before", "after"],
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
                 alt.Tooltip("wire_bytes:Q", title="wire bytes (this rank)")])
    return alt.layer(
        base.mark_rect(stroke="white").encode(color=alt.Color(
            "when:N", title=None, scale=alt.Scale(domain=["before", "after"],
                                                  range=["#f2f2f2", "#d6e6f5"]))),
        base.mark_text(fontSize=11, lineBreak="\n").encode(text="tensor:N"),
    ).properties(autosize=PAD, width=col_w * n, height=(8 + 14 * lines) * len(order), title=alt.TitleParams(
        f"Collectives on {n} ranks: each rank's tensor before and after (live run)", anchor="start"))


# ---------------------------------------------------------------------------------------------
# a training run (RunReport.to_dict())
# ---------------------------------------------------------------------------------------------
def _run_label(report: dict) -> str:
    c = report["config"]
    label = f"dp={c['dp']}"
    if c["dp"] > 1:
        label += f" {c['dp_mode']}"
    if c.get("grad_accum", 1) > 1:
        label += f", grad-accum {c['grad_accum']}"
    return label


def loss_curves(report: dict) -> alt.LayerChart:
    """Global loss per step of the live run, and of the single-process reference on the same data
    when the run had `reference=True` (dashed). Equal within fp32 rounding if the strategy is right."""
    rows = [{"step": i, "loss": v, "run": f"{_run_label(report)} (measured, "
                                           f"{report['world_size']} ranks)"}
            for i, v in enumerate(report["losses"])]
    ref = report.get("reference_losses")
    if ref:
        rows += [{"step": i, "loss": v, "run": "single process (reference)"}
                 for i, v in enumerate(ref)]
    df = pd.DataFrame(rows)
    runs = list(dict.fromkeys(df["run"]))
    base = alt.Chart(df).encode(
        x=alt.X("step:O", title="training step", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("loss:Q", title="loss (cross-entropy, nats)", scale=alt.Scale(zero=False)),
        color=alt.Color("run:N", title=None, sort=runs,
                        scale=alt.Scale(domain=runs, range=["#4c78a8", "#e45756"][:len(runs)]),
                        legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=420)),
        tooltip=["run:N", "step:O", alt.Tooltip("loss:Q", format=".6f")])
    # measured underneath, thick; the reference on top, thin and dashed: where they agree (as they
    # must), both stay visible
    measured = base.mark_line(strokeWidth=5, opacity=0.6, point=alt.OverlayMarkDef(size=90)
                              ).transform_filter(alt.datum.run == runs[0])
    reference = base.mark_line(strokeWidth=1.5, strokeDash=[6, 4], point=alt.OverlayMarkDef(size=20)
                               ).transform_filter(alt.datum.run != runs[0])
    diff = report.get("max_abs_diff")
    subtitle = (f"max |measured − reference| over losses and final parameters: {diff:.2e}"
                if diff is not None else "no reference run (run with reference=True to compare)")
    return alt.layer(measured, reference).properties(autosize=PAD, width=460, height=260, title=alt.TitleParams(
        "Loss per step: live run vs single-process reference", subtitle=subtitle, anchor="start"))


def comm_bytes_frame(report: dict) -> pd.DataFrame:
    """Wire bytes per training step, per rank and group: measured (the rank's comm records of the
    steps, summed and divided by the step count) and theory (report['theory'])."""
    steps = max(1, report["config"]["steps"])
    theory_b = report["theory"].get("wire_bytes_per_step", {})
    rows = []
    for r in report["ranks"]:
        measured: dict[str, float] = {g: 0.0 for g in theory_b}
        for rec in r["comm"]:
            if rec["step"] >= 0:
                measured[rec["group"]] = measured.get(rec["group"], 0.0) + rec["wire_bytes"]
        for g, b in measured.items():
            rows.append({"rank": r["rank"], "group": g, "source": "measured", "bytes": b / steps})
            if g in theory_b:
                rows.append({"rank": r["rank"], "group": g, "source": "theory",
                             "bytes": float(theory_b[g])})
    return pd.DataFrame(rows, columns=["rank", "group", "source", "bytes"])


def comm_bytes(report: dict) -> alt.LayerChart:
    """Grouped bars per rank (and process group): bytes this rank put on the wire per training step,
    measured from its comm records beside theory's 2(N-1)/N * gradient bytes."""
    df = comm_bytes_frame(report)
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    multi = df["group"].nunique() > 1
    df["who"] = ("rank " + df["rank"].astype(str)
                 + (" · " + df["group"] if multi else ""))
    base = alt.Chart(df).encode(
        x=alt.X("who:N", title="rank" + (" · group" if multi else ""),
                axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("source:N", sort=["measured", "theory"]),
        y=alt.Y("value:Q", title=f"wire bytes per step ({unit})",
                scale=alt.Scale(domainMin=0) if df["value"].max() > 0 else alt.Scale(domain=[0, 1])),
        tooltip=["who:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color(
            "source:N", title=None, scale=alt.Scale(domain=["measured", "theory"],
                                                    range=["#4c78a8", "#bab0ac"]))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=max(240, 90 * df["who"].nunique()), height=240, title=alt.TitleParams(
        "Bytes each rank sends per step: measured vs theory",
        subtitle="theory: all-reduce of every gradient once per step, 2(N−1)/N · gradient bytes",
        anchor="start"))


def memory_frame(report: dict) -> pd.DataFrame:
    """Bytes per rank by category (measured), plus theory's model states for one replica."""
    rows = []
    for r in report["ranks"]:
        for cat in MEMORY_ORDER:
            if cat in r["memory"]:
                rows.append({"who": f"rank {r['rank']}", "category": cat, "source": "measured",
                             "bytes": r["memory"][cat], "total_peak": r["memory"].get("total_peak")})
    for cat, b in report["theory"].get("memory", {}).items():
        rows.append({"who": "theory (each rank)", "category": cat, "source": "theory",
                     "bytes": b, "total_peak": None})
    return pd.DataFrame(rows)


def memory_bars(report: dict) -> alt.LayerChart:
    """Stacked bars per rank of the memory it measured by category (params, grads, optimizer state,
    transient bucket buffers, peak saved activations), a tick at the measured peak of all live
    bytes, and theory's params/grads/optimizer beside them."""
    df = memory_frame(report)
    peaks = df.dropna(subset=["total_peak"]).drop_duplicates("who")[["who", "total_peak"]]
    div, unit = bytes_unit(max(df.groupby("who")["bytes"].sum().max(),
                               peaks["total_peak"].max() if len(peaks) else 0))
    df["value"] = df["bytes"] / div
    peaks = peaks.assign(value=peaks["total_peak"] / div, label="live peak")
    whos = list(dict.fromkeys(df["who"]))
    x = alt.X("who:N", title=None, sort=whos, axis=alt.Axis(labelAngle=0, labelLimit=160))
    bars = alt.Chart(df).mark_bar().encode(
        x=x, y=alt.Y("value:Q", title=f"memory ({unit})", stack="zero"),
        color=alt.Color("category:N", title="category", sort=MEMORY_ORDER,
                        scale=alt.Scale(domain=MEMORY_ORDER, range=MEMORY_COLORS)),
        order=alt.Order("cat_index:Q"),
        tooltip=["who:N", "category:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")],
    ).transform_calculate(cat_index=f"indexof({MEMORY_ORDER}, datum.category)")
    tick = alt.Chart(peaks).mark_tick(color="black", thickness=3, size=60).encode(
        x=x, y="value:Q",
        tooltip=["who:N", alt.Tooltip("total_peak:Q", format=",.0f", title="live peak (bytes)")])
    tick_text = alt.Chart(peaks).mark_text(dy=-8, fontSize=10).encode(x=x, y="value:Q", text="label:N")
    return alt.layer(bars, tick, tick_text).properties(
        autosize=PAD,
        width=max(260, 100 * len(whos)), height=280, title=alt.TitleParams(
            "Memory per rank: measured by category vs theory",
            subtitle=["theory: fp32 params 4Ψ, grads 4Ψ, Adam moments 8Ψ bytes (Ψ = parameters)",
                      "tick: measured peak of all live bytes during the last step"],
            anchor="start"))


def timeline_frame(report: dict, steps=None) -> pd.DataFrame:
    """One row per op: compute events (forward/backward/grad_sync/optimizer) and comm records, with
    a lane per rank and kind of work, times in ms from the run's start."""
    if steps is not None and isinstance(steps, int):
        steps = [steps]
    keep = None if steps is None else set(steps)
    rows = []
    for r in report["ranks"]:
        rk = r["rank"]
        for e in r["events"]:
            if keep is not None and e.get("step") not in keep:
                continue
            rows.append({"rank": rk, "lane": f"rank {rk} · compute", "kind": e["kind"],
                         "step": e.get("step"), "microbatch": e.get("microbatch"), "bucket": None,
                         "async_op": None, "bytes": None, "start_ms": 1e3 * e["start"],
                         "end_ms": 1e3 * e["end"], "cpu_ms": 1e3 * e.get("cpu", 0.0),
                         "waited_until_ms": None})
        for c in r["comm"]:
            if "end" not in c or (keep is not None and c.get("step") not in keep):
                continue
            rows.append({"rank": rk, "lane": f"rank {rk} · comm", "kind": c["op"],
                         "step": c.get("step"), "microbatch": None, "bucket": c.get("bucket"),
                         "async_op": c.get("async_op"), "bytes": c.get("wire_bytes"),
                         "start_ms": 1e3 * c["start"], "end_ms": 1e3 * c["end"],
                         "cpu_ms": 1e3 * c.get("cpu", 0.0),
                         "waited_until_ms": 1e3 * c["waited_until"] if "waited_until" in c else None})
    df = pd.DataFrame(rows)
    if len(df):
        df["duration_ms"] = df["end_ms"] - df["start_ms"]
    return df


def timeline(report: dict, steps=None) -> alt.Chart:
    """Gantt chart of what every rank did, as measured (wall clock, ms from the run's start). Two
    lanes per rank: compute (forward, backward, grad_sync = waiting for the gradient all-reduces,
    optimizer) and comm (each collective; bucketed all-reduces start during backward, which is the
    overlap DP buckets buy). `steps`: an int or a list of steps to show (default: all, plus setup)."""
    df = timeline_frame(report, steps)
    lanes = [f"rank {r['rank']} · {k}" for r in report["ranks"] for k in ("compute", "comm")]
    present = set(df["kind"]) if len(df) else set()
    domain = [k for k in KIND_ORDER if k in present] + sorted(present - set(KIND_ORDER))
    palette = dict(zip(KIND_ORDER, KIND_COLORS))
    colors = [palette.get(k, "#999999") for k in domain]
    return alt.Chart(df).mark_bar(height=16).encode(
        x=alt.X("start_ms:Q", title="wall time from the run's start (ms)"),
        x2="end_ms:Q",
        y=alt.Y("lane:N", title=None, sort=lanes, axis=alt.Axis(labelLimit=200)),
        color=alt.Color("kind:N", title="op", scale=alt.Scale(domain=domain, range=colors)),
        tooltip=["lane:N", "kind:N", "step:Q", "microbatch:Q", "bucket:Q", "async_op:N",
                 alt.Tooltip("bytes:Q", format=",.0f", title="wire bytes"),
                 alt.Tooltip("start_ms:Q", format=".2f"), alt.Tooltip("end_ms:Q", format=".2f"),
                 alt.Tooltip("duration_ms:Q", format=".2f", title="wall ms"),
                 alt.Tooltip("cpu_ms:Q", format=".2f", title="cpu ms"),
                 alt.Tooltip("waited_until_ms:Q", format=".2f", title="waited until (ms)")],
    ).properties(autosize=PAD, width=640, height=24 * len(lanes), title=alt.TitleParams(
        f"Timeline of {_run_label(report)} on {report['world_size']} ranks (wall clock)",
        subtitle="ranks share the CPU cores, so the OS scheduler stretches wall times; "
                 "hover for each op's own CPU time", anchor="start"))


# ---------------------------------------------------------------------------------------------
# memory per GPU across ZeRO stages (rows of plain dicts: the memory page and the ZeRO lesson)
# ---------------------------------------------------------------------------------------------
STAGE_CATEGORIES = ["params", "grads", "optimizer", "transient", "activations"]
STAGE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"]
HOST_COLOR = "#9d755d"


def decimal_bytes_unit(max_bytes: float) -> tuple[float, str]:
    """(divisor, name) in decimal units, as GPU capacities and the ZeRO paper's table count: GB, MB, KB."""
    for div, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if max_bytes >= div:
            return div, name
    return 1, "B"


def _stage_unit(max_bytes: float, decimal: bool) -> tuple[float, str]:
    return decimal_bytes_unit(max_bytes) if decimal else bytes_unit(max_bytes)


def memory_stages_frame(rows: list[dict], capacity_bytes: float | None = None) -> pd.DataFrame:
    """`rows`: {stage, category, bytes} per GPU (category `host` = offloaded to CPU RAM, not on the
    GPU). Adds `where` (GPU / host) and, per stage, the GPU total and whether it fits."""
    df = pd.DataFrame(rows, columns=["stage", "category", "bytes"])
    df["where"] = df["category"].map(lambda c: "host (CPU RAM)" if c == "host" else "GPU")
    gpu_total = df[df["where"] == "GPU"].groupby("stage")["bytes"].sum()
    df["gpu_total"] = df["stage"].map(gpu_total).fillna(0.0)
    if capacity_bytes:
        df["fits"] = df["gpu_total"] <= capacity_bytes
    return df


def memory_stages(rows: list[dict], capacity_bytes: float | None = None,
                  selected: str | None = None, decimal: bool = True,
                  title: str = "Memory per GPU by ZeRO stage",
                  subtitle: str | list[str] = "") -> alt.LayerChart:
    """Stacked bars per ZeRO stage of the bytes one GPU holds (params, grads, optimizer states,
    activations), ZeRO-Offload's host bytes as a separate brown bar beside the GPU bar, and a red
    rule at the GPU's capacity with "fits" / "does not fit" above each GPU bar. `decimal`: GB/MB
    (the capacity's units) or, for toy models, binary MiB/KiB. `selected` stage drawn opaque."""
    df = memory_stages_frame(rows, capacity_bytes)
    stages = list(dict.fromkeys(df["stage"]))
    top_bytes = max(df.groupby(["stage", "where"])["bytes"].sum().max(), capacity_bytes or 0)
    div, unit = _stage_unit(top_bytes, decimal)
    df["value"] = df["bytes"] / div
    has_host = bool((df["where"] != "GPU").any() and df.loc[df["where"] != "GPU", "bytes"].sum() > 0)
    if not has_host:
        df = df[df["where"] == "GPU"]
    cats = [c for c in STAGE_CATEGORIES if c in set(df["category"])] + (["host"] if has_host else [])
    colors = [dict(zip(STAGE_CATEGORIES, STAGE_COLORS)).get(c, HOST_COLOR) for c in cats]
    x = alt.X("stage:N", title=None, sort=stages, axis=alt.Axis(labelAngle=0, labelFontSize=12))
    offset = {"xOffset": alt.XOffset("where:N", sort=["GPU", "host (CPU RAM)"])} if has_host else {}
    opacity = (alt.condition(alt.datum.stage == selected, alt.value(1.0), alt.value(0.45))
               if selected else alt.value(1.0))
    bars = alt.Chart(df).mark_bar().encode(
        x=x, **offset,
        y=alt.Y("value:Q", title=f"memory per GPU ({unit})", stack="zero",
                scale=alt.Scale(domain=[0, 1.15 * top_bytes / div])),
        color=alt.Color("category:N", title="category", sort=cats,
                        scale=alt.Scale(domain=cats, range=colors)),
        order=alt.Order("cat_index:Q"), opacity=opacity,
        tooltip=["stage:N", "where:N", "category:N",
                 alt.Tooltip("value:Q", format=",.4g", title=unit),
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes")],
    ).transform_calculate(cat_index=f"indexof({cats}, datum.category)")
    totals = (df[df["where"] == "GPU"].drop_duplicates("stage")
              [["stage", "gpu_total"] + (["fits"] if capacity_bytes else [])].copy())
    totals["value"] = totals["gpu_total"] / div
    totals["label"] = totals["value"].map(lambda v: f"{v:.4g} {unit}")
    if capacity_bytes:
        totals["label"] += totals["fits"].map(lambda f: " · fits" if f else " · does not fit")
    totals["where"] = "GPU"
    labels = alt.Chart(totals).mark_text(dy=-8, fontSize=11, fontWeight="bold").encode(
        x=x, **offset, y="value:Q", text="label:N",
        color=(alt.condition(alt.datum.fits, alt.value("#2e7d32"), alt.value("#c62828"))
               if capacity_bytes else alt.value("black")))
    layers = [bars, labels]
    if has_host:  # the offloaded bytes live in CPU RAM: say so above their bar
        host = df[df["where"] != "GPU"].groupby(["stage", "where"], as_index=False)["value"].sum()
        host["label"] = host["value"].map(lambda v: f"{v:.4g} {unit} in CPU RAM")
        layers.append(alt.Chart(host[host["value"] > 0]).mark_text(dy=-8, fontSize=10).encode(
            x=x, **offset, y="value:Q", text="label:N", color=alt.value(HOST_COLOR)))
    if capacity_bytes:
        cap = pd.DataFrame({"value": [capacity_bytes / div],
                            "label": [f"GPU capacity {capacity_bytes / div:.4g} {unit}"]})
        # named in its own legend entry: a label on the plot would collide with some bar's label
        layers.append(alt.Chart(cap).mark_rule(strokeDash=[6, 4], strokeWidth=2).encode(
            y="value:Q", tooltip=["label:N"],
            stroke=alt.Stroke("label:N", title=None,
                              scale=alt.Scale(domain=list(cap["label"]), range=["#c62828"]))))
    return alt.layer(*layers).properties(
        autosize=PAD, width=150 * len(stages), height=300,
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def memory_measured_vs_theory_frame(rows: list[dict]) -> pd.DataFrame:
    """`rows`: {stage, category, source ('measured' | 'predicted'), bytes}. Adds, per stage and
    category, `difference` = measured - predicted (None where one side has no value)."""
    df = pd.DataFrame(rows, columns=["stage", "category", "source", "bytes"])
    wide = df.pivot_table(index=["stage", "category"], columns="source", values="bytes",
                          aggfunc="sum")
    diff = (wide.get("measured") - wide.get("predicted")) if {"measured", "predicted"} <= set(
        wide.columns) else None
    if diff is not None:
        df["difference"] = [diff.get((s, c)) for s, c in zip(df["stage"], df["category"])]
    return df


def memory_measured_vs_theory(rows: list[dict], peaks: list[dict] | None = None,
                              title: str = "Memory per GPU: measured (live run) vs predicted",
                              subtitle: str | list[str] = "") -> alt.LayerChart:
    """Per ZeRO stage, two stacked bars: what rank 0's meters measured by category (params, grads,
    optimizer, transient comm buffers, peak saved activations; host bytes under ZeRO-Offload) and
    what theory predicts (model states: `theory.model_state_bytes`; activations: Korthikanti's
    estimate). `peaks`: {stage, bytes} of the measured peak of all live bytes, drawn as a tick on
    the measured bar. Units: binary (MiB/KiB), the toy's scale."""
    df = memory_measured_vs_theory_frame(rows)
    stages = list(dict.fromkeys(df["stage"]))
    peaks_df = pd.DataFrame(peaks or [], columns=["stage", "bytes"])
    top = max(df.groupby(["stage", "source"])["bytes"].sum().max(),
              peaks_df["bytes"].max() if len(peaks_df) else 0)
    div, unit = bytes_unit(top)
    df["value"] = df["bytes"] / div
    cats = ([c for c in STAGE_CATEGORIES if c in set(df["category"])]
            + (["host"] if "host" in set(df["category"]) else []))
    colors = [dict(zip(STAGE_CATEGORIES, STAGE_COLORS)).get(c, HOST_COLOR) for c in cats]
    # stage names sit below the "measured / predicted" captions drawn under each pair of bars
    x = alt.X("stage:N", title=None, sort=stages,
              axis=alt.Axis(labelAngle=0, labelFontSize=12, labelPadding=20, ticks=False))
    xoff = alt.XOffset("source:N", sort=["measured", "predicted"])
    tooltip = ["stage:N", "source:N", "category:N",
               alt.Tooltip("bytes:Q", format=",.0f", title="bytes")]
    if "difference" in df:
        tooltip.append(alt.Tooltip("difference:Q", format="+,.0f", title="measured − predicted"))
    bars = alt.Chart(df).mark_bar(stroke="white", strokeWidth=0.5).encode(
        x=x, xOffset=xoff,
        y=alt.Y("value:Q", title=f"memory per GPU ({unit})", stack="zero"),
        color=alt.Color("category:N", title="category", sort=cats,
                        scale=alt.Scale(domain=cats, range=colors)),
        opacity=alt.Opacity("source:N", title="bar", sort=["measured", "predicted"],
                            scale=alt.Scale(domain=["measured", "predicted"], range=[1.0, 0.5])),
        order=alt.Order("cat_index:Q"), tooltip=tooltip,
    ).transform_calculate(cat_index=f"indexof({cats}, datum.category)")
    which = df.drop_duplicates(["stage", "source"])[["stage", "source"]].copy()
    which["value"] = 0.0
    which["label"] = which["source"].map({"measured": "measured", "predicted": "predicted"})
    names = alt.Chart(which).mark_text(baseline="top", dy=4, fontSize=10, color="#555").encode(
        x=x, xOffset=xoff, y="value:Q", text="label:N")
    layers = [bars, names]
    if len(peaks_df):
        peaks_df = peaks_df.assign(value=peaks_df["bytes"] / div, source="measured")
        layers.append(alt.Chart(peaks_df).mark_tick(color="black", thickness=3, size=40).encode(
            x=x, xOffset=xoff, y="value:Q",
            tooltip=["stage:N", alt.Tooltip("bytes:Q", format=",.0f",
                                            title="measured peak of all live bytes")]))
    return alt.layer(*layers).properties(
        autosize=PAD, width=170 * len(stages), height=300,
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


# ---------------------------------------------------------------------------------------------
# activations per layer by checkpointing mode (the memory lesson, section 6)
# ---------------------------------------------------------------------------------------------
ACTIVATION_SOURCES = ["measured", "ours (exact)", "Korthikanti et al."]
ACTIVATION_COLORS = ["#4c78a8", "#9ecae9", "#bab0ac"]


def _bars_by_source(df: pd.DataFrame, group: str, x_title, y_title: str, width_per: int,
                    title: str, subtitle) -> alt.LayerChart:
    """Grouped bars: one group per value of `group`, one bar per ACTIVATION_SOURCES entry."""
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    groups = list(dict.fromkeys(df[group]))
    sources = [s for s in ACTIVATION_SOURCES if s in set(df["source"])]
    colors = [dict(zip(ACTIVATION_SOURCES, ACTIVATION_COLORS))[s] for s in sources]
    base = alt.Chart(df).encode(
        x=alt.X(f"{group}:N", title=x_title, sort=groups,
                axis=alt.Axis(labelAngle=0, labelFontSize=12, labelLimit=220)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("value:Q", title=f"{y_title} ({unit})"),
        tooltip=[f"{group}:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources,
                                               scale=alt.Scale(domain=sources, range=colors))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=width_per * len(groups), height=260,
                 title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def activation_bars(rows: list[dict], title: str = "Activation bytes per transformer layer",
                    subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per checkpointing mode (none, selective, full): the measured bytes one layer
    keeps for backward (difference of two live runs with L and L+1 layers) beside this library's
    exact count (`theory.gpt_activation_bytes_per_layer`) and Korthikanti et al.'s estimate
    (`theory.activation_bytes_per_layer`). `rows`: {mode, source, bytes}, source one of
    ACTIVATION_SOURCES."""
    df = pd.DataFrame(rows, columns=["mode", "source", "bytes"])
    return _bars_by_source(df, "mode", "activation checkpointing", "bytes kept per layer", 130,
                           title, subtitle)


# --- tensor parallel ---
# ---------------------------------------------------------------------------------------------
# tensor parallel (the tensor-parallel page and lesson): weight shards, comm by layer tag,
# activations per layer with and without sequence parallel, step-comm time per link
# ---------------------------------------------------------------------------------------------
TP_COMM_KINDS = {  # (layer tag, op) -> legend label, in drawing order
    ("g", "all_reduce"): "g: all-reduce, forward, after a row-parallel layer",
    ("f", "all_reduce"): "f: all-reduce, backward, before a column-parallel layer",
    ("sp", "all_gather"): "SP: all-gather, before a column-parallel layer (bwd: reduce-scatter)",
    ("sp", "reduce_scatter"): "SP: reduce-scatter, after a row-parallel layer (bwd: all-gather)",
    ("ce", "all_reduce"): "ce: vocab-parallel cross-entropy (max, target, sum exp)",
    ("sp-grads", "all_reduce"): "sp-grads: LayerNorm / bias / position grads summed over tp",
}
TP_COMM_COLORS = ["#4c78a8", "#9ecae9", "#f58518", "#ffbf79", "#54a24b", "#b279a2"]
TP_ACTIVATION_SOURCES = ACTIVATION_SOURCES  # the same three sources, per tp/SP setting


def time_unit(max_seconds: float) -> tuple[float, str]:
    """(divisor, name) that keeps a duration readable: s, ms or µs."""
    for div, name in ((1.0, "s"), (1e-3, "ms")):
        if max_seconds >= div:
            return div, name
    return 1e-6, "µs"


def weight_shard_cells(weight, rank: int, matrix: str, row_start: int = 0, col_start: int = 0,
                       block: int = 1) -> list[dict]:
    """One rank's shard of a weight as heatmap cells in the *full* matrix's coordinates: each cell
    the mean of a `block` x `block` patch (1: every weight), with its row/column index range."""
    import numpy as np

    w = np.asarray(weight, dtype=np.float64)
    rows, cols = w.shape
    label = f"rank {rank}: [{row_start}:{row_start + rows}, {col_start}:{col_start + cols}]"
    cells = []
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            cells.append({"matrix": matrix, "rank": rank, "panel": label,
                          "shard_rows": rows, "shard_cols": cols,
                          "row0": row_start + i, "row1": row_start + min(i + block, rows),
                          "col0": col_start + j, "col1": col_start + min(j + block, cols),
                          "value": float(w[i:i + block, j:j + block].mean())})
    return cells


def tp_weight_shards_frame(shards: list[dict], max_cells: int = 64) -> pd.DataFrame:
    """`shards`: {rank, matrix ('fc' | 'proj'), weight (2-D), row_start, col_start, full_shape}.
    One row per heatmap cell; patches are averaged so that the full matrix's long side has at most
    `max_cells` cells (the same patch size for every rank and both matrices)."""
    longest = max(max(s["full_shape"]) for s in shards)
    block = max(1, -(-longest // max_cells))
    rows = [c for s in shards for c in weight_shard_cells(
        s["weight"], s["rank"], s["matrix"], s["row_start"], s["col_start"], block)]
    df = pd.DataFrame(rows)
    df["block"] = block
    return df


def tp_weight_shards(shards: list[dict], title: str = "MLP weight shards, as the ranks hold them",
                     subtitle: str | list[str] = "", cell_px: int = 7,
                     max_cells: int = 64) -> alt.HConcatChart:
    """The seed's picture redrawn from a live run's shards. Left: the MLP's fc weight [4h, h]
    (column-parallel: rank r holds rows r*4h/t..(r+1)*4h/t, its slice of the output features),
    one panel per rank stacked in place. Right: proj [h, 4h] (row-parallel: rank r holds the
    matching columns, its slice of the input features), panels side by side. Axes: the full
    matrix's indices, so the panels laid together are the whole weight. Colour: the weight value
    (patch mean when the matrix is larger than `max_cells`)."""
    df = tp_weight_shards_frame(shards, max_cells)
    block = int(df["block"].iloc[0])
    m = float(df["value"].abs().max()) or 1.0
    color = alt.Color("value:Q", title="weight value", scale=alt.Scale(
        scheme="redblue", domain=[-m, m], reverse=True), legend=alt.Legend(orient="bottom"))
    tooltip = ["panel:N", alt.Tooltip("row0:Q", title="first row"),
               alt.Tooltip("col0:Q", title="first column"),
               alt.Tooltip("value:Q", format=".4f",
                           title="weight" + (" (patch mean)" if block > 1 else ""))]
    charts = []
    for matrix, facet_dim in (("fc", "row"), ("proj", "column")):
        part = df[df["matrix"] == matrix]
        shape = next(s["full_shape"] for s in shards if s["matrix"] == matrix)
        panels = list(dict.fromkeys(part.sort_values("rank")["panel"]))
        n = len(panels)
        rows_cells = -(-shape[0] // block) // (n if facet_dim == "row" else 1)
        cols_cells = -(-shape[1] // block) // (n if facet_dim == "column" else 1)
        out_in = ("output feature (row)", "input feature (column)")
        base = alt.Chart(part).mark_rect().encode(
            x=alt.X("col0:Q", title=out_in[1], scale=alt.Scale(zero=False, nice=False)),
            x2="col1:Q",
            y=alt.Y("row0:Q", title=out_in[0],
                    scale=alt.Scale(zero=False, nice=False, reverse=True)),
            y2="row1:Q", color=color, tooltip=tooltip,
        ).properties(width=cols_cells * cell_px, height=rows_cells * cell_px)
        header = alt.Header(labelAngle=0, labelAlign="left", labelFontSize=11, labelOrient="top",
                            titleFontSize=12)
        name = (f"fc.weight [{shape[0]}, {shape[1]}], column-parallel: split by rows"
                if matrix == "fc" else
                f"proj.weight [{shape[0]}, {shape[1]}], row-parallel: split by columns")
        if facet_dim == "row":
            chart = base.facet(row=alt.Row("panel:N", sort=panels, title=None, header=header),
                               spacing=12).resolve_scale(y="independent")
        else:
            chart = base.facet(column=alt.Column("panel:N", sort=panels, title=None, header=header),
                               spacing=12).resolve_scale(x="independent")
        charts.append(chart.properties(title=alt.TitleParams(name, fontSize=12, anchor="start")))
    sub = ([subtitle] if isinstance(subtitle, str) and subtitle else list(subtitle or []))
    if block > 1:
        sub.append(f"each cell: the mean of a {block}×{block} patch of weights")
    # svg, not canvas: Streamlit switches to canvas above 2,000 marks unless told, and the shards'
    # panels should stay inspectable (and testable) as SVG
    return alt.hconcat(*charts, spacing=30).resolve_scale(color="shared").properties(
        autosize=PAD, title=alt.TitleParams(title, subtitle=sub, anchor="start"),
        usermeta={"embedOptions": {"renderer": "svg"}})


def tp_comm_frame(rows: list[dict]) -> pd.DataFrame:
    """`rows`: {run, layer, op, calls, bytes} per step (one rank); adds the legend label."""
    df = pd.DataFrame(rows, columns=["run", "layer", "op", "calls", "bytes"])
    df["kind"] = [TP_COMM_KINDS.get((lay, op), f"{lay}: {op}")
                  for lay, op in zip(df["layer"], df["op"])]
    return df


def tp_comm_by_layer(rows: list[dict], theory_bytes: dict[str, float],
                     title: str = "Tensor-parallel bytes per step, by layer tag: "
                                  "measured vs theory",
                     subtitle: str | list[str] = "") -> alt.LayerChart:
    """One stacked bar per run (e.g. SP off, SP on): the wire bytes one rank put on the tp group
    per training step, split by what sent them (the comm records' layer tag and op). The black
    tick on each bar: `theory.tp_wire_bytes_per_step` of that run (`theory_bytes`: run -> bytes)."""
    df = tp_comm_frame(rows)
    runs = list(dict.fromkeys(df["run"]))
    totals = df.groupby("run", as_index=False)["bytes"].sum()
    th = pd.DataFrame([{"run": r, "bytes": float(b)} for r, b in theory_bytes.items()],
                      columns=["run", "bytes"])
    top_bytes = max(totals["bytes"].max() if len(totals) else 0,
                    th["bytes"].max() if len(th) else 0)
    div, unit = bytes_unit(top_bytes)
    df["value"] = df["bytes"] / div
    kinds = [k for k in TP_COMM_KINDS.values() if k in set(df["kind"])] + sorted(
        set(df["kind"]) - set(TP_COMM_KINDS.values()))
    palette = dict(zip(TP_COMM_KINDS.values(), TP_COMM_COLORS))
    y = alt.Y("run:N", title=None, sort=runs, axis=alt.Axis(labelLimit=200, labelFontSize=12))
    top = 1.3 * top_bytes / div
    bars = alt.Chart(df).mark_bar(height=28).encode(
        y=y, x=alt.X("value:Q", title=f"wire bytes per step, one rank ({unit})", stack="zero",
                     scale=alt.Scale(domain=[0, top or 1])),
        color=alt.Color("kind:N", title="sent by", sort=kinds, scale=alt.Scale(
            domain=kinds, range=[palette.get(k, "#bab0ac") for k in kinds]),
            legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=520)),
        order=alt.Order("kind_index:Q"),
        tooltip=["run:N", "kind:N", alt.Tooltip("calls:Q", format=".3g", title="calls per step"),
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes per step")],
    ).transform_calculate(kind_index=f"indexof({kinds}, datum.kind)")
    totals["value"] = totals["bytes"] / div
    totals["label"] = totals["bytes"].map(lambda b: f"measured {b:,.0f} B")
    total_text = alt.Chart(totals).mark_text(align="left", dx=6, fontSize=11).encode(
        y=y, x="value:Q", text="label:N")
    layers = [bars, total_text]
    if len(th):
        th["value"] = th["bytes"] / div
        th["label"] = th["bytes"].map(lambda b: f"theory {b:,.0f} B")
        layers.append(alt.Chart(th).mark_tick(color="black", thickness=3, size=40).encode(
            y=y, x="value:Q", tooltip=["run:N", alt.Tooltip("bytes:Q", format=",.0f",
                                                             title="theory (bytes per step)")]))
        layers.append(alt.Chart(th).mark_text(align="left", dx=6, dy=13, fontSize=10, color="#555")
                      .encode(y=y, x="value:Q", text="label:N"))
    return alt.layer(*layers).properties(
        autosize=PAD, width=520, height=70 * len(runs),
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def tp_activation_bars(rows: list[dict],
                       title: str = "Activation bytes per layer on one rank",
                       subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per setting (e.g. tp = 1, tp = t, tp = t + SP): the bytes one transformer
    layer keeps for backward on one rank, measured (difference of live runs with L and L+1
    layers) beside this library's exact count and Korthikanti et al.'s estimate. `rows`:
    {setting, source, bytes}, source one of ACTIVATION_SOURCES."""
    df = pd.DataFrame(rows, columns=["setting", "source", "bytes"])
    return _bars_by_source(df, "setting", None, "activation bytes per layer, one rank", 170,
                           title, subtitle)


def tp_link_times(rows: list[dict], compute_s: float | None = None,
                  title: str = "Tensor-parallel comm time per step, by link",
                  subtitle: str | list[str] = "") -> alt.LayerChart:
    """Horizontal bars: seconds the tp traffic of one step takes on each link. `rows`:
    {link, seconds, source ('predicted' = bytes / link bandwidth, 'measured' = this machine)}.
    `compute_s`, if given: a dashed rule at the step's compute time, to compare against."""
    df = pd.DataFrame(rows, columns=["link", "seconds", "source"])
    top = max(df["seconds"].max() if len(df) else 0, compute_s or 0)
    div, unit = time_unit(top)
    df["value"] = df["seconds"] / div
    df["label"] = df["value"].map(lambda v: f"{v:.3g} {unit}")
    links = list(dict.fromkeys(df["link"]))
    y = alt.Y("link:N", title=None, sort=links, axis=alt.Axis(labelLimit=280, labelFontSize=12))
    x = alt.X("value:Q", title=f"time per step ({unit})",
              scale=alt.Scale(domain=[0, 1.25 * top / div or 1]))
    base = alt.Chart(df).encode(y=y, x=x, tooltip=["link:N", "source:N", alt.Tooltip(
        "seconds:Q", format=".3g", title="seconds")])
    sources = [x for x in ("predicted", "measured") if x in set(df["source"])]
    palette = {"predicted": "#4c78a8", "measured": "#bab0ac"}
    layers = [base.mark_bar(height=18).encode(color=alt.Color(
                  "source:N", title=None,
                  legend=alt.Legend(orient="bottom") if len(sources) > 1 else None,
                  scale=alt.Scale(domain=sources, range=[palette[x] for x in sources]))),
              base.mark_text(align="left", dx=4, fontSize=11).encode(text="label:N")]
    if compute_s:
        rule = pd.DataFrame({"value": [compute_s / div],
                             "label": [f"compute {compute_s / div:.3g} {unit}"]})
        layers.append(alt.Chart(rule).mark_rule(color="#e45756", strokeDash=[6, 4], strokeWidth=2)
                      .encode(x="value:Q", tooltip=["label:N"]))
        layers.append(alt.Chart(rule).mark_text(color="#e45756", align="left", dx=4, dy=-6,
                                                baseline="bottom").encode(
            x="value:Q", y=alt.value(0), text="label:N"))
    return alt.layer(*layers).properties(
        autosize=PAD, width=460, height=30 * len(links),
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


# --- pipeline parallel ---
# ---------------------------------------------------------------------------------------------
# pipeline parallel (the pipeline page and lesson): the schedule as a Gantt chart per rank,
# the bubble measured vs the formula, the bytes each stage holds in flight
# ---------------------------------------------------------------------------------------------
PIPE_KINDS = {"F": "F: forward", "B": "B: backward", "W": "W: weight gradients",
              "send": "sending to a neighbour", "wait": "waiting for a neighbour",
              "idle": "idle (bubble)"}
PIPE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#79706e", "#bab0ac", "#fbe3e3"]


def _idle_gaps(timed: list[dict], end: float) -> list[dict]:
    """The stretches of [0, end] in which a rank ran no op: what the bubble is made of."""
    gaps = []
    for rank in sorted({t["rank"] for t in timed}):
        t = 0.0
        for op in sorted((x for x in timed if x["rank"] == rank), key=lambda x: x["start"]):
            if op["start"] > t + 1e-12:
                gaps.append({"rank": rank, "kind": "idle", "microbatch": None, "chunk": None,
                             "start": t, "end": op["start"]})
            t = max(t, op["end"])
        if end > t + 1e-12:
            gaps.append({"rank": rank, "kind": "idle", "microbatch": None, "chunk": None,
                         "start": t, "end": end})
    return gaps


def pipeline_frame(timed: list[dict], seconds: bool = True) -> pd.DataFrame:
    """Rows for pipeline_timeline: every op plus the idle gaps between them, in ms when the times
    are seconds (a replay or a wall view) or as they are (a schedule drawn with unit costs)."""
    end = max((t["end"] for t in timed), default=0.0)
    rows = [dict(t) for t in timed if t["kind"] in PIPE_KINDS]
    rows += _idle_gaps(rows, end)  # neither computing nor (wall view) waiting
    df = pd.DataFrame(rows, columns=["rank", "kind", "microbatch", "chunk", "start", "end"])
    scale = 1e3 if seconds else 1.0
    df["x"], df["x2"] = df["start"] * scale, df["end"] * scale
    df["lane"] = df["rank"].map(lambda r: f"rank {r}")
    df["what"] = df["kind"].map(PIPE_KINDS)
    chunks = df["chunk"].dropna()
    several = len(chunks) and chunks.nunique() > df["rank"].nunique()
    df["label"] = [("" if k in ("idle", "wait", "send") or m is None or m != m else
                    f"{int(m)}" + (f".{int(c)}" if several else ""))
                   for k, m, c in zip(df["kind"], df["microbatch"], df["chunk"])]
    return df


def _labels_fit(df: pd.DataFrame, width: int, x_max: float | None) -> bool:
    """Whether most op bars are wide enough for their label (a digit is about 6.5 px)."""
    ops = df[df["label"] != ""]
    span = x_max or (df["x2"].max() if len(df) else 0)
    if not len(ops) or not span:
        return True
    wide = (ops["x2"] - ops["x"]) / span * width >= 6.5 * ops["label"].str.len() + 2
    return wide.mean() >= 0.8


def pipeline_timeline(timed: list[dict], title: str, subtitle: str | list[str] = "",
                      seconds: bool = True, width: int = 640, x_max: float | None = None) -> alt.LayerChart:
    """Gantt chart of a pipeline step, one lane per rank: F, B, W ops labelled with their
    micro-batch (".chunk" when a rank holds several chunks), sends and waits (wall view), idle gaps.
    `timed`: records {rank, kind, microbatch, chunk, start, end} from schedules.simulate,
    trace.own_device_replay or trace.wall_view. `seconds=False` for unit-cost schedules.
    `x_max`: a common time axis, to set two charts side by side on one scale."""
    df = pipeline_frame(timed, seconds)
    lanes = [f"rank {r}" for r in sorted(df["rank"].unique())]
    kinds = [k for k in PIPE_KINDS if k in set(df["kind"])]
    colors = [dict(zip(PIPE_KINDS, PIPE_COLORS))[k] for k in kinds]
    unit = "ms" if seconds else "time units (one forward = 1)"
    x_scale = alt.Scale(domain=[0, x_max]) if x_max else alt.Undefined
    base = alt.Chart(df).encode(
        x=alt.X("x:Q", title=f"time from the step's start ({unit})", scale=x_scale),
        y=alt.Y("lane:N", title=None, sort=lanes))
    bars = base.mark_bar(height=22, stroke="white", strokeWidth=0.5).encode(
        x2="x2:Q",
        color=alt.Color("what:N", title=None, sort=[PIPE_KINDS[k] for k in kinds],
                        scale=alt.Scale(domain=[PIPE_KINDS[k] for k in kinds], range=colors),
                        legend=alt.Legend(orient="bottom", columns=3)),
        tooltip=["lane:N", "what:N", "microbatch:Q", "chunk:Q",
                 alt.Tooltip("x:Q", format=".3g", title=f"start ({'ms' if seconds else 'units'})"),
                 alt.Tooltip("x2:Q", format=".3g", title=f"end ({'ms' if seconds else 'units'})")])
    labels = alt.Chart(df[df["label"] != ""]).mark_text(color="white", fontSize=10).encode(
        x=alt.X("mid:Q", scale=x_scale), y=alt.Y("lane:N", sort=lanes), text="label:N"
    ).transform_calculate(mid="(datum.x + datum.x2) / 2")
    if not _labels_fit(df, width, x_max):  # crowded: the tooltip still names every op
        subtitle = [*([subtitle] if isinstance(subtitle, str) and subtitle else subtitle or []),
                    "too many ops to label: hover a bar for its micro-batch"]
        return alt.layer(bars).properties(autosize=PAD, width=width, height=34 * len(lanes),
                                          title=alt.TitleParams(title, subtitle=subtitle,
                                                                anchor="start"))
    return alt.layer(bars, labels).properties(
        autosize=PAD, width=width, height=34 * len(lanes),
        title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def pipeline_stage_bars(rows: list[dict], value: str, title: str, subtitle, y_title: str,
               label: str | None = None, palette: list[str] | None = None) -> alt.LayerChart:
    """Grouped bars per stage: one bar per `source` (a schedule, or measured / theory); bar labels
    from the column `label`, else the value."""
    df = pd.DataFrame(rows)
    div, unit = bytes_unit(df[value].max() if len(df) else 0)
    df["y"] = df[value] / div
    sources = list(dict.fromkeys(df["source"]))
    palette = palette or ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]
    base = alt.Chart(df).encode(
        x=alt.X("stage:N", title="pipeline stage (rank)", axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("y:Q", title=f"{y_title} ({unit})"),
        tooltip=["stage:N", "source:N", alt.Tooltip(f"{value}:Q", format=",.0f", title="bytes")]
        + ([f"{label}:N"] if label else []))
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=sources,
                                               scale=alt.Scale(domain=sources,
                                                               range=palette[:len(sources)]),
                                               legend=alt.Legend(orient="bottom"))),
        base.mark_text(dy=-5, fontSize=10).encode(
            text=alt.Text(f"{label}:N") if label else alt.Text("y:Q", format=".3g")),
    ).properties(autosize=PAD, width=max(240, 48 * df["stage"].nunique() * len(sources)),
                 height=240, title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def bubble_bars(rows: list[dict], title: str = "Pipeline bubble: measured vs formula",
                subtitle: str | list[str] = "") -> alt.LayerChart:
    """Grouped bars per schedule: the bubble fraction measured in the own-device replay, on the
    wall clock, and the formula's. `rows`: {schedule, source, bubble (0..1)}."""
    df = pd.DataFrame(rows, columns=["schedule", "source", "bubble"])
    df["percent"] = 100 * df["bubble"]
    groups = list(dict.fromkeys(df["schedule"]))
    order = [s for s in ("measured (own device)", "measured (wall clock)", "formula")
             if s in set(df["source"])] + sorted(set(df["source"]) - {
                 "measured (own device)", "measured (wall clock)", "formula"})
    palette = {"measured (own device)": "#4c78a8", "measured (wall clock)": "#bab0ac",
               "formula": "#e45756"}
    base = alt.Chart(df).encode(
        x=alt.X("schedule:N", title=None, sort=groups, axis=alt.Axis(labelAngle=0, labelFontSize=12)),
        xOffset=alt.XOffset("source:N", sort=order),
        y=alt.Y("percent:Q", title="share of the step a rank is idle (%)",
                scale=alt.Scale(domain=[0, 100])),
        tooltip=["schedule:N", "source:N", alt.Tooltip("percent:Q", format=".1f", title="%")])
    return alt.layer(
        base.mark_bar().encode(color=alt.Color("source:N", title=None, sort=order, scale=alt.Scale(
            domain=order, range=[palette.get(s, "#9d755d") for s in order]),
            legend=alt.Legend(orient="bottom"))),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("percent:Q", format=".1f")),
    ).properties(autosize=PAD, width=max(160, 110 * len(groups)), height=260,
                 title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


def in_flight_frame(report: dict) -> pd.DataFrame:
    """Bytes each pipeline rank holds beyond its model states after every op of the metered
    (last) step: activations waiting for their backward, queued W inputs, messages."""
    rows = []
    for r in report["ranks"]:
        if r["coords"].get("dp", 0) or "pp" not in r["coords"]:
            continue
        ops = [e for e in r["events"] if "held_bytes" in e]
        for i, e in enumerate(ops):
            rows.append({"stage": f"rank {r['coords']['pp']}", "op_index": i + 1,
                         "op": f"{e['kind']}{e['microbatch']}", "held_bytes": e["held_bytes"]})
    return pd.DataFrame(rows, columns=["stage", "op_index", "op", "held_bytes"])


def in_flight_chart(report: dict, title: str | None = None,
                    subtitle: str | list[str] = "") -> alt.Chart:
    """Step lines: bytes held in flight per pipeline rank after each of its ops (measured)."""
    df = in_flight_frame(report)
    div, unit = bytes_unit(df["held_bytes"].max() if len(df) else 0)
    df["value"] = df["held_bytes"] / div
    schedule = report["config"].get("schedule")
    return alt.Chart(df).mark_line(interpolate="step-after", point=True).encode(
        x=alt.X("op_index:Q", title="op of the step on this rank (F, B, W in schedule order)"),
        y=alt.Y("value:Q", title=f"held beyond model states ({unit})"),
        color=alt.Color("stage:N", title=None, legend=alt.Legend(orient="bottom")),
        tooltip=["stage:N", "op:N", alt.Tooltip("held_bytes:Q", format=",.0f", title="bytes")],
    ).properties(autosize=PAD, width=420, height=220, title=alt.TitleParams(
        title or f"Activation memory in flight per stage ({schedule}, measured)",
        subtitle=subtitle, anchor="start"))
