"""The exercise graders: a stub is "not attempted", a right answer passes, and each typical wrong
answer is refused with an AssertionError (a grader that accepts anything would be worse than none)."""
import re
import time

import pytest
import torch

import torch.nn.functional as F

from parallel_mini.course.grading import (check_average_gradients, check_parallel_mlp,
                                   check_ring_all_reduce, check_zero1_step)
from parallel_mini.parallel.data import average_gradients


def ring_stub(x, comm):
    raise NotImplementedError("exercise")


def ring_right(x, comm):
    """A learner's ring (the library's own is refused while the checker runs an answer)."""
    return _ring(x, comm)


def avg_right(params, comm):
    for p in params:
        comm.all_reduce(p.grad, "dp")
        p.grad /= comm.size("dp")


def avg_stub(params, comm):
    raise NotImplementedError("exercise")


def avg_without_divide(params, comm):
    for p in params:
        comm.all_reduce(p.grad, "dp")


def zero1_right(flat_params, flat_grads, step_shard, comm):
    n, r = comm.size("dp"), comm.rank("dp")
    k = flat_params.numel() // n
    g = torch.empty(k, dtype=flat_grads.dtype)
    comm.reduce_scatter(g, flat_grads, "dp")
    step_shard(g / n)
    comm.all_gather(flat_params, flat_params[r * k:(r + 1) * k].clone(), "dp")


def zero1_stub(flat_params, flat_grads, step_shard, comm):
    raise NotImplementedError("exercise")


def zero1_without_divide(flat_params, flat_grads, step_shard, comm):
    n, r = comm.size("dp"), comm.rank("dp")
    k = flat_params.numel() // n
    g = torch.empty(k, dtype=flat_grads.dtype)
    comm.reduce_scatter(g, flat_grads, "dp")
    step_shard(g)
    comm.all_gather(flat_params, flat_params[r * k:(r + 1) * k].clone(), "dp")


def zero1_without_gather(flat_params, flat_grads, step_shard, comm):
    n, r = comm.size("dp"), comm.rank("dp")
    k = flat_params.numel() // n
    g = torch.empty(k, dtype=flat_grads.dtype)
    comm.reduce_scatter(g, flat_grads, "dp")
    step_shard(g / n)


def zero1_all_reduce(flat_params, flat_grads, step_shard, comm):
    """Right numbers, twice the gradient traffic: refused on bytes."""
    n, r = comm.size("dp"), comm.rank("dp")
    k = flat_params.numel() // n
    comm.all_reduce(flat_grads, "dp")
    step_shard(flat_grads[r * k:(r + 1) * k] / n)
    comm.all_gather(flat_params, flat_params[r * k:(r + 1) * k].clone(), "dp")


def mlp_right(x, w1, b1, w2, b2, comm):
    y = F.gelu(x @ w1.T + b1) @ w2.T
    comm.all_reduce(y, "tp")
    return y + b2


def mlp_stub(x, w1, b1, w2, b2, comm):
    raise NotImplementedError("exercise")


def mlp_bias_on_every_rank(x, w1, b1, w2, b2, comm):
    y = F.gelu(x @ w1.T + b1) @ w2.T + b2
    comm.all_reduce(y, "tp")
    return y


def mlp_all_reduce_after_fc(x, w1, b1, w2, b2, comm):
    h = F.gelu(x @ w1.T + b1).contiguous()
    comm.all_reduce(h, "tp")
    return h @ w2.T + b2


def mlp_no_all_reduce(x, w1, b1, w2, b2, comm):
    return F.gelu(x @ w1.T + b1) @ w2.T + b2


@pytest.mark.parametrize("check,right,stub,wrongs", [
    (check_parallel_mlp, mlp_right, mlp_stub,
     [mlp_bias_on_every_rank, mlp_all_reduce_after_fc, mlp_no_all_reduce]),
    (check_ring_all_reduce, ring_right, ring_stub, []),  # wrong rings: below, each named
    (check_average_gradients, avg_right, avg_stub, []),  # wrong averages: below
    (check_zero1_step, zero1_right, zero1_stub,
     [zero1_without_divide, zero1_without_gather, zero1_all_reduce]),
])
def test_grader(check, right, stub, wrongs):
    assert check(stub).status == "not attempted"
    assert check(right).status == "correct"
    for wrong in wrongs:
        with pytest.raises(AssertionError):
            check(wrong)


# ---------------------------------------------------------------------------------------------
# check_one_f_one_b (lesson 05): the structural refusals need no ranks; one correct run does
# ---------------------------------------------------------------------------------------------
def f1b_right(rank, pp, m):
    warmup = min(pp - 1 - rank, m)
    ops = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        ops += [f"F{warmup + i}", f"B{i}"]
    return ops + [f"B{i}" for i in range(m - warmup, m)]


def f1b_stub(rank, pp, m):
    raise NotImplementedError("exercise")


def f1b_gpipe(rank, pp, m):
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def f1b_backward_first(rank, pp, m):
    return [f"B{i}" for i in range(m)] + [f"F{i}" for i in range(m)]


def f1b_missing_last_backward(rank, pp, m):
    return f1b_right(rank, pp, m)[:-1]


def f1b_bad_token(rank, pp, m):
    return ["forward0"] + f1b_right(rank, pp, m)[1:]


def test_one_f_one_b_stub_is_not_attempted():
    from parallel_mini.course.grading import check_one_f_one_b
    assert check_one_f_one_b(f1b_stub).status == "not attempted"


@pytest.mark.parametrize("wrong,message", [
    (f1b_gpipe, r"rank 0 runs 4 forwards before its first backward; 1F1B warms up with p - 1 - r = 1"),
    (f1b_backward_first, r"deadlocks"),
    (f1b_missing_last_backward, r"missing"),
    (f1b_bad_token, r"is not an op"),
])
def test_one_f_one_b_refuses_wrong_orders_without_ranks(wrong, message, monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_one_f_one_b

    def no_ranks(*args, **kwargs):
        raise RuntimeError("a structural refusal must not start any rank")

    monkeypatch.setattr(parallel_mini.runtime.launch, "run", no_ranks)
    with pytest.raises(AssertionError, match=message):
        check_one_f_one_b(wrong)


def test_one_f_one_b_correct_order_runs_on_ranks_and_equals_the_reference():
    from parallel_mini.course.grading import check_one_f_one_b
    grade = check_one_f_one_b(f1b_right, run_cases=((2, 4),))
    assert grade.status == "correct", grade
    report = grade.details["reports"][(2, 4)]
    assert report.max_abs_diff < 1e-5
    assert grade.details["orders"][(4, 8)][0][:5] == [["F", 0], ["F", 1], ["F", 2], ["F", 3], ["B", 0]]


def f1b_naive(rank, pp, m):
    """F0 B0 F1 B1 ... on every rank: deadlock-free and 1 micro-batch in flight, but no warm-up,
    so no pipelining at all (the naive schedule, bubble (p-1)/p)."""
    return [op for i in range(m) for op in (f"F{i}", f"B{i}")]


def test_one_f_one_b_refuses_the_naive_order(monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_one_f_one_b

    def no_ranks(*args, **kwargs):
        raise RuntimeError("structural checks passed: the grader went on to run the order")

    monkeypatch.setattr(parallel_mini.runtime.launch, "run", no_ranks)
    with pytest.raises(AssertionError):
        check_one_f_one_b(f1b_naive)


# ---------------------------------------------------------------------------------------------
# check_merge (lesson 06): the online-softmax merge, on real ranks inside the library's ring
# ---------------------------------------------------------------------------------------------
def merge_right(out, lse, out_t, lse_t):
    new = torch.logaddexp(lse, lse_t)
    return (out * torch.exp(lse - new).unsqueeze(-1) + out_t * torch.exp(lse_t - new).unsqueeze(-1),
            new)


def merge_right_with_max(out, lse, out_t, lse_t):
    """The same rule through the running maximum (FlashAttention's form): also right."""
    m = torch.maximum(lse, lse_t)
    a, b = torch.exp(lse - m), torch.exp(lse_t - m)
    return (out * a.unsqueeze(-1) + out_t * b.unsqueeze(-1)) / (a + b).unsqueeze(-1), m + torch.log(a + b)


def merge_stub(out, lse, out_t, lse_t):
    raise NotImplementedError("exercise")


def merge_no_rescale(out, lse, out_t, lse_t):
    new = torch.logaddexp(lse, lse_t)
    return out + out_t * torch.exp(lse_t - new).unsqueeze(-1), new


def merge_max_not_lse(out, lse, out_t, lse_t):
    new = torch.maximum(lse, lse_t)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_t * torch.exp(lse_t - new).unsqueeze(-1), new


def merge_sum_outputs(out, lse, out_t, lse_t):
    return out + out_t, torch.logaddexp(lse, lse_t)


def merge_overflows(out, lse, out_t, lse_t):
    """Right on small scores; exponentiates the log-sum-exps themselves."""
    new = torch.log(torch.exp(lse) + torch.exp(lse_t))
    return out * torch.exp(lse - new).unsqueeze(-1) + out_t * torch.exp(lse_t - new).unsqueeze(-1), new


def merge_nan_on_first(out, lse, out_t, lse_t):
    """Right whenever lse is finite; -inf - (-inf) on the first merge of a row."""
    new = lse + torch.log1p(torch.exp(lse_t - lse))
    return out * torch.exp(lse - new).unsqueeze(-1) + out_t * torch.exp(lse_t - new).unsqueeze(-1), new


def merge_swapped_return(out, lse, out_t, lse_t):
    return tuple(reversed(merge_right(out, lse, out_t, lse_t)))


def merge_calls_library(out, lse, out_t, lse_t):
    from parallel_mini.parallel import context
    return context._merge(out, lse, out_t, lse_t)


from parallel_mini.parallel.context import _merge as imported_library_merge  # noqa: E402


def merge_calls_imported_library(out, lse, out_t, lse_t):
    return imported_library_merge(out, lse, out_t, lse_t)


def merge_library_on_ranks_only(out, lse, out_t, lse_t):
    """Passes the single-merge checks in the parent; calls the library inside the ranks."""
    import torch.distributed as dist
    if dist.is_initialized():
        return merge_calls_library(out, lse, out_t, lse_t)
    return merge_right(out, lse, out_t, lse_t)


def merge_wrong_on_ranks_only(out, lse, out_t, lse_t):
    """Passes the single-merge checks; on the ranks forgets the old output (ring must refuse)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return merge_no_rescale(out, lse, out_t, lse_t)
    return merge_right(out, lse, out_t, lse_t)


def test_merge_stub_is_not_attempted():
    from parallel_mini.course.grading import check_merge
    grade = check_merge(merge_stub)
    assert grade.status == "not attempted" and "NotImplementedError" in grade.message


@pytest.mark.parametrize("right", [merge_right, merge_right_with_max])
def test_merge_right_answers_equal_sdpa_on_real_ranks(right):
    from parallel_mini.course.grading import MERGE_CHECK_CASES, check_merge
    grade = check_merge(right)
    assert grade.status == "correct", grade
    runs = {(r["cp"], r["layout"]): r for r in grade.details["runs"]}
    assert set(runs) == set(MERGE_CHECK_CASES)
    # the learner's merge was what ran: once per ring step after the first on every rank (a
    # step's visible tiles are one rectangle, one fused call; the first step starts the output)
    assert runs[(4, "contiguous")]["merges_per_rank"] == [0, 1, 2, 3]
    assert runs[(4, "contiguous")]["tiles_computed"] == [1, 2, 3, 4]
    assert runs[(4, "zigzag")]["merges_per_rank"] == [3, 3, 3, 3]
    assert runs[(4, "zigzag")]["tiles_computed"] == [9, 9, 9, 9]
    assert all(r["max_abs_diff"] < 1e-5 for r in runs.values())


@pytest.mark.parametrize("wrong,message", [
    (merge_no_rescale, r"old output was not rescaled"),
    (merge_max_not_lse, r"lse' is max\(lse, lse_t\)"),
    (merge_sum_outputs, r"out \+ out_t"),
    (merge_overflows, r"large scores .*inf or nan.*e\^1000 is inf in fp32"),
    (merge_nan_on_first, r"first merge of a row .*inf or nan"),
    (merge_swapped_return, r"return \(out, lse\) in that order"),
    (merge_calls_library, r"called the library's own merge"),
    (merge_calls_imported_library, r"called the library's own merge"),
])
def test_merge_wrong_answers_are_named_without_ranks(wrong, message, monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_merge

    def no_ranks(*args, **kwargs):
        raise RuntimeError("a single-merge refusal must not start any rank")

    monkeypatch.setattr(parallel_mini.runtime.launch, "run_ranks", no_ranks)
    with pytest.raises(AssertionError, match=message):
        check_merge(wrong)


@pytest.mark.parametrize("wrong,message", [
    (merge_library_on_ranks_only, r"called the library's own merge"),
    (merge_wrong_on_ranks_only, r"at C=2 \(contiguous chunks\): rank 1's ring attention .*differs "
                                r"from torch SDPA"),
])
def test_merge_refused_on_real_ranks(wrong, message):
    from parallel_mini.course.grading import check_merge
    with pytest.raises(AssertionError, match=message):
        check_merge(wrong)


def test_library_merge_works_again_after_a_refusal():
    from parallel_mini.course.grading import check_merge
    from parallel_mini.parallel import context
    with pytest.raises(AssertionError):
        check_merge(merge_calls_library)
    lse, lse_t = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)
    out, new = context._merge(torch.zeros(1, 1, 1, 1), lse, torch.ones(1, 1, 1, 1), lse_t)
    assert out.item() == pytest.approx(0.5) and new.item() == pytest.approx(0.6931, abs=1e-4)


# ---------------------------------------------------------------------------------------------
# check_route (lesson 07): top-k routing with capacity, in the MoE layers of a real ep run
# ---------------------------------------------------------------------------------------------
import math  # noqa: E402

from parallel_mini import moe  # noqa: E402


def capacity_right(tokens, experts, k, factor):
    return math.ceil(factor * tokens * k / experts)


def _slots(expert, E, order="choice"):
    """Queue places: "choice" (right), or a usual mistake: "token" (token by token),
    "per-choice" (each choice column its own queue), "one-queue" (one queue for all groups)."""
    g, t, k = expert.shape
    choices = expert.tolist()
    slots = [[[0] * k for _ in range(t)] for _ in range(g)]
    shared = [0] * E
    for group in range(g):
        taken = shared if order == "one-queue" else [0] * E
        pairs = ([(i, j) for i in range(t) for j in range(k)] if order == "token"
                 else [(i, j) for j in range(k) for i in range(t)])
        for i, j in pairs:
            if order == "per-choice" and i == 0:
                taken = [0] * E
            e = choices[group][i][j]
            slots[group][i][j] = taken[e]
            taken[e] += 1
    return torch.tensor(slots, dtype=torch.long).view(g, t, k)


def route_right(logits, k, cap):
    """A loop over the queues."""
    probs = logits.float().softmax(-1)
    top_p, expert = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_p, expert = top_p[..., :k], expert[..., :k]
    slot = _slots(expert, probs.shape[-1])
    return moe.Routing(expert, top_p / top_p.sum(-1, keepdim=True), slot, slot < cap, probs)


def route_right_vectorised(logits, k, cap):
    """Another form: argsort(stable), gates as a softmax over the k chosen logits, slots by a
    cumulative count over the choice-major flattening."""
    probs = logits.softmax(-1)
    expert = probs.argsort(dim=-1, descending=True, stable=True)[..., :k]
    gate = logits.gather(-1, expert).softmax(-1)
    onehot = F.one_hot(expert.transpose(1, 2).reshape(expert.shape[0], -1), logits.shape[-1])
    slot = ((onehot.cumsum(1) - 1) * onehot).sum(-1).view(expert.shape[0], k, -1).transpose(1, 2)
    return moe.Routing(expert, gate, slot, slot < cap, probs)


def route_stub(logits, k, cap):
    raise NotImplementedError("exercise")


def capacity_stub(tokens, experts, k, factor):
    raise NotImplementedError("exercise")


def _changed(**fields):
    """route_right with some fields replaced: fields[name](r, logits, k, cap) -> tensor."""
    def route(logits, k, cap):
        r = route_right(logits, k, cap)
        for name, make in fields.items():
            setattr(r, name, make(r, logits, k, cap))
        return r
    return route


route_ties_higher = _changed(expert=lambda r, logits, k, cap: logits.shape[-1] - 1 - torch.sort(
    r.probs.flip(-1), dim=-1, descending=True, stable=True)[1][..., :k])
route_topk = _changed(expert=lambda r, logits, k, cap: r.probs.topk(k, dim=-1).indices)
route_not_renormalised = _changed(gate=lambda r, logits, k, cap: r.probs.gather(-1, r.expert))
route_detached_gates = _changed(gate=lambda r, logits, k, cap: r.gate.detach())
def _queued(order):
    """route_right with its queues filled in another order (slot and keep)."""
    return _changed(slot=lambda r, logits, k, cap: _slots(r.expert, logits.shape[-1], order),
                    keep=lambda r, logits, k, cap: _slots(r.expert, logits.shape[-1], order) < cap)


route_token_major = _queued("token")
route_queue_per_choice = _queued("per-choice")
route_one_queue = _queued("one-queue")
route_slots_from_one = _changed(slot=lambda r, logits, k, cap: r.slot + 1,
                                keep=lambda r, logits, k, cap: r.slot + 1 <= cap)
route_keeps_one_more = _changed(keep=lambda r, logits, k, cap: r.slot <= cap)
route_drops_nothing = _changed(keep=lambda r, logits, k, cap: torch.ones_like(r.keep))
route_int32_experts = _changed(expert=lambda r, logits, k, cap: r.expert.int())


def route_tuple(logits, k, cap):
    r = route_right(logits, k, cap)
    return r.expert, r.gate, r.slot, r.keep, r.probs


def route_calls_library(logits, k, cap):
    return moe.route(logits, k, cap)


from parallel_mini.moe import route as imported_library_route  # noqa: E402


def route_calls_imported_library(logits, k, cap):
    return imported_library_route(logits, k, cap)


def route_calls_library_seam(logits, k, cap):
    return moe.MoE.routing(logits, k, cap)


def capacity_floor(tokens, experts, k, factor):
    return math.floor(factor * tokens * k / experts)


def capacity_plus_one(tokens, experts, k, factor):
    return int(factor * tokens * k / experts) + 1


def capacity_calls_library(tokens, experts, k, factor):
    return moe.capacity(tokens, experts, k, factor)


def route_library_on_ranks_only(logits, k, cap):
    import torch.distributed as dist
    if dist.is_initialized():
        return route_calls_library(logits, k, cap)
    return route_right(logits, k, cap)


def route_token_major_on_ranks_only(logits, k, cap):
    import torch.distributed as dist
    if dist.is_initialized():
        return route_token_major(logits, k, cap)
    return route_right(logits, k, cap)


def test_route_stub_is_not_attempted():
    from parallel_mini.course.grading import check_route
    for grade in (check_route(route_stub), check_route(route_stub, capacity_right),
                  check_route(route_right, capacity_stub)):
        assert grade.status == "not attempted" and "NotImplementedError" in grade.message
    assert "capacity" in check_route(route_right, capacity_stub).message


@pytest.mark.parametrize("right", [pytest.param(route_right, marks=pytest.mark.slow),
                                   route_right_vectorised])
def test_route_right_answers_train_as_the_library_on_real_ranks(right):
    """A right route, on real ranks. By default the vectorised form: its gates are computed
    another way than the library's (a softmax of the chosen logits), so the check is also shown
    not to refuse a right answer whose arithmetic differs; the loop form (route_right) is
    `-m slow`."""
    from parallel_mini.course.grading import ROUTE_RUN_CASES, check_route
    grade = check_route(right, capacity_right)
    assert grade.status == "correct", grade
    runs = grade.details["runs"]
    assert len(runs) == len(ROUTE_RUN_CASES)
    # the learner's route was what ran: once per MoE layer, micro-batch and step on every rank
    assert runs[0]["route_calls_per_rank"] == [2 * 1 * 2] * 2
    assert runs[1]["route_calls_per_rank"] == [2 * 2 * 2] * 4
    for row in runs:
        assert 0 < row["dropped"] < row["assignments"]  # the cases do drop tokens
        assert row["max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("wrong,message", [
    (route_ties_higher, r"tied probabilities.*ties are broken toward the higher index"),
    (route_topk, r"tied probabilities.*torch.topk makes no promise"),
    (route_not_renormalised, r"gates are not renormalised"),
    (route_detached_gates, r"gate carries no gradient to the router"),
    (route_token_major, r"queues are filled token by token"),
    (route_queue_per_choice, r"each choice starts a queue of its own"),
    (route_one_queue, r"one queue runs over all the sequences"),
    (route_slots_from_one, r"slots count from 1"),
    (route_keeps_one_more, r"capacity off by one: an expert kept cap \+ 1"),
    (route_drops_nothing, r"nothing was dropped"),
    (route_int32_experts, r"expert is torch.int32; it must be int64"),
    (route_tuple, r"returned a tuple of 5"),
    (route_calls_library, r"called the library's own route"),
    (route_calls_imported_library, r"called the library's own route"),
    (route_calls_library_seam, r"called the library's own route"),
])
def test_route_wrong_answers_are_named_without_ranks(wrong, message, monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_route

    def no_ranks(*args, **kwargs):
        raise RuntimeError("an in-process refusal must not start any rank")

    monkeypatch.setattr(parallel_mini.runtime.launch, "run_ranks", no_ranks)
    monkeypatch.setattr(parallel_mini.runtime.launch, "run", no_ranks)
    with pytest.raises(AssertionError, match=message):
        check_route(wrong, capacity_right)


@pytest.mark.parametrize("wrong,message", [
    (capacity_floor, r"capacity\(tokens=10, experts=4, k=1, factor=1.0\) rounds down"),
    (capacity_plus_one, r"capacity\(tokens=32, experts=8, k=2, factor=1.0\) one slot too many"),
    (capacity_calls_library, r"called the library's own capacity"),
])
def test_capacity_wrong_answers_are_named_without_ranks(wrong, message, monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_route

    monkeypatch.setattr(parallel_mini.runtime.launch, "run_ranks", None)
    with pytest.raises(AssertionError, match=message):
        check_route(route_right, wrong)


@pytest.mark.parametrize("wrong,message", [
    (route_library_on_ranks_only, r"called the library's own route"),
    # (k = 1 in the first case: token by token is then the right order; the k = 2 case refuses)
    (route_token_major_on_ranks_only, r"at dp=4 x ep=4 .*: rank \d, step \d, layer \d: with your "
                                      r"route the experts kept"),
])
def test_route_refused_on_real_ranks(wrong, message):
    from parallel_mini.course.grading import check_route
    with pytest.raises(AssertionError, match=message):
        check_route(wrong, capacity_right)


def test_library_routing_works_again_after_a_refusal():
    from parallel_mini.course.grading import check_route
    with pytest.raises(AssertionError):
        check_route(route_calls_library)
    r = moe.route(torch.zeros(1, 4, 3), 2, 2)
    assert r.expert.tolist() == [[[0, 1]] * 4] and r.keep.sum().item() == 4
    assert moe.capacity(10, 4, 1, 1.0) == 3
    assert len(moe.dispatch_order(r, 3)[0]) == 4


# ---------------------------------------------------------------------------------------------
# lessons 01, 02, 05: the library's own implementation refused, the usual mistakes named, a
# deadlock stopped within 10 s with who waited on what (issue 15)
# ---------------------------------------------------------------------------------------------
def _ring(x, comm, ag_send=None, ag_recv=None, all_gather=True, add=False, divide=False,
          extra_on_rank0=False):
    """The lesson's ring, with one mistake switched on."""
    n, r = comm.size("dp"), comm.rank("dp")
    chunks = list(x.view(-1).tensor_split(n))
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        buf = incoming[:chunks[recv_i].numel()]
        comm.sendrecv(chunks[send_i], right, buf, left, "dp")
        chunks[recv_i] += buf
    for s in range(n - 1 if all_gather else 0):
        send_i = ag_send(r, s, n) if ag_send else (r + 1 - s) % n
        recv_i = ag_recv(r, s, n) if ag_recv else (r - s) % n
        if add:
            buf = incoming[:chunks[recv_i].numel()]
            comm.sendrecv(chunks[send_i], right, buf, left, "dp")
            chunks[recv_i] += buf
        else:
            comm.sendrecv(chunks[send_i], right, chunks[recv_i], left, "dp")
    if extra_on_rank0 and r == 0:
        comm.sendrecv(chunks[0], right, incoming[:chunks[0].numel()], left, "dp")
    if divide:
        x /= n
    return x


def ring_calls_library(x, comm):
    from parallel_mini import comm as comm_module
    return comm_module.ring_all_reduce(x, comm)


def ring_calls_dist(x, comm):
    torch.distributed.all_reduce(x)
    return x


@pytest.mark.parametrize("wrong,message", [
    (ring_calls_library, r"called the library's own ring_all_reduce .* disables"),
    pytest.param(ring_calls_dist, r"called dist\.all_reduce, one of the backend's own collectives",
                 marks=pytest.mark.slow),  # the same refusal path as the library's ring
    (lambda x, comm: _ring(x, comm, all_gather=False),
     r"N-1 = 1 comm\.sendrecv calls: that is the reduce-scatter alone, and the all-gather is missing"),
    (lambda x, comm: _ring(x, comm, ag_send=lambda r, s, n: (r - s) % n),
     r"all-gather step 0 \(counting from 0\), rank \d sent chunk \d; it should send chunk \d = "
     r"\(r \+ 1 - s\) mod N"),
    (lambda x, comm: _ring(x, comm, add=True), r"a chunk was added twice, most likely in the all-gather"),
    (lambda x, comm: _ring(x, comm, divide=True), r"your ring divides .* returns the \*sum\*"),
])
def test_ring_checker_names_the_mistake(wrong, message):
    from parallel_mini import comm as comm_module
    code = comm_module.ring_all_reduce.__code__
    with pytest.raises(AssertionError, match=message):
        check_ring_all_reduce(wrong, cases=((2, 5),))
    assert comm_module.ring_all_reduce.__code__ is code  # the library's ring works again


def test_a_deadlocked_ring_stops_within_10_s_saying_who_waited_on_what():
    import time
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as err:
        check_ring_all_reduce(lambda x, comm: _ring(x, comm, extra_on_rank0=True), cases=((2, 5),))
    assert time.perf_counter() - t0 < 10
    text = str(err.value)
    assert "deadlock" in text and "Timed out" not in text and "GLHF" not in text
    assert re.search(r"rank 0 waited in comm\.sendrecv\(send to rank 1, receive from rank 1\), "
                     r"its call 3", text), text
    assert "rank 1 had returned from your ring_all_reduce after 2 calls" in text


def avg_calls_library(params, comm):
    average_gradients(params, comm)


def avg_only_rank0(params, comm):
    if comm.rank("dp") == 0:
        comm.all_reduce(params[0].grad, "dp")


@pytest.mark.parametrize("wrong,message", [
    (avg_without_divide, r"holds the sum over the ranks, N = 2 times the mean: divide by N"),
    pytest.param(avg_calls_library, r"called the library's own .*average_gradients.* disables",
                 marks=pytest.mark.slow),  # the code swap is tested for rings, buckets, MLPs
    (avg_only_rank0, r"rank 0 waited in comm\.all_reduce\(over 'dp'\), its call 1 .*rank 1 had "
                     r"returned from your average_gradients after 0 calls"),
])
def test_average_checker_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        check_average_gradients(wrong, world_sizes=(2,), steps=1)


def f1b_wraps_the_library(rank, pp, m):
    from parallel_mini.parallel.schedules import one_f_one_b
    return [str(op) for op in one_f_one_b(pp, m)[rank]]


def test_one_f_one_b_refuses_a_wrapper_around_the_library(monkeypatch):
    import parallel_mini.runtime.launch
    from parallel_mini.course.grading import check_one_f_one_b
    from parallel_mini.parallel import schedules

    monkeypatch.setattr(parallel_mini.runtime.launch, "run", lambda *a, **k: pytest.fail("ran ranks"))
    code = schedules.one_f_one_b.__code__
    with pytest.raises(AssertionError, match=r"called one of the library's own schedules .* "
                                             r"disables"):
        check_one_f_one_b(f1b_wraps_the_library)
    assert schedules.one_f_one_b.__code__ is code
    assert len(schedules.one_f_one_b(2, 3)) == 2


class BucketedRight:
    """The lesson-02 exercise's answer: hooks pack gradients into buckets and launch each
    bucket's all-reduce as soon as it is full; finish_gradient_sync waits, divides, unpacks."""

    def __init__(self, params, comm, bucket_bytes):
        self.comm, self.n = comm, comm.size("dp")
        groups, current = [], []
        for p in reversed(params):
            current.append(p)
            if sum(q.numel() * 4 for q in current) >= bucket_bytes:
                groups.append(current)
                current = []
        groups += [current] if current else []
        self.buckets = []
        for ps in groups:
            offsets, lo = {}, 0
            for p in ps:
                offsets[p] = (lo, lo + p.numel())
                lo += p.numel()
            self.buckets.append({"params": ps, "offsets": offsets, "flat": torch.zeros(lo),
                                 "ready": 0, "handle": None})
        self.bucket_of = {p: b for b in self.buckets for p in b["params"]}
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def launch(self, b):
        b["handle"] = self.comm.all_reduce(b["flat"], "dp", async_op=True)

    def on_grad_ready(self, p):
        b = self.bucket_of[p]
        lo, hi = b["offsets"][p]
        b["flat"][lo:hi].copy_(p.grad.view(-1))
        b["ready"] += 1
        if b["ready"] == len(b["params"]):
            self.launch(b)

    def finish_gradient_sync(self):
        for b in self.buckets:
            b["handle"].wait()
            b["flat"] /= self.n
            for p in b["params"]:
                lo, hi = b["offsets"][p]
                p.grad.copy_(b["flat"][lo:hi].view_as(p))
            b["ready"], b["handle"] = 0, None


class BucketedLaunchedAfterBackward(BucketedRight):
    """Right numbers, no overlap: every bucket launched in finish_gradient_sync."""

    def launch(self, b):
        pass

    def finish_gradient_sync(self):
        for b in self.buckets:
            super().launch(b)
        super().finish_gradient_sync()


class BucketedLibrary:
    def __init__(self, params, comm, bucket_bytes):
        from parallel_mini.parallel.data import make_buckets
        self.buckets = make_buckets(params, bucket_bytes)

    def finish_gradient_sync(self):
        pass


def test_bucketed_checker_measures_overlap_and_accepts_the_answer():
    from parallel_mini.course.grading import check_bucketed_grad_sync
    grade = check_bucketed_grad_sync(BucketedRight, world_sizes=(2,), steps=1)
    assert grade.status == "correct", grade
    run = grade.details["runs"][0]
    assert run["all_reduces_per_step"] > 1 and run["launched_in_backward"] >= 1
    # measured: in flight while backward ran, the share overlapped, backward without the hooks
    assert 1 <= run["in_flight_in_backward"] <= run["all_reduces"]
    assert 0 < run["overlapped_share"] <= 1 and run["plain_backward_ms"] > 0
    assert run["written_bytes"] is None or 0 < run["written_bytes"] <= run["explained_bytes"]
    assert "none waited for inside a hook, and all-reduces in flight while backward still ran " \
           "(measured)" in grade.message


@pytest.mark.parametrize("wrong,message", [
    (BucketedLaunchedAfterBackward, r"none of your \d+ all-reduces was launched before backward "
                                    r"returned"),
    (BucketedLibrary, r"called the library's own bucketed data parallel .* disables"),
])
def test_bucketed_checker_names_the_mistake(wrong, message):
    from parallel_mini.course.grading import check_bucketed_grad_sync
    with pytest.raises(AssertionError, match=message):
        check_bucketed_grad_sync(wrong, world_sizes=(2,), steps=1)


def test_compare_prediction_says_right_off_or_only_the_value():
    from parallel_mini.course.grading import compare_prediction
    assert compare_prediction(None, 24, "bytes", "counted", "2(N-1)/N x S").startswith(
        "bytes: counted 24 (2(N-1)/N x S). Write your prediction")
    assert compare_prediction(24, 24.0, "bytes").endswith("You predicted 24: right.")
    assert compare_prediction(12, 24, "bytes").endswith("You predicted 12, off: 0.5 times the "
                                                        "value above.")
    # plain words whatever the source says (no "x the your ... says value")
    assert "x the" not in compare_prediction(2, 4, "bytes", "theory")
    line = compare_prediction("faster", "about the same", "ring against gloo", "measured",
                              "within 10%: about the same", choices=("slower", "about the same",
                                                                     "faster"))
    assert line.startswith("ring against gloo: 'about the same', by what the run measured (the "
                           "rule: within 10%: about the same)"), line
    assert "measured about the same" not in line
    choices = ("slower", "about the same", "faster")
    assert compare_prediction("Slower", "slower", "ring", choices=choices).endswith("right.")
    assert compare_prediction("faster", "slower", "ring", choices=choices).endswith("not what happened.")
    assert "not one of the choices" in compare_prediction("tree", "slower", "ring", choices=choices)
    assert "is not a number" in compare_prediction("many", 3, "steps")


def mlp_all_reduce_on_rank1_only(x, w1, b1, w2, b2, comm):
    y = F.gelu(x @ w1.T + b1) @ w2.T
    if comm.rank("tp") == 1:
        comm.all_reduce(y, "tp")
    return y + b2


def mlp_with_the_library_g(x, w1, b1, w2, b2, comm):
    from parallel_mini.parallel.tensor import reduce_from_tp
    return reduce_from_tp(F.gelu(x @ w1.T + b1) @ w2.T, comm) + b2


@pytest.mark.parametrize("wrong,message", [
    (mlp_all_reduce_on_rank1_only, r"deadlock: rank 0 had returned from your parallel_mlp after 0 "
                                   r"calls; rank 1 waited in comm\.all_reduce"),
    pytest.param(mlp_with_the_library_g, r"called the library's own tensor parallelism .* disables",
                 marks=pytest.mark.slow),
])
def test_mlp_checker_names_the_mistake(wrong, message):
    from parallel_mini.parallel import tensor
    code = tensor.reduce_from_tp.__code__
    with pytest.raises(AssertionError, match=message):
        check_parallel_mlp(wrong, world_sizes=(2,))
    assert tensor.reduce_from_tp.__code__ is code


def zero1_with_the_library(flat_params, flat_grads, step_shard, comm):
    from parallel_mini.parallel.zero import ZeroDataParallel
    ZeroDataParallel(None, comm, 1)


@pytest.mark.slow  # the same code swap as the rings', buckets' and 1F1B's (tested by default)
def test_zero1_checker_refuses_the_library():
    from parallel_mini.parallel import zero
    code = zero.ZeroDataParallel.step.__code__
    with pytest.raises(AssertionError, match=r"called the library's own ZeRO .* disables"):
        check_zero1_step(zero1_with_the_library, world_sizes=(2,))
    assert zero.ZeroDataParallel.step.__code__ is code


# ---------------------------------------------------------------------------------------------
# lessons 06, 07: the learner's function inside the library's code on real ranks; one rank that
# diverges (raises, or never returns) stops the check within 10 s with who was where (issue 15)
# ---------------------------------------------------------------------------------------------
from parallel_mini.course.grading import ROUTE_RUN_CASES  # noqa: E402

ROUTE_CASE_2 = ROUTE_RUN_CASES[0]  # dp = ep = 2: the smallest run


def _on_rank(r, wrong, right):
    """A learner's function that is `right` except on global rank r of a check's ranks (and
    right in the checker's own process, so that the in-process probes pass)."""
    def fn(*args):
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_rank() == r:
            return wrong(*args)
        return right(*args)
    return fn


@pytest.fixture(scope="module")
def started_ranks():
    """One rank run before the timed checks: the launcher's forkserver imports torch once per
    process (2-7 s on this machine, paid by whatever test runs ranks first), so the tests time
    the check itself, as a lesson's later check cells are."""
    from parallel_mini.runtime.launch import run_ranks
    assert run_ranks(abs, 1, -1)[0].value == 1


def _never_returns(*args):
    import time
    time.sleep(60)  # the launcher ends the rank when the check stops


def _raises(*args):
    raise ValueError("only here")


def test_a_merge_raising_on_one_rank_is_named_with_that_rank(started_ranks):
    from parallel_mini.course.grading import check_merge
    t0 = time.perf_counter()
    with pytest.raises(AssertionError, match=r"^at C=2 \(contiguous\), rank 1: your merge raised "
                                             r"ValueError: only here$"):
        check_merge(_on_rank(1, _raises, merge_right), cases=((2, "contiguous"),))
    assert time.perf_counter() - t0 < 10


@pytest.mark.slow  # the same trace as the route's hang below (tested by default)
def test_a_merge_that_never_returns_on_one_rank_stops_within_10_s(started_ranks):
    from parallel_mini.course.grading import check_merge
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as err:
        check_merge(_on_rank(1, _never_returns, merge_right), cases=((2, "contiguous"),))
    assert time.perf_counter() - t0 < 10
    text = str(err.value)
    assert "Timed out" not in text and "GLHF" not in text, text
    assert re.search(r"stopped after 5 s of waiting for a rank that never left your merge.*"
                     r"rank 0 waited in .*ring attention with your merge; rank 1 was still "
                     r"running your merge \(its call 1 of it on that rank\)", text), text


def test_a_route_that_never_returns_on_one_rank_stops_within_10_s_saying_where(started_ranks):
    from parallel_mini.course.grading import check_route
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as err:
        check_route(_on_rank(1, _never_returns, route_right), capacity_right,
                    cases=(ROUTE_CASE_2,))
    assert time.perf_counter() - t0 < 10
    text = str(err.value)
    assert "Timed out" not in text and "GLHF" not in text, text
    # rank 0 went on to the first MoE layer's exchange of row counts, and waits there for rank 1
    assert re.search(r"^stopped after 5 s of waiting for a rank that never left your route \(a "
                     r"loop that never ends, or a wait in it\): rank 0 waited in comm\.all_to_all"
                     r"\(over '\w+', MoE layer \d+ counts\), its call \d+ in the training run "
                     r"with your route; rank 1 was still running your route \(its call 1 of it on "
                     r"that rank\)", text), text


@pytest.mark.slow  # the same wrapper as the merge's (tested by default)
def test_a_route_raising_on_one_rank_or_calling_a_collective_is_named():
    import torch.distributed as dist
    from parallel_mini.course.grading import check_route

    def route_all_reduces(logits, k, cap):
        dist.all_reduce(logits)
        return route_right(logits, k, cap)

    with pytest.raises(AssertionError, match=r"^at dp=2 x ep=2 .*, rank 1: your route raised "
                                             r"ValueError: only here$"):
        check_route(_on_rank(1, _raises, route_right), capacity_right, cases=(ROUTE_CASE_2,))
    with pytest.raises(AssertionError, match=r"your route called dist\.all_reduce: it gets this "
                                             r"rank's tensors only"):
        check_route(_on_rank(0, route_all_reduces, route_right), capacity_right,
                    cases=(ROUTE_CASE_2,))


@pytest.mark.slow  # 1-2 s; the comparison is tested by default (route_token_major_on_ranks_only)
def test_a_route_keeping_other_counts_on_one_rank_is_named_at_that_rank():
    """Rank 1 keeps every assignment: the ranks' all-to-alls still agree (each layer exchanges its
    rows per expert before the rows), and the earliest difference is named, on rank 1, not the
    later ones it causes on rank 0 through the gradient sync."""
    from parallel_mini.course.grading import check_route
    with pytest.raises(AssertionError, match=r"^at dp=2 x ep=2 .*: rank 1, step 0, layer 0: with "
                                             r"your route the experts kept"):
        check_route(_on_rank(1, route_drops_nothing, route_right), capacity_right,
                    cases=(ROUTE_CASE_2,))
