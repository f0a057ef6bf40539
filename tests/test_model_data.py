"""The tiny GPT, the synthetic data and the memory meters against theory.py."""
from __future__ import annotations

import math

import pytest
import torch

from parallel_mini import theory
from parallel_mini.runtime import launch
from parallel_mini.config import RunConfig
from parallel_mini.data import ENTROPY_FLOOR, P_FIRST, global_batch, shard, successor_table
from parallel_mini.model import build_model
from parallel_mini.reference import train_reference

SMALL = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8, steps=2)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,seq,d_model,heads,layers", [
    (128, 32, 64, 4, 4), (50, 7, 24, 3, 1), (16, 4, 8, 1, 3), (64, 16, 32, 2, 2)])
def test_parameter_count_matches_theory(vocab, seq, d_model, heads, layers):
    cfg = RunConfig(vocab=vocab, seq=seq, d_model=d_model, heads=heads, layers=layers).validate()
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == \
        theory.gpt_param_count(vocab, seq, d_model, layers)


def test_parameter_count_by_hand():
    """The default model counted by hand, so that the formula itself is checked too:
    v*h + s*h + L(12h^2 + 13h) + 2h + h*v with v=128, s=32, h=64, L=4."""
    assert theory.gpt_param_count(128, 32, 64, 4) == 8192 + 2048 + 4 * (49152 + 832) + 128 + 8192
    assert sum(p.numel() for p in build_model(RunConfig()).parameters()) == 218_496


def test_same_seed_same_weights_other_seed_other_weights():
    cfg = RunConfig(**SMALL)
    a, b, c = build_model(cfg), build_model(cfg), build_model(cfg, seed=cfg.seed + 1)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_loss_really_falls():
    cfg = RunConfig(steps=40, layers=1, d_model=32, heads=2, seq=16, vocab=64, batch=8,
                    lr=1e-2).validate()
    losses, _ = train_reference(cfg)
    start = math.log(cfg.vocab)
    assert abs(losses[0] - start) < 0.2  # an untrained model is close to uniform
    assert losses[-1] < 0.5 * start, losses  # ~0.9 nats measured, from 4.16
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 2.0
    assert losses[-1] > ENTROPY_FLOOR - 0.15  # fresh data each step: no better than the source


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def test_batches_are_a_function_of_seed_and_step():
    cfg = RunConfig(**SMALL)
    x1, y1 = global_batch(cfg, 3)
    x2, y2 = global_batch(cfg, 3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (cfg.batch, cfg.seq) and x1.dtype == torch.long
    assert not torch.equal(global_batch(cfg, 4)[0], x1)
    assert not torch.equal(global_batch(cfg.replace(seed=1), 3)[0], x1)
    # the layout does not change the data: a dp=4 run sees the same global batch
    assert torch.equal(global_batch(cfg.replace(dp=4), 3)[0], x1)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # targets are the next tokens


def test_data_follows_the_successor_table():
    cfg = RunConfig(vocab=32, seq=64, batch=64).validate()
    table = successor_table(cfg.vocab, cfg.seed)
    x, y = global_batch(cfg, 0)
    first, second = table[0][x], table[1][x]
    assert bool(((y == first) | (y == second)).all())
    frac = (y == first).float().mean().item()
    assert abs(frac - P_FIRST) < 0.03, frac  # 4096 draws: sd ~0.007


def test_shards_partition_the_batch():
    cfg = RunConfig(**SMALL)
    x, y = global_batch(cfg, 1)
    parts = [shard((x, y), i, 4) for i in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert all(p[0].shape[0] == 2 for p in parts)


# ---------------------------------------------------------------------------------------------
# measured model-state bytes == the formula, to the byte, in real runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp,optimizer", [(1, "adam"), (2, "adam"), (4, "adam"), (2, "sgd")])
def test_model_state_bytes_measured_equal_theory(dp, optimizer):
    cfg = RunConfig(dp=dp, optimizer=optimizer, **SMALL).validate()
    report = launch.run(cfg)
    P = theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers)
    predicted = theory.model_state_bytes(P, optimizer)
    assert predicted == {"params": 4 * P, "grads": 4 * P,
                         "optimizer": {"adam": 8 * P, "sgd": 0}[optimizer]}
    assert report.theory["memory"] == predicted
    assert len(report.ranks) == dp
    for r in report.ranks:
        m = r["memory"]
        assert r["n_params"] == P
        assert {k: m[k] for k in predicted} == predicted, (r["rank"], m)
        assert m["activations_peak"] > 0
        # the peak of live bytes holds at least the model states and the saved activations
        assert m["total_peak"] >= sum(predicted.values()) + m["activations_peak"]
