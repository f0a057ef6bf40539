"""Plan a run: a model and a cluster (GPUs, nodes, the network between them) in, the planner's
ranked layouts out (memory per GPU against the GPU's capacity, predicted step time split into
compute, bubble and each axis's exposed communication: theory, `parallel_mini.course.planner`), the
decision guide walked question by question (`parallel_mini.course.guide`) to the layout it calls for and
the planner's best layout that follows it, and the toy version of that layout run live on 2 or 4
local ranks: measured memory per rank and step time beside the planner's prediction for the same
toy layout."""
import dataclasses
import json
from types import SimpleNamespace

import streamlit as st

import presentation as pm
from live_runs import last_result, run_live, show_equality, training_run
from parallel_mini.course import guide, planner
from parallel_mini.course.viz.units import format_bytes, time_unit

GPU_COUNTS = [8 * 2 ** i for i in range(10)]  # 8 .. 4,096
BATCHES = [0, 64, 128, 256, 512, 1024, 2048, 4096]  # sequences per step; 0: the model's own
SEQS = [0, 2048, 4096, 8192, 32768, 131072]  # tokens; 0: the model's own
CUSTOM = "custom GPT (layers, width, heads)"
# between nodes, per GPU: the GPU's own network (planner.HARDWARE: InfiniBand), or Ethernet
NETWORKS = {"the GPU's own (InfiniBand)": 0.0, "100 Gb Ethernet (12.5 GB/s per GPU)": 12.5e9,
            "25 Gb Ethernet (3.1 GB/s per GPU)": 3.125e9}
SHOWN = 8  # ranked layouts drawn (each degree tuple at its best variant)
TOY_RANKS = [2, 4]  # local ranks the toy version runs on (guide.toy_version)


def _own(value: int, what: str):
    return lambda v: f"the model's own ({value:,})" if v == 0 else f"{v:,} {what}"


# ---------------------------------------------------------------------------------------------
# theory, cached (a big model's plan predicts thousands of layouts: seconds)
# ---------------------------------------------------------------------------------------------
def cluster_hardware(gpu: str, network: str) -> planner.Hardware:
    """The GPU's profile, with Ethernet between nodes when chosen (the planner's link times
    follow the bandwidth; a link name it does not list is fine with inter_bw given)."""
    hw = planner.hardware(gpu)
    bw = NETWORKS[network]
    return dataclasses.replace(hw, inter=network.split(" (")[0], inter_bw=bw) if bw else hw


@st.cache_data(max_entries=32, show_spinner="The planner predicts every layout…")
def cached_plan(spec_json: str, gpus: int, gpu: str, network: str, node: int, batch: int) -> dict:
    """planner.plan, its ranked layouts kept as plain dicts (every one, for the guide's pick)."""
    fields = json.loads(spec_json)
    spec = planner.ModelSpec(**{**fields, "mla": tuple(fields["mla"])})  # hashable, as given
    res = planner.plan(spec, gpus, cluster_hardware(gpu, network), batch, node, top=SHOWN)
    res["ranked"] = [dataclasses.asdict(lay) for lay, _ in res.pop("all")]
    return res


def _spec_json(spec: planner.ModelSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def guide_entry(spec, res: dict, rec, hw: planner.Hardware, node: int):
    """The planner's best-ranked layout that follows the guide, as an entry (theory), or None."""
    hit = guide.first_following([(planner.Layout(**d), None) for d in res["ranked"]], rec)
    if hit is None:
        return None
    rank, lay, _ = hit
    p = planner.predict(spec, lay, hw, res["global_batch"], node, res["precision"])
    return planner.layout_entry(lay, p, rank)


@st.cache_data(max_entries=16,
               show_spinner="The planner ranks the toy's layouts on this machine…")
def toy_version(rec: guide.Recommendation, ranks: int) -> guide.ToyVersion:
    """guide.toy_version, cached: the toy layout closest to the guide on `ranks` local ranks, the
    planner's prediction for it (theory) and the RunConfig that runs it with the reference."""
    return guide.toy_version(rec, ranks)


def toy_run(cfg_json: str, attempt: int = 0) -> dict:
    """One live run of the toy layout (cached by live_runs.training_run), compacted: memory per
    rank, losses, and the median measured step (planner.measured_step_s, from the op events)."""
    rep = training_run(cfg_json, attempt)
    step = planner.measured_step_s(SimpleNamespace(config=rep["config"], ranks=rep["ranks"]))
    keep = ("config", "world_size", "losses", "reference_losses", "max_abs_diff")
    return {**{k: rep[k] for k in keep if k in rep}, "measured_step_s": step,
            "ranks": [{"rank": r["rank"], "coords": r["coords"], "memory": r["memory"]}
                      for r in rep["ranks"]]}


def fmt_s(seconds: float) -> str:
    div, unit = time_unit(seconds)
    return f"{seconds / div:.3g} {unit}"


# ---------------------------------------------------------------------------------------------
# the page's sections
# ---------------------------------------------------------------------------------------------
def show_guide(facts: dict) -> None:
    """The four questions, each with what the chosen model and cluster suggest."""
    st.subheader("2 · The decision guide (a rule of thumb)")
    st.markdown("Answer as you would before running any planner; under each question, what the "
                "numbers of the model and cluster chosen above suggest.")
    for key, (question, answers) in guide.QUESTIONS.items():
        st.radio(question, list(answers), format_func=answers.get, key=f"plan.guide.{key}")
        st.caption(f"The numbers suggest: {answers[facts[key]]}.")


def show_guide_result(rec, entry: dict | None, first: dict | None, usable: float, spec,
                      fit: int) -> None:
    st.markdown(f"**The guide's layout:** {rec.describe()}")
    st.markdown("\n".join(f"- {r}" for r in rec.reasons))
    if first is None:
        return
    if entry is None:
        why = (f"The guide calls for expert parallel, but {spec.name} is a dense model: none of "
               f"its layouts follows the guide" if rec.ep and not spec.experts else
               f"None of the {fit:,} layouts that fit in memory follows the guide")
        st.warning(f"{why}. The planner's first: {first['describe']}.")
        return
    t, f = entry["theory"], first["theory"]
    m1, m2, m3 = st.columns(3)
    place = entry["rank_among_all_variants"]
    m1.metric("Guide's best layout: the planner's rank", f"#{place:,}",
              help=f"{entry['describe']}: the best-ranked of the layouts that fit and follow the "
                   f"guide; #N is its place among every fitting layout")
    if place == 1:
        m2.metric("Its step time (theory)", fmt_s(t["step_s"]), delta="the planner's first",
                  delta_color="off")
    else:
        m2.metric("Its step time (theory)", fmt_s(t["step_s"]),
                  delta=f"{t['step_s'] / f['step_s'] - 1:+.1%} vs the planner's first",
                  delta_color="inverse")
    m3.metric("Its memory per GPU (theory)",
              format_bytes(t["memory_bytes_per_gpu"]["total"]),
              help=f"usable per GPU: {format_bytes(usable)}")
    st.caption(f"Guide's layout in full: {entry['describe']}. The planner's first: "
               f"{first['describe']}.")


def show_toy(rec, controls, fresh_key: str) -> None:
    st.subheader("3 · The toy version, run live on this machine")
    t1, t2 = st.columns([1, 3])
    ranks = t1.radio("Local ranks", TOY_RANKS, horizontal=True, key=pm.kept("plan.toy_ranks", 2))
    toy = toy_version(rec, ranks)
    lay, c, p = toy.layout, toy.config, toy.prediction
    cfg = c.to_dict()
    t2.caption(f"parallel_mini's GPT: {c.layers} layers × d{c.d_model}, {c.heads} heads, "
               f"s = {c.seq}, batch {c.batch}"
               + (f", {c.experts} experts top-{c.top_k}" if c.experts else "")
               + f", {c.precision} {c.optimizer.capitalize()}, {c.steps} steps"
               + (" with the single-process reference." if c.reference else "."))
    how = ("follows the guide" if not toy.departures else
           f"comes closest to the guide (no toy layout on {ranks} ranks follows it all; this one "
           f"lacks: {', '.join(toy.departures)})")
    st.markdown(f"**Toy layout:** {lay.describe()}: the planner's #{toy.place} of the toy's "
                f"layouts on {ranks} ranks that {how}.")
    key = {"cfg": cfg}
    fresh = st.checkbox("Fresh measurement (ignore the cache)", key=fresh_key)
    if controls.run_button("Run live (toy version)",
                           help=f"Trains the toy layout on {lay.world} local ranks and on one "
                                f"process (the reference)."):
        run_live("plan", key, f"Training the toy as {lay.describe()}…", toy_run,
                 json.dumps(cfg, sort_keys=True), fresh=fresh, ranks=lay.world,
                 where=controls.run_area)
    result, current = last_result("plan", key)
    m1, m2, m3 = st.columns(3)
    m1.metric("Step time: theory (planner)", fmt_s(p["step_s"]),
              help="planner.predict on this machine's profile (assumed rates per core)")
    if result is None:
        st.info("Press **Run live (toy version)** to train this layout on real ranks and see the "
                "measured numbers beside the planner's.")
        return
    if not current:
        last = result["config"]
        st.warning("The toy layout changed (the guide's answers or the ranks): press **Run "
                   f"live (toy version)**. The last run (dp {last['dp']} × tp {last['tp']} × pp "
                   f"{last['pp']} × cp {last['cp']}, ep {last['ep']}) is not drawn beside this "
                   f"layout's prediction.")
        return
    m2.metric("Step time: measured (median of the timed steps)", fmt_s(result["measured_step_s"]),
              help="Wall clock from the first op to the last of a step, all ranks "
                   "(planner.measured_step_s). Ranks share this machine's cores.")
    m3.metric("Ranks whose states equal theory",
              f"{toy.states_equal(result['ranks'])} of {len(result['ranks'])}",
              help="params, grads and optimizer bytes measured on each rank, against the "
                   "planner's prediction for its pipeline stage: equal to the byte")
    from parallel_mini.course.viz import plan as vplan
    pm.chart(vplan.toy_memory(toy.memory_rows(result["ranks"]), subtitle=[
        f"{lay.describe()} on {lay.world} local ranks: params, grads and optimizer states "
        f"measured by the run's meters, theory by the planner;",
        "activations: the measured peak of saved tensors beside the planner's count"]))
    show_equality(result)


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
st.title("Plan a run")
pm.intro(r"""
Which layout trains a model fastest on a cluster? The **planner** tries every layout (data
parallel with ZeRO 0-3, tensor parallel inside a node, pipeline stages with a schedule, context
and expert parallel, activation checkpointing), drops those that do not fit in a GPU's memory and
ranks the rest by **predicted** step time: every number in section 1 is theory. Section 2 walks the
**decision guide** practitioners use before any planner, and section 3 runs the **toy version** of
its layout on real ranks here: **measured** numbers beside the planner's.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
model = c1.selectbox("Model", [*planner.MODELS, CUSTOM], key=pm.kept("plan.model", "llama3-70b"))
if model == CUSTOM:
    layers = int(c1.number_input("Layers", 1, 256, key=pm.kept("plan.layers", 32)))
    d_model = int(c1.number_input("Hidden size", 64, 65536, step=64,
                                  key=pm.kept("plan.d_model", 4096)))
    heads = int(c1.number_input("Attention heads", 1, 512, key=pm.kept("plan.heads", 32)))
    base = planner.ModelSpec("custom GPT", layers, d_model, heads, 50304, 2048, 512,
                             source="a GPT-style model (GELU MLP of 4h, learned positions)")
else:
    base = planner.MODELS[model]
gpus = c2.select_slider("GPUs", GPU_COUNTS, key=pm.kept("plan.gpus", 64),
                        format_func=lambda n: f"{n:,}")
node = c2.radio("GPUs per node", [4, 8], horizontal=True, key=pm.kept("plan.node", 8),
                help="Tensor parallel stays inside a node; the planner puts any axis whose group "
                     "fits in one node on the node's link.")
network = c2.selectbox("Network between nodes", list(NETWORKS),
                       key=pm.kept("plan.network", list(NETWORKS)[0]),
                       help="Bandwidth per GPU between nodes; inside a node the GPU's own link "
                            "(NVLink).")
gpu = c3.selectbox("GPU", list(planner.HARDWARE), key=pm.kept("plan.gpu", "h100-80gb"))
batch = c3.select_slider("Global batch (sequences)", BATCHES, key=pm.kept("plan.batch", 0),
                         format_func=_own(base.global_batch, "sequences"))
seq = c3.select_slider("Sequence length (tokens)", SEQS, key=pm.kept("plan.seq", 0),
                       format_func=_own(base.seq, "tokens"))
spec = dataclasses.replace(base, seq=seq or base.seq)
batch = batch or spec.global_batch
hw = cluster_hardware(gpu, network)

# the guide's answers are read before the chart (which marks the guide's layout); their radios
# are drawn in section 2. On a first visit they are what the numbers suggest; the learner's
# answers are kept after that, whatever the model.
facts = guide.fact_answers(planner.param_count(spec), hw.usable_bytes, spec.seq, spec.experts,
                           hw.bandwidth(False))
answers = {k: st.session_state[pm.kept(f"plan.guide.{k}", facts[k])] for k in guide.QUESTIONS}
rec = guide.recommend(answers)

st.subheader(f"1 · The planner's ranked layouts for {spec.name} on {gpus:,} × {gpu} (theory)")
res, first, entry = None, None, None
if spec.d_model % spec.heads:  # the planner would refuse it naming its CLI flags: say it here
    divisors = [h for h in (8, 16, 32, 40, 64, 128) if spec.d_model % h == 0]
    st.error(f"Invalid settings: hidden size {spec.d_model:,} is not divisible by {spec.heads} "
             f"attention heads; choose heads that divide it"
             + (f" (e.g. {', '.join(map(str, divisors))})." if divisors else "."))
else:
    try:
        res = cached_plan(_spec_json(spec), gpus, gpu, network, node, batch)
    except planner.PlanError as err:
        st.error(f"Invalid settings: {err}")
if res is not None:
    usable = res["hardware"]["usable_bytes"]
    if not res["layouts"]:
        c = res["closest"]
        if c:
            least = format_bytes(c["theory"]["memory_bytes_per_gpu"]["total"])
            st.warning(f"No layout fits: the least memory is {least} per GPU ({c['describe']}); "
                       f"add GPUs or take a GPU with more memory.")
        else:
            st.warning("No layout fits: none divides this cluster; change the GPUs or the batch.")
    else:
        first = res["layouts"][0]
        entry = guide_entry(spec, res, rec, hw, node)
        shown = list(res["layouts"])
        if entry and all(e["rank_among_all_variants"] != entry["rank_among_all_variants"]
                         for e in shown):
            shown.append(entry)
        from parallel_mini.course.viz import plan as vplan
        highlight = vplan.layout_label(entry) if entry else None
        m, between = res["model"], res["hardware"]["inter_node"]
        pm.chart(vplan.ranked_layouts(
            shown, res["hardware"]["memory_bytes"], usable, highlight=highlight, decimal=False,
            subtitle=[f"{m['parameters'] / 1e9:,.1f}B parameters, seq {m['seq']:,}, global batch "
                      f"{res['global_batch']:,}, {res['precision']}; {res['fit']:,} of "
                      f"{res['considered']:,} layouts fit; each degree tuple at its best variant",
                      f"nodes of {node}: {between['link']} "
                      f"{between['bytes_per_s'] / 1e9:.3g} GB/s per GPU between them",
                      ("opaque: the planner's best layout that follows the decision guide (2)"
                       if highlight else "no layout that follows the decision guide fits"),
                      "#N: the layout's place among every fitting layout"]))
        if not pm.on():
            st.caption("Memory: the pipeline rank that holds the most. Step time: compute, the "
                       "pipeline's bubble and the communication compute does not hide, per axis. "
                       "Hover a bar for the full layout (ZeRO stage, schedule, micro-batches, "
                       "checkpointing). Every number is the planner's prediction: none is "
                       "measured.")

show_guide(facts)
show_guide_result(rec, entry, first, hw.usable_bytes, spec, res["fit"] if res else 0)
show_toy(rec, controls, "plan.fresh")
