"""Our pipeline parallel against PyTorch's own: torch.distributed.pipelining's ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV on the same stage split (a
PipelineStage per chunk, built from our `partition` / `forward_chunk`: `peers.TorchPipeline`), the
same data and Adam arithmetic. In one launch, torch's schedule and ours (`peers.OurPipeline`) train
side by side; both must equal the single-process reference (losses and every final parameter to
1e-5), and each other.

How the loss is scaled differs, not the result: ours divides each micro-batch's loss by m before
its backward; torch's loss_fn returns the plain micro-batch mean, its `losses` are those means, and
with scale_grads=True (the default) the schedule divides the accumulated gradients by m after the
last backward. The whole batch's loss is then the mean of the m micro-batch losses."""
import functools

import pytest

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks


def _peer_rank(cfg_dict, torch_name, our_name):
    import torch.distributed as dist
    from parallel_mini.course.bench import _count_torch_sends
    from parallel_mini.course.peers import OurPipeline, TorchPipeline
    from parallel_mini.data import global_batch

    cfg = RunConfig.from_dict(cfg_dict)
    torch_sent = _count_torch_sends()
    peer, ours = TorchPipeline(cfg, torch_name), OurPipeline(cfg, our_name)
    peer_losses, our_losses, sends = [], [], []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)  # both split it into the same m micro-batches
        before = torch_sent["isend"]
        peer_losses.append(peer.step(x, y))
        our_losses.append(ours.step(x, y, step))
        sends.append((torch_sent["isend"] - before, ours.sends))
    # the action kinds torch's schedule runs on this rank (F, B, or F, I, W when split)
    order = getattr(peer.schedule, "pipeline_order", None) or {}
    kinds = sorted({a.computation_type.value for a in order.get(dist.get_rank(), []) if a})
    mine = {"chunks": peer.chunks, "kinds": kinds, "peer_losses": peer_losses,
            "our_losses": our_losses, "sends": sends, "peer_params": peer.parameters_by_name(),
            "our_params": ours.parameters_by_name()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


@functools.lru_cache(maxsize=None)
def _reference(**kw):
    from parallel_mini.reference import train_reference
    return train_reference(RunConfig(**kw))


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in b)


CASES = {  # id: (pp, layers, microbatches, torch's schedule, ours, torch's chunks per rank)
    "gpipe-pp2": (2, 4, 4, "gpipe", "gpipe", [[0], [1]]),
    "1f1b-pp2": (2, 4, 4, "1f1b", "1f1b", [[0], [1]]),
    "interleaved-pp2": (2, 4, 4, "interleaved", "interleaved", [[0, 2], [1, 3]]),
    "zbv-pp2": (2, 4, 4, "zbv", "zbv", [[0, 3], [1, 2]]),  # both lay the 4 chunks out in a V
    "dualpipev-pp2": (2, 4, 4, "dualpipev", "dualpipev", [[0, 3], [1, 2]]),  # ScheduleDualPipeV
    "gpipe-pp4": (4, 4, 8, "gpipe", "gpipe", [[0], [1], [2], [3]]),
    "1f1b-pp4": (4, 4, 8, "1f1b", "1f1b", [[0], [1], [2], [3]]),
    "interleaved-pp4": (4, 8, 8, "interleaved", "interleaved", [[0, 4], [1, 5], [2, 6], [3, 7]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_pipelining_agrees(case):
    pp, layers, m, torch_name, our_name, chunks = CASES[case]
    kw = dict(pp=pp, layers=layers, microbatches=m, steps=2)
    cfg = RunConfig(**kw, schedule=our_name).validate()
    ranks = run_ranks(_peer_rank, pp, cfg.to_dict(), torch_name, our_name)[0].value
    ref_losses, ref_params = _reference(**{k: v for k, v in kw.items() if k != "pp"})

    assert [r["chunks"] for r in ranks] == chunks
    # the same messages: every step, each rank sends as many as torch's schedule does (counted)
    for r in ranks:
        assert all(theirs == mine > 0 for theirs, mine in r["sends"]), r["sends"]
    if torch_name in ("zbv", "dualpipev"):  # torch's really split the backward: I then W
        assert all({"F", "I", "W"} <= set(r["kinds"]) for r in ranks), [r["kinds"] for r in ranks]
    n_chunks = sum(len(c) for c in chunks)
    holds_last = [n_chunks - 1 in r["chunks"] for r in ranks]
    assert [r["peer_losses"][0] is not None for r in ranks] == holds_last  # losses: last stage only
    peer_losses = ranks[holds_last.index(True)]["peer_losses"]
    our_losses = ranks[holds_last.index(True)]["our_losses"]  # same placement as torch's
    peer_params = {k: v for r in ranks for k, v in r["peer_params"].items()}
    our_params = {k: v for r in ranks for k, v in r["our_params"].items()}

    assert max(abs(a - b) for a, b in zip(peer_losses, ref_losses)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(our_losses, ref_losses)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(peer_losses, our_losses)) <= 1e-5
    assert _max_diff(peer_params, ref_params) <= 1e-5, case
    assert _max_diff(our_params, ref_params) <= 1e-5, case
    assert _max_diff(peer_params, our_params) <= 1e-5, case
