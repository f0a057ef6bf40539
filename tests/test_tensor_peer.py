"""Our tensor parallel against PyTorch's: DTensor parallelize_module with ColwiseParallel /
RowwiseParallel on the same tiny GPT's blocks (QKV and fc column-wise, the projections row-wise),
same data and Adam arithmetic, at tp=2 (and with the vocabulary split too, under loss_parallel);
and our sequence parallel (--sp) against the same plan with
SequenceParallel LayerNorms and the sequence gathered / reduce-scattered around the matmuls
(torchtitan's plan, `peers.dtensor_tp_plan`). Both must equal the single-process reference."""
import pytest
from torch.distributed.tensor import Shard

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.runtime.launch import run_ranks


def _dtensor_rank(cfg_dict, sp=False, vocab=False):
    import torch
    from torch.distributed.tensor import DTensor
    from parallel_mini.course.peers import dtensor_loss, dtensor_tp_model
    from parallel_mini.config import RunConfig
    from parallel_mini.data import global_batch

    cfg = RunConfig.from_dict(cfg_dict)
    n = cfg.tp
    model = dtensor_tp_model(cfg, sp, vocab)
    seen = {}  # what flows between blocks, and what the LayerNorm hands to QKV (first step)

    def block_input(module, args):
        seen.setdefault("block_input", (isinstance(args[0], DTensor), tuple(args[0].shape)))

    def ln1_output(module, args, out):
        seen.setdefault("ln1_out", tuple(out.placements) if isinstance(out, DTensor) else None)

    model.blocks[1].register_forward_pre_hook(block_input)
    model.blocks[1].ln1.register_forward_hook(ln1_output)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5, foreach=False)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)  # every tp rank sees the whole batch
        opt.zero_grad()
        with dtensor_loss(vocab):
            loss = model(x, y)
            loss.backward()
        opt.step()
        if isinstance(loss, DTensor):  # (loss_parallel: a replicated DTensor)
            seen.setdefault("loss", tuple(loss.placements))
            loss = loss.full_tensor()
        losses.append(loss.item())
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):  # undo the row order
            per = full.shape[0] // (3 * n)
            blocks = full.split(per, dim=0)
            full = torch.cat([torch.cat(blocks[i::3]) for i in range(3)])
        params[name] = full.detach().clone()
    return losses, params, seen


def _agree(cfg, vocab=False):
    from parallel_mini.reference import train_reference

    losses, params, seen = run_ranks(_dtensor_rank, cfg.tp, cfg.to_dict(), cfg.sp, vocab)[0].value
    ref_losses, ref_params = train_reference(cfg)
    ours = run(cfg.replace(reference=True))
    assert ours.max_abs_diff <= 1e-5, ours.max_abs_diff_detail
    assert set(params) == set(ref_params)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) <= 1e-5
    assert max(abs(a - b) for a, b in zip(losses, ours.losses)) <= 1e-5
    return seen


def test_dtensor_peer_agrees():
    seen = _agree(RunConfig(tp=2, steps=3))
    assert seen["block_input"] == (False, (8, 32, 64))  # plain TP: the whole sequence everywhere


def test_dtensor_vocabulary_parallel_peer_agrees():
    """The peer that splits the vocabulary as ours does (the token table row-wise, the head's
    logits left sharded, torch's loss_parallel cross-entropy): `bench tp` times it beside ours."""
    from torch.distributed.tensor import Replicate

    seen = _agree(RunConfig(tp=2, steps=3), vocab=True)
    assert seen["loss"] == (Replicate(),)  # the loss came out of loss_parallel as a DTensor


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dtensor_sequence_parallel_peer_agrees(tp):
    """Sequence parallel against DTensor's. The default suite runs tp = 2 (the same plan and
    shard layout; tp = 4, twice the ranks on CI's 2 cores, is `-m slow`)."""
    cfg = RunConfig(tp=tp, sp=True, steps=3)
    seen = _agree(cfg)
    # between blocks the residual stream is this rank's sequence shard [b, s/tp, h] (a local
    # tensor, as torchtitan's plan leaves it), and the LayerNorm ran on Shard(1) DTensors
    assert seen["block_input"] == (False, (cfg.batch, cfg.seq // tp, cfg.d_model))
    assert seen["ln1_out"] == (Shard(1),)
