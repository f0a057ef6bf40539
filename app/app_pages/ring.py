"""Ring all-reduce, run live: the ring animation decoded from the run, bytes, steps and bandwidth."""
import time

import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import fmt_bytes, fmt_count, fmt_rate, last_result, ring_experiment, run_live
from parallel_mini import theory
from parallel_mini.course import viz
from parallel_mini.course.viz.animate import autoplay

st.title("Ring all-reduce")
pm.intro("""
N ranks each hold a tensor of X bytes and all need the sum. The ring cuts each tensor into N
chunks. **Reduce-scatter** (N−1 steps): every rank sends one chunk to its right neighbour and adds
the chunk arriving from its left, until each rank holds one chunk fully summed. **All-gather**
(N−1 steps): the summed chunks travel once more around the ring. Each rank sends 2(N−1) chunks
of X/N bytes, whatever N: that is why the ring is bandwidth-optimal.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
n = c1.slider("World size N (ranks)", 2, 8, key=pm.kept("ring.n", 4))
numel = c2.select_slider("Elements in the animated tensor", [8, 16, 32, 64],
                         key=pm.kept("ring.numel", 16),
                         help="The probe run: small, so every message can be shown.")
timed_mb = c3.select_slider("Timed tensor (MB)", [1, 4, 16, 64], key=pm.kept("ring.timed_mb", 4),
                            help="The timing runs: large enough for bandwidth to dominate.")
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)
key = {"n": n, "numel": numel, "timed_mb": timed_mb}

pressed = controls.run_button()
if pressed:
    run_live("ring", key, f"Running a ring all-reduce on {n} ranks…", ring_experiment,
             n, numel, timed_mb, fresh=fresh, ranks=n, where=controls.run_area)

exp, current = last_result("ring", key)
if exp is None:
    st.info("Press **Run live** to start the ranks.")
    st.stop()
if not current:
    st.warning(f"The settings changed: press **Run live**. Below: the last run (N = "
               f"{exp['world_size']}, {exp['numel']} elements, {exp['timed_bytes'] / 2**20:g} MB timed).")

n, x_bytes = exp["world_size"], exp["nbytes"]
theory_bytes = theory.wire_bytes("all_reduce", x_bytes, n)
sent = exp["sent_bytes_per_rank"]  # counted: the payloads each rank handed to send
written = exp.get("written_bytes_per_rank") or [None] * n  # measured: written to its sockets
messages = exp.get("messages_per_rank") or [0] * n


# After a press, in normal mode: once the script run has ended (no stale element left to move the
# layout) and the browser has drawn the animation (its bound controls included), scroll the page
# so that its top is under the header, if it is not whole on the screen (at N = 8 the controls
# above push it past the first screen). Presentation mode lays it on the first screen: no script
# (one measured while a loaded browser was still laying the page out scrolled it to y = -1465).
# A loaded browser may still move the layout after that scroll (a soak round found the chart at
# y = -1348): until the reader scrolls, clicks or types (or 60 s pass), the chart is put back
# whenever it has left the screen. NONCE: each press's script is new, so the browser runs it again.
# The 2 min of tries are a guard.
_SCROLL_TO_THE_RING = """<script>/* NONCE */
(() => {
  let tries = 0, reader = false;
  for (const kind of ["wheel", "touchstart", "keydown", "pointerdown"])
    window.addEventListener(kind, () => { reader = true; }, {capture: true, once: true});
  const chart = () => [...document.querySelectorAll('[data-testid="stMain"] [data-testid="stVegaLiteChart"]')]
      .find(e => e.querySelector('.vega-bindings') && e.querySelector('.marks'));
  const place = (el) => {
    const header = document.querySelector('header[data-testid="stHeader"]');
    const top = header ? header.getBoundingClientRect().height : 0;
    const r = el.getBoundingClientRect();
    if (reader || (r.top >= top - 1 && r.bottom <= window.innerHeight)) return;
    el.style.scrollMarginTop = `${top}px`;
    el.scrollIntoView({block: "start"});
  };
  const go = () => {
    const idle = document.querySelector('[data-testid="stApp"][data-test-script-state="notRunning"]');
    const el = chart();
    if (!idle || !el) { if (++tries < 2400) setTimeout(go, 50); return; }
    place(el);
    const keep = setInterval(() => { const now = chart(); if (now) place(now); }, 100);
    setTimeout(() => clearInterval(keep), 60000);
  };
  go();
})();
</script>"""


def _spread(values) -> str:
    return f"{values[0]:,} B" if len(set(values)) == 1 else f"{min(values):,}–{max(values):,} B"


def what_the_ranks_did() -> None:
    st.subheader("What the ranks did")
    m1, m2, e1, e2 = st.columns(4)
    m1.metric("Ring steps: measured", exp["steps_measured"],
              help="Messages rank 0 sent in the probe run")
    m2.metric("Ring steps: theory 2(N−1)", theory.ring_steps(n))
    e1.metric("Exact on integers (vs gloo)", "yes" if exp["int_exact"] else "NO",
              help="The probe's integer sums equal gloo's all_reduce of the same tensors")
    e2.metric("float32: max |ring − gloo|", f"{exp['float_max_abs_err']:.2e}",
              help="Different summation order: fp32 rounding, not an error")
    b1, b2, b3 = st.columns(3)
    b1.metric("Bytes sent by each rank: counted", _spread(sent),
              help="The payloads each rank handed to send in the float run, summed: what the "
                   "code sent, not a socket measurement")
    b2.metric("Written to sockets by each rank: measured",
              "not measurable here" if None in written else _spread(written),
              help="What each rank's process wrote to its sockets during those sends "
                   "(/proc/self/io): the payloads plus gloo's framing of every message")
    b3.metric("Bytes sent: theory 2(N−1)/N·X", f"{fmt_count(theory_bytes)} B",
              help=f"X = {exp['numel']} fp32 elements = {x_bytes} bytes")
    if None not in written and messages[0]:
        per_message = (sum(written) - sum(sent)) / sum(messages)
        chunk = 4 * max(exp["chunk_sizes"])
        st.caption(f"Written to sockets minus counted: **{per_message:,.0f} B per message** "
                   f"({messages[0]} messages per rank, chunks of at most {chunk} B). That is "
                   "gloo's framing: a header with each message and a short notice from each "
                   "receiver that its buffer is ready. The formula counts payloads only: it "
                   "describes a large tensor well, where the framing is small beside each chunk.")


# the animation first, under the controls: it plays by itself in the browser (viz.animate: Vega's
# own timer, no server round-trip per frame), the whole grid and its messages on the first screen
frames = len(exp["frames"])
pm.chart(autoplay(viz.ring_animation(exp, drawn_font=pm.drawn_font(), compact=True), "step",
                  frames))
if pressed and not pm.on():  # the whole animation on the screen after Run live (under the controls)
    st.html(_SCROLL_TO_THE_RING.replace("NONCE", str(time.time_ns())),
            unsafe_allow_javascript=True)
st.caption("It plays by itself: untick **play** under the chart to hold a step, or move the "
           "**step** slider; **speed** sets the pace. Every frame is decoded from the messages of "
           "the live run: each message carries, in its values, which ranks' data it holds.")
what_the_ranks_did()

with st.expander("Bytes sent per rank"):
    st.dataframe(pd.DataFrame({"rank": range(n), "bytes sent (counted)": sent,
                               "written to sockets (measured)": written,
                               "theory 2(N−1)/N·X": [theory_bytes] * n}), hide_index=True)
    if x_bytes % n:
        st.caption(f"X = {x_bytes} B is not a multiple of N = {n}: chunks differ by one element, so "
                   "ranks send slightly different amounts; 2(N−1)/N·X is their mean.")

st.subheader("How fast")
st.latex(r"T = \frac{2(N-1)}{N}\cdot\frac{X}{B}"
         r"\qquad \text{bus bandwidth} = \frac{2(N-1)}{N}\cdot\frac{X}{T_\text{measured}}")
X = exp["timed_bytes"]
b_backend = exp["busbw_backend"]
t_pred = theory.ring_all_reduce_time(X, n, b_backend)
t1, t2, t3, t4 = st.columns(4)
t1.metric("Our ring: measured", f"{1e3 * exp['time_ring_s']:.2f} ms")
t2.metric("gloo all_reduce: measured", f"{1e3 * exp['time_backend_s']:.2f} ms")
t3.metric("Our ring: bus bandwidth", fmt_rate(exp["busbw_ring"]))
t4.metric("gloo: bus bandwidth", fmt_rate(b_backend))
st.markdown(
    f"With **B = gloo's measured bus bandwidth ({fmt_rate(b_backend)})**, the formula predicts "
    f"**{1e3 * t_pred:.2f} ms** for any ring all-reduce of X = {fmt_bytes(X)} on {n} ranks; our "
    f"ring (Python send/recv) took **{1e3 * exp['time_ring_s']:.2f} ms**, "
    f"{exp['time_ring_s'] / t_pred:.2f}× the prediction. (B is measured from gloo's own time, so "
    f"gloo matches the formula by construction; the ring's gap is what our implementation loses.)")
g1, g2 = st.columns(2)
pm.chart(viz.ring_time_bars(exp), g1, share=0.5)
pm.chart(viz.bandwidth_bars(exp), g2, share=0.5)
pm.chart(viz.ring_step_times(exp))
st.caption("The ranks share this machine's CPU cores, so times vary from run to run; the step "
           "and byte counts do not.")
