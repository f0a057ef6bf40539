"""The truth every strategy must equal: plain single-process training on the same data and init.

It runs the whole global batch at once (no micro-batches, no ranks). Losses and final parameters of
every parallel run are compared with these, in fp32, to 1e-5.
"""
from __future__ import annotations

import torch

from .data import global_batch, shard
from .model import build_model
from .optim import make_optimizer


def train_reference(cfg, device="cpu", per_microbatch: bool = False
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Returns (loss per step, final parameters by name). `per_microbatch`: an optimizer step after
    each of the step's cfg.microbatches slices instead of one per step (the sequential twin of
    PipeDream's updates); the step's loss is then the mean of its micro-batch losses."""
    model = build_model(cfg).to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
    losses = []
    parts = cfg.microbatches if per_microbatch else 1
    for step in range(cfg.steps):
        batch = global_batch(cfg, step)
        step_loss = 0.0
        for i in range(parts):
            x, y = shard(batch, i, parts)
            loss = model(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_loss += loss.item() / parts
        losses.append(step_loss)
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def replay_updates(cfg, updates: list[dict], batch_of, device="cpu", fresh: bool = False
                   ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Asynchronous SGD's sequential twin (parallel/async_ps.py): the run's `updates` in their
    recorded order, each gradient computed on the version its worker pulled (the parameters
    after `computed_on` updates), on `batch_of(cfg, worker, step)`. `fresh`: on the current
    version instead (the same batches in the same order, without staleness). Returns (loss per
    update, final parameters by name)."""
    model, at = build_model(cfg).to(device), build_model(cfg).to(device)  # current, pulled
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
    last_use = {u["computed_on"]: i for i, u in enumerate(updates)}  # version -> last update on it
    versions, losses = {}, []
    for i, u in enumerate(updates):
        if i in last_use:  # version i = the parameters now, before update i: a worker pulled it
            versions[i] = [p.detach().clone() for p in model.parameters()]
        pulled = list(model.parameters()) if fresh else versions[u["computed_on"]]
        with torch.no_grad():
            for p, v in zip(at.parameters(), pulled):
                p.copy_(v)
        x, y = batch_of(cfg, u["worker"], u["step"])
        loss = at(x.to(device), y.to(device))
        grads = torch.autograd.grad(loss, list(at.parameters()), allow_unused=True)
        for p, g in zip(model.parameters(), grads):
            p.grad = torch.zeros_like(p) if g is None else g  # (a worker pushes zeros too)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if last_use[u["computed_on"]] == i:
            versions.pop(u["computed_on"])  # no later update computes on it
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def max_abs_diff(losses, params, ref_losses, ref_params) -> dict[str, float]:
    """Largest |ours - reference| over the per-step losses and over every final parameter element."""
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    param_diff = max(((params[n].float().cpu() - ref_params[n].cpu()).abs().max().item()
                      for n in ref_params),
                     default=0.0)
    return {"losses": loss_diff, "params": param_diff}
