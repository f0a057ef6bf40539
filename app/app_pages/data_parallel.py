"""Data parallel, run live: loss vs the single-process reference, bytes, memory and a timeline."""
import json

import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import (fmt_bytes, fmt_count, last_result, run_live, show_equality,
                        training_run)
from parallel_mini.course import viz
from parallel_mini.report import RunReport


st.title("Data parallel")
pm.intro("""
Every rank holds a full copy of the model and trains on its own slice of the batch. After the
backward pass the gradients are **averaged with an all-reduce**, so every copy takes the same
optimizer step and the run equals training on one process with the whole batch. **Naive**: one
all-reduce per parameter after backward. **Bucketed**: gradients are packed into buckets of
*bucket MB*, and each bucket's all-reduce starts (asynchronously) as soon as its gradients are
ready, overlapping the rest of backward. **Gradient accumulation**: several micro-batches per
step; only the last one syncs.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
dp = c1.radio("Ranks (dp)", [1, 2, 4], horizontal=True, key=pm.kept("dp.dp", 2))
mode = c1.radio("Gradient sync", ["naive", "bucketed"], horizontal=True,
                key=pm.kept("dp.mode", "bucketed"))
if mode != "bucketed":  # disabled: back to its default, so it is not silently kept
    pm.reset("dp.bucket_mb", 0.25)
bucket_mb = c2.select_slider("Bucket size (MB)", [0.05, 0.1, 0.25, 0.5, 1.0],
                             key=pm.kept("dp.bucket_mb", 0.25), disabled=mode != "bucketed")
grad_accum = c2.radio("Gradient accumulation (micro-batches per step)", [1, 2, 4], horizontal=True,
                      key=pm.kept("dp.grad_accum", 1))
steps = c3.slider("Training steps", 2, 10, key=pm.kept("dp.steps", 4))
batch = c3.select_slider("Global batch (sequences)", [8, 16, 32], key=pm.kept("dp.batch", 8))
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)

cfg = {"dp": dp, "dp_mode": mode, "bucket_mb": bucket_mb, "grad_accum": grad_accum,
       "steps": steps, "batch": batch, "reference": True}
if controls.run_button():
    run_live("dp", cfg, f"Training on {dp} rank(s) and the single-process reference…",
             training_run, json.dumps(cfg, sort_keys=True), fresh=fresh, ranks=dp,
             where=controls.run_area)

report, current = last_result("dp", cfg)
if report is None:
    st.info("Press **Run live** to train.")
    st.stop()
if not current:
    c = report["config"]
    st.warning(f"The settings changed: press **Run live**. Below: the last run (dp = {c['dp']}, "
               f"{c['dp_mode']}, grad-accum {c['grad_accum']}, {c['steps']} steps).")

rep = RunReport.from_dict(report)
n = report["world_size"]
n_params = report["theory"]["n_params"]
model_wire = rep.wire_bytes_per_step(0).get("dp", 0.0)  # the ring model of the all-reduces run
written_wire = rep.wire_bytes_per_step(0, kind="measured").get("dp")  # to sockets; None off Linux
theory_wire = report["theory"]["wire_bytes_per_step"]["dp"]

if pm.on():  # the chart first, on the first screen with the controls, then the numbers
    pm.chart(viz.loss_curves(report))
    show_equality(report)
else:
    show_equality(report)
    pm.chart(viz.loss_curves(report))

st.subheader("Bytes on the wire")
st.latex(r"\text{bytes sent per rank per step} = \frac{2(N-1)}{N}\cdot 4\Psi"
         rf"\qquad N = {n},\ \Psi = {n_params:,}\ \text{{parameters}}")
(b0, b1), (b2, b3) = st.columns(2), st.columns(2)  # two by two: the labels fit
b0.metric("Rank 0 per step: measured (written to sockets)",
          "not measurable here" if written_wire is None else f"{fmt_count(round(written_wire))} B",
          help="What rank 0's process wrote to its sockets during the all-reduces (/proc/self/io): "
               "the ring's bytes plus gloo's headers, and whatever algorithm gloo picked")
b1.metric("Rank 0 per step: ring model of the ops run", f"{fmt_count(model_wire)} B",
          help="2(N-1)/N x the bytes of each all-reduce rank 0 ran, summed")
b2.metric("Per step: theory", f"{fmt_count(theory_wire)} B",
          help="parallel_mini.theory.dp_wire_bytes_per_step")
step_all_reduces = [r for r in report["ranks"][0]["comm"] if r["step"] >= 0 and r["op"] == "all_reduce"]
b3.metric("All-reduce calls per step (rank 0)",
          f"{len(step_all_reduces) / report['config']['steps']:g}")
pm.chart(viz.comm_bytes(report, written=written_wire is not None))  # sockets first, where read
with st.expander("Every collective of rank 0, summed"):
    st.dataframe(pd.DataFrame(rep.comm_summary(0)), hide_index=True)

st.subheader("Memory per rank")
mem = report["ranks"][0]["memory"]
states = report["theory"]["memory"]  # parallel_mini.theory.model_state_bytes, in the report
measured_states = mem["params"] + mem["grads"] + mem["optimizer"]
st.markdown(f"Model states of rank 0: measured **{fmt_bytes(measured_states)}**, "
            f"theory 4Ψ + 4Ψ + 8Ψ = 16Ψ = **{fmt_bytes(sum(states.values()))}**. "
            f"Data parallel replicates them on every rank.")
pm.chart(viz.memory_bars(report))

st.subheader("Timeline")
shown = st.select_slider("Steps shown", options=list(range(report["config"]["steps"])),
                         value=(0, report["config"]["steps"] - 1))
pm.chart(viz.timeline(report, steps=list(range(shown[0], shown[1] + 1))))
st.caption("Bucketed: the comm lane's all-reduces start while backward still runs. Naive: they "
           "all start after backward. Wall-clock times on shared CPU cores are approximate.")
