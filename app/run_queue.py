"""A bounded, first-come-first-served queue of rank processes for the whole app server.

Streamlit runs every session's script in its own thread of one server process; without a bound,
eight sessions asking for eight different 4-rank runs start 32 rank processes at once on a laptop's
2 cores and all of them crawl. Here every live run first asks the server's one `RunQueue` for as
many slots as it will start rank processes (its world size) and gives them back when its ranks
have exited. At most `bound` rank processes run at once (default: the machine's cores; set
`PARALLEL_MINI_MAX_RANKS` to change it). Requests are served in arrival order: a later small
request does not overtake an earlier big one (no starvation). A request bigger than the bound
(4 ranks on a 2-slot server) would wait forever; it runs alone instead, once everything ahead of it
has finished.

Every request may say how long it expects to hold its slots (`est_s`, from measured durations of
similar runs: live_runs.py keeps them); `estimate_wait()` then replays the queue (the holders'
remaining estimates, then every request ahead in arrival order) to say when a waiting request
should start, or None where one of those has no estimate.

Nothing here knows about Streamlit: a waiting request calls `on_wait(position, waited_s)` every
`poll_s` seconds, and whatever that callback raises (Streamlit's rerun when the learner changes a
control) takes the request out of the queue. The app's side is in live_runs.py.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from contextlib import contextmanager

ENV_BOUND = "PARALLEL_MINI_MAX_RANKS"


def cores() -> int:
    """The cores this server may use (its CPU affinity, which a container may narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def bound_from_env(environ=os.environ) -> int:
    """The server's bound on rank processes: $PARALLEL_MINI_MAX_RANKS, else the machine's cores."""
    raw = environ.get(ENV_BOUND, "").strip()
    if not raw:
        return cores()
    try:
        bound = int(raw)
    except ValueError:
        bound = 0
    if bound < 1:
        raise ValueError(f"{ENV_BOUND}={raw!r}: give a whole number of rank processes >= 1 "
                         f"(unset, it is this machine's {cores()} cores)")
    return bound


class RunQueue:
    """At most `bound` rank processes at once, granted in arrival order (see module docstring)."""

    def __init__(self, bound: int):
        if bound < 1:
            raise ValueError(f"bound must be >= 1 rank process, got {bound}")
        self.bound = bound
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()  # tickets, first come first
        self._ests: dict = {}  # ticket -> (ranks, est_s or None) of every waiting request
        self._holders: dict = {}  # thread id -> [(ranks, est_s or None, granted at)]
        self.in_use = 0        # slots held now (rank processes running or about to start)
        self.peak_in_use = 0   # the most slots ever held at once (tests read it)
        self.granted = 0       # requests served so far

    # -- asking -----------------------------------------------------------------------------
    def oversize(self, ranks: int) -> bool:
        """A request bigger than the bound: it runs alone rather than never."""
        return ranks > self.bound

    def _fits(self, ranks: int) -> bool:
        if self.oversize(ranks):
            return self.in_use == 0
        return self.in_use + ranks <= self.bound

    def _grant(self, ranks: int, est_s: float | None = None) -> None:
        self._holders.setdefault(threading.get_ident(), []).append(
            (ranks, est_s, time.monotonic()))
        self.in_use += ranks
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.granted += 1

    def try_acquire(self, ranks: int, est_s: float | None = None) -> bool:
        """Take `ranks` slots now if nobody is waiting and they are free; never waits."""
        with self._cond:
            if self._waiting or not self._fits(ranks):
                return False
            self._grant(ranks, est_s)
            return True

    def acquire(self, ranks: int, on_wait=None, poll_s: float = 0.5,
                est_s: float | None = None) -> float:
        """Wait for `ranks` slots in arrival order; returns the seconds waited. While waiting,
        `on_wait(position, waited_s)` is called every `poll_s` s (position 1 = next to run); if it
        raises, the request leaves the queue and the exception propagates. `est_s`: how long the
        request expects to hold its slots (for the estimates of those behind it)."""
        ticket = object()
        t0 = time.monotonic()
        with self._cond:
            self._waiting.append(ticket)
            self._ests[ticket] = (ranks, est_s)
        _LOCAL.ticket = ticket
        try:
            while True:
                with self._cond:
                    if self._waiting[0] is ticket and self._fits(ranks):
                        self._waiting.popleft()
                        self._ests.pop(ticket, None)
                        self._grant(ranks, est_s)
                        self._cond.notify_all()  # the next in line may fit beside us
                        _LOCAL.ticket = None
                        return time.monotonic() - t0
                    position = self._waiting.index(ticket) + 1
                if on_wait is not None:
                    on_wait(position, time.monotonic() - t0)  # outside the lock: it may draw
                with self._cond:  # the test again under the lock: no wake-up is lost
                    if not (self._waiting[0] is ticket and self._fits(ranks)):
                        self._cond.wait(poll_s)
        except BaseException:
            _LOCAL.ticket = None
            with self._cond:
                self._ests.pop(ticket, None)
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()  # the one behind us may be at the head now
            raise

    def release(self, ranks: int) -> None:
        """Give back `ranks` slots (held by this thread, or by another for it)."""
        with self._cond:
            # this thread's record of them (else, released for another thread: the oldest such)
            for tid in [threading.get_ident(), *self._holders]:
                held = self._holders.get(tid, [])
                match = [i for i, h in enumerate(held) if h[0] == ranks]
                if match:
                    del held[match[0]]
                    if not held:
                        del self._holders[tid]
                    break
            self.in_use -= ranks
            assert self.in_use >= 0, "released more rank slots than were taken"
            self._cond.notify_all()

    @contextmanager
    def slot(self, ranks: int, on_wait=None, poll_s: float = 0.5, est_s: float | None = None):
        """`with queue.slot(n): run n ranks`: acquire, run, release (also on an exception)."""
        self.acquire(ranks, on_wait, poll_s, est_s)
        try:
            yield
        finally:
            self.release(ranks)

    # -- looking ----------------------------------------------------------------------------
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def estimate_wait(self, ticket=None, now: float | None = None) -> float | None:
        """Seconds until the waiting request `ticket` (by default this thread's) should start:
        the queue replayed first come first served from the holders' remaining estimates (an
        overrun one: due now) and the estimates of the requests ahead. None where the request is
        not waiting or one of those has no estimate. `now`: a time.monotonic() reading."""
        ticket = ticket if ticket is not None else getattr(_LOCAL, "ticket", None)
        now = time.monotonic() if now is None else now
        with self._cond:
            if ticket not in self._ests:
                return None
            running = [(max(t0 + est - now, 0.0), ranks) if est is not None else None
                       for held in self._holders.values() for ranks, est, t0 in held]
            order = list(self._waiting)
            ahead = [self._ests[t] for t in order[:order.index(ticket) + 1]]
        if None in running or any(est is None for _, est in ahead):
            return None
        t = 0.0
        for ranks, est in ahead:  # each in turn starts when it fits (an oversize one: alone)
            while running and (ranks > self.bound
                               or sum(r for _, r in running) + ranks > self.bound):
                t = max(t, min(e for e, _ in running))
                running = [(e, r) for e, r in running if e > t]
            running.append((t + est, ranks))
        return t


_LOCAL = threading.local()  # the ticket this thread waits with, if any
_SERVER_QUEUE: RunQueue | None = None
_SERVER_LOCK = threading.Lock()


def server_queue() -> RunQueue:
    """The one queue of this server process, made on first use with `bound_from_env()`."""
    global _SERVER_QUEUE
    with _SERVER_LOCK:
        if _SERVER_QUEUE is None:
            _SERVER_QUEUE = RunQueue(bound_from_env())
        return _SERVER_QUEUE
