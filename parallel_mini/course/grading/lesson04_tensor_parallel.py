"""Lesson 04 (04_tensor_parallel): a column-then-row parallel MLP, `check_parallel_mlp`.

The learner's MLP runs on real ranks with its weights split Megatron-style; every rank's output
against the unsharded MLP in one process, and exactly one all-reduce of the [b, s, h] output.
"""
from __future__ import annotations

from ... import theory
from ...config import RunConfig
from .core import (CHECK_PG_TIMEOUT, CHECK_RUN_TIMEOUT, _CodeSwapped, Grade, _RankTrace,
                   _library_copy, _on_ranks, _wire_summary, _wire_verdict)


# The check MLP: h = 16, hidden 4h = 64 (splits over 2 and 4 ranks), two input shapes per world
# size. Weights ~ N(0, 1/fan_in) and biases ~ N(0, 1) (not zero, as the model's init makes them):
# a bias added on every rank must show.
PARALLEL_MLP_SHAPE = {"d_model": 16, "inputs": ((2, 8), (3, 5))}
PARALLEL_MLP_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _parallel_mlp_weights(h: int, seed: int = 0):
    """The full MLP, the same on every process: fc [4h, h] + [4h], proj [h, 4h] + [h], and inputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    fc_w = torch.randn(4 * h, h, generator=g) / h ** 0.5
    fc_b = torch.randn(4 * h, generator=g)
    proj_w = torch.randn(h, 4 * h, generator=g) / (4 * h) ** 0.5
    proj_b = torch.randn(h, generator=g)
    xs = [torch.randn(b, s, h, generator=g) for b, s in PARALLEL_MLP_SHAPE["inputs"]]
    return fc_w, fc_b, proj_w, proj_b, xs


def _library_tp_refused(*args, **kwargs):
    """Swapped in for the code of the library's tensor-parallel layers while a learner's MLP runs."""
    raise AssertionError("your parallel_mlp called the library's own tensor parallelism (parallel_"
                         "mini.parallel.tensor: ColumnParallelLinear, RowParallelLinear, "
                         "reduce_from_tp, copy_to_tp, ...), which the checker disables while your "
                         "code runs: write the two matmuls and the one comm.all_reduce yourself")


class _LibraryTensorParallelDisabled(_CodeSwapped):
    """The library's tensor-parallel layers and their f/g functions raise while active."""

    def swaps(self):
        from ...parallel import tensor
        fns = [tensor.copy_to_tp, tensor.reduce_from_tp, tensor.apply_tensor_parallel,
               tensor._CopyToTP.forward, tensor._ReduceFromTP.forward,
               tensor.ColumnParallelLinear.forward, tensor.RowParallelLinear.forward]
        return [(f, _library_tp_refused) for f in fns]


def _parallel_mlp_rank(cfg_dict: dict, fn) -> dict:
    """One rank of the parallel-MLP check: rank r gets fc's rows r (its slice of the hidden
    features), proj's columns r (the matching slice of proj's inputs) and proj's whole bias, calls
    `fn` once per input and returns each output, its shards, the inputs and the comm records that
    call made: for the lesson's weights (seed 0, whose figures the Grade shows) and for weights new
    every check (a seed drawn by rank 0 and sent to the others before the learner's code runs).
    This rank keeps only its shards: no frame the learner's code can reach holds an unsharded MLP
    or the seed (the parent computes the expected outputs from every rank's shards after the
    ranks return)."""
    import os

    import torch
    import torch.distributed as dist

    from ...comm import Comm
    from ...mesh import build_mesh

    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    n, r = comm.size("tp"), comm.rank("tp")
    seed = torch.tensor([int.from_bytes(os.urandom(7), "little") if r == 0 else 0])
    dist.broadcast(seed, comm.mesh.global_rank("tp", 0), group=comm.mesh.groups["tp"])
    sets = []  # the lesson's weights (seed 0: the figures shown), then the ones drawn now
    for s in (0, int(seed)):
        fc_w, fc_b, proj_w, proj_b, xs = _parallel_mlp_weights(cfg.d_model, s)
        sets.append({"xs": xs, "calls": [], "shards": (
            fc_w.chunk(n, dim=0)[r].clone(), fc_b.chunk(n, dim=0)[r].clone(),  # [4h/t, h], [4h/t]
            proj_w.chunk(n, dim=1)[r].clone(), proj_b.clone())})  # [h, 4h/t], [h]
    del fc_w, fc_b, proj_w, proj_b, seed, s  # from here on, this rank holds its shards only
    trace = _RankTrace("your parallel_mlp")
    for one in sets:
        for x in one["xs"]:
            comm.records.clear()
            with _LibraryTensorParallelDisabled(), trace:
                out = fn(x.clone(), *(t.clone() for t in one["shards"]), comm)
            trace.agree()
            one["calls"].append({
                "out": out.detach().clone() if isinstance(out, torch.Tensor) else out,
                "records": [{k: c.get(k) for k in ("op", "group", "payload_bytes",
                                                   "wire_bytes_model", "count")}
                            for c in comm.records]})
    return {"rank": r, "sets": sets, "wire": _wire_summary(trace)}


def check_parallel_mlp(fn, world_sizes=(2, 4)) -> Grade:
    """`fn(x, fc_w_shard, fc_b_shard, proj_w_shard, proj_b, comm)` must compute the MLP
    proj(GELU(fc(x))) on x [b, s, h] with weights split over the "tp" ranks, Megatron-style: fc
    column-parallel (rank r holds rows r of fc.weight [4h, h] and of its bias), proj row-parallel
    (columns r of proj.weight [h, 4h]; proj's bias whole on every rank), and exactly one
    comm.all_reduce per call, of the [b, s, h] output.

    Checked on real ranks at each tp degree, with two input shapes, for the lesson's weights and
    for weights drawn anew every check (an answer that rebuilds the lesson's is refused on those;
    the figures shown are the lesson's, the same every run): every rank's output equals the
    unsharded MLP computed in one process, within rtol = atol = 1e-5 (fp32: the sharded version
    adds the 4h products of each output in t partial sums, a different order than one matmul, so
    the last bits may differ; a wrong answer is off by O(1)); each call records exactly one
    all-reduce over "tp", of b*s*h fp32 numbers, whose wire bytes are theory's 2(t-1)/t x S.
    While the learner's code runs the library's tensor-parallel layers raise (an answer built on
    them is refused, saying so); a deadlock stops after CHECK_PG_TIMEOUT seconds of waiting."""
    import torch
    import torch.nn.functional as F

    from ...runtime.launch import run_ranks

    h = PARALLEL_MLP_SHAPE["d_model"]
    _library_copy(fn, ("parallel.tensor", "course.grading.lesson04_tensor_parallel"), "your")
    summary, wires = [], []
    for n in world_sizes:
        cfg = RunConfig(tp=n, d_model=h, heads=n, vocab=128)
        results = _on_ranks(lambda: run_ranks(_parallel_mlp_rank, n, cfg.to_dict(), fn,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            "parallel_mlp still raises NotImplementedError: write it, then run "
                            "this cell again.", f"at tp={n}")
        if isinstance(results, Grade):
            return results
        ranks = sorted((res.value for res in results), key=lambda p: p["rank"])
        for k in (0, 1):  # the lesson's weights, then those drawn for this check
            per_rank = [{"rank": p["rank"], **p["sets"][k]} for p in ranks]
            # the unsharded MLP from every rank's shards, here, after the ranks returned
            fc_w = torch.cat([p["shards"][0] for p in per_rank], dim=0)  # [4h, h]
            fc_b = torch.cat([p["shards"][1] for p in per_rank], dim=0)  # [4h]
            proj_w = torch.cat([p["shards"][2] for p in per_rank], dim=1)  # [h, 4h]
            proj_b, xs = per_rank[0]["shards"][3], per_rank[0]["xs"]  # [h]
            full = [F.gelu(x @ fc_w.T + fc_b) @ proj_w.T + proj_b for x in xs]  # [b, s, h]
            diff = _mlp_verdict(n, h, k, xs, full, proj_b, per_rank)
            worst = diff if k == 0 else worst  # the figure shown: the lesson's weights
        wire = _wire_verdict(ranks, f"at tp={n}", "your parallel_mlp")
        wires.append({"tp": n, "written_bytes": wire["written"],
                      "explained_bytes": wire["explained"]})
        summary.append({"tp": n, "max_abs_diff": worst,
                        "all_reduce_bytes": [x.shape[0] * x.shape[1] * h * 4 for x in xs],
                        "wire_bytes_model": [theory.wire_bytes("all_reduce", x.shape[0] * x.shape[1] * h * 4, n)
                                             for x in xs]})
    worst = max(row["max_abs_diff"] for row in summary)
    return Grade("correct", f"equal to the unsharded MLP (max |diff| {worst:.1e}) at tp = "
                 f"{list(world_sizes)}, and with weights drawn anew for this check, with exactly one "
                 f"all-reduce of the [b, s, h] output per call (counted) and no bytes written to "
                 f"the sockets beyond it (measured)", {"runs": summary, "wire": wires})


def _mlp_verdict(n: int, h: int, k: int, xs, full, proj_b, per_rank) -> float:
    """Every rank's calls on one weight set (k: 0 the lesson's, 1 drawn for this check) against
    the unsharded MLP `full`: AssertionError naming the mistake, else the largest difference."""
    import torch

    worst, drawn = 0.0, " (weights drawn for this check)" if k else ""
    for i, (x, want) in enumerate(zip(xs, full)):
        b, s = x.shape[:2]
        at = f"at tp={n}, x of shape {list(x.shape)}{drawn}"
        out_bytes = b * s * h * 4
        for rank in per_rank:
            call, r = rank["calls"][i], rank["rank"]
            got, recs = call["out"], call["records"]
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError(f"{at}: rank {r} returned {shape}; parallel_mlp returns "
                                     f"the full output [b, s, h] = {list(want.shape)} on "
                                     f"every rank")
            reduces = [c for c in recs if c["op"] == "all_reduce"]
            others = sorted({c["op"] for c in recs if c["op"] != "all_reduce"})
            if others:
                raise AssertionError(f"{at}: rank {r} called {', '.join(others)}; column-"
                                     f"then-row needs nothing but one comm.all_reduce")
            if not reduces:
                raise AssertionError(
                    f"{at}: rank {r} recorded no all-reduce, so its output is only its own "
                    f"partial sum over 4h/t = {4 * h // n} hidden features. Sum the partial "
                    f"products over the ranks with comm.all_reduce(y, 'tp') (torch.distributed "
                    f"called directly is not recorded)")
            if len(reduces) > 1:
                raise AssertionError(f"{at}: rank {r} made {len(reduces)} all-reduces in one "
                                     f"call; column-then-row needs exactly one, after proj")
            rec = reduces[0]
            if rec["group"] != "tp":
                raise AssertionError(f"{at}: the all-reduce went over '{rec['group']}'; the "
                                     f"weights are split over 'tp'")
            hidden_bytes = b * s * (4 * h // n) * 4
            if rec["payload_bytes"] == hidden_bytes and hidden_bytes != out_bytes:
                raise AssertionError(
                    f"{at}: the all-reduce carried {hidden_bytes} bytes, the fc output "
                    f"[b, s, 4h/t] = [{b}, {s}, {4 * h // n}]: all-reducing after fc adds up "
                    f"*different* hidden features of the ranks. The fc output needs no "
                    f"communication; all-reduce after proj, [b, s, h]")
            if rec["payload_bytes"] != out_bytes:
                raise AssertionError(f"{at}: the all-reduce carried {rec['payload_bytes']} "
                                     f"bytes; the MLP's output [b, s, h] in fp32 is "
                                     f"{out_bytes}")
            expected_wire = theory.wire_bytes("all_reduce", out_bytes, n)
            if rec["wire_bytes_model"] != expected_wire:
                raise AssertionError(f"{at}: the all-reduce's wire bytes {rec['wire_bytes_model']} "
                                     f"differ from 2(t-1)/t x {out_bytes} = {expected_wire}")
            got = got.to(want.dtype)
            if not torch.allclose(got, want, **PARALLEL_MLP_TOLERANCE):
                diff = (got - want).abs().max().item()
                if torch.allclose(got, want + (n - 1) * proj_b, **PARALLEL_MLP_TOLERANCE):
                    why = (f"the output is off by (t-1) x proj's bias: every rank added the "
                           f"bias before the all-reduce, so the sum holds it t = {n} times. "
                           f"Add proj_b once, after the sum")
                elif torch.allclose(got, want - proj_b, **PARALLEL_MLP_TOLERANCE):
                    why = "proj's bias is missing: add proj_b (once, after the all-reduce)"
                else:
                    why = (f"rank {r}'s output differs from the unsharded MLP by up to "
                           f"{diff:.2e} (tolerance: rtol = atol = 1e-5)")
                raise AssertionError(f"{at}: {why}")
            worst = max(worst, (got - want).abs().max().item())
    return worst
