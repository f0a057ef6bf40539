"""A lesson's prediction cell against what its live cell got, `compare_prediction` (lessons 01 to
05, 08 and 09).
"""
from __future__ import annotations


def _fmt(v) -> str:
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def compare_prediction(guess, actual, what: str, source: str = "measured", formula: str = "",
                       choices=None, rel_tol: float = 0.02) -> str:
    """One line for a lesson: the learner's prediction `guess` (written down in the cell before
    the live one) against `actual`, which the live cell `source` ("measured", "counted", "theory"),
    with the `formula` that predicts it. `choices`: the answers a choice question offers (then
    `actual` is one of them and the comparison is exact, ignoring case; `formula` is then the
    rule that chose it); otherwise numbers match within `rel_tol`. A guess of None prints the
    value and the formula only. The words are the same whatever `source` says: "off: 2 times
    the value above", never a template around it."""
    if choices is not None:  # e.g. "ring against gloo: 'faster', by what the run measured (...)"
        line = f"{what}: {str(actual)!r}, by what the run {source}" if source in (
            "measured", "counted", "replayed") else f"{what}: {str(actual)!r} ({source})"
        line += f" (the rule: {formula})" if formula else ""
    else:
        line = f"{what}: {source} {_fmt(actual)}" + (f" ({formula})" if formula else "")
    if guess is None:
        return line + ". Write your prediction in the cell above first, then run this one again."
    if choices is not None:
        if not isinstance(guess, str) or guess.strip().lower() not in [c.lower() for c in choices]:
            return (line + f". Your prediction {guess!r} is not one of the choices: "
                    + ", ".join(repr(c) for c in choices))
        ok = guess.strip().lower() == str(actual).lower()
        return line + f". You predicted {guess!r}: " + ("right." if ok else "not what happened.")
    try:
        g = float(guess)
    except (TypeError, ValueError):
        return line + f". Your prediction {guess!r} is not a number."
    a = float(actual)
    if abs(g - a) <= rel_tol * max(abs(a), 1e-12):
        return line + f". You predicted {_fmt(guess)}: right."
    ratio = f": {g / a:.3g} times the value above" if a else ""
    return line + f". You predicted {_fmt(guess)}, off{ratio}."
