"""Memory per GPU: ZeRO stages 0-3 side by side against a GPU's capacity (theory, any model size),
with tensor (TP, optionally + SP) and pipeline (PP) parallel degrees on top of the N data-parallel
ranks, and for the toy models a live run of all four stages whose measured bytes are drawn beside
the prediction (when the layout runs live here: one place, `why_not_live`, decides)."""
import hashlib
import json
import os
import tempfile

import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import StepBar, fmt_bytes, last_result, run_live, training_run
from parallel_mini import theory
from parallel_mini.runtime import preflight
from parallel_mini.course import at_scale, viz
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.course.viz.units import format_bytes

TOYS = {"toy: 4 layers × d64": {"layers": 4, "d_model": 64, "heads": 4, "vocab": 128},
        "toy: 8 layers × d128": {"layers": 8, "d_model": 128, "heads": 4, "vocab": 128}}
CUSTOM = "custom size (billions of parameters)"
LIVE_GPUS = (1, 2, 4)
MAX_LIVE_RANKS = max(LIVE_GPUS)  # N x TP x PP ranks share this machine's cores
DEGREES = [1, 2, 4, 8]  # TP and PP
STAGES = [0, 1, 2, 3]
STATE_CATS = ["params", "grads", "optimizer", "host", "disk"]  # must equal theory exactly

st.title("Memory per GPU")
pm.intro(r"""
Training keeps **model states** on every GPU (parameters, gradients, optimizer states) plus the
**activations** that forward saves for backward. Mixed precision with Adam costs 16 bytes per
parameter Ψ: 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master copy and two moments).
Plain data parallel (ZeRO-0) replicates all of it on each of N GPUs. ZeRO (Rajbhandari et al.,
2020) shards it: **stage 1** the optimizer states, **stage 2** also the gradients, **stage 3**
also the parameters (gathered layer by layer when needed). ZeRO-Offload moves the sharded
optimizer (with its fp32 master copy) to CPU RAM; ZeRO-Infinity (2021) one level further, to a
file on disk (NVMe), streamed through a small buffer at each step (ZeRO-3: the parameter slices
too). Activations are not sharded by ZeRO.
**Tensor parallel** (TP = t) splits every layer's matrices over t GPUs and **pipeline parallel**
(PP = p) gives each of p GPUs L/p of the layers: together they divide the model states by t·p
*before* ZeRO shards them over the N data-parallel ranks (N·t·p GPUs in all). TP also divides most
activations by t (all of them with sequence parallel, SP); PP with the 1F1B schedule does not.
""")

controls = pm.Controls(4, sidebar_columns=2)  # fourteen controls: two columns in presentation mode
c1, c2, c3, c4 = controls.columns
model = c1.selectbox("Model", [*TOYS, *at_scale.PRESETS, CUSTOM],
                     key=pm.kept("mem.model", [*TOYS][0]),
                     help="Toy models run live here; the presets and custom sizes use theory alone.")
toy = model in TOYS
if toy:
    shape = TOYS[model]
elif model == CUSTOM:
    billions = c1.number_input("Parameters (billions)", 0.01, 2000.0, step=1.0,
                               key=pm.kept("mem.billions", 13.0))
    shape = {"n_params": int(round(billions * 1e9)),
             "layers": int(c1.number_input("Layers", 1, 256, key=pm.kept("mem.layers", 40))),
             "d_model": int(c1.number_input("Hidden size", 64, 65536, step=64,
                                            key=pm.kept("mem.d_model", 5120))),
             "heads": int(c1.number_input("Attention heads", 1, 512,
                                          key=pm.kept("mem.heads", 40)))}
else:
    shape = at_scale.PRESETS[model]
gpus = c1.select_slider("GPUs (data-parallel ranks N)", [2 ** i for i in range(11)],
                        key=pm.kept("mem.gpus", 2))
highlight = c1.radio("ZeRO stage", STAGES, horizontal=True, key=pm.kept("mem.highlight", 0),
                     help="All four stages are drawn anyway; this one is highlighted.")
precision = c2.radio("Precision", ["fp32", "bf16-mixed"], horizontal=True,
                     key=pm.kept("mem.precision", "fp32"))
optimizer = c2.radio("Optimizer", ["adam", "sgd"], horizontal=True,
                     key=pm.kept("mem.optimizer", "adam"))
checkpointing = c2.radio("Activation checkpointing", ["none", "selective", "full"],
                         horizontal=True, key=pm.kept("mem.checkpointing", "none"))
if toy:
    micro_batch = c3.select_slider("Micro-batch per GPU (sequences)", [1, 2, 4, 8],
                                   key=pm.kept("mb_toy", 4))
    seq = c3.select_slider("Sequence length (tokens)", [16, 32, 64, 128],
                           key=pm.kept("seq_toy", 32))
else:
    micro_batch = c3.select_slider("Micro-batch per GPU (sequences)", [1, 2, 4, 8, 16],
                                   key=pm.kept("mb_big", 1))
    seq = c3.select_slider("Sequence length (tokens)", [512, 1024, 2048, 4096, 8192],
                           key=pm.kept("seq_big", 2048))
capacity_label = c3.selectbox("GPU capacity", list(at_scale.GPU_MEMORY_GB),
                              key=pm.kept("mem.capacity", list(at_scale.GPU_MEMORY_GB)[2]))
capacity = at_scale.GPU_MEMORY_GB[capacity_label] * 1e9  # decimal GB, as the capacities are quoted
offload = c4.checkbox("Offload optimizer to CPU (ZeRO-Offload)", key=pm.kept("mem.offload", False),
                      help="Applies to the ZeRO-1 and ZeRO-2 bars only: ZeRO-Offload (Ren et al., "
                           "2021), as parallel_mini implements it, offloads the sharded optimizer "
                           "of stages 1-2; ZeRO-0 and ZeRO-3 are drawn without it. For "
                           "ZeRO-Infinity's offload to disk, tick the box below instead.")
if offload:  # one offload at a time: the disk box is unticked while it is disabled
    pm.reset("mem.disk", False)
disk = c4.checkbox("Optimizer states to disk (ZeRO-Infinity)", key=pm.kept("mem.disk", False),
                   disabled=offload,
                   help="--offload-disk: every stage's fp32 master copy and Adam's moments (ZeRO-3: "
                        "its parameter slices too) live in a file per rank, 12 bytes per parameter "
                        "the rank owns (4 with SGD), read and written once per step. Drawn as a "
                        "grey bar beside the GPU's; not with CPU offload.")
disk = disk and not offload
tp = c4.radio("Tensor parallel degree (TP)", DEGREES, horizontal=True, key=pm.kept("mem.tp", 1),
              help="Megatron TP: each layer's matrices split over TP GPUs (model states / TP, "
                   "activations mostly / TP).")
if tp == 1:  # SP needs TP > 1: unticked while it is disabled, not kept ticked behind the grey
    pm.reset("mem.sp", False)
sp = c4.checkbox("Sequence parallel (SP)", key=pm.kept("mem.sp", False), disabled=tp == 1,
                 help="Megatron SP, on top of TP: LayerNorms and dropout work on sequence "
                      "shards, so every activation is divided by TP. Needs TP > 1.")
sp = sp and tp > 1
pp = c4.radio("Pipeline parallel degree (PP)", DEGREES, horizontal=True, key=pm.kept("mem.pp", 1),
              help="Each GPU holds L/PP of the layers (model states / PP). Under 1F1B the first "
                   "stage keeps PP micro-batches in flight: activations stay L layers' worth.")
world = gpus * tp * pp
c4.markdown(f"**{world:,} GPU(s)** = N × TP × PP = {gpus} × {tp} × {pp}")


def billions(n: float) -> str:
    """A parameter count in billions, never with an exponent: 0.0105B, 12.6B, 2,062B."""
    b = n / 1e9
    return f"{b:,.0f}B" if b >= 1000 else f"{b:.3g}B"


def custom_model_error(shape: dict) -> str | None:
    """Why a custom model cannot exist, one line, or None: heads must split the hidden size, and
    the layers' own weights (12·L·h², without embeddings) must fit in Ψ."""
    h, a, layers, n = shape["d_model"], shape["heads"], shape["layers"], shape["n_params"]
    if h % a:
        return (f"Hidden size {h:,} is not divisible by {a} attention heads: each head takes "
                f"hidden / heads dimensions. Choose a head count that divides {h:,} (e.g. "
                f"{max(d for d in range(1, min(a, h) + 1) if h % d == 0)}).")
    if 12 * layers * h * h > n:
        return (f"{layers} layers of hidden size {h:,} hold 12·L·h² = "
                f"{billions(12 * layers * h * h)} parameters, more than the {billions(n)} given: "
                f"raise the parameters or lower the layers or the hidden size.")
    return None


if model == CUSTOM and (custom_error := custom_model_error(shape)):
    st.error(f"Invalid custom model: {custom_error}")
    st.stop()

# exact_counts: our GPT counted per TP rank (gpt_unit_sizes), what a live run holds; with PP > 1
# (or a big model) the split is approximated as Ψ/(TP·PP) by at_scale.memory_per_gpu
exact_counts = toy and pp == 1
if toy:
    n_params = theory.gpt_param_count(shape["vocab"], seq, shape["d_model"], shape["layers"])
    units = theory.gpt_unit_sizes(shape["vocab"], seq, shape["d_model"], shape["layers"], tp)
else:
    n_params, units = shape["n_params"], None
# parameters on one GPU before ZeRO: all of them at TP = PP = 1
n_rank = sum(units) if exact_counts else at_scale.model_parallel_params(n_params, tp, pp)

# --offload-disk's directory: one per page setting (identical requests join one run; two
# settings never share the files' names), made before each run (four_stages)
DISK_DIR = os.path.join(tempfile.gettempdir(), "parallel_mini_offload", hashlib.sha1(json.dumps(
    [model, gpus, tp, sp, pp, precision, optimizer, checkpointing, micro_batch, seq]).encode()
).hexdigest()[:12])
# the live runs: one RunConfig per ZeRO stage, the same layout (N x TP x PP) for all four. With
# PP, PP micro-batches per step (1F1B's stage 0 then holds PP of them, as the theory assumes),
# each of the page's micro-batch size.
pipe = {"pp": pp, "microbatches": pp} if pp > 1 else {}
configs = [{"dp": gpus, "tp": tp, "sp": sp, **pipe, "zero": k, "precision": precision,
            "optimizer": optimizer, "checkpointing": checkpointing,
            "batch": micro_batch * gpus * pp, "seq": seq, "steps": 2,
            "offload": offload and k in (1, 2), "offload_disk": DISK_DIR if disk else "",
            "layers": shape["layers"],
            "d_model": shape["d_model"], "heads": shape["heads"], "vocab": shape["vocab"]}
           for k in STAGES] if toy else []


def first_config_error(cfgs: list[dict]) -> ConfigError | None:
    try:
        for cfg in cfgs:  # the values, then what this machine can hold (refused before a run)
            preflight.check_fits(RunConfig.from_dict(cfg))
    except ConfigError as err:
        return err
    return None


def why_not_live() -> str | None:
    """The one place that decides whether this layout runs live here: None when it does, else the
    reason, one line. RunConfig's own validation speaks first (e.g. heads that TP cannot split
    evenly), then this machine's rank cap."""
    if not toy:
        return "theory only: the model is far beyond what runs on this machine"
    err = first_config_error(configs)
    if err is not None:
        return f"this layout does not run live: `{err}`"
    if world > MAX_LIVE_RANKS:
        return (f"live runs take at most {MAX_LIVE_RANKS} ranks on this machine, and N × TP × PP "
                f"= {world}")
    return None


not_live = why_not_live()
live_possible = not_live is None


def size_text(b: float) -> str:
    """Big models in decimal units (GB, TB, as the ZeRO paper's table and GPU capacities); toys in
    KiB/MiB."""
    return fmt_bytes(b) if toy else format_bytes(b, decimal=True)


def predicted(zero: int) -> dict:
    """Bytes per GPU by category at one ZeRO stage (host = ZeRO-Offload's bytes in CPU RAM, disk =
    --offload-disk's in a file)."""
    off = offload and zero in (1, 2)
    if disk:  # the states per GPU as below, the optimizer's on disk (theory.model_state_bytes)
        states = theory.model_state_bytes(n_rank, optimizer, precision, zero, gpus,
                                          units if exact_counts else None, disk=True)
        acts = (at_scale.memory_per_gpu(n_params, gpus, zero, precision, optimizer, shape["layers"],
                                      shape["d_model"], shape["heads"], seq, micro_batch,
                                      checkpointing, tp=tp, pp=pp, sp=sp)["activations"]
                if not exact_counts else shape["layers"] * theory.activation_bytes_per_layer(
                    seq, micro_batch, shape["d_model"], shape["heads"], checkpointing, tp=tp, sp=sp))
        return {**states, "activations": acts}
    if not exact_counts:  # at_scale.memory_per_gpu: Ψ/(TP·PP), then ZeRO over N (as the lessons)
        host = theory.model_state_bytes(n_rank, optimizer, precision, zero, gpus, None, off)
        return {**at_scale.memory_per_gpu(n_params, gpus, zero, precision, optimizer,
                                        shape["layers"], shape["d_model"], shape["heads"], seq,
                                        micro_batch, checkpointing, off, tp=tp, pp=pp, sp=sp),
                **({"host": host["host"]} if off else {})}
    # a toy without PP: exact per TP rank (padded ZeRO shards), as run_theory predicts a live run
    states = theory.model_state_bytes(n_rank, optimizer, precision, zero, gpus, units, off)
    per_layer = theory.activation_bytes_per_layer(seq, micro_batch, shape["d_model"],
                                                  shape["heads"], checkpointing, tp=tp, sp=sp)
    return {**states, "activations": shape["layers"] * per_layer}


pred = {k: predicted(k) for k in STAGES}
stage_name = {k: f"ZeRO-{k}" + (" + offload" if offload and k in (1, 2) else "")
              + (" + disk" if disk else "") for k in STAGES}

split = ""
if tp * pp > 1:
    how = ("exactly, per TP rank: LayerNorms, position embeddings and row-parallel biases stay "
           "whole on every rank (`theory.gpt_unit_sizes`)" if exact_counts else
           "approximately, Ψ/(TP·PP): which stage holds the embeddings and the parameters TP "
           "replicates are ignored (`at_scale.model_parallel_params`)")
    split = f" TP × PP = {tp} × {pp} leaves **{n_rank:,}** parameters per GPU, {how}."
if toy:
    where = (f"runs live here on {world} rank(s) (N × TP × PP = {gpus} × {tp} × {pp}): press "
             f"**Run live** above" if live_possible else
             f"{not_live}; the bars below come from theory alone")
    st.info(f"**{model}**: Ψ = {n_params:,} parameters; {where}.{split}")
else:
    st.info(f"**Theory only**: a {n_params / 1e9:g}B-parameter model cannot run on this machine. "
            f"Every number below comes from `course.at_scale.memory_per_gpu` over "
            f"`parallel_mini.theory` (`model_state_bytes`, Korthikanti's activation count); nothing "
            f"here was measured.{split}")

layout = (f"N = {gpus} data-parallel rank(s)" if tp * pp == 1 else
          f"N {gpus} × TP {tp}{' (SP)' if sp else ''} × PP {pp} = {world:,} GPUs")
st.subheader(f"Predicted: all four ZeRO stages, {layout}")
states_total = {k: sum(v for c, v in pred[k].items() if c in ("params", "grads", "optimizer"))
                for k in STAGES}
gpu_total = {k: sum(v for c, v in pred[k].items() if c not in ("host", "disk")) for k in STAGES}
fits = {k: gpu_total[k] <= capacity for k in STAGES}
rows = [{"stage": stage_name[k], "category": c, "bytes": float(v)}
        for k in STAGES for c, v in pred[k].items()]
subtitle = [f"{model}, Ψ = {n_params:,}, {precision}, {optimizer}, micro-batch {micro_batch} × "
            f"{seq} tokens, checkpointing {checkpointing}; activations: Korthikanti et al. (2022)",
            f"N {gpus} (ZeRO shards over these) × TP {tp}{' (SP)' if sp else ''} × PP {pp} = "
            f"{world:,} GPUs; bytes per GPU"
            + (f"; {n_rank:,} parameters per GPU ("
               + ("exact per TP rank" if exact_counts else "Ψ/(TP·PP)") + "), then ZeRO"
               if tp * pp > 1 else "")
            + ("; PP under 1F1B: stage 0 holds L layers' activations" if pp > 1 else "")]
if toy:
    subtitle.append(f"capacity {capacity_label} is far off this scale: a toy always fits")
pm.chart(viz.memory_stages(
    rows, None if toy else capacity, selected=stage_name[highlight], decimal=not toy,
    title=f"Memory per GPU by ZeRO stage ({'theory' if not live_possible else 'predicted'})",
    subtitle=subtitle))
if not pm.on():  # presentation mode: the metrics below say it, and the chart needs the room
    st.markdown("Model states per GPU, ZeRO-0 → 1 → 2 → 3: **"
                + " → ".join(size_text(states_total[k]) for k in STAGES) + "**"
                + (" (on the GPU: ZeRO-1/2's offloaded optimizer lives in CPU RAM, the brown bars)"
                   if offload else "")
                + (" (on the GPU: the optimizer's states are on disk, the grey bars)" if disk else ""))
cols = st.columns(4)
for k, col in zip(STAGES, cols):
    col.metric(f"ZeRO-{k} model states" + (" (highlighted)" if k == highlight else ""),
               size_text(states_total[k]),
               delta=f"{'fits' if fits[k] else 'does not fit'} ({size_text(gpu_total[k])})",
               delta_color="green" if fits[k] else "red", delta_arrow="off",
               help="model states = params + grads + optimizer on the GPU (offloaded bytes are in "
                    "CPU RAM). In brackets: the GPU's total with activations; it fits when that "
                    "total ≤ the GPU's capacity.")
for k in STAGES:
    if fits[k]:
        st.markdown(f"**ZeRO-{k}**: :green[fits] in {capacity_label} "
                    f"({size_text(gpu_total[k])} per GPU)")
    else:
        st.markdown(f"**ZeRO-{k}**: :red[does not fit] in {capacity_label} "
                    f"({size_text(gpu_total[k])} per GPU)")
with st.expander("The formulas"):
    b = theory.BYTES_PER_PARAM[precision]
    o = theory.optimizer_bytes_per_param(optimizer, precision)
    st.markdown(f"b = {b} bytes per parameter and per gradient ({precision}), o = {o} optimizer "
                f"bytes per parameter ({optimizer}{' + fp32 master' if precision != 'fp32' else ''})."
                " Sharded buffers are padded to a multiple of N (ZeRO-3: each gathered unit).")
    st.latex(r"\text{ZeRO-0: } (2b+o)\Psi \quad \text{ZeRO-1: } 2b\Psi + \frac{o\Psi}{N} \quad "
             r"\text{ZeRO-2: } b\Psi + \frac{(b+o)\Psi}{N} \quad \text{ZeRO-3: } "
             r"\frac{(2b+o)\Psi}{N}")
    st.latex(r"\text{activations per layer (Korthikanti): } sbh\left(34 + \frac{5as}{h}\right)"
             r"\ \text{(none)},\quad 34\,sbh\ \text{(selective)},\quad 2\,sbh\ \text{(full)}")
    st.markdown("With TP = t and PP = p the parameters per GPU are Ψ/(t·p) before ZeRO (Ψ → "
                "Ψ/(t·p) above; for the toys without PP, the exact count per TP rank), and N is "
                "the data-parallel degree: N·t·p GPUs in all. Activations per layer with TP "
                "(Korthikanti et al., 2022):")
    st.latex(r"\text{TP: } sbh\left(10 + \frac{24}{t} + \frac{5as}{ht}\right) \qquad "
             r"\text{TP + SP: } \frac{sbh}{t}\left(34 + \frac{5as}{h}\right)")
    st.markdown("PP with 1F1B: stage 0 holds p micro-batches in flight, each through L/p layers: "
                "L layers' worth of one micro-batch whatever p (Korthikanti et al., §4.2.3). "
                "So activations per GPU = L × the per-layer count, with or without PP.")

if not toy:
    st.stop()
st.subheader("Live: measured vs predicted")
if not live_possible:
    st.info(f"{not_live[0].upper()}{not_live[1:]}: the bars above are theory alone.")
    st.stop()

key = {"model": model, "gpus": gpus, "tp": tp, "sp": sp, "pp": pp, "precision": precision,
       "optimizer": optimizer, "checkpointing": checkpointing, "micro_batch": micro_batch,
       "seq": seq, "offload": offload, "disk": disk}


def four_stages(configs_json: str, attempt: int = 0) -> list[dict]:
    """launch.run for ZeRO 0..3 (each cached per config by live_runs.training_run), a progress bar
    per stage; keeps what this page draws: config, theory, and each rank's memory."""
    cfgs = json.loads(configs_json)
    bar = StepBar(len(cfgs))
    out = []
    for cfg in cfgs:
        ranks = cfg["dp"] * cfg["tp"] * cfg.get("pp", 1)
        bar.step(f"ZeRO-{cfg['zero']}: training on {ranks} rank(s)…")
        if cfg.get("offload_disk"):  # (its files are removed after the run; the folder stays)
            os.makedirs(cfg["offload_disk"], exist_ok=True)
        rep = training_run(json.dumps(cfg, sort_keys=True), attempt)
        out.append({"config": rep["config"], "theory": rep["theory"],
                    "ranks": [{"rank": r["rank"], "coords": r["coords"], "memory": r["memory"],
                               **({"disk": r["disk"]} if "disk" in r else {})}
                              for r in rep["ranks"]]})
    bar.done("all four stages measured")
    return out


fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)
if controls.run_button():
    run_live("memory", key, f"Training ZeRO-0, 1, 2 and 3 on {world} rank(s) ({layout})…",
             four_stages, json.dumps(configs), fresh=fresh, ranks=world, own_progress=True,
             where=controls.run_area)

runs, current = last_result("memory", key)
if runs is None:
    st.info("Press **Run live** to train the toy at each ZeRO stage (2 steps each) and measure "
            "every rank's bytes.")
    st.stop()
if not current:
    c = runs[0]["config"]
    st.warning(f"The settings changed: press **Run live**. Below: the last run (dp = {c['dp']}, "
               f"tp = {c['tp']}{' + sp' if c['sp'] else ''}, {c['layers']} layers × "
               f"d{c['d_model']}, {c['precision']}, {c['optimizer']}, checkpointing "
               f"{c['checkpointing']}).")

live_rows, peaks, table = [], [], []
for run in runs:
    c = run["config"]
    k = c["zero"]
    name = f"ZeRO-{k}" + (" + offload" if c["offload"] else "") + (
        " + disk" if c.get("offload_disk") else "")
    mine = run["ranks"][0]["memory"]  # rank 0; every rank is checked against its formula below
    # the run report's own theory (run_theory): model states exact per rank (its TP slices, padded
    # ZeRO shards), Korthikanti per layer with this run's tp and sp
    korthikanti = c["layers"] * run["theory"]["activations_per_layer"]["korthikanti"]
    want = {**run["theory"]["memory"], "activations": korthikanti}
    got = {**{cat: mine[cat] for cat in run["theory"]["memory"]},
           "transient": mine["transient"], "activations": mine["activations_peak"]}
    for cat, v in got.items():
        live_rows.append({"stage": name, "category": cat, "source": "measured", "bytes": v})
    for cat, v in want.items():
        live_rows.append({"stage": name, "category": cat, "source": "predicted", "bytes": v})
    peaks.append({"stage": name, "bytes": mine["total_peak"]})
    # every rank against its own formula: with PP the stages differ (embeddings on the first,
    # the head on the last), so each rank is checked against its stage's entry
    stages = run["theory"].get("stages")
    same_on_every_rank = all(
        r["memory"][cat] == (stages[r["coords"]["pp"]] if stages else run["theory"])["memory"][cat]
        for r in run["ranks"] for cat in run["theory"]["memory"])
    row = {"stage": name}
    for cat in STATE_CATS:
        if cat in want:
            row[f"{cat}: measured − predicted (B)"] = got[cat] - want[cat]
    row.update({"every rank = its formula": "yes" if same_on_every_rank else "NO",
                "transient comm buffers (B)": got["transient"],
                "activations: measured peak (B)": got["activations"],
                "activations: Korthikanti (B)": korthikanti,
                "total live peak (B)": mine["total_peak"]})
    table.append(row)

c0 = runs[0]["config"]
diffs = [v for row in table for col, v in row.items() if "measured − predicted" in col]
exact = all(v == 0 for v in diffs) and all(r["every rank = its formula"] == "yes" for r in table)
pm.chart(viz.memory_measured_vs_theory(
    live_rows, peaks,
    subtitle=[f"dp {c0['dp']} × tp {c0['tp']}{' + sp' if c0['sp'] else ''} × pp {c0['pp']} = "
              f"{c0['dp'] * c0['tp'] * c0['pp']} rank(s), rank 0 shown"
              + (" (pipeline stage 0: embeddings + the first layers; 1F1B, pp micro-batches)"
                 if c0["pp"] > 1 else "")
              + "; predicted: the run report's theory (model states per rank, padded shards; "
              "activations: Korthikanti)",
              "transient: comm buffers (ZeRO-0's gradient buckets, ZeRO-3's gathered units), not "
              "in the formula",
              "tick: measured peak of all live bytes at once; the categories peak at different "
              "moments, so a measured stack can stand above its tick"]))
if exact:
    cats = ", ".join(c for c in STATE_CATS if any(f"{c}: measured" in col for col in table[0]))
    st.success(f"Model states ({cats}): measured − predicted = 0 bytes at all four stages, on "
               f"every rank: **equal to the byte**.")
else:
    st.error("Model states differ from the formula: " + "; ".join(
        f"{r['stage']}: {', '.join(f'{c} {v:+,}' for c, v in r.items() if 'measured −' in c)}"
        for r in table))
columns = list(dict.fromkeys(col for row in table for col in row))  # host (offload) after optimizer
columns.sort(key=lambda col: (col != "stage", "measured − predicted" not in col))
st.dataframe(pd.DataFrame(table, columns=columns), hide_index=True)

if "disk" in runs[highlight]["ranks"][0]:  # --offload-disk: the step's bytes to and from the file
    io = [r for r in runs[highlight]["ranks"][0]["disk"]["io"] if isinstance(r["step"], int)][-1]
    pm.chart(viz.disk_io_bars(viz.disk_io_rows(runs[highlight]), subtitle=[
        f"{table[highlight]['stage']}, rank 0, last step: {io['reads']} reads and {io['writes']} "
        f"writes of at most a 16,384-element window",
        "theory: theory.disk_io_bytes_per_step; counted: by the transfers; measured: this "
        "thread's /proc I/O counters (rchar/wchar: read/write calls; read_bytes/write_bytes: "
        "the disk's pages, the page cache dropped between steps)"]))

sel = table[highlight]
a1, a2, a3 = st.columns(3)
a1.metric(f"Activations, measured peak ({sel['stage']})",
          fmt_bytes(sel["activations: measured peak (B)"]))
a2.metric("Activations, Korthikanti estimate (layers × per layer)",
          fmt_bytes(sel["activations: Korthikanti (B)"]),
          help="theory.activation_bytes_per_layer × layers")
a3.metric(f"Total live peak, measured ({sel['stage']})", fmt_bytes(sel["total live peak (B)"]))
act_bytes = 4 if runs[0]["config"]["precision"] == "fp32" else 2
same_acts = len({r["activations: measured peak (B)"] for r in table}) == 1
st.markdown(f"""
**Why the activations differ from Korthikanti's count.** The formula counts a Megatron layer with
16-bit activations and dropout: s·b·h·(34 + 5as/h) bytes per layer (with TP and SP divided as in
*The formulas* above). Our toy keeps its activations
in the compute dtype ({act_bytes}-byte, {runs[0]['config']['precision']}), has no dropout (so no
masks), and the meter counts exactly what forward leaves alive for backward in the whole model,
including the embeddings, the final LayerNorm, the logits and the loss, which the per-layer formula
leaves out. The measured number is exact for this model; the estimate is the paper's.
{"ZeRO does not shard activations: the measured peak is the same at all four stages."
 if same_acts else "The measured activation peak differs between stages (see the table)."}
""")
