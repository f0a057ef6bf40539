"""µs per op (x + 1 on 64 floats, one thread) under the memory meter, its __torch_dispatch__ left
unwrapped (LiveBytes as it is, plus `_should_skip_dynamo` False) and wrapped by torch's dynamo
guard (the default), twice each; and what the first entry into a metering mode costs when it
imports torch._dynamo. python docs/suite-time-2026-12-07/scripts/dispatch_overhead.py"""
import sys
import time

import torch

from parallel_mini.meters import LiveBytes

torch.set_num_threads(1)
t = time.perf_counter()
with LiveBytes():
    torch.ones(3) + 1
print(f"first metered op: {time.perf_counter() - t:.2f} s, torch._dynamo imported: "
      f"{'torch._dynamo' in sys.modules}")


class Unwrapped(LiveBytes):
    @classmethod
    def _should_skip_dynamo(cls):
        return False


x = torch.ones(64)
for cls in (LiveBytes, Unwrapped, LiveBytes, Unwrapped):
    with cls():
        for _ in range(200):
            x + 1
        t = time.perf_counter()
        for _ in range(20000):
            x + 1
        print(f"{'wrapped' if cls is LiveBytes else 'unwrapped'}: "
              f"{(time.perf_counter() - t) / 20000 * 1e6:.1f} us/op")
