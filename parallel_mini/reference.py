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


def max_abs_diff(losses, params, ref_losses, ref_params) -> dict[str, float]:
    """Largest |ours - reference| over the per-step losses and over every final parameter element."""
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    param_diff = max(((params[n].float().cpu() - ref_params[n].cpu()).abs().max().item()
                      for n in ref_params),
                     default=0.0)
    return {"losses": loss_diff, "params": param_diff}
