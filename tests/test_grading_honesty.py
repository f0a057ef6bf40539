"""The graders measure what they grade and cannot be fooled (issue 21): an answer whose bytes go
around `comm` (the collective called on the process group behind it, a decoy of zeros through
comm keeping the records right) is refused on the bytes the ranks really wrote to their sockets;
a function that is the library's own (its code object, a copy of its bytecode, its source pasted
in) is refused as such; a reducer that waits inside its gradient hook is refused by name; an
answer that reads the expected one from its callers' frames finds nothing; an endless answer in
a single-process check stops within 10 s. Each with its own message; the right answers pass."""
import inspect
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

from parallel_mini.course.grading import (check_average_gradients, check_bucketed_grad_sync,
                                          check_parallel_mlp, check_ring_all_reduce,
                                          check_zero1_step)

from parallel_mini.comm import _reduce_scatter
from test_grading import BucketedRight, _ring

BYPASS = r"wrote [\d,]+ bytes to their sockets \(measured\), but the calls recorded by comm " \
         r"explain at most [\d,]+ .* went around comm"


def _group(comm, axis):
    return comm.mesh.groups[axis]


# -- the process-group bypass: the real transfer on the group, a decoy of zeros through comm ----
def ring_bypass(x, comm):
    n = comm.size("dp")
    _group(comm, "dp").allreduce([x]).wait()  # the real sum, around comm
    decoy = torch.zeros_like(x)
    _ring(decoy, comm)  # 2(N-1) sendrecv calls of zeros: the records look right
    return x


def avg_bypass(params, comm):
    for p in params:
        _group(comm, "dp").allreduce([p.grad]).wait()
        comm.all_reduce(torch.zeros_like(p.grad), "dp")
        p.grad /= comm.size("dp")


def zero1_bypass(flat_params, flat_grads, step_shard, comm):
    n, r = comm.size("dp"), comm.rank("dp")
    k = flat_params.numel() // n
    g = torch.empty(k)
    _reduce_scatter(g, flat_grads, group=_group(comm, "dp"))  # torch.distributed's, directly
    comm.reduce_scatter(torch.empty(k), torch.zeros_like(flat_grads), "dp")
    step_shard(g / n)
    comm.all_gather(flat_params, flat_params[r * k:(r + 1) * k].clone(), "dp")


def mlp_bypass(x, w1, b1, w2, b2, comm):
    y = F.gelu(x @ w1.T + b1) @ w2.T
    _group(comm, "tp").allreduce([y]).wait()
    comm.all_reduce(torch.zeros_like(y), "tp")
    return y + b2


class BucketedBypass(BucketedRight):
    def launch(self, b):
        b["handle"] = _group(self.comm, "dp").allreduce([b["flat"]])
        self.comm.all_reduce(torch.zeros_like(b["flat"]), "dp", async_op=True)


@pytest.mark.parametrize("check,bypass,kwargs", [
    (check_ring_all_reduce, ring_bypass, dict(cases=((2, 5),))),  # sendrecv decoys
    (check_zero1_step, zero1_bypass, dict(world_sizes=(2,), steps=1)),  # torch.distributed
    (check_bucketed_grad_sync, BucketedBypass, dict(world_sizes=(2,), steps=1)),  # async
    # the same verdict on the same trace (tested above), in the other checkers' plumbing
    pytest.param(check_average_gradients, avg_bypass, dict(world_sizes=(2,), steps=1),
                 marks=pytest.mark.slow),
    pytest.param(check_parallel_mlp, mlp_bypass, dict(world_sizes=(2,)), marks=pytest.mark.slow),
])
def test_the_process_group_bypass_is_refused_on_the_bytes_written(check, bypass, kwargs):
    """(The honest answers' bytes are explained: every right answer of test_grading passes the
    same verdict, and test_bucketed_checker_measures_overlap... reads the figures.)"""
    with pytest.raises(AssertionError, match=BYPASS):
        check(bypass, **kwargs)


# -- lesson 02: a hook that blocks is refused by name; an all-reduce after backward is not it ---
class BucketedBlockingHook(BucketedRight):
    """Launches each bucket asynchronously, then waits for it inside the hook: backward stops
    until the bytes have moved (the issue's reducer: it used to be accepted, 100 % overlapped)."""

    def launch(self, b):
        super().launch(b)
        b["handle"].wait()


class BucketedBlockingAfterBackward(BucketedRight):
    """Blocking all-reduces placed after backward, in finish_gradient_sync: no overlap, but no
    blocking call inside a hook either."""

    def launch(self, b):
        pass

    def finish_gradient_sync(self):
        for b in self.buckets:
            self.comm.all_reduce(b["flat"], "dp")
            b["handle"] = types.SimpleNamespace(wait=lambda: None)
        super().finish_gradient_sync()


def test_a_blocking_hook_is_refused_by_name_and_only_it():
    with pytest.raises(AssertionError, match=r"a blocking call inside a hook: the wait\(\) of an "
                                             r"async comm\.all_reduce ran while loss\.backward\(\)"):
        check_bucketed_grad_sync(BucketedBlockingHook, world_sizes=(2,), steps=1)
    with pytest.raises(AssertionError) as err:
        check_bucketed_grad_sync(BucketedBlockingAfterBackward, world_sizes=(2,), steps=1)
    assert "blocking call inside a hook" not in str(err.value)
    assert "launched before backward returned" in str(err.value)
    assert "all-reduces placed after backward cannot overlap it" in str(err.value)


# -- the library's own code, copied: the code object, its bytecode, its source pasted in --------
def _copies(lib):
    """Three answers that are `lib`: its code object, a copy of its code (the same bytecode under
    another name), and its source pasted into a cell (compiled without docstrings, so that its
    bytecode differs and only the syntax tree says it is the library's)."""
    import linecache

    same = types.FunctionType(lib.__code__, lib.__globals__, "mine")
    bytecode = types.FunctionType(lib.__code__.replace(co_name="mine"), lib.__globals__, "mine")
    src = inspect.getsource(lib).replace(f"def {lib.__name__}(", "def mine(", 1)
    name = f"<pasted cell {lib.__name__}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    ns = dict(lib.__globals__)
    exec(compile(src, name, "exec", optimize=2), ns)
    return [(same, "the same code object"), (bytecode, r"the same bytecode \(a copy of its "
                                                       r"__code__\)"),
            (ns["mine"], r"the same source \(the library's code pasted in\)")]


def _library_cases():
    from parallel_mini import comm, moe
    from parallel_mini.course.grading import (check_merge, check_one_f_one_b, check_route,
                                              check_states_per_rank)
    from parallel_mini.parallel import context, data, schedules
    return [(check_ring_all_reduce, comm.ring_all_reduce, "parallel_mini.comm.ring_all_reduce"),
            (check_merge, context._merge, "parallel_mini.parallel.context._merge"),
            (check_route, moe.route, "parallel_mini.moe.route"),
            (check_average_gradients, data.average_gradients,
             "parallel_mini.parallel.data.average_gradients"),
            (check_one_f_one_b, schedules.one_f_one_b,
             "parallel_mini.parallel.schedules.one_f_one_b"),
            (check_states_per_rank, __import__("parallel_mini.theory").theory.model_state_bytes,
             "parallel_mini.theory.model_state_bytes")]


def test_a_copy_of_the_library_is_refused_as_such_before_any_rank_starts(monkeypatch):
    import parallel_mini.runtime.launch
    monkeypatch.setattr(parallel_mini.runtime.launch, "run_ranks", lambda *a, **k: pytest.fail("ran"))
    for check, lib, qualified in _library_cases():
        for answer, how in _copies(lib):
            with pytest.raises(AssertionError, match=rf"^your mine is the library's own "
                                                     rf"{qualified}: {how}\. The checker grades "
                                                     rf"code you wrote"):
                check(answer)
    # a class whose method is the library's
    from parallel_mini.parallel.data import DataParallel

    class Copied(BucketedRight):
        finish_gradient_sync = DataParallel.finish_gradient_sync
    with pytest.raises(AssertionError, match=r"^your BucketedGradSync's finish_gradient_sync is "
                                             r"the library's own .*DataParallel\.finish_gradient_"
                                             r"sync: the same code object"):
        check_bucketed_grad_sync(Copied)


# -- the expected answer is nowhere on the stack the learner's code can read --------------------
_ANSWER_NAMES = ("want", "table", "full", "fc_w", "fc_b", "proj_w", "expected", "ref", "truth",
                 "answers")


def _from_frames():
    """Every local of every caller frame whose name says it may hold the answer."""
    found, frame = {}, sys._getframe(1)
    while frame is not None:
        for k in _ANSWER_NAMES:
            if k in frame.f_locals and k not in found:
                found[k] = frame.f_locals[k]
        frame = frame.f_back
    for info in inspect.stack():
        for k in _ANSWER_NAMES:
            found.setdefault(k, info.frame.f_locals.get(k)) if k in info.frame.f_locals else None
    return found


def states_from_frames(cfg):
    found = _from_frames()
    if isinstance(found.get("want"), dict):
        return found["want"]
    return {}


def layout_from_frames(budget):
    table = _from_frames().get("table")
    if table:
        fits = [lay for lay, st in table if max(st) <= budget]
        return max(fits, key=lambda lay: lay["dp"]) if fits else None
    return {"dp": 4, "tp": 1, "pp": 1, "zero": 0}  # right for the first budget only


def mlp_from_frames(x, w1, b1, w2, b2, comm):
    found = _from_frames()
    if found.get("fc_w") is not None and found.get("proj_w") is not None:
        y = F.gelu(x @ found["fc_w"].T + found["fc_b"]) @ found["proj_w"].T  # the whole MLP
    else:
        y = torch.zeros(*x.shape[:2], b2.numel())
    comm.all_reduce(y, "tp")
    return y / comm.size("tp") + b2


def zero1_from_frames(flat_params, flat_grads, step_shard, comm):
    n, r = comm.size("dp"), comm.rank("dp")
    k = flat_params.numel() // n
    comm.reduce_scatter(torch.empty(k), torch.zeros_like(flat_grads), "dp")  # bytes of a decoy
    expected = _from_frames().get("expected")
    step_shard(expected if isinstance(expected, torch.Tensor) else flat_grads[r * k:(r + 1) * k])
    comm.all_gather(flat_params, flat_params[r * k:(r + 1) * k].clone(), "dp")


def test_reading_the_callers_frames_finds_no_answer(monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_layout_choice, check_states_per_rank
    monkeypatch.setattr(parallel_mini.runtime.launch, "run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(AssertionError, match=r"must have one entry per rank"):
        check_states_per_rank(states_from_frames)
    with pytest.raises(AssertionError, match=r"^budget 2,500,000 bytes: dp4 tp1 pp1 ZeRO-0 does "
                                             r"not fit"):
        check_layout_choice(layout_from_frames)
    with pytest.raises(AssertionError, match=r"rank \d's output differs from the unsharded MLP"):
        check_parallel_mlp(mlp_from_frames, world_sizes=(2,))
    with pytest.raises(AssertionError, match=r"step_shard received this rank's own gradient "
                                             r"slice, not the mean"):
        check_zero1_step(zero1_from_frames, world_sizes=(2,), steps=1)


# -- no table stands in for the rule: cases drawn anew every check -------------------------------
def mlp_from_the_lesson_weights(x, w1, b1, w2, b2, comm):
    """The whole MLP rebuilt from the checker's own weights of the lesson (seed 0), shards unused."""
    from parallel_mini.course.grading.lesson04_tensor_parallel import _parallel_mlp_weights
    fc_w, fc_b, proj_w, proj_b, _ = _parallel_mlp_weights(x.shape[-1])
    y = (F.gelu(x @ fc_w.T + fc_b) @ proj_w.T).contiguous()
    comm.all_reduce(y, "tp")
    return y / comm.size("tp") + proj_b


def test_a_memorised_table_meets_cases_it_does_not_hold(monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import (LAYOUT_BUDGETS, check_layout_choice,
                                              check_one_f_one_b)
    from parallel_mini.parallel.schedules import one_f_one_b as library_1f1b
    monkeypatch.setattr(parallel_mini.runtime.launch, "run", lambda *a, **k: pytest.fail("ran"))
    orders = {(pp, m): [[str(op) for op in ops] for ops in library_1f1b(pp, m)]
              for pp, m in ((2, 4), (4, 8), (4, 2))}  # built from the name the lesson imports
    with pytest.raises(AssertionError, match=r"^your one_f_one_b at pp=\d+, m=\d+ \(drawn for this "
                                             r"check, beyond the lesson's\) raised KeyError"):
        check_one_f_one_b(lambda r, pp, m: orders[(pp, m)][r])
    answers = {b: None for b in LAYOUT_BUDGETS}
    with pytest.raises(AssertionError, match=r"your choose_layout raised KeyError"):
        check_layout_choice(lambda budget: answers[budget])
    with pytest.raises(AssertionError, match=r"^at tp=2, x of shape \[2, 8, 16\] \(weights drawn "
                                             r"for this check\): rank \d's output differs"):
        check_parallel_mlp(mlp_from_the_lesson_weights, world_sizes=(2,))
    # and the [correct] message no longer lists the budgets' answers (memorised from it before)
    assert "->" not in inspect.getsource(check_layout_choice).split("return Grade(")[-1]


# -- an endless answer in a single-process check stops, with a message --------------------------
def test_an_endless_answer_stops_with_a_message(monkeypatch):
    import threading

    from parallel_mini.course.grading import check_layout_choice, check_states_per_rank, core
    monkeypatch.setattr(core, "ANSWER_TIMEOUT", 0.5)  # 10 s in the lessons: the same code path

    def forever(_):
        while True:
            pass

    for check, what in ((check_states_per_rank, r"your states_per_rank"),
                        (check_layout_choice, r"your choose_layout")):
        t0 = time.perf_counter()
        with pytest.raises(AssertionError, match=rf"{what} did not return within 0\.5 s: a loop "
                                                 rf"that never ends\? \(stopped by the checker\)"):
            check(forever)
        assert time.perf_counter() - t0 < 5
    assert not [t for t in threading.enumerate() if t.name == "learner-answer"]  # stopped


def test_a_warning_inside_the_window_is_held_not_counted_as_traffic(capfd):
    """What the learner's code prints to stderr (a warning) while its bytes are measured is held
    and written after the window, so it is never taken for bytes sent around comm."""
    from parallel_mini.course.grading.core import _SocketBytes
    meter = _SocketBytes()
    if meter.total is None:
        pytest.skip("bytes written cannot be read here")
    with meter:
        sys.stderr.write("x" * 10_000)
        sys.stderr.flush()
    assert meter.total < 10_000
    assert "x" * 10_000 in capfd.readouterr().err
