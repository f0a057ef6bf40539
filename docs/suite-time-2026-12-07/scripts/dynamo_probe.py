"""Whether a rank has imported torch._dynamo after training 2 steps, per layout. Run it with
torch._dynamo taken out of launch.PRELOAD and meters.LiveBytes given
`_should_skip_dynamo = classmethod(lambda cls: False)` (the change tried and not kept): only
activation checkpointing imported it then.
python docs/suite-time-2026-12-07/scripts/dynamo_probe.py"""
import time

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks


def probe(cfg_dict):
    import sys

    from parallel_mini.engine import train_rank
    from parallel_mini.runtime import checkpoint
    train_rank(cfg_dict, checkpoints=checkpoint)
    return "torch._dynamo" in sys.modules


for layout in [dict(dp=2), dict(dp=2, zero=3),
               dict(dp=2, zero=1, precision="bf16-mixed", checkpointing="full"),
               dict(tp=2, sp=True), dict(pp=2, schedule="interleaved", layers=4), dict(cp=2),
               dict(cp=2, cp_impl="ulysses"), dict(dp=2, ep=2, experts=4),
               dict(pp=2, schedule="zb"), dict(dp=2, zero=2, offload=True),
               dict(dp=4, fsdp="HYBRID_SHARD", dp_shard=2)]:
    cfg = RunConfig(steps=2, **layout)
    t = time.perf_counter()
    seen = [r.value for r in run_ranks(probe, cfg.world_size, cfg.to_dict())]
    print(layout, seen, f"{time.perf_counter() - t:.2f} s")
