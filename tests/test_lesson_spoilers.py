"""No lesson answers a prediction before it asks it.

A prediction is a learner cell line `predict_x = None` or `my_x = None` (the learner writes a guess
there); the cell that checks it is the first later cell that passes that name to
`compare_prediction(...)`. Its answer is not kept in a table here: it is read from the solved
copy, whose checking cell stores the line `compare_prediction` printed when the lesson was run
with its solutions (`what: source VALUE (formula). Write your prediction ...`, or `what: 'VALUE', ...`
for a choice; make_lessons keeps
the outputs of every prediction-checking cell in the solved copy, the course's answer key).

The scan then looks, in the learner copy, at every cell above the checking cell (markdown and code,
the question cell and the cells between it and the check included) and at what the cells above the
question print when run (the solved copy's stored outputs), for the answer written as a number: the
value as the course prints it (`1,310,976`, `27.97`, `0.2727`), its plain digits (`1310976`) and,
for a fraction, as a percentage (`27 %`, `27.3%`). It fails naming the prediction, the cell and the
text.

What it cannot see, reviewed by hand instead: answers that are words ("yes", "the same", "above
a half": the words themselves are everywhere in the prose, so a leak is a sentence, not a token),
integers below 10 (every such digit appears in ordinary text) and answers equal to a quantity the
question line itself gives (rows of fc.weight per rank at t = 4 is h, and the question says
h = 64). The scan prints how many
predictions of each lesson it checked and how many it could not.
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "lessons" / "src").glob("[0-9][0-9]_*.ipynb"))
PREDICTION = re.compile(r"^\s*((?:predict|my)_\w+)\s*=\s*None\b.*$", re.M)
COMPARE = "compare_prediction"
ASKED = ". Write your prediction"  # what compare_prediction prints after the value when guess is None


@dataclass
class Prediction:
    name: str
    asked: int              # learner cell index of the `name = None` line
    checked: int            # learner cell index of the cell that checks it
    what: str
    answer: str | None      # as printed ("60", "1,310,976", "the same"); None: not stored
    question: str = ""      # the `name = None  # ...` line


def _code_of(source: str) -> str:
    """A cell's source as Python: IPython magics and shell lines blanked (line numbers kept)."""
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.split("\n"))


def _calls(source: str) -> list[tuple[str, str, str]]:
    """(guess name, what, source word) of each compare_prediction call, in the order of the text."""
    try:
        tree = ast.parse(_code_of(source))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == COMPARE:
            args = {i: a for i, a in enumerate(node.args)}
            kw = {k.arg: k.value for k in node.keywords}
            guess = args.get(0, kw.get("guess"))
            what = args.get(2, kw.get("what"))
            src = args.get(3, kw.get("source"))
            if isinstance(guess, ast.Name) and isinstance(what, ast.Constant):
                found.append((node.lineno, node.col_offset, guess.id, what.value,
                              src.value if isinstance(src, ast.Constant) else "measured"))
    return [f[2:] for f in sorted(found)]


def _printed(cell) -> str:
    return "".join(o.get("text", "") or "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def _answer(line: str, what: str, source: str) -> str:
    """The value in compare_prediction's line: `what: source VALUE (formula)` for a number,
    `what: 'VALUE', by what the run source ...` or `what: 'VALUE' (source) ...` for a choice."""
    head = f"{what}: "
    assert line.startswith(head), (line, head)
    rest = line[len(head):].split(ASKED)[0]
    if rest[:1] in "'\"":
        return re.match(r"""('[^']*'|"[^"]*")""", rest).group(1)[1:-1]
    assert rest.startswith(source + " "), (line, source)
    return rest[len(source) + 1:].split(" (")[0].strip()


def predictions(learner, solved) -> list[Prediction]:
    """Every prediction of a lesson with the cell that checks it and its answer from the solved
    copy. The solved copy has one more cell at the top (its note); cells otherwise match."""
    offset = len(solved.cells) - len(learner.cells)
    assert offset == 1, "the solved copy is the learner copy plus its note cell"
    out = []
    for i, cell in enumerate(learner.cells):
        if cell.cell_type != "code":
            continue
        for m in PREDICTION.finditer(cell.source):
            name = m.group(1)
            checks = [j for j in range(i + 1, len(learner.cells))
                      if learner.cells[j].cell_type == "code"
                      and any(c[0] == name for c in _calls(learner.cells[j].source))]
            assert checks, f"{name} (cell {i}) is never checked by {COMPARE}"
            j = checks[0]
            calls = _calls(learner.cells[j].source)
            lines = [ln for ln in _printed(solved.cells[j + offset]).splitlines() if ASKED in ln]
            what, source = next((w, s) for g, w, s in calls if g == name)
            answer = None
            if lines:
                assert len(lines) == len(calls), (
                    f"cell {j}: {len(calls)} {COMPARE} calls but {len(lines)} printed lines: "
                    f"one call each, not in a loop, so each answer pairs with its prediction")
                line = lines[[c[0] for c in calls].index(name)]
                answer = _answer(line, what, source)
            out.append(Prediction(name, i, j, what, answer, m.group(0)))
    return out


def _number(answer: str) -> float | None:
    try:
        value = float(answer.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # "nan" is a word here


def spellings(value: float) -> set[str]:
    """How a text would write this number: as the course prints it, in plain digits, exactly to
    a few decimals, and a fraction as a percentage."""
    out = set()
    if value == int(value):
        out |= {f"{int(value)}", f"{int(value):,}"}
    else:
        out.add(f"{value:.4g}")
        for k in range(1, 5):
            if abs(round(value, k) - value) <= 1e-9 * abs(value):
                out.add(f"{round(value, k)}")
                break
        if 0 < value < 1:
            for pct in (f"{100 * value:.0f}", f"{100 * value:.1f}"):
                out |= {f"{pct} %", f"{pct}%", f"{pct}\u202f%"}
    return out


def scannable(p: Prediction) -> bool:
    """A number, not a small integer, and not one the question itself gives (when the answer
    equals a given quantity, h = 64 rows at h = 64, its appearing elsewhere tells nothing)."""
    v = None if p.answer is None else _number(p.answer)
    return (v is not None and not (v == int(v) and abs(v) < 10)
            and not _find(p.question, spellings(v)))


def _find(text: str, spelled: set[str]) -> str | None:
    for s in sorted(spelled, key=len, reverse=True):
        m = re.search(r"(?<![\w.,])" + re.escape(s) + r"(?![\w]|[.,]\d)", text)
        if m:
            return text[max(0, m.start() - 60): m.end() + 40].replace("\n", " ")
    return None


def leaks(learner, solved) -> list[str]:
    found = []
    offset = len(solved.cells) - len(learner.cells)
    for p in predictions(learner, solved):
        if not scannable(p):
            continue
        spelled = spellings(_number(p.answer))
        places = [(k, "source", learner.cells[k].source) for k in range(p.checked)]
        places += [(k, "output", _printed(solved.cells[k + offset])) for k in range(p.asked)]
        for k, kind, text in places:
            hit = _find(text, spelled)
            if hit:
                found.append(f"{p.name} (asked in cell {p.asked}, checked in cell {p.checked}, "
                             f"answer {p.answer}): cell {k}'s {kind} shows it: ...{hit}...")
    return found


def _lesson(src: Path):
    return (nbformat.read(ROOT / "lessons" / src.name, as_version=4),
            nbformat.read(ROOT / "lessons" / "solutions" / src.name, as_version=4))


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_no_prediction_is_answered_before_it_is_asked(src):
    learner, solved = _lesson(src)
    found = predictions(learner, solved)
    assert found, "every lesson asks for predictions"
    missing = [p.name for p in found if p.answer is None]
    assert not missing, (f"no stored answer for {missing} in lessons/solutions/{src.name}: run "
                         f"python tools/make_lessons.py --execute --only {src.name[:2]}")
    print(f"{src.stem}: {sum(map(scannable, found))} of {len(found)} predictions scanned "
          f"(the rest are words or integers below 10)")
    assert not leaks(learner, solved), "\n".join(leaks(learner, solved))


def test_the_learner_copies_store_no_outputs():
    for src in SOURCES:
        learner, _ = _lesson(src)
        assert not any(c.get("outputs") for c in learner.cells), src.name


def test_a_planted_leak_is_caught():
    """Each kind of leak once: the answer stated in markdown above the question, printed by a
    cell above it, and the check moved above its question (then the question cell is 'above')."""
    learner, solved = _lesson(SOURCES[0])
    p = next(p for p in predictions(learner, solved) if scannable(p))
    assert not leaks(learner, solved)

    told = nbformat.v4.new_markdown_cell(f"As we will see, the answer is {p.answer} here.")
    leaked_l, leaked_s = _lesson(SOURCES[0])
    leaked_l.cells.insert(p.asked, told)
    leaked_s.cells.insert(p.asked + 1, told)
    assert any(f"{p.name} " in f and "the answer is" in f for f in leaks(leaked_l, leaked_s))

    printed = nbformat.v4.new_code_cell("print(x)")
    printed.outputs = [nbformat.v4.new_output("stream", text=f"result: {p.answer}\n")]
    leaked_l, leaked_s = _lesson(SOURCES[0])
    leaked_l.cells.insert(1, nbformat.v4.new_code_cell("print(x)"))
    leaked_s.cells.insert(2, printed)
    assert any(f"{p.name} " in f and "output shows it" in f for f in leaks(leaked_l, leaked_s))

    # every spelling the scan knows, for a fraction
    assert {"0.2727", "27 %", "27.3%"} <= spellings(3 / 11)
    assert "1,310,976" in spellings(1310976.0) and "1310976" in spellings(1310976.0)
    assert _find("theory says 38.5 GB", spellings(38.5)) and not _find("v1.38.5", spellings(38.5))
