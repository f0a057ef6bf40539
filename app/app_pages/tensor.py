"""Tensor parallel (Megatron) and sequence parallel, run live: each rank's weight shards drawn from
the ranks themselves, the tp traffic per step by layer tag against `theory.tp_wire_bytes_per_step`,
activations per layer with and without SP against Korthikanti's formula and our exact count, and
what the step's traffic would cost on real links (why TP stays inside a node)."""
import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import (TOLERANCE, StepBar, fmt_bytes, fmt_count, last_result, run_live,
                        show_equality, tp_mlp_shards, training_run)
from parallel_mini import theory
from parallel_mini.course import at_scale, viz
from parallel_mini.course.viz.units import format_bytes

MODELS = {"4 layers × d64 × 4 heads": {"layers": 4, "d_model": 64, "heads": 4, "vocab": 128},
          "4 layers × d128 × 8 heads": {"layers": 4, "d_model": 128, "heads": 8, "vocab": 128}}
STEPS = 2
MAX_WORLD = 4  # ranks this page starts at most (they share this machine's cores)
LINKS = sorted(theory.INTERCONNECTS, key=lambda k: -theory.INTERCONNECTS[k])
# H100 SXM, dense bf16 matmuls: the compute time at scale is a lower bound (real runs reach
# roughly half of the peak)
H100_BF16_FLOPS, NVLINK_GPUS_PER_NODE = at_scale.H100_BF16_FLOPS, at_scale.NVLINK_GPUS_PER_NODE


def _compact(report: dict) -> dict:
    """What this page draws from a report (the events timeline is left out)."""
    keep = ("config", "world_size", "losses", "reference_losses", "max_abs_diff", "theory")
    return {**{k: report[k] for k in keep if k in report},
            "ranks": [{"rank": r["rank"], "coords": r["coords"], "memory": r["memory"],
                       "comm": [c for c in r["comm"] if c["step"] >= 0]}
                      for r in report["ranks"]]}


def tensor_experiment(key_json: str, attempt: int = 0) -> dict:
    """The runs behind the page, each cached per config by live_runs.training_run: for SP off (and
    on, when tp > 1) one run of L layers with the single-process reference and one of L + 1 layers
    (the activation bytes of one layer = the difference of the two peaks); then the shard run."""
    k = json.loads(key_json)
    shape = MODELS[k["model"]]
    variants = [False, True] if k["tp"] > 1 else [False]
    jobs = [(sp, layers) for sp in variants for layers in (shape["layers"], shape["layers"] + 1)]
    bar = StepBar(len(jobs) + 1)  # the training runs, then the shard run
    runs: dict[str, dict] = {}
    for sp, layers in jobs:
        cfg = {**shape, "tp": k["tp"], "sp": sp, "dp": k["dp"], "seq": k["seq"],
               "batch": k["micro_batch"] * k["dp"], "steps": STEPS, "layers": layers,
               "reference": layers == shape["layers"]}
        bar.step(f"SP {'on' if sp else 'off'}, {layers} layers: training on "
                 f"{k['tp'] * k['dp']} rank(s)…")
        runs[f"{'sp' if sp else 'nosp'}_L{layers}"] = _compact(
            training_run(json.dumps(cfg, sort_keys=True), attempt))
    bar.step("reading every rank's weight shards…")
    shard_cfg = {**shape, "tp": k["tp"], "dp": 1, "sp": False, "seq": k["seq"],
                 "batch": k["micro_batch"]}
    shards = tp_mlp_shards(json.dumps(shard_cfg, sort_keys=True), attempt)
    bar.done()
    return {"key": k, "runs": runs, "shards": shards}


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
st.title("Tensor parallel")
pm.intro(r"""
Tensor parallelism (Megatron-LM, Shoeybi et al., 2019) splits **each layer's weight matrices**
over t ranks, so that no rank holds or computes a whole layer. The MLP is split twice in a row:
its first matrix **by columns** (column-parallel: each rank computes its own slice of the hidden
features, no communication) and its second **by rows** (row-parallel: each rank computes a partial
sum, and an **all-reduce** adds them). Attention is split the same way, by heads. Two conjugate
operators carry the traffic: **g** all-reduces forward after a row-parallel layer, **f**
all-reduces backward before a column-parallel one: 4 all-reduces of [b, s, h] per block.
**Sequence parallel** (Korthikanti et al., 2022) also splits along the sequence what lies between
the matmuls (LayerNorms, residuals), and swaps each all-reduce for an all-gather + a
reduce-scatter: the same bytes, fewer activations.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
tp = c1.radio("Tensor-parallel degree (tp)", [1, 2, 4], horizontal=True, key=pm.kept("tp.tp", 2))
if tp == 4:  # dp is disabled (tp x dp would pass the rank cap): back to 1, not kept at 2 behind it
    pm.reset("tp.dp", 1)
dp_choice = c1.radio("Data-parallel replicas (dp)", [1, 2], horizontal=True, disabled=tp == 4,
                     key=pm.kept("tp.dp", 1),
                     help=f"At most {MAX_WORLD} ranks (tp × dp) share this machine's cores.")
dp = 1 if tp * dp_choice > MAX_WORLD else dp_choice
if dp != dp_choice:
    c1.caption(f"tp = {tp} uses dp = 1: at most {MAX_WORLD} ranks on this machine.")
if tp == 1:  # SP needs tp > 1: unticked while it is disabled
    pm.reset("tp.sp", False)
sp = c2.checkbox("Sequence parallel (SP)", key=pm.kept("tp.sp", False), disabled=tp == 1,
                 help="Both SP off and SP on are run; this picks the one the numbers highlight.")
sp = sp and tp > 1
model = c2.selectbox("Model", list(MODELS), key=pm.kept("tp.model", list(MODELS)[0]),
                     help="Toy sizes, run live. The vocabulary (128) divides by every tp.")
micro_batch = c3.select_slider("Micro-batch per rank (sequences)", [1, 2, 4],
                               key=pm.kept("tp.micro_batch", 4))
seq = c3.select_slider("Sequence length (tokens)", [16, 32, 64], key=pm.kept("tp.seq", 32))
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)

shape = MODELS[model]
key = {"tp": tp, "dp": dp, "model": model, "micro_batch": micro_batch, "seq": seq}
what = "SP off and on" if tp > 1 else "no split (tp = 1)"
if controls.run_button():
    run_live("tp", key, f"Training tp = {tp} × dp = {dp}, {what}, and reading the shards…",
             tensor_experiment, json.dumps(key, sort_keys=True), fresh=fresh, ranks=tp * dp,
             own_progress=True, where=controls.run_area)

result, current = last_result("tp", key)


def _tp_bytes_per_step(run: dict, rank: int = 0) -> dict[tuple[str, str], dict]:
    """Rank `rank`'s tp-group records of the training steps, by (layer tag, op), per step: calls,
    bytes (counted, the ring model), written (measured, to sockets), payload and wall time."""
    steps = run["config"]["steps"]
    out: dict[tuple[str, str], dict] = {}
    for c in run["ranks"][rank]["comm"]:
        if c["group"] != "tp":
            continue
        a = out.setdefault((c.get("layer", "?"), c["op"]), {"calls": 0, "bytes": 0.0,
                                                             "written": 0.0, "payload": 0,
                                                             "wall_s": 0.0})
        a["calls"] += 1 / steps
        a["bytes"] += c["wire_bytes_model"] / steps  # counted: the ring model of the call
        w = c.get("wire_bytes_measured")  # measured: written to sockets; None where unreadable
        a["written"] = None if w is None or a["written"] is None else a["written"] + w / steps
        a["payload"] += c["payload_bytes"] / steps
        a["wall_s"] += (c["end"] - c["start"]) / steps if "end" in c else 0.0
    return out


def show_shards(res: dict) -> None:
    k, shards = res["key"], res["shards"]
    t, h = k["tp"], MODELS[k["model"]]["d_model"]
    st.subheader("1 · The weight shards, as the ranks hold them")
    layers = len(shards[0]["blocks"])
    block = st.selectbox("Block shown", list(range(layers)), index=0,
                         format_func=lambda i: f"block {i}")
    parts = []
    for s in shards:
        b = s["blocks"][block]
        parts.append({"rank": s["rank"], "matrix": "fc", "weight": b["fc"],
                      "row_start": b["fc_rows"][0], "col_start": 0, "full_shape": [4 * h, h]})
        parts.append({"rank": s["rank"], "matrix": "proj", "weight": b["proj"], "row_start": 0,
                      "col_start": b["proj_cols"][0], "full_shape": [h, 4 * h]})
    full = shards[0]["blocks"][block]
    fc_diff = float(np.abs(np.concatenate([s["blocks"][block]["fc"] for s in shards], axis=0)
                           - full["fc_full"]).max())
    proj_diff = float(np.abs(np.concatenate([s["blocks"][block]["proj"] for s in shards], axis=1)
                             - full["proj_full"]).max())
    pm.chart(viz.tp_weight_shards(
        parts, title=f"MLP weight shards of block {block} on {t} rank(s) (live run)",
        proj_columns=2 if t > 2 else None,  # 4 panels in 2 rows: the chart fits the page
        subtitle=["each rank built the full model from one seed, then kept its slice "
                  "(apply_tensor_parallel); axes: the full matrix's indices",
                  f"laid together the shards are the full weights: max |concat − W| = "
                  f"{max(fc_diff, proj_diff):g}"]))
    st.latex(r"\textbf{fc (column-parallel): } Y=\mathrm{GELU}(XA),\ A=[A_0\,|\,A_1\,|\cdots]"
             r"\ \Rightarrow\ Y_r=\mathrm{GELU}(XA_r)\ \text{(no communication)}")
    st.latex(r"\textbf{proj (row-parallel): } Z=YB,\ "
             r"B=\begin{bmatrix}B_0\\ B_1\\ \vdots\end{bmatrix}"
             r"\ \Rightarrow\ Z=\textstyle\sum_r Y_r B_r\ \text{(all-reduce } g\text{)}")
    st.caption("PyTorch stores a Linear's weight as [out, in] = Aᵀ: a column of A is a *row* of "
               "fc.weight, so the column-parallel fc is split by rows of fc.weight, and the "
               "row-parallel proj by columns of proj.weight.")
    table = []
    for s in shards:
        b = s["blocks"][block]
        table.append({"rank": s["rank"],
                      "fc.weight shard": f"{list(b['fc'].shape)} = rows {b['fc_rows'][0]}:"
                                         f"{b['fc_rows'][1]}",
                      "proj.weight shard": f"{list(b['proj'].shape)} = columns "
                                           f"{b['proj_cols'][0]}:{b['proj_cols'][1]}",
                      "Y_r shape": str(b["y_shape"]),
                      "max |Y_r − Y[:, slice]|": b["y_slice_diff"],
                      "max |Y_r B_r − Z|": b["partial_diff"],
                      "max |Σ_r Y_r B_r − Z|": b["all_reduce_diff"]})
    st.dataframe(pd.DataFrame(table), hide_index=True)
    st.caption("Y_r: this rank's GELU(X A_r) on 8 random tokens; Y_r B_r: its partial product "
               "alone; Σ_r Y_r B_r: after the all-reduce. Z, Y: the unsharded MLP on one process.")
    worst = max(b["all_reduce_diff"] for s in shards for b in s["blocks"])
    partial = min(s["blocks"][block]["partial_diff"] for s in shards)
    if fc_diff == 0 and proj_diff == 0 and worst <= TOLERANCE:
        st.success(f"The shards laid together are the full weights (max |concat − W| = 0), and "
                   f"after the all-reduce every rank holds the MLP's full output Z "
                   f"(max |Σ_r Y_r B_r − Z| = {worst:.1e}, fp32 rounding of the sum's order)"
                   + (f"; one rank's partial alone is off by {partial:.2g} or more." if t > 1
                      else "."))
    else:
        st.error(f"Shards do not reassemble: max |concat − W| = {max(fc_diff, proj_diff):g}, "
                 f"max |Σ_r Y_r B_r − Z| = {worst:g}")


def show_correctness(run: dict) -> None:
    show_equality(run)


def show_comm(chosen: dict, variants: dict[str, dict]) -> None:
    c = chosen["config"]
    t = c["tp"]
    st.subheader("2 · Communication per step: counted, measured and theory")
    if t == 1:
        st.info("tp = 1: nothing is split, so there is no tensor-parallel traffic. Choose tp = 2 "
                "or 4 and press **Run live**.")
    else:
        show_tp_comm(chosen, variants)
    if c["dp"] > 1:
        dp_counted = sum(x["wire_bytes_model"] for x in chosen["ranks"][0]["comm"]
                         if x["group"] == "dp") / c["steps"]
        st.caption(f"Data parallel over the tp shards: each rank also all-reduces its own "
                   f"{chosen['theory']['n_params_per_rank']:,} gradient elements over dp = "
                   f"{c['dp']}: {fmt_count(dp_counted)} B per step counted from the all-reduces it ran "
                   f"(ring model), theory "
                   f"{fmt_count(chosen['theory']['wire_bytes_per_step']['dp'])} B.")


def show_tp_comm(chosen: dict, variants: dict[str, dict]) -> None:
    c = chosen["config"]
    t = c["tp"]
    counted = sum(a["bytes"] for a in _tp_bytes_per_step(chosen).values())
    written = [a["written"] for a in _tp_bytes_per_step(chosen).values()]  # None: unreadable
    predicted = chosen["theory"]["wire_bytes_per_step"].get("tp", 0.0)
    (b0, b1), (b2, b3) = st.columns(2), st.columns(2)  # two by two: the labels fit
    b0.metric("TP bytes per step, rank 0: measured (written to sockets)",
              "not measurable here" if None in written
              else f"{fmt_count(round(sum(written)))} B",
              help="What rank 0's process wrote to its sockets during its tp collectives "
                   "(/proc/self/io): gloo's algorithm for each, its headers included")
    b1.metric("TP bytes per step, rank 0: counted (ring model of the ops run)", f"{fmt_count(counted)} B",
              help="2(t−1)/t × the payload of each tp collective rank 0 ran, summed: a count of "
                   "what the code asked for, not a socket measurement")
    b2.metric("TP bytes per step: theory", f"{fmt_count(predicted)} B",
              delta=("equal" if counted == predicted
                     else f"differ by {counted - predicted:+,.0f} B"),
              delta_color="normal" if counted == predicted else "inverse", delta_arrow="off",
              help="parallel_mini.theory.tp_wire_bytes_per_step")
    per_rank = [sum(a["bytes"] for a in _tp_bytes_per_step(chosen, i).values())
                for i in range(len(chosen["ranks"]))]
    b3.metric("Ranks sending exactly that", f"{sum(b == counted for b in per_rank)} of "
                                            f"{len(per_rank)}")
    mb, s, hh = c["batch"] // c["dp"], c["seq"], c["d_model"]
    st.latex(rf"\underbrace{{(4L+2)}}_{{{4 * c['layers'] + 2}}}\cdot\frac{{2(t-1)}}{{t}}\cdot"
             rf"\underbrace{{4\,bsh}}_{{{4 * mb * s * hh:,}\ \text{{B}}}}"
             rf"\;+\;3\cdot\frac{{2(t-1)}}{{t}}\cdot 4\,bs"
             rf"\;\left[+\ \text{{SP: }}\frac{{2(t-1)}}{{t}}\cdot 4(sh+6hL+2h)\right]")
    rows, theory_bytes = [], {}
    for label, run in variants.items():
        for (layer, op), a in _tp_bytes_per_step(run).items():
            rows.append({"run": label, "layer": layer, "op": op, "calls": a["calls"],
                         "bytes": a["bytes"]})
        theory_bytes[label] = run["theory"]["wire_bytes_per_step"]["tp"]
    pm.chart(viz.tp_comm_by_layer(
        rows, theory_bytes,
        subtitle=[f"rank 0 of tp = {t}, micro-batch {mb} × {s} tokens, d{hh}, {c['layers']} "
                  f"layers, fp32; from the comm records' layer tags",
                  "tick: theory.tp_wire_bytes_per_step"]))
    if len(variants) == 2:
        off, on = (_tp_bytes_per_step(r) for r in variants.values())
        act_off = sum(a["bytes"] for (lay, _), a in off.items() if lay in ("f", "g"))
        act_on = sum(a["bytes"] for (lay, _), a in on.items() if lay == "sp")
        grads = sum(a["bytes"] for (lay, _), a in on.items() if lay == "sp-grads")
        verdict = "the same bytes" if act_off == act_on else "NOT the same bytes"
        st.markdown(
            f"Activation traffic per step: SP off, the f and g all-reduces send "
            f"**{fmt_count(act_off)} B**; SP on, the all-gathers and reduce-scatters send "
            f"**{fmt_count(act_on)} B**: {verdict} (an all-reduce *is* a reduce-scatter then "
            f"an all-gather). SP adds **{fmt_count(grads)} B** of gradients of the parameters "
            f"used on sequence shards (LayerNorms, row-parallel biases, position embeddings).")
    table = [{"run": label, "layer tag": lay, "op": op, "calls per step": a["calls"],
              "payload per call (B)": a["payload"] / a["calls"],
              "bytes per step, counted (ring model)": a["bytes"],
              "written to sockets per step (measured)": a["written"]}
             for label, run in variants.items()
             for (lay, op), a in sorted(_tp_bytes_per_step(run).items())]
    with st.expander("Every tp collective of rank 0, per step"):
        st.dataframe(pd.DataFrame(table), hide_index=True)
        st.caption("Counted: what a ring would send for each call. Measured: what the process "
                   "wrote to its sockets during it, gloo's headers and its own algorithm included. "
                   "Compare the two on SP's reduce-scatter: gloo computes the whole sum and keeps "
                   "one slice (lesson 01), not the ring's half. On the smallest calls (the loss's "
                   "few hundred bytes) the headers alone are a large share.")


def show_memory(variants: dict[str, dict], extra: dict[str, dict]) -> None:
    st.subheader("3 · Activation memory per rank")
    c = next(iter(variants.values()))["config"]
    s, b, h, a, t = c["seq"], c["batch"] // c["dp"], c["d_model"], c["heads"], c["tp"]
    rows = [{"setting": "tp = 1 (theory)", "source": "ours (exact)",
             "bytes": theory.gpt_activation_bytes_per_layer(s, b, h, a, "none", 4)},
            {"setting": "tp = 1 (theory)", "source": "Korthikanti et al.",
             "bytes": theory.activation_bytes_per_layer(s, b, h, a, "none")}] if t > 1 else []
    exact, peaks = True, {}
    for label, run in variants.items():
        sp_on = run["config"]["sp"]
        bigger = extra[label]
        per_rank = [big["memory"]["activations_peak"] - small["memory"]["activations_peak"]
                    for big, small in zip(bigger["ranks"], run["ranks"])]
        ours = theory.gpt_activation_bytes_per_layer(s, b, h, a, "none", 4, t, sp_on)
        exact &= all(m == ours for m in per_rank)
        rows += [{"setting": label, "source": "measured", "bytes": per_rank[0]},
                 {"setting": label, "source": "ours (exact)", "bytes": ours},
                 {"setting": label, "source": "Korthikanti et al.",
                  "bytes": theory.activation_bytes_per_layer(s, b, h, a, "none", t, sp_on)}]
        peaks[label] = run["ranks"][0]["memory"]["activations_peak"]
    pm.chart(viz.tp_activation_bars(
        rows, subtitle=[f"micro-batch {b} × {s} tokens, d{h}, {a} heads, fp32, no checkpointing",
                        "measured: activations peak of an L+1-layer run minus an L-layer run "
                        "(rank 0)"]))
    cols = st.columns(len(peaks) + 1)
    for col, (label, peak) in zip(cols, peaks.items()):
        first = next(iter(peaks.values()))
        col.metric(f"Activation peak per rank, whole model: {label}", fmt_bytes(peak),
                   delta=None if peak == first else f"{(peak - first) / first:+.1%}",
                   delta_color="inverse")  # less memory is better
    cols[-1].metric("Measured per layer = ours", "yes, to the byte" if exact else "NO")
    st.markdown(r"""
**Ours against Korthikanti's.** The paper counts 16-bit activations with dropout:
per layer $sbh(10 + 24/t + 5as/(ht))$ with tensor parallel, and $\frac{sbh}{t}(34 + 5as/h)$ with
SP. Our toy keeps fp32 activations and no dropout masks, and it keeps the inputs of QKV and fc
gathered ($2sbh$ on every rank, even with SP: Megatron re-gathers them in backward instead), so
SP saves less here than in the paper: only the LayerNorm inputs and statistics shrink by t.
`theory.gpt_activation_bytes_per_layer` counts our block op by op; the measurement equals it.
The whole-model peak also holds the embeddings, the logits (split over the vocabulary) and the
loss, which no per-layer formula counts.
""")


def show_links(chosen: dict) -> None:
    st.subheader("4 · Where could TP run? The step's traffic on real links")
    per = _tp_bytes_per_step(chosen)
    counted = sum(x["bytes"] for x in per.values())  # the ring model of the calls made
    if not counted:
        st.info("tp = 1 sends nothing over tp; choose tp = 2 or 4 to time its traffic.")
        return
    wall = sum(x["wall_s"] for x in per.values())
    rows = [{"link": f"{link} ({theory.INTERCONNECTS[link] / 1e9:g} GB/s)",
             "seconds": theory.transfer_time(counted, link), "source": "predicted"}
            for link in LINKS]
    calls = round(sum(x["calls"] for x in per.values()))
    pm.chart(viz.tp_link_times(
        rows, title=f"TP traffic of one step ({fmt_bytes(counted)} per rank), by link",
        subtitle=["the counted bytes of rank 0 / each link's bandwidth (theory.transfer_time, "
                  "a lower bound: no latency)"]))
    l1, l2 = st.columns(2)
    l1.metric("Bytes per step, rank 0 (counted)", f"{fmt_count(counted)} B",
              help=f"{calls} tp collectives per step")
    l2.metric("Wall time of those collectives here (gloo on loopback, measured)",
              f"{wall * 1e3:.3g} ms")
    st.caption(f"At toy scale every link moves these bytes in microseconds; on this machine the "
               f"{calls} collectives per step cost a fixed overhead per call (processes waking "
               f"each other on shared cores), not bandwidth. The same formula at a real model's "
               f"scale is below.")


def show_at_scale() -> None:
    st.subheader("At scale: why tensor parallel stays inside a node (theory only)")
    # presentation mode: a caption, so that the chart below stays on the first screen
    (st.caption if pm.on() else st.info)(
        "Theory only: a real model cannot run here. The bytes come from the formula the live run "
        "above matched (`theory.tp_wire_bytes_per_step`), the times from `theory.transfer_time`.")
    d1, d2, d3 = st.columns(3)
    preset = d1.selectbox("Model (theory)", list(at_scale.PRESETS),
                          key=pm.kept("tp.big_model", list(at_scale.PRESETS)[2]))
    t_big = d2.select_slider("tp (theory)", [2, 4, 8, 16], key=pm.kept("tp.big_tp", 8))
    seq_big = d3.select_slider("Sequence length (theory)", [1024, 2048, 4096, 8192],
                               key=pm.kept("tp.big_seq", 4096))
    p = at_scale.PRESETS[preset]
    cfg = SimpleNamespace(batch=1, dp=1, grad_accum=1, seq=seq_big, d_model=p["d_model"],
                          precision="bf16-mixed", tp=t_big, layers=p["layers"],
                          checkpointing="none", sp=False)
    nbytes = theory.tp_wire_bytes_per_step(cfg)
    compute = at_scale.matmul_time(p["n_params"], seq_big, t_big)
    rows = [{"link": f"{link} ({theory.INTERCONNECTS[link] / 1e9:g} GB/s)",
             "seconds": theory.transfer_time(nbytes, link), "source": "predicted"}
            for link in LINKS]
    pm.chart(viz.tp_link_times(
        rows, compute_s=compute,
        title=f"{preset}, tp = {t_big}: {format_bytes(nbytes, decimal=True)} of TP traffic "
              f"per GPU per micro-batch",
        subtitle=[f"a micro-batch of one sequence of {seq_big} tokens, bf16, {p['layers']} "
                  f"layers × d{p['d_model']}; SP moves the same bytes",
                  "red: matmul time per GPU at H100's bf16 peak, 6·Ψ·tokens / (t · 989 "
                  "TFLOP/s), a lower bound"]))
    nv = theory.transfer_time(nbytes, "NVLink 4 (H100)")
    ib = theory.transfer_time(nbytes, "InfiniBand NDR")
    st.markdown(
        f"Every layer waits for its all-reduces (the next matmul needs their result), 4 per "
        f"layer of b·s·h activations each: the traffic per GPU follows the activations, not the "
        f"weights, and it does not shrink as t grows (2(t−1)/t → 2) while each GPU's compute "
        f"shrinks as 1/t. Here the traffic over NVLink takes **{nv / compute:.0%}** of the "
        f"compute time; over one InfiniBand NDR port per GPU **{ib / compute:.1f}×** the compute "
        f"time. So TP stays within the {NVLINK_GPUS_PER_NODE} NVLink-connected GPUs of a node "
        f"(t ≤ {NVLINK_GPUS_PER_NODE}). Data parallel moves many bytes too, but once per "
        f"optimizer step, overlapped with backward and amortised over all its micro-batches; "
        f"pipeline parallel sends one activation per stage boundary: they cross the slower "
        f"links between nodes."
        + (f" With t = {t_big} the ring would leave the node: its slowest hop, InfiniBand, "
           f"sets the pace." if t_big > NVLINK_GPUS_PER_NODE else ""))


if result is None:
    st.info("Press **Run live** to train the toy with tensor parallel (SP off and on, and the "
            "single-process reference) and read every rank's weight shards.")
else:
    k = result["key"]
    if not current:
        st.warning(f"The settings changed: press **Run live**. Below: the last run (tp = "
                   f"{k['tp']}, dp = {k['dp']}, {k['model']}, micro-batch {k['micro_batch']} × "
                   f"{k['seq']} tokens).")
    L = MODELS[k["model"]]["layers"]
    names = {"nosp": "SP off" if k["tp"] > 1 else "tp = 1", "sp": "SP on"}
    variants = {names[v]: result["runs"][f"{v}_L{L}"] for v in ("nosp", "sp")
                if f"{v}_L{L}" in result["runs"]}
    extra = {names[v]: result["runs"][f"{v}_L{L + 1}"] for v in ("nosp", "sp")
             if f"{v}_L{L + 1}" in result["runs"]}
    chosen = variants["SP on"] if (sp and "SP on" in variants) else next(iter(variants.values()))
    st.markdown(f"Numbers below: **{'SP on' if chosen['config']['sp'] else 'SP off'}** "
                f"(tick *Sequence parallel* to switch; both were run).")
    show_shards(result)  # the main chart first: on the first screen under Run live
    show_correctness(chosen)
    show_comm(chosen, variants)
    show_memory(variants, extra)
    show_links(chosen)
show_at_scale()
