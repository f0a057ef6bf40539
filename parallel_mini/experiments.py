"""Live experiments that are neither a training run (`engine.run`) nor a collective
(`collectives.py`): each starts ranks, does one small thing on them, and returns plain data that a
page or a lesson draws. The app's pages call these and never run code on a rank themselves.

- `tp_mlp_shards(cfg_dict)`: the MLP weights tensor parallel leaves on each rank, read back from
  the ranks, and the column-then-row-parallel MLP redone with them (the app's Tensor parallel page).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm import Comm
from .config import RunConfig
from .launch import run_ranks
from .mesh import build_mesh
from .model import build_model
from .parallel.tensor import apply_tensor_parallel


def _tp_mlp_shards_rank(cfg_dict: dict, tokens: int = 8) -> dict:
    """On each tp rank: build the model (the same full weights everywhere, one seed), shard it with
    apply_tensor_parallel, and return this rank's MLP weights of every block. Then redo Megatron-LM's
    picture with them: Y_r = GELU(X A_r) needs no communication; the partial products Y_r B_r are
    summed by an all-reduce, and both are compared with the unsharded computation."""
    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    t, r = comm.size("tp"), comm.rank("tp")
    model = build_model(cfg)
    full = [(b.mlp.fc.weight.detach().clone(), b.mlp.fc.bias.detach().clone(),
             b.mlp.proj.weight.detach().clone()) for b in model.blocks]
    apply_tensor_parallel(model, comm, cfg.sp)
    torch.manual_seed(1234)
    x = torch.randn(tokens, cfg.d_model)  # [tokens, h], the same on every rank
    blocks = []
    with torch.no_grad():
        for (fc_w, fc_b, proj_w), block in zip(full, model.blocks):
            w1, b1, w2 = (block.mlp.fc.weight.detach(), block.mlp.fc.bias.detach(),
                          block.mlp.proj.weight.detach())  # [4h/t, h], [4h/t], [h, 4h/t]
            n = w1.shape[0]
            y_r = F.gelu(x @ w1.T + b1)  # [tokens, 4h/t]: this rank's columns of Y, no comm
            z = (y_r @ w2.T).contiguous()  # [tokens, h]: a partial sum over this rank's 4h/t
            partial = z.clone()
            if t > 1:
                comm.all_reduce(z, "tp", layer="g")  # Σ_r Y_r B_r
            y_full = F.gelu(x @ fc_w.T + fc_b)  # [tokens, 4h], one process
            z_full = y_full @ proj_w.T  # [tokens, h]
            out = {"fc": w1.numpy().copy(), "proj": w2.numpy().copy(),
                   "fc_rows": [r * n, (r + 1) * n], "proj_cols": [r * n, (r + 1) * n],
                   "y_shape": list(y_r.shape), "z_shape": list(z.shape),
                   "y_slice_diff": float((y_r - y_full[:, r * n:(r + 1) * n]).abs().max()),
                   "partial_diff": float((partial - z_full).abs().max()),
                   "all_reduce_diff": float((z - z_full).abs().max())}
            if r == 0:
                out.update(fc_full=fc_w.numpy().copy(), proj_full=proj_w.numpy().copy())
            blocks.append(out)
    return {"rank": r, "blocks": blocks,
            "comm": [{k: v for k, v in c.items() if k in ("op", "layer", "payload_bytes",
                                                           "wire_bytes")} for c in comm.records]}


def tp_mlp_shards(cfg_dict: dict, tokens: int = 8, timeout: float = 60.0) -> list[dict]:
    """Every tp rank's MLP shards of every block, in rank order (rank 0's entry also holds the full
    weights), with the diffs of the sharded MLP against the unsharded one and the comm records.
    `cfg_dict`: a RunConfig as a dict, one rank per tp degree (dp = pp = 1)."""
    results = run_ranks(_tp_mlp_shards_rank, cfg_dict["tp"], cfg_dict, tokens, timeout=timeout,
                        pg_timeout=timeout)
    return [res.value for res in sorted(results, key=lambda res: res.rank)]
