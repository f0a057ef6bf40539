"""Bucketed data parallel rebuilds its buckets from the order gradients really became ready (as
DDP does), so that all-reduces launch during backward even when the model registers its layers in
another order than it uses them."""
import torch

from parallel_mini.runtime.launch import run_ranks


class Reversed(torch.nn.Module):
    """Layers registered l0..l6 but applied l6..l0: backward makes l0's gradient first, while
    reverse registration order guesses l6 first."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(7))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _train(steps: int):
    import time
    import torch.distributed as dist
    from types import SimpleNamespace
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.parallel.data import DataParallel
    n, r = dist.get_world_size(), dist.get_rank()
    comm = Comm(build_mesh(SimpleNamespace(dp=n, tp=1, pp=1, cp=1, ep=1, dp_shard=0, world_size=n)))
    torch.manual_seed(0)
    model = Reversed()
    # a clock of our own, registered before DataParallel's hooks so it runs first: when each
    # gradient became ready, measured independently of the library's grads_pending counter
    ready_at = {}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: ready_at.setdefault(comm.step, []).append(time.perf_counter()))
    dp = DataParallel(model, comm, mode="bucketed", bucket_mb=0.01)  # one layer per bucket
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        comm.step = step
        model(x[r::n]).backward()
        dp.finish_gradient_sync()
        opt.step()
        opt.zero_grad()
    pending, early = {}, {}
    for rec in comm.records:
        if rec["op"] == "all_reduce" and rec["step"] >= 0:
            pending.setdefault(rec["step"], []).append(rec["grads_pending"])
            last_ready = max(ready_at[rec["step"]])
            early[rec["step"]] = early.get(rec["step"], 0) + (rec["start"] < last_ready)
    return {"pending": pending, "early": early, "buckets": len(dp.buckets),
            "params": [p.detach().clone() for p in model.parameters()]}


def test_buckets_rebuilt_from_the_observed_order_launch_during_backward():
    out = [r.value for r in run_ranks(_train, 2, 3)]
    pending = out[0]["pending"]
    assert out[0]["buckets"] == 7
    # first step, guessed order: the first bucket holds the last gradient; nothing launches early
    assert pending[0] == [0] * 7
    # after the rebuild: buckets launch while later layers' gradients are still being computed
    assert pending[1] == pending[2] and max(pending[1]) > 0
    assert sorted(pending[1], reverse=True) == pending[1] and pending[1][0] == 12  # 14 - 2
    # the same by the clock: all-reduces launched before the last gradient was ready
    for rank in out:
        assert rank["early"][0] == 0 and rank["early"][1] >= 1 and rank["early"][2] >= 1, rank["early"]
    # the same collectives on every rank, and the replicas agree
    assert out[1]["pending"] == pending
    assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], out[1]["params"]))
    # and equal one process on the whole batch
    torch.manual_seed(0)
    model = Reversed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        # the ranks' shards x[0::2], x[1::2], averaged: the mean over all 8 rows
        model(torch.cat([x[0::2], x[1::2]])).backward()
        opt.step()
        opt.zero_grad()
    assert max((a - b).abs().max().item() for a, b in zip(out[0]["params"], model.parameters())) < 1e-6
