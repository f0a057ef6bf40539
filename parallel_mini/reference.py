"""The truth every strategy must equal: plain single-process training on the same data and init.

It runs the whole global batch at once (no micro-batches, no ranks). Losses and final parameters of
every parallel run are compared with these, in fp32, to 1e-5.
"""
from __future__ import annotations

import torch

from .data import client_batch, client_shard, global_batch, shard
from .model import build_model
from .optim import make_optimizer


def train_reference(cfg, device="cpu", per_microbatch: bool = False
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Returns (loss per step, final parameters by name). `per_microbatch`: an optimizer step after
    each of the step's cfg.microbatches slices instead of one per step (the sequential twin of
    PipeDream's updates); the step's loss is then the mean of its micro-batch losses. Local SGD
    has its own twin (simulate_local_sgd), N replicas stepped one after another, and federated
    averaging its own (simulate_federated), the sampled clients trained one after another."""
    if getattr(cfg, "sync_every", 0):
        return simulate_local_sgd(cfg, device)
    if getattr(cfg, "federated", False):
        out = simulate_federated(cfg, device)
        return out["losses"], out["params"]
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


def simulate_local_sgd(cfg, device="cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Local SGD (parallel/local_sgd.py) in one process: cfg.dp replicas of the model, each with
    its own optimizer, replica r trained on rows r of every step's batch split dp ways; after every
    cfg.sync_every-th step and after the last their parameters (with cfg.sync_optimizer, their
    optimizer states too) are replaced by the replicas' mean. A step's loss is the replicas' mean."""
    n = cfg.dp
    models = [build_model(cfg).to(device) for _ in range(n)]
    opts = [make_optimizer(cfg.optimizer, m.parameters(), cfg.lr, cfg.precision) for m in models]
    losses = []
    for step in range(cfg.steps):
        batch, step_loss = global_batch(cfg, step), 0.0
        for r, (model, opt) in enumerate(zip(models, opts)):
            x, y = shard(batch, r, n)  # [b/dp, s]: replica r's own rows
            step_loss += _step(model, opt, x.to(device), y.to(device)) / n
        losses.append(step_loss)
        if (step + 1) % cfg.sync_every == 0 or step == cfg.steps - 1:
            _average([list(m.parameters()) for m in models])
            if cfg.sync_optimizer:
                _average([opt.state_tensors() for opt in opts])
    return losses, {k: p.detach().float().clone() for k, p in models[0].named_parameters()}


def _step(model, opt, x, y) -> float:
    """One optimizer step on (x, y); returns its loss."""
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@torch.no_grad()
def _average(replicas: list[list[torch.Tensor]]) -> None:
    """replicas[r][i] := the mean over r of replicas[r][i], for every i."""
    for same in zip(*replicas):
        mean = sum(t.float() for t in same) / len(same)
        for t in same:
            t.copy_(mean)


def simulate_federated(cfg, device="cpu") -> dict:
    """Federated averaging (parallel/federated.py) in one process: each round the same sampled
    clients (federated.sample_clients), one after another, start from the server's weights, take
    cfg.local_steps steps with a fresh optimizer, and the server takes their average weighted by
    data size. Returns per round the union loss ("losses") and every client's ("clients_loss"),
    each sampled client's distance from the average ("drift"), and the final "params"."""
    from .parallel.federated import sample_clients  # (the server's draw is federated.py's)
    model = build_model(cfg).to(device)
    params = list(model.parameters())
    shards = [tuple(t.to(device) for t in client_shard(cfg, k)) for k in range(cfg.clients)]
    sizes = [len(x) for x, _ in shards]
    out = {"losses": [], "clients_loss": [], "drift": []}
    for round_ in range(cfg.rounds or cfg.steps):
        chosen = sample_clients(cfg, round_)
        server = [p.detach().clone() for p in params]
        trained = {}
        for k in chosen:
            with torch.no_grad():
                for p, w in zip(params, server):
                    p.copy_(w)
            opt = make_optimizer(cfg.optimizer, params, cfg.lr, cfg.precision)
            for e in range(cfg.local_steps):
                _step(model, opt, *client_batch(cfg, k, shards[k], round_, e))
            trained[k] = [p.detach().clone() for p in params]
        total = sum(sizes[k] for k in chosen)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(sum(sizes[k] * w[i] for k, w in trained.items()) / total)
            losses = [model(x, y).item() for x, y in shards]
        out["losses"].append(sum(n * x for n, x in zip(sizes, losses)) / sum(sizes))
        out["clients_loss"].append(losses)
        out["drift"].append({k: torch.cat([(a - p).reshape(-1) for a, p in zip(w, params)]).norm()
                             .item() for k, w in trained.items()})
    out["params"] = {k: p.detach().float().clone() for k, p in model.named_parameters()}
    return out


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
