"""The app server's bounded queue of rank processes (app/run_queue.py, used by app/live_runs.py):
first come first served with positions, a request bigger than the bound runs alone, a request that
leaves while waiting frees its place, identical requests share one run, and a load test: 20
sessions asking at once for distinct live runs all get answers and never more rank processes live
than the bound (counted from /proc, not from the queue's own books)."""
from __future__ import annotations

import multiprocessing.forkserver as mp_forkserver
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))

import run_queue  # noqa: E402
from run_queue import RunQueue, bound_from_env  # noqa: E402


class Waiter(threading.Thread):
    """One request: records every position it was told while waiting, then holds its slots until
    `done` is set."""

    def __init__(self, q: RunQueue, ranks: int, order: list, on_wait=None):
        super().__init__(daemon=True)
        self.q, self.ranks, self.order = q, ranks, order
        self.positions: list[int] = []
        self.granted, self.done = threading.Event(), threading.Event()
        self.error = None
        self._extra = on_wait

    def _on_wait(self, position, waited_s):
        self.positions.append(position)
        if self._extra:
            self._extra(position, waited_s)

    def run(self):
        try:
            self.q.acquire(self.ranks, self._on_wait, poll_s=0.005)
        except RuntimeError as err:
            self.error = err
            return
        self.order.append(self)
        self.granted.set()
        self.done.wait(60)  # a hang guard (HANG_S): the test sets `done`; 5 s let a holder go
        # early when the test was slow, and the order checked after it changed
        self.q.release(self.ranks)


HANG_S = 60  # the bound of every wait for a state below: a hang guard, never a measurement


def _told(waiter: Waiter, position: int):
    """Wait until the waiter has been told `position` by its latest callback: under load a
    waiting thread may not run for a while, so no fixed sleep is long enough."""
    deadline = time.monotonic() + HANG_S
    while not (waiter.positions and waiter.positions[-1] == position):
        assert time.monotonic() < deadline, f"told {waiter.positions[-3:]}, expected {position}"
        time.sleep(0.002)


def _queued(q: RunQueue, n: int):
    deadline = time.monotonic() + HANG_S
    while q.waiting() != n:
        assert time.monotonic() < deadline, f"{q.waiting()} waiting, expected {n}"
        time.sleep(0.002)


def test_first_come_first_served_with_positions_and_oversize():
    q = RunQueue(2)
    assert q.try_acquire(2)                      # a run of 2 ranks holds every slot
    order: list = []
    b = Waiter(q, 1, order)
    b.start(); _queued(q, 1)
    big = Waiter(q, 4, order)                    # 4 > bound 2: runs alone, rather than never
    big.start(); _queued(q, 2)
    d = Waiter(q, 1, order)
    d.start(); _queued(q, 3)
    assert not q.try_acquire(1)                  # nobody jumps the queue
    _told(b, 1); _told(big, 2); _told(d, 3)

    q.release(2)
    assert b.granted.wait(HANG_S)
    _told(big, 1); _told(d, 2)                   # a slot is free, but `big` is ahead of d
    assert not big.granted.is_set() and not d.granted.is_set()

    b.done.set()
    assert big.granted.wait(HANG_S)
    assert q.in_use == 4 and not d.granted.is_set()   # alone: d waits although it would fit
    big.done.set()
    assert d.granted.wait(HANG_S)
    d.done.set()
    for t in (b, big, d):
        t.join(HANG_S)
    assert order == [b, big, d]
    assert q.in_use == 0 and q.peak_in_use == 4 and q.granted == 4


def test_a_request_that_leaves_while_waiting_frees_its_place():
    """Streamlit's rerun (a control changed) is raised from the waiting callback: the request must
    leave the queue, and the one behind it must not wait for it."""
    q = RunQueue(1)
    assert q.try_acquire(1)
    order: list = []

    def leave(position, waited_s):
        raise RuntimeError("the learner changed a control")

    gone = Waiter(q, 1, order, on_wait=leave)
    gone.start(); gone.join(HANG_S)
    assert isinstance(gone.error, RuntimeError) and q.waiting() == 0
    after = Waiter(q, 1, order)
    after.start(); _queued(q, 1)
    q.release(1)
    assert after.granted.wait(HANG_S)
    after.done.set(); after.join(HANG_S)
    assert order == [after] and q.in_use == 0


def test_the_bound_comes_from_the_environment():
    assert bound_from_env({}) == run_queue.cores() >= 1
    assert bound_from_env({"PARALLEL_MINI_MAX_RANKS": "3"}) == 3
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="PARALLEL_MINI_MAX_RANKS=.*whole number"):
            bound_from_env({"PARALLEL_MINI_MAX_RANKS": bad})


@pytest.fixture
def live_runs(monkeypatch):
    import streamlit as st

    import live_runs as lr
    st.cache_data.clear()
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", None)
    yield lr
    st.cache_data.clear()


def _at_the_compute_lock(thread: threading.Thread) -> bool:
    """The thread is in Streamlit's cache, at the lock of a value being computed (past its cache
    miss: from there it takes the value the computing thread stores, never computes it again)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if ("runtime/caching" in frame.f_code.co_filename.replace(os.sep, "/")
                and frame.f_code.co_name == "_hold_compute_lock"):
            return True
        frame = frame.f_back
    return False


def test_identical_requests_share_one_run(live_runs, monkeypatch):
    """Two sessions asking for the same configuration, the second while the first one's run is in
    flight: one run, both answered."""
    calls = []
    second = threading.Thread(target=lambda: out.__setitem__(1, live_runs.ring_experiment(2, 8, 0.0)))

    def slow_ring(n, numel, timed_mb=None):
        calls.append((n, numel))
        if len(calls) == 1:  # the first run stays in flight until the second request waits for it
            second.start()
            deadline = time.monotonic() + HANG_S
            while not _at_the_compute_lock(second):
                assert time.monotonic() < deadline, "the second request never reached the lock"
                time.sleep(0.01)
        return {"n": n, "numel": numel}

    monkeypatch.setattr(live_runs.collectives, "ring_experiment", slow_ring)
    out = [None, None]
    out[0] = live_runs.ring_experiment(2, 8, 0.0)
    second.join(HANG_S)
    assert calls == [(2, 8)]
    assert out[0]["numel"] == out[1]["numel"] == 8


def _live_rank_processes(forkserver_pid: int) -> int:
    """Ranks alive now: children of the forkserver that are not zombies, read from /proc (its
    children file: one read, so that sampling every 5 ms takes little from the ranks' 2 cores)."""
    try:
        with open(f"/proc/{forkserver_pid}/task/{forkserver_pid}/children") as f:
            pids = f.read().split()
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: every process's parent
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    n = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == forkserver_pid and state != "Z":
            n += 1
    return n


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="counts rank processes in /proc")
def test_twenty_sessions_at_once_all_answered_within_the_bound(live_runs, monkeypatch):
    """20 sessions ask at once for 20 distinct ring all-reduces on 2 ranks each, through the app's
    cached wrapper, on a server bounded to 2 rank processes (the default on a 2-core machine: with
    a bound of 4, two runs at once on 2 cores, the 20 took 25 s instead of 6 s here: ranks that
    share a core wait a time slice for every message)."""
    bound, sessions = 2, 20
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", RunQueue(bound))
    live_runs.ring_experiment(2, 4, 0.0)  # starts the forkserver, so /proc can be watched
    fs_pid = mp_forkserver._forkserver._forkserver_pid
    assert fs_pid, "no forkserver: the ranks could not be counted"

    seen, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(_live_rank_processes(fs_pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    answers: dict[int, dict] = {}

    def session(i):
        answers[i] = live_runs.ring_experiment(2, 8 + i, 0.0)  # distinct: numel 8..27

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    sampler.join(5)

    assert sorted(answers) == list(range(sessions))
    for i, exp in answers.items():
        assert exp["numel"] == 8 + i and exp["int_exact"], exp
    q = run_queue._SERVER_QUEUE
    assert q.in_use == 0 and q.peak_in_use <= bound
    assert max(seen) <= bound, f"{max(seen)} rank processes alive at once, bound {bound}"
    assert max(seen) >= 2, "the sampler never saw a run's ranks: it proves nothing"


# ---------------------------------------------------------------------------------------------
# run_live on a page (AppTest, a fake run that holds rank slots but starts no rank)
# ---------------------------------------------------------------------------------------------
PAGE = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "app")!r})
import streamlit as st
import live_runs

def fake_run(n, attempt):
    if st.session_state.get("runs_cached"):  # as if every run were in the wrappers' caches
        return {{"n": n}}
    with live_runs.rank_slots(n):
        if st.session_state.get("change_mid_run"):  # the learner moves the slider mid-run
            st.session_state.change_mid_run = False
            st.session_state.n_next = n + 1  # the slider is set from it before it is drawn
            st.rerun()
        time.sleep(0.05)
    if st.session_state.get("own_progress"):
        st.progress(0.5, text="step 1 of 2 (the page's own bar)")
    return {{"n": n}}

if "n_next" in st.session_state:
    st.session_state.n = st.session_state.pop("n_next")
n = st.slider("n", 1, 8, key="n")
if st.button("Run live"):
    live_runs.run_live("t", {{"n": n}}, f"Running on {{n}} ranks…", fake_run, n, ranks=n,
                       own_progress=st.session_state.get("own_progress", False))
result, current = live_runs.last_result("t", {{"n": n}})
if result is not None:
    st.metric("n of the last run", result["n"])
"""


def _page(n: int):
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_string(PAGE, default_timeout=HANG_S)
    at.session_state["n"] = n
    return at.run()


def test_run_live_waits_in_the_queue_and_says_how_long(live_runs, monkeypatch):
    q = RunQueue(2)
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", q)
    assert q.try_acquire(2)  # another session's run holds every slot...
    notes = []
    note_of = live_runs._queue_note
    monkeypatch.setattr(live_runs, "_queue_note", lambda *a: notes.append(note_of(*a)) or notes[-1])
    at = _page(2)

    def other_session_finishes():  # ...until 0.6 s after this page's request has queued
        _queued(q, 1)
        time.sleep(0.6)
        q.release(2)

    other = threading.Thread(target=other_session_finishes, daemon=True)
    other.start()
    t0 = time.monotonic()
    at.button[0].click().run()
    took = time.monotonic() - t0  # the press, the wait included
    other.join(HANG_S)
    assert not at.exception and not at.error, [e.value for e in at.exception]
    assert at.metric[0].value == "2"
    label = at.status[0].label
    assert "measured now on this machine" in label and "waiting for rank processes" in label, label
    waited = float(label.split("after ")[1].split(" s waiting")[0])
    # at least the 0.6 s the other session held on, at most the press itself (not a fixed 10 s:
    # a loaded machine may take longer, and the label is checked against what happened)
    assert 0.5 <= waited <= took + 0.05, (label, took)
    assert q.in_use == 0 and q.granted == 2
    assert notes and notes[0].startswith("Waiting for 2 rank processes: number 1 in the queue, 0 s")


def test_progress_is_drawn_outside_the_collapsed_status_box(live_runs, monkeypatch):
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", RunQueue(2))
    at = _page(2)
    at.button[0].click().run()
    assert not at.status[0].children, "something was drawn inside the collapsed box"
    assert [p.proto.text for p in at.get("progress")] == ["Step 1 of 1: done"]
    at.session_state["own_progress"] = True
    at.session_state["n"] = 1  # a setting not measured yet (n = 2 is read from the cache now)
    at.button[0].click().run()  # a page function that draws its own bar: run_live adds none
    assert not at.status[0].children
    assert [p.proto.text for p in at.get("progress")] == ["step 1 of 2 (the page's own bar)"]


def test_run_live_bigger_than_the_bound_runs_alone(live_runs, monkeypatch):
    q = RunQueue(2)
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", q)
    at = _page(4)
    at.button[0].click().run()
    assert not at.exception and not at.error
    assert at.metric[0].value == "4" and q.peak_in_use == 4 and q.in_use == 0
    assert "it ran alone (4 rank processes, more than this server's 2)" in \
        at.status[0].label


def test_a_run_abandoned_by_a_control_change_is_said_and_frees_its_slots(live_runs, monkeypatch):
    q = RunQueue(4)
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", q)
    at = _page(2)
    at.session_state["change_mid_run"] = True
    at.button[0].click().run()  # the run reruns the script mid-run, as a moved slider does
    assert not at.exception, [e.value for e in at.exception]
    assert q.in_use == 0 and q.granted == 1  # it had its slots; they went back
    said = [w.value for w in at.warning]
    assert len(said) == 1 and "“Running on 2 ranks” was abandoned when you changed n 2 → 3" in said[0]
    assert not at.metric  # nothing was kept
    at.run()
    assert not at.warning  # said once
    at.button[0].click().run()
    assert not at.warning and at.metric[0].value == "3"


def test_the_wait_is_estimated_by_replaying_the_queue():
    """Holders' remaining estimates, then every request ahead, first come first served: a request
    starts when it fits; an oversize one alone; no estimate where one of them has none."""
    q = RunQueue(2)
    before = time.monotonic()
    assert q.try_acquire(1, est_s=10.0) and q.try_acquire(1, est_s=4.0)  # both slots, 10 s and 4 s
    order: list = []
    a = Waiter(q, 2, order)           # needs both slots: after the 10 s holder
    a.start(); _queued(q, 1)
    ticket_a = list(q._waiting)[0]
    q._ests[ticket_a] = (2, 3.0)      # as if asked with est_s=3
    b = Waiter(q, 1, order)
    b.start(); _queued(q, 2)
    ticket_b = list(q._waiting)[1]
    q._ests[ticket_b] = (1, 5.0)
    now = time.monotonic()
    wait_a, wait_b = q.estimate_wait(ticket_a, now), q.estimate_wait(ticket_b, now)
    assert 10.0 - (now - before) <= wait_a <= 10.0  # when the longer holder should end
    assert wait_b == pytest.approx(wait_a + 3.0)     # then a's 3 s on both slots
    q._ests[ticket_a] = (2, None)                    # a run ahead without a measured similar run
    assert q.estimate_wait(ticket_b) is None
    assert q.estimate_wait(object()) is None         # not waiting: nothing to estimate
    q._ests[ticket_a] = (4, 3.0)                     # oversize: alone, after both holders
    assert q.estimate_wait(ticket_b, now) == pytest.approx(q.estimate_wait(ticket_a, now) + 3.0)
    q.release(1); q.release(1)
    for w in (a, b):
        assert w.granted.wait(HANG_S)
        w.done.set(); w.join(HANG_S)
    assert q.in_use == 0 and not q._holders and not q._ests


def test_results_are_kept_by_bytes_per_page():
    """One page's big results evict that page's oldest, never another page's; the newest stays even
    when it alone is over the budget."""
    from live_runs import SharedResults

    shared = SharedResults(budget_bytes=10_000)
    for page, tag in (("dp", "a"), ("cp", "1"), ("cp", "2"), ("cp", "3")):
        flight, leader = shared.begin(page, tag, "session")
        assert leader
        shared.finish(page, tag, flight, {"x": "y" * 4_000}, took_s=1.0, ranks=2)
    assert shared.get("dp", "a").result() == {"x": "y" * 4_000}  # cp's three did not evict it
    assert shared.get("cp", "1") is None and shared.get("cp", "3") is not None
    assert shared.get("cp", "2") is not None
    flight, _ = shared.begin("cp", "big", "session")
    shared.finish("cp", "big", flight, "z" * 20_000, took_s=3.0, ranks=4)
    assert shared.get("cp", "big") is not None and shared.get("cp", "3") is None
    assert shared.bytes_by_page()["dp"] < 10_000
    assert shared.estimate("cp", 2) == 1.0 and shared.estimate("cp", 4) == 3.0
    assert shared.estimate("cp", 8) == 1.0  # no run on 8: the page's median
    assert shared.estimate("ring", 2) is None


def test_identical_presses_join_one_flight():
    from live_runs import SharedResults

    shared = SharedResults()
    flight, leader = shared.begin("ring", "k", "session")
    joined, second = shared.begin("ring", "k", "session")
    assert leader and not second and joined is flight
    other, third = shared.begin("ring", "other", "session")
    assert third and other is not flight
    shared.abandon("ring", "k", flight)  # the leader's session left: the next asker leads
    assert flight.done.is_set() and flight.entry is None
    again, leads = shared.begin("ring", "k", "session")
    assert leads and again is not flight


def test_the_status_line_says_measured_now_or_from_the_cache(live_runs, monkeypatch):
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", RunQueue(2))
    at = _page(2)
    at.button[0].click().run()
    first = at.status[0].label
    assert "measured now on this machine in " in first and "cache" not in first, first
    at.button[0].click().run()  # the same setting again (any session): read, not run
    again = at.status[0].label
    assert "taken from the cache: measured on this machine at " in again, again
    assert "measured now" not in again and at.metric[0].value == "2"
    stamp = re.search(r"machine at (\d\d:\d\d:\d\d), in (\d+\.\d) s", again)
    assert stamp and time.strptime(stamp[1], "%H:%M:%S"), again


def test_the_pages_to_warm_come_from_the_environment():
    from live_runs import WARM_ENV, warm_pages

    pages = [("Ring all-reduce", "ring", "ring.py"), ("Data parallel", "data_parallel", "dp.py")]
    assert warm_pages(pages, {}) == pages and warm_pages(pages, {WARM_ENV: "all"}) == pages
    assert warm_pages(pages, {WARM_ENV: "none"}) == []
    assert warm_pages(pages, {WARM_ENV: "data_parallel"}) == pages[1:]
    with pytest.raises(ValueError, match=r"PARALLEL_MINI_WARM='rings': rings is not a page; give "
                                         r"'all', 'none' or some of ring, data_parallel"):
        warm_pages(pages, {WARM_ENV: "rings"})


def test_a_press_whose_runs_were_all_cached_does_not_say_measured_now(live_runs, monkeypatch):
    q = RunQueue(2)
    monkeypatch.setattr(run_queue, "_SERVER_QUEUE", q)
    at = _page(2)
    at.session_state["runs_cached"] = True
    at.button[0].click().run()
    label = at.status[0].label
    assert "taken from the cache: its runs were measured earlier on this machine" in label, label
    assert "measured now" not in label and q.granted == 0 and at.metric[0].value == "2"
    assert live_runs.SHARED.estimate("t", 2) is None  # no rank ran: no duration to estimate from
