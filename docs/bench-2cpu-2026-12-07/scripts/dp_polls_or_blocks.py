"""bench dp (a) at dp 2, ours waiting by polling (as a rank with a core of its own does) against
blocking, alternating, argv[1] rounds. python docs/bench-2cpu-2026-12-07/scripts/dp_polls_or_blocks.py 2"""
import sys, statistics
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.config import RunConfig
import parallel_mini.course.bench as B

def rank(cfgd, w, s, most, polls):
    from parallel_mini.comm import Comm
    orig = Comm.__init__
    def init(self, mesh):
        orig(self, mesh)
        if not polls: self.polls = False
    Comm.__init__ = init
    return B._dp_rank(cfgd, w, s, most)

for rnd in range(int(sys.argv[1])):
    for polls in (True, False):
        cfg = RunConfig(dp=2, batch=16, bucket_mb=0.25, steps=45).validate()
        out = run_ranks(rank, 2, cfg.to_dict(), 5, 20, 300, polls, timeout=900, backend="gloo")[0].value
        t = out["times"]; r = statistics.median(t["bucketed"]) / statistics.median(t["ddp"])
        print("polls" if polls else "blocks", "ratio %.3f (%.2f-%.2f) overlap %.0f%% (%.0f%%) steps %d" % (r, *out["interval"], 100*statistics.median(out["overlap"]), 100*statistics.median(out["ddp_overlap"]), len(t["bucketed"])), flush=True)
