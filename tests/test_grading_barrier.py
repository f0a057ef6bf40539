"""Lesson 10's checker, check_server_average (course/grading/lesson10_barrier.py). Default: the
answers it refuses in this process, before any rank starts (a stub, the plain mean, the wrong
denominator, no division, the library's function and a call to it). -m slow: a right answer is
accepted on real ranks against the FedAvg simulation, and answers wrong only on the ranks (a
denominator of the rank's own clients, a rank that skips the all-reduce, the all-reduce around
comm) are refused with what went wrong."""
from __future__ import annotations

import pytest
import torch

from parallel_mini.course.grading import check_server_average
from parallel_mini.parallel import federated


def _summed(trained, sizes, start, comm, axis, weigh=True):
    """This rank's sum of n_k w_k (or of w_k), all-reduced over the axis."""
    s = torch.zeros_like(start)
    for k, w in trained.items():
        s += (sizes[k] if weigh else 1) * w
    comm.all_reduce(s, axis)
    return s


def right(trained, sizes, chosen, start, comm, axis):
    return _summed(trained, sizes, start, comm, axis) / sum(sizes[k] for k in chosen)


def plain_mean(trained, sizes, chosen, start, comm, axis):
    return _summed(trained, sizes, start, comm, axis, weigh=False) / len(chosen)


def all_clients(trained, sizes, chosen, start, comm, axis):
    return _summed(trained, sizes, start, comm, axis) / sum(sizes)


def undivided(trained, sizes, chosen, start, comm, axis):
    return _summed(trained, sizes, start, comm, axis)


def calls_the_library(trained, sizes, chosen, start, comm, axis):
    return federated.weighted_average(trained, sizes, chosen, start, comm, axis)


def stub(trained, sizes, chosen, start, comm, axis):
    raise NotImplementedError("exercise")


def test_a_stub_is_not_attempted():
    assert check_server_average(stub).status == "not attempted"


@pytest.mark.parametrize("answer, words", [
    (plain_mean, "plain mean"), (all_clients, "data of all K clients"),
    (undivided, "never divided"), (calls_the_library, "library's own"),
    (federated.weighted_average, "library's own")])
def test_wrong_answers_are_named_in_this_process(answer, words):
    with pytest.raises(AssertionError, match=words):
        check_server_average(answer)


@pytest.mark.slow
def test_a_right_answer_trains_equal_to_the_simulation():
    grade = check_server_average(right)
    assert grade.status == "correct", grade
    assert [min(r["comm_records_per_rank"]) >= 3 for r in grade.details["runs"]] == [True, True]
    assert all(r["max_abs_diff"] <= 1e-5 for r in grade.details["runs"])


def own_clients_only(trained, sizes, chosen, start, comm, axis):  # right on one rank only
    return _summed(trained, sizes, start, comm, axis) / max(1, sum(sizes[k] for k in trained))


def skips_without_clients(trained, sizes, chosen, start, comm, axis):
    return right(trained, sizes, chosen, start, comm, axis) if trained else start


def around_comm(trained, sizes, chosen, start, comm, axis):
    import torch.distributed as dist
    s = torch.zeros_like(start)
    for k, w in trained.items():
        s += sizes[k] * w
    dist.all_reduce(s, group=comm.mesh.groups[axis])
    return s / sum(sizes[k] for k in chosen)


@pytest.mark.slow
@pytest.mark.parametrize("answer, words", [
    (own_clients_only, "differs from the single-process FedAvg simulation"),
    (skips_without_clients, "rank"),
    (around_comm, "no call through comm")])
def test_answers_wrong_on_the_ranks_are_refused(answer, words):
    with pytest.raises(AssertionError, match=words):
        check_server_average(answer)
