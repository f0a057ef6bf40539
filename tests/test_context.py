"""Context parallel: ring, zigzag and Ulysses attention against torch's attention on the whole
sequence, and whole training runs against the single-process reference."""
from types import SimpleNamespace

import pytest
import torch

from parallel_mini.runtime.launch import run_ranks
from parallel_mini.parallel.context import chunks_of, positions_of


def _layout(impl):
    return "zigzag" if impl == "zigzag" else "contiguous"


def _core_vs_sdpa(impl, c):
    """Every rank: the same q, k, v for the whole sequence; torch's SDPA on all of it, our core on
    this rank's tokens; both outputs and all three gradients compared at this rank's positions."""
    import torch.nn.functional as F
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.parallel.context import RingAttentionCore, UlyssesAttentionCore
    cfg = SimpleNamespace(dp=1, tp=1, pp=1, cp=c, ep=1, dp_shard=0, world_size=c)
    comm = Comm(build_mesh(cfg))
    r = comm.rank("cp")
    g = torch.Generator().manual_seed(0)
    b, a, s, d = 2, 4, 16, 8
    q, k, v, grad = (torch.randn(b, a, s, d, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(grad)
    pos = positions_of(_layout(impl), s, c, r)
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    core = UlyssesAttentionCore(comm, "cp") if impl == "ulysses" else RingAttentionCore(comm, "cp", _layout(impl))
    out = core(*mine)
    out.backward(grad[:, :, pos])
    diffs = [(out - ref[:, :, pos]).abs().max().item()]
    diffs += [(m.grad - f.grad[:, :, pos]).abs().max().item() for m, f in zip(mine, full)]
    return {"diffs": diffs, "tiles": getattr(core, "tiles", [])}


@pytest.mark.parametrize("impl", ["ring", "zigzag", "ulysses"])
@pytest.mark.parametrize("c", [2, 4])
def test_attention_core_equals_torch_sdpa(impl, c):
    results = [r.value for r in run_ranks(_core_vs_sdpa, c, impl, c)]
    for r in results:
        assert max(r["diffs"]) < 1e-5, r["diffs"]


def test_zigzag_balances_the_causal_tiles():
    """Contiguous chunks: rank r computes r+1 of its C tiles; zigzag: every rank 2C+1 of 4C."""
    c = 4
    ring = [r.value["tiles"] for r in run_ranks(_core_vs_sdpa, c, "ring", c)]
    zigzag = [r.value["tiles"] for r in run_ranks(_core_vs_sdpa, c, "zigzag", c)]
    assert [sum(t["computed"] for t in ts) for ts in ring] == [1, 2, 3, 4]
    assert [sum(t["computed"] for t in ts) for ts in zigzag] == [2 * c + 1] * c
    assert all(len(ts) == 4 * c for ts in zigzag)


def test_layouts():
    assert chunks_of("zigzag", 4, 0) == [0, 7] and chunks_of("zigzag", 4, 3) == [3, 4]
    assert positions_of("zigzag", 16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions_of("contiguous", 16, 2, 1).tolist() == list(range(8, 16))


# -- whole runs ---------------------------------------------------------------------------------
from parallel_mini import theory  # noqa: E402
from parallel_mini.config import ConfigError, RunConfig  # noqa: E402
from parallel_mini.runtime.launch import run  # noqa: E402

from test_composition import check  # noqa: E402  (reference, bytes per axis, states per rank)


@pytest.mark.parametrize("kw", [dict(cp=2), dict(cp=4, cp_impl="zigzag"), dict(cp=2, cp_impl="ulysses"),
                                dict(dp=2, cp=2, tp=2), dict(cp=2, pp=2, microbatches=2, layers=4),
                                dict(cp=2, zero=3)],
                         ids=["ring2", "zigzag4", "ulysses2", "dp2-cp2-tp2", "cp2-pp2", "cp2-zero3"])
def test_context_parallel_runs_equal_the_reference(kw):
    check(run(RunConfig(steps=2, reference=True, **kw)))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(cp=4), dict(cp=2, cp_impl="zigzag"), dict(cp=4, cp_impl="ulysses"),
    dict(dp=2, cp=2), dict(cp=2, tp=2, sp=True), dict(cp=2, cp_impl="ulysses", tp=2),
    dict(cp=2, checkpointing="full"), dict(cp=2, cp_impl="zigzag", checkpointing="selective"),
    dict(cp=2, grad_accum=2), dict(cp=2, pp=2, tp=2, sp=True, schedule="zb", microbatches=2, layers=4),
    dict(cp=2, cp_impl="zigzag", pp=2, schedule="interleaved", microbatches=2, layers=4),
    dict(cp=2, dp=2, dp_mode="naive"), dict(cp=2, zero=1), dict(cp=2, dp=2, zero=2),
    dict(cp=2, dp=2, zero=3, cp_impl="zigzag"), dict(cp=2, dp=4, dp_shard=2, zero=3, cp_impl="ulysses"),
    dict(cp=2, pp=2, zero=1, microbatches=2, layers=4)])
def test_context_parallel_composes(kw):
    check(run(RunConfig(steps=2, reference=True, **kw)))


def test_report_tiles_per_rank_balanced_only_under_zigzag():
    ring = run(RunConfig(cp=4, steps=1))
    zigzag = run(RunConfig(cp=4, cp_impl="zigzag", steps=1))
    assert [r["context"]["tiles_computed"] for r in ring.ranks] == [1, 2, 3, 4]
    assert [r["context"]["tiles_computed"] for r in zigzag.ranks] == [9, 9, 9, 9]
    # every ring step's K/V block arrived from the previous rank: recorded with its block and bytes
    recvs = [c for c in ring.ranks[0]["comm"] if c["op"] == "recv" and c.get("layer") == "ring"
             and c["step"] == 0]
    assert {c["peer"] for c in recvs} == {3} and all(c["payload_bytes"] > 0 for c in recvs)


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_activation_bytes_per_layer_fall_with_cp(impl):
    """One more layer adds exactly theory.gpt_activation_bytes_per_layer(..., cp) per rank, and
    that is less than half of the cp = 1 layer (ring: no [s, s] scores anywhere)."""
    shape = dict(cp=2, cp_impl=impl, batch=8, seq=32, d_model=64, heads=4, steps=1)
    one = run(RunConfig(layers=1, **shape)).ranks[0]["memory"]["activations_peak"]
    two = run(RunConfig(layers=2, **shape)).ranks[0]["memory"]["activations_peak"]
    predicted = theory.gpt_activation_bytes_per_layer(32, 8, 64, 4, "none", 4, cp=2, cp_impl=impl)
    assert two - one == predicted
    assert predicted < theory.gpt_activation_bytes_per_layer(32, 8, 64, 4, "none", 4) / 2 * 1.1


@pytest.mark.parametrize("kw,message", [
    (dict(cp=3, seq=32), "multiple of 3"),
    (dict(cp=2, cp_impl="zigzag", seq=34), "multiple of 4"),
    (dict(cp=4, cp_impl="ulysses", heads=2, d_model=64), "heads divisible by 4"),
    (dict(cp=2, cp_impl="lightning"), "choose one of ring, zigzag, ulysses"),
])
def test_bad_context_inputs_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        RunConfig(**kw).validate()
    assert "\n" not in str(e.value)


def _ours_vs_torch_ring(impl):
    import torch.distributed as dist
    from parallel_mini.comm import Comm
    from parallel_mini.mesh import build_mesh
    from parallel_mini.parallel.context import RingAttentionCore
    from parallel_mini.course.peers import torch_ring_attention
    c, r = dist.get_world_size(), dist.get_rank()
    comm = Comm(build_mesh(SimpleNamespace(dp=1, tp=1, pp=1, cp=c, ep=1, dp_shard=0, world_size=c)))
    g = torch.Generator().manual_seed(1)
    pos = positions_of(_layout(impl), 32, c, r)
    q, k, v, grad = (torch.randn(2, 4, 32, 8, generator=g)[:, :, pos].contiguous() for _ in range(4))
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = RingAttentionCore(comm, "cp", _layout(impl))(*mine)
    out.backward(grad)
    peer = torch_ring_attention(q, k, v, grad, dist.group.WORLD, load_balance=impl == "zigzag")
    ours = (out, *(m.grad for m in mine))
    return [(a - b).abs().max().item() for a, b in zip(ours, peer)]


@pytest.mark.parametrize("impl", ["ring", "zigzag"])
def test_torch_ring_attention_peer_agrees(impl):
    """The benchmark's peer (torch's ring attention template) gives our outputs and gradients."""
    for diffs in (r.value for r in run_ranks(_ours_vs_torch_ring, 2, impl)):
        assert max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("causal", [False, True])
def test_fused_tile_equals_the_written_out_tile(causal, monkeypatch):
    """The fused CPU tile (torch's flash kernel: output, log-sum-exp, gradients) against the
    written-out tile that other devices run (context._FUSED emptied), fp32 at 1e-5."""
    from parallel_mini.parallel import context
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(4))
    # a merged row's out and lse: this tile's own, shifted as if other tiles had been merged in
    fused = context._attend_tile(q, k, v, causal)
    out, lse = fused[0] * 0.7, fused[1] + 0.4
    fused_grads = context._tile_grads(do, q, k, v, out, lse, causal)
    monkeypatch.setattr(context, "_FUSED", {})
    written = context._attend_tile(q, k, v, causal)
    written_grads = context._tile_grads(do, q, k, v, out, lse, causal)
    for a, b in zip((*fused, *fused_grads), (*written, *written_grads)):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_rectangle_per_ring_step_covers_exactly_the_visible_keys(layout):
    """RingAttentionCore._rectangle (one fused call per ring step) against the causal mask at the
    tokens' global positions, for every rank and ring step at C = 2, 3, 4, 8: the query x key pairs
    the rectangle computes (with its causal mask, if any, on local indices) are exactly the pairs
    where the key is not after the query."""
    from parallel_mini.parallel.context import RingAttentionCore
    seq = 48
    for c in (2, 3, 4, 8):
        if seq % (2 * c):
            continue
        for rank in range(c):
            core = object.__new__(RingAttentionCore)  # only the layout, C and rank are read
            core.layout, core.c, core.rank = layout, c, rank
            mine = positions_of(layout, seq, c, rank)
            size = len(mine) // len(chunks_of(layout, c, rank))
            for src in range(c):
                theirs = positions_of(layout, seq, c, src)
                visible = theirs[None, :] <= mine[:, None]
                computed = torch.zeros_like(visible)
                rect = core._rectangle(src, size)
                if rect is not None:
                    rows, cols, causal = rect
                    block = torch.ones_like(computed[rows, cols])
                    computed[rows, cols] = block.tril() if causal else block
                assert torch.equal(computed, visible), (layout, c, rank, src)
