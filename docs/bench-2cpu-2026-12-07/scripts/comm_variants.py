"""Shared by dp_metering_variants.py and allreduce_launch_cost.py: a Comm with parts of the async
collectives' metering off. Variants:
  full      Comm as the library runs it
  nowire    no socket counter (no /proc/self/io reading)
  noread    the socket counter's bookkeeping, its reading a constant
  nofuture  no completion callback (a record's end is taken at the wait)
  nometer   neither the counter nor the callback
  bare      all_reduce is dist.all_reduce and a polled wait, nothing recorded"""
import torch.distributed as dist

from parallel_mini.comm import Comm
from parallel_mini.meters import wait_for


class _Handle:
    def __init__(self, work, poll):
        self.work, self.poll = work, poll

    def wait(self):
        wait_for(self.work, self.poll)


class BareComm(Comm):
    def all_reduce(self, tensor, axis, op=dist.ReduceOp.SUM, async_op=False, **tags):
        work = dist.all_reduce(tensor, op=op, group=self.mesh.groups[axis], async_op=async_op)
        return _Handle(work, self.polls) if async_op else None


def comm_variant(mesh, name: str) -> Comm:
    comm = BareComm(mesh) if name == "bare" else Comm(mesh)
    if name in ("nowire", "nometer"):
        comm.meter.wire.fd = None
    if name == "noread":
        comm.meter.wire._read = lambda: 0
    if name in ("nofuture", "nometer"):
        comm.meter._no_future.add("all_reduce")
    return comm
