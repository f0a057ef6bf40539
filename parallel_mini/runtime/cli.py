"""Command line: `python -m parallel_mini run --dp 4 --reference --json -` (see DESIGN.md's run contract).

Every RunConfig field is a flag (`--d-model`, `--bucket-mb`, ...). A bad value prints one line naming
the field and the fix and exits 2 before any rank starts, without importing torch (config.py,
preflight.py); a failed run prints the failing rank's error and exits 1 (a run that diverged, or
a report that could not be written after the run: one line); a run stopped by SIGINT, SIGTERM or
SIGHUP ends every rank, says so in one line and exits 128 + the signal's number. Under torchrun every rank runs this and rank 0 prints the report.

runtime/ imports nothing from course/: parallel_mini/__main__.py, the door, hands this module the
course's parts (`CourseParts`: the `plan` verb, a run's bubble in the summary, the --trace file).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
from typing import Callable

from . import preflight
from ..config import BIGGEST, ConfigError, GPTConfig, RunConfig, under_torchrun

_HELP = {
    "dp": "data-parallel degree", "tp": "tensor-parallel degree", "pp": "pipeline stages",
    "cp": "context-parallel degree (sequences split over cp ranks)", "ep": "expert-parallel degree",
    "cp_impl": "context parallel: ring (K/V blocks around a ring), zigzag (ring, causal load balanced), ulysses (all-to-all to heads)",
    "dp_mode": "naive: all-reduce each gradient after backward; bucketed: overlap with backward",
    "bucket_mb": "bucket size in MB for --dp-mode bucketed", "grad_accum": "micro-steps per step",
    "batch": "global batch (sequences per step)", "steps": "optimizer steps",
    "schedule": "pipeline schedule: naive, gpipe, 1f1b, interleaved, zb, zbv, dualpipev, dualpipe "
                "(bidirectional, every stage on two ranks), pipedream, pipedream-nostash",
    "microbatches": "micro-batches per step with --pp > 1",
    "virtual_stages": "model chunks per pipeline rank (interleaved); 0 = the schedule's default",
    "timeout_s": "seconds the run may take before its ranks are stopped",
    "sync_every": "local SGD: each dp rank takes H optimizer steps alone, then the parameters are "
                  "averaged over dp (0: data parallel, gradients averaged every step)",
    "sync_optimizer": "local SGD: average the optimizer's states with the parameters",
    "federated": "federated averaging: K clients with their own data on the dp ranks; each round "
                 "C sampled clients train --local-steps steps, the server averages their weights",
    "clients": "federated: K clients", "clients_per_round": "federated: C clients sampled per round "
    "(0: all)", "local_steps": "federated: E local optimizer steps per sampled client and round",
    "rounds": "federated: R rounds (0: --steps)", "non_iid": "federated: A, how far each client's "
    "mixture of topics leans to its own (0: all the same)",
    "save": "save a distributed checkpoint (sharded, every rank its part) into this directory "
            "after the last step",
    "resume": "continue from the checkpoint in this --save directory up to --steps (any layout; "
              "without --layers, the checkpoint's). Given the same DIR as --save, a DIR that holds "
              "no checkpoint yet (no DIR/latest) starts from step 0: the first launch of a job "
              "that torchrun --max-restarts may restart",
    "asynchronous": "asynchronous SGD: rank 0 a parameter server, ranks 1..dp-1 workers that "
                    "pull, compute and push (parallel/async_ps.py)",
    "max_staleness": "with --async: a worker runs at most K steps ahead of the slowest (0: a "
                     "barrier every step; -1: no bound)",
    "straggler": "RANK:FACTOR: that rank's forward and backward take FACTOR times as long (a "
                 "real sleep), with --dp or --async",
    "save_every": "with --save: also save a checkpoint every K steps (atomic; a run killed at any "
                  "moment resumes from the newest complete one)",
    "no_prefetch": "ZeRO-3: gather one unit at a time (by default the next unit's all-gather is "
                   "on the wire while this one computes, two units gathered at once)",
    "keep": "with --save: keep the newest N checkpoints in the directory, prune older ones",
}
_ALIASES = {"asynchronous": ("--async", "--asynchronous")}  # a Python keyword cannot name a field


@dataclasses.dataclass(frozen=True)
class CourseParts:
    """What the command line offers of the course (parallel_mini/__main__.py builds it); without
    it, `run` works, with neither `plan` nor --trace nor the bubble in its summary."""
    add_plan_parser: Callable  # adds the `plan` verb to the sub-parsers (course/planner.py)
    plan: Callable  # runs it: plan(args, given) -> exit status
    summary: Callable  # a run's course lines, its bubble: summary(report) -> list[str] (course/trace.py)
    write_trace: Callable  # --trace PATH: write_trace(report, path) (course/timelines.py)


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints a usage block before its error; the run contract is one line naming the
    field (sub-commands inherit this class)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def _parser(explicit: bool = False, course: CourseParts | None = None) -> argparse.ArgumentParser:
    """`explicit`: every default suppressed, so that parsing tells which flags were given."""
    ap = _OneLineParser(prog="parallel-mini", description=__doc__.splitlines()[0],
                        argument_default=argparse.SUPPRESS if explicit else None)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the tiny GPT on N ranks and report what was measured")
    model = {f.name for f in dataclasses.fields(GPTConfig)}
    own = [f for f in dataclasses.fields(RunConfig) if f.name not in model]
    at = next(i for i, f in enumerate(own) if f.name == "batch")  # layout, model, training, run
    for f in own[:at] + [f for f in dataclasses.fields(RunConfig) if f.name in model] + own[at:]:
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = _ALIASES.get(f.name, (flag,))
        if f.type in ("bool", bool):
            run.add_argument(*flags, dest=f.name, action="store_true", help="compare with the single-process reference"
                             if f.name == "reference" else _HELP.get(f.name),
                             **({"default": argparse.SUPPRESS} if explicit else {}))
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            default = None if f.name in ("layers", "steps") else f.default  # _pipeline_defaults
            run.add_argument(*flags, dest=f.name, type=typ, default=argparse.SUPPRESS if explicit else default,
                             help=_HELP.get(f.name))
    run.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH ('-' = stdout)")
    run.add_argument("--progress", action="store_true", help="print each step's loss to stderr")
    if course is None:
        return ap
    run.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of every op "
                     "and transfer (open in ui.perfetto.dev or chrome://tracing)")
    plan = course.add_plan_parser(sub)  # `plan`: ranked layouts, theory only
    if explicit:
        for action in plan._actions:
            action.default = argparse.SUPPRESS
    return ap


def _summary(report, course: CourseParts | None = None) -> str:
    lines = [f"world size {report.world_size}  losses " + " ".join(f"{x:.4f}" for x in report.losses)]
    if report.max_abs_diff is not None:
        lines.append(f"max |ours - reference| = {report.max_abs_diff:.2e} "
                     f"(losses {report.max_abs_diff_detail['losses']:.1e}, "
                     f"params {report.max_abs_diff_detail['params']:.1e})")
    model, predicted = report.wire_bytes_per_step(), report.theory["wire_bytes_per_step"]
    written = report.wire_bytes_per_step(kind="measured")
    shared = report.wire_groups_apportioned()
    for group, pred in predicted.items():
        w = written.get(group, 0)
        lines.append(f"wire bytes/step on {group}: theory {pred:,.0f}  ring model of the ops run "
                     f"{model.get(group, 0):,.0f}  written to sockets "
                     + ("(not measurable here)" if w is None else f"{w:,.0f} (measured" + (
                         ", overlapping ops of other groups: split by model bytes)" if group in shared
                         else ")")))
    if report.config.get("ep", 1) > 1:
        lines.append(f"all-to-all bytes/step (expert parallel, rank 0): routed "
                     f"{report.moe_wire_bytes_per_step():,.0f}  uniform-routing formula "
                     f"{report.theory['ep_all_to_all_uniform']:,.0f}")
    if report.config.get("experts"):
        log = [e for e in report.ranks[0].get("moe", {}).get("log", []) if e["step"] == report.config["steps"] - 1]
        if log:
            lines.append(f"experts (rank 0, last step): tokens routed per expert "
                         f"{[sum(x) for x in zip(*(e['routed'] for e in log))]}, dropped "
                         f"{sum(e['dropped'] for e in log)}, aux loss "
                         f"{sum(e['aux'] for e in log) / len(log):.4f}")
    if "async" in report.extra:  # parallel/async_ps.py: counted from the server's records
        a = report.extra["async"]
        lines.append(f"async: {len(a['updates'])} updates, {a['updates_per_s']:.1f}/s (measured); "
                     f"per worker {a['updates_per_worker']}; staleness histogram "
                     f"{a['staleness_histogram']}, mean {a['staleness_mean']:.2f} (theory "
                     f"{a['theory']['mean']})")
    if course is not None:  # (a pipeline's bubble: course/trace.py)
        lines += course.summary(report)
    if "local_sgd" in report.extra:  # ranks that train apart (parallel/local_sgd.py)
        ls = report.extra["local_sgd"]
        lines.append(f"local SGD: {ls['averages']} averages of the weights over dp (every "
                     f"H = {ls['sync_every']} steps, and after the last)")
    if "federated" in report.extra:  # (parallel/federated.py)
        fed, last = report.extra["federated"], report.extra["federated"]["rounds"][-1]
        drift = sum(last["drift"].values()) / max(1, len(last["drift"]))
        lines.append(f"federated: {fed['clients_per_round']} of {fed['clients']} clients a round, "
                     f"{fed['local_steps']} local step(s) each; last round: union loss "
                     f"{last['union_loss']:.4f}, mean client drift {drift:.4f}; bytes of client "
                     f"data sent (counted) {sum(n['data_bytes_sent'] for n in fed['network'])}")
    m = report.ranks[0]["memory"]
    lines.append("rank 0 memory (bytes): " + "  ".join(f"{k} {v:,}" for k, v in m.items()))
    if "disk" in report.ranks[0]:  # --offload-disk: the last step's bytes to and from the file
        io = [r for r in report.ranks[0]["disk"]["io"] if isinstance(r["step"], int)][-1]
        got = io["measured"] or {}
        lines.append(f"rank 0 disk, last step: read {io['read']:,} written {io['written']:,} bytes "
                     f"(counted; theory {report.theory.get('disk_io_per_step', {})}); /proc "
                     f"measured: rchar {got.get('rchar')} wchar {got.get('wchar')} read_bytes "
                     f"{got.get('read_bytes')} write_bytes {got.get('write_bytes')}")
    return "\n".join(lines)


def _pipeline_defaults(values: dict) -> str:
    """Without --layers and --steps: RunConfig's 4 layers and 3 steps, or, for a pipeline,
    schedules.BLOCKS_PER_CHUNK blocks in every chunk (the embeddings and the head then weigh
    little beside a stage's blocks) and schedules.PIPELINE_STEPS steps (the bubble's op costs
    come from 4 timed steps); returns the note to print once the run is accepted."""
    chosen = []
    if values["layers"] is None and values.get("resume"):  # the checkpoint's model, any layout
        values["layers"] = preflight.saved_layers(values["resume"])
    if 1 < values["pp"] <= BIGGEST and 0 <= values["virtual_stages"] <= BIGGEST:  # (else refused next)
        from ..config import virtual_stages
        from ..parallel.schedules import BLOCKS_PER_CHUNK, PIPELINE_STEPS, pipeline_layers
        if values["layers"] is None:
            v = virtual_stages(values["schedule"], values["virtual_stages"])
            values["layers"] = pipeline_layers(values["pp"], v)
            chosen.append(f"--layers {values['layers']}")
        if values["steps"] is None:
            values["steps"] = PIPELINE_STEPS
            chosen.append(f"--steps {PIPELINE_STEPS}")
    note = ""
    if chosen:
        note = (f"note: {' '.join(chosen)} (a pipeline's defaults: {BLOCKS_PER_CHUNK} blocks per "
                f"chunk, {PIPELINE_STEPS - 2} timed steps; give them to choose)")
    for name in ("layers", "steps"):
        if values[name] is None:
            values[name] = getattr(RunConfig, name)
    return note


def _write_stdout(text: str) -> None:
    """All of `text` on stdout, even when it is a pipe whose reader is slow. The ranks' processes
    share that pipe (and its file status flags) with this one; twice in ~80 runs of
    `run --json - | python -c ...` the report arrived cut after a multiple of 4 KiB, as a write to a
    pipe in non-blocking mode cuts it. So: blocking mode, and a loop over partial writes."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError):  # not a file (a test's capture, a notebook)
        sys.stdout.write(text)
        return
    os.set_blocking(fd, True)
    data = memoryview(text.encode())
    while data:
        data = data[os.write(fd, data):]


# Flags that only one kind of layout reads: given without it, they would be silently ignored.
IGNORED_UNLESS = {
    ("schedule", "microbatches", "virtual_stages"):
        (lambda c: c.pp > 1, "a pipeline reads", "add --pp 2 or more"),
    ("cp_impl",): (lambda c: c.cp > 1, "context parallel reads", "add --cp 2 or more"),
    ("top_k", "capacity_factor", "moe_every", "aux_loss_weight", "z_loss_weight"):
        (lambda c: c.experts > 0, "a mixture-of-experts model reads", "add --experts E"),
    ("save_every", "keep"): (lambda c: bool(c.save), "a run with --save reads", "add --save DIR"),
    ("bucket_mb",): (lambda c: c.zero == 0 and c.dp_mode == "bucketed" and not c.sync_every
                     and not c.federated, "bucketed data parallel reads",
                     "ZeRO, --dp-mode naive, local SGD and federated averaging do not bucket"),
    ("clients", "clients_per_round", "local_steps", "rounds", "non_iid"):
        (lambda c: c.federated, "federated averaging reads", "add --federated"),
    ("steps",): (lambda c: not (c.federated and c.rounds), "a run without --rounds reads",
                 "a federated run trains --rounds rounds"),
    ("dp_mode", "bucket_mb"): (lambda c: not c.asynchronous, "synchronous data parallel reads",
                               "--async pushes each gradient to the server whole"),
}


def _refuse_ignored(given: set[str], cfg: RunConfig) -> None:
    for names, (applies, who, fix) in IGNORED_UNLESS.items():
        ignored = [n for n in names if n in given]
        if ignored and not applies(cfg):
            flags = " ".join(f"--{n.replace('_', '-')}" for n in ignored)
            it = "it" if len(ignored) == 1 else "them"
            raise ConfigError(f"{flags}: this run would ignore {it}; only {who} {it} ({fix})")


def _refuse_empty(given: set[str], args) -> None:
    """An empty --save/--resume would mean "none" (RunConfig's default) and be silently ignored;
    a trace is a file to open in a viewer, not a stream."""
    for name in ("save", "resume"):
        if name in given and not getattr(args, name):
            raise ConfigError(f"--{name} '': give a directory name")
    if "save_every" in given and args.save_every == 0:  # (0 is the default's "last step only")
        raise ConfigError("--save-every 0: give K >= 1 (a checkpoint every K steps); without "
                          "--save-every, --save writes one after the last step")
    if args.trace == "-":
        raise ConfigError("--trace -: a trace is a file to open in ui.perfetto.dev, not a stream; "
                          "give a file name")


def _check_backend(cfg: RunConfig) -> None:
    """--backend nccl needs NCCL and, for local ranks, a GPU per rank (NCCL refuses two ranks on one
    GPU); without them every rank failed inside init_process_group with a traceback."""
    if cfg.backend != "nccl":
        return
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ConfigError("--backend nccl: this machine has no GPU with NCCL; use --backend gloo "
                          "(CPU) or auto")
    if not under_torchrun() and cfg.world_size > torch.cuda.device_count():
        raise ConfigError(f"--backend nccl: {cfg.world_size} local ranks need a GPU each and "
                          f"{torch.cuda.device_count()} are here; use --backend gloo or auto")


# A rank's error that is a fault met while running, not a bug: its one line, not its traceback.
ONE_LINE_FAULTS = ("FloatingPointError", "parallel_mini.runtime.checkpoint.CheckpointSaveError",
                   "parallel_mini.runtime.preflight.CheckpointError")


class _Stopped(KeyboardInterrupt):
    """A stop signal during a run, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that
    the launcher's cleanup (every rank killed and joined) runs for SIGTERM and SIGHUP too; Python's
    default for those ends the process on the spot and left the ranks running."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


@contextlib.contextmanager
def _stop_signals_end_the_run():
    """Under torchrun the agent stops its workers itself (SIGTERM, then SIGKILL): left as it is.
    Signal handlers can only be set from the main thread (a caller may run `main` elsewhere). A
    signal the process was told to ignore stays ignored (`nohup` ignores SIGHUP, a shell's
    background job SIGINT): a closed terminal must not stop a run started with nohup."""
    if under_torchrun() or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Stopped(signum)

    saved = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
             if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def main(argv=None, course: CourseParts | None = None) -> int:
    args = _parser(course=course).parse_args(argv)
    given = set(vars(_parser(explicit=True, course=course).parse_args(argv)))  # flags written out
    if args.command == "plan":  # theory only: no RunConfig, no ranks
        return course.plan(args, given)
    args.trace = getattr(args, "trace", None)  # (offered with the course's parts)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    try:  # none of this imports torch: a bad value answers at once (--backend nccl aside)
        _refuse_empty(given, args)
        note = _pipeline_defaults(values)
        cfg = RunConfig(**values, extra={"progress": args.progress}).validate()
        _refuse_ignored(given, cfg)
        preflight.check_output("--json", args.json)
        preflight.check_output("--trace", args.trace)
        if args.json and args.trace and args.json != "-" and \
                os.path.realpath(args.json) == os.path.realpath(args.trace):
            raise ConfigError(f"--trace {args.trace}: the same file as --json (the report would "
                              f"overwrite the trace); give each its own name")
        preflight.check(cfg)
        _check_backend(cfg)
    except preflight.RunComplete as e:  # (a finished elastic job, relaunched: nothing to do)
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {e}", file=sys.stderr)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if note:  # only for a run that will start: a refused one gets its one line
        print(note, file=sys.stderr)
    from .launch import RankError, run  # imported late: a bad flag answers without loading torch
    from .checkpoint import CheckpointSaveError
    try:
        with _stop_signals_end_the_run():
            report = run(cfg)
    except RankError as e:
        last = e.details.rstrip().splitlines()[-1:] or [""]
        if last[0].split(": ", 1)[0] in ONE_LINE_FAULTS:  # diverged (engine._train), a save that
            print(f"error: {last[0].split(': ', 1)[1]}", file=sys.stderr)  # failed, a bad checkpoint
            return 1
        lost = _report_lost_after_save(cfg, e)
        if lost:  # trained and saved: only the report is gone
            print(f"error: {lost}", file=sys.stderr)
            return 1
        print(f"run failed on rank {e.rank}:\n{e.details.rstrip()}", file=sys.stderr)
        return 1
    except (CheckpointSaveError, preflight.CheckpointError) as e:  # (torchrun: raised right here,
        if os.environ.get("RANK", "0") == "0":  # in every rank; rank 0 says it)
            print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # launch.run's own checks, after torch's import took its memory
        print(f"error: {e}", file=sys.stderr)
        return 2
    except _Stopped as e:
        print(f"stopped by {e.name}: every rank was ended; no report", file=sys.stderr)
        return 128 + e.signum
    if under_torchrun():
        import torch.distributed as dist
        if dist.get_rank() != 0:
            return 0
    return _write_outputs(report, args, course)


def _report_lost_after_save(cfg, e) -> str | None:
    """A rank that died without its report (killed, say) after the run's last checkpoint was
    whole: the training and the save are done, only the report is lost. Says so in one line
    (None when that is not what happened: no --save, a rank that raised, a checkpoint not at the
    last step or not complete)."""
    head = e.details.strip().splitlines()[0] if e.details.strip() else ""
    if not cfg.save or not head.startswith(f"rank {e.rank} ") or "without a result" not in head \
            and "before returning a result" not in head:
        return None
    try:
        folder, meta = preflight.resolve(cfg.save)
    except ConfigError:
        return None
    if meta["step"] != cfg.steps:
        return None
    how = head.split(" before returning a result")[0].split(", and its exit status")[0]
    return (f"{how} after the run's last save: all {cfg.steps} steps trained and {folder} is "
            f"complete (latest names it); only the run's report was lost with rank {e.rank}. "
            f"Its parameters are in the checkpoint: --resume {cfg.save} with more --steps goes on")


def _write_outputs(report, args, course: CourseParts | None = None) -> int:
    """The trace, the report; a write that fails after the run (a disk that filled meanwhile) is
    one line and exit 1: the run finished, its output did not."""
    flag, path = "--trace", args.trace
    try:
        if args.trace:
            course.write_trace(report, args.trace)
        flag, path = "--json", args.json
        if args.json == "-":
            _write_stdout(report.to_json() + "\n")
        elif args.json:
            with open(args.json, "w") as fh:
                fh.write(report.to_json(indent=1))
            print(_summary(report, course))
        else:
            print(_summary(report, course))
    except OSError as e:
        if isinstance(e, BrokenPipeError):
            raise
        print(f"error: {flag} {path}: the run finished but its output could not be written "
              f"({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


def entry(main=main) -> None:
    """The process's end: `main`'s exit status (the door passes its own `main`, with the course)."""
    try:
        rc = main()
    except BrokenPipeError:  # e.g. `... --json - | head`: the reader left, nothing to report
        sys.stderr.close()
        sys.exit(0)
    if under_torchrun() or rc > 128:
        # Under torchrun, a gloo worker thread can drop its last tensor reference while the
        # interpreter shuts down and abort the process ("terminate called without an active
        # exception", pytorch issue 190489). The report is out: flush it and end the process
        # without that shutdown. Stopped by a signal (rc 128 + its number): the ranks are gone and
        # nothing is left to save; the shutdown of an interpreter that imported torch only keeps
        # whoever sent the signal waiting (2.6 s measured on a loaded 2-core machine).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)

