"""The exercise graders: a stub is "not attempted", a right answer passes, and each typical wrong
answer is refused with an AssertionError (a grader that accepts anything would be worse than none)."""
import pytest
import torch

from parallel_mini.comm import ring_all_reduce
import torch.nn.functional as F

from parallel_mini.grading import (check_average_gradients, check_parallel_mlp,
                                   check_ring_all_reduce, check_zero1_step)
from parallel_mini.parallel.data import average_gradients


def ring_stub(x, comm):
    raise NotImplementedError("exercise")


def ring_without_all_gather(x, comm):
    n, r = comm.size("dp"), comm.rank("dp")
    chunks = list(x.view(-1).tensor_split(n))
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        b = buf[:chunks[recv_i].numel()]
        comm.sendrecv(chunks[send_i], (r + 1) % n, b, (r - 1) % n, "dp")
        chunks[recv_i] += b


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
    (check_ring_all_reduce, ring_all_reduce, ring_stub, [ring_without_all_gather]),
    (check_average_gradients, average_gradients, avg_stub, [avg_without_divide]),
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
    from parallel_mini.grading import check_one_f_one_b
    assert check_one_f_one_b(f1b_stub).status == "not attempted"


@pytest.mark.parametrize("wrong,message", [
    (f1b_gpipe, r"rank 0 runs 4 forwards before its first backward; 1F1B warms up with p - 1 - r = 1"),
    (f1b_backward_first, r"deadlocks"),
    (f1b_missing_last_backward, r"missing"),
    (f1b_bad_token, r"is not an op"),
])
def test_one_f_one_b_refuses_wrong_orders_without_ranks(wrong, message, monkeypatch):
    import parallel_mini.engine
    from parallel_mini.grading import check_one_f_one_b

    def no_ranks(*args, **kwargs):
        raise RuntimeError("a structural refusal must not start any rank")

    monkeypatch.setattr(parallel_mini.engine, "run", no_ranks)
    with pytest.raises(AssertionError, match=message):
        check_one_f_one_b(wrong)


def test_one_f_one_b_correct_order_runs_on_ranks_and_equals_the_reference():
    from parallel_mini.grading import check_one_f_one_b
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
    import parallel_mini.engine
    from parallel_mini.grading import check_one_f_one_b

    def no_ranks(*args, **kwargs):
        raise RuntimeError("structural checks passed: the grader went on to run the order")

    monkeypatch.setattr(parallel_mini.engine, "run", no_ranks)
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
    from parallel_mini.grading import check_merge
    grade = check_merge(merge_stub)
    assert grade.status == "not attempted" and "NotImplementedError" in grade.message


@pytest.mark.parametrize("right", [merge_right, merge_right_with_max])
def test_merge_right_answers_equal_sdpa_on_real_ranks(right):
    from parallel_mini.grading import MERGE_CHECK_CASES, check_merge
    grade = check_merge(right)
    assert grade.status == "correct", grade
    runs = {(r["cp"], r["layout"]): r for r in grade.details["runs"]}
    assert set(runs) == set(MERGE_CHECK_CASES)
    # the learner's merge was what ran: once per computed tile on every rank
    assert runs[(4, "contiguous")]["merges_per_rank"] == [1, 2, 3, 4]
    assert runs[(4, "zigzag")]["merges_per_rank"] == [9, 9, 9, 9]
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
    import parallel_mini.launch
    from parallel_mini.grading import check_merge

    def no_ranks(*args, **kwargs):
        raise RuntimeError("a single-merge refusal must not start any rank")

    monkeypatch.setattr(parallel_mini.launch, "run_ranks", no_ranks)
    with pytest.raises(AssertionError, match=message):
        check_merge(wrong)


@pytest.mark.parametrize("wrong,message", [
    (merge_library_on_ranks_only, r"called the library's own merge"),
    (merge_wrong_on_ranks_only, r"at C=2 \(contiguous chunks\): rank 1's ring attention .*differs "
                                r"from torch SDPA"),
])
def test_merge_refused_on_real_ranks(wrong, message):
    from parallel_mini.grading import check_merge
    with pytest.raises(AssertionError, match=message):
        check_merge(wrong)


def test_library_merge_works_again_after_a_refusal():
    from parallel_mini.grading import check_merge
    from parallel_mini.parallel import context
    with pytest.raises(AssertionError):
        check_merge(merge_calls_library)
    lse, lse_t = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1)
    out, new = context._merge(torch.zeros(1, 1, 1, 1), lse, torch.ones(1, 1, 1, 1), lse_t)
    assert out.item() == pytest.approx(0.5) and new.item() == pytest.approx(0.6931, abs=1e-4)
