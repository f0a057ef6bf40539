"""Mixture of experts and expert parallel (lesson 07, the Experts page): every chart drawn from a
live run's report (`launch.run(RunConfig(experts=E, top_k=k, ep=P, ...))`, a RunReport or its
`to_dict()`), the formula beside it where there is one.

    routing_heatmap(report, rank, layer, step)   tokens x experts of one micro-batch: which experts
                                                 each token chose (first, second, ... choice) and
                                                 which assignments were dropped (over capacity)
    expert_load(report, layer, step, rank)       assignments per expert in one step, kept and
                                                 dropped stacked, against the capacity
    load_over_steps(report, layer)               per step: the busiest expert over the mean (1 =
                                                 balanced), the dropped fraction, the aux loss;
                                                 a {name: report} dict draws several runs
    all_to_all_matrix(report, step, phase,       bytes rank i sent rank j in the expert-parallel
                      direction)                 all-to-alls of one step (own rows: not sent)
    all_to_all_vs_uniform(report)                bytes each rank sent per step, written to
                                                 sockets (measured) and counted from its splits,
                                                 beside theory.ep_wire_bytes_per_step (uniform)
    expert_memory(report)                        model states per rank, measured beside theory,
                                                 and theory with the experts replicated (ep = 1)

Data helpers: moe_layers(report), moe_steps(report), expert_load_frame(...),
load_balance_frame(...), load_balance_table(report, layer),
all_to_all_bytes(report, step, phase, direction), expert_memory_frame(report).

What the report holds (parallel/expert.py, moe.py): per rank, `moe.log` one entry per MoE layer
forward (routed and kept assignments per expert, dropped, capacity per sequence, aux and z losses;
the first micro-batch of a step also its tokens' choices and whether each was kept: a sample of
at most 512 tokens, of every step of a short run and of at most 17 steps of a long one,
`routing_steps`), and the
all-to-all records (layer "moe", phase counts / dispatch / combine, pass backward, in_splits).
Tensor-parallel ranks route the same tokens: sums "over all ranks" count each token once (tp 0);
with sequence parallel each tp rank routes its own shard of the sequences (all ranks count).
"""
from __future__ import annotations

from types import SimpleNamespace

import altair as alt
import pandas as pd

from ... import theory as _theory
from .units import PAD, bytes_unit

CHOICE_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#9d755d", "#ff9da6",
                 "#bab0ac"]  # first, second, ... choice
DROPPED_COLOR = "#d62728"
LOAD_STATUS = ["kept", "dropped"]
LOAD_COLORS = ["#4c78a8", DROPPED_COLOR]
RUN_COLORS = ["#e45756", "#4c78a8", "#54a24b", "#f58518", "#b279a2"]
A2A_PHASES = ("counts", "dispatch", "combine")
STATE_ORDER = ["params", "grads", "optimizer"]
STATE_COLORS = ["#4c78a8", "#f58518", "#54a24b"]


def _ordinal(i: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(i, f"{i}th")


# ---------------------------------------------------------------------------------------------
# reading the report
# ---------------------------------------------------------------------------------------------
def _as_dict(report) -> dict:
    return report.to_dict() if hasattr(report, "to_dict") else report


def _log(rank: dict) -> list[dict]:
    return rank.get("moe", {}).get("log", [])


def moe_layers(report) -> list[int]:
    """The blocks with a mixture of experts that logged on some rank, in order."""
    rep = _as_dict(report)
    return sorted({e["layer"] for r in rep["ranks"] for e in _log(r)})


def moe_steps(report) -> list[int]:
    """The training steps the MoE logs cover, in order."""
    rep = _as_dict(report)
    return sorted({e["step"] for r in rep["ranks"] for e in _log(r) if e["step"] is not None})


def routing_steps(report, rank: int = 0, layer: int | None = None) -> list[int]:
    """The steps whose token-by-token routing `rank` kept for `layer` (the routing chart's
    steps): every step of a short run; of a long one, a sample of at most
    meters.ROUTING_SAMPLE_STEPS + 1, the last step always among them (the counts per expert are
    logged for every step)."""
    rep = _as_dict(report)
    layer = _layer(rep, layer)
    return sorted({e["step"] for e in _log(rep["ranks"][rank])
                   if e["layer"] == layer and "choices" in e and e["step"] is not None})


def _layer(report, layer: int | None) -> int:
    layers = moe_layers(report)
    if not layers:
        raise ValueError("this run has no mixture-of-experts layer (run with --experts E)")
    if layer is None:
        return layers[0]
    if layer not in layers:
        raise ValueError(f"layer {layer} is not a mixture-of-experts layer of this run: {layers}")
    return layer


def _step(report, step: int | None) -> int:
    steps = moe_steps(report)
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"step {step} is not in the run: steps {steps[0]}..{steps[-1]}")
    return step


def _data_ranks(rep: dict, rank: int | None) -> list[dict]:
    """The ranks whose tokens count: `rank` alone, or every rank with its own tokens (tensor-
    parallel ranks route the same tokens: tp 0 only; with sequence parallel, their own shards)."""
    if rank is not None:
        return [rep["ranks"][rank]]
    if rep["config"].get("sp"):
        return list(rep["ranks"])
    return [r for r in rep["ranks"] if r["coords"].get("tp", 0) == 0]


def _entries(rep: dict, ranks: list[dict], layer: int, step: int) -> list[dict]:
    return [e for r in ranks for e in _log(r) if e["layer"] == layer and e["step"] == step]


def _sequences(rep: dict, entry: dict) -> float:
    """Sequences (routing groups) in a log entry: its assignments / (k x tokens per sequence). A
    rank holding parts of sequences (cp, sp) counts those fractions: summed over ranks, whole."""
    c = rep["config"]
    return sum(entry["routed"]) / (c["top_k"] * c["seq"])


def _experts_per_rank(rep: dict) -> int:
    return rep["config"]["experts"] // rep["config"].get("ep", 1)


def _fmt_b(b: float) -> str:
    div, unit = bytes_unit(b)
    return f"{b / div:.3g} {unit}" if div > 1 else f"{b:,.0f} B"


# ---------------------------------------------------------------------------------------------
# routing: who chose which expert
# ---------------------------------------------------------------------------------------------
def routing_frame(report, rank: int = 0, layer: int | None = None,
                  step: int | None = None) -> pd.DataFrame:
    """One row per (token, choice) of `rank`'s first micro-batch of `step` in `layer`: token index
    (sequences x positions, flattened), sequence, position, expert, choice (1 = most probable),
    kept (False: over the expert's capacity, dropped). Under context or sequence parallel a rank
    holds part of each sequence: `position` is the token's place in the whole sequence, as the
    run logged it."""
    rep = _as_dict(report)
    layer, step = _layer(rep, layer), _step(rep, step)
    first = [e for e in _entries(rep, [rep["ranks"][rank]], layer, step) if "choices" in e]
    if not first and _entries(rep, [rep["ranks"][rank]], layer, step):
        raise ValueError(f"rank {rank} kept the token-by-token routing of layer {layer} for "
                         f"steps {routing_steps(rep, rank, layer)}, not step {step} (a long run's "
                         f"log keeps a sample of steps; the counts per expert are in every step)")
    if not first:
        raise ValueError(f"rank {rank} did not run layer {layer} in step {step} (with pipeline "
                         "parallel a rank holds only its stage's layers)")
    e = first[0]
    where = e.get("positions") or list(range(rep["config"]["seq"]))  # this rank's positions
    n = len(where)
    rows = [{"token": t, "sequence": t // n, "position": where[t % n], "expert": x,
             "choice": j + 1, "kept": bool(keep)}
            for t, (xs, keeps) in enumerate(zip(e["choices"], e["kept_mask"]))
            for j, (x, keep) in enumerate(zip(xs, keeps))]
    return pd.DataFrame(rows, columns=["token", "sequence", "position", "expert", "choice", "kept"])


def _expert_label(rep: dict, e: int) -> str:
    P = rep["config"].get("ep", 1)
    return f"expert {e}" + (f" · ep rank {e // _experts_per_rank(rep)}" if P > 1 else "")


def routing_heatmap(report, rank: int = 0, layer: int | None = None, step: int | None = None,
                    width: int | None = None) -> alt.LayerChart:
    """Tokens (x: index in `rank`'s first micro-batch of the step, sequence after sequence) x
    experts (y): a cell where a token chose an expert, coloured by the choice's rank (1st = most
    probable), and a red cross on the assignments dropped because the expert's queue for that
    sequence was full (capacity is per sequence: grey rules separate the sequences). Measured: the
    router's own choices as the run logged them. Defaults: the first MoE layer, the last step."""
    rep = _as_dict(report)
    layer, step = _layer(rep, layer), _step(rep, step)
    df = routing_frame(rep, rank, layer, step)
    c = rep["config"]
    E, k, seq = c["experts"], c["top_k"], c["seq"]
    tokens = int(df["token"].max()) + 1 if len(df) else 0
    df["x2"] = df["token"] + 1
    df["choice_label"] = df["choice"].map(lambda j: f"{_ordinal(j)} choice")
    df["expert_label"] = df["expert"].map(lambda e: _expert_label(rep, e))
    df["status"] = df["kept"].map({True: "kept", False: "dropped (over capacity)"})
    choices = [f"{_ordinal(j)} choice" for j in range(1, k + 1)]
    experts = [_expert_label(rep, e) for e in range(E)]
    x = alt.X("token:Q", title=f"token of rank {rank}'s first micro-batch (sequence after "
                              f"sequence, {seq} tokens each)",
              scale=alt.Scale(domain=[0, tokens], nice=False))
    y = alt.Y("expert_label:N", title=None, sort=experts, scale=alt.Scale(domain=experts))
    tip = ["token:Q", "sequence:Q", "position:Q", "expert:Q", "choice_label:N", "status:N"]
    cells = alt.Chart(df).mark_rect().encode(
        x=x, x2="x2:Q", y=y,
        color=alt.Color("choice_label:N", title="choice", sort=choices,
                        scale=alt.Scale(domain=choices, range=CHOICE_COLORS[:k])),
        opacity=alt.condition(alt.datum.kept, alt.value(1.0), alt.value(0.35)), tooltip=tip)
    dropped = df[~df["kept"]].assign(mid=lambda d: d["token"] + 0.5)
    crosses = alt.Chart(dropped).mark_point(shape="cross", filled=True, size=40, angle=45).encode(
        x=alt.X("mid:Q"), y=y, tooltip=tip,
        fill=alt.Fill("status:N", title=None, scale=alt.Scale(
            domain=["dropped (over capacity)"], range=[DROPPED_COLOR])),
        stroke=alt.value(DROPPED_COLOR))
    bounds = pd.DataFrame({"token": list(range(seq, tokens, seq))})
    rules = alt.Chart(bounds).mark_rule(color="#888", strokeDash=[2, 2]).encode(x="token:Q")
    n_drop, n_all = int((~df["kept"]).sum()), len(df)
    cap = next(e for e in _entries(rep, [rep["ranks"][rank]], layer, step) if "choices" in e)
    shown, routed = cap.get("tokens_sampled", [tokens, tokens])
    sample = "" if shown == routed else f", the first {shown} of the {routed} it routed"
    return alt.layer(cells, rules, crosses).properties(
        autosize=PAD, width=width or max(360, min(900, 4 * tokens)), height=max(120, 26 * E),
        title=alt.TitleParams(
            f"Routing of rank {rank}'s tokens{sample}, layer {layer}, step {step} (measured)",
            subtitle=[f"{tokens} tokens ({max(1, tokens // seq)} sequences) × top-{k}: {n_all} "
                      f"assignments, {n_drop} dropped; capacity {cap['capacity']} per expert per "
                      "sequence (ceil(F · s · k / E))",
                      "faded cell with a red cross: the expert's queue for that sequence was "
                      "full (1st choices queue before 2nd choices)"], anchor="start"))


# ---------------------------------------------------------------------------------------------
# load per expert, and over steps
# ---------------------------------------------------------------------------------------------
def expert_load_frame(report, layer: int | None = None, step: int | None = None,
                      rank: int | None = None) -> tuple[pd.DataFrame, int]:
    """(rows {expert, status (kept | dropped), assignments}, capacity): the step's assignments per
    expert summed over micro-batches and over `rank` (None: every rank with its own tokens), and
    the capacity for those tokens (capacity per sequence x sequences)."""
    rep = _as_dict(report)
    layer, step = _layer(rep, layer), _step(rep, step)
    entries = _entries(rep, _data_ranks(rep, rank), layer, step)
    E = rep["config"]["experts"]
    routed, kept = [0] * E, [0] * E
    for e in entries:
        routed = [a + b for a, b in zip(routed, e["routed"])]
        kept = [a + b for a, b in zip(kept, e["kept"])]
    cap = round(sum(e["capacity"] * _sequences(rep, e) for e in entries))
    rows = [{"expert": x, "status": "kept", "assignments": kept[x]} for x in range(E)]
    rows += [{"expert": x, "status": "dropped", "assignments": routed[x] - kept[x]}
             for x in range(E)]
    return pd.DataFrame(rows, columns=["expert", "status", "assignments"]), cap


def expert_load(report, layer: int | None = None, step: int | None = None,
                rank: int | None = None) -> alt.LayerChart:
    """Bars per expert: the token assignments routed to it in one step (summed over micro-batches,
    and over all ranks when `rank` is None), kept below, dropped stacked above, and a rule at the
    capacity (slots per sequence x sequences). Measured: the routers' counts as logged."""
    rep = _as_dict(report)
    layer, step = _layer(rep, layer), _step(rep, step)
    df, cap = expert_load_frame(rep, layer, step, rank)
    E = rep["config"]["experts"]
    df["expert_label"] = df["expert"].map(lambda e: _expert_label(rep, e))
    experts = [_expert_label(rep, e) for e in range(E)]
    total = int(df["assignments"].sum())
    dropped = int(df.loc[df["status"] == "dropped", "assignments"].sum())
    x = alt.X("expert_label:N", title=None, sort=experts,  # "expert e" over "ep rank p"
              axis=alt.Axis(labelAngle=0, labelExpr="split(datum.label, ' · ')"))
    top = max(cap, int(df.groupby("expert")["assignments"].sum().max()) if len(df) else 0)
    bars = alt.Chart(df).mark_bar().encode(
        x=x, y=alt.Y("assignments:Q", stack="zero", title="token assignments in the step",
                     scale=alt.Scale(domain=[0, 1.15 * top])),
        color=alt.Color("status:N", title=None, sort=LOAD_STATUS,
                        scale=alt.Scale(domain=LOAD_STATUS, range=LOAD_COLORS),
                        legend=alt.Legend(orient="bottom")),
        order=alt.Order("order:Q"),
        tooltip=["expert_label:N", "status:N", "assignments:Q"],
    ).transform_calculate(order=f"indexof({LOAD_STATUS}, datum.status)")
    line = pd.DataFrame({"capacity": [cap], "label": [f"capacity {cap}"]})
    rule = alt.Chart(line).mark_rule(color="black", strokeDash=[6, 4], strokeWidth=2).encode(
        y="capacity:Q", tooltip=["label:N"])
    width = max(260, 60 * E)
    text = alt.Chart(line).mark_text(align="left", dx=4, fontSize=11, fontWeight="bold").encode(
        y="capacity:Q", text="label:N", x=alt.value(width))  # right of the plot, clear of bars
    who = "all ranks" if rank is None else f"rank {rank}"
    return alt.layer(bars, rule, text).properties(
        autosize=PAD, width=width, height=260, title=alt.TitleParams(
            f"Load per expert, layer {layer}, step {step}, {who} (measured)",
            subtitle=[f"{total} assignments (tokens × k), {dropped} dropped; fair share "
                      f"{total / E:.4g} per expert",
                      "capacity: slots per expert per sequence × the sequences routed"],
            anchor="start"))


def _balance_rows(rep: dict, layer: int | None) -> list[dict]:
    layer = _layer(rep, layer)
    ranks = _data_ranks(rep, None)
    out = []
    for step in moe_steps(rep):
        entries = _entries(rep, ranks, layer, step)
        if not entries:
            continue
        routed = [sum(x) for x in zip(*(e["routed"] for e in entries))]
        seqs = [_sequences(rep, e) for e in entries]
        mean = sum(routed) / len(routed)
        out.append({"step": step, "max_over_mean": max(routed) / mean if mean else 0.0,
                    "dropped": sum(e["dropped"] for e in entries),
                    "aux": sum(e["aux"] * n for e, n in zip(entries, seqs)) / max(1, sum(seqs)),
                    "assignments": sum(routed)})
    return out


def load_balance_table(report, layer: int | None = None) -> list[dict]:
    """Per step, over every rank with its own tokens and every micro-batch: max_over_mean (the
    busiest expert's assignments over the mean, 1 = balanced), dropped (assignments dropped) and
    aux (the load-balancing loss, mean over the sequences)."""
    return [{k: row[k] for k in ("step", "max_over_mean", "dropped", "aux")}
            for row in _balance_rows(_as_dict(report), layer)]


_METRICS = {  # column -> (panel title, y title)
    "max_over_mean": ("Busiest expert ÷ mean", "assignments, max ÷ mean over experts"),
    "dropped_fraction": ("Dropped assignments", "fraction of assignments dropped"),
    "aux": ("Load-balancing loss", "aux loss (1 = uniform)"),
}


def load_balance_frame(report, layer: int | None = None) -> pd.DataFrame:
    """load_balance_table for one report or several ({name: report}), with a `run` column, the
    assignments of the step and the dropped fraction (dropped / assignments)."""
    rows = []
    for name, rep in _named(report).items():
        for row in _balance_rows(_as_dict(rep), layer):
            rows.append({"run": name, **row,
                         "dropped_fraction": row["dropped"] / max(1, row["assignments"])})
    return pd.DataFrame(rows, columns=["run", "step", "max_over_mean", "dropped", "aux",
                                       "assignments", "dropped_fraction"])


def _named(report) -> dict:
    """{name: report}: a dict of reports as it is, one report as {"run": report}."""
    if isinstance(report, dict) and "config" not in report:
        return report
    return {"run": report}


def load_over_steps(report, layer: int | None = None, width: int = 230) -> alt.HConcatChart:
    """Three small panels over the training steps: the busiest expert's assignments over the mean
    (1 = every expert equally loaded), the fraction of assignments dropped, and the load-balancing
    loss (1 when routing is uniform, up to E when collapsed). Measured: the routers' logs, summed
    over ranks and micro-batches. `report` may be {name: report} to draw runs side by side (e.g.
    --aux-loss-weight 0 vs 0.05), one colour per run."""
    df = load_balance_frame(report, layer)
    runs = list(dict.fromkeys(df["run"]))
    color = alt.Color("run:N", title=None, sort=runs, scale=alt.Scale(
        domain=runs, range=RUN_COLORS[:len(runs)] if len(runs) <= len(RUN_COLORS) else
        alt.Undefined), legend=alt.Legend(orient="bottom", labelLimit=400))
    panels = []
    for col, (name, y_title) in _METRICS.items():
        base = alt.Chart(df).mark_line(point=alt.OverlayMarkDef(size=25)).encode(
            x=alt.X("step:Q", title="training step", axis=alt.Axis(tickMinStep=1, format="d")),
            y=alt.Y(f"{col}:Q", title=y_title,
                    scale=alt.Scale(zero=col == "dropped_fraction")),
            color=color,
            tooltip=["run:N", "step:Q", alt.Tooltip("max_over_mean:Q", format=".3f"),
                     "dropped:Q", alt.Tooltip("dropped_fraction:Q", format=".3f"),
                     alt.Tooltip("aux:Q", format=".4f")])
        layers = [base]
        if col != "dropped_fraction":  # the balanced value
            layers.insert(0, alt.Chart(pd.DataFrame({"y": [1.0]})).mark_rule(
                color="#999", strokeDash=[4, 4]).encode(y="y:Q"))
        panels.append(alt.layer(*layers).properties(width=width, height=200, title=name))
    layer = _layer(_as_dict(next(iter(_named(report).values()))), layer)
    return alt.hconcat(*panels).properties(autosize=PAD, title=alt.TitleParams(
        f"Load balance over the steps, layer {layer} (measured)",
        subtitle="all ranks and micro-batches of each step; dashed: the balanced value (1)",
        anchor="start"))


# ---------------------------------------------------------------------------------------------
# the wire: the all-to-alls
# ---------------------------------------------------------------------------------------------
def _ep_peers(rep: dict) -> dict[int, list[int]]:
    """Global rank -> the global ranks of its ep group, in ep order (mesh.carve_experts: blocks
    of ep consecutive data-parallel ranks, at the same pp and tp coordinates)."""
    P = rep["config"].get("ep", 1)
    groups: dict[tuple, dict[int, int]] = {}
    for r in rep["ranks"]:
        c = r["coords"]
        key = (c.get("pp", 0), c.get("tp", 0), c["dp"] // P)
        groups.setdefault(key, {})[c["dp"] % P] = r["rank"]
    return {rank: [g[j] for j in range(P)] for g in groups.values() for rank in g.values()}


A2A_PASSES = ("forward", "backward")


def _a2a_records(rank: dict, step: int, phase: str | None, direction: str | None) -> list[dict]:
    return [c for c in rank["comm"] if c.get("layer") == "moe" and c["op"] == "all_to_all"
            and c["step"] == step and (phase is None or c.get("phase") == phase)
            and (direction is None or c.get("pass", "forward") == direction)]


def all_to_all_bytes(report, step: int | None = None, phase: str | None = None,
                     direction: str | None = None) -> list[list[int]]:
    """[source rank][destination rank] bytes of the expert-parallel all-to-alls of one training
    step (default: the last): every phase or one (counts, dispatch, combine), forward and backward
    or one `direction`. Each record's in_splits rows x row bytes (payload / rows); the counts
    exchange (even splits) payload / P to each. The diagonal is a rank's own rows: they stay in
    its memory. So the off-diagonal sum of row i is what rank i recorded as wire_bytes_model for
    that step. Backward runs each exchange with the splits swapped: forward and backward together are
    a symmetric matrix, the forward dispatch alone shows who sends whom its tokens."""
    rep = _as_dict(report)
    if phase is not None and phase not in A2A_PHASES:
        raise ValueError(f"phase {phase!r}: one of {A2A_PHASES} or None (all)")
    if direction is not None and direction not in A2A_PASSES:
        raise ValueError(f"direction {direction!r}: one of {A2A_PASSES} or None (both)")
    step = _step(rep, step)
    n, peers = rep["world_size"], _ep_peers(rep)
    out = [[0] * n for _ in range(n)]
    for r in rep["ranks"]:
        group = peers[r["rank"]]
        for rec in _a2a_records(r, step, phase, direction):
            splits = rec.get("in_splits")
            if splits is None:  # even split: the counts
                splits = [1] * len(group)
            rows = sum(splits)
            for j, s in enumerate(splits):
                if rows:
                    out[r["rank"]][group[j]] += rec["payload_bytes"] * s // rows
    return out


def all_to_all_matrix(report, step: int | None = None, phase: str | None = None,
                      direction: str | None = None, size: int | None = None) -> alt.LayerChart:
    """Rank x rank heatmap of the bytes the expert-parallel all-to-alls of one step sent (rows:
    source rank, columns: destination rank), counted from the run's recorded splits; the
    diagonal, a rank's rows for its own experts, is drawn hatched grey: it never leaves the
    rank. Uneven cells are the router's doing: a rank sends more to the ranks whose experts its
    tokens prefer."""
    rep = _as_dict(report)
    step = _step(rep, step)
    m = all_to_all_bytes(rep, step, phase, direction)
    n = len(m)
    top = max((m[i][j] for i in range(n) for j in range(n) if i != j), default=0)
    div, unit = bytes_unit(top)
    rows = [{"src": f"rank {i}", "dst": f"rank {j}", "bytes": m[i][j], "value": m[i][j] / div,
             "own": i == j, "label": (f"{m[i][j] / div:.3g}" if div > 1 else f"{m[i][j]:,}")
             + ("\n(own, not sent)" if i == j else "")}
            for i in range(n) for j in range(n)]
    df = pd.DataFrame(rows)
    ranks = [f"rank {i}" for i in range(n)]
    x = alt.X("dst:N", title="destination rank", sort=ranks, axis=alt.Axis(labelAngle=0,
                                                                          orient="top"))
    y = alt.Y("src:N", title="source rank", sort=ranks)
    tip = ["src:N", "dst:N", alt.Tooltip("bytes:Q", format=",", title="bytes"), "own:N"]
    sent = alt.Chart(df[~df["own"]]).mark_rect(stroke="white").encode(
        x=x, y=y, tooltip=tip, color=alt.Color("value:Q", title=f"bytes sent ({unit})",
                                               scale=alt.Scale(scheme="blues", domainMin=0)))
    own = alt.Chart(df[df["own"]]).mark_rect(color="#eeeeee", stroke="#999",
                                            strokeDash=[3, 3]).encode(x=x, y=y, tooltip=tip)
    df["ink"] = ["#777" if own else "white" if v > 0.6 * top / div else "black"
                 for own, v in zip(df["own"], df["value"])]  # legible on dark cells
    text = alt.Chart(df).mark_text(fontSize=11, lineBreak="\n").encode(
        x=x, y=y, text="label:N", color=alt.Color("ink:N", legend=None, scale=alt.Scale(
            domain=["#777", "white", "black"], range=["#777", "white", "black"])))
    what = ("all phases (counts, dispatch, combine)" if phase is None
            else f"the {phase} all-to-alls") + (", forward and backward" if direction is None
                                                 else f", {direction} only")
    sent_rows = [sum(m[i]) - m[i][i] for i in range(n)]
    side = size or max(180, 70 * n)
    return alt.layer(sent, own, text).properties(
        autosize=PAD, width=side, height=side, title=alt.TitleParams(
            f"All-to-all bytes, step {step} (counted from the run's splits)",
            subtitle=[what + f"; cells in {unit}" if div > 1 else what,
                      "sent per rank: " + ", ".join(_fmt_b(b) for b in sent_rows)],
            anchor="start"))


def _uniform(rep: dict, rank: dict) -> float:
    th = rep["theory"]
    if "stages" in th:
        return float(th["stages"][rank["coords"].get("pp", 0)].get("ep_all_to_all_uniform", 0))
    return float(th.get("ep_all_to_all_uniform", 0))


def all_to_all_vs_uniform(report) -> alt.LayerChart:
    """Per rank, the expert-parallel all-to-all bytes it sent per step, mean over the steps:
    "measured (written to sockets)" (its records' `wire_bytes_measured`: the rows and gloo's
    framing; left out where it cannot be read), "counted (this run's splits)" (`wire_bytes_model`:
    the rows it sent to other ranks) and theory.ep_wire_bytes_per_step, what uniform routing with
    no dropped token would send. Drops make the counted bar lower; uneven routing moves bytes
    between ranks."""
    rep = _as_dict(report)
    steps = max(1, rep["config"]["steps"])
    rows = []
    for r in rep["ranks"]:
        moe = [c for c in r["comm"] if c.get("layer") == "moe" and c["step"] >= 0]
        written = [c.get("wire_bytes_measured") for c in moe]
        if None not in written:
            rows.append({"rank": f"rank {r['rank']}", "source": "measured (written to sockets)",
                         "bytes": sum(written) / steps})
        rows += [{"rank": f"rank {r['rank']}", "source": "counted (this run's splits)",
                  "bytes": sum(c["wire_bytes_model"] for c in moe) / steps},
                 {"rank": f"rank {r['rank']}", "source": "theory (uniform routing, no drops)",
                  "bytes": _uniform(rep, r)}]
    df = pd.DataFrame(rows)
    div, unit = bytes_unit(df["bytes"].max() if len(df) else 0)
    df["value"] = df["bytes"] / div
    sources = list(dict.fromkeys(df["source"]))
    ranks = list(dict.fromkeys(df["rank"]))
    base = alt.Chart(df).encode(
        x=alt.X("rank:N", title=None, sort=ranks, axis=alt.Axis(labelAngle=0)),
        xOffset=alt.XOffset("source:N", sort=sources),
        y=alt.Y("value:Q", title=f"all-to-all bytes sent per step ({unit})"),
        tooltip=["rank:N", "source:N", alt.Tooltip("bytes:Q", format=",.0f", title="bytes")])
    color = alt.Color("source:N", title=None, sort=sources, legend=alt.Legend(
        orient="bottom", columns=1, labelLimit=400), scale=alt.Scale(domain=sources, range=(
            ["#4c78a8", "#9ecae9", "#bab0ac"] if len(sources) == 3 else ["#9ecae9", "#bab0ac"])))
    return alt.layer(
        base.mark_bar().encode(color=color),
        base.mark_text(dy=-5, fontSize=10).encode(text=alt.Text("value:Q", format=".4g")),
    ).properties(autosize=PAD, width=max(220, 30 * len(sources) * len(ranks)), height=240,
                 title=alt.TitleParams(
        "All-to-all bytes per rank per step: written, counted, uniform routing",
        subtitle="theory.ep_wire_bytes_per_step: (P−1)/P of tokens·k rows, 4 all-to-alls per "
                 "layer and micro-batch, plus the counts", anchor="start"))


# ---------------------------------------------------------------------------------------------
# memory: each rank holds E/P of the experts
# ---------------------------------------------------------------------------------------------
def _replicated_theory(rep: dict) -> dict:
    """run_theory for the same run with the experts replicated (ep = 1)."""
    cfg = SimpleNamespace(**{**rep["config"], "ep": 1})
    return _theory.run_theory(cfg, 0)


def expert_memory_frame(report) -> pd.DataFrame:
    """Rows {who, source, category, bytes}: per rank its measured params / grads / optimizer
    bytes and theory's for that rank (its pipeline stage), plus one group 'ep = 1' with theory's
    bytes per rank if every rank held every expert."""
    rep = _as_dict(report)
    th = rep["theory"]
    rows = []
    for r in rep["ranks"]:
        who = f"rank {r['rank']}"
        mine = th["stages"][r["coords"].get("pp", 0)] if "stages" in th else th
        for cat in STATE_ORDER:
            rows.append({"who": who, "source": "measured", "category": cat,
                         "bytes": r["memory"].get(cat, 0)})
            rows.append({"who": who, "source": "theory", "category": cat,
                         "bytes": mine["memory"].get(cat, 0)})
    if rep["config"].get("ep", 1) > 1:
        rep1 = _replicated_theory(rep)
        mem = rep1["stages"][0]["memory"] if "stages" in rep1 else rep1["memory"]
        for cat in STATE_ORDER:
            rows.append({"who": "experts replicated (ep = 1)", "source": "theory",
                         "category": cat, "bytes": mem.get(cat, 0)})
    return pd.DataFrame(rows, columns=["who", "source", "category", "bytes"])


def expert_memory(report) -> alt.LayerChart:
    """Model states per rank (params, grads, optimizer), stacked: measured (bytes of live
    storages) beside theory for the rank, and theory for the same run with the experts replicated
    on every rank (ep = 1): expert parallel keeps E/P experts per rank, 1/P of the expert
    parameters (and of their gradients and optimizer states)."""
    rep = _as_dict(report)
    df = expert_memory_frame(rep)
    totals = df.groupby(["who", "source"])["bytes"].sum()
    div, unit = bytes_unit(totals.max() if len(totals) else 0)
    df["value"] = df["bytes"] / div
    whos = list(dict.fromkeys(df["who"]))
    x = alt.X("who:N", title=None, sort=whos, axis=alt.Axis(labelAngle=0, labelLimit=200,
                                                            labelPadding=18, ticks=False))
    xoff = alt.XOffset("source:N", sort=["measured", "theory"])
    bars = alt.Chart(df).mark_bar(stroke="white", strokeWidth=0.5).encode(
        x=x, xOffset=xoff, y=alt.Y("value:Q", title=f"model states per rank ({unit})",
                                   stack="zero"),
        color=alt.Color("category:N", title="category", sort=STATE_ORDER,
                        scale=alt.Scale(domain=STATE_ORDER, range=STATE_COLORS)),
        opacity=alt.Opacity("source:N", title="bar", sort=["measured", "theory"],
                            scale=alt.Scale(domain=["measured", "theory"], range=[1.0, 0.5])),
        order=alt.Order("cat_index:Q"),
        tooltip=["who:N", "source:N", "category:N",
                 alt.Tooltip("bytes:Q", format=",.0f", title="bytes")],
    ).transform_calculate(cat_index=f"indexof({STATE_ORDER}, datum.category)")
    which = df.drop_duplicates(["who", "source"])[["who", "source"]].assign(value=0.0)
    names = alt.Chart(which).mark_text(baseline="top", dy=4, fontSize=10, color="#555").encode(
        x=x, xOffset=xoff, y="value:Q", text="source:N")
    c, th = rep["config"], rep["theory"]
    E, P = c.get("experts", 0), c.get("ep", 1)
    layers_moe = len(_theory.moe_blocks(c["layers"], E, c.get("moe_every", 1)))
    all_experts = layers_moe * E * _theory.mlp_params(c["d_model"])
    held = th.get("expert_params_per_rank", all_experts)
    return alt.layer(bars, names).properties(
        autosize=PAD, width=max(260, 110 * len(whos)), height=280, title=alt.TitleParams(
            "Model states per rank: measured vs theory",
            subtitle=[f"expert parameters per rank (theory): {held:,} of {all_experts:,} "
                      f"(E/P = {E}/{P} experts × {layers_moe} MoE layer(s) × (8h²+5h))",
                      "measured: bytes of the rank's live parameter, gradient and optimizer "
                      "storages"], anchor="start"))
