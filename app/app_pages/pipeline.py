"""Pipeline bubbles: two schedules drawn as planned (unit costs, the formula's bubble beside them),
then run live on p ranks: each rank's step as a Gantt chart in two views (measured on the wall
clock, each rank pinned to a core of its own when the machine has enough, and replayed with the
measured op CPU times as if each rank had its own device), the bubble in both views against the
formula with what the wall clock's gap to it is made of, the activations each stage holds in
flight, the point-to-point bytes per stage against `theory`, and the losses against the
single-process reference."""
import math
import json

import altair as alt
import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import (TOLERANCE, StepBar, fmt_bytes, fmt_count, last_result, run_live,
                       training_run)
from parallel_mini import theory
from parallel_mini.course import trace
from parallel_mini.course import timelines, viz
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.parallel import schedules as S
from parallel_mini.report import RunReport
from parallel_mini.course.viz.style import scaled_font, spec_of

SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "dualpipe"]
NAMES = {"naive": "naive (one micro-batch at a time)", "gpipe": "GPipe (all F, then all B)",
         "1f1b": "1F1B (one forward, one backward)", "interleaved": "interleaved 1F1B",
         "zb": "zero bubble (ZB-H1, B and W split)",
         "zbv": "V-shaped zero bubble (2 chunks per rank in a V)",
         "dualpipev": "DualPipeV (DualPipe's phases on zbv's V)",
         "dualpipe": "DualPipe (both directions, every stage twice)"}
DUAL = ("dualpipe", "dualpipev")  # planned with their F&B pairs as one unit, as the report counts
MODEL = {"d_model": 64, "heads": 4, "seq": 32, "vocab": 128}  # the toy; one sequence per micro-batch
STEPS = trace.PIPELINE_STEPS  # step 0 warms up, steps 1-4 are timed, the last is memory-metered
PLAN_COSTS = {"F": 1.0, "B": 2.0}  # a backward costs about two forwards
PLAN_COSTS_SPLIT = {"F": 1.0, "B": 1.0, "W": 1.0}  # B + W = the unsplit backward
VIEWS = {"wall": timelines.LABELS["wall"], "own": timelines.LABELS["replayed"]}  # the measurement first

CHART_WIDTH = 440  # two timelines side by side in the wide layout
WIDE_WIDTH = 960  # one timeline per row, when a rank runs too many ops to read them side by side
SIDE_BY_SIDE_OPS = 24  # most ops per rank drawn side by side


def run_config(pp: int, m: int, schedule: str, v: int, layers: int) -> dict:
    return {**MODEL, "pp": pp, "microbatches": m, "batch": m, "schedule": schedule,
            "virtual_stages": v if schedule == "interleaved" else 0, "layers": layers,
            "steps": STEPS, "reference": True}


def label_of(schedule: str, v: int) -> str:
    return f"interleaved (v = {v})" if schedule == "interleaved" else schedule


def formula_latex(schedule: str, pp: int, m: int, v: int) -> str:
    if schedule == "naive":
        return rf"\frac{{p-1}}{{p}} = \frac{{{pp - 1}}}{{{pp}}}"
    if schedule in ("gpipe", "1f1b"):
        return rf"\frac{{p-1}}{{m+p-1}} = \frac{{{pp - 1}}}{{{m + pp - 1}}}"
    if schedule == "interleaved":
        return rf"\frac{{p-1}}{{v\,m+p-1}} = \frac{{{pp - 1}}}{{{v * m + pp - 1}}}"
    if schedule == "zbv":
        return r"\text{greedy order: no closed form; its unit-cost replay}"
    if schedule in DUAL:  # (PP/2 - 1)(F&B + B - 3W) with F = B = W = 1, F&B = F + B + W = 3
        stages = pp if schedule == "dualpipe" else 2 * pp
        idle, busy = stages - 2, (3 * m if schedule == "dualpipe" else 6 * m)
        return (rf"\frac{{(PP/2-1)(F\&B+B-3W)}}{{\ldots + \text{{busy}}}} = "
                rf"\frac{{{idle}}}{{{busy} + {idle}}}\quad (PP = {stages})")
    # (p-1)(F+B-W) / ((p-1)(F+B-W) + m(F+B+W)), with F = B = W
    return (rf"\frac{{p-1}}{{3m+p-1}} = \frac{{{pp - 1}}}{{{3 * m + pp - 1}}}"
            rf"\quad (F = B = W)")


def cores_in_short(shared: bool | None, pp: int) -> str:
    """trace.placement's note, short enough for a chart's subtitle."""
    return {False: f"wall clock: each of the {pp} ranks pinned to a core of its own",
            True: f"wall clock: the {pp} ranks shared the cores (waits include core contention)",
            None: "wall clock: whether the ranks shared cores is not known"}[shared]


def ops_per_rank(schedule: str, m: int, v: int) -> int:
    chunks = v if schedule == "interleaved" else 2 if schedule in ("zbv", "dualpipev") else 1
    return m * chunks * (3 if schedule in ("zb", "zbv", *DUAL) else 2)


def timeline_layout(schedules: list[str], m: int, v: int) -> tuple[list, int]:
    """Containers for the timelines (side by side, or one per row when they would be crowded)
    and the chart width that fits them."""
    if max(ops_per_rank(s, m, v) for s in schedules) <= SIDE_BY_SIDE_OPS:
        return st.columns(len(schedules)), CHART_WIDTH
    return [st.container() for _ in schedules], WIDE_WIDTH


def timeline_chart(timed: list[dict], title: str, subtitle: list[str], seconds: bool, width: int,
                   x_max: float | None) -> dict:
    # presentation mode enlarges every text after the chart is built: fit the bar labels at the
    # size they will be drawn
    return _timeline_spec(timed, title, subtitle, seconds, width, x_max, pm.on())


@st.cache_data(max_entries=64, show_spinner=False)
def _timeline_spec(timed: list[dict], title: str, subtitle: list[str], seconds: bool, width: int,
                   x_max: float | None, presenting: bool) -> dict:
    """viz.pipeline_timeline's spec, built once per (bars, words, size, mode): the page's four
    timelines were about half of a warm redraw's server time (0.39 of 1.0 s under cProfile); the
    same arguments give the same spec, and every caller gets its own copy."""
    return spec_of(viz.pipeline_timeline(timed, title, subtitle=subtitle, seconds=seconds,
                                         width=width, x_max=x_max,
                                         drawn_font=scaled_font if presenting else None))


def pipeline_experiment(key_json: str, attempt: int = 0) -> dict:
    """Both schedules on real ranks (each run cached per config by live_runs.training_run), each
    with the single-process reference."""
    k = json.loads(key_json)
    runs = {}
    todo = list(dict.fromkeys(k["schedules"]))
    bar = StepBar(len(todo))
    for schedule in todo:
        bar.step(f"{label_of(schedule, k['v'])}: {k['pp']} ranks, {k['m']} micro-batches, "
                 f"{STEPS} steps, and the single-process reference…")
        cfg = run_config(k["pp"], k["m"], schedule, k["v"], k["layers"])
        runs[schedule] = training_run(json.dumps(cfg, sort_keys=True), attempt)
    bar.done()
    return {"key": k, "runs": runs}


def show_live(result: dict, current: bool, same_axis: bool = False) -> None:
    """Sections 2-5: what both runs measured."""
    k = result["key"]
    if not current:
        st.warning(f"The settings changed: press **Run live**. Below: the last run (p = {k['pp']}, "
                   f"m = {k['m']}, {' vs '.join(label_of(s, k['v']) for s in k['schedules'])}).")
    reports = {label_of(s, k["v"]): RunReport.from_dict(result["runs"][s]) for s in k["schedules"]}
    bubbles = {lab: trace.bubble(rep) for lab, rep in reports.items()}
    step = next(iter(bubbles.values()))["steps"][0]

    st.subheader("2 · One training step, measured")
    view = st.radio("View", list(VIEWS.values()), horizontal=True,
                    help="Measured (wall clock): every op's start and end as the ranks ran it. "
                         "Replayed: every op in the order the rank ran it, with its stage's measured "
                         "CPU time, each rank a device of its own and links instant (a simulation "
                         "fed with measurements).")
    own = view == VIEWS["own"]
    views = {lab: (trace.own_device_replay(rep, step) if own else timelines.wall_view(rep, step))
             for lab, rep in reports.items()}
    x_max = 1e3 * max(max(t["end"] for t in timed) for timed in views.values()) if same_axis \
        else None  # each schedule its own time axis: the faster one is not squeezed
    places, width = timeline_layout(k["schedules"], k["m"], k["v"])
    for col, (lab, timed) in zip(places, views.items()):
        b = bubbles[lab]
        wall, replayed = b["wall"], b["replayed"]
        short = lab.split(" ")[0]
        with col:
            pm.chart(timeline_chart(
                timed, f"{lab}: {view}",
                subtitle=[f"{'a typical step' if own else f'step {step}'} of {STEPS} (0 warms up), {k['pp']} ranks, {k['m']} micro-batches; "
                          f"bubble {replayed['overall'] if own else wall['per_step'][0]:.1%}",
                          f"each op its stage's own CPU time (10th percentile over steps {step}-{b['steps'][-1]})" if own
                          else "waits: a rank blocked on a neighbour's message",
                          cores_in_short(wall["ranks_shared_cores"], k["pp"])],
                seconds=True, width=width, x_max=x_max), share=width / WIDE_WIDTH)
            m1, m2, m3 = st.columns(3)
            m1.metric(f"Measured: {short}", f"{wall['per_step'][0]:.1%}",
                      help=f"Mean over ranks of the share of step {step} on the wall clock in which "
                           f"each rank computed nothing (trace.bubble; mean over the timed steps: "
                           f"{wall['overall']:.1%}). {wall['placement']}.")
            m2.metric(f"Replayed: {short}", f"{replayed['overall']:.1%}",
                      help="The same share in the own-device replay: each op its stage's measured "
                           "CPU time, links instant (a simulation fed with measurements; with equal "
                           "op costs it returns the formula)")
            m3.metric(f"Formula: {short}", f"{b['theory']:.1%}",
                      help="theory.bubble_fraction" + (" with the measured F, B, W CPU times"
                                                       if "W" in b["op_cpu_s"] else ""))
            gap = ", ".join(f"{trace.GAP_PARTS[part]} {100 * x:+.1f}" for part, x in wall["gap_to_formula"].items())
            share = wall["op_cpu_over_wall_per_rank"]
            cpu = ", ".join(f"{kind} {1e3 * t:.2f} ms" for kind, t in b["op_cpu_s"].items())
            st.caption(f"Wall clock minus formula, points (trace.wall_gap, measured): {gap}. "
                       f"The ops' CPU time is {min(share):.0%}-{max(share):.0%} of their wall time "
                       f"(100%: nothing else ran on the rank's core). Replay: CPU time per op (per "
                       f"chunk, mean over stages) {cpu}; idle share per rank "
                       + ", ".join(f"{x:.0%}" for x in replayed["per_rank"]) + ".")

    rows = [{"schedule": lab, "source": timelines.LABELS[src], "bubble": value}
            for lab, b in bubbles.items()
            for src, value in (("wall", b["wall"]["overall"]), ("replayed", b["replayed"]["overall"]),
                               ("theory", b["theory"]))]
    pm.chart(viz.bubble_bars(rows, title="Pipeline bubble: measured (wall clock), replayed and formula", subtitle=[
        f"p = {k['pp']}, m = {k['m']}; steps {step}-{bubbles[next(iter(bubbles))]['steps'][-1]}, mean over the ranks; "
        + next(iter(bubbles.values()))["wall"]["placement"],
        "formula: theory.bubble_fraction (zero bubble with the measured F, B, W times)"])
        .configure_legend(labelLimit=0))  # the replay's label in full
    shared = next(iter(bubbles.values()))["wall"]["ranks_shared_cores"]
    cores = (f"This run's {k['pp']} ranks **shared** the cores: the OS interleaved them, so a rank "
             f"also stalled while another rank had its core, and those stalls look like bubble "
             f"(p = 2 gives each rank a core on a 2-core laptop)." if shared else
             "This run had a core per rank." if shared is False else
             "Whether this run's ranks shared cores is not known.")
    st.markdown(f"""
    **Measured, and replayed.** The wall clock is the measurement: when this machine has a core
    for every rank, each rank is pinned to a core of its own with one thread, and the idle share on
    the wall clock is the bubble. {cores}
    What separates it from the formula is measured from the same events (caption above): the stages
    are not equal (stage 0 also holds the embeddings, the last stage the LM head and the loss, hence
    {S.BLOCKS_PER_CHUNK} blocks per chunk), ops vary in time, every message takes a moment to hand
    over, cross and take,
    and the runner does some bookkeeping between ops. The *replay* runs each rank's recorded order
    through the schedule with the op's measured **CPU** time (its 10th percentile over the timed
    steps) and instant links: the step as it would look with one device per rank. It is a
    simulation, not a measurement: with equal op costs it returns the formula by construction, so
    its gap to the formula shows only what unequal op costs do.
    """)

    # --- 3. memory -------------------------------------------------------------------------------
    st.subheader("3 · Activation memory per stage")
    cols = st.columns(len(reports))
    for col, (lab, rep) in zip(cols, reports.items()):
        pm.chart(viz.in_flight_chart(
            rep.to_dict(), title=f"Activations in flight per stage: {lab} (measured)",
            subtitle=[f"step {STEPS - 1} under the memory meter: bytes held beyond the model states "
                      "after each op"]), col, share=1 / len(cols))
    mem_rows = []
    for lab, rep in reports.items():
        stages = rep.theory["stages"]
        for r in rep.ranks:
            s = r["coords"]["pp"]
            n = stages[s]["microbatches_in_flight"]
            mem_rows.append({"stage": f"rank {s}", "source": lab,
                             "bytes": r["memory"]["activations_peak"], "in_flight": f"{n} in flight"})
    pm.chart(viz.pipeline_stage_bars(
        mem_rows, "bytes", "Activation peak per stage (measured)",
        ["label: the most micro-batches (× chunks) the schedule keeps in flight on that stage "
         "(schedules.in_flight, theory)"], "activations peak", label="in_flight"))
    first_rank = {lab: rep.ranks[0] for lab, rep in reports.items()}
    held = "; ".join(f"{lab}: {fmt_bytes(r['memory']['activations_peak'])} with "
                     f"{reports[lab].theory['stages'][0]['microbatches_in_flight']} in flight"
                     for lab, r in first_rank.items())
    st.markdown(f"""
    Stage 0 at its peak: {held}. A stage keeps each micro-batch's activations from its forward until
    its backward (until W, for zero bubble). **GPipe** runs all m forwards first, so every stage holds
    all m. **1F1B** starts backwards as soon as possible: stage r holds at most p − r. Its bubble is
    the same as GPipe's (same (p − 1)/(m + p − 1)): 1F1B saves **memory, not time**. The bytes do not
    scale exactly with the count: the batch, the messages received and the loss are held by every
    schedule. **Zero bubble** keeps 1F1B's count, but a backward whose W is postponed still holds the
    inputs and output gradients W will need. **DualPipe** holds p + 1 micro-batches of a stage on
    every rank (the report's PP + 1; DualPipeV 2p + 1 half-size chunks), and each of its ranks
    holds two stages' parameters: the memory it pays for the smaller bubble.
    """)

    # --- 4. p2p bytes ----------------------------------------------------------------------------
    st.subheader("4 · Point-to-point bytes per stage")
    cols = st.columns(len(reports))
    matched, extra = {}, {}
    for col, (lab, rep) in zip(cols, reports.items()):
        rows_b = []
        for r in rep.ranks:
            s = r["coords"]["pp"]
            counted = rep.wire_bytes_per_step(r["rank"]).get("pp", 0.0)  # the isends' payloads
            written = rep.wire_bytes_per_step(r["rank"], kind="measured").get("pp")  # or None
            predicted = rep.theory["stages"][s]["wire_bytes_per_step"]["pp"]
            if written is not None:
                rows_b.append({"stage": f"rank {s}", "source": "measured (written to sockets)",
                               "bytes": written})
                sends = sum(c["op"] == "send" and c["step"] >= 0 for c in r["comm"])
                extra.setdefault(lab, []).append(
                    (written - counted) * rep.config["steps"] / max(sends, 1))
            rows_b += [{"stage": f"rank {s}", "source": "counted", "bytes": counted},
                       {"stage": f"rank {s}", "source": "theory", "bytes": float(predicted)}]
            matched.setdefault(lab, []).append(counted == predicted)
        pm.chart(viz.pipeline_stage_bars(
            rows_b, "bytes", f"Bytes each stage sends per step: {lab}",
            ["measured: what the stage's process wrote to its sockets during its sends;",
             "counted: their payloads, from its send records; theory: "
             "theory.pipeline_p2p_bytes_per_step"],
            "bytes sent per step", palette=["#4c78a8", "#9ecae9", "#bab0ac"]
            if extra.get(lab) else ["#9ecae9", "#bab0ac"]), col, share=1 / len(cols))
        col.metric(f"Stages sending exactly the formula's bytes (counted): {lab}",
                   f"{sum(matched[lab])} of {len(matched[lab])}")
    if extra:
        st.caption("Written to sockets minus counted, per message: " + "; ".join(
            f"{lab} {min(v):,.0f}–{max(v):,.0f} B" for lab, v in extra.items()) + ". That is "
            "gloo's framing: a header with each message and a short notice from each receiver "
            "that its buffer is ready. Sends in flight together share what was written meanwhile, "
            "so read a stage's total rather than one message's share.")
    act = 4 * MODEL["seq"] * MODEL["d_model"]
    st.markdown(f"""
    Each micro-batch crosses every stage boundary twice: its activation [b, s, h] = [1, {MODEL['seq']},
    {MODEL['d_model']}] in fp32 = **{fmt_count(act)} B** forward, and the gradient of the same shape
    backward. Stage 0 only sends forward, the last stage only backward, the ones between both:
    m × {fmt_count(act)} B or 2m × {fmt_count(act)} B per step. **Interleaved** cuts the model into
    p·v chunks, so a micro-batch crosses p·v − 1 boundaries instead of p − 1: about v times the
    messages for a bubble about v times smaller, (p − 1)/(v·m + p − 1).
    """)

    # --- 5. same training ------------------------------------------------------------------------
    st.subheader("5 · Same training as one process?")
    cols = st.columns(len(reports))
    for col, (lab, rep) in zip(cols, reports.items()):
        diff = rep.max_abs_diff
        col.metric(f"max |run − reference| (losses, final params): {lab}", f"{diff:.2e}",
                   delta="equal within 1e-5" if diff <= TOLERANCE else "DIFFERENT",
                   delta_color="normal" if diff <= TOLERANCE else "inverse")
        col.caption(f"Final loss: {rep.losses[-1]:.6f} on the pipeline, "
                    f"{rep.reference_losses[-1]:.6f} on one process with the whole batch.")
    st.caption("Every schedule computes the same gradients, summed over the micro-batches: only the "
               "order of the ops differs, so the losses and the updated weights equal one process's.")


# --- 6. what the schedules do ----------------------------------------------------------------
def show_schedules() -> None:
    st.subheader("The schedules, in short")
    st.markdown(r"""
- **Naive**: one micro-batch in the pipe at a time; every rank waits for all the others: idle
  (p − 1)/p of the step, whatever m.
- **GPipe** (Huang et al., 2019): all m forwards, then all m backwards. The bubble is p − 1
  forwards and backwards at the ends of the step, so it shrinks as m grows:
  (p − 1)/(m + p − 1). The price: every stage holds the activations of all m micro-batches.
- **1F1B** (PipeDream-Flush, Narayanan et al., 2021): after p − 1 − r warm-up forwards, stage r
  alternates one forward and one backward, so a micro-batch's activations are freed as early as
  possible. Same bubble as GPipe, at most p − r micro-batches in flight: memory, not time.
- **Interleaved 1F1B** (Narayanan et al., 2021): each rank holds v smaller chunks (rank r: chunks
  r, r + p, …). The pipe fills and drains with ops v times shorter: bubble (p − 1)/(v·m + p − 1),
  paid for with about v times the point-to-point messages. It needs m to be a multiple of p.
- **Zero bubble, ZB-H1** (Qi et al., 2024): the backward is split in two. **B** computes the
  gradient for the layer's input, which the previous stage waits for; **W** computes the gradient
  for the weights, which nobody downstream needs before the optimizer step. Postponed W's fill
  the cool-down where 1F1B idles: bubble (p − 1)(F + B − W) of time, with 1F1B's memory count.
- **DualPipe** (DeepSeek-V3 report, 2024): every rank holds **two** stages, i and p − 1 − i, so
  every stage lives on two ranks (parameters twice). Half the micro-batches enter at rank 0 and
  run down, the other half enter at rank p − 1 and run up through the second copies: the two
  streams fill each other's bubbles. In the steady state each rank pairs a forward of one
  micro-batch with a backward of another (**F&B**); on a GPU cluster the pair's communication
  (the experts' all-to-all, the pipeline's sends) runs while the other half of the pair computes.
  Before the step, the two copies of each stage sum their gradients (one exchange between ranks
  i and p − 1 − i), so they stay equal. Needs p even and m ≥ 2p.
- **DualPipeV** (Sea AI Lab's "cut-in-half" of DualPipe): zbv's V (2p half-size chunks, rank r
  holds r and 2p − 1 − r) run with DualPipe's eight phases: one copy of the parameters.
""")
    rows = theory.pipeline_table(8)
    st.caption("The DeepSeek-V3 report's table for PP = 8 stages (theory, F = B = W = 1 time unit, "
               "F&B = F + B + W: nothing overlapped; 'bubble' in units, parameters and activations "
               "in one stage's worth; DualPipeV runs its 8 stages on 4 devices):")
    st.dataframe(pd.DataFrame(rows), hide_index=True)


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
st.title("Pipeline bubbles")
pm.intro(r"""
Pipeline parallelism gives each of **p** ranks a slice of the layers (a *stage*); activations
flow forward from stage to stage, gradients flow back. A batch is cut into **m micro-batches** so
that the stages can work on different micro-batches at once. At the start of a step the last
stages have nothing to do yet, at the end the first ones have nothing left: that idle time is the
**bubble**. It lasts about p − 1 ops of each kind whatever m is, so more micro-batches make it a
smaller share of the step: (p − 1)/(m + p − 1) for GPipe and 1F1B.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
pp = c1.radio("Pipeline stages (p)", [2, 4], horizontal=True, key=pm.kept("pp.pp", 4),
              help="One rank per stage, each pinned to a core of its own when this machine has "
                   "p cores or more (else the ranks share the cores).")
m = c1.slider("Micro-batches per step (m)", 1, 16, key=pm.kept("pp.m", 8),
              help="One sequence of 32 tokens each: the batch is m sequences.")
first = c2.selectbox("Schedule", SCHEDULES, key=pm.kept("pp.first", "gpipe"),
                     format_func=lambda s: NAMES[s])
second = c2.selectbox("Compare with", SCHEDULES, key=pm.kept("pp.second", "1f1b"),
                      format_func=lambda s: NAMES[s])
uses_v = "interleaved" in (first, second)
if not uses_v:  # disabled without interleaved: back to its default, not kept behind the grey
    pm.reset("pp.v", 2)
v_choice = c3.radio("Virtual stages per rank (v, interleaved only)", [2, 3], horizontal=True,
                    disabled=not uses_v, key=pm.kept("pp.v", 2),
                    help="Interleaved gives each rank v smaller chunks of the model: rank r holds "
                         "chunks r, r + p, …")
v = v_choice if uses_v else 1
# the CLI's choice: the same blocks in every chunk, enough that the embeddings and the head weigh
# little beside a stage (zbv needs 2 chunks per rank: both schedules get lcm(v, 2))
v_shaped = {"zbv", "dualpipev"} & {first, second}
layers = S.pipeline_layers(pp, v * 2 // math.gcd(v, 2) if v_shaped else v)
per_chunk = {s: layers // (pp * (v if s == "interleaved" else 2 if s in ("zbv", "dualpipev") else 1))
             for s in dict.fromkeys([first, second])}  # (dualpipe: p stages, each held twice)
c3.caption(f"Model: {layers} layers × d{MODEL['d_model']}, vocabulary {MODEL['vocab']}, "
           f"{STEPS} steps (the same model for both schedules: "
           + ", ".join(f"{n} layer(s) per chunk ({s})" for s, n in per_chunk.items()) + ").")
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)

chosen = list(dict.fromkeys([first, second]))
errors = {}
for s in chosen:
    try:
        RunConfig.from_dict(run_config(pp, m, s, v, layers))
    except ConfigError as err:
        errors[s] = str(err)

# --- 1. as planned ---------------------------------------------------------------------------
st.subheader("1 · The schedules as planned (theory only)")
st.caption("Before any run: each schedule replayed with unit costs, every rank a device of its "
           "own and transfers free (`schedules.simulate`). A forward takes 1 unit, a backward 2 "
           "(zero bubble: F = B = W = 1, B and W together being the backward). The idle share of "
           "such a plan is exactly the formula beside it.")
same_axis = st.toggle("Same time axis for both schedules", value=False, key="pp.same_axis",
                      disabled=len(chosen) < 2,
                      help="Off: each timeline spans its own step, so the faster schedule is drawn "
                           "as large as the slower one. On: one scale, so lengths compare.")
plans = {}
for s in chosen:
    if s in errors:
        continue
    schedule = S.build_schedule(s, pp, m, v if s == "interleaved" else 0)
    if s in DUAL:  # each F&B pair one unit: the report's count (schedules.simulate, fused)
        plans[s] = (schedule, S.simulate(schedule, lambda r, op: PLAN_COSTS_SPLIT[op.kind],
                                         fused=True))
    else:
        plans[s] = (schedule, timelines.replay_ops(schedule, PLAN_COSTS_SPLIT if schedule.split_backward
                                                   else PLAN_COSTS))
plan_max = max((max(t["end"] for t in timed) for _, timed in plans.values()),
               default=None) if same_axis else None
places, width = timeline_layout(chosen, m, v)
for col, s in zip(places, chosen):
    with col:
        if s in errors:
            st.error(f"{label_of(s, v)}: invalid settings: {errors[s]}")
            continue
        schedule, timed = plans[s]
        formula = theory.bubble_fraction(s, pp, m, schedule.virtual)
        pm.chart(timeline_chart(
            timed, f"Planned: {label_of(s, v)}, p = {pp}, m = {m}",
            subtitle=["unit costs " + ("F = B = W = 1" if schedule.split_backward
                                       else "F = 1, B = 2") + ", each rank its own device"
                      + ("; each F&B pair (an F, then a B of the rank's other chunk) one unit"
                         if s in DUAL else ""),
                      f"in flight at most (micro-batches × chunks): "
                      f"{', '.join(map(str, S.in_flight(schedule)))} on ranks 0…{pp - 1}"],
            seconds=False, width=width, x_max=plan_max), share=width / WIDE_WIDTH)
        f1, f2 = st.columns([2, 3])
        f1.metric(f"Bubble (theory): {s}", f"{formula:.1%}",
                  help="theory.bubble_fraction: the idle share of this plan"
                  + (". Zero bubble in general: (p−1)(F+B−W) / ((p−1)(F+B−W) + m(F+B+W))"
                     if s == "zb" else ""))
        with f2:
            st.latex(formula_latex(s, pp, m, v))
        with st.expander("The schedule as text"):
            st.code(S.format_schedule(schedule), language=None)

# --- 2. live ---------------------------------------------------------------------------------
key = {"pp": pp, "m": m, "schedules": chosen, "v": v, "layers": layers}
run_clicked = controls.run_button(disabled=bool(errors),
                                  help="Fix the settings first." if errors else
                                  f"Trains the toy on {pp} ranks with each schedule ({STEPS} "
                                  f"steps) and once on a single process.")
if run_clicked and not errors:
    run_live("pp", key, f"Running {' and '.join(label_of(s, v) for s in chosen)} on {pp} "
                        f"ranks…", pipeline_experiment, json.dumps(key, sort_keys=True),
             fresh=fresh, ranks=pp, own_progress=True, where=controls.run_area)


result, current = last_result("pp", key)
if result is None:
    st.info("Press **Run live** to run both schedules on real ranks (gloo on this machine's CPU) "
            "and measure their bubbles.")
else:
    show_live(result, current, same_axis)
show_schedules()
