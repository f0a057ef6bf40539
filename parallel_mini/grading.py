"""Exercise graders: run the learner's function on real ranks and compare it with the library's.

Each `check_*` returns a Grade. A stub that still raises NotImplementedError is "not attempted"
(shown, not raised, so the learner's notebook runs top to bottom); a wrong answer raises an
AssertionError that says what was observed; a right one returns the measured run so the lesson can
draw the learner's own result (e.g. animate their ring).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from . import theory
from .collectives import ring_experiment
from .config import RunConfig
from .launch import RankError


@dataclass
class Grade:
    status: str  # "not attempted" | "correct"
    message: str
    details: dict = field(default_factory=dict, repr=False)

    def __str__(self):
        return f"[{self.status}] {self.message}"

    def _repr_html_(self):
        colour = {"correct": "#1b7f3b", "not attempted": "#8a6d00"}.get(self.status, "#b00020")
        return (f'<div style="border-left:4px solid {colour};padding:4px 8px">'
                f'<b>{html.escape(self.status)}</b>: {html.escape(self.message)}</div>')


def _not_attempted(err: RankError) -> bool:
    return "NotImplementedError" in err.details


def _last_line(err: RankError) -> str:
    lines = [ln for ln in err.details.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else str(err)


def check_ring_all_reduce(fn, cases=((2, 5), (3, 10), (4, 16), (4, 17))) -> Grade:
    """`fn(x, comm)` must sum x in place over comm's "dp" ranks using only comm.sendrecv.

    Checked at each (world size, numel) in `cases`, sizes not divisible by N included: the result
    equals dist.all_reduce exactly on integers; the ring takes 2(N-1) steps; all ranks together
    send 2(N-1) * X bytes (each step moves every chunk once)."""
    exp = None
    for n, numel in cases:
        try:
            exp = ring_experiment(n, numel, impl=fn, repeats=1)
        except RankError as err:
            if _not_attempted(err):
                return Grade("not attempted", "ring_all_reduce still raises NotImplementedError: "
                             "fill in the two phases, then run this cell again.")
            raise AssertionError(f"at N={n}, numel={numel} rank {err.rank} failed: "
                                 f"{_last_line(err)}") from None
        if not exp["int_exact"]:
            raise AssertionError(f"at N={n}, numel={numel} the result differs from "
                                 f"dist.all_reduce (integers, so it must be exact). The animation "
                                 f"below shows which chunks ended incomplete.")
        if exp["steps_measured"] != theory.ring_steps(n):
            raise AssertionError(f"at N={n} each rank made {exp['steps_measured']} comm.sendrecv "
                                 f"calls; a ring all-reduce needs 2(N-1) = {theory.ring_steps(n)} "
                                 f"(use comm.sendrecv for every move so the run can be watched)")
        total = sum(exp["sent_bytes_per_rank"])
        if total != theory.ring_steps(n) * exp["nbytes"]:
            raise AssertionError(f"at N={n}, numel={numel} the ranks sent {total} bytes in all; "
                                 f"the ring sends 2(N-1)*X = {theory.ring_steps(n) * exp['nbytes']}")
    return Grade("correct", f"equal to dist.all_reduce at N,numel = {list(cases)}, in "
                 f"2(N-1) steps, sending 2(N-1)/N*X per rank on average", {"experiment": exp})


def check_average_gradients(fn, world_sizes=(2, 4), steps: int = 3) -> Grade:
    """`fn(params, comm)` must leave every p.grad equal to the mean over the "dp" ranks, using
    comm.all_reduce. Checked by training the tiny GPT with it in naive DP mode against the
    single-process reference, at each world size."""
    report = None
    for n in world_sizes:
        cfg = RunConfig(dp=n, dp_mode="naive", batch=2 * n, steps=steps, reference=True)
        try:
            from .engine import run  # late: engine imports the launcher stack
            report = run(cfg, average_fn=fn)
        except RankError as err:
            if _not_attempted(err):
                return Grade("not attempted", "average_gradients still raises "
                             "NotImplementedError: write it, then run this cell again.")
            raise AssertionError(f"at dp={n} rank {err.rank} failed: {_last_line(err)}") from None
        if report.max_abs_diff > 1e-5:
            ratio = ""
            if report.losses and report.reference_losses:
                ratio = (" (did every rank divide the summed gradient by the number of ranks?)")
            raise AssertionError(f"at dp={n} training differs from the single-process reference "
                                 f"by {report.max_abs_diff:.2e} (> 1e-5){ratio}")
        measured = report.wire_bytes_per_step().get("dp", 0)
        predicted = report.theory["wire_bytes_per_step"]["dp"]
        if measured != predicted:
            raise AssertionError(f"at dp={n} your averaging sent {measured:,.0f} bytes per step; "
                                 f"all-reducing every gradient once sends {predicted:,} "
                                 f"(use comm.all_reduce(p.grad, 'dp') so bytes are measured)")
    return Grade("correct", f"equal to the single-process reference (max |diff| "
                 f"{report.max_abs_diff:.1e}) at dp = {list(world_sizes)}, moving exactly "
                 f"2(N-1)/N x gradient bytes per step", {"report": report})
