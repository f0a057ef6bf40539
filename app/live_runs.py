"""What every page needs to run ranks live: cached runs, the server's queue of rank processes,
visible progress, abandoned runs said, errors without tracebacks.

Pages run nothing on a rank themselves: they configure a run, call the library through the cached
wrappers here (engine.run, collectives.ring_experiment, experiments.tp_mlp_shards), and draw.

Results are cached per configuration (st.cache_data, shared by everyone watching the app; two
sessions asking for the same configuration at once share one run: st.cache_data computes a value
under a lock per key and the second caller reads what the first computed) and the last result of
each page is kept in the session, so moving a slider never starts ranks by itself: only "Run live"
does. "Fresh measurement" bypasses the cache for timings that should be re-taken.

Every run that is not in the cache first takes as many slots of the server's RunQueue
(run_queue.py) as it starts rank processes. One press of "Run live" holds its slots from its first
uncached run to its end, so a page that runs several configurations in a row queues once, for the
largest (`ranks=` of run_live). When the slots are taken, the page shows its place in the queue and
how long it has waited.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import streamlit as st

from parallel_mini import engine
from parallel_mini.course import collectives, experiments
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.launch import RankError
from parallel_mini.course.viz.units import bytes_unit, rate_unit
from run_queue import server_queue


# ---------------------------------------------------------------------------------------------
# rank slots: every uncached run holds the server queue's slots while its ranks live
# ---------------------------------------------------------------------------------------------
class WaitForSlots(BaseException):
    """Raised inside a cached run when its press of "Run live" must queue: run_live waits (drawing
    the queue position, outside the cached function, whose drawing would be replayed on a cache
    hit) and calls the page's function again. A BaseException, like Streamlit's own rerun, so
    that no page's `except Exception` swallows it."""

    def __init__(self, ranks: int):
        super().__init__(ranks)
        self.ranks = ranks


class _Lease:
    """The slots one press of "Run live" holds: none until its first uncached run, then
    max(announced ranks, that run's world size) until the press ends."""

    def __init__(self, queue, ranks: int):
        self.queue, self.ranks, self.held, self.waited_s = queue, ranks, 0, 0.0
        self.most = 0  # the most slots it held at once

    def cover(self, world: int) -> None:
        """Never waits: it runs inside a cached function, which holds st.cache_data's lock for its
        key (a session asking for the same run waits on it) and whose drawing would be replayed."""
        if self.held >= world:
            return
        need = max(self.ranks, world)
        self.release()  # a run bigger than announced: queue again for the bigger size
        if not self.queue.try_acquire(need):
            raise WaitForSlots(need)
        self.held = self.most = max(self.most, need)

    def wait(self, need: int, on_wait) -> None:
        self.waited_s += self.queue.acquire(need, on_wait)
        self.held = self.most = max(self.most, need)

    def release(self) -> None:
        if self.held:
            self.queue.release(self.held)
            self.held = 0


_LOCAL = threading.local()  # each session's script runs in its own thread: its lease, if any


@contextmanager
def rank_slots(world: int):
    """Hold `world` of the server's rank slots while the ranks of one uncached run live. Inside
    run_live the press's lease covers it (or WaitForSlots sends run_live to queue); elsewhere (a
    test, a script) it simply waits its turn, holding the cache's lock for its key meanwhile: so a
    page calls the cached wrappers only under run_live (a press that holds slots and asks for that
    key would wait for a run that waits for its slots)."""
    lease = getattr(_LOCAL, "lease", None)
    if lease is None:
        with server_queue().slot(world):
            yield
    else:
        lease.cover(world)
        yield


@st.cache_data(max_entries=32, show_spinner=False)
def ring_experiment(n: int, numel: int, timed_mb: float, attempt: int = 0) -> dict:
    """collectives.ring_experiment, cached per (n, numel, timed_mb, attempt)."""
    with rank_slots(n):
        t0 = time.perf_counter()
        exp = collectives.ring_experiment(n, numel, timed_mb=timed_mb)
    return {**exp, "run_wall_s": time.perf_counter() - t0}


@st.cache_data(max_entries=32, show_spinner=False)
def training_run(cfg_json: str, attempt: int = 0) -> dict:
    """engine.run on the RunConfig given as JSON; the report as a dict (cached per config)."""
    cfg = RunConfig.from_dict(json.loads(cfg_json))
    with rank_slots(cfg.world_size):
        report = engine.run(cfg)
    return report.to_dict()


@st.cache_data(max_entries=16, show_spinner=False)
def tp_mlp_shards(cfg_json: str, attempt: int = 0) -> list[dict]:
    """experiments.tp_mlp_shards on the RunConfig given as JSON: every tp rank's MLP shards (and
    rank 0's full weights), cached per config."""
    cfg = json.loads(cfg_json)
    with rank_slots(cfg["tp"]):
        return experiments.tp_mlp_shards(cfg)


def step_text(i: int, n: int, what: str) -> str:
    """What every live run's progress bar says: which step of how many, and what runs now."""
    return f"Step {i} of {n}: {what}"


class StepBar:
    """The progress bar of a page function that runs several things per press (run_live's
    `own_progress`): "Step i of n: <what runs now>", filled (i - 1)/n while step i runs, and
    "Step n of n: done" at the end, as run_live's own bar for a single run says "Step 1 of 1".

        bar = StepBar(len(jobs))
        for job in jobs:
            bar.step(f"{job}: training on 4 ranks…")
            ...
        bar.done()
    """

    def __init__(self, total: int):
        self.total, self.i = max(total, 1), 0
        self._bar = st.progress(0.0, text=step_text(1, self.total, "starting the ranks…"))

    def step(self, what: str) -> None:
        """The next step starts; `what` it runs."""
        self.i = min(self.i + 1, self.total)
        self._bar.progress((self.i - 1) / self.total, text=step_text(self.i, self.total, what))

    def done(self, what: str = "done") -> None:
        self._bar.progress(1.0, text=step_text(self.total, self.total, what))


def rank_error_summary(err: RankError) -> str:
    """The failing rank and the last line of its traceback (the exception itself)."""
    lines = [ln for ln in str(err.details).strip().splitlines() if ln.strip()]
    return f"Rank {err.rank} failed: {lines[-1].strip() if lines else 'no details'}"


def _queue_note(queue, need: int, position: int | None = None, waited_s: float = 0.0) -> str:
    bound = f"this server runs at most {queue.bound} rank processes at once"
    if queue.oversize(need):
        return (f"This run needs {need} rank processes, more than the {queue.bound} this server runs "
                f"at once: it will run alone, when the runs ahead of it have finished"
                + (f" (number {position} in the queue, waiting {waited_s:.0f} s so far)."
                   if position else "."))
    return (f"Waiting for {need} rank processes: number {position} in the queue, "
            f"{waited_s:.0f} s so far ({bound}; other sessions are running).")


def run_live(page: str, key: dict, label: str, fn, *args, fresh: bool = False, ranks: int = 1,
             own_progress: bool = False, where=None):
    """Run `fn(*args, attempt)` and keep the result as this page's last one.

    `ranks`: the most rank processes the press starts at once (a page function that runs several
    configurations in a row: the largest). Its progress is drawn outside the collapsed status box:
    a bar, step 1 of 1, or, with `own_progress`, the StepBar `fn` draws itself (step i of n);
    above it the queue position while the press waits for rank slots. `where`: the container of
    the status box, the queue position and the bar (presentation.Controls.run_area: in
    presentation mode the sidebar under "Run live"); by default, where run_live is called.
    A press abandoned mid-run (a control changed, Streamlit reran the script) is said on the next
    run by last_result.
    Shows st.error (no traceback wall) for a bad config or a failed rank; returns None then."""
    attempts = st.session_state.setdefault(f"{page}_attempts", {})
    tag = json.dumps(key, sort_keys=True)
    if fresh:
        attempts[tag] = attempts.get(tag, 0) + 1
    try:
        queue = server_queue()
    except ValueError as err:  # a bad PARALLEL_MINI_MAX_RANKS: said in one line, nothing started
        st.error(f"The server's run queue is misconfigured: {err}")
        return None
    st.session_state[f"{page}_running"] = {"key": key, "label": label}
    box = st if where is None else where
    status = box.status(label, expanded=False)
    note, area = box.empty(), box.empty()  # outside the box: seen without opening it
    lease = _Lease(queue, ranks)
    error, details, result = None, None, None
    t0 = time.perf_counter()
    _LOCAL.lease = lease
    try:
        while True:
            try:
                if own_progress:
                    with area.container():
                        result = fn(*args, attempts.get(tag, 0))
                else:
                    bar = area.progress(0.0, text=step_text(1, 1, label))
                    result = fn(*args, attempts.get(tag, 0))
                    bar.progress(1.0, text=step_text(1, 1, "done"))
                break
            except WaitForSlots as ask:  # every slot taken: queue (a rerun leaves the queue)
                if not own_progress:
                    area.progress(0.0, text=step_text(
                        1, 1, f"waiting for {ask.ranks} rank processes…"))
                lease.wait(ask.ranks, lambda pos, waited: note.info(
                    _queue_note(queue, ask.ranks, pos, waited), icon="⏳"))
                note.empty()
    except ConfigError as err:
        error = f"Invalid settings: {err}"
    except RankError as err:
        error, details = rank_error_summary(err), err.details
    except Exception:  # a bug, shown by Streamlit as such: not an abandoned run
        st.session_state.pop(f"{page}_running", None)
        raise
    finally:  # also when Streamlit reruns mid-run: the slots go back at once
        _LOCAL.lease = None
        lease.release()
    st.session_state.pop(f"{page}_running", None)
    if error:
        status.update(label="The run did not complete", state="error")
        st.error(error)
        if details:
            with st.expander("Full output of the failed rank"):
                st.code(details)
        return None
    waited = (f", of which {lease.waited_s:.1f} s waiting for rank processes"
              if lease.waited_s >= 0.05 else "")
    alone = (f"; it ran alone ({lease.most} rank processes, more than this server's "
             f"{queue.bound})" if queue.oversize(lease.most) else "")
    status.update(label=f"{label.rstrip('…. ')}: done in {time.perf_counter() - t0:.1f} s{waited} "
                        f"(a cached result returns at once){alone}", state="complete")
    st.session_state[f"{page}_last"] = {"key": key, "result": result}
    return result


def _changed(old: dict, new: dict) -> str:
    diffs = [f"{k} {old.get(k)} → {new.get(k)}" for k in sorted(set(old) | set(new), key=str)
             if old.get(k) != new.get(k)]
    return ", ".join(diffs)


def last_result(page: str, key: dict):
    """(result, is_for_current_settings) of this page's last run, or (None, False).
    Says so first when this page's last press of "Run live" was abandoned before it finished."""
    abandoned = st.session_state.pop(f"{page}_running", None)
    if abandoned is not None:
        what = _changed(abandoned["key"], key)
        why = (f"when you changed {what}" if what else
               "when the page reran before it finished (a control changed or another page opened)")
        st.warning(f"The run “{abandoned['label'].rstrip('…. ')}” was abandoned {why}: it was not "
                   f"drawn, and the runs it had not started yet never started. Press **Run live** "
                   f"again.")
    last = st.session_state.get(f"{page}_last")
    if last is None:
        return None, False
    return last["result"], last["key"] == key


def fmt_count(b: float) -> str:
    """A byte count as the page shows it: whole numbers with separators, fractions with 2 decimals
    (theory's 2(N-1)/N * X is a fraction when N does not divide X)."""
    return f"{b:,.0f}" if float(b).is_integer() else f"{b:,.2f}"


def fmt_bytes(b: float) -> str:
    """Bytes in the binary unit the charts use (viz.units.bytes_unit), so a number on the page and
    the axis beside it agree; under 1 KiB the whole count."""
    div, unit = bytes_unit(abs(b))
    return f"{b:,.0f} B" if div == 1 else f"{b / div:.3f} {unit}"


def fmt_rate(b: float) -> str:
    """A bandwidth in the decimal unit the charts use (viz.units.rate_unit, NCCL's busbw units)."""
    div, unit = rate_unit(b)
    return f"{b / div:.3g} {unit}"


TOLERANCE = 1e-5  # fp32 losses and final parameters must equal the reference within this


def show_equality(report: dict) -> None:
    """The "same training as one process?" row every strategy page opens with."""
    st.subheader("Same training as one process?")
    diff = report["max_abs_diff"]
    m1, m2, m3 = st.columns(3)
    m1.metric("max |run − reference| (losses, final params)", f"{diff:.2e}",
              delta="equal within 1e-5" if diff <= TOLERANCE else "DIFFERENT",
              delta_color="normal" if diff <= TOLERANCE else "inverse")
    m2.metric("Final loss: this run", f"{report['losses'][-1]:.6f}")
    m3.metric("Final loss: reference", f"{report['reference_losses'][-1]:.6f}")
