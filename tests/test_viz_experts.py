"""viz/experts.py: the Experts charts' data, checked against the run's own records and logs.

One cheap real run (dp 2, ep 2, 4 experts, top-2, two micro-batches per step, 2 steps), made once:
the all-to-all matrix's rows add up to the bytes each rank recorded, forward dispatch and combine
are each other's transpose, the load per expert sums the routers' logs over ranks and micro-batches,
the capacity is ceil(F s k / E) per sequence times the step's sequences, the routing heatmap's
cells are the first micro-batch's logged choices, and the memory frame holds measured beside
theory to the byte, the replicated (ep = 1) bars 1/P more of the experts."""
from __future__ import annotations

import collections

import altair as alt
import pytest

from parallel_mini import theory
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.moe import capacity
from parallel_mini.course.viz import experts as vx

E, K, P, F, SEQ, BATCH, ACCUM, STEPS = 4, 2, 2, 1.0, 32, 8, 2, 2


@pytest.fixture(scope="module")
def report():
    return run(RunConfig(dp=P, ep=P, experts=E, top_k=K, capacity_factor=F, steps=STEPS,
                         batch=BATCH, grad_accum=ACCUM, seq=SEQ, layers=2, seed=0))


@pytest.fixture(scope="module")
def rep(report):
    return report.to_dict()


def _moe_records(rank: dict, step: int) -> list[dict]:
    return [c for c in rank["comm"] if c.get("layer") == "moe" and c["step"] == step]


def test_layers_and_steps(rep):
    assert vx.moe_layers(rep) == [0, 1]
    assert vx.moe_steps(rep) == list(range(STEPS))


def test_all_to_all_rows_are_the_bytes_each_rank_recorded(report, rep):
    total = [0] * P
    for step in range(STEPS):
        m = vx.all_to_all_bytes(report, step)
        assert len(m) == P and all(len(row) == P for row in m)
        for r in range(P):
            sent = sum(m[r]) - m[r][r]
            assert sent == sum(c["wire_bytes_model"] for c in _moe_records(rep["ranks"][r], step)) > 0
            total[r] += sent
        # backward runs every exchange with the splits swapped: the step's matrix is symmetric
        assert all(m[i][j] == m[j][i] for i in range(P) for j in range(P))
    for r in range(P):
        assert total[r] == report.moe_wire_bytes_per_step(r) * STEPS
    assert vx.all_to_all_bytes(report) == vx.all_to_all_bytes(report, STEPS - 1)  # default: last


def test_forward_dispatch_and_combine_are_transposes(rep):
    for step in range(STEPS):
        d = vx.all_to_all_bytes(rep, step, "dispatch", "forward")
        c = vx.all_to_all_bytes(rep, step, "combine", "forward")
        assert all(d[i][j] == c[j][i] for i in range(P) for j in range(P))
        # the diagonal: a rank's rows for its own experts, from its splits
        h_bytes = rep["config"]["d_model"] * 4
        for r in range(P):
            own = sum(x["in_splits"][r] for x in _moe_records(rep["ranks"][r], step)
                      if x["phase"] == "dispatch" and x.get("pass") != "backward")
            assert d[r][r] == own * h_bytes
        counts = vx.all_to_all_bytes(rep, step, "counts")  # E int64 per layer and micro-batch
        assert all(counts[i][j] == 2 * ACCUM * E * 8 // P for i in range(P) for j in range(P))
    with pytest.raises(ValueError, match="phase"):
        vx.all_to_all_bytes(rep, 0, "gather")


def test_load_per_expert_sums_the_routers_logs(rep):
    for layer in (0, 1):
        for step in range(STEPS):
            entries = [e for r in rep["ranks"] for e in r["moe"]["log"]
                       if e["layer"] == layer and e["step"] == step]
            assert len(entries) == P * ACCUM  # every rank, every micro-batch
            routed = [sum(e["routed"][x] for e in entries) for x in range(E)]
            kept = [sum(e["kept"][x] for e in entries) for x in range(E)]
            df, cap = vx.expert_load_frame(rep, layer, step)
            by = df.pivot(index="expert", columns="status", values="assignments")
            assert list(by["kept"]) == kept
            assert list(by["kept"] + by["dropped"]) == routed
            assert sum(routed) == BATCH * SEQ * K  # every token of the step, k times
            assert cap == capacity(SEQ, E, K, F) * BATCH  # per sequence x the step's sequences
            one, cap1 = vx.expert_load_frame(rep, layer, step, rank=1)
            mine = [e for e in entries if e in rep["ranks"][1]["moe"]["log"]]
            assert int(one["assignments"].sum()) == sum(sum(e["routed"]) for e in mine)
            assert cap1 == capacity(SEQ, E, K, F) * BATCH // P


def test_load_balance_table(rep):
    table = vx.load_balance_table(rep, layer=1)
    assert [t["step"] for t in table] == list(range(STEPS))
    for t in table:
        assert set(t) == {"step", "max_over_mean", "dropped", "aux"}
        entries = [e for r in rep["ranks"] for e in r["moe"]["log"]
                   if e["layer"] == 1 and e["step"] == t["step"]]
        routed = [sum(e["routed"][x] for e in entries) for x in range(E)]
        assert t["max_over_mean"] == pytest.approx(max(routed) / (sum(routed) / E))
        assert t["dropped"] == sum(e["dropped"] for e in entries)
        # micro-batches of equal size: the mean of the logged losses
        assert t["aux"] == pytest.approx(sum(e["aux"] for e in entries) / len(entries))
        assert 1.0 <= t["aux"] <= E
    frame = vx.load_balance_frame({"a": rep, "b": rep}, layer=1)
    assert list(frame["run"]) == ["a"] * STEPS + ["b"] * STEPS
    assert list(frame["dropped_fraction"][:STEPS]) == [t["dropped"] / (BATCH * SEQ * K)
                                                       for t in table]


def test_routing_frame_is_the_first_micro_batch(rep):
    df = vx.routing_frame(rep, rank=1, layer=0, step=1)
    (first,) = [e for e in rep["ranks"][1]["moe"]["log"]
                if e["layer"] == 0 and e["step"] == 1 and "choices" in e]
    tokens = BATCH // P // ACCUM * SEQ
    assert len(df) == tokens * K and df["token"].max() == tokens - 1
    assert list(df.groupby("choice").size()) == [tokens] * K
    assert collections.Counter(df["expert"]) == collections.Counter(
        {x: n for x, n in enumerate(first["routed"]) if n})
    assert collections.Counter(df.loc[df["kept"], "expert"]) == collections.Counter(
        {x: n for x, n in enumerate(first["kept"]) if n})
    assert int((~df["kept"]).sum()) == first["dropped"]
    with pytest.raises(ValueError, match="not a mixture-of-experts layer"):
        vx.routing_frame(rep, layer=7)


def test_memory_frame_measured_equals_theory_and_experts_are_one_over_p(rep):
    df = vx.expert_memory_frame(rep)
    for r in range(P):
        mine = df[df["who"] == f"rank {r}"].pivot(index="category", columns="source",
                                                   values="bytes")
        assert list(mine["measured"]) == list(mine["theory"])
        assert mine["measured"].sum() == sum(rep["ranks"][r]["memory"][k]
                                             for k in ("params", "grads", "optimizer"))
    replicated = df[df["who"] == "experts replicated (ep = 1)"]["bytes"].sum()
    sharded = df[(df["who"] == "rank 0") & (df["source"] == "theory")]["bytes"].sum()
    experts = 2 * E * theory.mlp_params(rep["config"]["d_model"])  # 2 MoE layers
    assert rep["theory"]["expert_params_per_rank"] == experts // P
    assert replicated - sharded == 16 * experts * (P - 1) // P  # fp32 Adam: 16 B per parameter


def test_charts_build_with_honest_titles(report, rep):
    charts = [vx.routing_heatmap(report), vx.expert_load(rep), vx.expert_load(rep, rank=0),
              vx.load_over_steps(report), vx.load_over_steps({"aux 0": rep, "aux 0.01": rep}),
              vx.all_to_all_matrix(report), vx.all_to_all_matrix(rep, 0, "dispatch", "forward"),
              vx.all_to_all_vs_uniform(rep), vx.expert_memory(rep)]
    titles = []
    for c in charts:
        spec = c.to_dict()
        titles.append(spec["title"]["text"])
        assert isinstance(c, (alt.LayerChart, alt.HConcatChart))
    assert all("measured" in t for t in titles[:5])
    assert all("counted from the run's splits" in t for t in titles[5:7])  # not socket bytes
    assert titles[7] == "All-to-all bytes per rank per step: written, counted, uniform routing"
    assert titles[8] == "Model states per rank: measured vs theory"
    uniform = vx.all_to_all_vs_uniform(rep).data
    assert set(uniform["source"]) - {"measured (written to sockets)"} == {
        "counted (this run's splits)", "theory (uniform routing, no drops)"}
    assert (uniform.loc[uniform["source"].str.startswith("theory"), "bytes"]
            == rep["theory"]["ep_all_to_all_uniform"]).all()
