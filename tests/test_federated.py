"""Federated averaging (--federated, parallel/federated.py): equal to its single-process twin
(reference.simulate_federated) round by round, clients' losses and drift included, at 1, 2 and 4
ranks; the weights' all-reduce the only traffic (counted = theory, written to the sockets within
gloo's headers), no record carrying anything else; a non-IID corpus whose skew is measurable in
the tokens; every layout but --dp refused."""
import sys

import pytest

from parallel_mini import theory
from parallel_mini.runtime.cli import _summary
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.course.experiments import fedavg_rounds_to_target, rounds_to_target
from parallel_mini.data import client_mixture, client_shard, client_size, successor_table
from parallel_mini.runtime.launch import run
from parallel_mini.parallel.federated import sample_clients, weighted_average
from parallel_mini.reference import simulate_federated

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOY = dict(layers=1, d_model=32, heads=2, seq=16, vocab=64, batch=4)


def config(**kw) -> RunConfig:
    kw = {**TOY, "federated": True, "clients": 4, "clients_per_round": 3, "local_steps": 2,
          "rounds": 2, "non_iid": 2.0, "reference": True, **kw}
    return RunConfig(**kw)


def check(report) -> None:
    assert report.max_abs_diff <= 1e-5, report.max_abs_diff_detail
    cfg = RunConfig.from_dict(report.config)
    twin = simulate_federated(cfg)
    fed = report.extra["federated"]
    assert len(fed["rounds"]) == cfg.rounds
    for r, got in enumerate(fed["rounds"]):
        assert got["sampled"] == sample_clients(cfg, r)
        assert got["union_loss"] == pytest.approx(twin["losses"][r], abs=1e-5)
        assert got["clients_loss"] == pytest.approx(twin["clients_loss"][r], abs=1e-5)
        assert sorted(got["drift"]) == sorted(str(k) for k in twin["drift"][r])
        for k, d in twin["drift"][r].items():
            assert got["drift"][str(k)] == pytest.approx(d, abs=1e-5), (r, k)
    assert fed["client_sizes"] == [client_size(cfg, k) for k in range(cfg.clients)]
    for rank in fed["network"]:
        sent = rank["weights_bytes_per_round"]
        assert sent["counted"] == pytest.approx(sent["theory"], abs=0.5)
        if sent["measured"] is not None and sys.platform.startswith("linux") and sent["counted"]:
            assert sent["measured"] == pytest.approx(sent["counted"], rel=0.03)
        assert rank["data_bytes_sent"] == 0


def test_federated_two_ranks_equals_its_simulation():
    """4 clients on 2 ranks (two each), 3 sampled per round, 2 local steps, 2 rounds."""
    report = run(config(dp=2))
    check(report)
    assert "federated: 3 of 4 clients a round, 2 local step(s) each" in _summary(report)
    assert [r["clients"] for r in report.extra["federated"]["network"]] == [[0, 2], [1, 3]]


def test_federated_four_ranks_uneven_hosts():
    """6 clients on 4 ranks (2, 2, 1, 1 of them), 3 sampled a round: a rank may have none."""
    report = run(config(dp=4, clients=6))
    check(report)
    assert [r["clients"] for r in report.extra["federated"]["network"]] == [[0, 4], [1, 5], [2], [3]]


def _own_topic_transitions(cfg, k: int) -> float:
    """The share of client k's token transitions that its own topic's table allows."""
    table = successor_table(cfg.vocab, cfg.seed + 7_919 * (k + 1))  # [2, vocab]
    x, y = client_shard(cfg, k)
    allowed = (table[0][x] == y) | (table[1][x] == y)
    return allowed.float().mean().item()


def test_non_iid_corpus_skews_each_client_towards_its_own_topic():
    """A = 0: every client the same mixture (1/K each), about 1/K of its transitions its own
    topic's (plus chance agreement); A = 1000: nearly all of them. Seeded: the same twice."""
    iid, skewed = RunConfig(**TOY, clients=4), RunConfig(**TOY, clients=4, non_iid=1000.0)
    for k in range(4):
        assert client_mixture(iid, k) == [0.25] * 4
        assert client_mixture(skewed, k)[k] > 0.99
        assert _own_topic_transitions(iid, k) < 0.6
        assert _own_topic_transitions(skewed, k) > 0.99
    assert (client_shard(skewed, 1)[0] == client_shard(skewed, 1)[0]).all()
    middle = RunConfig(**TOY, clients=4, non_iid=1.0)
    assert sum(client_mixture(middle, k)[k] for k in range(4)) / 4 > 0.25  # leans, on average


def test_server_samples_c_distinct_clients_seeded_by_round():
    cfg = config(clients=8, clients_per_round=3)
    draws = [sample_clients(cfg, r) for r in range(6)]
    assert all(len(set(d)) == 3 and all(0 <= k < 8 for k in d) for d in draws)
    assert draws == [sample_clients(cfg, r) for r in range(6)] and len(set(map(tuple, draws))) > 1
    assert sample_clients(config(clients_per_round=0), 0) == [0, 1, 2, 3]


REFUSED = [
    (dict(tp=2), "--federated with --tp 2"), (dict(pp=2, layers=2), "--federated with --pp 2"),
    (dict(cp=2), "--federated with --cp 2"), (dict(dp=2, zero=1), "--federated with --zero 1"),
    (dict(dp=2, ep=2, experts=2), "--federated with --ep 2"),
    (dict(sync_every=2), "choose one of them"), (dict(grad_accum=2), "--grad-accum"),
    (dict(dp=8, batch=8), "--dp 8: more ranks than --clients 4"),
    (dict(clients_per_round=5), "--clients-per-round 5"), (dict(non_iid=-1.0), "--non-iid"),
    (dict(local_steps=0), "--local-steps 0"), (dict(clients=0), "--clients 0"),
]


@pytest.mark.parametrize("kw,reason", REFUSED)
def test_federated_refusals(kw, reason):
    with pytest.raises(ConfigError, match=reason) as e:
        RunConfig(**{"federated": True, **kw}).validate()
    assert "\n" not in str(e.value)


def test_rounds_set_the_steps():
    assert RunConfig(federated=True, rounds=5).steps == 5
    assert RunConfig(federated=True, steps=4).steps == 4  # --rounds 0: --steps rounds
    cfg = RunConfig(federated=True, rounds=5)
    assert RunConfig.from_dict(cfg.to_dict()).steps == 5


def test_rounds_to_target_and_the_round_formula():
    assert rounds_to_target([4.0, 3.5, 2.9, 2.5], 3.0) == 3
    assert rounds_to_target([4.0, 3.5], 3.0) is None
    predicted = theory.run_theory(config(dp=4), 0)  # a round: one all-reduce of fp32 weights
    assert predicted["wire_bytes_per_step"] == {"dp": theory.wire_bytes(
        "all_reduce", 4 * predicted["n_params"], 4)}


@pytest.mark.slow
def test_fedavg_experiment_rows():
    """The lesson's figure: one live run per (A, E); more local steps, fewer rounds to 3.0 here."""
    rows = fedavg_rounds_to_target(non_iid=(0.0,), local_steps=(1, 4), rounds=8)
    assert [(r["non_iid"], r["local_steps"]) for r in rows] == [(0.0, 1), (0.0, 4)]
    assert rows[1]["rounds_to_target"] is not None
    one, four = (r["rounds_to_target"] for r in rows)
    assert one is None or one > four
    assert all(len(r["union_loss"]) == 8 for r in rows)


# -- -m slow: 1, 2 and 4 ranks, several clients per rank, both optimizers, IID and not -------------
@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("kw", [dict(), dict(clients=8, clients_per_round=4, non_iid=10.0),
                                dict(clients=8, clients_per_round=0, non_iid=0.0, rounds=3),
                                dict(optimizer="sgd", lr=0.5, local_steps=3)])
def test_federated_matrix(dp, kw):
    check(run(config(dp=dp, **kw)))


@pytest.mark.slow
def test_federated_with_experts():
    """A mixture-of-experts model (its experts whole on every rank) trains apart too."""
    check(run(config(dp=2, layers=2, experts=2)))


def _unweighted_and_leaky(trained, sizes, sampled, like, comm, axis):
    """A learner's wrong server: the plain mean (data sizes ignored), and it ships a client's
    tokens too (a [B, seq] all-reduce)."""
    import torch
    comm.all_reduce(torch.zeros(4, 16), axis)  # "the data" (as many bytes as one client batch)
    total = torch.zeros_like(like)
    for w in trained.values():
        total += w
    comm.all_reduce(total, axis)
    return total / len(sampled)


@pytest.mark.slow
def test_the_aggregation_hook_and_what_catches_a_wrong_one():
    """launch.run(cfg, average_fn) puts a server's function in place of weighted_average: the
    library's own equals the simulation; an unweighted, leaky one is off and its leak is counted."""
    check(run(config(dp=2), average_fn=weighted_average))
    wrong = run(config(dp=2), average_fn=_unweighted_and_leaky)
    assert wrong.max_abs_diff > 1e-4
    rounds = wrong.config["steps"]  # the run's whole count: 256 bytes a round
    for rank in wrong.extra["federated"]["network"]:
        assert rank["data_bytes_sent"] == rounds * 4 * 16 * 4
