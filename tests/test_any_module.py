"""Data parallel and ZeRO 1/2/3 on any module torch's DDP and FSDP2 accept, not only our GPT.

`AnyModule` has every awkward pattern at once:
- tied weights: the output projection *is* the embedding table (one Parameter in two modules);
- a data-dependent branch: a block's `branch` layer runs only when some row of the rank's batch
  is flagged, so its parameters get no gradient on some ranks, or on none, in some steps;
- frozen parameters (requires_grad=False): a whole layer, and a LayerNorm inside a block;
- parameters used outside their module's forward: the root reads `pos.weight` (that module's
  forward never runs), calls F.linear with block 0's weight after block 0 has finished, and runs a
  custom autograd.Function on block 1's weight that keeps an alias of it for its backward;
- a weight read that gives it no gradient (h * w.detach()): its backward needs the weight after
  the weight's own gradient has arrived.

Each world size is one launch that trains it 5 steps with torch DDP (find_unused_parameters=True),
torch FSDP2 (fully_shard), our DataParallel, ZeRO-1, ZeRO-2 and ZeRO-3; every loss and final
parameter must equal the single-process run within 1e-5 (fp32)."""
from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_mini.runtime import launch

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not import this file

VOCAB, D, SEQ, BATCH, STEPS, LR, TOL = 16, 8, 6, 8, 5, 1e-2, 1e-5
# Which of the 8 rows take the branch, per step. Steps 0 and 4: no rank (step 4 comes after
# updates, so a strategy that let Adam decay the unused moments would move the branch); step 1:
# only the rank holding row 0; step 2: every rank; step 3: only the rank holding row 7.
FLAGGED = [(), (0,), tuple(range(BATCH)), (7,), ()]


def takes_branch(flag: torch.Tensor, agree: bool) -> bool:
    """Whether this rank runs the branch: when one of its rows is flagged, or (agree=True) when
    any rank's row is. FSDP2 needs the latter: it reduce-scatters only the parameters that have a
    gradient, so ranks that disagree send different sizes (measured: gloo aborts the rank,
    "Received data size doesn't match expected size"). A rank with no flagged row then adds a
    zero-masked branch: the same numbers, and every rank has the gradient."""
    take = torch.tensor([int(flag.any())])
    if agree:
        dist.all_reduce(take)
    return bool(take.item())


class Block(nn.Module):
    agree = False  # FSDP2's runs set it (see takes_branch)

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, D)
        self.branch = nn.Linear(D, D)  # only for flagged rows

    def forward(self, h, flag):  # h: [b, s, D], flag: [b]
        h = h + 0.1 * h * self.proj.weight.detach()[0]  # backward reads proj.weight, no grad to it
        h = h + torch.tanh(self.proj(self.norm(h)))
        if takes_branch(flag, self.agree):  # data-dependent: on a rank without a flagged row
            # (and, unless agree, it is every rank) the branch's parameters get no gradient
            h = h + flag[:, None, None] * self.branch(h)
        return h


class Mix(torch.autograd.Function):
    """h + 0.1 h w^T, with its own backward, which reads an alias of w kept on ctx."""

    @staticmethod
    def forward(ctx, h, w):  # h: [b, s, D], w: [D, D]
        ctx.h, ctx.w = h.detach(), w.detach()
        return h + 0.1 * h @ w.t()

    @staticmethod
    def backward(ctx, g):
        return g + 0.1 * g @ ctx.w, 0.1 * torch.einsum("bsi,bsj->ij", g, ctx.h)


class AnyModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)  # never called: its weight is read by the root
        self.frozen = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two modules
        self.scale = nn.Parameter(torch.ones(D))  # registered on the root itself
        self.frozen.requires_grad_(False)
        self.blocks[0].norm.requires_grad_(False)

    def forward(self, x, y):  # x, y: [b, s] token ids
        flag = x[:, 0] == 0  # [b]
        h = self.emb(x) + self.pos.weight[: x.shape[1]]  # [b, s, D]; pos used outside pos()
        h = h + self.frozen(h)
        for block in self.blocks:
            h = block(h, flag)
        h = h + 0.5 * F.linear(h, self.blocks[0].proj.weight)  # block 0's weight, after block 0
        h = Mix.apply(h, self.blocks[1].proj.weight)  # a custom Function on block 1's weight
        logits = self.head(h * self.scale)  # [b, s, VOCAB], the tied table
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def build() -> AnyModule:
    torch.manual_seed(0)
    return AnyModule()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    x[list(FLAGGED[step]), 0] = 0
    return x, y


def local_batch(step: int, r: int, n: int):
    x, y = global_batch(step)
    b = BATCH // n
    return x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]


def single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-5)
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# on every rank: each strategy in turn, from the same initial weights
# ---------------------------------------------------------------------------------------------
def _global_loss(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)  # outside any comm record: the loss for the log
    return t.item() / dist.get_world_size()


def _torch_peer(kind: str):
    """(forward, optimizer, full-parameter getter) for torch's DDP or FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build()
    if kind == "ddp":
        forward = DDP(model, find_unused_parameters=True)
        full = lambda: {k: p.detach().clone() for k, p in model.named_parameters()}  # noqa: E731
    else:
        # One unit, the root: FSDP2 refuses block 0's weight outside block 0's forward if the
        # block is a unit of its own ("got mixed torch.Tensor and DTensor"), measured.
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        for block in model.blocks:
            block.agree = True
        forward = model
        full = lambda: {k: p.full_tensor().detach().clone()  # noqa: E731
                        for k, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]  # after fully_shard: DTensors
    return forward, torch.optim.Adam(trainable, lr=LR, eps=1e-5), full


def _train_peer(kind: str) -> dict:
    forward, opt, full = _torch_peer(kind)
    r, n = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        loss = forward(*local_batch(step, r, n))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_global_loss(loss))
    return {"losses": losses, "params": full()}


def _ours(kind: str, comm):
    """(model, strategy with zero_grad / finish_gradient_sync / step, full-parameter getter)."""
    from parallel_mini.optim import Adam
    from parallel_mini.parallel.data import DataParallel
    from parallel_mini.parallel.zero import ZeroDataParallel
    from parallel_mini.parallel.zero3 import Zero3DataParallel

    model = build()
    if kind == "dp":  # small buckets: several, completed at different times on different ranks
        dp = DataParallel(model, comm, bucket_mb=0.0005, find_unused_parameters=True)
        opt = Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
        dp.zero_grad, dp.step = opt.zero_grad, opt.step
        return model, dp, lambda: {k: p.detach().clone() for k, p in model.named_parameters()}
    if kind == "zero3":
        strategy = Zero3DataParallel(model, comm, lr=LR, find_unused_parameters=True)
    else:
        strategy = ZeroDataParallel(model, comm, int(kind[-1]), lr=LR, find_unused_parameters=True)
    return model, strategy, lambda: {k: v.clone() for k, v in strategy.full_parameters().items()}


def _train_ours(kind: str) -> dict:
    from parallel_mini.comm import Comm
    from parallel_mini.config import RunConfig
    from parallel_mini.mesh import build_mesh

    r, n = dist.get_rank(), dist.get_world_size()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    model, strategy, full = _ours(kind, comm)
    losses = []
    for step in range(STEPS):
        comm.step = step
        strategy.zero_grad()
        loss = model(*local_batch(step, r, n))
        loss.backward()
        strategy.finish_gradient_sync()
        strategy.step()
        losses.append(_global_loss(loss))
    comm.step = -1
    collectives = [(rec["step"], rec["op"], rec["payload_bytes"]) for rec in comm.records]
    return {"losses": losses, "params": full(), "collectives": collectives}


def _every_strategy(kinds) -> dict:
    out = {}
    for kind in kinds:
        t0 = time.perf_counter()
        out[kind] = _train_peer(kind) if kind in ("ddp", "fsdp2") else _train_ours(kind)
        out[kind]["seconds"] = time.perf_counter() - t0
    return out


def _check(run: dict, ref_losses, ref_params, name: str) -> None:
    loss_diff = max(abs(a - b) for a, b in zip(run["losses"], ref_losses))
    assert loss_diff <= TOL, (name, run["losses"], ref_losses)
    assert run["params"].keys() == ref_params.keys(), name
    diffs = {k: (run["params"][k] - ref_params[k]).abs().max().item() for k in ref_params}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL, (name, worst, diffs[worst])


KINDS = ("ddp", "fsdp2", "dp", "zero1", "zero2", "zero3")


@pytest.mark.parametrize("n", [2, 4])
def test_every_strategy_trains_any_module_like_one_process(n):
    ref_losses, ref_params = single_process()
    outs = launch.run_ranks(_every_strategy, n, KINDS, backend="gloo", timeout=120)
    for res in outs:
        for name, run in res.value.items():
            _check(run, ref_losses, ref_params, name)
            # every rank issued the same collectives in the same order (else they would pair
            # wrongly), though ranks used different parameters
            if "collectives" in run:
                assert run["collectives"] == outs[0].value[name]["collectives"], name


def test_zero3_units_one_home_per_parameter():
    """The tied table and the root's own `scale` form the root unit; `pos` is a unit though its
    forward never runs; the frozen layer is in none, the frozen LayerNorm not in block 0's."""
    from parallel_mini.parallel.zero3 import plan_units

    model = build()
    name = {p: k for k, p in model.named_parameters()}
    units = [(type(m).__name__, [name[p] for p in ps]) for m, ps in plan_units(model)]
    assert units == [
        ("AnyModule", ["scale", "emb.weight"]),
        ("Embedding", ["pos.weight"]),
        ("Block", ["blocks.0.proj.weight", "blocks.0.proj.bias",
                   "blocks.0.branch.weight", "blocks.0.branch.bias"]),
        ("Block", ["blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.proj.weight",
                   "blocks.1.proj.bias", "blocks.1.branch.weight", "blocks.1.branch.bias"])]


class SparseTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, sparse=True)


def _refusals() -> dict:
    """Each sharded strategy on a module it cannot hold: the error it raises at construction."""
    from parallel_mini.comm import Comm
    from parallel_mini.config import RunConfig
    from parallel_mini.mesh import build_mesh
    from parallel_mini.parallel.zero import ZeroDataParallel
    from parallel_mini.parallel.zero3 import Zero3DataParallel

    comm = Comm(build_mesh(RunConfig(dp=dist.get_world_size(), batch=dist.get_world_size())))
    frozen = nn.Linear(D, D).requires_grad_(False)
    makers = {"zero1": lambda m: ZeroDataParallel(m, comm, 1),
              "zero2": lambda m: ZeroDataParallel(m, comm, 2),
              "zero3": lambda m: Zero3DataParallel(m, comm)}
    out = {}
    for kind, make in makers.items():
        for label, model in (("sparse", SparseTable()), ("frozen", frozen)):
            try:
                make(model)
                out[kind, label] = None
            except ValueError as e:
                out[kind, label] = str(e)
    return {"errors": out, "collectives": len(comm.records)}


def _zero3_without_find_unused() -> None:
    from parallel_mini.comm import Comm
    from parallel_mini.config import RunConfig
    from parallel_mini.mesh import build_mesh
    from parallel_mini.parallel.zero3 import Zero3DataParallel

    r, n = dist.get_rank(), dist.get_world_size()
    model = build()
    zero = Zero3DataParallel(model, Comm(build_mesh(RunConfig(dp=n, batch=n))), lr=LR)
    zero.zero_grad()
    loss = model(*local_batch(0, r, n))  # step 0: no row flagged, the branches go unused
    print("forward returned")  # not reached
    loss.backward()


def test_unsupported_is_a_clear_error_before_the_first_step():
    res = launch.run_ranks(_refusals, 2, backend="gloo", timeout=60)[0].value
    assert res["collectives"] == 0  # refused before any traffic
    for kind in ("zero1", "zero2", "zero3"):
        assert "sparse=False" in res["errors"][kind, "sparse"], kind
        assert "no trainable parameters" in res["errors"][kind, "frozen"], kind
    # Parameters left without a gradient, without find_unused_parameters (DDP's rule): an error as
    # the forward ends, on every rank that left one out, before backward issues a collective
    with pytest.raises(launch.RankError) as info:
        launch.run_ranks(_zero3_without_find_unused, 2, backend="gloo", timeout=60)
    msg = str(info.value)
    assert "find_unused_parameters=True" in msg and "blocks.0.branch.weight" in msg, msg
    assert "signal" not in msg and "forward returned" not in msg, msg


def _zero3_reads_outside_the_forward() -> dict:
    """After a step, every read of a sharded parameter outside the forward: the error it raises."""
    from parallel_mini.comm import Comm
    from parallel_mini.config import RunConfig
    from parallel_mini.mesh import build_mesh
    from parallel_mini.parallel.zero3 import Zero3DataParallel

    r, n = dist.get_rank(), dist.get_world_size()
    model = build()
    zero = Zero3DataParallel(model, Comm(build_mesh(RunConfig(dp=n, batch=n))), lr=LR,
                             find_unused_parameters=True)
    zero.zero_grad()
    model(*local_batch(2, r, n)).backward()
    zero.finish_gradient_sync()
    zero.step()
    reads = {"state_dict": lambda: model.state_dict(),
             "norm": lambda: model.blocks[1].proj.weight.norm(),
             "data": lambda: model.blocks[1].proj.weight.data + 0,
             "loss term after forward": lambda: model(*local_batch(3, r, n))
             + model.blocks[0].branch.weight.pow(2).sum(),
             "load": lambda: model.load_state_dict(build().state_dict())}
    errors = {}
    for what, read in reads.items():
        try:
            read()
            errors[what] = None
        except RuntimeError as e:
            errors[what] = str(e)
    shape = tuple(model.blocks[1].proj.weight.shape)  # metadata still answers
    return {"errors": errors, "shape": shape, "full": zero.full_parameters()}


def test_zero3_reading_a_sharded_parameter_is_an_error_not_a_signal():
    """Outside the forward a ZeRO-3 parameter's storage has no bytes (measured before: reading it,
    e.g. model.state_dict(), killed the rank with SIGSEGV). Now every such read raises an error
    naming the parameter and the fix; the ranks live on and full_parameters() still works."""
    outs = launch.run_ranks(_zero3_reads_outside_the_forward, 2, backend="gloo", timeout=60)
    for res in outs:
        errors = res.value["errors"]
        for what, msg in errors.items():
            assert msg is not None and "ZeRO-3" in msg and "full_parameters()" in msg, (what, msg)
        assert "blocks.1.proj.weight" in errors["norm"]
        assert res.value["shape"] == (D, D)
        assert res.value["full"]["blocks.1.proj.weight"].shape == (D, D)
        assert torch.equal(res.value["full"]["emb.weight"], outs[0].value["full"]["emb.weight"])
