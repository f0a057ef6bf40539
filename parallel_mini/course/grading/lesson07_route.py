"""Lesson 07 (07_mixture_of_experts): top-k routing with capacity (the mixture-of-experts
router), `check_route`.
"""
from __future__ import annotations

from ... import theory
from ...config import RunConfig
import os
import random

from .core import (CHECK_PG_TIMEOUT, _CodeSwapped, Grade, _RankTrace, _call_in_time,
                   _library_copy, _on_ranks)


# The learner's route(logits, k, cap) -> moe.Routing goes where the library's is, the MoE layer's
# `routing` seam; their capacity(tokens, experts, k, factor), if given, computes the cap it gets.
# In-process probes first (named mistakes), then training runs on real ranks with expert
# parallel: every MoE layer of the ep run routes with the learner's code, compared with the same
# run routed by the library (drops, losses) and with the single-process reference (parameters).
ROUTE_RUN_CASES = (
    dict(dp=2, ep=2, experts=4, top_k=1, capacity_factor=1.0, layers=2),
    dict(dp=4, ep=4, experts=8, top_k=2, capacity_factor=1.25, layers=4, moe_every=2,
         grad_accum=2),
)
ROUTE_RUN_COMMON = dict(d_model=64, heads=4, seq=32, vocab=128, batch=8, steps=2)
ROUTE_TOLERANCE = 1e-5  # fp32: a gate written another way (e.g. a softmax over the k chosen
#                          logits) is equal up to rounding, and so is the training
CAPACITY_CASES = ((32, 8, 2, 1.0), (32, 8, 1, 1.0), (10, 4, 1, 1.0), (32, 8, 2, 1.1),
                  (32, 8, 2, 1.25), (6, 4, 1, 0.5), (12, 4, 2, 1.5))
_ROUTE_STUB = ("route still raises NotImplementedError: write it, then run this cell again.")
_CAPACITY_STUB = ("capacity still raises NotImplementedError: write it (and route), then run "
                  "this cell again.")
_ROUTING_FIELDS = ("expert", "gate", "slot", "keep", "probs")


def _library_route_refused(*args, **kwargs):
    """Swapped in for the code of moe.route while a learner's routing runs (a literal message:
    the code object runs with the library module's globals)."""
    raise AssertionError("your code called the library's own route (parallel_mini.moe.route, "
                         "also MoE.routing), which the checker disables while your code runs: "
                         "write the routing yourself, with torch operations (softmax, sort, ...)")


def _library_capacity_refused(*args, **kwargs):
    raise AssertionError("your code called the library's own capacity (parallel_mini.moe."
                         "capacity), which the checker disables while your code runs: write "
                         "the formula yourself (math.ceil)")


def _library_dispatch_refused(*args, **kwargs):
    raise AssertionError("your code called the library's own dispatch_order (parallel_mini.moe."
                         "dispatch_order), which the checker disables while your code runs: it "
                         "consumes a Routing, route has to make one")


class _LibraryRoutingDisabled(_CodeSwapped):
    """While active, moe.route, moe.capacity and moe.dispatch_order raise (their code objects
    swapped), so an answer calling any of them, by whatever name, is refused. Restored on exit."""

    RAISERS = (("route", _library_route_refused), ("capacity", _library_capacity_refused),
               ("dispatch_order", _library_dispatch_refused))

    def swaps(self):
        from ... import moe
        return [(getattr(moe, name), raiser) for name, raiser in self.RAISERS]


def _capacity_rule(tokens: int, experts: int, k: int, factor: float) -> int:
    """Written out here: the library's capacity is disabled while a learner's code runs."""
    import math
    return math.ceil(factor * tokens * k / experts)


def _queue_slots(expert, E: int, order: str = "choice"):
    """Each assignment's place in its expert's queue, [g, t, k] int64. order "choice": the right
    one (first choices in token order, then second choices, ..., a queue per routing group);
    the usual mistakes: "token" (token by token, each token's k choices together), "per-choice"
    (every choice column a queue of its own), "one-queue" (one queue over all the groups)."""
    import torch

    g, t, k = expert.shape
    ex = expert.tolist()
    slot = [[[0] * k for _ in range(t)] for _ in range(g)]
    shared = [0] * E
    for gi in range(g):
        taken = shared if order == "one-queue" else [0] * E
        pairs = ([(ti, j) for ti in range(t) for j in range(k)] if order == "token"
                 else [(ti, j) for j in range(k) for ti in range(t)])
        for ti, j in pairs:
            if order == "per-choice" and ti == 0:
                taken = [0] * E
            e = ex[gi][ti][j]
            slot[gi][ti][j] = taken[e]
            taken[e] += 1
    return torch.tensor(slot, dtype=torch.long).view(g, t, k)


def _route_rule(logits, k: int, ties: str = "lower"):
    """(probs, expert, gate) as the library's rule gives them, written out here; ties="higher"
    breaks ties toward the higher expert index instead (a mistake the checker names)."""
    import torch

    probs = logits.float().softmax(-1)  # [g, t, E]
    E = probs.shape[-1]
    if ties == "higher":
        p_sorted, e_sorted = torch.sort(probs.flip(-1), dim=-1, descending=True, stable=True)
        e_sorted = E - 1 - e_sorted
    else:
        p_sorted, e_sorted = torch.sort(probs, dim=-1, descending=True, stable=True)
    top = p_sorted[..., :k]
    return probs, e_sorted[..., :k], top / top.sum(-1, keepdim=True)


def _route_probes():
    """(name, logits [g, t, E], k, cap) for the in-process checks, fp32."""
    import torch

    g = torch.Generator().manual_seed(7)
    ties = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 0.0], [0.0, 3.0, 0.0, 3.0],
                          [5.0, 1.0, 1.0, 1.0], [0.0, 1.0, 2.0, 3.0]]])
    bias4 = torch.tensor([1.5, 1.0, 0.0, -1.0])
    bias8 = torch.tensor([1.5, 1.2, 0.8, 0.4, 0.0, -0.4, -0.8, -1.2])
    fresh = torch.Generator().manual_seed(int.from_bytes(os.urandom(6), "little"))
    t, E, k = 6 + int(torch.randint(0, 10, (1,), generator=fresh)), 4, 2
    return [
        ("tied probabilities", ties, 2, 2),
        (f"drawn for this check: two sequences of {t} tokens, k = {k}",
         2 * torch.randn(2, t, E, generator=fresh) + bias4, k, _capacity_rule(t, E, k, 1.0)),
        ("two sequences of 12 tokens, k = 2", 2 * torch.randn(2, 12, 4, generator=g) + bias4, 2,
         _capacity_rule(12, 4, 2, 1.0)),
        ("two sequences of 10 tokens, 8 experts, k = 3",
         2 * torch.randn(2, 10, 8, generator=g) + bias8, 3, _capacity_rule(10, 8, 3, 1.0)),
        ("three sequences of 8 tokens, k = 1", 2 * torch.randn(3, 8, 4, generator=g) + bias4, 1,
         _capacity_rule(8, 4, 1, 1.0)),
    ]


def _routing_result(r, g: int, t: int, k: int, E: int, where: str):
    """The learner's return value checked for its form: fields, shapes, dtypes."""
    import torch

    if isinstance(r, (tuple, list)):
        raise AssertionError(f"{where}: route returned a {type(r).__name__} of {len(r)}; return "
                             f"moe.Routing(expert=..., gate=..., slot=..., keep=..., probs=...), "
                             f"the fields by name")
    missing = [n for n in _ROUTING_FIELDS if not isinstance(getattr(r, n, None), torch.Tensor)]
    if missing:
        raise AssertionError(f"{where}: route's result has no tensor {', '.join(missing)}; return "
                             f"moe.Routing(expert, gate, slot, keep, probs)")
    want = {"expert": ((g, t, k), "int64"), "gate": ((g, t, k), "float"),
            "slot": ((g, t, k), "int64"), "keep": ((g, t, k), "bool"),
            "probs": ((g, t, E), "float")}
    for name, (shape, kind) in want.items():
        x = getattr(r, name)
        if tuple(x.shape) != shape:
            raise AssertionError(f"{where}: {name} has shape {list(x.shape)}; for logits "
                                 f"[g, t, E] = [{g}, {t}, {E}] and k = {k} it is {list(shape)}")
        ok = {"int64": x.dtype == torch.long, "bool": x.dtype == torch.bool,
              "float": x.dtype.is_floating_point}[kind]
        if not ok:
            hint = {"int64": " (torch.long: F.one_hot and indexing need it; .long() converts)",
                    "bool": " (a mask: slot < cap gives one)",
                    "float": ""}[kind]
            raise AssertionError(f"{where}: {name} is {x.dtype}; it must be "
                                 f"{'a floating type' if kind == 'float' else kind}{hint}")
    return r


def _first_difference(got, want) -> tuple:
    """(g, t, j) of the first element where two [g, t, k] tensors differ."""
    return tuple(int(i) for i in (got != want).nonzero()[0])


def _routing_diagnosis(fn, name: str, logits, k: int, cap: int) -> None:
    """One probe: the learner's route on `logits`, checked field by field against the rule, the
    usual mistakes named. Raises NotImplementedError (the stub) or AssertionError."""
    import torch

    def close(a, b, tol=1e-6):
        return torch.allclose(a.double(), b.double(), rtol=10 * tol, atol=tol)

    g, t, E = logits.shape
    where = f"on the example '{name}' (logits of shape [{g}, {t}, {E}], k = {k}, cap = {cap})"
    leaf = logits.clone().requires_grad_()
    with _LibraryRoutingDisabled():
        try:
            r = _call_in_time(fn, leaf, k, cap, what=f"{where}: your route")
        except (NotImplementedError, AssertionError):
            raise
        except Exception as e:  # noqa: BLE001 - the learner's code: say what it raised
            raise AssertionError(f"{where}: route raised {type(e).__name__}: {e}") from None
    r = _routing_result(r, g, t, k, E, where)
    probs, expert, gate = _route_rule(logits, k)
    # probs: the router's softmax over the E experts
    if not close(r.probs.detach(), probs):
        why = ("probs holds the logits: it is their softmax over the E experts"
               if close(r.probs.detach(), logits) else
               "probs must be the softmax of the logits over the experts (the last dimension), "
               "in fp32")
        raise AssertionError(f"{where}: {why}")
    # expert: the k most probable, most probable first, ties to the lower index
    if not torch.equal(r.expert, expert):
        gi, ti, _ = _first_difference(r.expert, expert)
        row = logits[gi, ti].tolist()
        got, right = r.expert[gi, ti].tolist(), expert[gi, ti].tolist()
        at = f"token {ti}" + (f" of sequence {gi}" if g > 1 else "") + f" (logits {row})"
        p_row = probs[gi, ti]
        tied = bool((p_row[right].unsqueeze(-1) == p_row).sum(-1).gt(1).any())
        if torch.equal(r.expert, _route_rule(logits, k, ties="higher")[1]):
            why = (f"ties are broken toward the higher index: {at} got experts {got}, the rule "
                   f"{right}. Among equal probabilities the lower expert index comes first, so "
                   f"that every rank (and every run) picks the same experts: a stable sort "
                   f"keeps equal values in index order (torch.sort(..., descending=True, "
                   f"stable=True))")
        elif tied:
            why = (f"{at} has tied probabilities: your route chose experts {got}, the rule "
                   f"{right}, the lower index first among equal probabilities. torch.topk "
                   f"makes no promise about the order of equal values (here it does not give "
                   f"the lower index); sort with torch.sort(probs, descending=True, stable=True)")
        elif sorted(got) == sorted(right) and got == sorted(got):
            why = (f"{at}: experts {got} are listed by index; list them most probable first, "
                   f"{right} (the first choice queues before the second)")
        elif sorted(got) == sorted(right):
            why = f"{at}: experts {got} must be listed most probable first: {right}"
        elif set(got) == set(probs[gi, ti].argsort()[:k].tolist()):
            why = (f"{at} went to its {k} least probable experts {got}; the rule takes the most "
                   f"probable, {right}")
        else:
            why = (f"{at} went to experts {got}; the {k} most probable are {right}, most "
                   f"probable first")
        raise AssertionError(f"{where}: {why}")
    # gate: the chosen probabilities renormalised over the k, carrying the router's gradient
    top = probs.gather(-1, expert)
    if not close(r.gate.detach(), gate):
        if k > 1 and close(r.gate.detach(), top):
            why = ("the gates are not renormalised: they are the router's probabilities of the "
                   "chosen experts, which sum to less than 1. Divide by their sum over the k, "
                   "so that a token's output is a weighted mean of its experts' outputs")
        elif close(r.gate.detach(), torch.full_like(gate, 1.0 / k)):
            why = (f"every gate is 1/k = {1 / k:.3g}: each is the chosen expert's probability "
                   f"divided by the sum of the k chosen probabilities")
        else:
            why = (f"the gates differ from the chosen probabilities renormalised over the k by "
                   f"up to {(r.gate.detach().double() - gate.double()).abs().max().item():.2e}")
        raise AssertionError(f"{where}: {why}")
    for field_name in ("gate", "probs"):
        if not getattr(r, field_name).requires_grad:
            raise AssertionError(
                f"{where}: {field_name} carries no gradient to the router (it was computed from "
                f"detached values, .tolist() or .item(), or under torch.no_grad). The router "
                f"learns through the gates (and the load-balancing loss through probs): compute "
                f"them from the logits with torch operations")
    weights = torch.randn(g, t, k, generator=torch.Generator().manual_seed(8))
    (got_grad,) = torch.autograd.grad((r.gate * weights).sum(), leaf, allow_unused=True)
    want_leaf = logits.clone().requires_grad_()
    (want_grad,) = torch.autograd.grad((_route_rule(want_leaf, k)[2] * weights).sum(), want_leaf)
    if got_grad is None or not close(got_grad, want_grad, 1e-5):
        raise AssertionError(f"{where}: the gates' gradient with respect to the logits differs "
                             f"from the rule's: compute the gates from the softmax of the logits "
                             f"(not from detached or re-created tensors)")
    # slot: the place in the expert's queue, first choices first, a queue per sequence
    slot = _queue_slots(expert, E)
    if not torch.equal(r.slot, slot):
        gi, ti, j = _first_difference(r.slot, slot)
        at = (f"token {ti}" + (f" of sequence {gi}" if g > 1 else "") + f", choice {j + 1} "
              f"(expert {int(expert[gi, ti, j])}): slot {int(r.slot[gi, ti, j])}, the rule "
              f"{int(slot[gi, ti, j])}")
        if torch.equal(r.slot, slot + 1):
            why = (f"the slots count from 1 ({at}). A slot is the number of assignments queued "
                   f"before this one: the first in a queue has slot 0, and slots 0 to cap - 1 "
                   f"are kept")
        elif torch.equal(r.slot, _queue_slots(expert, E, "token")):
            why = (f"the queues are filled token by token, each token's k choices together "
                   f"({at}). Every token's first choice queues first, in token order, then the "
                   f"second choices: a token's second choice must not take the place of a later "
                   f"token's first choice")
        elif torch.equal(r.slot, _queue_slots(expert, E, "per-choice")):
            why = (f"each choice starts a queue of its own ({at}): the second choices queue "
                   f"behind all the first choices for the same expert, in the same queue")
        elif torch.equal(r.slot, _queue_slots(expert, E, "one-queue")):
            why = (f"one queue runs over all the sequences ({at}): the routing group is one "
                   f"sequence, and each has its own queues (its own cap slots per expert)")
        elif torch.equal(r.slot[slot < cap], slot[slot < cap]):
            why = (f"the kept assignments have the right slots, the dropped ones not ({at}): a "
                   f"slot is the place in the queue for every assignment, >= cap for a dropped "
                   f"one")
        else:
            why = (f"{at}. A slot is the number of assignments queued before this one for the "
                   f"same expert")
        raise AssertionError(f"{where}: {why}")
    # keep: slot < cap
    keep = slot < cap
    if not torch.equal(r.keep, keep):
        if bool(r.keep.all()) and bool((slot > cap).any()):
            why = (f"nothing was dropped, though {int((~keep).sum())} assignments found their "
                   f"expert's queue full: keep = slot < cap")
        elif torch.equal(r.keep, slot <= cap):
            why = (f"capacity off by one: an expert kept cap + 1 = {cap + 1} assignments of a "
                   f"sequence. Slots start at 0, so slots 0 to cap - 1 are the cap kept: keep = "
                   f"slot < cap")
        elif torch.equal(r.keep, slot < cap - 1):
            why = (f"capacity off by one: an expert kept cap - 1 = {cap - 1} assignments of a "
                   f"sequence; keep = slot < cap")
        else:
            gi, ti, j = _first_difference(r.keep, keep)
            why = (f"token {ti}" + (f" of sequence {gi}" if g > 1 else "") + f", choice {j + 1}: "
                   f"keep {bool(r.keep[gi, ti, j])}, the rule {bool(keep[gi, ti, j])} (slot "
                   f"{int(slot[gi, ti, j])}, cap {cap}): keep = slot < cap")
        raise AssertionError(f"{where}: {why}")


def _capacity_diagnosis(capacity_fn) -> None:
    """The learner's capacity on CAPACITY_CASES, the usual mistakes named."""
    import math
    import numbers

    rng = random.Random(os.urandom(8))  # and two drawn anew every check: nothing to memorise
    fresh = [(rng.randint(4, 200), rng.choice((2, 4, 8, 16)), rng.randint(1, 2),
              rng.choice((0.5, 1.0, 1.25, 1.5, 2.0))) for _ in range(2)]  # exact in binary
    for tokens, E, k, F in list(CAPACITY_CASES) + fresh:
        where = f"capacity(tokens={tokens}, experts={E}, k={k}, factor={F})"
        with _LibraryRoutingDisabled():
            try:
                got = _call_in_time(capacity_fn, tokens, E, k, F, what=f"your {where}")
            except (NotImplementedError, AssertionError):
                raise
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{where} raised {type(e).__name__}: {e}") from None
        want = _capacity_rule(tokens, E, k, F)
        exact = F * tokens * k / E
        if not isinstance(got, numbers.Integral) or isinstance(got, bool):
            raise AssertionError(f"{where} returned {got!r} ({type(got).__name__}); return an int "
                                 f"(a number of slots: math.ceil gives one)")
        if got == want:
            continue
        if got == math.floor(exact):
            why = (f"rounds down: F·tokens·k/E = {exact:g} gives {want} slots (math.ceil), not "
                   f"{got}. Rounding down would leave the fair share's remainder without a slot")
        elif got == round(exact):
            why = (f"rounds to the nearest: F·tokens·k/E = {exact:g} rounds up, to {want} "
                   f"(math.ceil)")
        elif got == want + 1:
            why = (f"one slot too many: F·tokens·k/E = {exact:g}, so {want} (math.ceil; an "
                   f"integer needs no extra slot)")
        elif got == math.ceil(F * tokens / E):
            why = (f"k is missing: each token makes k = {k} assignments, so the fair share is "
                   f"tokens·k/E; ceil(F·tokens·k/E) = {want}")
        elif got == math.ceil(tokens * k / E):
            why = f"the capacity factor is missing: ceil(F·tokens·k/E) = ceil({exact:g}) = {want}"
        else:
            why = f"returned {got}; ceil(F·tokens·k/E) = ceil({exact:g}) = {want}"
        raise AssertionError(f"{where} {why}")


def _learners_routing(fn, capacity_fn, factor: float, calls: list, where: str, trace):
    """The function put in a MoE layer's `routing` seam on a rank: the learner's capacity (if
    any) computes the cap, the learner's route routes, the library's own disabled meanwhile;
    both run as the learner's code under the rank's `trace` (_RankTrace.learners)."""
    route_fn = trace.learners(fn, "your route", where)
    cap_fn = capacity_fn and trace.learners(capacity_fn, "your capacity", where)

    def routing(logits, k, cap):
        g, t, E = logits.shape
        with _LibraryRoutingDisabled():
            if cap_fn is not None:
                cap = cap_fn(t, E, k, factor)
            r = route_fn(logits, k, cap)
        calls.append(1)
        return _routing_result(r, g, t, k, E, where)

    return routing


def _route_rank(cfg_dict: dict, fn, capacity_fn) -> dict:
    """One rank of the routing check: engine.train_rank with every MoE layer's `routing` seam
    set to the learner's function (the single-process reference, which rank 0 then trains for
    the comparison, keeps the library's route)."""
    from ... import engine

    import torch.distributed as dist

    cfg = RunConfig.from_dict(cfg_dict)
    calls: list = []
    original = engine.apply_expert_parallel
    where = f"at {_case_name(cfg)}, rank {dist.get_rank()}"
    # every collective of the run traced: a route that hangs, or raises, on one rank only is
    # reported as who waited on what within CHECK_PG_TIMEOUT, not as gloo's text
    trace = _RankTrace("the training run with your route")

    def apply_with_learners_routing(model, comm, axis, loss_scale=1.0):
        experts = original(model, comm, axis, loss_scale)
        for layer in experts.layers:
            layer.routing = _learners_routing(fn, capacity_fn, cfg.capacity_factor, calls, where,
                                              trace)
        return experts

    engine.apply_expert_parallel = apply_with_learners_routing
    try:
        with trace:
            out = engine.train_rank(cfg_dict)
    finally:
        engine.apply_expert_parallel = original
    out["route_calls"] = len(calls)
    return out


def _case_name(cfg) -> str:
    return f"dp={cfg.dp} x ep={cfg.ep} (E={cfg.experts}, k={cfg.top_k}, F={cfg.capacity_factor:g})"


def _compare_route_runs(cfg, mine, library) -> None:
    """The learner's run against the library's (the same config): every rank's routing log (the
    assignments kept per expert and the dropped ones, per layer and micro-batch), the losses, and
    the final parameters against the single-process reference."""
    case = _case_name(cfg)
    micro = cfg.grad_accum
    n_moe = len(theory.moe_blocks(cfg.layers, cfg.experts, cfg.moe_every))
    for r in mine.ranks:
        want_calls = n_moe * micro * cfg.steps
        if r["route_calls"] != want_calls:  # the seam was not used: the checker itself is wrong
            raise AssertionError(f"at {case}: your route ran {r['route_calls']} times on rank "
                                 f"{r['rank']}, not {want_calls} (MoE layers x micro-batches x "
                                 f"steps): the checker could not put it in place")
    for r_mine, r_lib in zip(mine.ranks, library.ranks):
        if len(r_mine["moe"]["log"]) != len(r_lib["moe"]["log"]):
            raise AssertionError(f"at {case}: rank {r_mine['rank']} logged "
                                 f"{len(r_mine['moe']['log'])} MoE forwards with your route, "
                                 f"{len(r_lib['moe']['log'])} with the library's")
    # the earliest forward first, over all ranks: a route wrong on one rank changes every rank's
    # training after the step's gradient sync, and that later difference is not the news
    for i in range(max(len(r["moe"]["log"]) for r in mine.ranks)):
        for r_mine, r_lib in zip(mine.ranks, library.ranks):
            if i >= len(r_mine["moe"]["log"]):  # (a pipeline stage logs its own layers only)
                continue
            a, b = r_mine["moe"]["log"][i], r_lib["moe"]["log"][i]
            if (a["kept"], a["dropped"]) != (b["kept"], b["dropped"]):
                raise AssertionError(
                    f"at {case}: rank {r_mine['rank']}, step {a['step']}, layer {a['layer']}: "
                    f"with your route the experts kept {a['kept']} assignments and dropped "
                    f"{a['dropped']}; with the library's route {b['kept']} and {b['dropped']}")
    loss_diff = max(abs(x - y) for x, y in zip(mine.losses, library.losses))
    if not loss_diff <= ROUTE_TOLERANCE:
        raise AssertionError(f"at {case}: the losses with your route {mine.losses} differ from "
                             f"the library's {library.losses} by {loss_diff:.2e}")
    detail = mine.max_abs_diff_detail
    if not max(detail.values()) <= ROUTE_TOLERANCE:
        raise AssertionError(f"at {case}: after training with your route the final parameters "
                             f"differ from the single-process reference (the library's route) "
                             f"by {detail['params']:.2e}, the losses by {detail['losses']:.2e}")


def check_route(fn, capacity=None, cases=ROUTE_RUN_CASES) -> Grade:
    """`fn(logits, k, cap) -> moe.Routing` must route like the library's moe.route: logits
    [g, t, E] (g routing groups, here sequences, of t tokens); per token the k experts of highest
    softmax probability, most probable first, ties to the lower expert index (`expert`, int64);
    their probabilities renormalised over the k (`gate`, with the router's gradient); each
    assignment's place in its expert's queue, first choices in token order before second choices,
    a queue per group (`slot`, int64); `keep` = slot < cap (bool); `probs` the softmax [g, t, E].
    `capacity(tokens, experts, k, factor)`, if given, must be ceil(factor * tokens * k / experts),
    and gives the cap on the ranks.

    First in this process: capacity on CAPACITY_CASES, then route on small examples (tied
    probabilities, drops, k = 1, 2, 3), naming the usual mistakes (ties to the higher index,
    queues filled token by token, capacity off by one or rounded down, gates not renormalised or
    without gradient). Then on real ranks, for each case: a training run with expert parallel in
    which every MoE layer routes with `fn` (its `routing` seam), against the same run with the
    library's route: the same assignments kept and dropped in every layer, micro-batch and rank,
    the same losses, and final parameters equal to the single-process reference (within
    ROUTE_TOLERANCE). Throughout, the library's route, capacity and dispatch_order are disabled
    (they raise) while the learner's code runs: an answer calling them is refused, saying so, and
    so is a function that is the library's (its code object, bytecode or source). The in-process
    probes include cases drawn anew every check, and stop a call that does not return in 10 s.
    On the ranks, a route (or capacity) that raises on one rank only is named with that rank, one
    that calls a collective is refused, and one that never returns on a rank stops the check
    after CHECK_PG_TIMEOUT seconds of waiting, saying which rank was still in it and what the
    others waited on (e.g. the MoE layer's all-to-all, with its rows per rank)."""
    from ...runtime.launch import run
    from ...runtime.launch import run_ranks
    from ...report import merge_rank_results

    for answer in (fn, capacity):
        if answer is not None:
            _library_copy(answer, ("moe", "course.grading.lesson07_route"), "your")
    try:
        if capacity is not None:
            _capacity_diagnosis(capacity)
    except NotImplementedError:
        return Grade("not attempted", _CAPACITY_STUB)
    try:
        for name, logits, k, cap in _route_probes():
            _routing_diagnosis(fn, name, logits, k, cap)
    except NotImplementedError:
        return Grade("not attempted", _ROUTE_STUB)
    summary = []
    for case in cases:
        cfg = RunConfig(**{**ROUTE_RUN_COMMON, **case}, reference=True).validate()
        results = _on_ranks(lambda: run_ranks(_route_rank, cfg.world_size, cfg.to_dict(), fn,
                                              capacity, timeout=120.0,
                                              pg_timeout=CHECK_PG_TIMEOUT),
                            _ROUTE_STUB, f"at {_case_name(cfg)}")
        if isinstance(results, Grade):
            return results
        mine = merge_rank_results(cfg, [res.value for res in results])
        library = run(cfg.replace(reference=False))
        _compare_route_runs(cfg, mine, library)
        summary.append({"case": _case_name(cfg), "config": cfg.to_dict(), "report": mine,
                        "library": library,
                        "route_calls_per_rank": [r["route_calls"] for r in mine.ranks],
                        "dropped": sum(e["dropped"] for r in mine.ranks for e in r["moe"]["log"]),
                        "assignments": sum(sum(e["routed"]) for r in mine.ranks
                                           for e in r["moe"]["log"]),
                        "max_abs_diff": mine.max_abs_diff})
    worst = max(row["max_abs_diff"] for row in summary)
    dropped = sum(row["dropped"] for row in summary)
    return Grade("correct", f"your {'capacity and ' if capacity is not None else ''}route trained "
                 f"the MoE model with expert parallel on real ranks exactly as the library's: the "
                 f"same {dropped} assignments dropped, every layer, step and rank, the same "
                 f"losses, final parameters equal to the single-process reference (max |diff| "
                 f"{worst:.1e}) at " + ", ".join(row["case"] for row in summary)
                 + "; the library's route, capacity and dispatch_order disabled while yours ran",
                 {"runs": summary})
