"""ZeRO against PyTorch's own: ZeroRedundancyOptimizer (stage 1) and FSDP2 fully_shard (stage 3, and
stage 2 via reshard_after_forward=False), same model, data and Adam arithmetic (torch.optim.Adam
with our eps), at 2 ranks."""
import pytest

from parallel_mini.config import RunConfig
from parallel_mini.launch import run_ranks

CFG = RunConfig(dp=2, steps=3)


def _peer_rank(cfg_dict, peer):
    import torch
    import torch.distributed as dist
    from parallel_mini.config import RunConfig
    from parallel_mini.data import global_batch, shard
    from parallel_mini.model import build_model

    cfg = RunConfig.from_dict(cfg_dict)
    r, n = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg)
    adam = dict(lr=cfg.lr, eps=1e-5, foreach=False)
    if peer == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        module = DDP(model)
        opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, **adam)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (n,))
        reshard = peer == "fsdp2"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        module = model
        opt = torch.optim.Adam(module.parameters(), **adam)
    losses = []
    for step in range(cfg.steps):
        x, y = shard(global_batch(cfg, step), r, n)
        opt.zero_grad()
        loss = module(x, y)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / n)
    if peer == "zero_redundancy":
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
    else:
        params = {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}
    return losses, params


def _ours_params(cfg_dict):
    import torch.distributed as dist
    from parallel_mini.config import RunConfig
    from parallel_mini.comm import Comm
    from parallel_mini.data import global_batch, shard
    from parallel_mini.engine import parallelize
    from parallel_mini.mesh import build_mesh
    from parallel_mini.model import build_model

    cfg = RunConfig.from_dict(cfg_dict)
    mesh = build_mesh(cfg)
    model = build_model(cfg)
    strategy = parallelize(model, Comm(mesh), cfg)
    losses = []
    for step in range(cfg.steps):
        x, y = shard(global_batch(cfg, step), dist.get_rank(), dist.get_world_size())
        strategy.zero_grad()
        loss = model(x, y)
        loss.backward()
        strategy.finish_gradient_sync()
        strategy.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses, {k: v.clone() for k, v in strategy.full_parameters().items()}


@pytest.mark.parametrize("peer,zero", [("zero_redundancy", 1), ("fsdp2", 3), ("fsdp2_no_reshard", 2)])
def test_peer_agrees_with_our_zero(peer, zero):
    cfg = CFG.replace(zero=zero)
    peer_losses, peer_params = run_ranks(_peer_rank, 2, cfg.to_dict(), peer)[0].value
    our_losses, ours = run_ranks(_ours_params, 2, cfg.to_dict())[0].value
    assert max(abs(a - b) for a, b in zip(peer_losses, our_losses)) <= 1e-5
    diff = max((peer_params[k] - ours[k]).abs().max().item() for k in ours)
    assert diff <= 1e-5, f"{peer} vs our ZeRO-{zero}: max |param diff| {diff:.2e}"
