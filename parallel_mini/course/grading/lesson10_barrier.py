"""Lesson 10 (10_without_a_barrier): federated averaging's server, `check_server_average`.

The learner writes the server's weighted average of one FedAvg round (the library's is
parallel/federated.weighted_average): every rank holds the weights of its own sampled clients only,
and the result, the same on every rank, is sum_k n_k w_k / sum_k n_k over the round's sampled
clients. First one call in this process (one rank: its all-reduce adds nothing), naming the usual
mistakes; then whole federated runs on real ranks with the learner's function in the library's
place, against the single-process simulation (reference.simulate_federated), computed on rank 0
after the last round.
"""
from __future__ import annotations

import os

from ...config import RunConfig
from .core import (CHECK_PG_TIMEOUT, Grade, _CodeSwapped, _RankTrace, _SocketBytes,
                   _call_in_time, _library_copy, _on_ranks, _wire_allowance, GLOO_CONNECT)

# Whole FedAvg runs: unequal client sizes (B to 4B sequences each), clients sampled per round,
# several clients per rank, and (dp 3, C 2) ranks whose clients were not sampled in a round.
SERVER_AVERAGE_CASES = (dict(dp=2, clients=4, clients_per_round=3),
                        dict(dp=3, clients=5, clients_per_round=2))
# SGD: Adam's first step from a fresh state is about lr x sign(g), which turns the rounding of a
# sum taken in another order (the ranks' all-reduce, the learner's loop) into steps of lr on
# near-zero gradients (1e-5 apart at lr 1e-2, measured); SGD keeps such differences at 4e-7
SERVER_AVERAGE_COMMON = dict(federated=True, local_steps=2, rounds=3, non_iid=5.0, batch=4,
                             layers=1, d_model=32, heads=2, seq=16, vocab=64, optimizer="sgd",
                             lr=0.3)
SERVER_AVERAGE_TOLERANCE = 1e-5
_STUB = ("server_average still raises NotImplementedError: write the weighted average, then run "
         "this cell again.")


def _library_refused(trained, sizes, chosen, start, comm, axis):
    """Swapped in for the code of the library's federated.weighted_average while the learner's runs
    (a literal message: the code object runs with the library module's globals)."""
    raise AssertionError("your server_average called the library's own "
                         "(parallel_mini.parallel.federated.weighted_average), which the checker "
                         "disables while it runs yours: write the average yourself")


class _LibraryAverageDisabled(_CodeSwapped):
    def swaps(self):
        from ...parallel import federated
        return [(federated.weighted_average, _library_refused)]


class _OneRank:
    """A stand-in for Comm on one rank: its all-reduce over a group of one adds nothing (an answer
    that needs more of Comm than this is tried on the ranks alone)."""

    def __init__(self):
        self.all_reduces = 0

    def all_reduce(self, tensor, axis, **tags):
        self.all_reduces += 1
        return tensor

    def size(self, axis):
        return 1


def _probe(fn) -> None:
    """One call in this process, all sampled clients on this one rank, sizes and weights drawn
    anew every check: the mistakes named. Raises NotImplementedError (the stub) or AssertionError."""
    import torch

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(6), "little"))
    K, P = 6, 7
    sizes = [int(x) for x in torch.randint(1, 9, (K,), generator=g)]
    while len(set(sizes)) < 3:
        sizes = [int(x) for x in torch.randint(1, 9, (K,), generator=g)]
    chosen = sorted(torch.randperm(K, generator=g)[:4].tolist())
    start = torch.randn(P, generator=g)
    trained = {k: start + torch.randn(P, generator=g) for k in chosen}
    comm = _OneRank()
    args = ({k: w.clone() for k, w in trained.items()}, list(sizes), list(chosen), start.clone(),
            comm, "dp")
    where = "on one rank (every sampled client here)"
    with _LibraryAverageDisabled():
        try:
            got = _call_in_time(fn, *args, what=f"{where}: your server_average")
        except AssertionError as err:
            if " raised " in str(err) and "library's own" not in str(err):
                return  # (e.g. it used more of comm than this stand-in has): the ranks will say
            raise
    if not isinstance(got, torch.Tensor) or got.shape != start.shape:
        raise AssertionError(f"{where}: server_average must return the flat weights, a tensor "
                             f"of shape {list(start.shape)} like `start`; it returned "
                             + (f"shape {list(got.shape)}" if isinstance(got, torch.Tensor)
                                else type(got).__name__))
    # the expected answers, computed only now that the learner's function has returned
    total = sum(sizes[k] for k in chosen)
    want = sum(sizes[k] * trained[k] for k in chosen) / total

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    if close(got, want):
        return
    wrong = {
        "the plain mean of the clients' weights: FedAvg weighs client k by its data, n_k (a "
        "client with 4 times the data counts 4 times)":
            sum(trained[k] for k in chosen) / len(chosen),
        "the sum of n_k w_k divided by the data of all K clients: only the sampled clients' "
        "n_k add up to the denominator":
            sum(sizes[k] * trained[k] for k in chosen) / sum(sizes),
        "the weighted sum of the clients' weights, never divided by sum_k n_k":
            sum(sizes[k] * trained[k] for k in chosen),
        "the start weights: the clients' trained weights are what is averaged":
            start,
    }
    for why, value in wrong.items():
        if close(got, value):
            raise AssertionError(f"{where}: your server_average returned {why}")
    raise AssertionError(f"{where}: your server_average differs from sum_k n_k w_k / sum_k n_k "
                         f"over the sampled clients by up to {(got - want).abs().max().item():.2e}")


def _average_rank(cfg_dict: dict, fn) -> dict:
    """One rank of a federated run (engine.train_rank) with the learner's function in place of
    federated.weighted_average (the engine's `average_fn` hook; the library's own disabled); the
    bytes this process wrote to its sockets while the learner's function ran, beside what its
    comm calls recorded explain."""
    import torch
    import torch.distributed as dist

    from ... import engine

    cfg = RunConfig.from_dict(cfg_dict)
    rank = dist.get_rank()
    where = f"at dp={cfg.dp}, K={cfg.clients}, C={cfg.clients_per_round}, rank {rank}"
    trace = _RankTrace("the federated run with your server_average")
    written, state = _SocketBytes(), {"calls": 0, "explained": 0, "records": 0, "results": []}

    def learners_average(trained, sizes, chosen, start, comm, axis):
        before = len(comm.records)
        try:
            with written:
                out = fn(trained, sizes, chosen, start, comm, axis)
        except (AssertionError, NotImplementedError):
            raise
        except Exception as e:  # noqa: BLE001 - the learner's code: say what it raised
            hint = ("" if not any(w in str(e) for w in ("mismatch", "reset", "closed", "imed out"))
                    else " (every rank must make the same calls: a rank none of whose clients "
                    "was sampled this round, `trained` empty, still joins the all-reduce)")
            raise AssertionError(f"{where}: your server_average raised {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}{hint}") from None
        for rec in comm.records[before:]:
            state["explained"] += _wire_allowance(rec, comm.size(rec["group"]))
            state["records"] += 1
        state["calls"] += 1
        if not isinstance(out, torch.Tensor) or out.shape != start.shape:
            raise AssertionError(f"{where}: server_average must return a tensor of shape "
                                 f"{list(start.shape)} like `start`")
        state["results"].append(out.detach().clone())
        return out

    with _LibraryAverageDisabled(), trace:  # the engine's hook: the server's step is the learner's
        out = engine.train_rank(cfg_dict, average_fn=learners_average)
    # every rank must hold the same server weights after every round: gathered after the run
    mine = torch.stack(state["results"])  # [rounds, P]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    out["average_check"] = {"calls": state["calls"], "records": state["records"],
                            "written": written.total, "explained": state["explained"],
                            "ranks_disagree_by": max((e - mine).abs().max().item()
                                                     for e in every)}
    return out


def _case_name(cfg) -> str:
    return (f"dp={cfg.dp}, K={cfg.clients} clients, C={cfg.clients_per_round} a round, "
            f"E={cfg.local_steps}")


def check_server_average(fn, cases=SERVER_AVERAGE_CASES) -> Grade:
    """`fn(trained, sizes, chosen, start, comm, axis) -> Tensor [P]` is FedAvg's server for one
    round, called on every rank: `trained` {client: flat weights [P]} holds this rank's sampled
    clients only (empty when none of its clients was sampled), `sizes` every client's n_k,
    `chosen` the round's sampled clients (all ranks), `start` the weights the round began from
    ([P]), `comm` and `axis` the data-parallel group. It returns sum_k n_k w_k / sum_k n_k over
    `chosen`, the same on every rank.

    One call in this process first (weights and sizes drawn anew every check; 10 s at most),
    naming the usual mistakes (the plain mean, the wrong denominator, no division). Then whole
    federated runs on real ranks at each case of `cases`, `fn` in place of the library's
    federated.weighted_average (the library's own disabled: an answer that calls it is refused, and
    so is the library's function itself): every rank must hold the same weights after every
    round; the bytes the ranks wrote to their sockets while `fn` ran must be explained by its
    calls recorded through `comm`; the losses and final parameters must equal the
    single-process simulation, computed on rank 0 after the last round. A rank that skips the
    all-reduce (no sampled client this round) leaves the others waiting: named within
    CHECK_PG_TIMEOUT seconds."""
    from ...runtime.launch import run_ranks
    from ...report import merge_rank_results

    _library_copy(fn, ("parallel.federated", "course.grading.lesson10_barrier"), "your")
    try:
        _probe(fn)
    except NotImplementedError:
        return Grade("not attempted", _STUB)
    summary = []
    for case in cases:
        cfg = RunConfig(**{**SERVER_AVERAGE_COMMON, **case}, reference=True).validate()
        name = _case_name(cfg)
        results = _on_ranks(lambda: run_ranks(_average_rank, cfg.world_size, cfg.to_dict(), fn,
                                              timeout=120.0, pg_timeout=CHECK_PG_TIMEOUT),
                            _STUB, f"at {name}")
        if isinstance(results, Grade):
            return results
        per_rank = [res.value for res in results]
        report = merge_rank_results(cfg, per_rank)
        checks = [r["average_check"] for r in per_rank]
        if any(c["calls"] != cfg.rounds for c in checks):  # the seam was not used: a checker bug
            raise AssertionError(f"at {name}: your server_average ran "
                                 f"{[c['calls'] for c in checks]} times on the ranks, not "
                                 f"{cfg.rounds} each: the checker could not put it in place")
        if any(c["records"] == 0 for c in checks):
            raise AssertionError(f"at {name}: your server_average made no call through comm on "
                                 f"some rank: each rank holds only its own clients' weights, so "
                                 f"the ranks must add their sums (one all-reduce over `axis`)")
        spread = max(c["ranks_disagree_by"] for c in checks)
        if not spread <= SERVER_AVERAGE_TOLERANCE:
            raise AssertionError(f"at {name}: the ranks' server weights differ by up to "
                                 f"{spread:.2e} after a round: every rank must return the same "
                                 f"average (each holds only its own clients' weights)")
        written = [c["written"] for c in checks]
        if all(w is not None for w in written):
            explained = sum(c["explained"] for c in checks) + GLOO_CONNECT * len(checks)
            if sum(written) > explained:
                raise AssertionError(
                    f"at {name}: while your server_average ran, the ranks wrote {sum(written):,} "
                    f"bytes to their sockets (measured), but its calls recorded by comm explain "
                    f"at most {explained:,}: make every transfer through comm, so it is recorded")
        diff = report.max_abs_diff
        if not diff <= SERVER_AVERAGE_TOLERANCE:
            raise AssertionError(f"at {name}: the run with your server_average differs from the "
                                 f"single-process FedAvg simulation by {diff:.2e} (losses and "
                                 f"final weights; tolerance {SERVER_AVERAGE_TOLERANCE:.0e}): is the "
                                 f"denominator the data of every sampled client, on every rank "
                                 f"(sum of sizes[k] over `chosen`)?")
        summary.append({"case": name, "config": cfg.to_dict(), "report": report,
                        "max_abs_diff": diff, "written": sum(written) if all(
                            w is not None for w in written) else None,
                        "comm_records_per_rank": [c["records"] for c in checks]})
    worst = max(row["max_abs_diff"] for row in summary)
    return Grade("correct", "your server_average trained federated averaging on real ranks equal "
                 f"to the single-process simulation (losses and final weights, max |diff| "
                 f"{worst:.1e}) at " + "; ".join(row["case"] for row in summary)
                 + "; every rank held the same weights after every round; the library's own "
                 "weighted_average disabled while yours ran", {"runs": summary})
