"""Without a barrier, run live: a straggler against synchronous DP and asynchronous SGD (the
staleness histogram, loss against the wall clock), local SGD's bytes, federated averaging."""
import json

import pandas as pd
import streamlit as st

import presentation as pm
from live_runs import StepBar, fmt_bytes, last_result, run_live, training_run
from parallel_mini.course.experiments import barrier_curve
from parallel_mini.course.viz import barrier as vb
from parallel_mini.report import RunReport

RANKS = 4  # sync DP on 4 ranks; async: a server and 3 workers
MODEL = dict(layers=2, d_model=64, heads=4, seq=32, vocab=128)  # compute sets the step's pace
SMALL = dict(layers=1, d_model=32, heads=2, seq=16, vocab=64)  # local SGD's and FedAvg's toy
STEPS, BATCH = 6, 24

st.title("Without a barrier")
pm.intro("""
Synchronous data parallel ends every step at a **barrier**, the all-reduce: every rank waits for
the slowest. **Asynchronous SGD** drops it: a parameter server (rank 0) applies each worker's
gradient as it arrives, and a gradient computed on an older version is **stale**; a bound K
(stale synchronous parallel) holds a worker more than K steps ahead. **Local SGD** meets every H
steps instead of every step. **Federated averaging**: clients train E steps on their own, skewed
(non-IID) data and a server averages their weights, weighted by their data.
""")

controls = pm.Controls(3)
c1, c2, c3 = controls.columns
slow_rank = c1.radio("Straggler rank", [1, 2, 3], horizontal=True, key=pm.kept("barrier.rank", 3),
                     help="Async: rank 0 is the server, so the straggler is one of the workers")
factor = c1.select_slider("Straggler factor (× slower)", [1, 2, 3, 4],
                          key=pm.kept("barrier.factor", 3), help="1: no straggler")
bound = c2.radio("Max staleness K (async)", [-1, 0, 1, 2], horizontal=True,
                 key=pm.kept("barrier.bound", -1), format_func=lambda k: "none" if k < 0 else str(k))
every = c2.radio("Local SGD: sync every H steps", [1, 2, 4], horizontal=True,
                 key=pm.kept("barrier.every", 4))
non_iid = c3.radio("FedAvg: non-IID A", [0.0, 1.0, 10.0], horizontal=True,
                   key=pm.kept("barrier.non_iid", 10.0), format_func=lambda a: f"{a:g}")
local_steps = c3.radio("FedAvg: local steps E", [1, 2, 4], horizontal=True,
                       key=pm.kept("barrier.local_steps", 4))
fresh = controls.area.checkbox("Fresh measurement (ignore the cache)", value=False)


def configs(k: dict) -> dict:
    """The runs of one press, by name (each cached by live_runs.training_run)."""
    slow = {"straggler": f"{k['rank']}:{k['factor']}"} if k["factor"] > 1 else {}
    common = dict(dp=RANKS, steps=STEPS, batch=BATCH, **MODEL, **slow)
    return {"sync DP": common,
            "async": dict(common, asynchronous=True, max_staleness=k["bound"], reference=True),
            "DDP": dict(dp=2, steps=4, batch=8, **SMALL),
            "local SGD": dict(dp=2, steps=4, batch=8, sync_every=k["every"], **SMALL),
            "FedAvg": dict(dp=2, federated=True, clients=4, clients_per_round=2, rounds=6,
                           local_steps=k["local_steps"], non_iid=k["non_iid"], batch=4,
                           lr=1e-2, reference=True, **SMALL)}


def barrier_experiment(key_json: str, attempt: int = 0) -> dict:
    k = json.loads(key_json)
    todo = configs(k)
    bar = StepBar(len(todo))
    runs = {}
    for name, cfg in todo.items():
        bar.step(f"{name}: on {cfg['dp']} ranks…")
        runs[name] = training_run(json.dumps(cfg, sort_keys=True), attempt)
    bar.done()
    return {"key": k, "runs": runs}


key = {"rank": slow_rank, "factor": factor, "bound": bound, "every": every,
       "non_iid": non_iid, "local_steps": local_steps}
if controls.run_button(help="Five live runs: sync DP and async SGD on 4 ranks, DDP and local SGD "
                            "on 2, federated averaging on 2"):
    run_live("barrier", key, "Training without a barrier…", barrier_experiment,
             json.dumps(key, sort_keys=True), fresh=fresh, ranks=RANKS, own_progress=True,
             where=controls.run_area)

result, current = last_result("barrier", key)
if result is None:
    st.info("Press **Run live** to train with a straggler, without a barrier, and apart.")
    st.stop()
if not current:
    k = result["key"]
    st.warning(f"The settings changed: press **Run live**. Below: the last runs (straggler rank "
               f"{k['rank']} ×{k['factor']}, K {k['bound']}, H {k['every']}, A {k['non_iid']:g}, "
               f"E {k['local_steps']}).")
runs, k = result["runs"], result["key"]
reports = {name: RunReport.from_dict(rep) for name, rep in runs.items()}
curves = {name: barrier_curve(reports[name]) for name in ("sync DP", "async")}
a = runs["async"]["async"]
W = len(a["workers"])

st.subheader("1 · A straggler: synchronous DP waits, asynchronous SGD does not")
rates = [{"run": n, "updates_per_s": len(c) / c[-1]["time"],
          "samples_per_s": c[-1]["samples"] / c[-1]["time"]} for n, c in curves.items()]
m1, m2, m3, m4 = st.columns(4)
m1.metric("Sync DP: samples per second (measured)", f"{rates[0]['samples_per_s']:.3g}")
m2.metric("Async: samples per second (measured)", f"{rates[1]['samples_per_s']:.3g}")
m3.metric("Async ÷ sync: measured", f"{rates[1]['samples_per_s'] / rates[0]['samples_per_s']:.2f}")
m4.metric("Async ÷ sync: theory, compute only", f"{(k['factor'] * (W - 1) + 1) / RANKS:.2f}",
          help="Sync: all ranks step at the straggler's pace; async: W workers, the straggler at "
               "1/F of the others' rate, no overheads: (F(W−1)+1)/(W+1) (bench async's formula)")
left, right = st.columns(2)
pm.chart(vb.loss_against(curves, "time"), where=left, share=0.5)
pm.chart(vb.loss_against(curves, "samples"), where=right, share=0.5)
st.caption("Sync DP: the global loss per step. Async: the pushed losses, smoothed over one update "
           "per worker. The ranks share this machine's cores: wall-clock times are stretched.")

st.subheader("2 · Staleness (counted from the server's records)")
left, right = st.columns(2)
pm.chart(vb.staleness_histogram(runs["async"]), where=left, share=0.5)
th = a["theory"]
right.metric("Mean staleness: counted", f"{a['staleness_mean']:.2f}")
right.metric("Mean staleness: theory", "no formula for 0 < K" if th["mean"] is None
             else f"{th['mean']:g}", help="W − 1 without a bound; (W − 1)/2 at K = 0")
if th["bound"] is not None:
    right.metric("Largest: counted ≤ bound (W−1)(2K+1)",
                 f"{max(u['staleness'] for u in a['updates'])} ≤ {th['bound']}")
diff = runs["async"]["max_abs_diff"]
right.metric("Run vs its replay in one process (max |diff|)", f"{diff:.1e}",
             delta="equal within 1e-5" if diff <= 1e-5 else "DIFFERENT",
             delta_color="normal" if diff <= 1e-5 else "inverse")
right.dataframe(pd.DataFrame([{"worker": w, "updates": n, "mean staleness":
                               a["staleness_mean_by_worker"][w]}
                              for w, n in a["updates_per_worker"].items()]), hide_index=True)

st.subheader(f"3 · Local SGD: meet every H = {k['every']} steps")
ddp, lsgd = (RunReport.from_dict(runs[n]) for n in ("DDP", "local SGD"))
rows = [{"mode": name, "bytes_per_sample": {
    "counted": rep.wire_bytes_per_step().get("dp", 0) / 8,
    "theory": rep.theory["wire_bytes_per_step"].get("dp", 0) / 8,
    "measured": (lambda m: None if m is None else m / 8)(
        rep.wire_bytes_per_step(kind="measured").get("dp", 0))}}
    for name, rep in (("DDP", ddp), (f"local SGD, H = {k['every']}", lsgd))]
l1, l2 = st.columns(2)
l1.metric("Bytes per sample, local SGD ÷ DDP: counted",
          f"{rows[1]['bytes_per_sample']['counted'] / rows[0]['bytes_per_sample']['counted']:.3f}")
l2.metric("theory: 1/H", f"{1 / k['every']:.3f}")
pm.chart(vb.bytes_per_sample(rows))

st.subheader(f"4 · Federated averaging: A = {k['non_iid']:g}, E = {k['local_steps']}")
fed = runs["FedAvg"]["federated"]
pm.chart(vb.fedavg_rounds([{"non_iid": k["non_iid"], "local_steps": k["local_steps"],
                            "union_loss": runs["FedAvg"]["losses"]}]))
f1, f2, f3 = st.columns(3)
drift = [sum(r["drift"].values()) / max(1, len(r["drift"])) for r in fed["rounds"]]
f1.metric("Mean client drift, last round (measured)", f"{drift[-1]:.3f}")
f2.metric("Data bytes that left a client (counted)",
          f"{sum(n['data_bytes_sent'] for n in fed['network'])}")
f3.metric("Weights per round, rank 0: counted / theory",
          f"{fmt_bytes(fed['network'][0]['weights_bytes_per_round']['counted'])} / "
          f"{fmt_bytes(fed['network'][0]['weights_bytes_per_round']['theory'])}")
st.caption(f"Equal to its single-process simulation: max |diff| "
           f"{runs['FedAvg']['max_abs_diff']:.1e}. Own-topic share of each client's data: "
           + ", ".join(f"{s:.2f}" for s in fed["own_topic_share"]))
