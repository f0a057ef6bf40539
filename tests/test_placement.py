"""One placement (parallel_mini/placement.py): which box of every full tensor each rank holds and
owns, said once.

- the torch-free twin of the tiny GPT (gpt_tensors, gpt_held) equals what the live model and its
  parallel modules say (placement.held_by), on every tp x ep cut;
- on the composition matrix (every 8th layout here, all 504 under `-m slow`), the boxes all ranks
  own tile every full tensor, each element the same number of times (once per replica); a
  piece's optimizer states are its boxes too; each rank's padding is theory's; the planner's twin
  (_stages, stage_states) gives every rank its units and its stage theory's model states;
- theory's unit sizes count the placement, and agree with their closed form;
- a few layouts run live: every rank's strategy lists exactly the twin's boxes (`owned`), with
  Adam's two moments per owned element (more live layouts under `-m slow`).
"""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from parallel_mini import placement, theory
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.course import planner
from parallel_mini.runtime.launch import run
from parallel_mini.model import build_model
from parallel_mini.parallel.expert import apply_expert_parallel
from parallel_mini.parallel.schedules import virtual_stages
from parallel_mini.parallel.tensor import apply_tensor_parallel

SMALL = dict(layers=2, d_model=32, heads=2, seq=16, vocab=64, batch=8)


# -- the twin of the model and its parallel modules ----------------------------------------------
def _stub_comm(sizes: dict, ranks: dict):
    """What the parallel modules read of a Comm while they cut: sizes and ranks, no group."""
    return SimpleNamespace(size=lambda a: sizes.get(a, 1), rank=lambda a: ranks.get(a, 0), step=0)


@pytest.mark.parametrize("experts,moe_every", [(0, 1), (4, 1), (4, 2)])
def test_twin_tensors_and_cuts_are_the_live_modules(experts, moe_every):
    cfg = RunConfig(**{**SMALL, "layers": 2}, experts=experts, moe_every=moe_every)
    shapes = {n: tuple(p.shape) for n, p in build_model(cfg, seed=0).named_parameters()}
    assert placement.gpt_tensors(cfg) == shapes
    for tp, ep in itertools.product((1, 2, 4), (1, 2, 4) if experts else (1,)):
        for t, e in itertools.product(range(tp), range(ep)):
            comm = _stub_comm({"tp": tp, "ep": ep}, {"tp": t, "ep": e})
            model = build_model(cfg, seed=0)
            apply_tensor_parallel(model, comm, axis="tp")
            apply_expert_parallel(model, comm, "ep" if ep > 1 else None)
            live = dict(placement.held_by(model).values())
            assert live == placement.gpt_held(cfg, (tp, t), (ep, e)), (tp, t, ep, e)
            for name, p in model.named_parameters():  # the cut tensor is what the blocks say
                assert tuple(p.shape) == placement.local_shape(live[name])


def test_a_module_cut_holds_its_blocks_of_the_full_tensor():
    """QKV under tp 2: rank 1's rows are [q_1 | k_1 | v_1], three blocks of the full [q | k | v]."""
    cfg = RunConfig(**SMALL)
    full = build_model(cfg, seed=0).state_dict()
    model = build_model(cfg, seed=0)
    apply_tensor_parallel(model, _stub_comm({"tp": 2}, {"tp": 1}), axis="tp")
    for p, (name, blocks) in placement.held_by(model).items():
        for b in blocks:
            local = placement.Box(b.local, b.full.sizes)
            assert p.detach()[local.index()].equal(full[name][b.full.index()]), name
    qkv = placement.held_by(model)[model.blocks[0].attn.qkv.weight][1]
    h = cfg.d_model
    assert [b.full.offsets[0] for b in qkv] == [h // 2, h + h // 2, 2 * h + h // 2]


# -- tiling, on every layout of the matrix -------------------------------------------------------
def matrix(slow: bool) -> list[dict]:
    """The composition matrix up to 8 ranks: dp (dp_shard 2 of 4: HYBRID_SHARD), tp, pp (three kinds
    of schedule), cp, expert parallel, ZeRO 0-3; what RunConfig refuses is left out."""
    out = []
    tps = (1, 2, 4) if slow else (1, 2)
    for dp, tp, pp, cp, zero, moe in itertools.product((1, 2, 4), tps, (1, 2), (1, 2), range(4),
                                                        (None, 1, 2, 4)):
        if dp * tp * pp * cp > 8 or (moe is not None and moe > dp * cp):
            continue
        shards = [0] + ([2] if dp == 4 and zero else [])
        scheds = (["1f1b", "interleaved", "zbv"] if slow else ["1f1b", "zbv"]) if pp > 1 else ["1f1b"]
        for dp_shard, schedule in itertools.product(shards, scheds):
            kw = dict(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, schedule=schedule, d_model=24, heads=2,
                      seq=16, vocab=40, layers=4 * pp, microbatches=2 * pp, batch=4 * dp * pp)
            if dp_shard:
                kw.update(dp_shard=dp_shard)  # (ZeRO-3: HYBRID_SHARD)
            if moe is not None:
                kw.update(experts=4, top_k=2, moe_every=2, ep=moe)
            try:
                RunConfig(**kw).validate()
            except ConfigError:
                continue
            out.append(kw)
    return out


def check_tiling(cfg) -> None:
    """Every element of every full tensor owned by the same number of ranks (> 0), as parameter
    and as optimizer state (states live with the pieces they belong to); each rank's boxes are
    disjoint; each rank's padding is theory's."""
    tensors = placement.gpt_tensors(cfg)
    cover = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in tensors.items()}
    th = theory.run_theory(cfg, theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers,
                                                      cfg.experts, cfg.moe_every))
    for rank in range(cfg.world_size):
        mine = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in tensors.items()}
        padding = 0
        for piece in placement.owned_by_rank(cfg, rank):
            for reg in piece:
                if reg.name == placement.PADDING:
                    padding += reg.box.numel
                else:
                    mine[reg.name][reg.box.index()] += 1
        for name, t in mine.items():
            assert t.max() <= 1, (cfg, rank, name)  # a rank owns an element once
            cover[name] += t
        stage = th["stages"][placement.rank_groups(cfg, rank)["pp"].index(rank)] if cfg.pp > 1 else th
        assert padding == stage["padding_elements"], (cfg, rank)
    for name, t in cover.items():
        assert t.min() >= 1 and t.min() == t.max(), (cfg, name, t.min(), t.max())


def check_planner(cfg) -> None:
    """The planner's torch-free twin (planner._stages, stage_states, written for any ModelSpec)
    equals the placement on the tiny GPT: every rank's parameters per unit and routed-expert
    parameters per unit are its pipeline stage's, and the stage's model states are theory's
    (which counts the placement). HYBRID_SHARD is not a planner layout: skipped."""
    if 0 < cfg.dp_shard < cfg.dp:
        return
    spec = planner.toy_model(cfg.layers, cfg.d_model, cfg.heads, cfg.seq, cfg.vocab, cfg.batch,
                             cfg.experts, cfg.top_k, cfg.moe_every)
    v = virtual_stages(cfg.schedule, cfg.virtual_stages) if cfg.pp > 1 else 1
    stages = planner._stages(spec, cfg.tp, cfg.pp, cfg.schedule if cfg.pp > 1 else "-", v, cfg.ep)
    th = theory.run_theory(cfg, theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers,
                                                      cfg.experts, cfg.moe_every))
    lay = planner.Layout(cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.zero,
                         cfg.schedule if cfg.pp > 1 else "-", v, cfg.microbatches, 1, "none", cfg.sp)
    for rank in range(cfg.world_size):
        stage = placement.rank_groups(cfg, rank)["pp"].index(rank)
        held = placement.rank_held(cfg, rank)
        units = placement.gpt_units(held)
        sizes = [sum(placement.held_numel(held[n]) for n in names) for _, names in units]
        experts = [sum(placement.held_numel(held[n]) for n in names if ".experts." in n)
                   for _, names in units]
        assert (list(stages[stage][0]), list(stages[stage][1])) == (sizes, experts), (cfg, rank)
    for stage, (units, experts, *_rest) in enumerate(stages):
        memory, _ = planner.stage_states(units, experts, planner._states_layout(lay), cfg.precision,
                                         cfg.optimizer)
        want = (th["stages"][stage] if cfg.pp > 1 else th)["memory"]
        assert memory == {k: want[k] for k in memory}, (cfg, stage)


def _cfg(kw):
    return RunConfig(**kw).validate()


def test_owned_boxes_tile_every_tensor_on_the_matrix():
    """Every 8th layout of the matrix (~5 s); the whole of it (504 layouts) is `-m slow`."""
    layouts = matrix(slow=False)[::8]
    assert len(layouts) > 40
    for kw in layouts:
        check_tiling(_cfg(kw))
        check_planner(_cfg(kw))


@pytest.mark.slow
def test_owned_boxes_tile_every_tensor_on_the_whole_matrix():
    layouts = matrix(slow=True)
    assert len(layouts) > 400
    for kw in layouts:
        check_tiling(_cfg(kw))
        check_planner(_cfg(kw))


def test_tiling_check_can_fail():
    """A rank that owned one element too many (or one too few) breaks the tiling."""
    cfg = _cfg(dict(dp=2, zero=1, **SMALL))
    real = placement.owned_by_rank

    def one_too_many(c, rank):
        out = real(c, rank)
        if rank == 1:
            out.append([placement.Region("head.out.weight", placement.Box((0, 0), (1, 1)))])
        return out
    placement.owned_by_rank = one_too_many
    try:
        with pytest.raises(AssertionError):
            check_tiling(cfg)
    finally:
        placement.owned_by_rank = real


def test_theory_unit_sizes_count_the_placement_as_the_formula_says():
    """theory.gpt_unit_sizes counts the placement's blocks; its docstring's closed form agrees:
    v h/t + s h, per dense block (12h^2 + 7h)/t + 6h, per MoE block (4h^2 + 3h)/t + 5h + h E plus
    E/ep experts of 8h^2 + 5h (none when apart), the head 2h + h v/t."""
    v, s, h, L = 64, 16, 32, 4
    for tp, E, ep, apart in [(1, 0, 1, False), (2, 0, 1, False), (4, 4, 2, False), (2, 4, 4, True)]:
        moe = set(theory.moe_blocks(L, E, 2))
        expert = 0 if apart else E // ep * (8 * h * h + 5 * h)
        blocks = [(4 * h * h + 3 * h) // tp + 5 * h + h * E + expert if i in moe
                  else (12 * h * h + 7 * h) // tp + 6 * h for i in range(L)]
        want = [v * h // tp + s * h] + blocks + [2 * h + h * v // tp]
        assert theory.gpt_unit_sizes(v, s, h, L, tp, E, 2, ep, apart) == want
        cfg = SimpleNamespace(vocab=v, seq=s, d_model=h, layers=L, experts=E, moe_every=2, ep=ep)
        assert theory.expert_unit_sizes(cfg, range(L)) == [E // ep * (8 * h * h + 5 * h)] * len(moe)


# -- live: the strategies list the twin's boxes --------------------------------------------------
LIVE = {  # two ranks each: ExpertAndDense over two flat buffers; ZeRO-3's units on a V of stages
    "dp2-zero2-ep2": dict(dp=2, zero=2, ep=2, experts=4, top_k=2),
    "pp2-zero3-zbv": dict(pp=2, zero=3, schedule="zbv", microbatches=2, layers=4),
}
LIVE_SLOW = {
    "dp2xtp2-zero2-ep2": dict(dp=2, tp=2, zero=2, ep=2, experts=4, top_k=2),
    "dp2xpp2-zero3-zbv": dict(dp=2, pp=2, zero=3, schedule="zbv", microbatches=2, layers=4),
    "dp2-zero0-bf16": dict(dp=2, precision="bf16-mixed"),
    "dp4-shard2-zero1": dict(dp=4, zero=1, dp_shard=2),
    "dp2xcp2-zero3-ep4": dict(dp=2, cp=2, zero=3, ep=4, experts=4, top_k=2),
    "tp2xpp2-zero1-interleaved": dict(dp=2, tp=2, pp=2, zero=1, schedule="interleaved",
                                      microbatches=2, layers=4),
    "dp2-zero2-offload": dict(dp=2, zero=2, offload=True),
    "ep2-zero0": dict(dp=2, ep=2, experts=4),
}


def check_live(kw) -> None:
    cfg = RunConfig(steps=1, **{**SMALL, **kw}, extra={"owned": True})
    report = run(cfg)
    for rank in report.ranks:
        twin = [[[r.name, r.box.offsets, r.box.sizes] for r in piece]
                for piece in placement.owned_by_rank(cfg, rank["rank"])]
        live = rank["owned"]
        assert live and len(live) == len(twin), rank["rank"]
        assert [[[n, tuple(o), tuple(s)] for n, o, s in p["regions"]] for p in live] == twin
        for p in live:  # Adam: two moments per element of every owned piece, after a step
            assert p["states"] == [p["numel"]] * 2, (rank["rank"], p["regions"])


@pytest.mark.parametrize("name", LIVE)
def test_live_strategies_own_the_twins_boxes(name):
    check_live(LIVE[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", LIVE_SLOW)
def test_live_strategies_own_the_twins_boxes_slow(name):
    check_live(LIVE_SLOW[name])


def test_the_blocks_gathered_at_the_end_pickle_only_their_own_elements():
    """The final-parameter check ships each rank's blocks with all_gather_object. Parameters that
    are views of one flat buffer (ZeRO's) must not pickle the buffer once per view: each block
    goes as a tensor of its own (engine.own_blocks)."""
    import pickle

    from parallel_mini.engine import own_blocks
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    local, off = {}, 0
    for name, p in model.named_parameters():  # [numel] views into flat, shaped like p
        local[name] = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    as_views = len(pickle.dumps(local))
    blocks = own_blocks(model, local)
    shipped = len(pickle.dumps(blocks))
    assert as_views > 3 * flat.numel() * 4  # the trap this guards against: 4 views, 4 buffers
    assert shipped < 1.2 * flat.numel() * 4, (shipped, flat.numel() * 4)
    for name, p in model.named_parameters():
        (box, t), = blocks[name]
        assert tuple(box.sizes) == tuple(p.shape) and torch.equal(t, local[name])


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, layers=4), dict(dp=2, ep=2, experts=4, zero=3)])
def test_a_run_counts_the_whole_model_alike_with_and_without_the_reference(layout):
    """Without the reference comparison a run counts the full model's parameters from every
    rank's boxes (engine.count_full_parameters), shipping no values; with it, from the gathered
    tensors. Both counts are the same, pipeline stages, tensor slices and experts included."""
    counted = run(RunConfig(steps=1, **layout))
    gathered = run(RunConfig(steps=1, reference=True, **layout))
    assert gathered.max_abs_diff < 1e-5
    assert [r["n_params"] for r in counted.ranks] == [r["n_params"] for r in gathered.ranks]
    assert len({r["n_params"] for r in counted.ranks}) == 1
