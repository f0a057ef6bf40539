"""The lessons' widgets (course/widgets.py), driven as a learner drives them: sliders set, buttons
clicked (`button.click()`), with no kernel and no browser. Every theory chart is checked against
the library's formula after each move; one "Run live" per widget checks that what the ranks
measured arrived (toy sizes; the ring's and the memory's run in the default suite, the pipeline's
and the tiles' under `-m slow`); and a notebook holding a widget's output, rendered by nbconvert
with no kernel and no widget state, shows the static chart."""
from __future__ import annotations

import json

import pytest

from parallel_mini import theory
from parallel_mini.config import RunConfig
from parallel_mini.parallel import schedules as S
from parallel_mini.runtime import launch
from parallel_mini.course import at_scale, viz
from parallel_mini.course import widgets as w


def _datasets(chart) -> list[list[dict]]:
    return list(chart.to_dict()["datasets"].values())


def _shown(output) -> dict:
    """The mime bundle an Output widget holds (what the frontend draws)."""
    assert len(output.outputs) == 1
    return output.outputs[0]["data"]


def _error(widget) -> str:
    assert widget.error, widget.status.value
    assert "Traceback" not in widget.status.value
    return widget.error


# ---------------------------------------------------------------------------------------------
# lesson 03: memory per GPU
# ---------------------------------------------------------------------------------------------
def _stage_bytes(chart) -> dict[tuple[str, str], float]:
    """(stage, category) -> bytes, read back from the memory_stages chart drawn."""
    rows = next(d for d in _datasets(chart) if d and "category" in d[0])
    return {(r["stage"], r["category"]): r["bytes"] for r in rows}


def test_memory_explorer_redraws_theory_at_every_slider_move():
    m = w.memory_explorer(gpus=2, precision="bf16-mixed")
    toy = w.TOYS[m.model.value]
    units = theory.gpt_unit_sizes(toy["vocab"], w.TOY_SEQ, toy["d_model"], toy["layers"])
    before = _stage_bytes(m.chart)
    shown_before = _shown(m.outs[0])
    for gpus in (4, 8):
        m.gpus.value = gpus
        got = _stage_bytes(m.chart)
        for k in w.STAGES:  # exact per rank, padded shards, as theory counts them
            want = theory.model_state_bytes(sum(units), "adam", "bf16-mixed", k, gpus, units)
            for cat, v in want.items():
                assert got[(f"ZeRO-{k}", cat)] == v
    assert got != before and _shown(m.outs[0]) != shown_before
    # ZeRO-0 replicates: N does not change it; ZeRO-3 divides everything by N (padded)
    assert got[("ZeRO-0", "params")] == before[("ZeRO-0", "params")]
    assert got[("ZeRO-3", "optimizer")] < before[("ZeRO-3", "optimizer")]
    assert m.run_button.disabled and "at most 4 ranks" in m.status.value

    m.zero.value = 2  # the chosen stage is drawn opaque, the others faded
    spec = m.chart.to_dict()
    assert "ZeRO-2" in json.dumps(spec["layer"][0]["encoding"]["opacity"])
    m.model.value = "7B"  # a preset: at_scale.memory_per_gpu against an 80 GB GPU, no live run
    got = _stage_bytes(m.chart)
    p = at_scale.PRESETS["7B"]
    want = at_scale.memory_per_gpu(p["n_params"], 8, 1, "bf16-mixed", "adam", p["layers"],
                                 p["d_model"], p["heads"], w.BIG_SEQ, w.BIG_MICRO_BATCH)
    assert all(got[("ZeRO-1", c)] == v for c, v in want.items())
    assert m.run_button.disabled and "theory only" in m.status.value
    m.run_button.click()  # clicked anyway (a script can): said, not run
    assert "theory only" in _error(m)


def test_memory_explorer_run_live_measures_the_toy(monkeypatch):
    m = w.memory_explorer(gpus=2, zero=3, precision="bf16-mixed")
    assert m.live_chart is None and not m.run_button.disabled
    m.run_button.click()
    assert m.error is None, m.status.value
    run = m.runs[(m.model.value, 2, "bf16-mixed", 3)]
    for cat in ("params", "grads", "optimizer"):  # measured by the ranks' meters, to the byte
        assert run["measured"][cat] == run["theory"][cat] > 0
    assert run["measured"]["activations"] > 0 and run["peak"] > 0
    rows = next(d for d in _datasets(m.live_chart) if d and "source" in d[0])
    assert {r["source"] for r in rows} == {"measured", "predicted"}
    assert {r["stage"] for r in rows} == {"ZeRO-3"}
    assert "equal the formula to the byte" in m.status.value
    # another N: the live chart is that N's (none yet); back: the run is still there
    m.gpus.value = 4
    assert m.live_chart is None
    m.gpus.value = 2
    assert m.live_chart is not None

    def broken(cfg):
        raise RuntimeError("rank 1 exited with code 9 (killed)\n  and a second line")
    monkeypatch.setattr(launch, "run", broken)  # a failed run: one line in the widget
    m.run_button.click()
    assert _error(m) == "The live run failed: rank 1 exited with code 9 (killed)"
    assert not m.run_button.disabled


# ---------------------------------------------------------------------------------------------
# lesson 05: the bubble
# ---------------------------------------------------------------------------------------------
def _bubbles(chart) -> dict[tuple[str, str], float]:
    rows = _datasets(chart)[0]
    return {(r["schedule"], r["source"]): r["bubble"] for r in rows}


def test_bubble_explorer_plans_every_schedule_and_equals_the_formula():
    b = w.bubble_explorer(pp=2, m=4, schedule="gpipe")
    first = _shown(b.outs[0])
    for name in w.SCHEDULES:
        b.schedule.value = name
        assert b.error is None, b.status.value
        s = b.planned["schedule"]
        formula = theory.bubble_fraction(name, 2, 4, s.virtual)
        got = _bubbles(b.bars)
        group = f"planned: {name}, p 2, m 4"
        assert got[(group, "formula")] == formula
        assert got[(group, "planned (unit costs, theory)")] == pytest.approx(formula, abs=1e-12)
        # the timeline drawn is this schedule's plan: every op of every rank, once
        ops = [r for d in _datasets(b.chart) for r in d if r.get("kind") in ("F", "B", "W")]
        assert len({(r["rank"], r["kind"], r["microbatch"], r["chunk"]) for r in ops}) == \
            sum(len(x) for x in s.ops)
    assert _shown(b.outs[0]) != first
    # fewer micro-batches than stages: a bigger bubble, (p - 1) / (m + p - 1)
    b.schedule.value, b.pp.value, b.m.value = "1f1b", 4, 2
    assert _bubbles(b.bars)[("planned: 1f1b, p 4, m 2", "formula")] == pytest.approx(3 / 5)
    assert not b.run_button.disabled
    b.pp.value = 6  # planned, but not run here
    assert b.run_button.disabled and "at most 4 ranks" in b.status.value
    assert b.chart is not None


def test_bubble_explorer_says_a_bad_combination_in_one_line():
    b = w.bubble_explorer(pp=4, m=4, schedule="interleaved")
    assert b.error is None
    b.m.value = 3
    msg = _error(b)
    assert msg.startswith("interleaved, p = 4, m = 3 cannot run:") and "micro-batches" in msg
    assert b.run_button.disabled and b.chart is None and b.outs[0].outputs == ()
    b.m.value = 8  # fixed: planned again
    assert b.error is None and b.chart is not None


def test_bubble_explorer_plans_dualpipe_with_its_fb_pairs_as_one_unit():
    """DualPipe and DualPipeV as the app's Pipeline page plans them: each F&B pair (an F, then a B
    of the rank's other chunk, schedules.overlapped_pairs) one unit, so its ops run back to back;
    the model as the CLI would choose it; a setting the library refuses said in one line."""
    b = w.bubble_explorer(pp=4, m=8, schedule="dualpipe")
    assert b.error is None and "each F&B pair" in json.dumps(b.chart.to_dict()["title"])
    s = b.planned["schedule"]
    pairs = S.overlapped_pairs(s)
    assert pairs and b.planned["planned"] == pytest.approx(theory.bubble_fraction("dualpipe", 4, 8))
    at = {(r["rank"], r["kind"], r["microbatch"], r["chunk"]): r for r in b.planned["timed"]}
    for (rank, i), n in pairs.items():  # the pair's ops back to back, as one unit
        ops = [at[(rank, op.kind, op.microbatch, op.chunk)] for op in s.ops[rank][i:i + n]]
        assert all(a["end"] == c["start"] for a, c in zip(ops, ops[1:]))
    unfused = S.idle_fractions(S.simulate(s, lambda r, op: 1.0), 4)
    assert sum(unfused) / 4 != pytest.approx(b.planned["planned"])  # the fusing matters here
    # layers: dualpipe's two chunks per rank are two copies of one stage; dualpipev's V halves
    for name, layers in (("dualpipe", 4 * 4), ("dualpipev", 4 * 8)):
        cfg = w.pipeline_config(name, 4, 8)
        assert cfg["layers"] == layers and RunConfig.from_dict(cfg).schedule == name
    b.m.value = 6  # fewer than 2p: refused, in the library's words
    assert _error(b).startswith("dualpipe, p = 4, m = 6 cannot run:") and "2 x pp" in b.error
    assert b.run_button.disabled and b.chart is None
    b.schedule.value, b.m.value = "dualpipev", 8
    assert b.error is None and b.planned["planned"] == pytest.approx(
        theory.bubble_fraction("dualpipev", 4, 8))


@pytest.mark.slow
def test_bubble_explorer_run_live_draws_the_reports_bubble():
    b = w.bubble_explorer(pp=2, m=2, schedule="1f1b")
    b.run_button.click()
    assert b.error is None, b.status.value
    bub = b.live["bubble"]
    got = _bubbles(b.bars)
    run = "run: 1f1b, p 2, m 2"
    assert got[(run, "measured (wall clock)")] == bub["wall"]["overall"] > 0
    assert got[(run, "replayed (measured op times, own-device schedule)")] == \
        bub["replayed"]["overall"]
    assert got[(run, "formula")] == pytest.approx(theory.bubble_fraction("1f1b", 2, 2))
    b.m.value = 4  # the plan follows the sliders; the run's bars stay, named as the run
    got = _bubbles(b.bars)
    assert got[("planned: 1f1b, p 2, m 4", "formula")] == pytest.approx(1 / 5)
    assert got[(run, "measured (wall clock)")] == bub["wall"]["overall"]
    kinds = {r.get("kind") for d in _datasets(b.live_chart) for r in d}
    assert {"F", "B"} <= kinds


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_bubble_explorer_runs_dualpipe_live(name):
    b = w.bubble_explorer(pp=2, m=4, schedule=name)
    b.run_button.click()
    assert b.error is None, b.status.value
    bub, run = b.live["bubble"], f"run: {name}, p 2, m 4"
    got = _bubbles(b.bars)
    assert got[(run, "measured (wall clock)")] == bub["wall"]["overall"] > 0
    assert got[(run, "formula")] == bub["theory"]
    ops = {(r["rank"], r["kind"], r["microbatch"], r["chunk"]) for d in _datasets(b.live_chart)
           for r in d if r.get("kind") in ("F", "B", "W")}  # every op of the plan, run and drawn
    assert ops == {(r, op.kind, op.microbatch, op.chunk)
                   for r, rank_ops in enumerate(b.planned["schedule"].ops) for op in rank_ops}


# ---------------------------------------------------------------------------------------------
# lesson 06: causal tiles
# ---------------------------------------------------------------------------------------------
def _tiles_per_rank(chart) -> dict[int, tuple[int, int]]:
    """rank -> (tiles computed, tiles) read back from a tile map drawn."""
    out = {}
    for rows in _datasets(chart):
        if rows and "q_chunk" in rows[0]:
            out[rows[0]["rank"]] = (sum(r["computed"] for r in rows), len(rows))
    return out


def test_tiles_explorer_plans_the_tile_map_and_work_by_the_formula():
    t = w.tiles_explorer(cp=3, layout="ring", seq=48)
    for layout, c in (("ring", 3), ("ring", 4), ("zigzag", 4), ("zigzag", 3)):
        t.chunking.value, t.cp.value = layout, c
        assert t.error is None, t.status.value
        tiles = _tiles_per_rank(t.chart)
        assert tiles == {k: viz.tiles_theory("zigzag" if layout == "zigzag" else "contiguous",
                                             c, k) for k in range(c)}
        size = 48 // (2 * c if layout == "zigzag" else c)
        work = {r["rank"]: r["pairs"] for r in _datasets(t.work_chart)[0]}
        assert work == {f"rank {k}": tiles[k][0] * size * size for k in range(c)}
        # contiguous: rank r computes r + 1 tiles, the last rank most; zigzag: all the same
        assert len(set(work.values())) == (1 if layout == "zigzag" else c)
    assert not t.run_button.disabled
    t.cp.value = 6
    assert t.run_button.disabled and "at most 4 ranks" in t.status.value


def test_tiles_explorer_says_a_sequence_that_does_not_split():
    t = w.tiles_explorer(cp=2, layout="zigzag", seq=64)
    t.cp.value = 5
    assert _error(t) == ("s = 64 does not split into 10 equal chunks (zigzag, C = 5): choose s in "
                         "[80] or C in [2, 4, 8]")
    assert t.chart is None and t.run_button.disabled
    t.seq.value = 80
    assert t.error is None and _tiles_per_rank(t.chart)[4] == (11, 20)


@pytest.mark.slow
def test_tiles_explorer_run_live_records_the_planned_tiles():
    t = w.tiles_explorer(cp=2, layout="zigzag", seq=32)
    t.run_button.click()
    assert t.error is None, t.status.value
    assert t.live["same_as_planned"] and "equal the plan" in t.status.value
    assert _tiles_per_rank(t.live_chart) == _tiles_per_rank(t.chart)
    assert _shown(t.live_outs[1])
    measured = [r for r in _datasets(t.live_work_chart)[0] if r["source"].endswith("measured")]
    assert [r["pairs"] for r in measured] == [5 * 8 * 8, 5 * 8 * 8]  # 2C + 1 tiles of 8 x 8


# ---------------------------------------------------------------------------------------------
# lesson 01: the ring, from a live run
# ---------------------------------------------------------------------------------------------
def test_ring_player_plays_a_live_runs_frames_and_runs_again():
    r = w.ring_player(n=2, numel=8)  # runs the ring on 2 ranks now
    assert r.error is None, r.status.value
    assert r.exp["world_size"] == 2 and r.step.max == theory.ring_steps(2) == 2
    assert r.exp["steps_measured"] == theory.ring_steps(2)
    shown = _shown(r.outs[0])
    r.play.value = 1  # Play moves the step slider, the chart follows
    assert r.step.value == 1 and r.chart.to_dict()["params"][0]["value"] == 1
    assert _shown(r.outs[0]) != shown
    r.n.value = 3  # not run yet: said, the last run still shown
    assert "not run yet" in r.status.value and r.exp["world_size"] == 2
    r.run_button.click()
    assert r.error is None, r.status.value
    assert r.exp["world_size"] == 3 and r.step.max == r.play.max == theory.ring_steps(3)
    assert r.step.value == 0
    last = r.exp["frames"][-1]["state"]  # after the all-gather every chunk holds all 3 ranks' data
    assert all(mask == 0b111 for row in last for mask in row)
    assert "measured" in r.summary.value and "theory 2(N−1) = 4" in r.summary.value


# ---------------------------------------------------------------------------------------------
# without a kernel: the static chart
# ---------------------------------------------------------------------------------------------
def test_a_notebook_rendered_without_a_kernel_shows_the_static_chart():
    nbformat = pytest.importorskip("nbformat")
    nbconvert = pytest.importorskip("nbconvert")
    t = w.tiles_explorer(cp=2, layout="ring", seq=32)
    bundle = t._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # in a kernel: the widget
    html = bundle["text/html"]
    assert json.dumps(t.chart.to_dict()["title"]["text"])[1:-1] in html
    t.cp.value = 4  # the static copy follows the sliders
    assert t._repr_mimebundle_()["text/html"] != html
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "tiles_explorer()", outputs=[nbformat.v4.new_output("display_data", data=bundle)])])
    page, _ = nbconvert.HTMLExporter().from_notebook_node(nb)  # no widget state saved
    assert bundle["text/html"].split("<div id=")[1][:20] in page  # the chart's own div
    assert "vegaEmbed" in page and "application/vnd.jupyter.widget-view+json" not in page


@pytest.mark.slow
def test_a_kernel_displays_the_widget_with_the_static_chart_beside_it():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from parallel_mini.course.widgets import memory_explorer\nm = memory_explorer()\nm"),
        nbformat.v4.new_code_cell("m.gpus.value = 4\nprint(m.chart.to_dict()['title']['text'])")])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    shown = nb.cells[0].outputs[0]["data"]
    assert {"application/vnd.jupyter.widget-view+json", "text/html"} <= set(shown)
    assert "N = 2" in shown["text/html"] and "N = 4" in nb.cells[1].outputs[0]["text"]
