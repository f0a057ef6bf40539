"""cProfile of engine.train_rank inside each of the ranks, with each rank's minor page faults and
CPU (getrusage), the second of two launches; prints rank 0's 25 costliest functions by own time
and 45 by cumulative time.
python docs/suite-time-2026-12-07/scripts/rank_profile.py '{"dp": 4, "zero": 1, "steps": 3}'"""
import cProfile
import io
import json
import pstats
import resource
import sys

from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run_ranks


def profiled(cfg_dict):
    import torch.distributed as dist

    from parallel_mini.engine import train_rank
    from parallel_mini.runtime import checkpoint
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    prof = cProfile.Profile()
    prof.enable()
    train_rank(cfg_dict, checkpoints=checkpoint)
    prof.disable()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    own, cum = io.StringIO(), io.StringIO()
    pstats.Stats(prof, stream=own).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof, stream=cum).sort_stats("cumtime").print_stats(45)
    return (dist.get_rank(), r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime,
            r1.ru_utime - r0.ru_utime, own.getvalue(), cum.getvalue())


cfg = RunConfig(**json.loads(sys.argv[1]))
run_ranks(profiled, cfg.world_size, cfg.to_dict())
results = run_ranks(profiled, cfg.world_size, cfg.to_dict())
for r in results:
    rank, faults, sys_s, user_s = r.value[:4]
    print(f"rank {rank}: minor faults {faults}, sys {sys_s:.2f} s, user {user_s:.2f} s")
print(results[0].value[4])
print(results[0].value[5])
