"""Mixture of experts (moe.py) and expert parallel (parallel/expert.py).

Routing is tested as pure functions first (ties, queue order, capacity, gates, the losses); then
runs: every layout equals the single-process reference (fp32, 1e-5), drops exactly the tokens the
reference drops, records its all-to-alls, and holds the model states theory predicts to the byte.
The matrix (test_matrix) runs one entry per behaviour by default and the rest under `-m slow`.
"""
import json
import math
import subprocess
import sys

import pytest
import torch

from parallel_mini import theory
from parallel_mini.config import RunConfig
from parallel_mini.data import global_batch
from parallel_mini.runtime.launch import run
from parallel_mini.model import GPT, GPTConfig, build_model
from parallel_mini.moe import MoE, capacity, dispatch_order, load_balancing_loss, route
from parallel_mini.optim import make_optimizer

from test_composition import check


# -- routing, pure --------------------------------------------------------------------------------
def test_ties_go_to_the_lower_expert_and_queues_fill_choice_major():
    r = route(torch.zeros(1, 4, 3), top_k=2, cap=2)  # every probability equal
    assert r.expert.tolist() == [[[0, 1]] * 4]
    # expert 0's queue: the four first choices in token order; expert 1's: the second choices
    assert r.slot.tolist() == [[[0, 0], [1, 1], [2, 2], [3, 3]]]
    assert r.keep.tolist() == [[[True, True], [True, True], [False, False], [False, False]]]
    assert torch.allclose(r.gate, torch.full((1, 4, 2), 0.5))


def test_first_choices_are_queued_before_second_choices():
    # token 0 prefers expert 1 then 0; tokens 1 and 2 prefer expert 0
    logits = torch.tensor([[[1.0, 2.0, -9], [2.0, 1.0, -9], [2.0, 1.0, -9]]])
    r = route(logits, top_k=2, cap=2)
    assert r.expert[0].tolist() == [[1, 0], [0, 1], [0, 1]]
    # expert 0 gets tokens 1 and 2 as first choices (slots 0, 1); token 0's second choice is 3rd
    assert r.slot[0].tolist() == [[0, 2], [0, 1], [1, 2]]
    assert r.keep[0].tolist() == [[True, False], [True, True], [True, False]]


def test_gates_renormalised_over_the_k_chosen():
    logits = torch.randn(3, 5, 8)
    r = route(logits, top_k=3, cap=100)
    probs = logits.softmax(-1)
    top = probs.topk(3, dim=-1).values
    assert torch.allclose(r.gate, top / top.sum(-1, keepdim=True))
    assert torch.allclose(r.gate.sum(-1), torch.ones(3, 5))


def test_capacity_is_a_ceiling():
    assert capacity(32, 4, 2, 1.0) == 16
    assert capacity(10, 4, 1, 1.0) == 3  # 2.5 -> 3
    assert capacity(10, 4, 1, 1.25) == math.ceil(1.25 * 10 / 4)


def test_dispatch_order_groups_rows_by_expert():
    r = route(torch.randn(2, 16, 4), top_k=2, cap=5)
    token, gate, counts = dispatch_order(r, 4)
    assert counts.tolist() == [int((r.expert[r.keep] == e).sum()) for e in range(4)]
    assert len(token) == len(gate) == int(r.keep.sum()) == int(counts.sum())
    experts = torch.repeat_interleave(torch.arange(4), counts)
    for tok, e in zip(token.tolist(), experts.tolist()):  # each row really chose that expert
        g, t = divmod(tok, 16)
        assert e in r.expert[g, t][r.keep[g, t]].tolist()


def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    E = 4
    uniform = route(torch.zeros(1, 8, E), 1, 8)
    uniform.expert = torch.arange(8).remainder(E).view(1, 8, 1)  # a perfect round robin
    assert load_balancing_loss(uniform).item() == pytest.approx(1.0)
    collapsed = route(torch.tensor([[[50.0, 0, 0, 0]] * 8]), 1, 8)  # all to expert 0, p ~ 1
    assert load_balancing_loss(collapsed).item() == pytest.approx(E, rel=1e-6)


@pytest.mark.parametrize("experts,moe_every,layers", [(4, 1, 4), (8, 2, 4), (2, 3, 3)])
def test_parameter_count_formula(experts, moe_every, layers):
    model = GPT(GPTConfig(layers=layers, experts=experts, moe_every=moe_every))
    assert sum(p.numel() for p in model.parameters()) == \
        theory.gpt_param_count(128, 32, 64, layers, experts, moe_every)
    assert sum(theory.gpt_unit_sizes(128, 32, 64, layers, 1, experts, moe_every)) == \
        theory.gpt_param_count(128, 32, 64, layers, experts, moe_every)
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == \
        [i in theory.moe_blocks(layers, experts, moe_every) for i in range(layers)]


# -- runs -----------------------------------------------------------------------------------------
def reference_logs(cfg: RunConfig) -> list[list[dict]]:
    """The MoE layers' routing logs of the single-process reference, one list per layer (trained
    as reference.train_reference trains it, with the layers' logs on)."""
    model = build_model(cfg)
    step = {"now": 0}
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.log, m.clock = [], (lambda: step["now"])
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.precision)
    for s in range(cfg.steps):
        step["now"] = s
        x, y = global_batch(cfg, s)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return [m.log for m in layers]


def reference_drops(cfg: RunConfig) -> dict[tuple[int, int], int]:
    """Dropped assignments per (step, layer) of the single-process reference."""
    return _drops(reference_logs(cfg))


def _drops(logs) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for log in logs:
        for e in log:
            out[e["step"], e["layer"]] = out.get((e["step"], e["layer"]), 0) + e["dropped"]
    return out


def check_moe(report) -> None:
    """check() (reference, per-axis bytes, states), plus: the same tokens dropped as in the
    reference, and the all-to-alls recorded and consistent with the routing logs."""
    check(report)
    cfg = RunConfig.from_dict(report.config)
    # one tensor-parallel rank per data-parallel replica: tp ranks route the same tokens
    logs = [r["moe"]["log"] for r in report.ranks if r["coords"]["tp"] == 0 and "moe" in r]
    assert _drops(logs) == reference_drops(cfg)
    if cfg.ep == 1:
        assert not any(rec.get("layer") == "moe" for r in report.ranks for rec in r["comm"])
        return
    micro = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    for r in report.ranks:
        a2a = [rec for rec in r["comm"] if rec.get("layer") == "moe" and rec["step"] >= 0]
        assert all(rec["op"] == "all_to_all" for rec in a2a)
        layers_here = len(r["moe"]["layers"])
        again = cfg.checkpointing == "full"
        # per layer and micro-batch: counts, dispatch, combine forward (twice with full
        # checkpointing) and dispatch, combine backward
        assert len(a2a) == cfg.steps * micro * layers_here * (3 * (1 + again) + 2)
        # the rows this rank dispatched are the assignments its routing kept
        sent = sum(sum(rec["in_splits"]) for rec in a2a
                   if rec["phase"] == "dispatch" and "pass" not in rec)
        assert sent == (1 + again) * sum(sum(e["kept"]) for e in r["moe"]["log"])


def moe_config(**kw) -> RunConfig:
    kw.setdefault("steps", 2)
    kw.setdefault("experts", 4)
    kw.setdefault("top_k", 2)
    kw.setdefault("reference", True)
    if kw.get("pp", 1) > 1:
        kw.setdefault("microbatches", 2 * kw["pp"])
        kw.setdefault("batch", 2 * kw.get("dp", 1) * kw["microbatches"])
        kw.setdefault("layers", 2 * kw["pp"])
    return RunConfig(**kw)


def test_one_rank_equals_the_reference():
    check_moe(run(moe_config()))


def test_done_means_dp4_ep4_eight_experts_top2():
    """dp 4 x ep 4, eight experts, top-2 (2 steps): two experts per rank."""
    report = run(moe_config(dp=4, ep=4, experts=8, top_k=2))
    check_moe(report)
    assert report.theory["expert_params_per_rank"] == 4 * 2 * theory.mlp_params(64)


def test_done_means_dp2_ep2_tp2_top1():
    """dp 2 x ep 2 x tp 2, top-1 (2 steps): experts whole on every tp rank."""
    check_moe(run(moe_config(dp=2, ep=2, tp=2, experts=4, top_k=1, capacity_factor=1.0)))


def test_ep_with_pp_and_zero1():
    check_moe(run(moe_config(dp=2, ep=2, pp=2, zero=1, schedule="1f1b")))


def test_ep_inside_dp_with_zero2_and_grad_accum():
    """ep 2 inside dp 4: experts replicated over edp = 2 and ZeRO-2-sharded over it."""
    report = run(moe_config(dp=4, ep=2, zero=2, grad_accum=2, batch=16))
    check_moe(report)
    assert "edp" in report.wire_bytes_per_step(0)


def test_ep_shards_expert_states_one_over_p():
    """Model states per rank: the dense part whole, the experts 1/P (theory to the byte is
    check()'s; here the difference itself)."""
    one, four = (run(moe_config(dp=4, ep=ep, steps=1, reference=False)) for ep in (1, 4))
    experts = 4 * 4 * theory.mlp_params(64)  # 4 MoE blocks x 4 experts
    saved = sum(one.ranks[0]["memory"][k] - four.ranks[0]["memory"][k]
                for k in ("params", "grads", "optimizer"))
    assert saved == 16 * experts * 3 // 4  # fp32 Adam: 16 bytes per parameter, 3/4 of them gone


def _slow(kw: dict, covered_by: str):
    return pytest.param(kw, marks=pytest.mark.slow, id=repr(kw))


@pytest.mark.parametrize("kw", [
    # in `make test`: one of each behaviour no test above has (a zero-bubble schedule's split
    # backward through the all-to-alls, four axes with gpipe, full recomputation re-dispatching)
    pytest.param(dict(dp=2, ep=2, pp=2, schedule="zb", moe_every=2),
                 id=repr(dict(dp=2, ep=2, pp=2, schedule="zb", moe_every=2))),
    pytest.param(dict(dp=2, ep=2, pp=2, schedule="gpipe", tp=2),
                 id=repr(dict(dp=2, ep=2, pp=2, schedule="gpipe", tp=2))),
    pytest.param(dict(dp=2, ep=2, checkpointing="full", grad_accum=2),
                 id=repr(dict(dp=2, ep=2, checkpointing="full", grad_accum=2))),
    # `-m slow`: each behaviour below is also run by a default test (named)
    _slow(dict(dp=2, ep=2), "test_done_means_dp2_ep2_tp2_top1"),
    _slow(dict(dp=4, ep=4, zero=1), "test_ep_with_pp_and_zero1, test_done_means_dp4_ep4_..."),
    _slow(dict(dp=4, ep=2, experts=8, top_k=1, capacity_factor=1.0),
          "test_ep_inside_dp_with_zero2_and_grad_accum, test_done_means_dp2_ep2_tp2_top1"),
    _slow(dict(dp=2, ep=2, pp=2, schedule="interleaved", layers=4, zero=2),
          "the zb and gpipe entries, test_ep_with_pp_and_zero1"),
    _slow(dict(dp=2, ep=2, checkpointing="selective"), "the checkpointing='full' entry"),
    _slow(dict(dp=8, ep=8, experts=8, batch=16), "test_done_means_dp4_ep4_eight_experts_top2"),
    _slow(dict(dp=8, ep=4, experts=8, zero=1, batch=16),
          "test_ep_inside_dp_with_zero2_and_grad_accum"),
    _slow(dict(dp=2, experts=4, zero=3), "tests/test_experts_zero3.py"),
])
def test_matrix(kw):
    """Expert parallel composed with the other axes. The default suite runs three entries, one per
    behaviour that no other default test covers: the zero-bubble schedule (its split backward
    through the all-to-alls), four axes at once (dp x ep x pp x tp, gpipe) and full
    recomputation with accumulation (every dispatch and combine issued twice, counted by
    check_moe). The others are `-m slow`, each beside the default test that covers its behaviour
    (see each entry's second argument)."""
    check_moe(run(moe_config(**kw)))


def test_ep_with_context_parallel_routes_whole_sequences():
    """cp splits every sequence; each cp rank routes the whole sequences (router logits
    all-gathered over cp, counted in theory.cp_wire_bytes_per_step) and keeps its own tokens:
    the same drops per step and layer as the reference (check_moe), zigzag layout, ep = dp x cp."""
    report = run(moe_config(dp=2, cp=2, ep=4, cp_impl="zigzag"))
    check_moe(report)
    gathers = [rec for rec in report.ranks[0]["comm"] if rec.get("layer") == "moe_routing"]
    assert gathers and all(rec["op"] == "all_gather" for rec in gathers)
    # the routing chart places each rank's tokens at their positions in the whole sequence
    from parallel_mini.parallel.context import positions_of
    from parallel_mini.course.viz.experts import routing_frame
    seq = report.config["seq"]
    for r, rank in enumerate(report.ranks):
        frame = routing_frame(report, rank=r)
        want = positions_of("zigzag", seq, 2, rank["coords"]["cp"]).tolist()
        for _, tokens in frame[frame.choice == 1].groupby("sequence"):
            assert tokens.position.tolist() == want


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(cp=2, ep=2),
    dict(cp=2, ep=2, checkpointing="full"),
    dict(dp=2, cp=2, ep=2, cp_impl="ulysses", zero=1),
    dict(cp=4, ep=2, top_k=1, capacity_factor=1.0),
    dict(cp=2, ep=2, pp=2, schedule="zb", tp=2),
    # five axes on 16 ranks: dp2 x tp2 x pp2 x cp2, experts over ep 4 of the dp x cp ranks
    dict(dp=2, tp=2, pp=2, cp=2, ep=4, schedule="1f1b", cp_impl="zigzag"),
], ids=repr)
def test_ep_with_cp_matrix(kw):
    check_moe(run(moe_config(**kw)))


def cli_reference_run(*flags: str, timeout: float) -> dict:
    """`python -m parallel_mini run FLAGS --reference --json -` in a subprocess: it exits 0 (its
    stderr shown otherwise) and equals the single-process reference; returns the JSON report."""
    out = subprocess.run([sys.executable, "-m", "parallel_mini", "run", *flags, "--reference",
                          "--json", "-"], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["max_abs_diff"] <= 1e-5
    return report


def test_cli_done_means_prints_the_diff_and_reports_all_to_alls():
    report = cli_reference_run("--dp", "4", "--ep", "4", "--experts", "8", "--top-k", "2",
                               timeout=120)
    assert all(any(rec["op"] == "all_to_all" and rec.get("layer") == "moe" for rec in r["comm"])
               for r in report["ranks"])
    assert len(report["measured"]["ep_all_to_all_per_step"]) == 4
