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
