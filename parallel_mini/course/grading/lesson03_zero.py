"""Lesson 03 (03_memory_and_zero): the ZeRO-1 optimizer step, `check_zero1_step`.

The learner's step reduce-scatters the flat gradient buffer, hands this rank's slice to Adam and
all-gathers the updated slices, on real ranks; checked every step against uncounted collectives,
then against the single-process reference, the library's ZeRO-1 and the formula's bytes.
"""
from __future__ import annotations

from ... import theory
from ...config import RunConfig
from .core import (CHECK_PG_TIMEOUT, CHECK_RUN_TIMEOUT, _CodeSwapped, Grade, _RankTrace,
                   _library_copy, _on_ranks, _wire_summary, _wire_verdict)


# The check model: small and with a padded flat buffer at N = 4 (P = 77,322 = 4 * 19,330 + 2), so
# the learner's slicing must handle the padding that ZeRO's flat layout adds.
ZERO1_CHECK_SHAPE = {"layers": 3, "d_model": 42, "heads": 6}


def _library_zero_refused(*args, **kwargs):
    """Swapped in for the code of the library's ZeRO while a learner's zero1_step runs."""
    raise AssertionError("your zero1_step called the library's own ZeRO (parallel_mini.parallel."
                         "zero.ZeroDataParallel), which the checker disables while your code runs: "
                         "reduce-scatter, step and all-gather yourself, with comm")


class _LibraryZeroDisabled(_CodeSwapped):
    """ZeroDataParallel's constructor, gradient sync and step raise while active."""

    def swaps(self):
        from ...parallel import zero
        return [(getattr(zero.ZeroDataParallel, n), _library_zero_refused)
                for n in ("__init__", "finish_gradient_sync", "step")]


def _zero1_rank(cfg_dict: dict, fn) -> dict:
    """One rank of the ZeRO-1 check: ZeroDataParallel's flat layout (every parameter a view into
    one flat fp32 buffer, padded to a multiple of N) and an Adam that owns only this rank's slice,
    with the learner's `fn(flat_params, flat_grads, step_shard, comm)` doing the gradient sync and
    the step. Each step checks what `step_shard` received and what `flat_params` holds afterwards
    against uncounted torch.distributed collectives; a wrong answer raises AssertionError here."""
    import torch
    import torch.distributed as dist

    from ...comm import Comm, _all_gather
    from ...data import global_batch, shard
    from ...mesh import rank_device
    from ...mesh import build_mesh
    from ...model import build_model
    from ...optim import Adam
    from ...parallel.zero import FlatLayout

    cfg = RunConfig.from_dict(cfg_dict)
    mesh = build_mesh(cfg)
    comm = Comm(mesh)
    n, r, group = comm.size("dp"), comm.rank("dp"), mesh.groups["dp"]
    device = rank_device()
    model = build_model(cfg).to(device)  # the same seed on every rank: identical replicas
    params = [p for p in model.parameters() if p.requires_grad]
    layout = FlatLayout(params, n)
    k = layout.shard_numel
    flat_params = torch.zeros(layout.padded, device=device)  # [N*k]
    for p, view in zip(params, layout.views(flat_params)):
        view.copy_(p.data)
        p.data = view
    mine = layout.shard(flat_params, r)  # [k]: the slice this rank's optimizer owns
    optimizer = Adam([mine], lr=cfg.lr)  # moments for k elements only: ZeRO-1's saving
    received: list[torch.Tensor] = []  # the gradient step_shard got, this step
    updated: list[torch.Tensor] = []  # my slice right after the step, before any all-gather

    def step_shard(grad_shard: torch.Tensor) -> None:
        """Adam on this rank's slice flat_params[r*k:(r+1)*k], in place, with `grad_shard` [k]."""
        if not isinstance(grad_shard, torch.Tensor) or tuple(grad_shard.shape) != (k,):
            got = (tuple(grad_shard.shape) if isinstance(grad_shard, torch.Tensor)
                   else type(grad_shard).__name__)
            raise AssertionError(f"at dp={n}: step_shard takes this rank's averaged gradient "
                                 f"slice, shape ({k},) = padded {layout.padded} / N {n}; "
                                 f"got {got}")
        received.append(grad_shard.detach().clone())
        mine.grad = grad_shard.detach().to(mine.dtype)
        optimizer.step()
        mine.grad = None
        updated.append(mine.detach().clone())

    def close(a, b):  # reduce-scatter and all-reduce may sum in different orders
        return torch.allclose(a, b, rtol=1e-5, atol=1e-8)

    losses = []
    trace = _RankTrace("your zero1_step")
    for step in range(cfg.steps):
        comm.step = step
        flat_grads = torch.zeros_like(flat_params)  # [N*k], backward accumulates into it
        for p, view in zip(params, layout.views(flat_grads)):
            p.grad = view
        x, y = (t.to(device) for t in shard(global_batch(cfg, step), r, n))  # [b/N, s] x 2
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        own = flat_grads.clone()  # this rank's own gradients, before the learner's code
        local = layout.shard(own, r)  # this rank's own, unreduced slice
        received.clear()
        updated.clear()
        with _LibraryZeroDisabled(), trace:
            fn(flat_params, flat_grads, step_shard, comm)
        trace.agree()  # every rank made the same calls: the checks' own collectives may follow
        # the answer, only now (no frame held it while fn ran), by an all-reduce the records
        # do not see
        expected = own.clone()
        if n > 1:
            dist.all_reduce(expected, group=group)
        expected = layout.shard(expected, r) / n
        at = f"at dp={n}, step {step}"
        if len(received) != 1:
            raise AssertionError(f"{at}: step_shard was called {len(received)} times; call it "
                                 f"once per step, with the averaged gradient of your slice")
        got = received[0].to(expected.dtype)
        if not close(got, expected):
            if close(got, local):
                why = ("step_shard received this rank's own gradient slice, not the mean over "
                       "the ranks: reduce-scatter the gradients first (comm.reduce_scatter)")
            elif close(got, expected * n):
                why = ("step_shard received N times the mean gradient: divide the "
                       "reduce-scattered slice by N (comm.size('dp'))")
            elif close(got, local / n):
                why = ("step_shard received this rank's own gradient divided by N: the gradients "
                       "were never summed across ranks (comm.reduce_scatter)")
            else:
                why = (f"step_shard received a gradient that is not the mean over the ranks of "
                       f"slice r = [r*k, (r+1)*k) (k = {k}); max |difference| "
                       f"{(got - expected).abs().max().item():.2e}")
            raise AssertionError(f"{at}: {why}")
        truth = torch.empty_like(flat_params)  # every rank's updated slice, side by side
        if n > 1:
            _all_gather(truth, updated[0], group=group)
        else:
            truth.copy_(updated[0])
        if not torch.equal(flat_params, truth):
            stale = [q for q in range(n) if q != r and not torch.equal(
                layout.shard(flat_params, q), layout.shard(truth, q))]
            if not stale:
                raise AssertionError(f"{at}: after zero1_step, this rank's own slice of "
                                     f"flat_params is not what step_shard left there: each rank "
                                     f"contributes its own slice, flat_params[r*k:(r+1)*k], to "
                                     f"the all-gather")
            raise AssertionError(f"{at}: after zero1_step, flat_params does not hold the other "
                                 f"ranks' updated slices ({len(stale)} of {n - 1} differ): "
                                 f"all-gather every rank's own slice into flat_params "
                                 f"(comm.all_gather), in place")
    full = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return {"rank": r, "losses": losses, "params": full, "comm": comm.records,
            "n_params": layout.numel, "padding": layout.padding,
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in optimizer.state_tensors()),
            "wire": _wire_summary(trace)}


def check_zero1_step(fn, world_sizes=(2, 4), steps: int = 3) -> Grade:
    """`fn(flat_params, flat_grads, step_shard, comm)` must do ZeRO-1's gradient sync and step:
    reduce-scatter `flat_grads` over "dp" (rank r receives the sum of slice r), divide by N, hand
    that slice to `step_shard`, and all-gather every rank's updated slice into `flat_params`.

    Checked by training a small GPT with it on real ranks at each world size (dp=4 pads the flat
    buffer): the gradient each rank steps with, and the parameters every rank holds afterwards,
    every step; losses and final parameters against the single-process reference (1e-5); losses
    against the library's ZeroDataParallel(stage=1); bytes on the wire per step against
    2(N-1)/N x padded Psi (reduce-scatter + all-gather, what one all-reduce moves) and against the
    library's, both counted from the calls' records; and the bytes each rank really wrote to its
    sockets while `fn` ran (measured) against what those recorded calls explain, so a transfer
    around comm (torch.distributed or the process group called directly, with decoy calls
    through comm) is refused; so is a function that is the library's (code, bytecode or source)."""
    from ...runtime.launch import run  # late: engine imports the launcher stack
    from ...runtime.launch import run_ranks
    from ...reference import max_abs_diff, train_reference

    _library_copy(fn, ("parallel.zero", "course.grading.lesson03_zero"), "your")
    summary = []
    for n in world_sizes:
        cfg = RunConfig(dp=n, zero=1, batch=2 * n, steps=steps, **ZERO1_CHECK_SHAPE)
        results = _on_ranks(lambda: run_ranks(_zero1_rank, n, cfg.to_dict(), fn,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            "zero1_step still raises NotImplementedError: write the three "
                            "steps, then run this cell again.", f"at dp={n}")
        if isinstance(results, Grade):
            return results
        per_rank = [res.value for res in results]
        losses = [sum(vals) / n for vals in zip(*(r["losses"] for r in per_rank))]
        ref_losses, ref_params = train_reference(cfg)
        diff = max_abs_diff(losses, per_rank[0]["params"], ref_losses, ref_params)
        if max(diff.values()) > 1e-5:
            raise AssertionError(f"at dp={n}: training with zero1_step differs from the "
                                 f"single-process reference by {max(diff.values()):.2e} (> 1e-5)")
        library = run(cfg)
        if max(abs(a - b) for a, b in zip(losses, library.losses)) > 1e-5:
            raise AssertionError(f"at dp={n}: losses {losses} differ from the library's ZeRO-1 "
                                 f"{library.losses}")
        p = per_rank[0]["n_params"]
        units = theory.gpt_unit_sizes(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers)
        predicted = theory.zero_wire_bytes_per_step(1, p, "fp32", n, units)
        library_bytes = library.wire_bytes_per_step().get("dp", 0)
        s = 4 * theory.padded(p, n)  # padded flat buffer, fp32
        for r in per_rank:
            counted = sum(c["wire_bytes_model"] for c in r["comm"] if c["step"] >= 0) / steps
            if counted != predicted or counted != library_bytes:
                hint = ""
                if counted == 0:
                    hint = (" Nothing went through comm: use comm.reduce_scatter and "
                            "comm.all_gather (torch.distributed directly is not recorded).")
                elif counted == theory.wire_bytes("all_reduce", s, n) + theory.wire_bytes(
                        "all_gather", s, n):
                    hint = (" That is an all-reduce of the gradients plus an all-gather: each "
                            "rank needs only its own slice, so reduce-scatter it.")
                raise AssertionError(f"at dp={n}: rank {r['rank']} sent {counted:,.0f} bytes "
                                     f"per step (counted from its calls); reduce-scatter + "
                                     f"all-gather of the padded flat buffer send 2(N-1)/N x "
                                     f"{s:,} = {predicted:,} (the library's ZeRO-1, counted the "
                                     f"same way: {library_bytes:,.0f}).{hint}")
        wire = _wire_verdict(per_rank, f"at dp={n}", "your zero1_step")
        summary.append({"dp": n, "n_params": p, "padding": per_rank[0]["padding"],
                        "wire_bytes_per_step": predicted, "max_abs_diff": max(diff.values()),
                        "losses": losses, "reference_losses": ref_losses,
                        "library_losses": library.losses,
                        "optimizer_bytes": per_rank[0]["optimizer_bytes"],
                        "written_bytes": wire["written"], "explained_bytes": wire["explained"]})
    worst = max(row["max_abs_diff"] for row in summary)
    return Grade("correct", f"equal to the single-process reference (max |diff| {worst:.1e}) and "
                 f"to the library's ZeRO-1 at dp = {list(world_sizes)} (padding included), moving "
                 f"exactly 2(N-1)/N x padded Psi bytes per step (counted), and no bytes written "
                 f"to the sockets beyond those calls' (measured)", {"runs": summary})
