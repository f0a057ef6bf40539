"""The decision guide: four questions about a model and a cluster, and the rule that turns the
answers into a layout, the way practitioners choose one before any planner runs.

    from parallel_mini.course import guide
    rec = guide.recommend({"fits": "states_only", "long": "no", "moe": "no", "link": "fast"})
    rec.axes            # {"dp": True, "zero": (1, 2), "tp": False, "pp": False, ...}
    guide.follows(layout, rec)      # does a planner.Layout obey the rule?

The rule (each step is the answer to one question):
1. Does one GPU hold the model's states (weights, gradients, Adam's moments: 16 bytes per
   parameter in bf16 mixed precision, Rajbhandari et al., 2020)?  Yes: plain data parallel, every
   GPU a full replica (one gradient all-reduce per step). Only the weights and gradients: data
   parallel with the optimizer states (ZeRO-1) and gradients (ZeRO-2) sharded, the same traffic.
   Not even the weights: split the model itself, tensor parallel inside a node (its all-reduces
   sit on the critical path of every layer: they need NVLink), pipeline parallel across nodes
   (only the stage boundaries travel, point to point) or, on a fast network, ZeRO-3 / FSDP
   (parameters gathered layer by layer: 1.5x data parallel's traffic).
2. Long sequences (activations of one layer crowd the GPU)?  Context parallel: each GPU keeps a
   slice of every sequence, K/V blocks go round a ring (Liu et al., 2023, ring attention).
3. A mixture of experts?  Expert parallel: each GPU holds E/ep of the experts, tokens travel to
   them by all-to-all (Lepikhin et al., 2020, GShard).
4. A slow link between nodes (Ethernet rather than InfiniBand)?  Keep what talks often inside the
   node: tensor parallel never leaves it, pipeline parallel rather than ZeRO-3 across nodes (a
   stage boundary is far fewer bytes than the weights ZeRO-3 gathers every step).

`fact_answers` answers the questions from numbers (the model's states against the GPU's memory,
its sequence length, its experts, the link's bandwidth) so the page can say what the facts
suggest; the learner still answers. `toy_version` turns a recommendation into a layout of
parallel_mini's own GPT on a few local ranks, the planner's prediction for it and the RunConfig
that runs it (lesson 09 runs it live). Pure Python: no torch, no Streamlit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# question key -> (question, {answer key: answer text})
QUESTIONS: dict[str, tuple[str, dict[str, str]]] = {
    "fits": ("Do the model's states fit on one GPU?",
             {"yes": "yes: weights, gradients and optimizer states, with room for activations",
              "states_only": "only the weights and gradients: the optimizer states do not",
              "no": "no: not even the weights"}),
    "long": ("Are the sequences long (tens of thousands of tokens)?",
             {"no": "no", "yes": "yes: one layer's activations crowd the GPU"}),
    "moe": ("Is it a mixture of experts?",
            {"no": "no: a dense model", "yes": "yes: many expert MLPs behind a router"}),
    "link": ("How fast is the link between nodes?",
             {"fast": "fast: InfiniBand, tens of GB/s per GPU",
              "slow": "slow: Ethernet, a few GB/s per GPU"}),
}
DEFAULTS = {"fits": "yes", "long": "no", "moe": "no", "link": "fast"}
SLOW_LINK_BYTES_S = 20e9  # below this per GPU between nodes (100 Gb Ethernet: 12.5e9), slow
LONG_SEQUENCE = 32_768  # from this many tokens, the guide calls a sequence long
BYTES_PER_PARAM_STATES = 16  # bf16 weights and gradients, fp32 master copy and Adam's moments
BYTES_PER_PARAM_WEIGHTS_GRADS = 4  # bf16 weights and gradients


@dataclass(frozen=True)
class Recommendation:
    """What the guide says: which axes to use, the ZeRO stages it allows, and why (one line per
    answer). `tp`: tensor parallel inside a node; `pp`: pipeline stages across nodes."""
    tp: bool
    pp: bool
    cp: bool
    ep: bool
    zero: tuple[int, ...]
    reasons: list[str] = field(default_factory=list, compare=False)

    def describe(self) -> str:
        parts = [f"dp (ZeRO {'/'.join(map(str, self.zero))})"]
        split = " and ".join(name for name, on in (("tp inside a node", self.tp),
                                                   ("pp across nodes", self.pp)) if on)
        if split:
            parts.append(split + (" (or ZeRO-3 alone)" if 3 in self.zero else ""))
        parts += [name for name, on in (("cp", self.cp), ("ep", self.ep)) if on]
        return " + ".join(parts)


def check_answers(answers: dict) -> dict:
    """Every question answered with one of its answers (missing ones take DEFAULTS); a bad answer
    raises ValueError naming the question and the choices."""
    out = {**DEFAULTS, **answers}
    for key, value in out.items():
        if key not in QUESTIONS:
            raise ValueError(f"{key!r}: not a question of the guide; choose from "
                             f"{', '.join(QUESTIONS)}")
        if value not in QUESTIONS[key][1]:
            raise ValueError(f"{key} = {value!r}: choose one of {', '.join(QUESTIONS[key][1])}")
    return out


def recommend(answers: dict) -> Recommendation:
    """The guide's rule: answers (QUESTIONS' keys) -> the axes of a layout, with a reason each."""
    a = check_answers(answers)
    slow = a["link"] == "slow"
    reasons = []
    tp = pp = False
    if a["fits"] == "yes":
        zero = (0,)
        reasons.append("The states fit: plain data parallel, a full replica on every GPU and one "
                       "gradient all-reduce per step.")
    elif a["fits"] == "states_only":
        zero = (1, 2)
        reasons.append("Only the optimizer states are too many: data parallel with them (ZeRO-1) "
                       "and the gradients (ZeRO-2) sharded; the traffic stays a data-parallel "
                       "all-reduce's.")
    else:
        tp, pp = True, True
        zero = (0, 1) if slow else (0, 1, 2, 3)
        reasons.append("Not even the weights fit: split the model. Tensor parallel inside a node "
                       "(an all-reduce in every layer needs the node's fast link), pipeline "
                       "parallel across nodes (only stage boundaries travel)"
                       + ("." if slow else ", or ZeRO-3 / FSDP over a fast network."))
    cp = a["long"] == "yes"
    reasons.append("Long sequences: context parallel splits every sequence over GPUs (ring "
                   "attention)." if cp else "Short sequences: no context parallel.")
    ep = a["moe"] == "yes"
    reasons.append("Mixture of experts: expert parallel, each GPU holds a share of the experts "
                   "and tokens travel to them by all-to-all." if ep else
                   "A dense model: no expert parallel.")
    if slow:
        reasons.append("A slow link between nodes: tensor parallel stays inside the node and "
                       "pipeline stages rather than ZeRO-3 cross it (a stage boundary is far "
                       "fewer bytes than the weights ZeRO-3 gathers every step).")
    else:
        reasons.append("A fast link between nodes: data-parallel traffic hides behind compute.")
    return Recommendation(tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, reasons=reasons)


def departures(layout, rec: Recommendation) -> list[str]:
    """The guide's choices a planner Layout departs from (none: it follows the guide). An axis the
    guide does not call for stays at 1, one it calls for is used; a model the guide splits is
    split by tp or pp (or, where the guide allows ZeRO-3, by ZeRO-3 alone); the ZeRO stage is one
    the guide allows (any, when nothing shards: dp x cp = 1)."""
    out = []
    if (layout.cp > 1) != rec.cp:
        out.append("context parallel" if rec.cp else "no context parallel")
    if (layout.ep > 1) != rec.ep:
        out.append("expert parallel" if rec.ep else "no expert parallel")
    split = layout.tp > 1 or layout.pp > 1
    if rec.tp or rec.pp:
        if not (split or (layout.zero == 3 and 3 in rec.zero)):
            out.append("the model split (tp or pp)")
    elif split:
        out.append("no tensor or pipeline parallel")
    if layout.zero not in rec.zero and layout.dp * layout.cp > 1:
        out.append(f"ZeRO {'/'.join(map(str, rec.zero))}")
    return out


def follows(layout, rec: Recommendation) -> bool:
    """Does a planner Layout obey the recommendation (no departures)?"""
    return not departures(layout, rec)


def first_following(ranked: list, rec: Recommendation):
    """(rank from 1, layout, prediction) of the best-ranked layout that follows the guide, or
    None. `ranked`: planner.plan(...)["all"], (Layout, prediction) pairs best first."""
    for i, (lay, p) in enumerate(ranked):
        if follows(lay, rec):
            return i + 1, lay, p
    return None


def closest(ranked: list, rec: Recommendation):
    """(rank from 1, layout, prediction, departures) of the best-ranked layout among those with
    the fewest departures from the guide, or None when `ranked` is empty."""
    best = None
    for i, (lay, p) in enumerate(ranked):
        d = departures(lay, rec)
        if best is None or len(d) < len(best[3]):
            best = (i + 1, lay, p, d)
            if not d:
                break
    return best


def fact_answers(params: int, gpu_bytes: float, seq: int, experts: int,
                 inter_node_bytes_s: float) -> dict:
    """What the numbers suggest for each question (the learner still answers): states at 16 bytes
    per parameter (weights and gradients 4) against one GPU's memory; a sequence of
    LONG_SEQUENCE tokens or more is long; any routed expert is a mixture of experts; a link under
    SLOW_LINK_BYTES_S per GPU is slow."""
    if params * BYTES_PER_PARAM_STATES <= gpu_bytes:
        fits = "yes"
    elif params * BYTES_PER_PARAM_WEIGHTS_GRADS <= gpu_bytes:
        fits = "states_only"
    else:
        fits = "no"
    return {"fits": fits, "long": "yes" if seq >= LONG_SEQUENCE else "no",
            "moe": "yes" if experts else "no",
            "link": "slow" if inter_node_bytes_s < SLOW_LINK_BYTES_S else "fast"}


# ---------------------------------------------------------------------------------------------
# the toy version: a recommendation on parallel_mini's GPT, small enough to run here
# ---------------------------------------------------------------------------------------------
TOY_MODEL = {"layers": 4, "d_model": 64, "heads": 4, "seq": 32, "vocab": 128, "batch": 8}
TOY_EXPERTS = {"experts": 4, "top_k": 2}  # the toy's MoE layers, when the guide calls for ep
TOY_STEPS = 4  # steps 1 and 2 timed (planner.measured_step_s: not the first, not the metered last)
TOY_STATES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class ToyVersion:
    """The toy layout closest to a recommendation: `place` among the toy's fitting layouts as the
    planner ranks them on this machine's profile ("cpu": assumed rates, so the place depends on
    the cores), the guide's choices it lacks (`departures`, none when it follows the guide), the
    planner's `prediction` for it (theory) and the RunConfig that runs it."""
    place: int
    layout: object  # planner.Layout
    departures: list
    prediction: dict
    config: object  # config.RunConfig

    def memory_rows(self, ranks: list[dict]) -> list[dict]:
        """{rank, source, category, bytes} for viz.plan.toy_memory: each rank's measured model
        states and activation peak (a run report's `ranks`) beside the planner's prediction for
        its pipeline stage."""
        rows = []
        for r in ranks:
            want = self.prediction["memory_per_rank"][r["coords"]["pp"]]
            for category, measured_key in [(k, k) for k in TOY_STATES] + [("activations",
                                                                          "activations_peak")]:
                rows.append({"rank": r["rank"], "source": "measured", "category": category,
                             "bytes": r["memory"][measured_key]})
                rows.append({"rank": r["rank"], "source": "theory", "category": category,
                             "bytes": want[category]})
        return rows

    def states_equal(self, ranks: list[dict]) -> int:
        """How many ranks measured params, grads and optimizer bytes equal to the prediction."""
        return sum(all(r["memory"][k] == self.prediction["memory_per_rank"][r["coords"]["pp"]][k]
                       for k in TOY_STATES) for r in ranks)


def toy_version(rec: Recommendation, ranks: int, steps: int = TOY_STEPS,
                model: dict | None = None, reference: bool = True) -> ToyVersion:
    """The toy GPT (TOY_MODEL, with TOY_EXPERTS when the guide calls for expert parallel) on
    `ranks` local ranks: every layout the planner finds runnable here, ranked on this machine's
    profile, then the best-ranked of those closest to `rec` (guide.closest). Its RunConfig trains
    `steps` steps, with the single-process reference unless `reference` is False."""
    from . import planner
    from ..config import RunConfig

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks = {ranks!r}: give a whole number of local ranks, 1 or more")
    shape = {**TOY_MODEL, **(model or {}), **(TOY_EXPERTS if rec.ep else {})}
    spec = planner.toy_model(**shape)
    ranked = planner.plan(spec, ranks, planner.hardware("cpu"), spec.global_batch, top=0)["all"]
    found = closest(ranked, rec)
    if found is None:
        raise ValueError(f"no layout of the toy GPT fits on {ranks} local ranks; try 2, 4 or 8")
    place, lay, prediction, departures = found
    cfg = planner.run_config(spec, lay, spec.global_batch, steps=steps)
    cfg = RunConfig(**{**cfg.to_dict(), "reference": reference})
    return ToyVersion(place, lay, departures, prediction, cfg)
