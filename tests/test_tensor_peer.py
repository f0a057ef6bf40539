"""Our tensor parallel against PyTorch's: DTensor parallelize_module with ColwiseParallel /
RowwiseParallel on the same tiny GPT's blocks (QKV and fc column-wise, the projections row-wise),
same data and Adam arithmetic, at tp=2. Both must equal the single-process reference."""
from parallel_mini.config import RunConfig
from parallel_mini.engine import run
from parallel_mini.launch import run_ranks


def _dtensor_rank(cfg_dict):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from parallel_mini.config import RunConfig
    from parallel_mini.data import global_batch
    from parallel_mini.model import build_model
    from parallel_mini.parallel.tensor import qkv_rows_by_rank

    cfg = RunConfig.from_dict(cfg_dict)
    n = cfg.tp
    model = build_model(cfg)
    order = qkv_rows_by_rank(n)  # so that DTensor's contiguous row split gives whole heads
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.copy_(order(block.attn.qkv.weight))
            block.attn.qkv.bias.copy_(order(block.attn.qkv.bias))
    plan = {}
    for i in range(cfg.layers):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    parallelize_module(model, init_device_mesh("cpu", (n,)), plan)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5, foreach=False)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)  # every tp rank sees the whole batch
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):  # undo the row order
            per = full.shape[0] // (3 * n)
            blocks = full.split(per, dim=0)
            full = torch.cat([torch.cat(blocks[i::3]) for i in range(3)])
        params[name] = full.detach().clone()
    return losses, params


def test_dtensor_peer_agrees():
    from parallel_mini.reference import train_reference

    cfg = RunConfig(tp=2, steps=3)
    losses, params = run_ranks(_dtensor_rank, 2, cfg.to_dict())[0].value
    ref_losses, ref_params = train_reference(cfg)
    ours = run(cfg.replace(reference=True))
    assert ours.max_abs_diff <= 1e-5
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) <= 1e-5
    assert max(abs(a - b) for a, b in zip(losses, ours.losses)) <= 1e-5
