"""Training without a barrier (lesson 10, the Without a barrier page):

    staleness_histogram(report)   asynchronous SGD: updates per staleness, counted from the
                                  server's records, with theory's mean (W - 1 without a straggler)
                                  and the SSP bound as rules
    loss_against(curves, x)       loss against wall-clock time (measured) or samples, one line per
                                  run (curves: {run name: experiments.barrier_curve(report)})
    step_rates(rows)              updates per second of each run, measured (rows: name, updates_per_s)
    fedavg_rounds(rows, target)   federated averaging: the union loss per round, one line per
                                  (non-IID A, local steps E), the target as a rule
                                  (rows: experiments.fedavg_rounds_to_target)
    bytes_per_sample(rows)        local SGD against DDP: bytes per sample counted, theory, written
                                  to sockets (rows: experiments.local_sgd_bytes)
"""
from __future__ import annotations

import altair as alt
import pandas as pd

from .units import PAD, bytes_unit

RUN_COLORS = ["#e45756", "#4c78a8", "#54a24b", "#f58518", "#b279a2", "#9d755d"]
SOURCES = ["counted", "theory", "measured"]
SOURCE_COLORS = ["#4c78a8", "#bab0ac", "#f58518"]
SOURCE_LABELS = {"counted": "counted (comm records)", "theory": "theory (formula)",
                 "measured": "measured (written to sockets)"}


def staleness_histogram(report: dict, width: int = 420, height: int = 240) -> alt.LayerChart:
    """Bars: how many updates the server applied at each staleness (counted from its records).
    Rules: the counted mean, theory's expected mean where there is one (W - 1 unbounded, (W-1)/2 at
    K = 0) and the bound (W - 1)(2K + 1) where K >= 0."""
    a = report["async"]
    hist = a["staleness_histogram"]
    df = pd.DataFrame([{"staleness": int(s), "updates": n} for s, n in hist.items()])
    W, th = len(a["workers"]), a["theory"]
    top = max(max(map(int, hist)), th.get("bound") or 0) + 0.5
    scale = alt.Scale(domain=[-0.5, top])  # the bars and the rules on one linear axis
    bars = alt.Chart(df).mark_bar(color="#4c78a8", size=18).encode(
        x=alt.X("staleness:Q", title="staleness (versions the gradient did not see)", scale=scale,
                axis=alt.Axis(tickMinStep=1, format="d")),
        y=alt.Y("updates:Q", title="updates (counted)"),
        tooltip=["staleness:Q", "updates:Q"])
    rules = [{"what": f"counted mean {a['staleness_mean']:.2f}", "at": a["staleness_mean"]}]
    if th.get("mean") is not None:
        rules.append({"what": f"theory mean {th['mean']:g}" + (" (W − 1)" if a["max_staleness"] < 0
                                                              else ""), "at": th["mean"]})
    if th.get("bound") is not None:
        rules.append({"what": f"bound (W−1)(2K+1) = {th['bound']}", "at": th["bound"]})
    names = [r["what"] for r in rules]
    marks = alt.Chart(pd.DataFrame(rules)).mark_rule(strokeWidth=3, strokeDash=[6, 3]).encode(
        x=alt.X("at:Q", scale=scale),
        color=alt.Color("what:N", title=None, sort=names,
                        scale=alt.Scale(domain=names, range=["#e45756", "#222222", "#54a24b"]
                                        [:len(names)]),
                        legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=420)),
        tooltip=["what:N"])
    straggler = a.get("straggler")
    sub = (f"{W} workers, " + (f"worker {straggler['rank']} {straggler['factor']:g}× slower"
                              if straggler else "no straggler")
           + (f", K = {a['max_staleness']}" if a["max_staleness"] >= 0 else ", no bound"))
    return alt.layer(bars, marks).properties(
        width=width, height=height, autosize=PAD,
        title=alt.TitleParams("Staleness of the applied updates", subtitle=sub, anchor="start"))


def loss_against(curves: dict, x: str = "time", width: int = 460,
                 height: int = 260) -> alt.Chart:
    """One line per run: the loss against `x`, "time" (seconds on the wall clock, measured) or
    "samples" (sequences trained on). curves: {run name: [{time, samples, loss}, ...]}."""
    rows = [{"run": name, **p} for name, pts in curves.items() for p in pts]
    df = pd.DataFrame(rows)
    names = list(curves)
    title = ("wall-clock time (s, measured)" if x == "time" else "samples (sequences trained on)")
    return alt.Chart(df).mark_line(point=alt.OverlayMarkDef(size=30), strokeWidth=2.5).encode(
        x=alt.X(f"{x}:Q", title=title),
        y=alt.Y("loss:Q", title="loss (nats)", scale=alt.Scale(zero=False)),
        color=alt.Color("run:N", title=None, sort=names,
                        scale=alt.Scale(domain=names, range=RUN_COLORS[:len(names)]),
                        legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=420)),
        tooltip=["run:N", alt.Tooltip(f"{x}:Q", format=".3g"), alt.Tooltip("loss:Q", format=".4f")]
    ).properties(width=width, height=height, autosize=PAD, title=alt.TitleParams(
        "Loss against " + ("the wall clock" if x == "time" else "samples"), anchor="start"))


def step_rates(rows: list[dict], width: int = 420, height: int = 200) -> alt.Chart:
    """Horizontal bars: updates per second of each run (measured on the wall clock)."""
    df = pd.DataFrame([{"run": r["run"], "updates per second": r["updates_per_s"]} for r in rows])
    return alt.Chart(df).mark_bar(color="#4c78a8").encode(
        y=alt.Y("run:N", title=None, sort=None, axis=alt.Axis(labelLimit=260)),
        x=alt.X("updates per second:Q", title="updates per second (measured)"),
        tooltip=["run:N", alt.Tooltip("updates per second:Q", format=".3g")]
    ).properties(width=width, height=height, autosize=PAD,
                 title=alt.TitleParams("Optimizer updates per second", anchor="start"))


def fedavg_rounds(rows: list[dict], target: float | None = None, width: int = 460,
                  height: int = 260) -> alt.LayerChart:
    """The server's loss on the union of the clients' data after each round (measured on the
    run), one line per (A, E); the target loss as a rule."""
    data = [{"run": f"A = {r['non_iid']:g}, E = {r['local_steps']}", "round": i + 1, "loss": x}
            for r in rows for i, x in enumerate(r["union_loss"])]
    names = list(dict.fromkeys(d["run"] for d in data))
    lines = alt.Chart(pd.DataFrame(data)).mark_line(point=True, strokeWidth=2.5).encode(
        x=alt.X("round:O", title="round", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("loss:Q", title="union loss (nats)", scale=alt.Scale(zero=False)),
        color=alt.Color("run:N", title=None, sort=names,
                        scale=alt.Scale(domain=names, range=RUN_COLORS[:len(names)]),
                        legend=alt.Legend(orient="bottom", columns=2, labelLimit=300)),
        tooltip=["run:N", "round:O", alt.Tooltip("loss:Q", format=".4f")])
    layers = [lines]
    if target is not None:
        layers.append(alt.Chart(pd.DataFrame([{"target": target}])).mark_rule(
            strokeDash=[6, 3], color="#222222").encode(y="target:Q"))
    title = "Federated averaging: loss on every client's data, per round"
    return alt.layer(*layers).properties(width=width, height=height, autosize=PAD, title=(
        alt.TitleParams(title, anchor="start") if target is None else
        alt.TitleParams(title, subtitle=f"dashed: the target {target:g}", anchor="start")))


def bytes_per_sample(rows: list[dict], width: int = 460, height: int = 240) -> alt.Chart:
    """Grouped bars per mode (DDP, local SGD at each H): bytes rank 0 sent per sample, counted,
    theory and measured (written to the sockets; absent where it could not be read)."""
    data = [{"mode": r["mode"], "source": SOURCE_LABELS[s], "bytes": r["bytes_per_sample"][s]}
            for r in rows for s in SOURCES if r["bytes_per_sample"].get(s) is not None]
    div, unit = bytes_unit(max(d["bytes"] for d in data))
    for d in data:
        d["value"] = d["bytes"] / div
    labels = [SOURCE_LABELS[s] for s in SOURCES]
    return alt.Chart(pd.DataFrame(data)).mark_bar().encode(
        x=alt.X("mode:N", title=None, sort=None, axis=alt.Axis(labelAngle=0, labelLimit=200)),
        xOffset=alt.XOffset("source:N", sort=labels),
        y=alt.Y("value:Q", title=f"bytes per sample ({unit})"),
        color=alt.Color("source:N", title=None, sort=labels,
                        scale=alt.Scale(domain=labels, range=SOURCE_COLORS),
                        legend=alt.Legend(orient="bottom", direction="vertical")),
        tooltip=["mode:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f")]
    ).properties(width=width, height=height, autosize=PAD,
                 title=alt.TitleParams("Bytes sent per sample (rank 0, over dp)", anchor="start"))
