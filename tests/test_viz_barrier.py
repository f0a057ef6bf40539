"""course/viz/barrier.py on hand-made data (no ranks): each chart carries exactly the numbers it
was given, with theory's beside the counted ones and the labels that say which is which."""
from __future__ import annotations

from parallel_mini import theory
from parallel_mini.course.viz import barrier as vb
from parallel_mini.course.viz.style import spec_of


def _rows(spec: dict) -> list[dict]:
    return [r for rows in spec["datasets"].values() for r in rows]


def _async_report(bound: int = -1) -> dict:
    hist = {"0": 2, "1": 5, "2": 9, "3": 2}
    return {"async": {"staleness_histogram": hist, "workers": [1, 2, 3], "max_staleness": bound,
                      "staleness_mean": sum(int(s) * n for s, n in hist.items()) / 18,
                      "straggler": {"rank": 3, "factor": 3.0},
                      "theory": theory.async_staleness(3, 3.0, bound)}}


def test_staleness_histogram_bars_and_rules():
    spec = spec_of(vb.staleness_histogram(_async_report()))
    rows = _rows(spec)
    assert {r["staleness"]: r["updates"] for r in rows if "updates" in r} == {0: 2, 1: 5, 2: 9,
                                                                              3: 2}
    rules = {r["what"]: r["at"] for r in rows if "what" in r}
    assert rules == {f"counted mean {29 / 18:.2f}": 29 / 18, "theory mean 2 (W − 1)": 2}
    assert "worker 3 3× slower" in spec["title"]["subtitle"]
    bounded = {r["what"]: r["at"] for r in _rows(spec_of(vb.staleness_histogram(
        _async_report(bound=1)))) if "what" in r}
    assert bounded[f"bound (W−1)(2K+1) = {2 * 3}"] == 6 and len(bounded) == 2  # no mean at K=1


def test_loss_against_time_and_samples():
    curves = {"sync DP": [{"time": 0.5, "samples": 24, "loss": 4.0},
                          {"time": 1.0, "samples": 48, "loss": 3.9}],
              "async": [{"time": 0.1 * i, "samples": 8 * i, "loss": 4.0 - 0.01 * i}
                        for i in range(1, 7)]}
    for x, title in (("time", "wall-clock time (s, measured)"),
                     ("samples", "samples (sequences trained on)")):
        spec = spec_of(vb.loss_against(curves, x))
        assert spec["encoding"]["x"]["field"] == x and spec["encoding"]["x"]["title"] == title
        assert [r["run"] for r in _rows(spec)] == ["sync DP"] * 2 + ["async"] * 6


def test_bytes_per_sample_keeps_the_sources_apart():
    rows = [{"mode": "DDP", "bytes_per_sample": {"counted": 4096.0, "theory": 4096.0,
                                                 "measured": 4400.0}},
            {"mode": "local SGD, H = 4", "bytes_per_sample": {"counted": 1024.0,
                                                              "theory": 1024.0,
                                                              "measured": None}}]
    got = {(r["mode"], r["source"]): r["bytes"] for r in _rows(spec_of(vb.bytes_per_sample(rows)))}
    assert got == {("DDP", "counted (comm records)"): 4096.0,
                   ("DDP", "theory (formula)"): 4096.0,
                   ("DDP", "measured (written to sockets)"): 4400.0,
                   ("local SGD, H = 4", "counted (comm records)"): 1024.0,
                   ("local SGD, H = 4", "theory (formula)"): 1024.0}  # unreadable: no bar


def test_fedavg_rounds_one_line_per_setting_and_the_target():
    rows = [{"non_iid": a, "local_steps": e, "union_loss": [4.0, 3.5, 3.0]}
            for a in (0.0, 10.0) for e in (1, 4)]
    spec = spec_of(vb.fedavg_rounds(rows, target=3.2))
    data = _rows(spec)
    assert sorted({r["run"] for r in data if "run" in r}) == [
        "A = 0, E = 1", "A = 0, E = 4", "A = 10, E = 1", "A = 10, E = 4"]
    assert sum("round" in r for r in data) == 12 and {"target": 3.2} in data
    assert "subtitle" not in spec_of(vb.fedavg_rounds(rows))["title"]
