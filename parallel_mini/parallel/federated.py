"""Federated averaging: clients train on data that never leaves them; a server averages weights.

McMahan et al., 2017, "Communication-efficient learning of deep networks from decentralized data"
(FedAvg). K clients each hold their own shard of the corpus (data.client_shard: a mixture of
topics skewed per client by --non-iid). One round:

    1. the server samples C of the K clients (a seeded draw: `sample_clients`)
    2. each sampled client starts from the server's weights w and takes E local optimizer steps
       (--local-steps) on batches of its own data, with an optimizer of its own that starts fresh
       every round (clients keep no state between rounds)           -> w_k
    3. the server averages, weighted by data size:  w <- sum_k n_k w_k / sum_k n_k

What crosses the network is weights, never data. Here the clients live on the --dp ranks (client k
on rank k mod dp, several per rank when K > dp) and the server is the all-reduce: each rank sums
n_k w_k over its own sampled clients, one all-reduce of that sum over dp (a rank without a sampled
client adds zeros), and every rank divides by sum_k n_k, so that every rank holds the server's
weights for the next round. Local SGD (local_sgd.py) is the special case of every client in every
round, identical data and E = H.

After each round the server's weights are evaluated on every client's whole shard; the run's loss
for a round is the loss over the union of all shards (sum_k n_k L_k / sum_k n_k). Client drift is
the distance |w_k - w| of each sampled client's weights from the average it joined. The
single-process twin is reference.simulate_federated; a run equals it to 1e-5.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Comm
from ..data import client_batch, client_mixture, client_shard, client_size, mix_seed
from ..mesh import rank_device
from ..meters import ActivationMeter, Timeline
from ..optim import make_optimizer
from .local_sgd import LocalSteps


def sample_clients(cfg, round_: int) -> list[int]:
    """The server's draw for a round: C of the K clients, without replacement, seeded by (seed,
    round) alone, so that every rank and the simulation draw the same ones."""
    g = torch.Generator().manual_seed(mix_seed(cfg.seed, 4, round_))
    c = cfg.clients_per_round or cfg.clients
    return sorted(torch.randperm(cfg.clients, generator=g)[:c].tolist())


def host(client: int, dp: int) -> int:
    """The dp rank a client lives on."""
    return client % dp


def weighted_average(trained: dict[int, torch.Tensor], sizes: list[int], sampled: list[int],
                     like: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    """The server's step: sum_k n_k w_k / sum_k n_k over the round's sampled clients. `trained`
    holds the flat weights ([P]) of the sampled clients on this rank only (none, on some ranks);
    one all-reduce over the axis adds every rank's partial sum. `like`: a [P] tensor to shape the
    zeros of a rank without a sampled client."""
    weighted = torch.zeros_like(like)  # [P]: sum of n_k w_k over this rank's sampled clients
    for k, w in trained.items():
        weighted += sizes[k] * w
    comm.all_reduce(weighted, axis)
    return weighted / sum(sizes[k] for k in sampled)


class FederatedAveraging(LocalSteps):
    """GradientStrategy: the sampled client's own optimizer (fresh each round), and the server's
    data-weighted average of the clients' weights over the dp axis. `aggregate_fn` replaces
    weighted_average (same arguments; a learner's exercise runs through here)."""

    def __init__(self, model, comm, cfg, axis: str = "dp", aggregate_fn=None):
        super().__init__(model, comm, cfg, axis)
        self.aggregate_fn = aggregate_fn or weighted_average

    def start_client(self) -> None:
        """A client's round starts with an optimizer of its own, without state."""
        self.optimizer = make_optimizer(self.cfg.optimizer, self.model.parameters(), self.cfg.lr,
                                        self.cfg.precision)

    def aggregate(self, trained: dict[int, torch.Tensor], sizes: list[int], sampled: list[int],
                  like: torch.Tensor) -> None:
        """The server's weights := the aggregate of this round's clients, on every rank."""
        self.load_flat(self.aggregate_fn(trained, sizes, sampled, like, self.comm, self.axis))


class FederatedRounds:
    """StepRunner: one `train_step` is one round of FedAvg for the clients on this rank."""

    reference_per_microbatch = False

    def __init__(self, model: torch.nn.Module, comm: Comm, cfg, timeline: Timeline,
                 act: ActivationMeter):
        self.model, self.comm, self.cfg, self.timeline, self.act = model, comm, cfg, timeline, act
        self.axis = comm.mesh.axis_for("batch")
        self.dp, self.me = comm.size(self.axis), comm.rank(self.axis)
        self.sizes = [client_size(cfg, k) for k in range(cfg.clients)]  # n_k, known to the server
        self.own_topic = [client_mixture(cfg, k)[k] for k in range(cfg.clients)]  # q_k[k]
        self.mine = [k for k in range(cfg.clients) if host(k, self.dp) == self.me]
        self.shards = {k: client_shard(cfg, k) for k in self.mine}  # its clients' data, kept here
        self.log: list[dict] = []
        self.strategy: FederatedAveraging | None = None

    def attach(self, strategy: FederatedAveraging) -> None:
        self.strategy = strategy

    def train_step(self, round_: int, batch=None) -> float:
        """One round (`batch`, the engine's global batch, is not used: clients hold their own
        data). Returns the loss of the server's new weights on the union of every client's data."""
        strategy, cfg = self.strategy, self.cfg
        chosen = sample_clients(cfg, round_)
        server = strategy.flat()  # [P]: the weights every sampled client starts from
        trained: dict[int, torch.Tensor] = {}  # [P] each: this rank's sampled clients' weights
        train_loss: dict[int, float] = {}
        for k in (k for k in chosen if k in self.shards):
            strategy.load_flat(server)
            strategy.start_client()
            losses = [self._local_step(k, round_, e) for e in range(cfg.local_steps)]
            trained[k] = strategy.flat()
            train_loss[k] = sum(losses) / len(losses)
        with self.timeline.op("aggregate", round_):
            strategy.aggregate(trained, self.sizes, chosen, server)
        average = strategy.flat()
        clients_loss = self._evaluate(round_)
        union = sum(n * x for n, x in zip(self.sizes, clients_loss)) / sum(self.sizes)
        self.log.append({"round": round_, "sampled": chosen, "clients_loss": clients_loss,
                         "union_loss": union, "train_loss": train_loss,
                         "drift": {k: (w - average).norm().item() for k, w in trained.items()}})
        return union

    def _local_step(self, client: int, round_: int, local_step: int) -> float:
        x, y = (t.to(rank_device()) for t in
                client_batch(self.cfg, client, self.shards[client], round_, local_step))  # [B, s]
        self.strategy.zero_grad()
        with self.timeline.op("forward", round_, local_step, client=client), self.act.forward():
            loss = self.model(x, y)
        with self.timeline.op("backward", round_, local_step, client=client):
            loss.backward()
        with self.timeline.op("optimizer", round_, local_step, client=client):
            self.strategy.step()
        return loss.item()

    @torch.no_grad()
    def _evaluate(self, round_: int) -> list[float]:
        """Every client's loss under the server's weights, each on its whole shard: this rank's
        clients here, the others' by a sum over dp (a metric, not training traffic: it bypasses
        the comm records, as the engine's loss log does)."""
        losses = torch.zeros(self.cfg.clients, dtype=torch.float64, device=rank_device())
        with self.timeline.op("evaluate", round_):
            for k, (x, y) in self.shards.items():
                losses[k] = self.model(x.to(rank_device()), y.to(rank_device())).item()
        if self.dp > 1:
            dist.all_reduce(losses, group=self.comm.mesh.groups[self.axis])
        return losses.tolist()

    def activation_peak(self) -> int:
        return self.act.peak  # a local step's forward, in the metered (last) round

    def report(self) -> dict:
        return {"federated": {"clients": self.mine, "sizes": self.sizes,
                              "own_topic_share": self.own_topic, "rounds": self.log}}


def summary(report) -> dict:
    """What a federated run's report adds (RunReport.extra["federated"]): per round the sampled
    clients, every client's loss and the union's, each sampled client's training loss and drift
    (gathered from the ranks that host them); and what crossed the network, rank by rank: per
    round the weights' all-reduce, counted from the comm records, predicted and written to the
    sockets; over the whole run the bytes of every record that is not a whole set of weights (P
    elements), a bound on the client data that left its rank (counted: zero); and, for
    comparison, a server-and-clients deployment's bytes per round (theory)."""
    cfg = report.config
    rounds = [dict(r, drift={}, train_loss={}) for r in report.ranks[0]["federated"]["rounds"]]
    for rank in report.ranks:
        for merged, mine in zip(rounds, rank["federated"]["rounds"]):
            merged["drift"].update(mine["drift"])
            merged["train_loss"].update(mine["train_loss"])
    for r in rounds:  # JSON keys are strings: clients in order
        r["drift"] = {str(k): r["drift"][k] for k in sorted(r["drift"], key=int)}
        r["train_loss"] = {str(k): r["train_loss"][k] for k in sorted(r["train_loss"], key=int)}
    n_params = report.theory["n_params"]
    sampled = cfg["clients_per_round"] or cfg["clients"]
    network = []
    for r in range(report.world_size):
        counted = report.wire_bytes_per_step(r)
        network.append({
            "rank": r, "clients": report.ranks[r]["federated"]["clients"],
            "weights_bytes_per_round": {
                "counted": counted.get("dp", 0),
                "theory": report.theory["wire_bytes_per_step"].get("dp", 0),
                "measured": report.wire_bytes_per_step(r, kind="measured").get("dp", 0)},
            "data_bytes_sent": sum(rec["payload_bytes"] for rec in report.ranks[r]["comm"]
                                   if rec["step"] >= 0 and rec["count"] != n_params)})
    return {"clients": cfg["clients"], "clients_per_round": sampled,
            "local_steps": cfg["local_steps"], "non_iid": cfg["non_iid"],
            "client_sizes": report.ranks[0]["federated"]["sizes"],
            "own_topic_share": report.ranks[0]["federated"]["own_topic_share"],
            "rounds": rounds, "network": network,
            "server_and_clients_bytes_per_round": 2 * sampled * 4 * n_params}

