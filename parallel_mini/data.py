"""A deterministic synthetic language whose loss really falls.

Each token has two successors, fixed by the seed: the next token is the first with probability
3/4, the second with 1/4. A model that learns the table reaches the entropy of that choice,
H = -(3/4 ln 3/4 + 1/4 ln 1/4) ≈ 0.562 nats, starting from ln(vocab) (4.85 for 128 tokens):
a curve worth watching within a few dozen steps.

Batches are a pure function of (seed, step): every rank and the single-process reference build
the same global batch and take their own slice of it. No data loader, no shuffling state.
"""
from __future__ import annotations

import math
import random

import torch

P_FIRST = 0.75
ENTROPY_FLOOR = -(P_FIRST * math.log(P_FIRST) + (1 - P_FIRST) * math.log(1 - P_FIRST))


def successor_table(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_007 * seed + 1)
    return torch.stack([torch.randperm(vocab, generator=g), torch.randperm(vocab, generator=g)])


def global_batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [batch, seq] int64: the whole step's data, identical everywhere."""
    table = successor_table(cfg.vocab, cfg.seed)
    g = torch.Generator().manual_seed(1_000_003 * cfg.seed + step)
    tokens = torch.empty(cfg.batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (cfg.batch,), generator=g)
    for t in range(cfg.seq):
        pick_second = (torch.rand(cfg.batch, generator=g) >= P_FIRST).long()
        tokens[:, t + 1] = table[pick_second, tokens[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def shard(batch: tuple[torch.Tensor, torch.Tensor], index: int, parts: int):
    """Rows [index*B/parts, (index+1)*B/parts) of a batch: a data-parallel rank's or a micro-batch's."""
    x, y = batch
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n], y[index * n:(index + 1) * n]


# ---------------------------------------------------------------------------------------------
# A corpus for federated learning: K clients whose data differ (parallel/federated.py)
# ---------------------------------------------------------------------------------------------
# The language above is one "topic". This corpus has K topics, one per client, each its own
# successor table. Every sequence is written in one topic; client k draws its sequences' topics from
# its own mixture q_k over the K topics, a Dirichlet draw whose skew is --non-iid A:
#     q_k ~ Dirichlet(1/A + [j = k] for each topic j)         (A = 0: q_k uniform, exactly)
# so client k's expected share of its own topic is (1 + A) / (K + A): 1/K at A = 0 (every client
# sees the same mixture), towards 1 as A grows (each client writes mostly its own topic). The usual
# Dirichlet split (Hsu et al., 2019) draws q_k ~ Dir(alpha); the extra 1 on the own topic makes
# "its own topic" well defined. Client k holds n_k = B x (1 to 4) sequences (B = --batch), so the
# server's weighting by data size matters. All of it is a pure function of (seed, k): a client's
# data never has to travel, every rank and the single-process simulation make the same shards.

def mix_seed(*numbers: int) -> int:
    """One 63-bit seed from several whole numbers (distinct tuples, distinct seeds in practice)."""
    out = 0
    for x in numbers:
        out = (out * 1_000_003 + x + 1) % 2 ** 63
    return out


def client_rng(cfg, client: int) -> random.Random:
    return random.Random(mix_seed(cfg.seed, client, 1))


def client_size(cfg, client: int) -> int:
    """n_k: how many sequences client k holds, B to 4B."""
    return cfg.batch * client_rng(cfg, client).randint(1, 4)


def client_mixture(cfg, client: int) -> list[float]:
    """q_k: client k's share of each of the K topics (sums to 1)."""
    k, a = cfg.clients, cfg.non_iid
    if a == 0:
        return [1 / k] * k
    rng = client_rng(cfg, client)
    rng.randint(1, 4)  # (the size's draw: the mixture comes after it)
    draws = [rng.gammavariate(1 / a + (j == client), 1.0) for j in range(k)]  # Dirichlet by Gammas
    return [d / sum(draws) for d in draws]


def client_shard(cfg, client: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [n_k, seq] int64: all of client k's data."""
    n = client_size(cfg, client)
    tables = torch.stack([successor_table(cfg.vocab, cfg.seed + 7_919 * (t + 1))
                          for t in range(cfg.clients)])  # [K, 2, vocab]: one table per topic
    g = torch.Generator().manual_seed(mix_seed(cfg.seed, client, 2))
    topic = torch.multinomial(torch.tensor(client_mixture(cfg, client)), n, replacement=True,
                              generator=g)  # [n]: each sequence's topic
    tokens = torch.empty(n, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (n,), generator=g)
    for t in range(cfg.seq):
        pick_second = (torch.rand(n, generator=g) >= P_FIRST).long()
        tokens[:, t + 1] = tables[topic, pick_second, tokens[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def client_batch(cfg, client: int, shard_: tuple, round_: int, local_step: int):
    """The B sequences of its shard client k trains on at `local_step` of round `round_`: a seeded
    draw without replacement (a pure function of the four numbers, like global_batch's)."""
    g = torch.Generator().manual_seed(mix_seed(cfg.seed, client, 3, round_, local_step))
    rows = torch.randperm(len(shard_[0]), generator=g)[:cfg.batch]
    return shard_[0][rows], shard_[1][rows]
