"""`%%ranks N`: run a notebook cell on N real ranks and show what each one printed, side by side.

    %load_ext parallel_mini.course.magic

    %%ranks 4
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    print(f"rank {rank} of {world_size}: sum = {x.item()}")

Every rank runs the cell in a fresh namespace that already holds `rank`, `world_size`, `torch`,
`dist` (torch.distributed, process group initialised) and `comm` (a recorded `Comm` over a pure
data-parallel mesh of N ranks; axis "dp"). Every other name the cell uses that the notebook defines
(functions, classes, values, imported modules) is copied to the ranks with cloudpickle, by value: a
function written in one cell runs on the ranks in the next, and what a rank changes stays on that
rank. Options: `--timeout S` (default 20 s; a rank waits at most half of it in one collective or recv,
so a deadlock ends within 10 s with the cell line each waiting rank was stuck on); `--backend gloo|nccl`
(default gloo, so that cells written with CPU tensors run anywhere; with nccl, put tensors on
`torch.device("cuda", torch.cuda.current_device())`).

A rank that raises does not take the kernel down: the panels show every rank's output and the
failing rank's traceback, and the cell ends with a one-line error so "run all" stops there.

`run_cell(source, n)` is the same thing without IPython (tests, scripts): it returns the list of
per-rank outputs, or raises `launch.RankError`.

IPython is imported lazily: this module is also what runs *inside* each rank.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import linecache
import re
import shlex
import sys
import traceback
import types

import cloudpickle

from ..runtime.launch import RankError, RunTimeout, run_ranks

CELL_FILENAME = "<%%ranks cell>"
DEFAULT_TIMEOUT_S = 20.0  # a cell's run; a deadlock stops after half of it (pg_timeout_for)
PROVIDED = ("rank", "world_size", "torch", "dist", "comm")
MAX_SHIP_BYTES = 64 * 2 ** 20  # a notebook value bigger than this is not copied to every rank


# ---------------------------------------------------------------------------------------------
# inside a rank
# ---------------------------------------------------------------------------------------------
def _exec_on_rank(source: str, shipped: dict) -> None:
    import torch
    import torch.distributed as dist

    from ..comm import Comm
    from ..config import RunConfig
    from ..mesh import build_mesh

    n = dist.get_world_size()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))  # axis "dp" spans all n ranks
    ns = {"__name__": "__ranks__", "__builtins__": __builtins__}
    ns.update(shipped)
    ns.update(rank=dist.get_rank(), world_size=n, torch=torch, dist=dist, comm=comm)
    # Register the source so a traceback shows the learner's own lines, not just line numbers.
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    code = compile(source, CELL_FILENAME, "exec")
    with contextlib.redirect_stderr(sys.stdout):  # warnings land in the rank's panel too
        exec(code, ns)


# ---------------------------------------------------------------------------------------------
# in the notebook
# ---------------------------------------------------------------------------------------------
def _names_used(code: types.CodeType) -> set[str]:
    """Every global name a code object (or any function/class nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def shippable(source: str, user_ns: dict) -> tuple[dict, dict]:
    """What the ranks get from the notebook: every name the cell uses that the notebook defines
    (functions, classes, values, modules), except the names the ranks provide themselves.
    Returns ({name: obj} to send, {name: reason} for those that cannot be sent)."""
    try:
        wanted = _names_used(compile(source, CELL_FILENAME, "exec"))
    except SyntaxError:
        return {}, {}  # reported before any rank starts
    ok, skipped = {}, {}
    for name in sorted(wanted - set(PROVIDED)):
        if name not in user_ns or name.startswith("_"):
            continue
        obj = user_ns[name]
        if isinstance(obj, types.ModuleType):
            ok[name] = obj  # pickled by reference: the rank imports it
            continue
        try:
            size = len(cloudpickle.dumps(obj))
        except Exception as err:  # noqa: BLE001 - anything unpicklable is reported, not fatal
            skipped[name] = f"cannot be pickled: {type(err).__name__}: {err}"
            continue
        if size > MAX_SHIP_BYTES:
            skipped[name] = (f"{size / 2 ** 20:.0f} MiB once pickled; create it inside the cell "
                             f"instead")
            continue
        ok[name] = obj
    return ok, skipped


def run_cell(source: str, n: int, user_ns: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S,
             backend: str = "gloo") -> list[str]:
    """Run `source` on n ranks; returns what each rank printed (index = rank)."""
    shipped, _ = shippable(source, user_ns or {})
    results = run_ranks(_exec_on_rank, n, source, shipped, timeout=timeout,
                        pg_timeout=pg_timeout_for(timeout), backend=backend)
    return [r.output for r in results]


class RanksOutput:
    """Per-rank panels: HTML columns in Jupyter, labelled blocks as plain text."""

    def __init__(self, outputs: list[str], failed: int | None = None, details: str = "",
                 notes: list[str] | None = None):
        self.outputs, self.failed, self.details, self.notes = outputs, failed, details, notes or []

    def _body(self, r: int) -> str:
        text = self.outputs[r] if r < len(self.outputs) else ""
        if r == self.failed:
            text = (text + ("\n" if text and not text.endswith("\n") else "")
                    + _trim_traceback(self.details))
        return text

    def __repr__(self) -> str:
        parts = [f"note: {note}" for note in self.notes]
        for r in range(len(self.outputs)):
            label = f"rank {r}" + (" (failed)" if r == self.failed else "")
            parts.append(f"--- {label} ---")
            body = self._body(r).rstrip("\n")
            parts.append(body if body else "(no output)")
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        cols = []
        for r in range(len(self.outputs)):
            bad = r == self.failed
            border = "#b00020" if bad else "#999"
            head = f"rank {r}" + (" &mdash; failed" if bad else "")
            body = html.escape(self._body(r)) or '<span style="color:#888">(no output)</span>'
            cols.append(
                f'<div style="flex:1 1 0;min-width:12em;border:1px solid {border};'
                f'border-radius:4px;overflow:auto">'
                f'<div style="background:{"#fde7ea" if bad else "#f0f0f0"};padding:2px 6px;'
                f'font-weight:bold">{head}</div>'
                f'<pre style="margin:0;padding:4px 6px;white-space:pre-wrap;'
                f'{"color:#b00020;" if bad else ""}">{body}</pre></div>')
        notes = "".join(f'<div style="color:#8a6d00">note: {html.escape(n)}</div>'
                        for n in self.notes)
        return f'{notes}<div style="display:flex;gap:6px;align-items:stretch">{"".join(cols)}</div>'


def _trim_traceback(details: str) -> str:
    """Keep the learner's frames: drop the launcher's own frames above the cell."""
    lines = details.rstrip("\n").splitlines()
    for i, line in enumerate(lines):
        if CELL_FILENAME in line:
            return "Traceback (most recent call last):\n" + "\n".join(lines[i:])
    return "\n".join(lines)


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print to stderr and exit the kernel's thread
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("n", type=int, help="number of ranks")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds before a run is killed")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    return p


def ranks(line: str, cell: str):
    """%%ranks N [--timeout S] [--backend gloo|nccl]: run this cell on N ranks (module docstring)."""
    from IPython import get_ipython
    from IPython.core.error import UsageError
    from IPython.display import display

    try:
        args = _parser().parse_args(shlex.split(line))
    except _ArgError as err:
        raise UsageError(f"{err}. Usage: %%ranks N [--timeout S] [--backend gloo|nccl], "
                         f"e.g. %%ranks 4") from None
    try:  # a typo is reported here, once, instead of by every rank
        compile(cell, CELL_FILENAME, "exec")
    except SyntaxError as err:
        msg = "".join(traceback.format_exception_only(type(err), err)).rstrip()
        raise UsageError(f"the cell does not parse, so no rank was started:\n{msg}") from None
    ip = get_ipython()
    shipped, skipped = shippable(cell, ip.user_ns if ip is not None else {})
    notes = [f"{name} was not sent to the ranks ({why})" for name, why in skipped.items()]
    try:
        results = run_ranks(_exec_on_rank, args.n, cell, shipped, timeout=args.timeout,
                            pg_timeout=pg_timeout_for(args.timeout), backend=args.backend)
    except ValueError as err:  # e.g. a world size beyond what runs locally
        raise UsageError(str(err)) from None
    except RankError as err:
        outputs = list(err.outputs) + [""] * (args.n - len(err.outputs))
        display(RanksOutput(outputs, err.rank, err.details, notes))
        raise UsageError(failure_message(err, cell, pg_timeout_for(args.timeout))) from None
    display(RanksOutput([r.output for r in results], notes=notes))


def pg_timeout_for(timeout: float) -> float:
    """How long a rank waits in one collective or recv: half the run's time (at most 30 s), so
    that a deadlock ends with the waiting rank's own traceback (which names the cell line) before
    the launcher's timeout kills every rank."""
    return min(timeout / 2, 30.0)


def _cell_line(details: str, cell: str) -> str:
    """' at line n of the cell (its source)': the last line of the cell a rank's traceback names."""
    found = re.findall(r'File "' + re.escape(CELL_FILENAME) + r'", line (\d+)', details)
    if not found:
        return ""
    n, lines = int(found[-1]), cell.splitlines()
    source = f" ({lines[n - 1].strip()})" if 0 < n <= len(lines) else ""
    return f" at line {n} of the cell{source}"


def failure_message(err: RankError, cell: str, pg_timeout: float) -> str:
    """One line for a failed cell: the failing rank's exception, and where a rank waited in vain
    the cell line it waited on and the likely mismatch, instead of gloo's own words."""
    details = str(err.details)
    last = [ln for ln in details.strip().splitlines() if ln.strip()]
    if isinstance(err, RunTimeout):  # the launcher's own sentence: idle or still computing
        return str(err.details)
    if "Timed out" in details or "timed out" in details:
        return (f"rank {err.rank} waited {pg_timeout:g} s{_cell_line(details, cell)} for peers "
                f"that never joined: most likely a deadlock. Every send needs a matching recv on "
                f"its peer, and every collective a call on every rank of its group, in the same "
                f"order (print rank and the op before each call to see who waits on what)")
    if "Connection reset by peer" in details or "Connection closed by peer" in details:
        return (f"rank {err.rank}{_cell_line(details, cell)} lost its peer: a peer finished or "
                f"failed while this rank was still waiting for it (every send needs a matching "
                f"recv, every collective a call on every rank)")
    return f"rank {err.rank} failed: {last[-1] if last else err}"


def load_ipython_extension(ip) -> None:
    ip.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
