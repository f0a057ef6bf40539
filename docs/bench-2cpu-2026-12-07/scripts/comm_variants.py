"""Shared by dp_metering_variants.py and allreduce_launch_cost.py: a Comm with parts of the async
collectives' metering off. Variants:
  full      Comm as the library runs it
  nowire    no socket counter (no /proc/self/io reading)
  noread    the socket counter's bookkeeping, its reading a constant
  nofuture  no completion callback (a record's end is taken at the wait)
  nometer   neither the counter nor the callback
  bare      all_reduce is dist.all_reduce and a polled wait, nothing recorded
  record    bare + a record per op; clock: also the CPU clock around the launch (section 7)
  lean      section 7's sketch: async ops share one counter reading while they overlap, and the
            completion callback only takes the time (lean_meter.py)"""
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
    if name in BISECT:
        return BISECT[name](mesh)
    if name == "lean":
        from lean_meter import lean
        return lean(Comm(mesh))
    comm = BareComm(mesh) if name == "bare" else Comm(mesh)
    if name in ("nowire", "nometer"):
        comm.meter.wire.fd = None
    if name == "noread":
        comm.meter.wire._read = lambda: 0
    if name in ("nofuture", "nometer"):
        comm.meter._no_future.add("all_reduce")
    return comm


# Section 7's bisection: a bare Comm plus one piece of Comm's bookkeeping at a time.
import time as _time  # noqa: E402


class RecordOnly(BareComm):
    """bare + a record per op (variant `record`)"""
    def all_reduce(self, tensor, axis, op=dist.ReduceOp.SUM, async_op=False, **tags):
        self.records.append({"op": "all_reduce", "group": axis, "count": tensor.numel(),
                             "start": _time.perf_counter(), **tags})
        return super().all_reduce(tensor, axis, op, async_op)


class RecordAndClock(RecordOnly):
    """bare + a record and the CPU clock read before and after the launch (variant `clock`)"""
    def all_reduce(self, tensor, axis, op=dist.ReduceOp.SUM, async_op=False, **tags):
        c = _time.thread_time()
        h = super().all_reduce(tensor, axis, op, async_op, **tags)
        self.records[-1]["cpu"] = _time.thread_time() - c
        return h


BISECT = {"record": RecordOnly, "clock": RecordAndClock}
