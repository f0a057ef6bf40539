"""This machine's links, run live: each collective's time over message sizes, the α–β fit, and one
all-reduce on this machine beside NVLink, PCIe and InfiniBand."""
import json

import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import StepBar, last_result, rank_slots, run_live
from parallel_mini.course import links
from parallel_mini.course.viz import links as vl

st.title("This machine's links")
pm.intro("""
A message of S bytes costs a fixed **latency** α (start the transfer, wake the receiver) plus
S/B at the link's **bandwidth** B. A ring collective over N ranks pays α once per ring step and
pushes its bytes through every rank's link: an all-reduce makes 2(N−1) steps and sends
2(N−1)/N·S per rank, so t = 2(N−1)·α + 2(N−1)/N·S/B. **Run live** times point-to-point,
all-reduce, all-gather, reduce-scatter and all-to-all between local gloo ranks over message sizes
(each size several times; a run's time is its slowest rank's, the median over runs is drawn) and
fits α and B per operation. Below the fit, the same all-reduce on the links of a GPU cluster, from
their quoted bandwidth (with an assumed latency: vendors quote none).
""")

SIZE_OPTIONS = [2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24, 2 ** 26]  # the sweep's largest message
OP_NAMES = list(links.OPS)

controls = pm.Controls([1, 1, 2])  # the operations' tags need the room
c1, c2, c3 = controls.columns
world = c1.slider("Ranks in the sweep", 2, 4, key=pm.kept("links.world", 2),
                  help="Local gloo ranks (processes) that run each collective.")
largest = c2.select_slider("Largest message", SIZE_OPTIONS, key=pm.kept("links.largest", 2 ** 22),
                           format_func=vl.fmt_size,
                           help="Sizes from 4 B up to this one, ×4 each step.")
ops = c3.multiselect("Operations", OP_NAMES, key=pm.kept("links.ops", OP_NAMES),
                     format_func=lambda op: vl.OP_LABELS[op],
                     help="Each one is a launch of the ranks.")
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)
ops = [op for op in OP_NAMES if op in ops]  # in the library's order, whatever the clicks' order
REPEATS = 5
key = {"world": world, "largest": largest, "ops": ops}


def sweep(key_json: str, attempt: int = 0) -> dict:
    """measure_links on the key's ranks, sizes and ops; the bar steps as each op's rows come in."""
    k = json.loads(key_json)
    todo = k["ops"]
    todo_sizes = [s for s in links.DEFAULT_SIZES if s <= k["largest"]]
    bar = StepBar(len(todo))

    def what(op: str) -> str:
        return f"{vl.OP_LABELS[op]} on {k['world']} ranks, {len(todo_sizes)} sizes…"

    bar.step(what(todo[0]))
    seen: dict[str, int] = {}

    def progress(row: dict) -> None:  # measure_links calls it per row, as each op's launch ends
        seen[row["op"]] = seen.get(row["op"], 0) + 1
        i = todo.index(row["op"])
        if seen[row["op"]] == len(todo_sizes) and i + 1 < len(todo):
            bar.step(what(todo[i + 1]))

    with rank_slots(k["world"]):
        result = links.measure_links(k["world"], todo_sizes, todo, REPEATS, progress=progress)
    bar.done()
    return result


pressed = controls.run_button(disabled=not ops, help="One launch of the ranks per operation")
if not ops:
    controls.area.warning("Choose at least one operation.")
if pressed and ops:
    run_live("links", key, f"Timing {len(ops)} collectives on {world} ranks…", sweep,
             json.dumps(key, sort_keys=True), fresh=fresh, ranks=world, own_progress=True,
             where=controls.run_area)

result, current = last_result("links", key)
if result is None:
    st.info("Press **Run live** to time the collectives on this machine's ranks.")
    st.stop()
if not current:
    measured_ops = ", ".join(vl.OP_LABELS[op] for op in dict.fromkeys(r["op"] for r in result["rows"]))
    st.warning(f"The settings changed: press **Run live**. Below: the last sweep ({result['world']} "
               f"ranks; {measured_ops}).")

fit = links.fit_alpha_beta(result)
measured = list(dict.fromkeys(r["op"] for r in result["rows"]))
pm.chart(vl.links_chart(result, fit))
st.caption(f"Measured on {result['cores']} CPU cores, load average {result['load_before'][0]:g} "
           f"before and {result['load_after'][0]:g} after: on a shared machine a run that lost its "
           "core waits a scheduler quantum (milliseconds), so the slowest runs are the load's, "
           "the fastest the link's.")

st.subheader("The fit: α and B per operation")
table = pd.DataFrame([{
    "operation": vl.OP_LABELS[op],
    "α per hop (fitted)": vl.fmt_seconds(fit[op]["alpha_s"]),
    "B (fitted)": vl.fmt_bandwidth(fit[op]["bandwidth_Bps"]),
    "hops a, bytes factor b (ring, N = " + str(result["world"]) + ")":
        f"{fit[op]['a']:g}, {fit[op]['b']:.3g}",
    "latency = bandwidth term at S =": vl.fmt_size(fit[op]["a"] * fit[op]["alpha_s"]
                                                  * fit[op]["bandwidth_Bps"] / fit[op]["b"])
    if fit[op]["beta_s_per_byte"] > 0 else "never (no bandwidth term)",
    "worst miss (|fit − measured| / measured)": f"{fit[op]['max_rel_err']:.0%}",
} for op in measured])
st.dataframe(table, hide_index=True)
st.caption("α and B belong to the link, not to the operation: fitted per operation they should "
           "agree. Where they do not, the ring's hop counts (or the algorithm gloo really runs) "
           "are what the measurement contradicts. Below the size in the fifth column, latency "
           "dominates: many small messages cost more than one large one of the same bytes.")

st.subheader("The same all-reduce on a GPU cluster's links")
if "all_reduce" not in fit:
    st.info("Add **all-reduce** to the operations and press **Run live** to compare it.")
    st.stop()
COMPARE_SIZES = [4, 2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 28, 2 ** 30, 14 * 10 ** 9]
COMPARE_RANKS = [2, 4, 8, 16, 64, 256, 1024]
d1, d2 = st.columns(2)
nbytes = d1.select_slider("All-reduce size", COMPARE_SIZES, key=pm.kept("links.nbytes", 2 ** 28),
                          format_func=lambda b: "14 GB = 13 GiB (7B params, bf16 grads)"
                          if b == 14 * 10 ** 9 else vl.fmt_size(b),
                          help="Theory alone: redrawn at once, nothing runs.")
n = d2.select_slider("Ranks N", COMPARE_RANKS, key=pm.kept("links.n", 8),
                     help="Theory alone: this machine's fitted α and B with the ring's hop counts, "
                          "as if every rank had its own core and link.")
pm.chart(vl.link_comparison(fit, nbytes, n))
cmp = vl.link_comparison_frame(fit, nbytes, n)
mine = cmp.iloc[0]
fastest = cmp.iloc[1:].sort_values("seconds").iloc[0]
st.markdown(f"One all-reduce of **{vl.fmt_size(nbytes)}** on **{n}** ranks: this machine "
            f"(fitted α–β, as if each rank had its own core) **{vl.fmt_seconds(mine['seconds'])}**, "
            f"of which {mine['latency_share']:.0%} latency; {fastest['link']} "
            f"**{vl.fmt_seconds(fastest['seconds'])}**, "
            f"{mine['seconds'] / fastest['seconds']:,.0f}× faster.")
with st.expander("The numbers"):
    st.dataframe(pd.DataFrame({
        "link": cmp["link"], "source": cmp["kind"], "as stated": cmp["stated"],
        "B (GB/s, one direction)": [f"{b / 1e9:.3g}" for b in cmp["bandwidth_Bps"]],
        "α per hop": [vl.fmt_seconds(a) for a in cmp["latency_s"]],
        "time": [vl.fmt_seconds(s) for s in cmp["seconds"]],
        "times faster than this machine": [f"{1 / r:,.3g}" for r in cmp["vs_this_machine"]],
    }), hide_index=True)
assumed = cmp["latency_s"].iloc[1:]
st.caption("Every time here is the α–β model (theory). This machine's α and B were fitted to the "
           "times measured above; the other links' bandwidths are the vendors' (as the source "
           "material's table states them) and their latencies an assumption "
           f"({vl.fmt_seconds(assumed.min())} to {vl.fmt_seconds(assumed.max())} per hop: neither "
           "measured nor quoted).")
