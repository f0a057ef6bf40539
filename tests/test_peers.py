"""Our data parallel against PyTorch's own: torch.nn.parallel.DistributedDataParallel on the same
tiny GPT, data and optimizer gives the same losses and final parameters; DDP's semantics for frozen
parameters and for parameters unused on some ranks (find_unused_parameters) are kept."""
from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel_mini.comm import Comm
from parallel_mini.config import RunConfig
from parallel_mini.data import global_batch, shard
from parallel_mini.runtime import launch
from parallel_mini.runtime.launch import RankError
from parallel_mini.mesh import build_mesh
from parallel_mini.model import build_model
from parallel_mini.optim import SGD, Adam
from parallel_mini.parallel.data import DataParallel
from parallel_mini.reference import train_reference


def run_ranks(fn, world_size, *args, **kwargs):
    """These ranks compute on CPU tensors: pin gloo (the default would be NCCL on a GPU machine)."""
    return launch.run_ranks(fn, world_size, *args, backend="gloo", **kwargs)


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not import this file

SMALL = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8, steps=3, bucket_mb=0.02)
TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# the tiny GPT: DDP vs ours, same model, data, optimizer
# ---------------------------------------------------------------------------------------------
def _train_both(cfg_dict, modes, frozen=()):
    """On every rank: train with DDP, then with each of our modes, from the same init."""
    cfg = RunConfig.from_dict(cfg_dict)
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = build_mesh(RunConfig(dp=n, batch=n))
    out = {}
    for name in ("ddp", *modes):
        model = build_model(cfg)
        for pname, p in model.named_parameters():
            if pname in frozen:
                p.requires_grad_(False)
        comm = Comm(mesh)
        if name == "ddp":
            forward = DDP(model, bucket_cap_mb=cfg.bucket_mb)
            sync = lambda: None  # noqa: E731 - DDP syncs inside backward
        else:
            forward = model
            sync = DataParallel(model, comm, mode=name, bucket_mb=cfg.bucket_mb).finish_gradient_sync
        opt = Adam(model.parameters(), lr=cfg.lr)
        losses = []
        for step in range(cfg.steps):
            comm.step = step
            x, y = shard(global_batch(cfg, step), r, n)
            loss = forward(x, y)
            loss.backward()
            sync()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)  # the global loss, outside the comm records
            losses.append(total.item() / n)
        out[name] = {"losses": losses, "records": comm.records,
                     "params": {k: v.detach().clone() for k, v in model.named_parameters()}}
    return out


def _max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _reference_with_frozen(cfg, frozen):
    model = build_model(cfg)
    for pname, p in model.named_parameters():
        if pname in frozen:
            p.requires_grad_(False)
    opt = Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        loss = model(*global_batch(cfg, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _step_both(ours_cls, theirs_cls, kw, skip=lambda i, step: False, steps=12):
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    ps = [torch.randn(s, requires_grad=True) for s in shapes]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    ours, theirs = ours_cls(ps, **kw), theirs_cls(qs, **kw)
    for step in range(steps):
        for i, (p, q) in enumerate(zip(ps, qs)):
            g = torch.randn(p.shape)
            p.grad, q.grad = (None, None) if skip(i, step) else (g.clone(), g.clone())
        ours.step()
        theirs.step()
    return ps, qs


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_our_optimizers_are_torch_arithmetic(name):
    """Adam/SGD are ours (so every byte of state is visible) but must step exactly as torch's do:
    the same operations in the same order give bit-identical parameters (measured: 0.0)."""
    classes = {"adam": (Adam, torch.optim.Adam, dict(lr=3e-3, eps=1e-5)),
               "sgd": (SGD, torch.optim.SGD, dict(lr=3e-3))}[name]
    for p, q in zip(*_step_both(*classes)):
        assert torch.equal(p, q), (p - q).abs().max()


def test_adam_counts_steps_per_parameter_like_torch():
    """A parameter that has no gradient in some steps (unused that step, or used nowhere under
    find_unused_parameters) is skipped; torch.optim.Adam then does not advance *its* step count,
    so its bias correction stays 1 - beta^(steps it really took)."""
    late = lambda i, step: i == 1 and (step < 4 or step % 3 == 0)  # noqa: E731
    for p, q in zip(*_step_both(Adam, torch.optim.Adam, dict(lr=3e-3, eps=1e-5), skip=late)):
        assert torch.equal(p, q), (p - q).abs().max()


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_and_ours_agree_on_the_tiny_gpt(n):
    cfg = RunConfig(**SMALL).validate()
    outs = [res.value for res in run_ranks(_train_both, n, cfg.to_dict(), ("naive", "bucketed"))]
    ref_losses, ref_params = train_reference(cfg)
    for r, out in enumerate(outs):
        ddp = out["ddp"]
        assert max(abs(a - b) for a, b in zip(ddp["losses"], ref_losses)) <= TOL  # the peer is right
        assert _max_param_diff(ddp["params"], ref_params) <= TOL
        for mode in ("naive", "bucketed"):
            ours = out[mode]
            assert max(abs(a - b) for a, b in zip(ours["losses"], ddp["losses"])) <= TOL, (mode, r)
            assert _max_param_diff(ours["params"], ddp["params"]) <= TOL, (mode, r)
        # the replicas really are replicas
        assert _max_param_diff(out["bucketed"]["params"], outs[0]["bucketed"]["params"]) == 0.0
        if n == 2:
            # (a+b)/2 (ours) and a/2 + b/2 (DDP) are the same float when N is 2: bit-identical
            for mode in ("naive", "bucketed"):
                assert _max_param_diff(out[mode]["params"], ddp["params"]) == 0.0, mode
                assert out[mode]["losses"] == ddp["losses"], mode


def test_frozen_parameters_never_move_and_never_communicate():
    frozen = ("embed.pos.weight", "blocks.0.ln1.weight")
    cfg = RunConfig(**SMALL).validate()
    outs = [res.value for res in run_ranks(_train_both, 2, cfg.to_dict(), ("naive", "bucketed"),
                                           frozen)]
    init = dict(build_model(cfg).named_parameters())
    ref_losses, ref_params = _reference_with_frozen(cfg, frozen)
    trainable_bytes = 4 * sum(p.numel() for k, p in init.items() if k not in frozen)
    assert trainable_bytes < 4 * sum(p.numel() for p in init.values())
    for out in outs:
        for name in ("ddp", "naive", "bucketed"):
            run = out[name]
            for k in frozen:
                assert torch.equal(run["params"][k], init[k].detach()), (name, k)
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses)) <= TOL, name
            assert _max_param_diff(run["params"], ref_params) <= TOL, name
        for name in ("naive", "bucketed"):
            recs = out[name]["records"]
            for step in range(cfg.steps):
                moved = sum(rec["payload_bytes"] for rec in recs
                            if rec["step"] == step and rec["op"] == "all_reduce")
                assert moved == trainable_bytes, (name, step, moved, trainable_bytes)
            if name == "naive":  # one record per trainable tensor: the frozen shapes never appear
                counts = [rec["count"] for rec in recs if rec["step"] == 0]
                assert len(counts) == len(init) - len(frozen)


# ---------------------------------------------------------------------------------------------
# parameters unused on some ranks
# ---------------------------------------------------------------------------------------------
class Branchy(nn.Module):
    """`extra` is used only on the ranks in `extra_ranks`; `extra2` (if given) only on
    `extra2_ranks`; `never` (if asked for) is used nowhere."""

    def __init__(self, extra_ranks=(0,), extra2_ranks=None, with_never=False):
        super().__init__()
        self.extra_ranks, self.extra2_ranks = tuple(extra_ranks), extra2_ranks
        self.a = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.extra2 = nn.Linear(8, 8) if extra2_ranks is not None else None
        self.head = nn.Linear(8, 1)
        self.never = nn.Linear(8, 8) if with_never else None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if dist.get_rank() in self.extra_ranks:
            h = h + self.extra(h)
        if self.extra2 is not None and dist.get_rank() in self.extra2_ranks:
            h = h * self.extra2(h)
        return self.head(h).pow(2).mean()


def _unused_grads(which, model_kwargs, find_unused=True, iterations=2):
    """Grads after sync for two iterations, with DDP (which='ddp') or our mode `which`."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Branchy(**model_kwargs)
    if which == "ddp":
        forward, sync = DDP(model, find_unused_parameters=True), (lambda: None)
    else:
        comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
        dp = DataParallel(model, comm, mode=which, bucket_mb=25.0, find_unused_parameters=find_unused)
        forward, sync = model, dp.finish_gradient_sync
    grads = []
    for it in range(iterations):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * it + r))
        forward(x).backward()
        sync()
        grads.append({k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(ours, ddp):
    for it, (g_ours, g_ddp) in enumerate(zip(ours, ddp)):
        assert g_ours.keys() == g_ddp.keys()
        for k in g_ddp:
            if g_ddp[k] is None:
                assert g_ours[k] is None, (it, k)
            else:
                assert g_ours[k] is not None, (it, k)
                torch.testing.assert_close(g_ours[k], g_ddp[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["naive", "bucketed"])
def test_unused_on_some_ranks_matches_ddp(mode):
    """The DDP case: only rank 0 takes the `extra` branch. (Bucketed: rank 0 completes its bucket
    during backward, rank 1 only in finish_gradient_sync, so the two must still issue the same
    collectives in the same order.)"""
    kwargs = dict(extra_ranks=(0,))
    ddp = [res.value for res in run_ranks(_unused_grads, 2, "ddp", kwargs)]
    ours = [res.value for res in run_ranks(_unused_grads, 2, mode, kwargs, timeout=30)]
    for r in range(2):
        assert ddp[r][0]["extra.weight"] is not None  # rank 1 gets the average though it never used it
        _assert_same_grads(ours[r], ddp[r])
    torch.testing.assert_close(ddp[0][0]["extra.weight"], ddp[1][0]["extra.weight"])


@pytest.mark.parametrize("mode", ["naive", "bucketed"])
def test_unused_on_different_ranks_matches_ddp(mode):
    """Each rank leaves a different parameter unused (rank 0: extra2, rank 1: extra)."""
    kwargs = dict(extra_ranks=(0,), extra2_ranks=(1,), with_never=True)
    ddp = [res.value for res in run_ranks(_unused_grads, 2, "ddp", kwargs)]
    ours = [res.value for res in run_ranks(_unused_grads, 2, mode, kwargs, timeout=30)]
    for r in range(2):
        assert ddp[r][0]["never.weight"] is None  # used nowhere: no gradient
        _assert_same_grads(ours[r], ddp[r])


@pytest.mark.parametrize("mode", ["naive", "bucketed"])
def test_unused_without_find_unused_is_a_clear_error(mode):
    kwargs = dict(extra_ranks=(0,), extra2_ranks=(1,))  # every rank leaves one parameter unused
    with pytest.raises(RankError) as info:
        run_ranks(_unused_grads, 2, mode, kwargs, False, 1, timeout=60)
    msg = str(info.value)
    assert "find_unused_parameters" in msg and "received no gradient" in msg
    assert "extra" in msg  # the parameter is named
