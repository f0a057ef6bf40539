"""course/viz/links.py on a real, tiny measure_links run (2 ranks, one op, 3 sizes, ~1 s): the
chart carries exactly the times the ranks measured, the fitted line is the α–β model computed here
by hand from the fit, the comparison puts this machine's fitted all-reduce beside the source
material's links, and every chart fits its column at each setting the Links page offers."""
from __future__ import annotations

import copy
import math

import pytest

from parallel_mini import theory
from parallel_mini.course import links
from parallel_mini.course.viz import links as vl
from parallel_mini.course.viz.style import fit_width, presentation, spec_of

SIZES = [4, 2 ** 14, 2 ** 20]


@pytest.fixture(scope="module")
def sweep():
    result = links.measure_links(2, sizes=SIZES, ops=("all_reduce",), repeats=3)
    return result, links.fit_alpha_beta(result)


def _rows(spec: dict) -> list[dict]:
    return [r for rows in spec["datasets"].values() for r in rows]


def test_the_chart_carries_the_measured_times_and_the_fit_by_hand(sweep):
    result, fit = sweep
    spec = spec_of(vl.links_chart(result, fit))
    rows = _rows(spec)
    measured = {r["bytes"]: r for r in rows if r.get("source") == "measured"}
    assert sorted(measured) == sorted(r["bytes"] for r in result["rows"]) and len(measured) == 3
    for row in result["rows"]:
        dot = measured[row["bytes"]]
        assert (dot["measured_s"], dot["min_s"], dot["max_s"]) == (
            row["median_s"], min(row["seconds"]), max(row["seconds"]))
    alpha, bw = fit["all_reduce"]["alpha_s"], fit["all_reduce"]["bandwidth_Bps"]
    line = [r for r in rows if r.get("source") == "fitted α–β"]
    assert len(line) == 40 and {r["op"] for r in line} == {"all-reduce"}
    assert min(r["bytes"] for r in line) == pytest.approx(min(measured))
    assert max(r["bytes"] for r in line) == pytest.approx(max(measured))
    for r in line:  # a ring all-reduce on N = 2: 2(N-1) = 2 hops, 2(N-1)/N = 1 x the bytes
        assert r["fitted_s"] == pytest.approx(2 * alpha + r["bytes"] / bw, rel=1e-12)
    assert spec["title"]["text"].startswith("This machine's links: 2 ranks")
    subtitle = " ".join(spec["title"]["subtitle"])
    assert "dots: measured" in subtitle and "dashed: fitted α–β" in subtitle


def test_the_comparison_puts_this_machine_beside_the_source_links(sweep):
    _, fit = sweep
    nbytes, world = 2 ** 30, 8
    df = vl.link_comparison_frame(fit, nbytes, world)
    mine = df.iloc[0]
    alpha, bw = fit["all_reduce"]["alpha_s"], fit["all_reduce"]["bandwidth_Bps"]
    assert mine["link"] == "this machine (gloo, 8 ranks)" and mine["kind"] == vl.MEASURED
    assert mine["seconds"] == pytest.approx(14 * alpha + 7 / 4 * nbytes / bw, rel=1e-12)
    assert mine["latency_share"] == pytest.approx(14 * alpha / mine["seconds"], rel=1e-12)
    vendor = df.set_index("link")
    for name in ("NVLink 4 (H100)", "NVLink 5 (B200)", "PCIe Gen5 x16", "InfiniBand NDR",
                 "InfiniBand XDR"):
        row = vendor.loc[name]
        assert row["kind"] == vl.VENDOR and row["bandwidth_Bps"] == theory.INTERCONNECTS[name]
        assert row["seconds"] == pytest.approx(
            14 * row["latency_s"] + 7 / 4 * nbytes / theory.INTERCONNECTS[name], rel=1e-12)
    bars = {r["link"]: r for r in _rows(spec_of(vl.link_comparison(fit, nbytes, world)))}
    assert bars["NVLink 4 (H100)"]["label"] == vl.fmt_seconds(vendor.loc["NVLink 4 (H100)",
                                                                         "seconds"])


def test_every_chart_fits_its_column(sweep):
    """At each all-reduce size and rank count the Links page offers (its first, middle and last
    values), in a half column, the main column and presentation mode."""
    result, fit = sweep
    charts = [spec_of(vl.links_chart(result, fit))] + [
        spec_of(vl.link_comparison(fit, nbytes, world))
        for nbytes in (4, 2 ** 20, 14 * 10 ** 9) for world in (2, 16, 1024)]
    for chart in charts:
        for width, font in ((480, 12), (980, 12), (680, 16)):
            spec, stretch = fit_width(presentation(copy.deepcopy(chart), min_font_px=font), width)
            assert stretch and spec["width"] == "container"  # the column's width, whatever it is
            x = [layer["encoding"]["x"] for layer in spec["layer"]]
            values = [v for enc in x for v in enc.get("axis", {}).get("values", [])]
            assert len(set(values)) <= 9  # log ticks: a narrow column still holds their labels
            assert all(math.isfinite(v) for v in values)
