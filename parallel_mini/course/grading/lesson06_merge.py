"""Lesson 06 (06_long_sequences): merging two partial attention results (the online softmax),
`check_merge`.

One merge at a time in this process first (the usual mistakes named), then the library's ring
attention on real ranks with the learner's merge in place of its own, against torch's SDPA on the
whole sequence.
"""
from __future__ import annotations

from ...config import RunConfig
import os

from .core import (CHECK_PG_TIMEOUT, CHECK_RUN_TIMEOUT, _CodeSwapped, Grade, _RankTrace,
                   _call_in_time, _library_copy, _on_ranks)


# Ring attention on C ranks, with the learner's merge in place of the library's, against torch's
# SDPA on the whole sequence: contiguous chunks at C = 2 and 4, zigzag at C = 4. One sequence
# shape for every case (s divisible by 2C for zigzag).
MERGE_CHECK_CASES = ((2, "contiguous"), (4, "contiguous"), (4, "zigzag"))
MERGE_CHECK_SHAPE = (2, 4, 32, 8)  # b, a (heads), s, d (head size)
MERGE_TOLERANCE = 1e-5  # fp32: the merge sums the same terms in another order than SDPA
_MERGE_STUB = ("merge still raises NotImplementedError: write the online-softmax rule, then run "
               "this cell again.")


def _library_merge_refused(out, lse, o_t, lse_t):
    """Swapped in for the code of the library's context._merge while the checker runs a learner's
    merge (a literal message: the code object runs with the library module's globals)."""
    raise AssertionError("your merge called the library's own merge "
                         "(parallel_mini.parallel.context._merge), which the checker disables "
                         "while it runs your code: write the rule yourself, with torch "
                         "operations (torch.logaddexp, torch.exp, ...)")


class _LibraryMergeDisabled(_CodeSwapped):
    """While active, the library's `_merge` raises (its code object swapped), so an answer that
    calls it, by any name it was imported under, is refused. Restored on exit."""

    def swaps(self):
        from ...parallel import context
        fn = context._merge
        while hasattr(fn, "__wrapped_library__"):  # on a rank: the checker's own wrapper
            fn = fn.__wrapped_library__
        return [(fn, _library_merge_refused)]


def _merge_rule(out, lse, o_t, lse_t):
    """The rule, written out here (not the library's function) so the checker can run while the
    library's is disabled: (out', lse') of the union of both blocks' keys."""
    import torch

    new = torch.logaddexp(lse, lse_t)
    return out * (lse - new).exp().unsqueeze(-1) + o_t * (lse_t - new).exp().unsqueeze(-1), new


def _merge_result(res, shapes: tuple, where: str):
    """The learner's return value as (out', lse'), or an AssertionError saying what is wrong."""
    import torch

    out_shape, lse_shape = shapes
    if not (isinstance(res, (tuple, list)) and len(res) == 2
            and all(isinstance(t, torch.Tensor) for t in res)):
        raise AssertionError(f"{where}: merge must return a pair of tensors (out, lse); it "
                             f"returned {type(res).__name__}"
                             + (f" of {len(res)}" if isinstance(res, (tuple, list)) else ""))
    got = tuple(tuple(t.shape) for t in res)
    if got == (lse_shape, out_shape):
        raise AssertionError(f"{where}: merge returned (lse, out), shapes {list(got)}; return "
                             f"(out, lse) in that order")
    if got != (out_shape, lse_shape):
        raise AssertionError(f"{where}: merge returned tensors of shapes {list(got)}; out keeps "
                             f"the shape of out, {list(out_shape)}, and lse that of lse, "
                             f"{list(lse_shape)} (one log-sum-exp per query row)")
    return res


def _merge_probe_inputs(kind: str, seed: int = 6):
    """(out, lse, out_t, lse_t) for the checks on one merge, fp32, [b, a, n, d] / [b, a, n]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b, a, n, d = 2, 3, 5, 4
    out, o_t = torch.randn(b, a, n, d, generator=g), torch.randn(b, a, n, d, generator=g)
    lse, lse_t = 2 * torch.randn(b, a, n, generator=g), 2 * torch.randn(b, a, n, generator=g) + 1
    if kind == "first":  # how ring_forward starts every query row: nothing seen yet
        out, lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    elif kind == "large":  # scores of a few hundred: e^lse overflows fp32 (max ~ e^88.7)
        lse, lse_t = lse + 1000, lse_t + 1000
    return out, lse, o_t, lse_t


def _merge_diagnosis(fn) -> None:
    """One merge at a time, in this process, with the library's merge disabled: the common
    mistakes named. Raises NotImplementedError (the stub) or AssertionError."""
    import torch

    def close(a, b, tol=1e-5):
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=False)

    fresh = int.from_bytes(os.urandom(6), "little")  # new values every check: nothing to memorise
    for kind in ("random", "first", "large", "fresh"):
        out, lse, o_t, lse_t = _merge_probe_inputs(kind, fresh if kind == "fresh" else 6)
        kind = "random" if kind == "fresh" else kind
        where = {"random": "on one merge",
                 "first": "on the first merge of a row (out = 0, lse = -inf: nothing seen yet, "
                          "how ring_forward starts every query row)",
                 "large": "on one merge with large scores (lse around 1000)"}[kind]
        args = [t.clone() for t in (out, lse, o_t, lse_t)]
        with _LibraryMergeDisabled():
            try:
                res = _call_in_time(fn, *args, what=f"{where}: your merge")
            except (NotImplementedError, AssertionError):
                raise
            except Exception as e:  # noqa: BLE001 - the learner's code: say what it raised
                raise AssertionError(f"{where}: merge raised {type(e).__name__}: {e}") from None
        got_out, got_lse = _merge_result(res, (tuple(out.shape), tuple(lse.shape)), where)
        want_out, want_lse = _merge_rule(out, lse, o_t, lse_t)
        if not (torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()):
            why = {"first": "the first merge must give back (out_t, lse_t) exactly: e^(-inf) = 0, "
                            "but -inf - (-inf) and inf - inf are nan. torch.logaddexp(-inf, x) "
                            "is x",
                   "large": "e^1000 is inf in fp32 (the largest is about e^88.7): never "
                            "exponentiate a log-sum-exp itself. Work with differences such as "
                            "lse - lse', which are <= 0, or use torch.logaddexp"}.get(
                kind, "check every exp and log in your rule")
            raise AssertionError(f"{where}: merge returned inf or nan. {why}")
        if kind != "random":
            # lse ~ 1000 in fp32 is only good to ~6e-5 (its spacing there), and so are the
            # weights e^(lse - lse') made from it, whichever way they are computed
            tol = 1e-3 if kind == "large" else 1e-5
            if not (close(got_lse, want_lse, tol) and close(got_out, want_out, tol)):
                raise AssertionError(f"{where}: merge returned out and lse that differ from "
                                     f"the merged result by up to "
                                     f"{max((got_out - want_out).abs().max().item(), (got_lse - want_lse).abs().max().item()):.2e}"
                                     + (" (from nothing seen yet, the result is the new block's "
                                        "own out_t and lse_t)" if kind == "first" else
                                        " (large scores overflow e^lse in fp32: use "
                                        "differences of log-sum-exps, or torch.logaddexp)"))
            continue
        # the random probe: name the mistake
        new = want_lse
        w_old, w_new = (lse - new).exp().unsqueeze(-1), (lse_t - new).exp().unsqueeze(-1)
        if not close(got_lse, want_lse):
            if close(got_lse, torch.maximum(lse, lse_t)):
                why = ("lse' is max(lse, lse_t): the maximum is what a safe softmax subtracts "
                       "before exponentiating, not the normaliser. The two blocks' keys together "
                       "have the softmax sum e^lse + e^lse_t, so lse' is its log (the "
                       "log-sum-exp), which is larger than the max")
            elif close(got_lse, lse + lse_t):
                why = ("lse' = lse + lse_t: adding the logs multiplies the two sums; the keys of "
                       "both blocks add their sums, e^lse + e^lse_t")
            elif close(got_lse, lse_t):
                why = "lse' is the new block's lse_t alone: the keys seen before count too"
            else:
                why = (f"lse' differs from the log-sum-exp over both blocks' keys, "
                       f"log(e^lse + e^lse_t), by up to {(got_lse - want_lse).abs().max().item():.2e}")
            raise AssertionError(f"{where}: {why}")
        if not close(got_out, want_out):
            if close(got_out, out + o_t * w_new):
                why = ("the old output was not rescaled. out was normalised by e^lse, the sum over "
                       "the keys seen so far; once the new block is in, the sum is e^lse', so out "
                       "must be multiplied by e^(lse - lse') (and out_t by e^(lse_t - lse'))")
            elif close(got_out, out * w_old + o_t):
                why = ("out_t was added without its weight: it is normalised over its own block "
                       "only, so it counts with e^(lse_t - lse'), its block's share of the sum")
            elif close(got_out, out + o_t):
                why = ("out + out_t: each output is already normalised over its own keys, so "
                       "their weights in the sum add up to 2. Weigh each by its block's share of "
                       "the softmax sum, e^(lse - lse') and e^(lse_t - lse')")
            elif close(got_out, (out + o_t) / 2):
                why = ("the two outputs were averaged with equal weights: a block's weight is its "
                       "share of the softmax sum, e^(lse - lse') and e^(lse_t - lse'), not 1/2")
            elif close(got_out, out * w_new + o_t * w_old):
                why = ("the weights are swapped: out (the keys seen so far) goes with "
                       "e^(lse - lse'), out_t (the new block) with e^(lse_t - lse')")
            else:
                m = torch.maximum(lse, lse_t)
                if close(got_out, out * (lse - m).exp().unsqueeze(-1)
                         + o_t * (lse_t - m).exp().unsqueeze(-1)):
                    why = ("the outputs were weighted by e^(lse - max) and e^(lse_t - max): "
                           "normalise by the combined sum instead, e^(lse - lse') and "
                           "e^(lse_t - lse'), so the weights add up to 1")
                else:
                    why = (f"out' differs from the softmax-weighted output over both blocks by up "
                           f"to {(got_out - want_out).abs().max().item():.2e}")
            raise AssertionError(f"{where}: {why}")


def _merge_rank(cfg_dict: dict, layout: str, fn, shape: tuple) -> dict:
    """One rank of the merge check: the library's RingAttentionCore with the learner's merge in
    place of context._merge (the library's own disabled), forward and backward on this rank's
    tokens of one random q, k, v; compared with torch's SDPA (output, gradients) and the causal
    log-sum-exp on the whole sequence at this rank's positions."""
    import math

    import torch
    import torch.nn.functional as F

    from ...comm import Comm
    from ...mesh import build_mesh
    from ...parallel import context

    cfg = RunConfig.from_dict(cfg_dict)
    comm = Comm(build_mesh(cfg))
    c, r = comm.size("cp"), comm.rank("cp")
    b, a, s, d = shape
    g = torch.Generator().manual_seed(6)
    q, k, v, grad = (torch.randn(b, a, s, d, generator=g) for _ in range(4))  # the same everywhere
    pos = context.positions_of(layout, s, c, r)
    mine = [t[:, :, pos].contiguous() for t in (q, k, v)]  # [b, a, s/C, d]
    calls, inside = [0], [False]
    where = f"at C={c} ({layout}), rank {r}"
    # the ring's sends and receives traced: a merge that hangs, or raises, on one rank only is
    # reported as who waited on what within CHECK_PG_TIMEOUT, not as gloo's text
    trace = _RankTrace("ring attention with your merge")
    traced_fn = trace.learners(fn, "your merge", where)

    def learners_merge(out, lse, o_t, lse_t):
        if inside[0]:  # the learner's code called context._merge, i.e. this wrapper
            _library_merge_refused(out, lse, o_t, lse_t)
        inside[0] = True
        try:
            res = traced_fn(out, lse, o_t, lse_t)
        finally:
            inside[0] = False
        calls[0] += 1
        return _merge_result(res, (tuple(out.shape), tuple(lse.shape)), where)

    library = context._merge
    learners_merge.__wrapped_library__ = library
    context._merge = learners_merge
    try:
        with _LibraryMergeDisabled(), trace:
            core = context.RingAttentionCore(comm, "cp", layout)
            out, lse = core.ring_forward(*mine)
            dq, dk, dv = core.ring_backward(*mine, out, lse, grad[:, :, pos].contiguous())
    finally:
        context._merge = library
    # the expected answer, only now that the learner's merge has returned (no frame held it)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)  # [b, a, s, d], one process
    ref.backward(grad)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    ref_lse = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~causal, float("-inf")
                                                                   ).logsumexp(-1)  # [b, a, s]
    diffs = {"out": (out - ref[:, :, pos]).abs().max().item(),
             "lse": (lse - ref_lse[:, :, pos]).abs().max().item()}
    for name, mine_g, f in zip(("dq", "dk", "dv"), (dq, dk, dv), full):
        diffs[name] = (mine_g - f.grad[:, :, pos]).abs().max().item()
    return {"rank": r, "diffs": diffs, "calls": calls[0],
            "tiles_computed": sum(t["computed"] for t in core.tiles)}


def check_merge(fn, cases=MERGE_CHECK_CASES, shape=MERGE_CHECK_SHAPE) -> Grade:
    """`fn(out, lse, out_t, lse_t) -> (out, lse)` must fold a block's partial attention result
    into the running one: out [b, a, n, d] is the attention output of n query rows over the keys
    seen so far (normalised), lse [b, a, n] the log of their softmax sum; out_t, lse_t the same
    over a new block of keys. The result is out and lse over both blocks' keys together.

    First one merge at a time in this process (random values, the first merge of a row from
    out = 0 and lse = -inf, and scores large enough to overflow e^lse in fp32), naming the usual
    mistakes (the old output not rescaled, max instead of the log-sum-exp, ...). Then on real
    ranks: the library's ring attention (RingAttentionCore.ring_forward and ring_backward) with
    `fn` in place of its `_merge`, at each (C, layout) of `cases`, against torch's SDPA on the
    whole sequence: every rank's output, log-sum-exp and dq, dk, dv within MERGE_TOLERANCE.
    Throughout, the library's own `_merge` is disabled (it raises): an answer that calls it is
    refused, saying so, and so is a function that is the library's (its code object, bytecode or
    source). The in-process probes include one of values drawn anew every check, and stop a merge
    that does not return within 10 s. A merge that raises on one rank only is named with that rank; one that
    never returns on a rank stops the check after CHECK_PG_TIMEOUT seconds of waiting, saying
    which rank was still in it and what the others waited on."""
    from ...runtime.launch import run_ranks

    _library_copy(fn, ("parallel.context", "course.grading.lesson06_merge"), "your")
    try:
        _merge_diagnosis(fn)
    except NotImplementedError:
        return Grade("not attempted", _MERGE_STUB)
    summary = []
    for c, layout in cases:
        cfg = RunConfig(cp=c, cp_impl="zigzag" if layout == "zigzag" else "ring",
                        seq=shape[2], heads=shape[1])
        results = _on_ranks(lambda: run_ranks(_merge_rank, c, cfg.to_dict(), layout, fn, shape,
                                              timeout=CHECK_RUN_TIMEOUT,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _MERGE_STUB, f"at C={c} ({layout})")
        if isinstance(results, Grade):
            return results
        per_rank = sorted((res.value for res in results), key=lambda x: x["rank"])
        at = f"at C={c} ({layout} chunks)"
        what = {"out": "attention output", "lse": "log-sum-exp", "dq": "dq", "dk": "dk", "dv": "dv"}
        # the forward first: a wrong output on one rank spoils every rank's dk, dv (they travel)
        for keys in (("out", "lse"), ("dq", "dk", "dv")):
            for row in per_rank:
                bad = {k: row["diffs"][k] for k in keys if not row["diffs"][k] <= MERGE_TOLERANCE}
                if not bad:  # (a nan is never <= the tolerance)
                    continue
                worst = ", ".join(f"{what[k]} by {v:.2e}" for k, v in bad.items())
                hint = ("" if keys[0] == "out" else " (the gradients use the forward's lse: is it "
                        "the log-sum-exp over every key seen?)")
                raise AssertionError(f"{at}: rank {row['rank']}'s ring attention with your merge "
                                     f"differs from torch SDPA on the whole sequence: {worst} "
                                     f"(tolerance {MERGE_TOLERANCE:.0e}){hint}")
        summary.append({"cp": c, "layout": layout,
                        "max_abs_diff": max(max(r["diffs"].values()) for r in per_rank),
                        "merges_per_rank": [r["calls"] for r in per_rank],
                        "tiles_computed": [r["tiles_computed"] for r in per_rank]})
    worst = max(row["max_abs_diff"] for row in summary)
    where = ", ".join(f"C={row['cp']} {row['layout']}" for row in summary)
    return Grade("correct", f"ring attention with your merge equals torch SDPA on the whole "
                 f"sequence (output, log-sum-exp, dq, dk, dv; max |diff| {worst:.1e}) at {where}, "
                 f"the library's own merge disabled", {"runs": summary})
