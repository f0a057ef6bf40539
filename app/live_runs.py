"""What every page needs to run ranks live: shared results, the server's queue of rank processes,
visible progress, abandoned runs said, errors without tracebacks.

Pages run nothing on a rank themselves: they configure a run, call the library through the cached
wrappers here (launch.run, collectives.ring_experiment, experiments.tp_mlp_shards), and draw.

A class served at once. The result of every press of "Run live" is kept for the whole server, per
page and setting (`SHARED`: a page's results are sized by their bytes, so one page's big results
cannot evict another page's), with when and how long it was measured. Sessions asking for a
setting already measured read it (the status line says "taken from the cache: measured on this
machine at 09:31, in 3.2 s"); sessions asking at once for the same setting join one run (single
flight on the page and setting) instead of queueing their own. Every page's default setting is
measured once in the background as the server starts (`start_warmup`, from the first session's
first run: Streamlit runs no app code before; bounded by the queue like any session), so a class pressing "Run live" at the default controls reads it at once. "Fresh
measurement" measures again (and the new result replaces the old for everyone). The last result of
each page is also kept in the session, so moving a slider never starts ranks by itself: only
"Run live" does. Inside a press, the wrappers' own st.cache_data caches let a page's runs share
sub-runs.

Every run that is not in the cache first takes as many slots of the server's RunQueue
(run_queue.py) as it starts rank processes. One press of "Run live" holds its slots from its first
uncached run to its end, so a page that runs several configurations in a row queues once, for the
largest (`ranks=` of run_live). When the slots are taken, the page shows its place in the queue,
how long it has waited, and when it should start: replayed from the measured durations of similar
runs (the same page on as many ranks) of the runs ahead.
"""
from __future__ import annotations

import collections
import json
import os
import pickle
import statistics
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from parallel_mini.runtime import launch
from parallel_mini.course import collectives, experiments
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.runtime.launch import RankError
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

    def __init__(self, queue, ranks: int, est_s: float | None = None):
        self.queue, self.ranks, self.held, self.waited_s = queue, ranks, 0, 0.0
        self.est_s = est_s  # how long the press should hold its slots (measured similar runs)
        self.most = 0  # the most slots it held at once

    def cover(self, world: int) -> None:
        """Never waits: it runs inside a cached function, which holds st.cache_data's lock for its
        key (a session asking for the same run waits on it) and whose drawing would be replayed."""
        if self.held >= world:
            return
        need = max(self.ranks, world)
        self.release()  # a run bigger than announced: queue again for the bigger size
        if not self.queue.try_acquire(need, self.est_s):
            raise WaitForSlots(need)
        self.held = self.most = max(self.most, need)

    def wait(self, need: int, on_wait) -> None:
        self.waited_s += self.queue.acquire(need, on_wait, est_s=self.est_s)
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
    """launch.run on the RunConfig given as JSON; the report as a dict (cached per config)."""
    cfg = RunConfig.from_dict(json.loads(cfg_json))
    with rank_slots(cfg.world_size):
        report = launch.run(cfg)
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


# ---------------------------------------------------------------------------------------------
# the server's shared results: per page and setting, sized by bytes per page, one run per setting
# ---------------------------------------------------------------------------------------------
PAGE_BUDGET_BYTES = 64 * 2**20  # each page's results (pickled) are kept up to this many bytes


@st.cache_data(show_spinner=False)
def _cache_epoch() -> str:
    """A token that st.cache_data.clear() renews: SHARED is cleared with the caches it fronts."""
    return uuid.uuid4().hex


@dataclass
class Measured:
    """One press's result, as measured: pickled (every reader unpickles its own copy), when it
    finished (wall clock), how long its run took (waiting for slots excluded) and on how many
    rank processes, and by whom ("warm-up": the server's start, "session": a press)."""
    blob: bytes
    at: float
    took_s: float
    ranks: int
    by: str

    def result(self):
        return pickle.loads(self.blob)

    def when(self) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.at))


class _Flight:
    """A press being measured now: the sessions asking for the same page and setting wait on it."""

    def __init__(self, by: str):
        self.by, self.t0, self.done = by, time.monotonic(), threading.Event()
        self.entry: Measured | None = None
        self.error: tuple[str, str | None] | None = None  # (one line, the failed rank's output)


class SharedResults:
    """Every page's measured results for the whole server (see the module docstring)."""

    def __init__(self, budget_bytes: int = PAGE_BUDGET_BYTES):
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._pages: dict[str, collections.OrderedDict] = {}  # page -> tag -> Measured (LRU)
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._generation: dict[tuple[str, str], int] = {}  # "Fresh measurement" presses
        self._durations: dict[str, list[tuple[int, float]]] = {}  # page -> (ranks, took_s)
        self._epoch: str | None = None

    def _sync(self) -> None:  # under the lock
        epoch = _cache_epoch()
        if epoch != self._epoch:
            self._pages.clear(); self._generation.clear(); self._durations.clear()
            self._epoch = epoch

    def get(self, page: str, tag: str) -> Measured | None:
        with self._lock:
            self._sync()
            entries = self._pages.get(page)
            if entries is None or tag not in entries:
                return None
            entries.move_to_end(tag)
            return entries[tag]

    def bump(self, page: str, tag: str) -> int:
        """A fresh measurement of this setting: the next run may not read the wrappers' caches."""
        with self._lock:
            self._generation[page, tag] = self._generation.get((page, tag), 0) + 1
            return self._generation[page, tag]

    def generation(self, page: str, tag: str) -> int:
        with self._lock:
            return self._generation.get((page, tag), 0)

    def begin(self, page: str, tag: str, by: str) -> tuple[_Flight, bool]:
        """The run of this setting in flight, and whether the caller is to run it (the leader)."""
        with self._lock:
            flight = self._flights.get((page, tag))
            if flight is not None:
                return flight, False
            flight = self._flights[page, tag] = _Flight(by)
            return flight, True

    def finish(self, page: str, tag: str, flight: _Flight, result=None, took_s: float = 0.0,
               ranks: int = 0, error: tuple[str, str | None] | None = None) -> Measured | None:
        """The leader's end: its result kept (the page's oldest evicted beyond its byte budget,
        never the newest) or its error, handed to every session that joined it."""
        entry = None
        if error is None:
            entry = Measured(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), time.time(),
                             took_s, ranks, flight.by)
        with self._lock:
            self._sync()
            if entry is not None:
                entries = self._pages.setdefault(page, collections.OrderedDict())
                entries[tag] = entry
                entries.move_to_end(tag)
                while len(entries) > 1 and sum(len(e.blob) for e in entries.values()) > self.budget:
                    entries.popitem(last=False)
                if ranks:  # ranks ran: a measured duration (not one assembled from caches)
                    self._durations.setdefault(page, []).append((ranks, took_s))
            self._flights.pop((page, tag), None)
        flight.entry, flight.error = entry, error
        flight.done.set()
        return entry

    def abandon(self, page: str, tag: str, flight: _Flight) -> None:
        """The leader left mid-run (its session reran): the sessions that joined run it again."""
        with self._lock:
            self._flights.pop((page, tag), None)
        flight.done.set()

    def estimate(self, page: str, ranks: int) -> float | None:
        """How long a press of this page on `ranks` rank processes holds its slots: the median of
        the measured ones on as many ranks, else of the page's measured ones; None before any."""
        with self._lock:
            runs = self._durations.get(page, [])
            same = [t for r, t in runs if r == ranks] or [t for _, t in runs]
        return statistics.median(same) if same else None

    def bytes_by_page(self) -> dict[str, int]:
        with self._lock:
            return {page: sum(len(e.blob) for e in entries.values())
                    for page, entries in self._pages.items()}

    def clear(self) -> None:
        with self._lock:
            self._pages.clear(); self._generation.clear(); self._durations.clear()


SHARED = SharedResults()


def _queue_note(queue, need: int, position: int | None = None, waited_s: float = 0.0,
                wait_s: float | None = None) -> str:
    bound = f"this server runs at most {queue.bound} rank processes at once"
    expect = ("; no estimate yet (a run ahead has no measured similar run)" if wait_s is None else
              f"; expected to start in about {max(wait_s, 1):.0f} s (the runs ahead replayed from "
              f"measured durations of similar runs)")
    if queue.oversize(need):
        return (f"This run needs {need} rank processes, more than the {queue.bound} this server "
                f"runs at once: it will run alone, when the runs ahead of it have finished"
                + (f" (number {position} in the queue, waiting {waited_s:.0f} s so far{expect})."
                   if position else "."))
    return (f"Waiting for {need} rank processes: number {position} in the queue, "
            f"{waited_s:.0f} s so far{expect} ({bound}; other sessions are running).")


class _Warmed(BaseException):
    """Ends a warm-up run of a page script once its default press is measured: nothing to draw."""


def run_live(page: str, key: dict, label: str, fn, *args, fresh: bool = False, ranks: int = 1,
             own_progress: bool = False, where=None):
    """Run `fn(*args, attempt)` (or read its result, measured for this page and `key` by any
    session) and keep the result as this page's last one.

    `ranks`: the most rank processes the press starts at once (a page function that runs several
    configurations in a row: the largest). Its progress is drawn outside the collapsed status box:
    a bar, step 1 of 1, or, with `own_progress`, the StepBar `fn` draws itself (step i of n);
    above it the queue position while the press waits for rank slots, or that it joined the same
    run of another session. `where`: the container of the status box, the queue position and the
    bar (presentation.Controls.run_area: in presentation mode the sidebar under "Run live"); by
    default, where run_live is called. The status line says whether the result was measured now
    (and in how long) or taken from the cache (and when it was measured, and in how long).
    A press abandoned mid-run (a control changed, Streamlit reran the script) is said on the next
    run by last_result.
    Shows st.error (no traceback wall) for a bad config or a failed rank; returns None then."""
    tag = json.dumps(key, sort_keys=True)
    try:
        queue = server_queue()
    except ValueError as err:  # a bad PARALLEL_MINI_MAX_RANKS: said in one line, nothing started
        st.error(f"The server's run queue is misconfigured: {err}")
        return None
    warm_up = warming()
    st.session_state[f"{page}_running"] = {"key": key, "label": label}
    box = st if where is None else where
    status = box.status(label, expanded=False)
    note, area = box.empty(), box.empty()  # outside the box: seen without opening it
    t0 = time.perf_counter()
    name = label.rstrip("…. ")
    attempt = SHARED.bump(page, tag) if fresh else SHARED.generation(page, tag)
    entry = None if fresh else SHARED.get(page, tag)
    how = "cache"
    while entry is None:
        flight, leader = SHARED.begin(page, tag, "warm-up" if warm_up else "session")
        if leader:
            how = "now"
            entry, error, waited = _lead(page, tag, flight, queue, fn, args, attempt, ranks,
                                         own_progress, note, area)
            if error:
                st.session_state.pop(f"{page}_running", None)
                return _fail(status, *error)
            break
        shown = None
        while not flight.done.wait(0.25):  # another session measures this setting: join it
            so_far = int(time.monotonic() - flight.t0)
            if so_far != shown:  # a message a second, not four
                shown = so_far
                note.info(f"Another session is running these same settings: this page joined its "
                          f"run ({so_far} s so far) instead of queueing its own.",
                          icon=":material/group:")
        note.empty()
        if flight.error:
            st.session_state.pop(f"{page}_running", None)
            return _fail(status, *flight.error)
        entry, how = flight.entry, "joined"  # None: its session left mid-run; run it again
    st.session_state.pop(f"{page}_running", None)
    total = time.perf_counter() - t0
    if how == "now" and not entry.ranks:  # every run of the press was in the wrappers' caches
        said = "taken from the cache: its runs were measured earlier on this machine"
    elif how == "now":
        said = (f"measured now on this machine in {entry.took_s:.1f} s"
                + (f", after {waited:.1f} s waiting for rank processes" if waited >= 0.05 else ""))
    elif how == "joined":
        by = "the server's start-up run" if entry.by == "warm-up" else "another session's run"
        said = (f"measured now on this machine in {entry.took_s:.1f} s by {by}, "
                f"which this page joined")
    else:
        by = " by the server's start-up run" if entry.by == "warm-up" else ""
        said = (f"taken from the cache: measured on this machine at {entry.when()}{by}, "
                f"in {entry.took_s:.1f} s")
    alone = (f"; it ran alone ({entry.ranks} rank processes, more than this server's "
             f"{queue.bound})" if queue.oversize(entry.ranks) else "")
    if how != "now":  # the bar a run would have left, full
        area.progress(1.0, text=step_text(1, 1, "done"))
    status.update(label=f"{name}: done in {total:.1f} s, {said}{alone}", state="complete")
    result = entry.result()
    st.session_state[f"{page}_last"] = {"key": key, "result": result}
    if warm_up:
        raise _Warmed()
    return result


def _lead(page, tag, flight, queue, fn, args, attempt, ranks, own_progress, note, area):
    """Measure the press (the leader of its flight): (Measured, None, seconds waiting for rank
    processes) or (None, (error, details), seconds waiting)."""
    lease = _Lease(queue, ranks, SHARED.estimate(page, ranks))
    error = result = None
    _LOCAL.lease = lease
    try:
        while True:
            try:
                if own_progress:
                    with area.container():
                        result = fn(*args, attempt)
                else:
                    bar = area.progress(0.0, text=step_text(1, 1, "starting the ranks…"))
                    result = fn(*args, attempt)
                    bar.progress(1.0, text=step_text(1, 1, "done"))
                break
            except WaitForSlots as ask:  # every slot taken: queue (a rerun leaves the queue)
                if not own_progress:
                    area.progress(0.0, text=step_text(
                        1, 1, f"waiting for {ask.ranks} rank processes…"))
                lease.wait(ask.ranks, lambda pos, waited: note.info(
                    _queue_note(queue, ask.ranks, pos, waited, queue.estimate_wait()),
                    icon=":material/hourglass_top:"))
                note.empty()
    except ConfigError as err:
        error = (f"Invalid settings: {err}", None)
    except RankError as err:
        error = (rank_error_summary(err), err.details)
    except BaseException:  # a rerun mid-run, or a bug (shown by Streamlit as such)
        SHARED.abandon(page, tag, flight)
        raise
    finally:  # also when Streamlit reruns mid-run: the slots go back at once
        _LOCAL.lease = None
        lease.release()
    took = time.monotonic() - flight.t0 - lease.waited_s
    # lease.most: the rank slots the press took; 0 where every run was in the wrappers' caches
    entry = SHARED.finish(page, tag, flight, result, took, lease.most, error)
    return entry, error, lease.waited_s


def _fail(status, error: str, details: str | None):
    status.update(label="The run did not complete", state="error")
    st.error(error)
    if details:
        with st.expander("Full output of the failed rank"):
            st.code(details)
    if warming():
        raise _Warmed(error)
    return None


# ---------------------------------------------------------------------------------------------
# the warm-up: every page's default press, measured once in the background when the server starts
# ---------------------------------------------------------------------------------------------
WARM_ENV = "PARALLEL_MINI_WARM"  # "all" (unset), "none", or the url paths to warm: "ring,dp"
_WARM_LOCK = threading.Lock()
_WARM: dict[str, str] = {}  # page title -> "waiting" | "running" | "measured at 09:31:05 in 3.2 s"
_WARM_STARTED = False


def warming() -> bool:
    """True in the warm-up's thread: there a page's Run live counts as pressed
    (presentation.Controls.run_button asks), in every other thread the browser decides."""
    return getattr(_LOCAL, "warming", False)


def _is_real_server() -> bool:
    """A `streamlit run` server (AppTest runs the app on a mock runtime: no warm-up there)."""
    from streamlit.runtime import Runtime
    return Runtime.exists() and type(Runtime.instance()) is Runtime


def warm_pages(pages: list[tuple[str, str, str]], environ=os.environ) -> list[tuple[str, str, str]]:
    """The (title, url path, script) of `pages` that $PARALLEL_MINI_WARM asks to warm; a bad
    value raises ValueError naming the variable and the fix."""
    raw = environ.get(WARM_ENV, "all").strip() or "all"
    if raw == "all":
        return list(pages)
    if raw == "none":
        return []
    asked = [w.strip() for w in raw.split(",") if w.strip()]
    known = [url for _, url, _ in pages]
    unknown = [w for w in asked if w not in known]
    if unknown:
        raise ValueError(f"{WARM_ENV}={raw!r}: {', '.join(unknown)} is not a page; give 'all', "
                         f"'none' or some of {', '.join(known)}, comma-separated")
    return [p for p in pages if p[1] in asked]


def start_warmup(pages: list[tuple[str, str, str]], main_script: str) -> None:
    """Measure the default press of each of `pages` ((title, url path, script path)), one page
    after another, in one background thread of this server; idempotent (the entry script calls it
    on every run; the first run of the first session starts it). Each page's script runs as a
    session would run it, under a private script context (its own session state, so its controls
    take their defaults; nothing sent to any browser), with "Run live" pressed; run_live ends it
    once the press is measured. Its runs queue for rank slots like any session's."""
    global _WARM_STARTED
    if not _is_real_server():
        return
    todo = warm_pages(pages)
    with _WARM_LOCK:
        if _WARM_STARTED:
            return
        _WARM_STARTED = True
        _WARM.update({title: "waiting" for title, _, _ in todo})
    threading.Thread(target=_warm_all, args=(todo, main_script), daemon=True,
                     name="parallel_mini warm-up").start()


def _warm_launcher() -> None:
    """Start the launcher's forkserver (torch and the engine preloaded) before the first run, so
    that no run, the warm-up's first included, pays for it inside its ranks' rendezvous (seen: a
    cold 4-rank ring at load 19 timed out after 30 s waiting for its ranks)."""
    import multiprocessing.forkserver as forkserver

    from parallel_mini.runtime import launch
    if launch._context().get_start_method() == "forkserver":
        forkserver.ensure_running()


def _warm_all(todo, main_script: str) -> None:
    try:
        _warm_launcher()
    except Exception:  # noqa: BLE001 - the runs will start it themselves
        traceback.print_exc()
    for title, _, script in todo:
        with _WARM_LOCK:
            _WARM[title] = "running"
        t0, outcome = time.monotonic(), []
        # each page in a thread of its own: its own script context, as a session's script has
        page = threading.Thread(target=_warm_one, args=(script, main_script, outcome),
                                daemon=True, name=f"parallel_mini warm-up: {title}")
        page.start()
        page.join()
        err = outcome[0] if outcome else None
        if isinstance(err, _Warmed) and err.args:
            said = f"failed: {err.args[0]}"
        elif isinstance(err, _Warmed):
            said = f"measured at {time.strftime('%H:%M:%S')} in {time.monotonic() - t0:.1f} s"
        elif err is None:
            said = "not measured: the page did not press Run live"
        else:  # a page that fails: said on Home, the others still warm
            last = (str(err).strip().splitlines() or [""])[-1]
            said = f"failed: {type(err).__name__}: {last}"
            traceback.print_exception(err)  # the whole story in the server's log
        with _WARM_LOCK:
            _WARM[title] = said


def _warm_one(script: str, main_script: str, outcome: list) -> None:
    from streamlit.runtime.fragment import MemoryFragmentStorage
    from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager
    from streamlit.runtime.pages_manager import PagesManager
    from streamlit.runtime.scriptrunner_utils.script_run_context import (ScriptRunContext,
                                                                         add_script_run_ctx)
    from streamlit.runtime.state import SafeSessionState, SessionState

    ctx = ScriptRunContext(
        session_id=f"warm-up {uuid.uuid4().hex}", _enqueue=lambda msg: None, query_string="",
        session_state=SafeSessionState(SessionState(), lambda: None),
        uploaded_file_mgr=MemoryUploadedFileManager("/warm-up"), main_script_path=main_script,
        user_info={}, fragment_storage=MemoryFragmentStorage(),
        pages_manager=PagesManager(main_script))
    add_script_run_ctx(threading.current_thread(), ctx)
    ctx.reset()
    _LOCAL.warming = True
    try:
        # exec'd here, not by runpy: runpy swaps sys.modules["__main__"] and sys.argv for the
        # whole process while the page runs, and every rank started meanwhile re-ran the page
        code = compile(Path(script).read_text(), script, "exec")
        exec(code, {"__name__": "__warm_up__", "__file__": script, "__builtins__": __builtins__})
    except BaseException as err:  # _Warmed: measured; anything else: the page failed
        outcome.append(err)
    finally:
        _LOCAL.warming = False


def warm_states() -> dict[str, str]:
    """Each warmed page's title and where its default press stands (Home lists them)."""
    with _WARM_LOCK:
        return dict(_WARM)


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
        name = abandoned["label"].rstrip("…. ")
        st.warning(f"The run “{name}” was abandoned {why}: it was not "
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
