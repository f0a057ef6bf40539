"""Pipeline parallel: schedules as data (pure), the runner on real ranks against the reference,
measured bytes and memory against theory, the bubble (wall clock, replayed), the trace."""
import copy
import json
import os
import subprocess
import sys

import pytest

from parallel_mini import theory
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.parallel import schedules as S
from parallel_mini.runtime.launch import MAX_LOCAL_RANKS, run_ranks
from parallel_mini.course.timelines import chrome_trace, wall_view
from parallel_mini.course.trace import bubble, own_device_costs, own_device_replay, wall_gap


# -- schedules, no ranks ------------------------------------------------------------------------
@pytest.mark.parametrize("name,pp,m,v", [("naive", 4, 3, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                         ("1f1b", 4, 2, 1), ("interleaved", 4, 8, 2),
                                         ("interleaved", 2, 4, 3), ("zb", 4, 8, 1), ("zb", 3, 5, 1)])
def test_uniform_costs_give_the_formula(name, pp, m, v):
    """Replayed with equal stages, every schedule's bubble is its textbook formula exactly."""
    s = S.build_schedule(name, pp, m, v)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0} if s.split_backward else {"F": 1.0, "B": 2.0}
    timed = S.simulate(s, lambda rank, op: cost[op.kind] / s.virtual)
    idle = S.idle_fractions(timed, pp)
    assert max(idle) - min(idle) < 1e-9  # balanced stages idle alike
    assert idle[0] == pytest.approx(theory.bubble_fraction(name, pp, m, s.virtual), abs=1e-9)


def test_zero_bubble_formula_with_unequal_costs():
    s = S.build_schedule("zb", 4, 8)
    costs = {"F": 1.0, "B": 1.3, "W": 0.7}
    idle = S.idle_fractions(S.simulate(s, lambda r, op: costs[op.kind]), 4)
    assert idle[0] == pytest.approx(theory.bubble_fraction("zb", 4, 8, 1, costs), abs=1e-9)
    assert theory.bubble_fraction("zb", 4, 8) < theory.bubble_fraction("1f1b", 4, 8) / 2


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
def test_v_shape_zero_bubble(pp, m):
    """zbv: a V of 2p chunks (rank 0 holds the first and the last), 1F1B's memory (2p half-size
    chunk activations), and with equal op costs less bubble than ZB-H1, far less than 1F1B."""
    s = S.build_schedule("zbv", pp, m)
    assert s.owner[0] == s.owner[-1] == 0 and s.owner[pp - 1] == s.owner[pp] == pp - 1
    assert max(S.in_flight(s)) <= 2 * pp
    zbv = theory.bubble_fraction("zbv", pp, m)
    assert zbv < theory.bubble_fraction("zb", pp, m) < theory.bubble_fraction("1f1b", pp, m)


def test_memory_in_flight_per_schedule():
    assert S.in_flight(S.build_schedule("gpipe", 4, 8)) == [8, 8, 8, 8]  # all m at once
    assert S.in_flight(S.build_schedule("1f1b", 4, 8)) == [4, 3, 2, 1]  # p - r
    assert max(S.in_flight(S.build_schedule("zb", 4, 8))) == 4  # 1F1B's peak
    assert S.in_flight(S.build_schedule("naive", 4, 8)) == [1, 1, 1, 1]


def test_schedule_text_and_owner():
    s = S.build_schedule("1f1b", 2, 3)
    assert S.format_schedule(s).splitlines() == ["rank 0 | F0 F1 B0 F2 B1 B2",
                                                 "rank 1 | F0 B0 F1 B1 F2 B2"]
    assert S.build_schedule("interleaved", 2, 2).owner == [0, 1, 0, 1]


class _FakeComm:
    """Comm's point-to-point calls, noted instead of sent: a receive completes when waited on."""

    def __init__(self):
        self.calls = []

    def isend(self, tensor, dst, axis, **tags):
        self.calls.append(("isend", dst, tags["message"], tags["microbatch"], tags["chunk"]))
        return _Waited(self.calls, "send")

    def irecv(self, tensor, src, axis, **tags):
        self.calls.append(("irecv", src, tags["message"], tags["microbatch"], tags["chunk"]))
        return _Waited(self.calls, "wait")


class _Waited:
    def __init__(self, calls, what):
        self.calls, self.what = calls, what

    def wait(self):
        self.calls.append((self.what,))


def test_mailbox_posts_each_neighbours_next_receive_ahead():
    """Rank 1 of interleaved pp2: every message it takes had its receive posted before the op
    asked for it (irecv, no blocking recv), in the sender's order, at most AHEAD in flight."""
    import torch
    from parallel_mini.parallel.pipeline import Mailbox

    s = S.build_schedule("interleaved", 2, 4)
    comm = _FakeComm()
    box = Mailbox(comm, s, 1, (1, 2, 3), torch.float32, "cpu")
    assert comm.calls == [("irecv", 0, "act", 0, 1)]  # posted before any op runs
    taken = []
    for op in s.ops[1]:
        if op.kind == "F" and op.chunk > 0:
            key = ("act", op.microbatch, op.chunk)
        elif op.kind == "B" and op.chunk < s.n_chunks - 1:
            key = ("grad", op.microbatch, op.chunk)
        else:
            continue
        before = len(comm.calls)
        assert box.receive(key).shape == (1, 2, 3)
        taken.append(key)
        new = comm.calls[before:]
        assert new[0] == ("wait",) and all(c[0] == "irecv" for c in new[1:])  # waits, then posts
        in_flight = sum(c[0] == "irecv" for c in comm.calls) - sum(c == ("wait",) for c in comm.calls)
        assert in_flight <= Mailbox.AHEAD
    posted = [c[2:] for c in comm.calls if c[0] == "irecv"]
    assert posted == list(box._sent_by(s, 0)) and sorted(posted) == sorted(taken)
    assert not box.inbox and not box.posted[0]


def test_check_refuses_broken_schedules():
    F, B = (lambda i: S.Op("F", i, 0)), (lambda i: S.Op("B", i, 0))
    with pytest.raises(ValueError, match="missing"):
        S.from_ops([[F(0), F(1), B(0)], [S.Op("F", 0, 1), S.Op("B", 0, 1), S.Op("F", 1, 1),
                                         S.Op("B", 1, 1)]], 2)
    # rank 1 wants B1 before F0 can be done: waits for its own later op -> deadlock
    with pytest.raises(ValueError, match="deadlock"):
        S.from_ops([[F(0), F(1), B(0), B(1)],
                    [S.Op("F", 1, 1), S.Op("B", 1, 1), S.Op("F", 0, 1), S.Op("B", 0, 1)][::-1]], 2)


@pytest.mark.parametrize("changes,match", [
    (dict(pp=4, layers=6), "multiple of 4 layers"),
    (dict(pp=2, microbatches=3), "divisible by dp x microbatches"),
    (dict(pp=4, layers=8, schedule="interleaved", microbatches=2, batch=8), "at least as many"),
    (dict(pp=2, schedule="interleaved", microbatches=3, batch=12), "multiple of 2"),
    (dict(pp=2, schedule="1f1b", virtual_stages=2), "need --schedule interleaved"),
    (dict(pp=2, grad_accum=2), "grad-accum"),
    (dict(pp=2, precision="bf16-mixed", fp32_grad_accum=True), "fp32 gradient buffers inside"),
    (dict(pp=2, zero=1, schedule="pipedream"), "use --zero 0"),
])
def test_bad_pipeline_configs_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**changes).validate()


# -- on real ranks ------------------------------------------------------------------------------
def _check_against_theory(report):
    """Per rank: losses/params equal the reference, p2p and dp bytes equal theory, model states
    equal the stage's formula to the byte."""
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail
    stages = report.theory["stages"]
    for rank in report.ranks:
        stage = stages[rank["coords"]["pp"]]
        measured = report.wire_bytes_per_step(rank["rank"])
        for group, predicted in stage["wire_bytes_per_step"].items():
            assert measured.get(group, 0) == predicted, (rank["rank"], group)
        for cat in ("params", "grads", "optimizer"):
            assert rank["memory"][cat] == stage["memory"][cat], (rank["rank"], cat)


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b", "interleaved", "zb", "zbv"])
def test_pp2_equals_reference(schedule):
    report = run(RunConfig(pp=2, microbatches=4, schedule=schedule, steps=2, reference=True))
    _check_against_theory(report)


@pytest.mark.parametrize("schedule,layers", [("gpipe", 4), ("1f1b", 4), ("interleaved", 8), ("zb", 4),
                                             ("zbv", 8)])
def test_pp4_equals_reference(schedule, layers):
    report = run(RunConfig(pp=4, layers=layers, microbatches=8, schedule=schedule, steps=2,
                           reference=True))
    _check_against_theory(report)
    assert set(bubble(report)) >= {"wall", "replayed", "theory"}
    assert "measured" not in bubble(report)  # the replay is not a measurement


def test_dp_times_pp_equals_reference():
    report = run(RunConfig(dp=2, pp=2, microbatches=2, schedule="1f1b", steps=2, reference=True))
    _check_against_theory(report)
    assert report.wire_bytes_per_step(0)["dp"] > 0  # the stage's gradients were averaged


def test_gpipe_holds_more_activations_than_1f1b():
    """Stage 0 holds all m micro-batches under GPipe, at most p under 1F1B (measured bytes)."""
    held = {}
    for schedule in ("gpipe", "1f1b"):
        report = run(RunConfig(pp=2, microbatches=8, schedule=schedule, steps=2))
        held[schedule] = report.ranks[0]["memory"]["activations_peak"]
    # 8 vs 2 micro-batches in flight; the ratio is below 4 because buffers and the batch count too
    assert held["gpipe"] > 2.5 * held["1f1b"]


def test_replay_trace_and_cli(tmp_path):
    report = run(RunConfig(pp=2, microbatches=4, schedule="1f1b", steps=3))
    timed = own_device_replay(report, 1)
    assert {(t["kind"], t["rank"]) for t in timed} == {(k, r) for k in "FB" for r in (0, 1)}
    assert len(timed) == 2 * 2 * 4
    # own-device replay: rank 1's first forward starts exactly when rank 0's ends
    f00 = next(t for t in timed if t["rank"] == 0 and t["kind"] == "F" and t["microbatch"] == 0)
    f01 = next(t for t in timed if t["rank"] == 1 and t["kind"] == "F" and t["microbatch"] == 0)
    assert f01["start"] == f00["end"]
    # a disturbed op (the core taken mid-op) does not move the own-device costs: the low percentile
    costs = own_device_costs(report)
    slowed = copy.deepcopy(report)
    for r in slowed.ranks:
        for kind in "FB":
            ops = [e for e in r["events"] if e["kind"] == kind and e["step"] == 1]
            max(ops, key=lambda e: e["cpu"])["cpu"] *= 3
    assert own_device_costs(slowed) == costs
    assert set(costs) == {(r, k, r) for r in (0, 1) for k in "FB"}
    # the hand-off to the link is its own "send" event, outside the F or B that made the message
    for r, (message, to) in enumerate((("act", 1), ("grad", 0))):
        sends = [e for e in report.ranks[r]["events"] if e["kind"] == "send"]
        assert len(sends) == 4 * 3 and {(e["message"], e["to_chunk"]) for e in sends} == {(message, to)}
    trace = chrome_trace(report)
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0 and e["cat"] in "FB"]
    assert len(ops) == 2 * 2 * 4 * 3  # ranks x kinds x micro-batches x steps
    b = bubble(report)
    assert b["theory"] == pytest.approx(1 / 5)
    assert 0 <= b["replayed"]["overall"] < 1 and 0 <= b["wall"]["overall"] < 1
    path = tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-m", "parallel_mini", "run", "--pp", "2", "--steps", "2",
                          "--trace", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "bubble: measured (wall clock) " in out.stdout
    assert "replayed (measured op times, own-device schedule)" in out.stdout
    assert any(e.get("cat") == "send" or e.get("name") == "send" for e in json.loads(path.read_text())["traceEvents"])


# -- the wall-clock bubble ------------------------------------------------------------------------
def _where_am_i():
    import torch
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_ranks_get_a_core_of_their_own_when_there_are_enough():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        got = run_ranks(_where_am_i, 2)
        assert [r.value for r in got] == [([cores[0]], 1), ([cores[1]], 1)]
        assert [r.placement["pinned"] for r in got] == [True, True]
    crowd = len(cores) + 1  # more ranks than cores: nobody is pinned, the cores are shared
    if crowd > MAX_LOCAL_RANKS:  # (a 16-core machine cannot be crowded by local ranks)
        return
    got = run_ranks(_where_am_i, crowd)
    assert all(r.value == (cores, 1) and not r.placement["pinned"] for r in got)
    assert "share them" in got[0].placement["how"]


def _gpipe_by_hand(bookkeeping: float = 0.0) -> dict:
    """GPipe, p = 2, m = 1, written as the events a run records: F = 1 s, B = 2 s, each message
    handed to the link in 0.1 s and arriving 0.5 s after its op ended; rank 1 spends `bookkeeping`
    seconds between its F and its B."""
    def ev(kind, start, end, chunk, **extra):
        return {"kind": kind, "step": 0, "microbatch": 0, "stage": chunk, "start": start,
                "end": end, "cpu": end - start, **extra}
    g = bookkeeping
    rank0 = [ev("F", 0, 1, 0), ev("send", 1, 1.1, 0, message="act", to_chunk=1),
             ev("wait", 1.1, 5 + g, 0, waiting_for="B0.1"), ev("B", 5 + g, 7 + g, 0)]
    rank1 = [ev("wait", 0, 1.5, 1, waiting_for="F0.0"), ev("F", 1.5, 2.5, 1),
             ev("B", 2.5 + g, 4.5 + g, 1), ev("send", 4.5 + g, 4.6 + g, 1, message="grad", to_chunk=0)]
    ranks = [{"rank": r, "coords": {"dp": 0, "pp": r}, "events": es, "placement": {
        "pinned": True, "cores": [r], "cores_available": 2, "how": ""}} for r, es in enumerate((rank0, rank1))]
    return type("Report", (), {"config": {"schedule": "gpipe", "pp": 2, "microbatches": 1,
                                          "virtual_stages": 0, "steps": 1}, "ranks": ranks})()


@pytest.mark.parametrize("bookkeeping", [0.0, 0.2])
def test_wall_gap_splits_the_idle_time_into_what_was_measured(bookkeeping):
    report = _gpipe_by_hand(bookkeeping)
    span = 7 + bookkeeping
    gap = wall_gap(report, 0, report.ranks)
    assert gap["per_rank"] == pytest.approx([1 - 3 / span] * 2)  # 3 s of F + B on each rank
    assert gap["p2p_latencies_s"] == pytest.approx([0.5, 0.5])  # both receivers were blocked
    assert gap["replay_stage_means"] == gap["replay_each_op"] == pytest.approx(1 / 2)  # the formula
    # with the hand-offs and latencies put back, the replay is the run, bookkeeping aside
    assert gap["replay_each_op_and_links"] == pytest.approx(1 - 3 / 7)
    # where each rank's idle seconds went: waiting in a receive, handing a message over, the rest
    # (rank 1: its bookkeeping, and the drain after its last op)
    split = [[x[k] * span for k in ("waiting_on_messages", "sending", "other")] for x in gap["idle_per_rank"]]
    assert split[0] == pytest.approx([3.9 + bookkeeping, 0.1, 0.0])
    assert split[1] == pytest.approx([1.5, 0.1, 2.4 + bookkeeping])
    b = bubble(report)
    assert b["theory"] == 1 / 2 and b["wall"]["ranks_shared_cores"] is False
    parts = b["wall"]["gap_to_formula"]
    assert parts["stage_imbalance"] == parts["op_time_variation"] == pytest.approx(0.0)
    assert parts["p2p_messages"] == pytest.approx(1 / 2 - 3 / 7)
    assert parts["between_ops"] == pytest.approx(3 / 7 - 3 / span)


def _gpipe_m2_slow_last_stage() -> dict:
    """GPipe, p = 2, m = 2 as recorded: rank 0's F 1 s, rank 1's 2 s, every B 2 s, hand-off 0.1 s,
    latency 0.5 s; F1's activation is there before rank 1 asks for it, and taking it costs 0.2 s."""
    def ev(kind, micro, start, end, chunk, **extra):
        return {"kind": kind, "step": 0, "microbatch": micro, "stage": chunk, "start": start,
                "end": end, "cpu": end - start, **extra}
    rank0 = [ev("F", 0, 0, 1, 0), ev("send", 0, 1, 1.1, 0, message="act", to_chunk=1),
             ev("F", 1, 1.1, 2.1, 0), ev("send", 1, 2.1, 2.2, 0, message="act", to_chunk=1),
             ev("wait", 0, 2.2, 8.2, 0, waiting_for="B0.1"), ev("B", 0, 8.2, 10.2, 0),
             ev("wait", 1, 10.2, 10.3, 0, waiting_for="B1.1"), ev("B", 1, 10.3, 12.3, 0)]
    rank1 = [ev("wait", 0, 0, 1.5, 1, waiting_for="F0.0"), ev("F", 0, 1.5, 3.5, 1),
             ev("wait", 1, 3.5, 3.7, 1, waiting_for="F1.0"), ev("F", 1, 3.7, 5.7, 1),
             ev("B", 0, 5.7, 7.7, 1), ev("send", 0, 7.7, 7.8, 1, message="grad", to_chunk=0),
             ev("B", 1, 7.8, 9.8, 1), ev("send", 1, 9.8, 9.9, 1, message="grad", to_chunk=0)]
    ranks = [{"rank": r, "coords": {"dp": 0, "pp": r}, "events": es, "placement": {
        "pinned": True, "cores": [r], "cores_available": 2, "how": ""}} for r, es in enumerate((rank0, rank1))]
    return type("Report", (), {"config": {"schedule": "gpipe", "pp": 2, "microbatches": 2,
                                          "virtual_stages": 0, "steps": 1}, "ranks": ranks})()


def test_wall_gap_with_a_slow_stage_and_a_message_waiting():
    report = _gpipe_m2_slow_last_stage()
    gap = wall_gap(report, 0, report.ranks)
    assert gap["per_rank"] == pytest.approx([1 - 6 / 12.3, 1 - 8 / 12.3])
    # latencies are read where the receiver asked before the message's op ended (F0, B0); rank 0
    # asks for B1's gradient after B1 ended: its 0.1 s wait counts as taking the message, which
    # with the latency bound (wait end - B1's end) replays the same start
    assert gap["p2p_latencies_s"] == pytest.approx([0.5] * 2)
    # each stage's own op times, instant links: rank 0 idles 5 of 11 s, rank 1 3 of 11
    assert gap["replay_stage_means"] == gap["replay_each_op"] == pytest.approx(4 / 11)
    # hand-offs, latencies and the 0.2 s taking F1's activation put back: the run exactly
    assert gap["replay_each_op_and_links"] == pytest.approx(1 - 7 / 12.3)
    parts = bubble(report)["wall"]["gap_to_formula"]
    assert parts["stage_imbalance"] == pytest.approx(4 / 11 - 1 / 3)
    assert parts["p2p_messages"] == pytest.approx(1 - 7 / 12.3 - 4 / 11)
    assert parts["between_ops"] == pytest.approx(0.0, abs=1e-12)
    split = [[x[k] * 12.3 for k in ("waiting_on_messages", "sending", "other")] for x in gap["idle_per_rank"]]
    assert split == [pytest.approx([6.1, 0.2, 0.0]), pytest.approx([1.7, 0.2, 2.4])]


def test_wall_gap_counts_the_senders_hand_off():
    """GPipe, p = 2, m = 2, equal stages, messages handed over in 0.1 s and arriving 0.05 s after
    their op: each hand-off delays the sender's next op, which the next rank waits for."""
    def ev(kind, micro, start, end, chunk, **extra):
        return {"kind": kind, "step": 0, "microbatch": micro, "stage": chunk, "start": start,
                "end": end, "cpu": end - start, **extra}
    act = {"message": "act", "to_chunk": 1}
    grad = {"message": "grad", "to_chunk": 0}
    rank0 = [ev("F", 0, 0, 1, 0), ev("send", 0, 1, 1.1, 0, **act), ev("F", 1, 1.1, 2.1, 0),
             ev("send", 1, 2.1, 2.2, 0, **act), ev("wait", 0, 2.2, 5.2, 0, waiting_for="B0.1"),
             ev("B", 0, 5.2, 7.2, 0), ev("wait", 1, 7.2, 7.3, 0, waiting_for="B1.1"), ev("B", 1, 7.3, 9.3, 0)]
    rank1 = [ev("wait", 0, 0, 1.05, 1, waiting_for="F0.0"), ev("F", 0, 1.05, 2.05, 1),
             ev("wait", 1, 2.05, 2.15, 1, waiting_for="F1.0"), ev("F", 1, 2.15, 3.15, 1),
             ev("B", 0, 3.15, 5.15, 1), ev("send", 0, 5.15, 5.25, 1, **grad),
             ev("B", 1, 5.25, 7.25, 1), ev("send", 1, 7.25, 7.35, 1, **grad)]
    report = type("Report", (), {"config": {"schedule": "gpipe", "pp": 2, "microbatches": 2,
                                            "virtual_stages": 0, "steps": 1},
                                 "ranks": [{"rank": r, "coords": {"pp": r}, "events": es}
                                           for r, es in enumerate((rank0, rank1))]})()
    gap = wall_gap(report, 0, report.ranks)
    assert gap["p2p_latencies_s"] == pytest.approx([0.05] * 4)
    assert gap["replay_each_op"] == pytest.approx(1 / 3)  # (p - 1)/(m + p - 1): equal stages
    assert gap["replay_each_op_and_links"] == pytest.approx(1 - 6 / 9.3) == gap["per_rank"][0]
    assert bubble(report)["wall"]["ranks_shared_cores"] is None  # no placement recorded


def test_wall_clock_bubble_of_a_pinned_pipeline():
    """`bubble.wall` is the idle share of the recorded wall-clock ops (recomputed here from the raw
    events); the report says where the ranks ran."""
    report = run(RunConfig(pp=2, microbatches=4, schedule="gpipe", steps=3))
    wall = bubble(report)["wall"]
    ranks = sorted(report.ranks, key=lambda r: r["coords"]["pp"])
    ops = [[e for e in r["events"] if e["step"] == 1 and e["kind"] in "FB"] for r in ranks]
    t0, t1 = min(e["start"] for es in ops for e in es), max(e["end"] for es in ops for e in es)
    by_hand = [1 - sum(e["end"] - e["start"] for e in es) / (t1 - t0) for es in ops]
    assert wall["per_step"] == [pytest.approx(sum(by_hand) / 2, abs=1e-12)]
    assert wall["overall"] == pytest.approx(sum(by_hand) / 2, abs=1e-12)
    assert wall_view(report, 1)  # the same events, drawn
    assert all(0 < x <= 1.0 + 1e-9 for x in wall["op_cpu_over_wall_per_rank"])
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        assert [r["placement"]["pinned"] for r in ranks] == [True, True]
        assert wall["ranks_shared_cores"] is False and "core of its own" in wall["placement"]
    crowded = run(RunConfig(pp=len(os.sched_getaffinity(0)) + 1, microbatches=1, schedule="gpipe",
                            layers=len(os.sched_getaffinity(0)) + 1, steps=1))
    assert bubble(crowded)["wall"]["ranks_shared_cores"] is True
    assert "shared" in bubble(crowded)["wall"]["placement"]


@pytest.mark.parametrize("zero,schedule", [(1, "1f1b"), (2, "zb"), (2, "interleaved"), (3, "gpipe"),
                                           (3, "1f1b")])
def test_zero_inside_pipeline_stages(zero, schedule):
    """dp 2 x pp 2: each stage's states sharded over its dp pair (ZeRO-1/2: once per step, after
    the flush; ZeRO-3: every layer gathered again for each micro-batch's forward and backward, so
    m times the traffic), equal to the reference, every rank's bytes to the stage's formula."""
    report = run(RunConfig(dp=2, pp=2, zero=zero, microbatches=4, schedule=schedule, steps=2,
                           layers=8 if schedule == "interleaved" else 4, reference=True))
    _check_against_theory(report)
    plain = theory.run_theory(RunConfig.from_dict({**report.config, "zero": 0}).validate(), 0)
    for r in report.ranks:  # Adam's moments are split over the dp pair: half (+ padding) each
        full = plain["stages"][r["coords"]["pp"]]["memory"]["optimizer"]
        assert full / 2 <= r["memory"]["optimizer"] < full


# -- PipeDream: asynchronous 1F1B ---------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-nostash"])
def test_pipedream_without_staleness_is_sequential_training(schedule):
    """One micro-batch per step: nothing is in flight when a stage updates, so PipeDream is exactly
    the sequential per-micro-batch reference (with or without stashing)."""
    report = run(RunConfig(pp=2, microbatches=1, schedule=schedule, steps=3, reference=True))
    assert report.max_abs_diff <= 1e-5


def test_pipedream_staleness_and_what_stashing_fixes():
    from parallel_mini.parallel.pipedream import expected_staleness

    diffs = {}
    for schedule in ("pipedream", "pipedream-nostash"):
        report = run(RunConfig(pp=4, microbatches=8, schedule=schedule, steps=4, reference=True))
        for rank in report.ranks:
            r = rank["coords"]["pp"]
            seen = [(s["microbatch"], s["updates_between"]) for s in rank["pipedream"]["staleness"]]
            assert len(seen) == 8 * 4
            assert all(u == expected_staleness(4, r, mb) for mb, u in seen)
            assert rank["pipedream"]["peak_versions"] == 4 - r  # stashed weight versions in flight
        diffs[schedule] = report.max_abs_diff
    # stale but consistent gradients stay nearer sequential training than inconsistent ones;
    # neither equals it (deterministic numbers: no timing is involved)
    assert 1e-3 < diffs["pipedream"] < diffs["pipedream-nostash"]


def test_pipedream_with_dp_is_refused():
    with pytest.raises(ConfigError, match="use --dp 1"):
        RunConfig(pp=2, dp=2, schedule="pipedream").validate()
