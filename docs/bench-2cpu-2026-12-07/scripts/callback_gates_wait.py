"""Does gloo's Work.wait() return before the Work's future callbacks have run? A 4-float
all-reduce on 2 ranks, waited for without a callback, then with a callback that sleeps 50 ms
(the sleep releases the GIL). Prints rank 0's wait in ms.
python docs/bench-2cpu-2026-12-07/scripts/callback_gates_wait.py"""
import time

import torch
import torch.distributed as dist

from parallel_mini.runtime.launch import run_ranks


def rank():
    x, out = torch.ones(4), {}
    for label, delay in (("no callback", None), ("a callback sleeping 50 ms", 0.05)):
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        if delay is not None:
            work.get_future().then(lambda fut, d=delay: time.sleep(d))
        work.wait()
        out[label] = round(1e3 * (time.perf_counter() - t0), 1)
    return out


if __name__ == "__main__":
    print(run_ranks(rank, 2, backend="gloo", timeout=60)[0].value)
