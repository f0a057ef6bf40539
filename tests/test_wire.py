"""Real wire bytes: what a rank's process wrote to its sockets during each op (meters.WireMeter,
/proc/self/io's wchar), beside the ring model (theory.wire_bytes) the records also carry."""
import sys

import pytest

from parallel_mini.course.bench import MB, _wire_rank
from parallel_mini.config import RunConfig
from parallel_mini.runtime.launch import run
from parallel_mini.runtime.launch import run_ranks
from parallel_mini.meters import WireMeter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="/proc/self/io is Linux's")


def test_dp4_gradient_all_reduce_written_within_2_percent_of_the_ring_model():
    """run --dp 4 --reference: every rank's all-reduce bytes, every step, within 2% of the ring."""
    report = run(RunConfig(dp=4, steps=2, reference=True))
    assert report.max_abs_diff <= 1e-5
    for r in report.ranks:
        for step in range(2):
            recs = [x for x in r["comm"] if x["step"] == step and x["op"] == "all_reduce"]
            model = sum(x["wire_bytes_model"] for x in recs)
            written = sum(x["wire_bytes_measured"] for x in recs)
            assert model > 0 and abs(written / model - 1) < 0.02, (r["rank"], step, written, model)
    per_step = report.wire_bytes_per_step(kind="measured")["dp"]
    assert per_step == pytest.approx(report.theory["wire_bytes_per_step"]["dp"], rel=0.02)


@pytest.fixture(scope="module")
def one_mib_on_four_ranks():
    results = run_ranks(_wire_rank, 4, [MB], 2, backend="gloo")
    return {row["op"]: row for row in results[1].value}  # rank 1: not a broadcast's root


def test_large_collectives_write_the_ring_bytes(one_mib_on_four_ranks):
    """At 1 MiB headers are lost in the payload: all-reduce 2(N-1)/N S, all-gather and
    all-to-all (N-1)/N S, within 1 %."""
    for op in ("all_reduce", "all_gather", "all_to_all"):
        assert one_mib_on_four_ranks[op]["written_over_model"] == pytest.approx(1.0, abs=0.01), op


def test_gloo_reduce_scatter_writes_an_all_reduce(one_mib_on_four_ranks):
    """A fact about gloo (torch 2.13) the ring model does not know: its reduce-scatter writes
    what an all-reduce does, 2(N-1)/N S, twice the (N-1)/N S of a ring reduce-scatter."""
    row = one_mib_on_four_ranks["reduce_scatter"]
    assert row["written_bytes"] == pytest.approx(one_mib_on_four_ranks["all_reduce"]["written_bytes"],
                                                 rel=0.01)
    assert row["written_over_model"] == pytest.approx(2.0, abs=0.02)


def test_unmeasurable_is_none_not_a_number():
    meter, rec = WireMeter(backend="nccl"), {"wire_bytes_model": 10, "group": "dp"}
    meter.begin(rec)
    meter.end(rec)
    assert rec["wire_bytes_measured"] is None


def _ring_in_a_row(numel: int) -> dict:
    import torch
    from parallel_mini.comm import Comm, ring_all_reduce
    from parallel_mini.mesh import build_mesh
    import torch.distributed as dist
    n = dist.get_world_size()
    comm = Comm(build_mesh(RunConfig(dp=n, batch=n)))
    reads, read = [], comm.meter.wire._read
    comm.meter.wire._read = lambda: reads.append(1) or read()
    x = torch.ones(numel)
    ring_all_reduce(x, comm)
    sends = [r for r in comm.records if r["op"] == "send"]
    return {"reads": len(reads), "sends": len(sends),
            "shared": all(r.get("wire_shared") for r in sends),
            "written_over_model": sum(r["wire_bytes_measured"] for r in sends)
            / sum(r["wire_bytes_model"] for r in sends),
            "sum_right": bool(torch.equal(x, torch.full_like(x, float(n))))}


def test_the_ring_reads_its_socket_bytes_once_at_each_end():
    """ring_all_reduce runs its 2(N-1) steps in Comm.in_a_row: two readings of the counter for the
    whole ring, not two per step; the steps share the bytes (wire_shared) and the ring's total is
    still what it wrote: 1 MiB on 4 ranks, within 2 % of the ring model."""
    for got in (res.value for res in run_ranks(_ring_in_a_row, 4, MB // 4, backend="gloo")):
        assert got["sum_right"] and got["sends"] == 6 and got["reads"] == 2
        assert got["shared"]
        assert got["written_over_model"] == pytest.approx(1.0, abs=0.02)


def test_ops_in_flight_share_each_reading_by_model_bytes_and_note_the_groups():
    """Between two readings the bytes written belong to the ops in flight, split by their model
    bytes; an op that overlapped others is marked wire_shared, with every group it overlapped."""
    meter = WireMeter(backend="gloo")
    if meter.fd is None:
        pytest.skip("/proc/self/io unreadable here")
    counter = iter(range(0, 10_000, 100))  # each reading: 100 bytes more than the last
    meter._read = lambda: next(counter)
    meter.last = meter._read()
    a = {"wire_bytes_model": 300, "group": "pp"}
    b = {"wire_bytes_model": 100, "group": "dp"}
    meter.begin(a)                 # reading 1: 100 bytes, nothing in flight (not communication)
    meter.begin(b)                 # reading 2: 100 bytes, a alone
    meter.end(a)                   # reading 3: 100 bytes, a and b: 75 / 25
    meter.end(b)                   # reading 4: 100 bytes, b alone
    assert a["wire_bytes_measured"] == pytest.approx(175)
    assert b["wire_bytes_measured"] == pytest.approx(125)
    assert a["wire_shared"] and b["wire_shared"]
    assert a["wire_shared_with"] == b["wire_shared_with"] == ["dp", "pp"]
    alone = {"wire_bytes_model": 50, "group": "tp"}
    meter.begin(alone)
    meter.end(alone)
    assert alone["wire_bytes_measured"] == 100 and "wire_shared" not in alone
