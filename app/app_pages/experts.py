"""Experts (mixture of experts and expert parallel), run live: a small MoE GPT trained on real
ranks with E experts per MoE layer, top-k routing and a capacity factor, its experts sharded over
ep ranks. From the run's own logs and records: which expert every token of a micro-batch chose and
which assignments were dropped, the load per expert against the capacity, the all-to-all bytes
rank x rank beside `theory.ep_wire_bytes_per_step` (uniform routing), model states per rank
(experts 1/P) beside theory, and the losses against the single-process reference. A second,
longer pair of runs (aux-loss weight 0 vs the chosen weight) shows the load evening out over the
steps, or not."""
import json

import streamlit as st

import presentation as pm
from live_runs import (StepBar, fmt_bytes, fmt_count, last_result, run_live, show_equality,
                       training_run)
from parallel_mini import theory
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.moe import capacity
from parallel_mini.course.viz import experts as vx

MODEL = {"layers": 2, "d_model": 64, "heads": 4, "seq": 32, "vocab": 128, "batch": 8, "steps": 4}
# the aux-loss comparison: long enough for routing to collapse without the loss (measured: layer
# 3's aux loss climbs from about 1.07 to 3 with weight 0 and stays near 1.15 with 0.05)
AUX_RUN = {"layers": 4, "d_model": 64, "heads": 4, "seq": 32, "vocab": 128, "batch": 16,
           "lr": 3e-2, "z_loss_weight": 0.0}
AUX_STEPS = [8, 16, 24, 40, 60]
EP_CHOICES = [1, 2, 4]  # dp = max(2, ep) ranks: at most 4 share this machine's cores
FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
PHASES = {"all (counts, dispatch, combine)": None, "dispatch": "dispatch", "combine": "combine",
          "counts": "counts"}
DIRECTIONS = {"forward and backward": None, "forward only": "forward"}


def dp_for(ep: int) -> int:
    return max(2, ep)


def run_config(experts: int, top_k: int, factor: float, ep: int, aux: float) -> dict:
    """The page's live run: dp = max(2, ep) ranks, experts sharded over ep of them, with the
    single-process reference."""
    return {**MODEL, "dp": dp_for(ep), "ep": ep, "experts": experts, "top_k": top_k,
            "capacity_factor": factor, "aux_loss_weight": aux, "reference": True}


def aux_config(experts: int, top_k: int, factor: float, ep: int, aux: float, steps: int) -> dict:
    return {**AUX_RUN, "dp": dp_for(ep), "ep": ep, "experts": experts, "top_k": top_k,
            "capacity_factor": factor, "aux_loss_weight": aux, "steps": steps}


def _compact(report: dict) -> dict:
    """What this page draws from a report: the MoE logs, the all-to-all records, memory (the op
    timeline and the other comm records are left out)."""
    keep = ("config", "world_size", "losses", "reference_losses", "max_abs_diff", "theory")
    return {**{k: report[k] for k in keep if k in report},
            "ranks": [{"rank": r["rank"], "coords": r["coords"], "memory": r["memory"],
                       "comm": [x for x in r["comm"] if x.get("layer") == "moe"],
                       "moe": {k: v for k, v in r.get("moe", {}).items()
                               if k in ("layers", "log", "experts_here")}}
                      for r in report["ranks"]]}


def experts_run(cfg_json: str, attempt: int = 0) -> dict:
    """One live run (cached per config by live_runs.training_run), compacted."""
    return _compact(training_run(cfg_json, attempt))


def aux_experiment(key_json: str, attempt: int = 0) -> dict:
    """Two runs with the same data and seed: aux-loss weight 0 and the chosen weight."""
    k = json.loads(key_json)
    weights = [0.0, k["aux"]] if k["aux"] != 0 else [0.0]
    bar = StepBar(len(weights))
    runs = {}
    for w in weights:
        bar.step(f"aux-loss weight {w:g}: {k['steps']} steps…")
        cfg = aux_config(k["experts"], k["top_k"], k["factor"], k["ep"], w, k["steps"])
        runs[f"aux-loss weight {w:g}"] = _compact(training_run(json.dumps(cfg, sort_keys=True),
                                                               attempt))
    bar.done()
    return {"key": k, "runs": runs}


# ---------------------------------------------------------------------------------------------
# the live sections
# ---------------------------------------------------------------------------------------------
def show_routing(rep: dict) -> tuple[int, int]:
    """Section 1; returns the (layer, step) chosen, which section 2 shows too."""
    c = rep["config"]
    E, k, F, seq = c["experts"], c["top_k"], c["capacity_factor"], c["seq"]
    st.subheader("1 · Where each token goes (measured)")
    layers = vx.moe_layers(rep)
    r1, r2, r3 = st.columns(3)
    layer = r2.radio("MoE layer", layers, horizontal=True, key="experts_layer")
    rank = r3.radio("Rank (its own tokens)", [r["rank"] for r in rep["ranks"]], horizontal=True,
                    key="experts_rank")
    steps = vx.routing_steps(rep, rank, layer) or vx.moe_steps(rep)  # (a long run: a sample)
    step = r1.select_slider("Step", steps, value=steps[-1], key="experts_step",
                            help="Routing changes as the router trains: step through it.")
    pm.chart(vx.routing_heatmap(rep, rank=rank, layer=layer, step=step))
    df = vx.routing_frame(rep, rank, layer, step)
    cap = capacity(seq, E, k, F)
    m1, m2, m3 = st.columns(3)
    m1.metric("Assignments (tokens × k), this micro-batch", f"{len(df):,}",
              help=f"{len(df) // k} tokens of rank {rank}, each sent to its top {k}")
    m2.metric("Dropped (over capacity), measured", f"{int((~df['kept']).sum()):,}",
              help="Assignments whose place in the expert's queue for their sequence was ≥ the "
                   "capacity: the expert never sees that token (the residual carries it).")
    m3.metric("Capacity per expert per sequence (formula)", f"{cap}",
              help="ceil(F · s · k / E): F the capacity factor, s tokens per sequence")
    st.latex(rf"C = \left\lceil F \cdot \frac{{s \cdot k}}{{E}} \right\rceil = \left\lceil {F:g}"
             rf"\cdot \frac{{{seq} \cdot {k}}}{{{E}}} \right\rceil = {cap}"
             r"\ \text{slots per expert per sequence}")
    st.markdown("""
Each token's router picks its **k** most probable experts. An expert's queue for a sequence is
filled with every first choice in token order, then the second choices; past **C** slots the
assignment is **dropped** (red cross). A token whose choices were all dropped skips the layer:
only the residual connection carries it.
""")
    return layer, step


def show_load(rep: dict, layer: int, step: int) -> None:
    st.subheader("2 · Load per expert against the capacity (measured)")
    cols = st.columns([3, 2])
    pm.chart(vx.expert_load(rep, layer=layer, step=step), cols[0], share=0.6)
    df, cap = vx.expert_load_frame(rep, layer, step)
    per = df.groupby("expert")["assignments"].sum()
    cols[1].metric("Busiest expert ÷ mean, this step (measured)",
                   f"{per.max() / per.mean():.2f}", help="1 = every expert equally loaded")
    cols[1].metric("Capacity for the step (formula × sequences)", f"{cap:,}",
                   help="slots per expert per sequence × every sequence of the step, all ranks")
    cols[1].caption("A step's tokens, every rank and micro-batch: kept assignments in blue, the "
                    "dropped ones stacked in red above them. An expert past the dashed line has "
                    "dropped the overflow of some sequence; a low bar left slots unused.")


def show_aux(experts: int, top_k: int, factor: float, ep: int, aux: float, fresh: bool) -> None:
    st.subheader("3 · The load-balancing loss over steps (measured)")
    st.markdown(r"""
Without help a router collapses: experts that win early get trained more and win more. The
**load-balancing loss** (Switch Transformer) E · Σₑ fₑ · Pₑ (fₑ the share of assignments expert e
got, Pₑ its mean router probability) is 1 when routing is uniform and up to E when everything goes
to one expert; its weight trades balance against the language-model loss. The busiest expert
can get at most E/k times the mean (each token's k choices are distinct experts). Two runs with
the same data and seed, weight 0 and the weight chosen above:
""")
    a1, a2 = st.columns([1, 3])
    steps = a1.select_slider("Steps per run", AUX_STEPS, key=pm.kept("experts_aux_steps", 40),
                             help="Collapse takes a few steps at lr 3e-2; more steps show the "
                                  "recovery (or not).")
    key = {"experts": experts, "top_k": top_k, "factor": factor, "ep": ep, "aux": aux,
           "steps": steps}
    label = (f"Run weight 0 vs {aux:g}" if aux else "Run weight 0")
    a2.caption(f"{AUX_RUN['layers']} layers × d{AUX_RUN['d_model']}, batch {AUX_RUN['batch']}, "
               f"lr {AUX_RUN['lr']:g}, z-loss off, E = {experts}, top-{top_k}, F = {factor:g}, "
               f"on {dp_for(ep)} ranks (ep {ep}); each run takes a few seconds here.")
    if a2.button(label, key="experts_aux_run"):
        run_live("experts_aux", key, f"Training with aux-loss weight 0 and {aux:g}…",
                 aux_experiment, json.dumps(key, sort_keys=True), fresh=fresh,
                 ranks=dp_for(ep), own_progress=True)
    result, current = last_result("experts_aux", key)
    if result is None:
        st.info(f"Press **{label}** to train the pair ({steps} steps each) and compare.")
        return
    if not current:
        k = result["key"]
        st.warning(f"The settings changed: press **{label}**. Below: the last pair (weight "
                   f"{k['aux']:g}, {k['steps']} steps, E = {k['experts']}, top-{k['top_k']}).")
    runs = result["runs"]
    layers = vx.moe_layers(next(iter(runs.values())))
    layer = st.radio("MoE layer", layers, index=len(layers) - 1, horizontal=True,
                     key="experts_aux_layer", help="Deeper layers collapse more readily.")
    pm.chart(vx.load_over_steps(runs, layer=layer))
    cols = st.columns(len(runs))
    for col, (name, rep) in zip(cols, runs.items()):
        table = vx.load_balance_table(rep, layer)
        last = table[-5:]
        col.metric(f"{name}: busiest ÷ mean, last {len(last)} steps (measured)",
                   f"{sum(t['max_over_mean'] for t in last) / len(last):.2f}")
        col.metric(f"{name}: aux loss, last {len(last)} steps (measured)",
                   f"{sum(t['aux'] for t in last) / len(last):.3f}",
                   help="1 = uniform routing, E = everything on one expert")
        with col.expander(f"{name}: every step"):
            st.dataframe(table, hide_index=True)


def show_wire(rep: dict) -> None:
    c = rep["config"]
    P = c["ep"]
    st.subheader("4 · The all-to-all, rank × rank (counted from the run's splits) beside the "
                 "uniform-routing formula")
    if P == 1:
        st.info("ep = 1: every rank holds every expert and routes to its own copies; no token "
                "crosses ranks (choose ep 2 or 4 above and run again).")
        return
    steps = vx.moe_steps(rep)
    w1, w2, w3 = st.columns(3)
    step = w1.select_slider("Step of the matrix", steps, value=steps[-1], key="experts_a2a_step")
    phase = w2.radio("Exchange", list(PHASES), horizontal=True, key="experts_a2a_phase")
    direction = w3.radio("Pass", list(DIRECTIONS), horizontal=True, key="experts_a2a_pass",
                         help="Backward sends each exchange back the other way: with both "
                              "passes the matrix is symmetric.")
    cols = st.columns(2)
    pm.chart(vx.all_to_all_matrix(rep, step, PHASES[phase], DIRECTIONS[direction]), cols[0],
             share=0.5)
    pm.chart(vx.all_to_all_vs_uniform(rep), cols[1], share=0.5)
    uniform = rep["theory"]["ep_all_to_all_uniform"]
    # what each rank's splits sent to other ranks: counted from the run's records, not socket bytes
    counted = [sum(x["wire_bytes_model"] for x in r["comm"] if x["step"] >= 0) / c["steps"]
               for r in rep["ranks"]]
    m1, m2 = st.columns(2)
    m1.metric("All-to-all bytes per step, rank 0: counted from the run's splits",
              fmt_bytes(counted[0]),
              help=f"{fmt_count(counted[0])} B; every rank: "
                   + ", ".join(fmt_count(b) for b in counted) + " B")
    m2.metric("If routing were uniform, nothing dropped: theory", fmt_bytes(uniform),
              help=f"{fmt_count(uniform)} B: theory.ep_wire_bytes_per_step")
    t = c["batch"] // c["dp"] * c["seq"]
    n = len(theory.moe_blocks(c["layers"], c["experts"], c.get("moe_every", 1)))
    h, k, E = c["d_model"], c["top_k"], c["experts"]
    total = fmt_count(uniform).replace(",", "{,}")  # LaTeX: a comma without a space after it
    st.latex(rf"\underbrace{{{n}}}_{{\text{{MoE layers}}}} \cdot \Bigl(4 \cdot \tfrac{{P-1}}{{P}}"
             rf"\cdot t\,k\,h \cdot 4\,\text{{B}} + \tfrac{{P-1}}{{P}} \cdot 8E\Bigr) = {n} \cdot"
             rf"\Bigl(4 \cdot \tfrac{{{P - 1}}}{{{P}}} \cdot {t} \cdot {k} \cdot {h} \cdot 4 + "
             rf"\tfrac{{{P - 1}}}{{{P}}} \cdot {8 * E}\Bigr) = {total}"
             r"\ \text{B per rank per step}")
    st.markdown(f"""
Per MoE layer each rank sends the rows of its t = {t} tokens × k to the ranks holding their
experts (**dispatch**), gets the outputs back (**combine**), and backward does both again the other
way: four all-to-alls of rows of h = {h} fp32, plus a small **counts** exchange (E int64) so that
every rank knows how many rows to expect. Under uniform routing (P − 1)/P of the rows leave the
rank. The run's splits are uneven (the router prefers some experts) and dropped tokens are never
sent, so the counted bytes differ from the formula. The first bar of each rank is what its
process really wrote to its sockets during the all-to-alls: the rows and gloo's framing of each
message.
""")


def show_memory(rep: dict) -> None:
    c, th = rep["config"], rep["theory"]
    E, P = c["experts"], c["ep"]
    st.subheader(f"5 · Memory per rank: each rank holds E/P = {E // P} of {E} experts")
    pm.chart(vx.expert_memory(rep))
    cats = ("params", "grads", "optimizer")
    equal = sum(all(r["memory"][k] == th["memory"][k] for k in cats) for r in rep["ranks"])
    n = len(theory.moe_blocks(c["layers"], E, c.get("moe_every", 1)))
    all_experts = n * E * theory.mlp_params(c["d_model"])
    m1, m2, m3 = st.columns(3)
    m1.metric("Ranks whose measured states equal theory to the byte",
              f"{equal} of {len(rep['ranks'])}")
    held = th.get("expert_params_per_rank", all_experts)  # (only given when ep > 1)
    m2.metric("Expert parameters per rank (theory)", f"{held:,}",
              help=f"E/P = {E}/{P} experts × {n} MoE layers × (8h² + 5h)")
    m3.metric("All expert parameters (theory)", f"{all_experts:,}",
              help=f"each rank holds 1/{P} of them" if P > 1 else "every rank holds all of them")


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
st.title("Experts")
pm.intro(r"""
A **mixture of experts** replaces a block's MLP by **E** expert MLPs and a router that sends each
token to **k** of them: parameters grow E-fold, the compute per token only k-fold. Each expert
takes at most a **capacity** of tokens per sequence; the overflow is dropped. **Expert
parallelism** gives each of **P** ranks E/P of the experts: tokens travel to their expert's rank
and back with two **all-to-alls**. Everything below comes from a live run on real ranks (gloo on
this machine's CPU), beside the formulas.
""")

controls = pm.Controls(4)
c1, c2, c3, c4 = controls.columns
experts = c1.radio("Experts per MoE layer (E)", [4, 8], horizontal=True,
                   key=pm.kept("experts.E", 8))
top_k = c2.radio("Experts per token (top-k)", [1, 2], horizontal=True,
                 key=pm.kept("experts.top_k", 2))
factor = c3.select_slider("Capacity factor (F)", FACTORS, key=pm.kept("experts.factor", 1.25),
                          help="1.0 = each expert's fair share of a sequence's assignments")
ep = c4.radio("Expert-parallel ranks (ep = P)", EP_CHOICES, horizontal=True,
              key=pm.kept("experts.ep", 2),
              help="The experts are split over P of the dp = max(2, P) data-parallel ranks.")
aux = controls.area.slider("Load-balancing (aux) loss weight", 0.0, 0.1, step=0.01,
                           key=pm.kept("experts.aux", 0.05),
                           help="0 turns it off; the library's default is 0.01.")
controls.area.caption(f"Model: {MODEL['layers']} MoE layers × d{MODEL['d_model']}, "
                      f"s = {MODEL['seq']}, vocabulary {MODEL['vocab']}, batch {MODEL['batch']}, "
                      f"{MODEL['steps']} training steps on dp = {dp_for(ep)} ranks, with the "
                      f"single-process reference.")
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)

cfg = run_config(experts, top_k, factor, ep, aux)
error = None
try:
    RunConfig.from_dict(cfg)
except ConfigError as err:
    error = f"Invalid settings: {err}"
    st.error(error)

key = {"experts": experts, "top_k": top_k, "factor": factor, "ep": ep, "aux": aux}
if controls.run_button(disabled=error is not None,
                       help=f"Trains the MoE toy on {dp_for(ep)} ranks and on one process "
                            f"(the reference)."):
    run_live("experts", key, f"Training E = {experts}, top-{top_k} on {dp_for(ep)} ranks…",
             experts_run, json.dumps(cfg, sort_keys=True), fresh=fresh, ranks=dp_for(ep),
             where=controls.run_area)

report, current = last_result("experts", key)
if report is None:
    st.info("Press **Run live** to train a mixture of experts on real ranks and see where its "
            "tokens go.")
else:
    if not current:
        c = report["config"]
        st.warning(f"The settings changed: press **Run live**. Below: the last run (E = "
                   f"{c['experts']}, top-{c['top_k']}, F = {c['capacity_factor']:g}, ep "
                   f"{c['ep']}, aux weight {c['aux_loss_weight']:g}).")
    layer, step = show_routing(report)
    show_load(report, layer, step)
show_aux(experts, top_k, factor, ep, aux, fresh)
if report is not None:
    show_wire(report)
    show_memory(report)
    show_equality(report)
