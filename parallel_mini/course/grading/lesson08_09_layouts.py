"""Lessons 08 (08_putting_it_together) and 09 (09_choosing_a_layout): model states per rank of a
composed layout, `check_states_per_rank`; a layout that fits a budget, `check_layout_choice`.
"""
from __future__ import annotations

import os
import random

from ... import theory
from ...config import RunConfig
from .core import _CodeSwapped, Grade, _call_in_time, _library_copy


# Both exercises are about prediction, so the library functions that would answer them are
# disabled while the learner's code runs: theory's per-rank model (run_theory and the pieces it
# is built from), the planner, and live runs (launch.run). Each raises an AssertionError naming
# itself; the checker computes its own expectations before and after, never during.
_STATE_KEYS = ("params", "grads", "optimizer")


def _refusal(qualified: str, advice: str):
    """A function with no closure whose body raises a literal message: its code object can be
    swapped into any library function (the code runs with that module's globals)."""
    message = (f"your code called the library's own {qualified}, which the checker disables "
               f"while your code runs: {advice}")
    ns: dict = {}
    exec(f"def refused(*args, **kwargs):\n    raise AssertionError({message!r})\n", ns)
    return ns["refused"]


class _LibraryFunctionsDisabled(_CodeSwapped):
    """While active, each (module, name) raises (its code object swapped for a refusal), so an
    answer calling it, by whatever name it was imported under, is refused. Restored on exit."""

    def __init__(self, targets, advice: str):
        self.targets, self.advice = targets, advice

    def swaps(self):
        import importlib
        out = []
        for module, name in self.targets:
            fn = getattr(importlib.import_module(f"parallel_mini.{module}"), name)
            fn = getattr(fn, "__wrapped__", fn)  # functools wrappers: the function inside
            out.append((fn, _refusal(f"{module.split('.')[-1]}.{name}", self.advice)))
        return out


_PER_RANK_THEORY = (("theory", "run_theory"), ("theory", "_rank_theory"),
                    ("theory", "_pipeline_theory"), ("theory", "model_state_bytes"),
                    ("theory", "gpt_unit_sizes"), ("theory", "gpt_local_param_count"),
                    ("theory", "pipeline_stage_units"))
_PLANNER = tuple(("course.planner", name) for name in (
    "plan", "predict", "stage_states", "validate_on_toy_runs", "enumerate_layouts"))
_LIVE = (("runtime.launch", "run"),)
# the checker's own rules, reachable from the learner's code as any module is: disabled too
_RULES = tuple(("course.grading.lesson08_09_layouts", name) for name in (
    "_states_rule", "_states_from_theory", "planned_states"))


# -- lesson 08: states_per_rank(cfg) -> {rank: {params, grads, optimizer}} --------------------
STATES_CASES = (  # in this process, against theory; (what the case is about, RunConfig fields)
    ("dp2 x tp2 x pp2", dict(dp=2, tp=2, pp=2, layers=2)),
    ("tp2 x pp2, 4 layers", dict(tp=2, pp=2, layers=4)),
    ("pp4 x dp2 ZeRO-1 (middle stages)", dict(dp=2, pp=4, layers=4, zero=1)),
    ("dp2 x pp2 ZeRO-2", dict(dp=2, pp=2, layers=2, zero=2)),
    ("dp2 x cp2 x tp2 ZeRO-1", dict(dp=2, cp=2, tp=2, layers=2, zero=1)),
    ("dp2 x cp2 x tp2 x pp2 ZeRO-1", dict(dp=2, cp=2, tp=2, pp=2, layers=2, zero=1)),
    ("dp3 ZeRO-1 (padding)", dict(dp=3, layers=2, zero=1, batch=6)),
    ("dp3 x tp2 ZeRO-2 (padding)", dict(dp=3, tp=2, layers=2, zero=2, batch=6)),
)
# live: lesson 08's 4-D layout on 16 ranks, at its tiny sizes (16 processes train in seconds)
STATES_LIVE = dict(dp=2, cp=2, tp=2, pp=2, zero=1, layers=2, d_model=32, heads=2, seq=16,
                   vocab=64, batch=4, microbatches=2, steps=1)
_STATES_STUB = ("states_per_rank still raises NotImplementedError: write it, then run this cell "
                "again.")


def _states_rule(cfg, whole: bool = False, tp_splits_all: bool = False, even: bool = False,
                 pp_fastest: bool = False, pad: bool = True, grads_as: int | None = None,
                 shard_cp: bool = True, optimizer_sharded: bool = True) -> dict:
    """Model-state bytes per rank (fp32, Adam), written out here (theory's functions are
    disabled while a learner's code runs); the keyword arguments are the usual mistakes, for
    naming them. Per pipeline stage, on one tensor-parallel rank: L/pp blocks of (12h^2 + 7h)/t +
    6h (the matrices and column-parallel biases split, LayerNorms and row-parallel biases
    whole), the first stage adds v*h/t + s*h (token table split, positions whole), the last
    2h + h*v/t (final LayerNorm, LM head split). ZeRO-1: optimizer states / N; ZeRO-2: gradients
    too, N = dp x cp, the stage's parameters padded to a multiple of N."""
    h, v, s, L = cfg.d_model, cfg.vocab, cfg.seq, cfg.layers
    t = 1 if whole else cfg.tp
    pp = 1 if whole else cfg.pp
    if tp_splits_all:
        block, embed, head = (12 * h * h + 13 * h) // t, (v * h + s * h) // t, (2 * h + h * v) // t
    else:
        block, embed, head = (12 * h * h + 7 * h) // t + 6 * h, v * h // t + s * h, 2 * h + h * v // t
    per = L // pp
    stages = [per * block + (r == 0) * embed + (r == pp - 1) * head for r in range(pp)]
    if even:
        stages = [sum(stages) // pp] * pp
    n = cfg.dp * (cfg.cp if shard_cp else 1)
    out = {}
    for rank in range(cfg.world_size):
        stage = 0 if whole else (rank % cfg.pp if pp_fastest else rank // (cfg.world_size // cfg.pp))
        count = stages[stage]
        if cfg.zero == 0:
            out[rank] = {"params": 4 * count, "grads": 4 * count, "optimizer": 8 * count}
            continue
        padded = -(-count // n) * n if pad else count
        sharded_grads = (grads_as or cfg.zero) >= 2
        out[rank] = {"params": 4 * padded,
                     "grads": 4 * padded // n if sharded_grads else 4 * padded,
                     "optimizer": 8 * padded // n if optimizer_sharded else 8 * padded}
    return out


_STATES_MISTAKES = (
    (dict(whole=True), "every rank holds the whole model: tensor parallel keeps 1/tp of each "
     "weight matrix on a rank, and a pipeline rank keeps only its stage's layers"),
    (dict(tp_splits_all=True), "tensor parallel does not split everything: the LayerNorms, the "
     "row-parallel layers' biases and the position table stay whole on every tp rank (per block "
     "(12h^2 + 7h)/t + 6h)"),
    (dict(even=True), "the stages are not equal: the first one also holds the embeddings "
     "(v*h/t + s*h), the last one the final LayerNorm and the LM head (2h + h*v/t)"),
    (dict(pp_fastest=True), "your ranks sit on the wrong pipeline stages: the mesh puts pp "
     "outermost and tp fastest, so rank r is on stage r // (world / pp), not r % pp"),
    (dict(pad=False), "ZeRO pads the stage's flat parameter buffer to a multiple of N = dp x cp "
     "before it cuts N equal shards, and every rank keeps the padded size in params"),
    (dict(shard_cp=False), "ZeRO shards over dp x cp, not over dp alone: the context-parallel "
     "ranks hold the same weights too"),
    (dict(optimizer_sharded=False), "with ZeRO the optimizer states are sharded: 8 bytes per "
     "parameter / N on each rank"),
)


def _states_answer(got, cfg, where: str) -> dict:
    """The learner's return value, checked for shape: {rank: {params, grads, optimizer}} with
    whole numbers, for every rank of the layout."""
    if not isinstance(got, dict):
        raise AssertionError(f"{where}: states_per_rank returned {type(got).__name__}, not a dict "
                             f"{{rank: {{'params': bytes, 'grads': bytes, 'optimizer': bytes}}}}")
    ranks = sorted(got, key=str)
    if set(got) != set(range(cfg.world_size)):
        raise AssertionError(f"{where}: states_per_rank must have one entry per rank, 0 to "
                             f"{cfg.world_size - 1} (world = dp*tp*pp*cp = {cfg.world_size}); "
                             f"yours has {ranks}")
    for rank, row in got.items():
        if not isinstance(row, dict) or set(row) != set(_STATE_KEYS):
            raise AssertionError(f"{where}: rank {rank}'s entry must be a dict with exactly the "
                                 f"keys {list(_STATE_KEYS)}; yours is {row!r}")
        for k, b in row.items():
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not float(b).is_integer():
                raise AssertionError(f"{where}: rank {rank}'s {k} is {b!r}: bytes are a whole "
                                     f"number (padding makes every division exact)")
    return {r: {k: int(got[r][k]) for k in _STATE_KEYS} for r in got}


def _states_from_theory(cfg) -> dict:
    """The library's prediction, per rank (theory.run_theory: stage entries under pp)."""
    th = theory.run_theory(cfg, theory.gpt_param_count(cfg.vocab, cfg.seq, cfg.d_model, cfg.layers))
    stages = th.get("stages")
    per_stage = cfg.world_size // cfg.pp
    return {r: {k: (stages[r // per_stage] if stages else th)["memory"][k] for k in _STATE_KEYS}
            for r in range(cfg.world_size)}


def _states_diagnosis(got: dict, want: dict, cfg, where: str) -> None:
    if got == want:
        return
    for kw, why in _STATES_MISTAKES:
        wrong = _states_rule(cfg, **kw)
        if wrong != want and got == wrong:
            raise AssertionError(f"{where}: {why}")
    r = min(r for r in want if got[r] != want[r])
    k = next(k for k in _STATE_KEYS if got[r][k] != want[r][k])
    hint = ""
    if cfg.zero == 1 and got[r]["grads"] * cfg.dp * cfg.cp == want[r]["grads"]:
        hint = " (ZeRO-1 shards only the optimizer states; the gradients stay whole until ZeRO-2)"
    elif cfg.zero == 2 and got[r]["grads"] == want[r]["grads"] * cfg.dp * cfg.cp:
        hint = " (ZeRO-2 shards the gradients too)"
    raise AssertionError(f"{where}: rank {r}'s {k} should be {want[r][k]:,} bytes, yours says "
                         f"{got[r][k]:,}{hint}")


def _fresh_states_cases(k: int = 2) -> list:
    """`k` layouts drawn anew every check (dp, cp, tp, pp, ZeRO and the model's width and depth),
    beyond the lesson's: no table of answers can stand in for the rule."""
    rng = random.Random(os.urandom(8))
    out = []
    while len(out) < k:
        dp, cp, tp, pp = (rng.choice(c) for c in ((1, 2, 3, 4), (1, 2), (1, 2, 4), (1, 2, 4)))
        fields = dict(dp=dp, cp=cp, tp=tp, pp=pp, zero=rng.choice((0, 1, 2)) if dp * cp > 1 else 0,
                      layers=pp * rng.randint(1, 3), d_model=16 * rng.randint(2, 6), heads=4,
                      seq=8 * rng.randint(2, 8), vocab=4 * rng.randint(8, 40),
                      batch=dp * rng.randint(1, 2) * 2, microbatches=2 if pp > 1 else 1)
        try:
            cfg = RunConfig(**fields).validate()
        except (ValueError, AssertionError, SystemExit):
            continue
        out.append((f"drawn for this check: {_layout_name(cfg)} (h={cfg.d_model}, "
                    f"L={cfg.layers}, v={cfg.vocab}, s={cfg.seq})", fields))
    return out


def _layout_name(cfg) -> str:
    """e.g. "dp2 x tp2 x pp2 ZeRO-1": the degrees above 1 (dp1 when nothing is split)."""
    axes = [f"{a}{getattr(cfg, a)}" for a in ("dp", "cp", "tp", "pp") if getattr(cfg, a) > 1]
    return " x ".join(axes or ["dp1"]) + (f" ZeRO-{cfg.zero}" if cfg.zero else "")


def check_states_per_rank(fn, cases=STATES_CASES, live=STATES_LIVE, fresh: int = 2) -> Grade:
    """`fn(cfg) -> {rank: {"params": B, "grads": B, "optimizer": B}}` must predict every rank's
    model-state bytes (fp32, Adam) for a RunConfig composed of dp, tp, pp, cp and ZeRO 0-2.

    First in this process, for each of `cases`, against theory.run_theory (the library's
    prediction), naming the usual mistakes (whole model on every rank, tensor parallel splitting
    LayerNorms too, equal stages, ranks on the wrong stage, ZeRO's padding, its shard group,
    which states each stage shards). Then one live run (`live`, 16 ranks): every rank's measured
    params/grads/optimizer bytes must equal the learner's prediction, to the byte. Throughout,
    theory's per-rank model, the planner, launch.run and this checker's own rules are disabled
    while `fn` runs, and the expected answer is computed only after `fn` has returned (no frame
    holds it meanwhile). `fresh` more layouts, drawn anew every check, are graded the same way;
    a call of `fn` that does not return within 10 s stops the check with a message; a function
    that is the library's (its code object, bytecode or source) is refused."""
    from ...runtime.launch import run

    _library_copy(fn, ("theory", "course.planner", "course.grading.lesson08_09_layouts"), "your")
    advice = ("count the parameters of each stage on one tensor-parallel rank yourself, then "
              "apply the 16 bytes (and ZeRO's division) to them")
    targets = _PER_RANK_THEORY + _PLANNER + _LIVE + _RULES
    for name, fields in list(cases) + _fresh_states_cases(fresh):
        cfg = RunConfig(**fields).validate()
        with _LibraryFunctionsDisabled(targets, advice):
            try:
                got = _call_in_time(fn, cfg, what=f"at {name}: your states_per_rank")
            except NotImplementedError:
                return Grade("not attempted", _STATES_STUB)
        got = _states_answer(got, cfg, f"at {name}")
        want = _states_from_theory(cfg)  # only now: no frame held it while fn ran
        _states_diagnosis(got, want, cfg, f"at {name}")
    cfg = RunConfig(**live).validate()
    with _LibraryFunctionsDisabled(targets, advice):
        predicted = _call_in_time(fn, cfg, what=f"live at {_layout_name(cfg)}: your "
                                                f"states_per_rank")
    where = f"live at {_layout_name(cfg)}"
    predicted = _states_answer(predicted, cfg, where)
    report = run(cfg)
    for rank in report.ranks:
        measured = {k: rank["memory"][k] for k in _STATE_KEYS}
        if measured != predicted[rank["rank"]]:
            k = next(k for k in _STATE_KEYS if measured[k] != predicted[rank["rank"]][k])
            raise AssertionError(f"{where}: rank {rank['rank']} measured {measured[k]:,} bytes "
                                 f"of {k}, you predicted {predicted[rank['rank']][k]:,}")
    total = sum(sum(m.values()) for m in predicted.values())
    return Grade("correct", f"your states_per_rank equals the library's theory on "
                 f"{len(cases)} layouts (" + ", ".join(n for n, _ in cases) + f") and {fresh} "
                 f"drawn for this check, and what every rank of a live {_layout_name(cfg)} run "
                 f"measured, to the byte ({total:,} bytes of model states over "
                 f"{cfg.world_size} ranks); theory's per-rank model, the planner and launch.run "
                 f"disabled while yours ran",
                 {"config": cfg.to_dict(), "report": report, "predicted": predicted})


# -- lesson 09: choose_layout(budget) -> {dp, tp, pp, zero} or None -----------------------------
# The toy GPT on LAYOUT_RANKS ranks, fp32 with Adam; the budget is model-state bytes per rank
# (params + grads + optimizer: what the planner's memory model and the run's meters agree on to
# the byte). The rule the lesson teaches: as much data parallel as fits, with the ZeRO stage (0-2)
# that makes it fit (ZeRO-3 fits first whenever anything does: the question here is when to split
# the model instead); tp or pp for what is left, either. None when nothing fits.
LAYOUT_RANKS = 4
LAYOUT_MODEL = dict(layers=4, d_model=64, heads=4, seq=32, vocab=128, batch=8)
LAYOUT_BUDGETS = (4_000_000, 2_500_000, 1_600_000, 1_400_000, 1_105_000, 1_000_000, 910_000,
                  800_000)
LAYOUT_LIVE_BUDGETS = (1_105_000, 910_000)
_LAYOUT_KEYS = ("dp", "tp", "pp", "zero")
_LAYOUT_STUB = ("choose_layout still raises NotImplementedError: write it, then run this cell "
                "again.")


def layout_candidates(ranks: int = LAYOUT_RANKS, model: dict | None = None) -> list[dict]:
    """Every {dp, tp, pp, zero} of `ranks` ranks the exercise considers: dp x tp x pp = ranks,
    tp dividing the heads and the vocabulary, pp at most the layers, ZeRO 0-2 (0 alone at dp 1)."""
    m = {**LAYOUT_MODEL, **(model or {})}
    out = []
    for dp in range(1, ranks + 1):
        for tp in range(1, ranks // dp + 1):
            if ranks % (dp * tp) or m["heads"] % tp or m["vocab"] % tp:
                continue
            pp = ranks // (dp * tp)
            if pp > m["layers"] or m["layers"] % pp or m["batch"] % dp:
                continue
            for zero in ((0, 1, 2) if dp > 1 else (0,)):
                out.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero})
    return out


def layout_config(layout: dict, model: dict | None = None, steps: int = 1) -> RunConfig:
    """The RunConfig of a layout on the toy (pipelines: 1F1B, 2 micro-batches per step)."""
    return RunConfig(**{**LAYOUT_MODEL, **(model or {})}, **layout, steps=steps,
                     microbatches=2 if layout["pp"] > 1 else 4, schedule="1f1b")


def planned_states(layout: dict, model: dict | None = None) -> list[int]:
    """The planner's memory model: model-state bytes (params + grads + optimizer) of each
    pipeline rank of `layout` on the toy, fp32 with Adam (planner.predict; theory, no run)."""
    from .. import planner

    m = {**LAYOUT_MODEL, **(model or {})}
    spec = planner.toy_model(**m)
    pp = layout["pp"]
    lay = planner.Layout(layout["dp"], layout["tp"], pp, 1, 1, layout["zero"],
                         "1f1b" if pp > 1 else "-", 1, 2 if pp > 1 else 1,
                         m["batch"] // layout["dp"] // (2 if pp > 1 else 1), "none", False)
    p = planner.predict(spec, lay, planner.hardware("cpu"), m["batch"], precision="fp32")
    return [sum(mem[k] for k in _STATE_KEYS) for mem in p["memory_per_rank"]]


def _layout_text(layout: dict | None) -> str:
    if layout is None:
        return "None"
    return f"dp{layout['dp']} tp{layout['tp']} pp{layout['pp']} ZeRO-{layout['zero']}"


def _layout_answer(got, budget: int, ranks: int, model: dict) -> dict | None:
    where = f"budget {budget:,} bytes"
    if got is None:
        return None
    if not isinstance(got, dict) or set(got) != set(_LAYOUT_KEYS):
        raise AssertionError(f"{where}: choose_layout must return a dict with exactly the keys "
                             f"{list(_LAYOUT_KEYS)} (or None when nothing fits); yours returned "
                             f"{got!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got.values()):
        raise AssertionError(f"{where}: every degree is a whole number; yours returned {got!r}")
    if got["dp"] * got["tp"] * got["pp"] != ranks:
        raise AssertionError(f"{where}: {_layout_text(got)} uses dp*tp*pp = "
                             f"{got['dp'] * got['tp'] * got['pp']} ranks; the job has {ranks}")
    if got["zero"] == 3:
        raise AssertionError(f"{where}: ZeRO-3 is outside this exercise (0, 1 or 2): it would fit "
                             f"first at every budget where anything fits, and the question here "
                             f"is when to split the model instead")
    if got not in layout_candidates(ranks, model):
        raise AssertionError(f"{where}: {_layout_text(got)} is not a layout of this model: tp must "
                             f"divide the {model['heads']} heads, pp the {model['layers']} layers, "
                             f"and ZeRO needs dp > 1 (stages 0-2)")
    return dict(got)


def _layout_diagnosis(got: dict | None, budget: int, table: list) -> None:
    """`table`: (layout, planned states per pipeline rank) for every candidate."""
    where = f"budget {budget:,} bytes"
    fits = [(lay, st) for lay, st in table if max(st) <= budget]
    if got is None:
        if fits:
            lay, st = max(fits, key=lambda f: f[0]["dp"])
            raise AssertionError(f"{where}: something fits, e.g. {_layout_text(lay)} "
                                 f"({max(st):,} bytes of model states on its fullest rank)")
        return
    states = next(st for lay, st in table if lay == got)
    if max(states) > budget:
        worst = states.index(max(states))
        stage = f" (pipeline stage {worst}, the one with the embeddings)" if got["pp"] > 1 and \
            worst == 0 else (f" (pipeline stage {worst})" if got["pp"] > 1 else "")
        raise AssertionError(f"{where}: {_layout_text(got)} does not fit: its fullest rank"
                             f"{stage} holds {max(states):,} bytes of model states")
    best_dp = max(lay["dp"] for lay, _ in fits)
    if got["dp"] < best_dp:
        lay, st = next((lay, st) for lay, st in fits if lay["dp"] == best_dp)
        raise AssertionError(f"{where}: {_layout_text(lay)} fits too ({max(st):,} bytes): keep "
                             f"as much data parallel as fits, and split the model only when "
                             f"ZeRO is not enough")


def check_layout_choice(fn, budgets=LAYOUT_BUDGETS, live=LAYOUT_LIVE_BUDGETS,
                        ranks: int = LAYOUT_RANKS, model: dict | None = None,
                        fresh: int = 4) -> Grade:
    """`fn(budget_bytes) -> {"dp", "tp", "pp", "zero"}` (or None) must pick, for the toy GPT on
    `ranks` ranks (fp32, Adam), a layout whose model states fit `budget_bytes` on every rank:
    the largest dp that fits (with any ZeRO stage 0-2 that makes it fit), tp and pp for the
    rest, either; None when nothing fits.

    Each budget is graded with the planner's memory model (planner.predict, per pipeline rank),
    naming the mistake (does not fit, and on which pipeline stage; a larger dp fits too;
    something fits where None was returned). Then the answers for the `live` budgets run on
    real ranks: every rank's measured params + grads + optimizer bytes must be within the budget
    and equal the planner's prediction. The planner, launch.run and this checker's own rules are
    disabled while `fn` runs, and the planner's table is computed only after every answer is in
    (no frame holds it meanwhile). `fresh` more budgets, drawn anew every check between the
    smallest and the largest layout's states, are graded the same way (the [correct] message
    does not list the answers); a call of `fn` that does not return within 10 s stops the check
    with a message; a function that is the library's (code object, bytecode, source) is refused."""
    from ...runtime.launch import run

    _library_copy(fn, ("course.planner", "course.grading.lesson08_09_layouts"), "your")
    m = {**LAYOUT_MODEL, **(model or {})}
    advice = ("work out the model states per rank of each candidate layout yourself (theory's "
              "formulas are allowed, as in lesson 08), then apply the rule")
    rng = random.Random(os.urandom(8))
    drawn = [rng.randint(600_000, 4_500_000) for _ in range(fresh)]
    answers = {}  # the lesson's budgets first, then the drawn ones
    for budget in list(budgets) + drawn:
        with _LibraryFunctionsDisabled(_PLANNER + _LIVE + _RULES, advice):
            try:
                got = _call_in_time(fn, budget, what=f"budget {budget:,} bytes: your "
                                                     f"choose_layout")
            except NotImplementedError:
                return Grade("not attempted", _LAYOUT_STUB)
        answers[budget] = _layout_answer(got, budget, ranks, m)
    # only now, every answer in: the planner's states of every candidate
    table = [(lay, planned_states(lay, m)) for lay in layout_candidates(ranks, m)]
    for budget, got in answers.items():
        _layout_diagnosis(got, budget, table)
    runs = []
    for budget in live:
        layout = answers.get(budget)
        if layout is None:
            continue
        report = run(layout_config(layout, m))
        planned = next(st for lay, st in table if lay == layout)
        for rank in report.ranks:
            measured = sum(rank["memory"][k] for k in _STATE_KEYS)
            want = planned[rank["coords"]["pp"]]
            if measured != want or measured > budget:
                raise AssertionError(f"live at {_layout_text(layout)}: rank {rank['rank']} "
                                     f"measured {measured:,} bytes of model states; the planner "
                                     f"predicts {want:,}, the budget is {budget:,}")
        runs.append({"budget": budget, "layout": layout, "report": report,
                     "measured_max": max(sum(r["memory"][k] for k in _STATE_KEYS)
                                         for r in report.ranks)})
    return Grade("correct", f"your choose_layout picks, for each of the {len(budgets)} budgets "
                 f"and {fresh} more drawn for this check, the layout the rule asks for by the "
                 f"planner's memory model (theory); live runs of "
                 + ", ".join(_layout_text(r["layout"]) for r in runs) + " measured every "
                 f"rank's model states equal to the planner's prediction and within budget; the "
                 f"planner and launch.run disabled while yours ran",
                 {"answers": {b: answers[b] for b in budgets}, "runs": runs, "table": table,
                  "drawn": {b: answers[b] for b in drawn}})
