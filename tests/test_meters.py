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
