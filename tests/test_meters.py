"""The meters themselves: what they count must not depend on where states live."""
import pytest

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run


@pytest.mark.parametrize("kw", [dict(dp=2, pp=2, zero=1, schedule="1f1b"),
                                dict(dp=2, pp=2, zero=1, schedule="1f1b", precision="bf16-mixed",
                                     checkpointing="full"),
                                dict(dp=2, zero=2)], ids=repr)
def test_offload_does_not_change_activation_bytes(kw):
    """ZeRO-Offload moves the master weights and moments to the host: the bytes held for
    backward are the same, on every rank (they read 0 B once: the host states were subtracted
    from live bytes that never counted them)."""
    plain, offload = (run(RunConfig(steps=2, offload=o, **kw)) for o in (False, True))
    for a, b in zip(plain.ranks, offload.ranks):
        assert a["memory"]["activations_peak"] > 0
        assert b["memory"]["activations_peak"] == a["memory"]["activations_peak"]
        assert b["memory"]["host"] > 0 and "host" not in a["memory"]


class _P2PWork:
    """gloo's point-to-point Work: no future (get_future raises, as torch 2.13's does)."""
    asked = 0

    def get_future(self):
        type(self).asked += 1
        raise RuntimeError("Work::getFuture not implemented")

    def wait(self):
        return True


class _CollectiveWork:
    """A collective's Work: its future runs the callback when the backend finishes."""

    def __init__(self):
        self.callbacks = []

    def get_future(self):
        work = self

        class Future:
            def then(self, fn):
                work.callbacks.append(fn)
        return Future()

    def wait(self):
        return True


def test_the_meter_asks_a_futureless_op_once_and_still_times_futures():
    """A p2p op whose Work has no future is asked once per meter, not per message (each raise cost
    ~8 us of CPU on a pipeline's every send and receive), and is timed at its wait; a collective's
    Work keeps its future: the end is when the backend finished, before anyone waits."""
    from parallel_mini.meters import CommMeter
    meter = CommMeter(backend=None)
    for _ in range(3):
        rec = meter.begin(meter.record("send", "pp", 4, 1, 4, step=0))
        meter.end(rec, _P2PWork(), async_op=True).wait()
        assert rec["end"] <= rec["waited_until"]
    assert _P2PWork.asked == 1
    rec = meter.begin(meter.record("all_reduce", "dp", 4, 1, 6, step=0))
    work = _CollectiveWork()
    handle = meter.end(rec, work, async_op=True)
    assert "end" not in rec and len(work.callbacks) == 1
    work.callbacks[0](None)  # the backend finished
    finished = rec["end"]
    handle.wait()
    assert rec["end"] == finished < rec["waited_until"]


def test_the_live_meter_finds_the_tensors_torch_would_find():
    """LiveBytes walks an op's arguments and results by hand (meters._tensors); on every op of a
    training step of the toy it finds the same tensors as torch's general tree_flatten."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from parallel_mini.meters import _tensors
    from parallel_mini.model import build_model

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append(((args, kwargs or {}), out))
            return out

    cfg = RunConfig(dp=1, steps=1)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq))
    with Record():
        model(tokens, tokens).backward()
    assert len(seen) > 100
    for (args, kwargs), out in seen:
        for found, general in ((_tensors((args, tuple(kwargs.values()))), (args, kwargs)),
                               (_tensors(out), out)):
            mine = [id(t) for t in found]
            theirs = [id(t) for t in tree_flatten(general)[0] if isinstance(t, torch.Tensor)]
            assert mine == theirs
