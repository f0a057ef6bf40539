"""Long sequences (context parallel), run live: the same toy trained with every sequence split over
C ranks three ways (ring, zigzag, Ulysses). The K/V blocks going round the ring, animated from the
sends the ranks recorded; each rank's causal tile map, contiguous beside zigzag, masked tiles
skipped; the ring's sends beside Ulysses' all-to-alls, the bytes against
`theory.cp_wire_bytes_per_step`; activation bytes per layer per rank against sequence length (the
formula as lines, live runs as points); and the losses against the single-process reference."""
import json

import streamlit as st

import presentation as pm
from live_runs import (TOLERANCE, StepBar, fmt_bytes, fmt_count, last_result, run_live,
                       training_run)
from parallel_mini import theory
from parallel_mini.course import viz
from parallel_mini.course.viz.animate import autoplay
from parallel_mini.course.viz.style import spec_of
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.parallel.context import hidden_fraction

MODEL = {"d_model": 64, "vocab": 128, "batch": 4}  # the toy; heads and s are chosen on the page
IMPLS = {"ring": "ring (contiguous chunks)", "zigzag": "zigzag (balanced ring)",
         "ulysses": "Ulysses (all-to-all)"}
LAYOUTS = {"contiguous (ring)": "ring", "zigzag": "zigzag"}
MAX_SEQ = 256  # the activation curve's live points stop here (s x s scores without CP)


def run_config(impl: str, c: int, seq: int, heads: int, layers: int = 1,
               reference: bool = True) -> dict:
    """One run of the page: C ranks, one training step; one layer by default (the animation and
    the tile map show one layer)."""
    return {**MODEL, "heads": heads, "seq": seq, "cp": c, "cp_impl": impl, "layers": layers,
            "steps": 1, "reference": reference}


def activation_seqs(seq: int) -> list[int]:
    """The sequence lengths measured for the activation curve: s, 2s, 4s up to MAX_SEQ."""
    return [s for s in (seq, 2 * seq, 4 * seq) if s <= MAX_SEQ] or [seq]


def series_of(c: int) -> dict[str, tuple[int, str]]:
    """Activation curve series: label -> (cp, impl)."""
    return {"no context parallel (C = 1)": (1, "ring"), f"ring / zigzag, C = {c}": (c, "ring"),
            f"Ulysses, C = {c}": (c, "ulysses")}


def _compact(report: dict) -> dict:
    """What this page draws from a report (the events timeline is left out)."""
    keep = ("config", "world_size", "losses", "reference_losses", "max_abs_diff", "theory")
    return {**{k: report[k] for k in keep if k in report},
            "ranks": [{"rank": r["rank"], "coords": r["coords"], "memory": r["memory"],
                       "comm": [x for x in r["comm"] if x["step"] >= 0],
                       "context": r.get("context", {})} for r in report["ranks"]]}


def context_experiment(key_json: str, attempt: int = 0) -> dict:
    """The runs behind "Run live", each cached per config by live_runs.training_run: ring, zigzag
    and Ulysses on C ranks (one layer, one step, with the single-process reference). The activation
    curve's runs are activation_experiment's, behind their own button."""
    k = json.loads(key_json)
    c, seq, heads = k["cp"], k["seq"], k["heads"]
    bar = StepBar(len(IMPLS))
    runs = {}
    for impl in IMPLS:
        bar.step(f"{IMPLS[impl]}: {c} ranks, s = {seq}, and the single-process reference…")
        cfg = run_config(impl, c, seq, heads)
        runs[impl] = _compact(training_run(json.dumps(cfg, sort_keys=True), attempt))
    bar.done()
    return {"key": k, "runs": runs}


def activation_experiment(key_json: str, attempt: int = 0) -> dict:
    """The activation curve's runs (each cached per config by live_runs.training_run): every series
    at s, 2s, 4s with 1 and 2 layers, one step, no reference (a layer's activation bytes are the
    difference of the two peaks)."""
    k = json.loads(key_json)
    c, seq, heads = k["cp"], k["seq"], k["heads"]
    jobs = [(name, cp, impl, s, layers) for name, (cp, impl) in series_of(c).items()
            for s in activation_seqs(seq) for layers in (1, 2)]
    bar = StepBar(len(jobs))
    peaks: dict[str, dict[int, dict[int, int]]] = {}
    for name, cp, impl, s, layers in jobs:
        bar.step(f"activations: {name}, s = {s}, {layers} layer(s)…")
        cfg = run_config(impl, cp, s, heads, layers, reference=False)
        rep = training_run(json.dumps(cfg, sort_keys=True), attempt)
        peaks.setdefault(name, {}).setdefault(s, {})[layers] = \
            rep["ranks"][0]["memory"]["activations_peak"]
    bar.done()
    points = [{"series": name, "seq": s, "bytes": by[2] - by[1]}
              for name, per in peaks.items() for s, by in per.items()]
    return {"key": k, "activation_points": points}


def activation_theory(c: int, heads: int) -> dict:
    """Each series' formula: theory.gpt_activation_bytes_per_layer at s tokens."""
    b, h = MODEL["batch"], MODEL["d_model"]
    return {name: (lambda s, cp=cp, impl=impl: theory.gpt_activation_bytes_per_layer(
        s, b, h, heads, "none", 4, cp=cp, cp_impl=impl)) for name, (cp, impl) in series_of(c).items()}


@st.cache_data(max_entries=16, show_spinner=False)
def tile_maps_spec(reports_json: str) -> dict:
    """viz.tile_maps of {layout: report} (JSON) as a Vega-Lite spec, built once per pair of runs:
    its 8 panels of 4 layers were most of a warm redraw (0.58 of the page's 0.8 s on the server);
    the same runs give the same spec, and every caller gets its own copy."""
    return spec_of(viz.tile_maps(json.loads(reports_json)))


@st.cache_data(max_entries=16, show_spinner=False)
def ring_spec(report_json: str) -> dict:
    """The ring animation of one run (JSON), playing by itself: built once per run, as above."""
    rep = json.loads(report_json)
    return autoplay(viz.ring_kv_animation(rep), "frame", 2 * rep["config"]["cp"])


def _per_rank(values) -> str:
    return ", ".join(str(int(v)) for v in values)


def _messages_per_step(report: dict) -> int:
    """Rank 0's cp calls (ring sends or all-to-alls) in one training step."""
    return len(viz.cp_comm_frame(report).query("rank == 0"))


def _framing(report: dict) -> tuple[float, int] | None:
    """(written to sockets minus counted per call, calls per step) on rank 0; None where the
    written bytes cannot be read."""
    written, counted = viz.cp_sent_bytes(report, "measured")[0], viz.cp_sent_bytes(report)[0]
    n = _messages_per_step(report)
    return None if written is None or not n else ((written - counted) / n, n)


# ---------------------------------------------------------------------------------------------
# the live sections
# ---------------------------------------------------------------------------------------------
def show_ring(result: dict) -> None:
    """Section 1: the layout to animate, the animation (it plays in the browser), its bytes. In
    presentation mode the layout control joins the page's in the sidebar and the chart's own title
    stands for the section's: the chart (650 px tall) then fits the first screen."""
    k, runs = result["key"], result["runs"]
    c = k["cp"]
    if pm.on():
        layout_at = st.sidebar.container(border=True)
    else:
        st.subheader("1 · K/V blocks around the ring (measured)")
        layout_at = st
    layout = layout_at.radio("Layout in the animation", list(LAYOUTS), horizontal=True,
                             help="Both were run; switching starts nothing.")
    rep = runs[LAYOUTS[layout]]
    # plays by itself in the browser (viz.animate: Vega's own timer, no server round-trip a frame)
    pm.chart(ring_spec(json.dumps(rep)))
    st.caption("It plays by itself, forward then backward: untick **play** under the chart to hold "
               "a frame, or move the **frame** slider; **speed** sets the pace.")
    sent = viz.cp_sent_bytes(rep)
    written = viz.cp_sent_bytes(rep, "measured")
    predicted = theory.cp_wire_bytes_per_step(RunConfig.from_dict(rep["config"]))
    (m0, m1), (m2, m3) = st.columns(2), st.columns(2)  # two by two: the labels fit
    m0.metric("Ring bytes rank 0 wrote to its sockets per step: measured",
              "not measurable here" if written[0] is None else f"{fmt_count(round(written[0]))} B",
              help="What rank 0's process wrote to its sockets during its ring sends "
                   "(/proc/self/io): the payloads plus gloo's framing of every message")
    m1.metric("Ring bytes each rank sends per step: counted", f"{fmt_count(sent[0])} B",
              help="The payloads of rank 0's ring sends in the step (K/V forward, K/V + dK/dV "
                   "backward, dK/dV home), from its records: what the code sent, not a socket "
                   f"measurement; every rank: {', '.join(fmt_count(x) for x in sent)} B")
    m2.metric("Ring bytes per step: theory", f"{fmt_count(predicted)} B",
              help="theory.cp_wire_bytes_per_step")
    hidden = [hidden_fraction(r["context"]["hops"]) for r in viz.cp_ranks(rep)]
    m3.metric("Forward hop time covered by compute (measured)",
              f"{sum(hidden) / len(hidden):.0%}",
              help="context.hidden_fraction per rank, mean over ranks: of the time from posting "
                   "each K/V transfer to its arrival, the share during which the rank was "
                   "computing on the block it held. Every rank: "
                   + ", ".join(f"{x:.0%}" for x in hidden))
    blk = MODEL["batch"] * k["heads"] * (k["seq"] // c) * (MODEL["d_model"] // k["heads"]) * 4
    st.markdown(rf"""
One K/V block is [b, a, s/C, d] = [{MODEL['batch']}, {k['heads']}, {k['seq'] // c},
{MODEL['d_model'] // k['heads']}] fp32 = **{fmt_count(blk)} B**, K and V make two. Per layer the
forward passes K and V on C − 1 = {c - 1} times, the backward passes K, V with their dK, dV
(4 blocks) C − 1 times and sends dK, dV home once (2 blocks):
""")
    st.latex(rf"\bigl(2(C-1) + 4(C-1) + 2\bigr)\cdot B = ({2 * (c - 1)} + {4 * (c - 1)} + 2)"
             rf"\cdot {blk:,} = {(6 * (c - 1) + 2) * blk:,}\ \text{{B per layer}}")


def show_tiles(result: dict) -> None:
    k, runs = result["key"], result["runs"]
    c = k["cp"]
    st.subheader("2 · Which tiles each rank computes (measured)")
    pm.chart(tile_maps_spec(json.dumps({"contiguous (ring)": runs["ring"],
                                         "zigzag": runs["zigzag"]})))
    cols = st.columns(2)
    for col, (name, impl) in zip(cols, LAYOUTS.items()):
        layout = "zigzag" if impl == "zigzag" else "contiguous"
        measured = [r["context"]["tiles_computed"] for r in viz.cp_ranks(runs[impl])]
        formula = [viz.tiles_theory(layout, c, r)[0] for r in range(c)]
        col.metric(f"Tiles computed per rank: {name}, measured", _per_rank(measured),
                   help="context.tiles_computed of each rank, one layer's forward")
        col.metric(f"Tiles computed per rank: {name}, formula", _per_rank(formula),
                   help="contiguous: r + 1 of C; zigzag: 2C + 1 of 4C on every rank")
    pm.chart(viz.cp_work_bars({"contiguous": runs["ring"], "zigzag": runs["zigzag"]}))
    st.markdown(f"""
With a causal mask a query only looks at keys before it. Cut the sequence into C contiguous
chunks and rank r's queries need the K/V blocks of ranks 0…r only: rank 0 computes 1 tile, rank
C − 1 computes all C, and everyone waits for the last rank. **Zigzag** cuts the sequence into 2C
chunks and gives rank r chunks r and 2C − 1 − r, one early and one late: every rank then computes
2C + 1 = {2 * c + 1} of its 4C = {4 * c} tiles, the same work. Tiles above the diagonal (×) are
skipped without a single multiply; tiles on it are computed with the causal mask inside.
""")


def show_wire(result: dict) -> None:
    k, runs = result["key"], result["runs"]
    c = k["cp"]
    st.subheader("3 · Ring sends beside Ulysses' all-to-alls")
    x_max = max(viz.cp_comm_frame(runs[i])["x2"].max() for i in ("ring", "ulysses"))
    cols = st.columns(2)
    for col, impl in zip(cols, ("ring", "ulysses")):
        pm.chart(viz.cp_comm_timeline(
            runs[impl], title=f"{IMPLS[impl]}: the cp messages of one step (measured)",
            width=430, x_max=x_max), col, share=0.5)
    rows, matched = [], {}
    for impl in IMPLS:
        sent = viz.cp_sent_bytes(runs[impl])
        written = viz.cp_sent_bytes(runs[impl], "measured")[0]
        predicted = theory.cp_wire_bytes_per_step(RunConfig.from_dict(runs[impl]["config"]))
        rows += [{"impl": IMPLS[impl], "source": "counted", "bytes": sent[0]},
                 {"impl": IMPLS[impl], "source": "theory", "bytes": float(predicted)}]
        if written is not None:  # None off Linux / on NCCL: that bar is left out
            rows.append({"impl": IMPLS[impl], "source": "measured (written to sockets)",
                         "bytes": written})
        matched[impl] = (sum(x == predicted for x in sent), len(sent))
    pm.chart(viz.cp_bytes_chart(rows, subtitle=[
        f"C = {c}, s = {k['seq']}, one layer, rank 0; measured: what its process wrote to its "
        "sockets during them;",
        "counted: its send / all-to-all records; theory: theory.cp_wire_bytes_per_step"]))
    cols = st.columns(3)
    for col, impl in zip(cols, IMPLS):
        got, n = matched[impl]
        col.metric(f"Ranks whose counted bytes = formula: {impl}", f"{got} of {n}")
    extra = {name: _framing(runs[i]) for i, name in (("ring", "ring"), ("ulysses", "Ulysses"))}
    if all(extra.values()):
        st.caption("Written to sockets minus counted, per call on rank 0: " + ", ".join(
            f"{name} **{per:,.0f} B** ({n} calls per step)" for name, (per, n) in extra.items())
            + ". That is gloo's framing: a header with each message and a short notice from each "
              "receiver that its buffer is ready (an all-to-all sends one message to each of the "
              "other C − 1 ranks). The formula counts payloads only.")
    blk = MODEL["batch"] * k["heads"] * (k["seq"] // c) * (MODEL["d_model"] // k["heads"]) * 4
    st.markdown(f"""
**Ulysses** does not pass blocks around: one all-to-all turns each rank's [b, a, s/C, d] q, k, v
(all heads, its tokens) into [b, a/C, s, d] (a/C heads, every token), attention runs as on one
device, and a second all-to-all turns the output back; the backward does the same two in reverse.
Four all-to-alls per layer, of 3 + 1 + 1 + 3 = 8 blocks of {fmt_count(blk)} B, each rank keeping
1/C of what it holds: 8 · (C − 1)/C · B on the wire. The ring sends (6(C − 1) + 2) · B, more
bytes, but point to point and hidden behind compute; Ulysses' all-to-alls wait for everyone and
need the heads to divide by C.
""")


def show_activations(key: dict, fresh: bool) -> None:
    """Section 4: the formula's lines at once; the measured points behind their own button (18 runs
    of their own: every series at s, 2s, 4s with 1 and 2 layers)."""
    c, heads = key["cp"], key["heads"]
    st.subheader("4 · Activation memory per rank vs sequence length")
    seqs = activation_seqs(key["seq"])
    measure = st.button("Measure the activation curve",
                        help=f"Trains the toy {2 * len(series_of(c)) * len(seqs)} times, one step "
                             f"each: {len(series_of(c))} series at s = "
                             f"{', '.join(map(str, seqs))}, with 1 and 2 layers each.")
    area = st.container()
    if measure:
        run_live("cp_act", key, f"Measuring the activation curve on {c} ranks…",
                 activation_experiment, json.dumps(key, sort_keys=True), fresh=fresh, ranks=c,
                 own_progress=True, where=area)
    result, current = last_result("cp_act", key)
    if result is not None and not current:
        result = None  # another setting's points: only this setting's lines are drawn
    formulas = activation_theory(c, heads)
    points = result["activation_points"] if result else []
    pm.chart(viz.cp_activation_curve(points, formulas, list(range(2 * c, max(seqs) + 1, 2 * c)), subtitle=[
        f"batch {MODEL['batch']}, d{MODEL['d_model']}, {heads} heads, fp32; lines: "
        "theory.gpt_activation_bytes_per_layer (theory)",
        "points: measured, a layer's bytes = activation peak with 2 layers − with 1 (rank 0)"
        if points else "no measured points yet: press Measure the activation curve"]))
    if points:
        cols = st.columns(len(formulas))
        here = {p["series"]: p["bytes"] for p in points if p["seq"] == key["seq"]}
        for col, (name, f) in zip(cols, formulas.items()):
            col.metric(f"{name}, s = {key['seq']}: measured", fmt_bytes(here[name]),
                       delta="equal to the formula" if here[name] == f(key["seq"]) else
                       f"formula {fmt_bytes(f(key['seq']))}",
                       delta_color="off" if here[name] == f(key["seq"]) else "inverse",
                       help=f"{fmt_count(here[name])} B measured; theory: "
                            f"{fmt_count(f(key['seq']))} B")
    st.markdown(f"""
Without context parallel a layer keeps its softmax output, a · s² · b numbers: activations grow
with s². With C ranks every per-token tensor is 1/C as long. The **ring** never forms the [s, s]
scores: it keeps only its output and the log-sum-exp of each query row, so its curve is a straight
line in s. **Ulysses** computes plain attention on a/C heads over the whole sequence, so it keeps
a/C heads' s² scores: still quadratic, C times lower.
""")


def show_equality(result: dict) -> None:
    st.subheader("5 · Same training as one process?")
    cols = st.columns(len(IMPLS))
    for col, impl in zip(cols, IMPLS):
        rep = result["runs"][impl]
        diff = rep["max_abs_diff"]
        col.metric(f"max |run − reference| (losses, final params): {impl}", f"{diff:.2e}",
                   delta="equal within 1e-5" if diff <= TOLERANCE else "DIFFERENT",
                   delta_color="normal" if diff <= TOLERANCE else "inverse")
        col.caption(f"Final loss: {rep['losses'][-1]:.6f} with context parallel, "
                    f"{rep['reference_losses'][-1]:.6f} on one process with the whole sequence.")


# ---------------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------------
st.title("Long sequences")
pm.intro(r"""
Activations grow with the sequence length s, and attention's scores with s². **Context
parallelism** gives each of **C** ranks s/C tokens of every sequence for the *whole* model.
Everything but attention is per token; attention needs the keys and values of every earlier
token. **Ring attention** passes the K/V blocks around the ring of ranks, one hop per step, while
each rank computes on the block it holds, merging partial results with the online softmax.
**Zigzag** lays the chunks out so that the causal mask leaves every rank the same work.
**Ulysses** trades the ring for two all-to-alls that switch from sequence shards to head shards.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
cp = c1.radio("Context-parallel ranks (C)", [2, 4], horizontal=True, key=pm.kept("cp.cp", 4),
              help="Each sequence is split over C ranks; at most 4 share this machine's cores.")
seq = int(c2.number_input("Sequence length s (tokens)", min_value=8, max_value=MAX_SEQ, step=4,
                          key=pm.kept("cp.seq", 32),
                          help="ring and Ulysses need a multiple of C, zigzag of 2C"))
heads = c3.radio("Attention heads (a)", [2, 4], horizontal=True, key=pm.kept("cp.heads", 4),
                 help="Ulysses gives each rank a/C whole heads: a must divide by C.")
c3.caption(f"Model: 1 layer × d{MODEL['d_model']}, vocabulary {MODEL['vocab']}, batch "
           f"{MODEL['batch']}, one training step per run.")
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)

errors = {}
for impl in IMPLS:
    try:
        RunConfig.from_dict(run_config(impl, cp, seq, heads))
    except ConfigError as err:
        errors[impl] = str(err)
for impl, msg in errors.items():
    st.error(f"{IMPLS[impl]}: invalid settings: {msg}")

key = {"cp": cp, "seq": seq, "heads": heads}
run_clicked = controls.run_button(disabled=bool(errors),
                                  help="Fix the settings first." if errors else
                                  f"Trains the toy with ring, zigzag and Ulysses on {cp} "
                                  f"ranks and the single-process reference (the activation "
                                  f"curve's runs have their own button).")
if run_clicked and not errors:
    run_live("cp", key, f"Running ring, zigzag and Ulysses on {cp} ranks…", context_experiment,
             json.dumps(key, sort_keys=True), fresh=fresh, ranks=cp, own_progress=True,
             where=controls.run_area)

result, current = last_result("cp", key)
if result is None:
    st.info("Press **Run live** to split every sequence over real ranks (gloo on this machine's "
            "CPU) three ways and watch what they send.")
else:
    if not current:
        k = result["key"]
        st.warning(f"The settings changed: press **Run live**. Below: the last run (C = {k['cp']}, "
                   f"s = {k['seq']}, {k['heads']} heads).")
    show_ring(result)
    show_tiles(result)
    show_wire(result)
    if current:
        show_activations(key, fresh)
    show_equality(result)
