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
