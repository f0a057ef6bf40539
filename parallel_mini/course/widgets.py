"""Live widgets for the lessons (ipywidgets): the course's own charts (`course.viz`, the same as the
app's), redrawn from the library's formulas at every slider move and from real ranks on a button.

    ring_player(exp=None, n=4, numel=16)      lesson 01: the ring all-reduce, Play/Pause and a step
                                              slider over a live run's messages; "Run live" (N,
                                              elements) runs the ring again on real ranks
    memory_explorer(model=..., gpus=2, zero=0, precision="bf16-mixed")
                                              lesson 03: memory per GPU, sliders for model size,
                                              ZeRO stage and ranks (theory at once); "Run live"
                                              measures the toy on real ranks (launch.run)
    bubble_explorer(pp=4, m=4, schedule="1f1b")
                                              lesson 05: the schedule planned with unit costs and
                                              its bubble beside the formula (at once; DualPipe's
                                              F&B pairs one unit each, as the app's Pipeline page
                                              plans them); "Run live" runs it on pp ranks
                                              (launch.run): the bubble measured on the wall clock
                                              and replayed, as the report says
    tiles_explorer(cp=4, layout="zigzag", seq=64)
                                              lesson 06: the causal tile map and the work per rank
                                              as planned (theory) for a cp size and layout; "Run
                                              live" runs context parallel and draws what it did

Each returns a widget (an ipywidgets.VBox) that displays itself, in a kernel, as the live widget,
and offers beside it a static copy of its current chart (text/html, and image/png where
vl-convert is installed): a notebook rendered without a kernel (nbconvert, nbviewer) shows that
chart instead of the widget.

Labels follow the course's rule: "theory" / "formula" / "planned" for what is computed before any
run, "measured" only for what the ranks did. The live runs are small (toy sizes, a second or two
once the rank processes are warm); every run shows its progress in the widget's status line, and
a bad combination of settings is said there in one line, never as a traceback.
"""
from __future__ import annotations

import hashlib
import html
import json
import time

import altair as alt
import ipywidgets as W

from .. import theory
from ..runtime import launch
from . import trace
from ..config import RunConfig
from ..parallel import schedules as S
from ..parallel.context import chunks_of, n_chunks
from . import at_scale, collectives, timelines, viz
from .viz.units import PAD

MAX_LIVE_RANKS = 4  # the ranks of one live run share this machine's cores


# ---------------------------------------------------------------------------------------------
# what every widget shares: a chart shown in an Output, a status line, a Run live button, and a
# static copy of the chart for a notebook rendered without a kernel
# ---------------------------------------------------------------------------------------------
def chart_bundle(chart: alt.TopLevelMixin) -> dict:
    """The chart's mime bundle from altair's active renderer, as a lesson's cell would display it
    (the spec not validated again at every slider move: viz's tests validate its charts)."""
    out = alt.renderers.get()(chart.to_dict(validate=False))
    return dict(out[0] if isinstance(out, tuple) else out)


def static_bundle(chart: alt.TopLevelMixin) -> dict:
    """The chart for a page without a kernel: self-contained HTML (vega-embed) and, where
    vl-convert is installed, a PNG (for viewers that strip scripts)."""
    spec = chart.to_dict()
    div = "pm-" + hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    data = {"text/html": chart.to_html(fullhtml=False, output_div=div)}
    try:
        import base64

        import vl_convert
    except ImportError:
        return data
    data["image/png"] = base64.b64encode(vl_convert.vegalite_to_png(spec, scale=1)).decode()
    return data


def _show(out: W.Output, chart: alt.TopLevelMixin | None) -> None:
    """Put the chart in the Output (or empty it): set directly, so it works with no display hook."""
    out.outputs = () if chart is None else (
        {"output_type": "display_data", "data": chart_bundle(chart), "metadata": {}},)


class Explorer(W.VBox):
    """A VBox of controls, a status line, a Run live button and chart outputs. Subclasses set
    `self.chart` (the chart the sliders redraw) and `self.live_chart` (the last run's)."""

    def __init__(self, controls: list[W.Widget], outputs: int = 1, run_label: str = "Run live",
                 extra: list[W.Widget] = (), live_outputs: int = 1):
        self.status = W.HTML(layout=W.Layout(min_height="1.6em"))
        self.summary = W.HTML()
        self.run_button = W.Button(description=run_label, icon="play", button_style="primary",
                                   tooltip="Runs it on real ranks here (a second or two)")
        self.run_button.on_click(self._run_clicked)
        self.outs = [W.Output() for _ in range(outputs)]
        self.live_outs = [W.Output() for _ in range(live_outputs)]
        self.chart: alt.TopLevelMixin | None = None
        self.live_chart: alt.TopLevelMixin | None = None
        self.error: str | None = None  # the last message said in red, for tests and callers
        box = W.HBox(controls, layout=W.Layout(flex_flow="row wrap"))
        super().__init__([box, *extra, W.HBox([self.run_button, self.status]), *self.outs,
                          self.summary, *self.live_outs])

    # --- status ----------------------------------------------------------------------------
    def say(self, text: str, kind: str = "info") -> None:
        color = {"info": "#333", "busy": "#1f6fb2", "ok": "#2e7d32", "error": "#c62828"}[kind]
        self.error = text if kind == "error" else None
        self.status.value = f'<span style="color:{color}">{html.escape(text)}</span>'

    def why_not_live(self) -> str | None:
        """None when the sliders' setting runs live here, else why (one line)."""
        return None

    def refresh_button(self) -> str | None:
        """Enable Run live exactly when the setting runs live; returns why not (or None)."""
        why = self.why_not_live()
        self.run_button.disabled = why is not None
        return why

    def _run_clicked(self, _button=None) -> None:
        why = self.why_not_live()
        if why:  # a disabled button can still be clicked from code: said, not run
            self.say(_sentence(why), "error")
            return
        self.run_button.disabled = True
        t0 = time.perf_counter()
        try:
            done = self.run_live()
        except Exception as err:  # noqa: BLE001 - any failure is said in the widget, one line
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            self.say(f"The live run failed: {first}", "error")
        else:
            self.say(f"{done} ({time.perf_counter() - t0:.1f} s)", "ok")
        finally:
            self.refresh_button()

    def run_live(self) -> str:  # pragma: no cover - every subclass has its own
        """Run on real ranks, draw what they did; returns the status line's summary."""
        raise NotImplementedError

    def show(self, chart, index: int = 0) -> None:
        _show(self.outs[index], chart)

    def show_live(self, chart, index: int = 0) -> None:
        if index == 0:
            self.live_chart = chart
        _show(self.live_outs[index], chart)

    # --- without a kernel -----------------------------------------------------------------
    def static_chart(self) -> alt.TopLevelMixin | None:
        """The chart a page without a kernel shows: the last live run's, else the sliders'."""
        return self.live_chart if self.live_chart is not None else self.chart

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        chart = self.static_chart()
        return {**(static_bundle(chart) if chart is not None else {}), **data}


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _labelled(widget: W.Widget, width: str = "330px") -> W.Widget:
    widget.style = {"description_width": "initial"}
    widget.layout.width = width
    return widget


# ---------------------------------------------------------------------------------------------
# lesson 01: the ring all-reduce
# ---------------------------------------------------------------------------------------------
class RingPlayer(Explorer):
    """The ring all-reduce, frame by frame, from a live run's recorded messages."""

    def __init__(self, exp: dict | None = None, n: int = 4, numel: int = 16):
        self.n = _labelled(W.IntSlider(n, min=2, max=8, description="ranks N"))
        self.numel = _labelled(W.SelectionSlider(options=[8, 16, 32, 64], value=numel,
                                                 description="elements"))
        self.play = W.Play(value=0, min=0, max=1, interval=900, description="Play")
        self.step = _labelled(W.IntSlider(0, min=0, max=1, description="step"), "400px")
        W.link((self.play, "value"), (self.step, "value"))
        super().__init__([self.n, self.numel], extra=[W.HBox([self.play, self.step])])
        self.exp = None
        self.step.observe(lambda _: self.redraw(), "value")
        self.n.observe(lambda _: self._settings_changed(), "value")
        self.numel.observe(lambda _: self._settings_changed(), "value")
        if exp is None:
            self._run_clicked()
        else:
            if exp["numel"] not in self.numel.options:  # a lesson's own size: offered too
                self.numel.options = sorted({*self.numel.options, exp["numel"]})
            self.n.value, self.numel.value = exp["world_size"], exp["numel"]
            self.use(exp)

    def use(self, exp: dict) -> None:
        """Show a ring_experiment's frames (step 0 first)."""
        self.exp = exp
        last = len(exp["frames"]) - 1
        self.step.value = 0
        self.play.max = self.step.max = last
        self.redraw()
        n, sent = exp["world_size"], exp["sent_bytes_per_rank"]
        written = exp.get("written_bytes_per_rank") or [None] * n
        self.summary.value = (
            f"<b>Live run, {n} ranks, {exp['numel']} fp32 elements.</b> Ring steps: counted "
            f"{exp['steps_measured']} (the messages rank 0 sent, from its records), theory "
            f"2(N−1) = {theory.ring_steps(n)}. Bytes each rank sent: counted "
            f"{min(sent):,}–{max(sent):,} B; theory 2(N−1)/N·X = "
            f"{exp['theory_bytes_per_rank']:,.0f} B; written to its sockets: "
            + ("not measurable here" if None in written else
               f"measured {min(written):,}–{max(written):,} B (payloads + gloo's framing)")
            + ". Integer sums equal gloo's: " + ("yes" if exp["int_exact"] else "NO") + ".")

    def redraw(self) -> None:
        if self.exp is None:
            return
        self.chart = viz.ring_animation(self.exp, frame=min(self.step.value,
                                                            len(self.exp["frames"]) - 1))
        self.show(self.chart)

    def _settings_changed(self) -> None:
        if self.exp and (self.n.value, self.numel.value) != (self.exp["world_size"],
                                                             self.exp["numel"]):
            self.say(f"N = {self.n.value}, {self.numel.value} elements: not run yet, press Run "
                     f"live. Shown: the last run (N = {self.exp['world_size']}, "
                     f"{self.exp['numel']} elements).")

    def run_live(self) -> str:
        n, numel = self.n.value, self.numel.value
        self.say(f"Running the ring all-reduce on {n} ranks ({numel} elements)…", "busy")
        self.use(collectives.ring_experiment(n, numel, repeats=1))
        return f"Live run on {n} ranks: {len(self.exp['frames']) - 1} steps recorded; press ▶"


def ring_player(exp: dict | None = None, n: int = 4, numel: int = 16) -> RingPlayer:
    """ring_player(exp=None, n=4, numel=16) -> widget.

    The ring all-reduce of a live run (`collectives.ring_experiment` dict `exp`; None runs one now
    on `n` ranks with `numel` elements), frame by frame: Play/Pause steps through the frames
    decoded from the messages the ranks sent, the step slider moves through them. "Run live" runs
    the ring again with the N and elements chosen."""
    return RingPlayer(exp, n, numel)


# ---------------------------------------------------------------------------------------------
# lesson 03: memory per GPU
# ---------------------------------------------------------------------------------------------
TOYS = {"toy: 4 layers × d64": {"layers": 4, "d_model": 64, "heads": 4, "vocab": 128},
        "toy: 8 layers × d128": {"layers": 8, "d_model": 128, "heads": 4, "vocab": 128}}
TOY_MICRO_BATCH, TOY_SEQ = 4, 32  # per rank; big models: 1 sequence of 2048 tokens
BIG_MICRO_BATCH, BIG_SEQ = 1, 2048
GPU_CAPACITY = 80e9  # bytes: an 80 GB GPU, for the big models' "fits"
MODELS = [*TOYS, *at_scale.PRESETS]
STAGES = [0, 1, 2, 3]


def memory_theory(model: str, gpus: int, zero: int, precision: str = "bf16-mixed") -> dict:
    """Bytes per GPU by category at one ZeRO stage, by the formulas: a toy counted exactly
    (theory.model_state_bytes over its units, padded shards), a preset by at_scale.memory_per_gpu;
    activations: Korthikanti per layer × layers (micro-batch and sequence as above)."""
    if model in TOYS:
        t = TOYS[model]
        units = theory.gpt_unit_sizes(t["vocab"], TOY_SEQ, t["d_model"], t["layers"])
        states = theory.model_state_bytes(sum(units), "adam", precision, zero, gpus, units)
        acts = t["layers"] * theory.activation_bytes_per_layer(TOY_SEQ, TOY_MICRO_BATCH,
                                                                t["d_model"], t["heads"])
        return {**states, "activations": acts}
    p = at_scale.PRESETS[model]
    return at_scale.memory_per_gpu(p["n_params"], gpus, zero, precision, "adam", p["layers"],
                                 p["d_model"], p["heads"], BIG_SEQ, BIG_MICRO_BATCH)


def memory_config(model: str, gpus: int, zero: int, precision: str) -> dict:
    """The live run of a toy: one step on `gpus` data-parallel ranks."""
    return {**TOYS[model], "dp": gpus, "zero": zero, "precision": precision, "optimizer": "adam",
            "batch": TOY_MICRO_BATCH * gpus, "seq": TOY_SEQ, "steps": 1}


class MemoryExplorer(Explorer):
    """Memory per GPU at ZeRO 0-3 (theory, redrawn at every move) and the toy measured live."""

    def __init__(self, model: str = MODELS[0], gpus: int = 2, zero: int = 0,
                 precision: str = "bf16-mixed"):
        self.model = _labelled(W.SelectionSlider(options=MODELS, value=model,
                                                 description="model size"), "420px")
        self.gpus = _labelled(W.SelectionSlider(options=[2 ** i for i in range(11)], value=gpus,
                                                description="GPUs N (ranks)"))
        self.zero = _labelled(W.IntSlider(zero, min=0, max=3, description="ZeRO stage"), "260px")
        self.precision = W.ToggleButtons(options=["fp32", "bf16-mixed"], value=precision,
                                         description="precision")
        super().__init__([self.model, self.gpus, self.zero, self.precision])
        self.runs: dict[tuple, dict] = {}  # (model, N, precision, stage) -> what a run measured
        self.rows: list[dict] = []
        for w in (self.model, self.gpus, self.zero, self.precision):
            w.observe(lambda _: self.redraw(), "value")
        self.redraw()

    def why_not_live(self) -> str | None:
        """None when this setting runs live here, else why (one line)."""
        model, gpus = self.model.value, self.gpus.value
        if model not in TOYS:
            return f"a {model} model does not run on this machine: theory only"
        if gpus > MAX_LIVE_RANKS:
            return (f"live runs take at most {MAX_LIVE_RANKS} ranks here and N = {gpus}: theory "
                    f"only (or choose N ≤ {MAX_LIVE_RANKS})")
        try:
            RunConfig.from_dict(memory_config(model, gpus, self.zero.value, self.precision.value))
        except ValueError as err:
            return f"this setting does not run: {err}"
        return None

    def redraw(self) -> None:
        model, gpus, zero, prec = (self.model.value, self.gpus.value, self.zero.value,
                                   self.precision.value)
        toy = model in TOYS
        self.rows = [{"stage": f"ZeRO-{k}", "category": c, "bytes": float(v)}
                     for k in STAGES for c, v in memory_theory(model, gpus, k, prec).items()]
        what = ("theory.model_state_bytes (exact per rank, padded shards)" if toy else
                f"at_scale.memory_per_gpu (Adam, micro-batch {BIG_MICRO_BATCH} × {BIG_SEQ} tokens, "
                "no activation checkpointing)")
        self.chart = viz.memory_stages(
            self.rows, None if toy else GPU_CAPACITY, selected=f"ZeRO-{zero}", decimal=not toy,
            title=f"Memory per GPU by ZeRO stage (theory): {model}, N = {gpus}, {prec}",
            subtitle=[f"{what}; activations: Korthikanti et al.",
                      "the chosen stage opaque" + ("" if toy else "; red: an 80 GB GPU")])
        self.show(self.chart)
        why = self.refresh_button()
        if why:
            self.say(_sentence(why))
        else:
            done = [k for k in STAGES if (model, gpus, prec, k) in self.runs]
            self.say(f"Run live measures ZeRO-{zero} on {gpus} rank(s)"
                     + (f" (measured so far: {', '.join(f'ZeRO-{k}' for k in done)})" if done
                        else "") + ".")
        self.draw_live()

    def run_live(self) -> str:
        model, gpus, zero, prec = (self.model.value, self.gpus.value, self.zero.value,
                                   self.precision.value)
        self.say(f"Training the toy at ZeRO-{zero} on {gpus} rank(s), one step…", "busy")
        rep = launch.run(RunConfig.from_dict(memory_config(model, gpus, zero, prec))).to_dict()
        mem = rep["ranks"][0]["memory"]
        self.runs[(model, gpus, prec, zero)] = {
            "theory": {**rep["theory"]["memory"], "activations": TOYS[model]["layers"]
                       * rep["theory"]["activations_per_layer"]["korthikanti"]},
            "measured": {**{c: mem[c] for c in rep["theory"]["memory"]},
                         "transient": mem["transient"], "activations": mem["activations_peak"]},
            "peak": mem["total_peak"]}
        self.draw_live()
        run = self.runs[(model, gpus, prec, zero)]
        same = all(run["measured"][c] == run["theory"][c] for c in rep["theory"]["memory"])
        return (f"ZeRO-{zero} measured on {gpus} rank(s): model states "
                + ("equal the formula to the byte" if same else "DIFFER from the formula"))

    def draw_live(self) -> None:
        model, gpus, prec = self.model.value, self.gpus.value, self.precision.value
        runs = {k: self.runs[(model, gpus, prec, k)] for k in STAGES
                if (model, gpus, prec, k) in self.runs}
        if not runs:
            self.show_live(None)
            return
        rows = [{"stage": f"ZeRO-{k}", "category": c, "source": src, "bytes": float(v)}
                for k, run in runs.items()
                for src, key in (("measured", "measured"), ("predicted", "theory"))
                for c, v in run[key].items()]
        self.show_live(viz.memory_measured_vs_theory(
            rows, [{"stage": f"ZeRO-{k}", "bytes": run["peak"]} for k, run in runs.items()],
            title=f"Rank 0's memory, measured (live run) vs predicted (theory): {model}, N = "
                  f"{gpus}, {prec}",
            subtitle=["measured: the run's meters (one step); predicted: the run report's theory "
                      "(model states exact, activations Korthikanti)",
                      "each stage appears once you press Run live at it; tick: measured peak of "
                      "all live bytes at once"]))


def memory_explorer(model: str = MODELS[0], gpus: int = 2, zero: int = 0,
                    precision: str = "bf16-mixed") -> MemoryExplorer:
    """memory_explorer(model="toy: 4 layers × d64", gpus=2, zero=0, precision="bf16-mixed")
    -> widget.

    Memory per GPU at ZeRO 0-3 by the formulas, redrawn at every move of the sliders for model
    size (toys and at_scale.PRESETS), ZeRO stage (highlighted) and ranks N. "Run live" trains a toy
    one step at the chosen stage on N ≤ 4 real ranks (launch.run) and draws rank 0's measured
    bytes beside the run's predicted ones; runs at other stages add their bars."""
    return MemoryExplorer(model, gpus, zero, precision)


# ---------------------------------------------------------------------------------------------
# lesson 05: the pipeline bubble
# ---------------------------------------------------------------------------------------------
SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "dualpipe"]
DUAL = ("dualpipe", "dualpipev")  # planned with their F&B pairs as one unit, as the report counts
PLAN_COSTS = {"F": 1.0, "B": 2.0}  # a backward costs about two forwards
PLAN_COSTS_SPLIT = {"F": 1.0, "B": 1.0, "W": 1.0}  # zero bubble: B + W = the unsplit backward
PIPE_MODEL = {"d_model": 64, "heads": 4, "seq": 32, "vocab": 128}  # one sequence per micro-batch
INTERLEAVED_V = 2


def plan(schedule: str, pp: int, m: int) -> tuple[S.Schedule, list[dict], float]:
    """The schedule built and replayed with unit costs (every rank its own device, transfers free)
    and the formula's bubble. Raises ValueError (ConfigError) for a setting the library refuses."""
    RunConfig.from_dict(pipeline_config(schedule, pp, m))  # the library's checks first, its words
    s = S.build_schedule(schedule, pp, m, INTERLEAVED_V if schedule == "interleaved" else 0)
    if schedule in DUAL:  # each F&B pair one unit (schedules.simulate, fused); a chunk's costs
        size = pp / s.stages  # in stages: 1 (dualpipe: whole stages), 1/2 (dualpipev's V)
        timed = S.simulate(s, lambda r, op: PLAN_COSTS_SPLIT[op.kind] * size, fused=True)
    else:
        timed = timelines.replay_ops(s, PLAN_COSTS_SPLIT if s.split_backward else PLAN_COSTS)
    return s, timed, theory.bubble_fraction(schedule, pp, m, s.virtual)


def pipeline_config(schedule: str, pp: int, m: int) -> dict:
    v = S.virtual_stages(schedule, INTERLEAVED_V if schedule == "interleaved" else 0)
    return {**PIPE_MODEL, "pp": pp, "microbatches": m, "batch": m, "schedule": schedule,
            "virtual_stages": v if schedule == "interleaved" else 0,  # dualpipe: its 2 chunks are
            "layers": S.pipeline_layers(pp, v // S.directions(schedule)),  # 2 copies of 1 stage
            "steps": trace.PIPELINE_STEPS}


class BubbleExplorer(Explorer):
    """A pipeline schedule planned (unit costs) and its bubble beside the formula; run live."""

    def __init__(self, pp: int = 4, m: int = 4, schedule: str = "1f1b"):
        self.pp = _labelled(W.IntSlider(pp, min=2, max=8, description="stages p"), "260px")
        self.m = _labelled(W.IntSlider(m, min=1, max=16, description="micro-batches m"), "300px")
        self.schedule = W.Dropdown(options=SCHEDULES, value=schedule, description="schedule")
        super().__init__([self.pp, self.m, self.schedule], outputs=2)
        self.bars: alt.TopLevelMixin | None = None
        self.planned: dict = {}  # schedule, timed, planned bubble, formula
        self.live: dict | None = None  # the last run: its settings and its report's bubble
        for w in (self.pp, self.m, self.schedule):
            w.observe(lambda _: self.redraw(), "value")
        self.redraw()

    def key(self) -> tuple:
        return self.schedule.value, self.pp.value, self.m.value

    def redraw(self) -> None:
        name, pp, m = self.key()
        try:
            s, timed, formula = plan(name, pp, m)
        except ValueError as err:
            self.planned, self.chart = {}, None
            self.show(None), self.show(None, 1)
            self.refresh_button()
            self.say(f"{name}, p = {pp}, m = {m} cannot run: {err}", "error")
            return
        planned = sum(S.idle_fractions(timed, pp)) / pp
        self.planned = {"schedule": s, "timed": timed, "planned": planned, "formula": formula}
        costs = "F = B = W = 1" if s.split_backward else "F = 1, B = 2"
        self.chart = viz.pipeline_timeline(
            timed, f"Planned (theory): {name}{f' (v = {s.virtual})' if s.virtual > 1 else ''}, "
                   f"p = {pp}, m = {m}",
            subtitle=[f"unit costs {costs}, every rank its own device, transfers free "
                      "(schedules.simulate); no run"
                      + ("; each F&B pair (an F, then a B of the rank's other chunk) one unit"
                         if name in DUAL else ""),
                      f"idle share {planned:.1%}; in flight at most: "
                      f"{', '.join(map(str, S.in_flight(s)))} on ranks 0…{pp - 1}"],
            seconds=False, width=560)
        self.show(self.chart)
        self.draw_bars()
        why = self.refresh_button()
        self.say(_sentence(why) if why else
                 f"Planned bubble {planned:.1%}, formula {formula:.1%}. Run live runs it on {pp} "
                 f"ranks ({trace.PIPELINE_STEPS} steps).")

    def why_not_live(self) -> str | None:
        name, pp, m = self.key()
        if not self.planned:
            return f"{name}, p = {pp}, m = {m} cannot run (see the message above the chart)"
        if pp > MAX_LIVE_RANKS:
            return (f"live runs take at most {MAX_LIVE_RANKS} ranks here and p = {pp}: the plan "
                    "only")
        return None

    def draw_bars(self) -> None:
        """Two groups of bars: the plan of the sliders' setting (planned, formula) and the last
        run's (measured on the wall clock, replayed, the report's formula)."""
        name, pp, m = self.key()
        rows = []
        if self.planned:
            group = f"planned: {name}, p {pp}, m {m}"
            rows += [{"schedule": group, "source": "planned (unit costs, theory)",
                      "bubble": self.planned["planned"]},
                     {"schedule": group, "source": timelines.LABELS["theory"],
                      "bubble": self.planned["formula"]}]
        if self.live:
            lname, lpp, lm = self.live["key"]
            group, b = f"run: {lname}, p {lpp}, m {lm}", self.live["bubble"]
            rows += [{"schedule": group, "source": timelines.LABELS["wall"],
                      "bubble": b["wall"]["overall"]},
                     {"schedule": group, "source": timelines.LABELS["replayed"],
                      "bubble": b["replayed"]["overall"]},
                     {"schedule": group, "source": timelines.LABELS["theory"], "bubble": b["theory"]}]
        self.bars = viz.bubble_bars(
            rows, title="Pipeline bubble: planned and formula"
                        + ("; the last run's, measured (wall clock) and replayed" if self.live
                           else ""),
            subtitle="the run's bubble: mean over its timed steps and ranks; its formula: the "
                     "report's (zero bubble: with the measured F, B, W times)"
        ).configure_legend(labelLimit=0)  # the replay's label in full
        self.show(self.bars, 1)

    def run_live(self) -> str:
        name, pp, m = self.key()
        self.say(f"Running {name} on {pp} ranks, {m} micro-batches, {trace.PIPELINE_STEPS} "
                 "steps…", "busy")
        rep = launch.run(RunConfig.from_dict(pipeline_config(name, pp, m)))
        b = trace.bubble(rep)
        step = b["steps"][0]
        self.live = {"key": self.key(), "bubble": b}
        self.show_live(viz.pipeline_timeline(
            timelines.wall_view(rep, step), f"{name}, p = {pp}, m = {m}: step {step} on the wall "
                                        "clock (measured)",
            subtitle=[f"bubble {b['wall']['per_step'][0]:.1%} this step; {b['wall']['placement']}",
                      "waits: a rank blocked on a neighbour's message"], width=560))
        self.draw_bars()
        return (f"{name} on {pp} ranks: bubble measured (wall clock) {b['wall']['overall']:.1%}, "
                f"replayed {b['replayed']['overall']:.1%}, formula {b['theory']:.1%}")


def bubble_explorer(pp: int = 4, m: int = 4, schedule: str = "1f1b") -> BubbleExplorer:
    """bubble_explorer(pp=4, m=4, schedule="1f1b") -> widget.

    Sliders for the stages p, the micro-batches m and the schedule (naive, gpipe, 1f1b,
    interleaved with v = 2, zb, zbv, dualpipev, dualpipe): the schedule planned at once with unit
    costs (schedules.simulate; DualPipe's F&B pairs one unit each, as the DeepSeek-V3 report
    counts them) and its idle share beside theory.bubble_fraction. "Run live" trains the
    toy with it on p ≤ 4 ranks (launch.run) and draws the step on the wall clock and the bubble
    measured (wall clock) and replayed, as the run's report labels them."""
    return BubbleExplorer(pp, m, schedule)


# ---------------------------------------------------------------------------------------------
# lesson 06: causal tiles under context parallel
# ---------------------------------------------------------------------------------------------
LAYOUTS = ["ring", "zigzag"]  # cp_impl; "ring" lays the sequence out in contiguous chunks
CP_MODEL = {"d_model": 64, "heads": 4, "vocab": 128, "batch": 2}


def planned_tiles(layout: str, c: int, rank: int) -> list[dict]:
    """The tiles rank `rank` meets in one ring forward, by the ring's rule (at step t it holds the
    K/V block of rank (rank - t) mod C; a tile is skipped when every key comes after every query,
    i.e. its key chunk is later than its query chunk): what a run's tile map should record."""
    out = []
    for t in range(c):
        src = (rank - t) % c
        for qc in chunks_of(layout, c, rank):
            for kc in chunks_of(layout, c, src):
                out.append({"ring_step": t, "from": src, "q_chunk": qc, "k_chunk": kc,
                            "computed": kc <= qc})
    return out


def planned_report(layout: str, c: int, seq: int) -> dict:
    """The planned tiles in the shape of a run report, for viz's tile map (drawn as theory)."""
    return {"config": {"cp": c, "seq": seq, "cp_impl": layout},
            "ranks": [{"rank": k, "coords": {"cp": k}, "comm": [],
                       "context": {"tiles": planned_tiles(layout, c, k)}} for k in range(c)]}


class TilesExplorer(Explorer):
    """Causal attention tiles per cp rank, planned (theory) at once, run live on a button."""

    def __init__(self, cp: int = 4, layout: str = "zigzag", seq: int = 64):
        self.cp = _labelled(W.IntSlider(cp, min=2, max=8, description="cp size C"), "260px")
        self.chunking = W.ToggleButtons(options=LAYOUTS, value=layout, description="layout",
                                      tooltips=["contiguous chunks", "chunks r and 2C−1−r"])
        self.seq = _labelled(W.SelectionSlider(options=[16, 32, 48, 64, 80, 96, 112, 128],
                                               value=seq, description="sequence s"), "300px")
        super().__init__([self.cp, self.chunking, self.seq], outputs=2, live_outputs=2)
        self.work_chart: alt.TopLevelMixin | None = None
        self.live_work_chart: alt.TopLevelMixin | None = None
        self.live: dict | None = None
        for w in (self.cp, self.chunking, self.seq):
            w.observe(lambda _: self.redraw(), "value")
        self.redraw()

    def key(self) -> tuple:
        return self.chunking.value, self.cp.value, self.seq.value

    def bad_setting(self) -> str | None:
        layout, c, seq = self.key()
        chunks = n_chunks(layout, c)
        if seq % chunks:
            fits = [s for s in self.seq.options if s % chunks == 0]
            cs = [k for k in range(self.cp.min, self.cp.max + 1) if seq % n_chunks(layout, k) == 0]
            return (f"s = {seq} does not split into {chunks} equal chunks ({layout}, C = {c}): "
                    f"choose s in {fits} or C in {cs}")
        return None

    def redraw(self) -> None:
        layout, c, seq = self.key()
        bad = self.bad_setting()
        if bad:
            self.chart = self.work_chart = None
            self.show(None), self.show(None, 1)
            self.refresh_button()
            self.say(bad, "error")
            return
        self.chart = viz.tile_map(
            planned_report(layout, c, seq),
            title=f"Causal attention tiles per rank, planned (theory, no run): {layout}, C = {c}",
            subtitle=[f"s = {seq}; at ring step t rank r holds the K/V block of rank (r − t) mod "
                      "C; label: that step; ×: fully masked, skipped",
                      "formula: contiguous, rank r computes r + 1 of C tiles; zigzag, every rank "
                      f"2C + 1 = {2 * c + 1} of 4C = {4 * c}"],
            panel=max(70, min(150, 640 // c)))
        self.work_chart = viz.cp_work_theory_bars(layout, c, seq)
        self.show(self.chart)
        self.show(self.work_chart, 1)
        why = self.refresh_button()
        self.say(_sentence(why) if why else
                 f"Planned. Run live runs one training step with C = {c} ranks ({layout}).")

    def why_not_live(self) -> str | None:
        c = self.cp.value
        if self.bad_setting():
            return self.bad_setting()
        if c > MAX_LIVE_RANKS:
            return f"live runs take at most {MAX_LIVE_RANKS} ranks here and C = {c}: theory only"
        return None

    def run_live(self) -> str:
        layout, c, seq = self.key()
        self.say(f"Running context parallel ({layout}) on {c} ranks, s = {seq}, one step…",
                 "busy")
        rep = launch.run(RunConfig(**CP_MODEL, cp=c, cp_impl=layout, seq=seq, layers=1,
                                   steps=1)).to_dict()
        recorded = {k: viz.tile_map_frame(rep).query("rank == @k")[
            ["ring_step", "from", "q_chunk", "k_chunk", "computed"]].to_dict("records")
            for k in range(c)}
        same = all(recorded[k] == planned_tiles(layout, c, k) for k in range(c))
        self.live = {"key": self.key(), "report": rep, "same_as_planned": same}
        self.show_live(viz.tile_map(rep, title=f"Tiles the ranks computed (measured, live run): "
                                               f"{layout}, C = {c}, s = {seq}",
                                    panel=max(70, min(150, 640 // c))))
        self.live_work_chart = viz.cp_work_bars({layout: rep})
        self.show_live(self.live_work_chart, 1)
        return (f"Live run on {c} ranks: the tiles recorded "
                + ("equal the plan, tile by tile" if same else "DIFFER from the plan"))


def tiles_explorer(cp: int = 4, layout: str = "zigzag", seq: int = 64) -> TilesExplorer:
    """tiles_explorer(cp=4, layout="zigzag", seq=64) -> widget.

    Sliders for the cp size C, the layout (ring: contiguous chunks; zigzag: chunks r and 2C−1−r)
    and the sequence length: each rank's causal tile map and its work as planned (theory), at
    once. "Run live" trains the toy one step with C ≤ 4 ranks (launch.run) and draws the tiles the
    ranks recorded and their work, measured beside the formula."""
    return TilesExplorer(cp, layout, seq)
