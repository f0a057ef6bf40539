"""One training run, drawn from its `RunReport.to_dict()` (lesson 02, the Data parallel page):

    loss_curves(report)    loss per step: live run vs the single-process reference
    comm_bytes(report)     bytes per step per rank: the ring model of the calls made (counted
                           from the comm records) vs theory; with written=True also the bytes
                           written to sockets (measured)
    memory_bars(report)    memory per rank by category: measured vs theory, with the live peak
    timeline(report)       Gantt of compute and comm per rank (wall clock)
    bucket_overlap(rows)   each bucket's all-reduce, launch to finish, relative to the end of backward
                           (rows: experiments.bucket_overlap or dp_overlap_experiment's "buckets")
"""
from __future__ import annotations

import altair as alt
import pandas as pd

from .units import PAD, bytes_unit

KIND_ORDER = ["forward", "backward", "grad_sync", "optimizer",
              "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"]
KIND_COLORS = ["#4c78a8", "#f58518", "#b279a2", "#54a24b",
               "#e45756", "#9d755d", "#72b7b2", "#eeca3b", "#ff9da6", "#bab0ac", "#79706e"]
MEMORY_ORDER = ["params", "grads", "optimizer", "transient", "activations_peak"]
MEMORY_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"]


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


COMM_SOURCES = ["measured (written to sockets)", "ring model", "theory"]
COMM_SOURCE_COLORS = ["#4c78a8", "#9ecae9", "#bab0ac"]


def comm_bytes_frame(report: dict, written: bool = False) -> pd.DataFrame:
    """Bytes per training step, per rank and group, summed over the steps and divided by their count.

    written=False: "ring model", the ring model's count of the calls the rank really made (records'
    `wire_bytes_model`: counted, not a socket measurement), beside "theory", the formula for the
    config. written=True (lessons 02, 03, the app's Data parallel page): first "measured (written to
    sockets)", what the rank's process really wrote during its ops (records' `wire_bytes_measured`;
    left out where it cannot be read), then "ring model" and "theory"."""
    steps = max(1, report["config"]["steps"])
    theory_b = report["theory"].get("wire_bytes_per_step", {})
    rows = []
    for r in report["ranks"]:
        model: dict[str, float] = {g: 0.0 for g in theory_b}
        sent: dict[str, float | None] = {g: 0.0 for g in theory_b}
        for rec in r["comm"]:
            if rec["step"] >= 0:
                g = rec["group"]
                model[g] = model.get(g, 0.0) + rec["wire_bytes_model"]
                w, so_far = rec.get("wire_bytes_measured"), sent.get(g, 0.0)
                sent[g] = None if w is None or so_far is None else so_far + w
        for g, b in model.items():
            if written and sent.get(g) is not None:
                rows.append({"rank": r["rank"], "group": g, "source": COMM_SOURCES[0],
                             "bytes": sent[g] / steps})
            rows.append({"rank": r["rank"], "group": g, "source": COMM_SOURCES[1],
                         "bytes": b / steps})
            if g in theory_b:
                rows.append({"rank": r["rank"], "group": g, "source": "theory",
                             "bytes": float(theory_b[g])})
    return pd.DataFrame(rows, columns=["rank", "group", "source", "bytes"])


def comm_bytes(report: dict, written: bool = False) -> alt.LayerChart:
    """Grouped bars per rank (and process group): bytes this rank sent per training step, counted
    from its comm records beside theory's 2(N-1)/N * gradient bytes (data parallel). With
    written=True, the bytes its process really wrote to its sockets come first. The records' count
    is named what it is either way, the ring model of the calls made (see comm_bytes_frame)."""
    df = comm_bytes_frame(report, written)
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    multi = df["group"].nunique() > 1
    df["who"] = ("rank " + df["rank"].astype(str)
                 + (" · " + df["group"] if multi else ""))
    sources = [s for s in COMM_SOURCES if s in set(df["source"])]
    palette = dict(zip(COMM_SOURCES, COMM_SOURCE_COLORS))
    base = alt.Chart(df).encode(
        x=alt.X("who:N", title="rank" + (" · group" if multi else ""),
                axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("value:Q", title=f"{'bytes' if written else 'ring-model bytes'} per step ({unit})",
                scale=alt.Scale(domainMin=0) if df["value"].max() > 0 else alt.Scale(domain=[0, 1])),
        tooltip=["who:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    if written:
        title = "Bytes each rank sends per step: written to sockets, ring model, theory"
        subtitle = ["measured: what the rank's process wrote to its sockets during its ops",
                    "ring model: the calls it made, each counted as a ring sends it; "
                    "theory: the formula for the config"]
    else:
        title = "Bytes each rank sends per step: ring model vs theory"
        subtitle = ["ring model: the calls it made, each counted as a ring sends it (not a socket "
                    "measurement)",
                    "theory: all-reduce of every gradient once per step, 2(N−1)/N · gradient bytes"]
    return alt.layer(
        base.mark_bar().encode(color=alt.Color(
            "source:N", title=None, sort=sources,
            scale=alt.Scale(domain=sources, range=[palette[c] for c in sources]),
            legend=alt.Legend(orient="bottom", labelLimit=300) if written else alt.Legend())),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=max(240, (120 if written else 90) * df["who"].nunique()),
                 height=240, title=alt.TitleParams(title, subtitle=subtitle, anchor="start"))


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
                         "async_op": None, "bytes": None, "written": None,
                         "start_ms": 1e3 * e["start"],
                         "end_ms": 1e3 * e["end"], "cpu_ms": 1e3 * e.get("cpu", 0.0),
                         "waited_until_ms": None})
        for c in r["comm"]:
            if "end" not in c or (keep is not None and c.get("step") not in keep):
                continue
            rows.append({"rank": rk, "lane": f"rank {rk} · comm", "kind": c["op"],
                         "step": c.get("step"), "microbatch": None, "bucket": c.get("bucket"),
                         "async_op": c.get("async_op"), "bytes": c.get("wire_bytes_model"),
                         "written": c.get("wire_bytes_measured"),
                         "start_ms": 1e3 * c["start"], "end_ms": 1e3 * c["end"],
                         "cpu_ms": 1e3 * c.get("cpu", 0.0),
                         "waited_until_ms": 1e3 * c["waited_until"] if "waited_until" in c else None})
    df = pd.DataFrame(rows)
    if len(df):
        df["duration_ms"] = df["end_ms"] - df["start_ms"]
    return df


def timeline(report: dict, steps=None) -> alt.Chart | alt.LayerChart:
    """Gantt chart of what every rank did, as measured (wall clock, ms from the run's start). Two
    lanes per rank: compute (forward, backward, grad_sync = waiting for the gradient all-reduces,
    optimizer) and comm (each collective; bucketed all-reduces start during backward, which is the
    overlap DP buckets buy). `steps`: an int or a list of steps to show (default: all, plus setup)."""
    df = timeline_frame(report, steps)
    lanes = [f"rank {r['rank']} · {k}" for r in report["ranks"] for k in ("compute", "comm")]
    metered = report["ranks"][0].get("metered_step")
    present = set(df["kind"]) if len(df) else set()
    domain = [k for k in KIND_ORDER if k in present] + sorted(present - set(KIND_ORDER))
    palette = dict(zip(KIND_ORDER, KIND_COLORS))
    colors = [palette.get(k, "#999999") for k in domain]
    bars = alt.Chart(df).mark_bar(height=16).encode(
        x=alt.X("start_ms:Q", title="wall time from the run's start (ms)"),
        x2="end_ms:Q",
        y=alt.Y("lane:N", title=None, sort=lanes, axis=alt.Axis(labelLimit=200)),
        color=alt.Color("kind:N", title="op", scale=alt.Scale(domain=domain, range=colors)),
        tooltip=["lane:N", "kind:N", "step:Q", "microbatch:Q", "bucket:Q", "async_op:N",
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes, ring model (counted)"),
                 alt.Tooltip("written:Q", format=",.0f", title="written to sockets (measured)"),
                 alt.Tooltip("start_ms:Q", format=".2f"), alt.Tooltip("end_ms:Q", format=".2f"),
                 alt.Tooltip("duration_ms:Q", format=".2f", title="wall ms"),
                 alt.Tooltip("cpu_ms:Q", format=".2f", title="cpu ms"),
                 alt.Tooltip("waited_until_ms:Q", format=".2f", title="waited until (ms)")],
    )
    subtitle = ["ranks share the CPU cores, so the OS scheduler stretches wall times; "
                "hover for each op's own CPU time"]
    chart = bars
    in_view = df[df["step"] == metered] if len(df) and metered is not None else df.iloc[:0]
    if len(in_view):
        # the memory meter sees every allocation of the last step: its ops run several times slower
        span = pd.DataFrame([{"start_ms": in_view["start_ms"].min(), "end_ms": in_view["end_ms"].max(),
                              "label": f"step {metered}: memory meter on (slower)"}])
        shade = alt.Chart(span).mark_rect(color="#999999", opacity=0.15).encode(
            x="start_ms:Q", x2="end_ms:Q")
        label = alt.Chart(span).mark_text(align="left", baseline="top", dx=3, dy=2, fontSize=11,
                                          color="#555555").encode(x="start_ms:Q", y=alt.value(0),
                                                                  text="label:N")
        chart = alt.layer(shade, bars, label)
        subtitle.append(f"shaded: step {metered}, the one the memory meter watched (every op "
                        f"slower); compare the other steps' times")
    return chart.properties(autosize=PAD, width=640, height=24 * len(lanes), title=alt.TitleParams(
        f"Timeline of {_run_label(report)} on {report['world_size']} ranks (wall clock)",
        subtitle=subtitle, anchor="start"))


def bucket_overlap(rows: list[dict], title: str | None = None) -> alt.LayerChart:
    """One bar per bucket all-reduce (every rank, timed step and run, translucent, so that where
    they pile up the bar is dark): from its launch to its completion as the backend reported it, in
    ms relative to the end of the backward that filled it (0, the black rule; the shaded band, in
    backward's colour, is the median backward). A black tick marks the median launch and finish of each bucket. Left of 0:
    the all-reduce ran before backward returned; right of 0: after it, where only waiting is left.
    `rows`: experiments.bucket_overlap(report), or dp_overlap_experiment(...)["buckets"]."""
    df = pd.DataFrame(rows)
    df["label"] = [f"bucket {b} ({p} grads pending)" for b, p in zip(df["bucket"], df["grads_pending"])]
    labels = list(dict.fromkeys(df.sort_values("bucket")["label"]))
    y = alt.Y("label:N", title=None, sort=labels, axis=alt.Axis(labelLimit=260))
    bars = alt.Chart(df).mark_bar(height=14, opacity=max(0.06, min(0.5, 3 / max(1, len(df) / len(labels))))).encode(
        x=alt.X("launch_ms:Q", title="ms relative to the end of backward (negative: before it ended)"),
        x2="finish_ms:Q", y=y, color=alt.value("#e45756"),
        tooltip=["label:N", "rank:Q", "step:Q", alt.Tooltip("launch_ms:Q", format=".2f"),
                 alt.Tooltip("finish_ms:Q", format=".2f"), alt.Tooltip("allreduce_ms:Q", format=".2f"),
                 alt.Tooltip("overlapped_ms:Q", format=".2f")])
    med = (df.groupby("label", as_index=False)
             .agg(launch_ms=("launch_ms", "median"), finish_ms=("finish_ms", "median")))
    ticks = [alt.Chart(med).mark_tick(color="black", thickness=2, size=18).encode(
        x=alt.X(f"{k}:Q"), y=y, tooltip=["label:N", alt.Tooltip(f"{k}:Q", format=".2f", title=f"median {k}")])
        for k in ("launch_ms", "finish_ms")]
    band = pd.DataFrame([{"start": -float(df["backward_ms"].median()), "end": 0.0,
                          "label": "backward (median)"}])
    shade = alt.Chart(band).mark_rect(color="#f58518", opacity=0.15).encode(x="start:Q", x2="end:Q")
    rule = alt.Chart(pd.DataFrame([{"x": 0.0}])).mark_rule(color="black", strokeWidth=2).encode(x="x:Q")
    text = alt.Chart(band).mark_text(align="right", baseline="top", dx=-3, dy=2, fontSize=11,
                                     color="#555555").encode(x="end:Q", y=alt.value(0),
                                                             text=alt.value("backward ends"))
    n = df.groupby(["run", "rank", "step"]).ngroups if {"run", "rank", "step"} <= set(df) else \
        df.groupby(["rank", "step"]).ngroups
    return alt.layer(shade, bars, *ticks, rule, text).properties(
        autosize=PAD, width=620, height=40 * len(labels) + 20, title=alt.TitleParams(
            title or "When each bucket's all-reduce ran, relative to the end of backward (measured)",
            subtitle=[f"one translucent bar per rank and timed step ({n} in all); black ticks: "
                      f"median launch and finish; shaded: the median backward",
                      "finish: when gloo reported the all-reduce done (a callback), not when the "
                      "rank waited for it"],
            anchor="start"))
