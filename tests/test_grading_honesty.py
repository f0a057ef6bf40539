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

from test_grading import BucketedRight, _ring, avg_right, mlp_right, zero1_right

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
    torch.distributed.reduce_scatter_tensor(g, flat_grads, group=_group(comm, "dp"))
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


@pytest.mark.parametrize("check,right,bypass,kwargs", [
    (check_ring_all_reduce, None, ring_bypass, dict(cases=((2, 5),))),
    (check_average_gradients, None, avg_bypass, dict(world_sizes=(2,), steps=1)),
    (check_zero1_step, None, zero1_bypass, dict(world_sizes=(2,), steps=1)),
    (check_parallel_mlp, mlp_right, mlp_bypass, dict(world_sizes=(2,))),
    (check_bucketed_grad_sync, None, BucketedBypass, dict(world_sizes=(2,), steps=1)),
])
def test_the_process_group_bypass_is_refused_on_the_bytes_written(check, right, bypass, kwargs):
    if right is not None:  # the honest answer's bytes are explained (the others: test_grading)
        grade = check(right, **kwargs)
        assert grade.status == "correct", grade
        run = grade.details["runs"][0]
        if run["written_bytes"] is not None:
            assert 0 < run["written_bytes"] <= run["explained_bytes"]
    with pytest.raises(AssertionError, match=BYPASS):
        check(bypass, **kwargs)
