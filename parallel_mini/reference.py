"""The truth every strategy must equal: plain single-process training on the same data and init.

It runs the whole global batch at once (no micro-batches, no ranks). Losses and final parameters of
every parallel run are compared with these, in fp32, to 1e-5.
"""
from __future__ import annotations

import torch

from .data import global_batch
from .model import build_model
from .optim import make_optimizer


def train_reference(cfg, device="cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Returns (loss per step, final parameters by name)."""
    model = build_model(cfg).to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def max_abs_diff(losses, params, ref_losses, ref_params) -> dict[str, float]:
    """Largest |ours - reference| over the per-step losses and over every final parameter element."""
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    param_diff = max(((params[n].float() - ref_params[n]).abs().max().item() for n in ref_params),
                     default=0.0)
    return {"losses": loss_diff, "params": param_diff}
