"""Lesson 05 (05_pipeline): one rank's 1F1B op order, `check_one_f_one_b`.

The learner's order for every rank is checked in this process (each op once, no deadlock,
1F1B's warm-up and memory bound), then run on real ranks against the single-process reference.
The library's schedule builders raise while the learner's code runs.
"""
from __future__ import annotations

from ...config import RunConfig
import os
import random

from .core import _CodeSwapped, Grade, _call_in_time, _library_copy


def _parse_ops(ops, rank: int) -> list[list]:
    """["F0", "B0", ...] (or ("F", 0) pairs) -> [["F", 0], ...]."""
    if not isinstance(ops, (list, tuple)):
        raise AssertionError(f"rank {rank}: one_f_one_b returned {type(ops).__name__}; return a "
                             f"list of ops such as ['F0', 'F1', 'B0', ...]")
    out = []
    for op in ops:
        kind, micro = (op[0], op[1:]) if isinstance(op, str) else op
        if kind not in ("F", "B") or not str(micro).isdigit():
            raise AssertionError(f"rank {rank}: {op!r} is not an op; write 'F3' (forward of "
                                 f"micro-batch 3) or 'B3' (its backward)")
        out.append([kind, int(micro)])
    return out


def _library_schedule_refused(*args, **kwargs):
    """Swapped in for the code of the library's schedule builders while a learner's order is
    built (a literal message: the code object runs with the library module's globals)."""
    raise AssertionError("your one_f_one_b called one of the library's own schedules "
                         "(parallel_mini.parallel.schedules: one_f_one_b, build_schedule, "
                         "interleaved, ...), which the checker disables while your code runs: "
                         "write the warm-up, steady state and cool-down yourself")


class _LibrarySchedulesDisabled(_CodeSwapped):
    """While active, every schedule builder in parallel/schedules.py raises (their code objects
    swapped), so an order that wraps the library's 1F1B, by whatever name, is refused."""

    NAMES = ("naive", "gpipe", "one_f_one_b", "interleaved", "zero_bubble_h1", "zero_bubble_v",
             "build_schedule", "for_config")

    def swaps(self):
        from ...parallel import schedules
        return [(getattr(schedules, n), _library_schedule_refused) for n in self.NAMES]


def _fresh_cases(k: int = 3) -> list[tuple[int, int]]:
    """`k` (pp, m) pairs drawn anew every check (pp 2 to 16, m 1 to 64): beyond any the lesson
    shows, so that no table of orders can stand in for the rule."""
    rng = random.Random(os.urandom(8))
    return [(rng.randint(2, 16), rng.randint(1, 64)) for _ in range(k)]


def check_one_f_one_b(fn, cases=((2, 4), (4, 8), (4, 2)), run_cases=((2, 4), (4, 8)),
                      fresh: int = 3) -> Grade:
    """`fn(rank, pp, m)` returns one rank's 1F1B op order, e.g. ["F0", "F1", "B0", ...].

    Checked for every rank at each (pp, m) in `cases`: each F and B once, an order that cannot
    deadlock (schedules.check), 1F1B's warm-up (min(p - r, m) forwards before rank r's first
    backward: the naive order has 1) and its memory bound: rank r never holds more than p - r
    micro-batches (all-forward-then-all-backward would hold m). Then the order runs on real ranks
    at each of `run_cases` and must equal the single-process reference. While `fn` runs, the
    library's schedule builders (one_f_one_b, build_schedule, ...) raise: an order that wraps the
    library's 1F1B is refused, saying so, as is a function that is the library's (its code object,
    bytecode or source). `fresh` more (pp, m) pairs, drawn anew every check, are checked the same
    way (no table of orders can stand in for the rule), and each call of `fn` that does not
    return within 10 s stops the check with a message."""
    from ...runtime.launch import run
    from ...parallel.schedules import Op, from_ops, in_flight

    _library_copy(fn, ("parallel.schedules", "course.grading.lesson05_pipeline"), "your")
    orders = {}
    for pp, m in list(cases) + _fresh_cases(fresh):
        drawn = "" if (pp, m) in cases else " (drawn for this check, beyond the lesson's)"
        try:
            with _LibrarySchedulesDisabled():
                orders_here = _call_in_time(lambda: [fn(r, pp, m) for r in range(pp)],
                                            what=f"your one_f_one_b at pp={pp}, m={m}{drawn}")
            ops = [_parse_ops(o, r) for r, o in enumerate(orders_here)]
        except NotImplementedError:
            return Grade("not attempted", "one_f_one_b still raises NotImplementedError: write "
                                          "the warm-up, steady state and cool-down, then run this cell again.")
        try:
            schedule = from_ops([[Op(k, i, r) for k, i in rank_ops] for r, rank_ops in
                                 enumerate(ops)], m, "1f1b")
        except ValueError as e:
            raise AssertionError(f"at pp={pp}, m={m}: {e}") from None
        for r, rank_ops in enumerate(ops):
            before = next((i for i, (k, _) in enumerate(rank_ops) if k == "B"), len(rank_ops))
            if before != min(pp - r, m):
                raise AssertionError(f"at pp={pp}, m={m} rank {r} runs {before} forwards before its "
                                     f"first backward; 1F1B warms up with p - 1 - r = {pp - 1 - r} "
                                     f"and then starts with one more forward, so {min(pp - r, m)} "
                                     f"(fewer leaves the pipeline idle, more holds more memory)")
        held = in_flight(schedule)
        for r, h in enumerate(held):
            if h > min(pp - r, m):
                raise AssertionError(f"at pp={pp}, m={m} rank {r} holds {h} micro-batches at once; "
                                     f"1F1B holds at most p - r = {pp - r} (start backwards as soon "
                                     f"as the warm-up of p - 1 - r forwards is done)")
        orders[(pp, m)] = ops
    reports = {}
    for pp, m in run_cases:
        cfg = RunConfig(pp=pp, microbatches=m, batch=m, schedule="1f1b", steps=2, reference=True,
                        extra={"ops": orders[(pp, m)], "lesson": "05"})
        report = run(cfg)
        if report.max_abs_diff > 1e-5:
            raise AssertionError(f"at pp={pp}, m={m} training differs from the reference by "
                                 f"{report.max_abs_diff:.2e}")
        reports[(pp, m)] = report
    return Grade("correct", f"your 1F1B order runs on real ranks and equals the reference "
                            f"(max difference {max(r.max_abs_diff for r in reports.values()):.1e}) "
                            f"at " + ", ".join(f"pp={p} m={m}" for p, m in run_cases),
                 {"reports": reports, "orders": orders})
