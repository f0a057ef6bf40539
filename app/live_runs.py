"""What every page needs to run ranks live: cached runs, a status box, errors without tracebacks.

Pages run nothing on a rank themselves: they configure a run, call the library through the cached
wrappers here (engine.run, collectives.ring_experiment, experiments.tp_mlp_shards), and draw.

Results are cached per configuration (st.cache_data, shared by everyone watching the app) and the
last result of each page is kept in the session, so moving a slider never starts ranks by itself:
only "Run live" does. "Fresh measurement" bypasses the cache for timings that should be re-taken.
"""
from __future__ import annotations

import json
import time

import streamlit as st

from parallel_mini import collectives, engine, experiments
from parallel_mini.config import ConfigError, RunConfig
from parallel_mini.launch import RankError
from parallel_mini.viz.units import bytes_unit, rate_unit


@st.cache_data(max_entries=32, show_spinner=False)
def ring_experiment(n: int, numel: int, timed_mb: float, attempt: int = 0) -> dict:
    """collectives.ring_experiment, cached per (n, numel, timed_mb, attempt)."""
    t0 = time.perf_counter()
    exp = collectives.ring_experiment(n, numel, timed_mb=timed_mb)
    return {**exp, "run_wall_s": time.perf_counter() - t0}


@st.cache_data(max_entries=32, show_spinner=False)
def training_run(cfg_json: str, attempt: int = 0) -> dict:
    """engine.run on the RunConfig given as JSON; the report as a dict (cached per config)."""
    report = engine.run(RunConfig.from_dict(json.loads(cfg_json)))
    return report.to_dict()


@st.cache_data(max_entries=16, show_spinner=False)
def tp_mlp_shards(cfg_json: str, attempt: int = 0) -> list[dict]:
    """experiments.tp_mlp_shards on the RunConfig given as JSON: every tp rank's MLP shards (and
    rank 0's full weights), cached per config."""
    return experiments.tp_mlp_shards(json.loads(cfg_json))


def rank_error_summary(err: RankError) -> str:
    """The failing rank and the last line of its traceback (the exception itself)."""
    lines = [ln for ln in str(err.details).strip().splitlines() if ln.strip()]
    return f"Rank {err.rank} failed: {lines[-1].strip() if lines else 'no details'}"


def run_live(page: str, key: dict, label: str, fn, *args, fresh: bool = False):
    """Run `fn(*args, attempt)` under a status box and keep the result as this page's last one.
    Shows st.error (no traceback wall) for a bad config or a failed rank; returns None then."""
    attempts = st.session_state.setdefault(f"{page}_attempts", {})
    tag = json.dumps(key, sort_keys=True)
    if fresh:
        attempts[tag] = attempts.get(tag, 0) + 1
    error, details = None, None
    with st.status(label, expanded=False) as status:
        t0 = time.perf_counter()
        try:
            result = fn(*args, attempts.get(tag, 0))
        except ConfigError as err:
            error = f"Invalid settings: {err}"
        except RankError as err:
            error, details = rank_error_summary(err), err.details
        if error:
            status.update(label="The run did not complete", state="error")
        else:
            status.update(label=f"{label.rstrip('…. ')}: done in {time.perf_counter() - t0:.1f} s "
                                f"(a cached result returns at once)", state="complete")
    if error:
        st.error(error)
        if details:
            with st.expander("Full output of the failed rank"):
                st.code(details)
        return None
    st.session_state[f"{page}_last"] = {"key": key, "result": result}
    return result


def last_result(page: str, key: dict):
    """(result, is_for_current_settings) of this page's last run, or (None, False)."""
    last = st.session_state.get(f"{page}_last")
    if last is None:
        return None, False
    return last["result"], last["key"] == key


def fmt_count(b: float) -> str:
    """A byte count as the page shows it: whole numbers with separators, fractions with 2 decimals
    (theory's 2(N-1)/N * X is a fraction when N does not divide X)."""
    return f"{b:,.0f}" if float(b).is_integer() else f"{b:,.2f}"


def fmt_bytes(b: float) -> str:
    """Bytes in the binary unit the charts use (viz.units.bytes_unit), so a number on the page and
    the axis beside it agree; under 1 KiB the whole count."""
    div, unit = bytes_unit(abs(b))
    return f"{b:,.0f} B" if div == 1 else f"{b / div:.3f} {unit}"


def fmt_rate(b: float) -> str:
    """A bandwidth in the decimal unit the charts use (viz.units.rate_unit, NCCL's busbw units)."""
    div, unit = rate_unit(b)
    return f"{b / div:.3g} {unit}"


TOLERANCE = 1e-5  # fp32 losses and final parameters must equal the reference within this


def show_equality(report: dict) -> None:
    """The "same training as one process?" row every strategy page opens with."""
    st.subheader("Same training as one process?")
    diff = report["max_abs_diff"]
    m1, m2, m3 = st.columns(3)
    m1.metric("max |run − reference| (losses, final params)", f"{diff:.2e}",
              delta="equal within 1e-5" if diff <= TOLERANCE else "DIFFERENT",
              delta_color="normal" if diff <= TOLERANCE else "inverse")
    m2.metric("Final loss: this run", f"{report['losses'][-1]:.6f}")
    m3.metric("Final loss: reference", f"{report['reference_losses'][-1]:.6f}")
