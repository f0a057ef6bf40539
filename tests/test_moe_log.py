"""The MoE routing log is bounded (issue 26: every token's choice of every step was logged as Python
lists; a 1-rank run grew ~48 MB a step and its --json passed 8 GB). The counts per expert are
logged for every forward; the token-by-token choices only for a sample: at most
ROUTING_SAMPLE_TOKENS tokens of a step, of at most ROUTING_SAMPLE_STEPS + 1 steps per layer (the
last always), the same steps on every rank. Real MoE layers in this process (no ranks: cheap)."""
from __future__ import annotations

import json

import pytest
import torch

from parallel_mini import meters
from parallel_mini.meters import ROUTING_SAMPLE_STEPS, ROUTING_SAMPLE_TOKENS, RoutingLog
from parallel_mini.moe import MoE


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops: one thread (on a loaded machine torch's thread pool made them 100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _logged(steps: int, batch: int, seq: int, micro: int = 2) -> RoutingLog:
    """A real MoE layer's log after `steps` steps of `micro` forwards each."""
    torch.manual_seed(0)
    moe = MoE(8, 4, 2, 1.0, 0.01, 0.001, layer=1)
    clock = {"step": 0}
    moe.log, moe.clock = RoutingLog(), (lambda: clock["step"])
    with torch.no_grad():
        for step in range(steps):
            clock["step"] = step
            for _ in range(micro):
                moe(torch.randn(batch, seq, 8))
    return moe.log


def _choice_bytes(log) -> int:
    return len(json.dumps([[e["choices"], e["kept_mask"], e["positions"]]
                           for e in log if "choices" in e]))


def test_the_log_is_bounded_whatever_the_steps():
    """Counts for every forward; choices of at most ROUTING_SAMPLE_STEPS + 1 steps, so the bytes of
    choices are the same after 40 and after 160 steps (the old log grew with every step: sabotage
    `keep_choices` to keep everything and this fails)."""
    short, long = _logged(40, 4, 16), _logged(160, 4, 16)
    assert len(long) == 160 * 2 and all(sum(e["routed"]) == 4 * 16 * 2 for e in long)
    for log, steps in ((short, 40), (long, 160)):
        sampled = sorted(e["step"] for e in log if "choices" in e)
        assert len(sampled) <= ROUTING_SAMPLE_STEPS + 1 and sampled[-1] == steps - 1
        assert sampled[0] == 0 and len(set(sampled)) == len(sampled)  # first micro-batch only
        strides = {b - a for a, b in zip(sampled[:-2], sampled[1:-1])}
        assert len(strides) == 1, sampled  # evenly spread, then the last step
    assert _choice_bytes(long) <= _choice_bytes(short) * 1.05


def test_a_step_keeps_at_most_the_token_cap_whole_sequences_first():
    seq = 96
    log = _logged(2, 64, seq, micro=1)  # 6144 tokens a step
    e = log[-1]
    n = (ROUTING_SAMPLE_TOKENS // seq) * seq
    assert len(e["choices"]) == len(e["kept_mask"]) == n == e["tokens_sampled"][0]
    assert e["tokens_sampled"][1] == 64 * seq and e["positions"] is None
    assert all(len(c) == 2 for c in e["choices"])
    # one sequence longer than the cap: its first tokens, with their positions
    (e,) = [x for x in _logged(1, 1, ROUTING_SAMPLE_TOKENS + 40, micro=1) if "choices" in x]
    assert len(e["choices"]) == ROUTING_SAMPLE_TOKENS
    assert e["positions"] == list(range(ROUTING_SAMPLE_TOKENS))


def test_the_chart_reads_the_sample(monkeypatch):
    """routing_frame draws a sampled step, names the sampled steps for another, and the heatmap
    says it shows a sample."""
    from parallel_mini.course.viz import experts as vx
    monkeypatch.setattr(meters, "ROUTING_SAMPLE_STEPS", 4)
    log = _logged(12, 64, 16, micro=1)
    rep = {"config": {"seq": 16, "experts": 4, "top_k": 2, "ep": 1, "sp": False},
           "ranks": [{"rank": 0, "coords": {"tp": 0}, "moe": {"log": list(log)}}]}
    steps = vx.routing_steps(rep)
    assert len(steps) <= 5 and steps[-1] == 11
    df = vx.routing_frame(rep, step=steps[0])
    assert len(df) == ROUTING_SAMPLE_TOKENS * 2 and df["position"].max() == 15
    missing = next(s for s in range(12) if s not in steps)
    with pytest.raises(ValueError, match="sample of steps"):
        vx.routing_frame(rep, step=missing)
    title = vx.routing_heatmap(rep).to_dict()["title"]["text"]
    assert f"the first {ROUTING_SAMPLE_TOKENS} of the {64 * 16}" in title, title
