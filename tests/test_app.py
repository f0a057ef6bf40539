"""The Streamlit app, driven headless with AppTest: every page renders, and "Run live" puts the
numbers of a real run on the page (checked against values computed here from the formulas)."""
from __future__ import annotations

import io
import re
import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from parallel_mini import theory
from parallel_mini.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app" / "streamlit_app.py")
PAGES = ["app_pages/home.py", "app_pages/ring.py", "app_pages/data_parallel.py"]


@pytest.fixture(autouse=True)
def _fresh_cache():
    st.cache_data.clear()
    yield
    st.cache_data.clear()


def _app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=90).run()
    if page:
        at.switch_page(page).run()
    return at


def _widget(elements, label_start: str):
    found = [w for w in elements if w.label.startswith(label_start)]
    assert len(found) == 1, f"{label_start!r}: {[w.label for w in elements]}"
    return found[0]


def _metric(at, label_start: str) -> str:
    return _widget(at.metric, label_start).value


def _charts(at) -> list[dict]:
    """Every Altair chart on the page: its spec and its datasets as lists of row dicts."""
    out = []
    for el in at.get("vega_lite_chart"):
        datasets = {d.name: pa.ipc.open_stream(io.BytesIO(d.data.data)).read_all().to_pylist()
                    for d in el.proto.datasets}
        out.append({"spec": json.loads(el.proto.spec), "datasets": datasets})
    return out


def _chart(at, title_start: str) -> dict:
    found = [c for c in _charts(at) if str(c["spec"].get("title", {}).get("text", "")).startswith(title_start)]
    assert len(found) == 1, [c["spec"].get("title") for c in _charts(at)]
    return found[0]


def _rows_with(chart: dict, column: str) -> list[dict]:
    return [row for rows in chart["datasets"].values() for row in rows if column in row]


def record_steps(monkeypatch) -> list[str]:
    """Every text the pages' progress bars are given from now on, in order (live_runs.step_text,
    in the module the page imported): AppTest keeps only the last state of each element."""
    live_runs = sys.modules["live_runs"]  # imported by the page _app() opened
    texts: list[str] = []
    step_text = live_runs.step_text
    monkeypatch.setattr(live_runs, "step_text",
                        lambda i, n, what: texts.append(step_text(i, n, what)) or texts[-1])
    return texts


def assert_steps(at, texts: list[str], whats: list[str], done: str = "done") -> None:
    """A press that ran len(whats) things: its bar said "Step i of n: <what>" for each, in order
    (after "Step 1 of n: starting the ranks…"), and ends full on "Step n of n: done"."""
    n = len(whats)
    assert texts == ([f"Step 1 of {n}: starting the ranks…"]
                     + [f"Step {i} of {n}: {w}" for i, w in enumerate(whats, 1)]
                     + [f"Step {n} of {n}: {done}"]), texts
    (bar,) = at.get("progress")
    assert bar.proto.text == texts[-1] and bar.proto.value == 100


def _assert_clean(at):
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders(page):
    at = _app(page)
    _assert_clean(at)
    assert at.title, "page has no title"
    if page != "app_pages/home.py":  # nothing runs until asked
        assert any("Run live" in i.value for i in at.info)
        assert not at.get("vega_lite_chart")


def test_ring_run_live_shows_measured_numbers():
    at = _app("app_pages/ring.py")
    n, numel = 8, 16
    _widget(at.slider, "World size").set_value(n)
    _widget(at.select_slider, "Elements").set_value(numel)
    _widget(at.select_slider, "Timed tensor").set_value(1)
    at.button[0].click().run()
    _assert_clean(at)

    x = 4 * numel  # fp32 bytes
    expected_bytes = 2 * (n - 1) * x // n  # 2(N-1)/N * X, computed here, not by the library
    assert _metric(at, "Bytes sent by each rank: counted") == f"{expected_bytes:,} B"
    assert _metric(at, "Bytes sent: theory") == f"{expected_bytes:,} B"
    written = _metric(at, "Written to sockets by each rank: measured")
    if written != "not measurable here":  # the payloads plus gloo's framing, 2(N-1) messages
        per_rank = [int(x.replace(",", "")) for x in written.split()[0].split("–")]  # "a–b B"
        assert expected_bytes < min(per_rank) <= max(per_rank) < expected_bytes + 2 * (n - 1) * 1024
        assert any("B per message" in c.value for c in at.caption)
    assert _metric(at, "Ring steps: measured") == str(2 * (n - 1))
    assert _metric(at, "Exact on integers") == "yes"
    assert float(_metric(at, "float32: max")) < 1e-5
    for label in ("Our ring: measured", "gloo all_reduce: measured"):
        assert float(_metric(at, label).split()[0]) > 0

    anim = _chart(at, f"Ring all-reduce on {n} ranks")
    (step,) = [p for p in anim["spec"]["params"] if p["name"] == "step"]
    assert step["bind"]["input"] == "range" and step["bind"]["max"] == 2 * (n - 1)
    cells = _rows_with(anim, "contributors")
    assert len(cells) == (2 * (n - 1) + 1) * n * n  # every frame x rank x chunk
    first = [c for c in cells if c["frame"] == 0]
    last = [c for c in cells if c["frame"] == 2 * (n - 1)]
    assert all(c["mask"] == 1 << c["rank"] for c in first)  # each rank starts with its own data
    assert all(c["contributors"] == n for c in last)  # and ends with everyone's, as decoded
    # after the reduce-scatter, each rank holds exactly one fully summed chunk
    mid = [c for c in cells if c["frame"] == n - 1]
    assert sorted(c["rank"] for c in mid if c["contributors"] == n) == list(range(n))

    # moving a slider afterwards does not start ranks: the page says the result is stale
    _widget(at.slider, "World size").set_value(3).run()
    _assert_clean(at)
    assert any("settings changed" in w.value for w in at.warning)
    assert _chart(at, f"Ring all-reduce on {n} ranks")  # still the last run


def test_data_parallel_run_live_matches_reference_and_theory():
    at = _app("app_pages/data_parallel.py")
    dp, steps = 2, 3
    _widget(at.radio, "Ranks").set_value(dp)
    _widget(at.radio, "Gradient sync").set_value("bucketed")
    _widget(at.slider, "Training steps").set_value(steps)
    at.button[0].click().run()
    _assert_clean(at)

    assert float(_metric(at, "max |run − reference|")) <= 1e-5
    cfg = RunConfig()
    n_params = theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers)
    expected = 2 * (dp - 1) * 4 * n_params // dp
    counted = int(_metric(at, "Rank 0 per step: ring model of the ops run").split()[0]
                  .replace(",", ""))
    assert counted == expected
    written = int(_metric(at, "Rank 0 per step: measured (written to sockets)").split()[0]
                  .replace(",", ""))
    assert 0.99 * expected <= written <= 1.1 * expected  # the ring's bytes plus gloo's headers
    assert _metric(at, "Per step: theory") == f"{expected:,} B"

    loss = _chart(at, "Loss per step")
    rows = _rows_with(loss, "loss")
    runs = {r["run"] for r in rows}
    assert len(runs) == 2 and len(rows) == 2 * steps
    by_step: dict[int, list[float]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["loss"])
    assert all(abs(a - b) <= 1e-5 for a, b in by_step.values())
    final = float(_metric(at, "Final loss: this run"))
    assert final == pytest.approx(rows[steps - 1]["loss"], abs=1e-6)

    comm = _rows_with(_chart(at, "Bytes each rank sends"), "source")
    assert {r["bytes"] for r in comm if r["source"] == "ring model"} == {expected}
    assert len([r for r in comm if r["source"] == "ring model"]) == dp
    sockets = [r["bytes"] for r in comm if r["source"] == "measured (written to sockets)"]
    assert len(sockets) == dp and all(0.99 * expected <= b <= 1.1 * expected for b in sockets)
    mem = _rows_with(_chart(at, "Memory per rank"), "category")
    params = [r["bytes"] for r in mem if r["category"] == "params"]
    assert params == [4 * n_params] * (dp + 1)  # every rank measured, and theory
    timeline = _rows_with(_chart(at, "Timeline"), "lane")
    assert {r["lane"] for r in timeline} == {f"rank {r} · {k}" for r in range(dp)
                                             for k in ("compute", "comm")}
    assert {r["step"] for r in timeline} == set(range(steps))
    assert any(r["kind"] == "all_reduce" and r["bucket"] is not None for r in timeline)


def test_data_parallel_bad_config_shows_one_line_error():
    at = _app("app_pages/data_parallel.py")
    _widget(at.radio, "Ranks").set_value(4)
    _widget(at.radio, "Gradient accumulation").set_value(4)  # 4 x 4 does not divide batch 8
    at.button[0].click().run()
    assert not at.exception
    (err,) = at.error
    assert "--batch 8" in err.value and "\n" not in err.value.strip()
    assert not at.get("vega_lite_chart")


def test_rank_error_summary_keeps_the_last_line():
    sys.path.insert(0, str(ROOT / "app"))
    from live_runs import rank_error_summary

    from parallel_mini.runtime.launch import RankError

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: shapes differ\n"
    assert rank_error_summary(RankError(2, tb)) == "Rank 2 failed: ValueError: shapes differ"


def test_home_lists_every_page_once_without_a_port_and_icons_are_material():
    sys.path.insert(0, str(ROOT / "app"))
    import streamlit_app  # main() runs only as a script: importing it draws nothing

    at = _app()
    _assert_clean(at)
    text = "\n".join(m.value for m in at.markdown)
    bullets = [ln for ln in text.splitlines() if ln.startswith("- **")]
    titles = [title for _, title, _, _ in streamlit_app.TOPICS]
    assert [b.split("**")[1] for b in bullets] == titles  # every page, one line each, in order
    assert not re.search(r":\d{4}\b|localhost|127\.0\.0\.1", text), "a hard-coded address"
    assert "about a second" not in text and "instant" not in text
    assert all(icon.startswith(":material/") and icon.endswith(":")
               for _, _, icon, _ in streamlit_app.TOPICS)
    source = (ROOT / "app" / "streamlit_app.py").read_text()
    assert not re.search("[\U0001F300-\U0001FAFF\u2600-\u27BF]", source), "an emoji icon"
