"""Generate the learner and solved copies of every lesson from its source notebook.

    python tools/make_lessons.py            regenerate lessons/NN_topic.ipynb and lessons/solutions/
    python tools/make_lessons.py --check    exit 1, naming the file, if any generated copy is stale
    python tools/make_lessons.py --execute  run each source notebook first (solutions in place) and
                                            store the outputs of its checked cells
    python tools/make_lessons.py --execute --only 05
                                            the same for lesson 05 alone (execute and regenerate
                                            only lessons/src/05_*.ipynb; --check always checks all)

Sources live in lessons/src/NN_topic.ipynb: the lesson with the solutions in it, between lines
`### BEGIN SOLUTION` and `### END SOLUTION` inside code cells.

- Learner copy (lessons/NN_topic.ipynb): each solution block becomes
  `raise NotImplementedError("exercise: ...")` at the indentation of its BEGIN line, so the function
  signature, docstring and any hints above the block stay. The message is the text after
  `### BEGIN SOLUTION` if there is any, else "exercise: write <enclosing function>". It holds no
  outputs at all, as an exercise release does: a stored output under a prediction cell would
  answer it before the learner is asked.
- Solved copy (lessons/solutions/NN_topic.ipynb): the marker lines are removed, nothing else; the
  outputs of its checked cells are the source's, and so is what each cell that checks a prediction
  (calls `compare_prediction`) printed: the answer key, from which tests/test_lesson_spoilers.py
  reads each prediction's answer (nbval does not compare those unless they are tagged).

Checked cells carry the cell tag `nbval-check-output` (nbval reads tags; no comment line in the
learner's code). They are the only cells nbval compares (the tests run it on the solved copies with
--nbval-lax and lessons/nbval_sanitize.cfg); every other cell only has to run without error. So a
checked cell must print something deterministic: a grade line, a byte count that theory predicts
exactly, an equality. Cells whose output is a widget or a timing may say so with the tag
`nbval-ignore-output` (never compared either way). A grade cell (one that calls a `check_*`
grader) must `print(grade)`, and its stored output in the source must hold the "[correct]" line:
`--execute` produces it, and the script refuses to generate without it. A source cell that still
holds the old `# NBVAL_CHECK_OUTPUT` comment line is refused (use the tag).

Why the solved copy stands for "the learner copy with the solutions filled in": both are written
here from one source, cell for cell, with the same ids, tags and order; the only difference in code
is the solution blocks (stubs in one, solutions in the other), which `--check` proves on every run
of the tests. So nbval on the solved copy checks every checked cell's output as a learner who
wrote the solutions would see it.

Everything is deterministic (execution counts only on the solved copy's checked cells, numbered as
in a top-to-bottom run, because nbval refuses stored outputs of a cell that never ran; no
timestamps), so --check can compare the files on disk with what this script would write (as parsed
JSON, so formatting does not matter).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
OLD_MARK = "NBVAL_CHECK_OUTPUT"           # the comment marker that the tags replaced
CHECK_TAG, IGNORE_TAG = "nbval-check-output", "nbval-ignore-output"
CORRECT = "[correct]"
KEEP_CELL_METADATA = ("tags",)
GRADER_CALL = re.compile(r"\bcheck_\w+\(")  # a grader from parallel_mini.course.grading
ANSWER_CALL = re.compile(r"\bcompare_prediction\(")  # prints a prediction's answer


class LessonError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# the transforms
# ---------------------------------------------------------------------------------------------
def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _enclosing_def(lines: list[str], before: int) -> str | None:
    for line in reversed(lines[:before]):
        m = re.match(r"\s*(?:async\s+)?def\s+(\w+)\s*\(", line)
        if m:
            return m.group(1)
    return None


def split_solution(source: str, where: str = "cell") -> tuple[str, str]:
    """(learner source, solved source) of one code cell."""
    lines = source.split("\n")
    learner, solved = [], []
    inside = None  # index of the open BEGIN line
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside is not None:
                raise LessonError(f"{where}: '{BEGIN}' on line {i + 1} inside another solution "
                                  f"block (opened on line {inside + 1})")
            inside = i
            message = stripped[len(BEGIN):].strip(" :-")
            if not message:
                name = _enclosing_def(lines, i)
                message = f"write {name}" if name else "fill in this block"
            learner.append(f"{_indent(line)}raise NotImplementedError({json.dumps('exercise: ' + message)})")
            continue
        if stripped.startswith(END):
            if inside is None:
                raise LessonError(f"{where}: '{END}' on line {i + 1} without a '{BEGIN}'")
            inside = None
            continue
        solved.append(line)
        if inside is None:
            learner.append(line)
    if inside is not None:
        raise LessonError(f"{where}: '{BEGIN}' on line {inside + 1} is never closed by '{END}'")
    return "\n".join(learner), "\n".join(solved)


def is_checked(cell) -> bool:
    """A cell whose output nbval compares: tagged `nbval-check-output`."""
    return CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def is_answer_key(cell) -> bool:
    """A cell that checks a prediction (calls compare_prediction) but is not compared by nbval:
    the solved copy keeps what it printed (its stream outputs), the course's answer key, which
    tests/test_lesson_spoilers.py reads each prediction's answer from."""
    return (cell.cell_type == "code" and not is_checked(cell)
            and bool(ANSWER_CALL.search(cell.source)))


def _answer_key_outputs(outputs) -> list:
    return [_strip_output(o) for o in outputs if o.get("output_type") == "stream"]


def _refuse_old_marker(cell, where: str) -> None:
    if any(line.strip().lstrip("#").strip() == OLD_MARK for line in cell.source.splitlines()):
        raise LessonError(f"{where}: the comment line '# {OLD_MARK}' is gone from the lessons; "
                          f"delete it and give the cell the tag '{CHECK_TAG}' instead")


def _clean_metadata(meta: dict) -> dict:
    return {k: meta[k] for k in KEEP_CELL_METADATA if k in meta}


def make_copies(src_nb, src_rel: str) -> tuple[dict, dict]:
    """(learner notebook, solved notebook) for a source notebook (nbformat node)."""
    copies = {}
    for kind in ("learner", "solved"):
        nb = nbformat.v4.new_notebook()
        nb.metadata = {
            "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                           "name": "python3"},
            "language_info": {"name": "python"},
            "parallel_mini": {"copy": kind, "generated_from": src_rel,
                              "regenerate": "python tools/make_lessons.py"},
        }
        if kind == "solved":
            nb.cells.append(nbformat.v4.new_markdown_cell(
                f"*Solved copy, generated from `{src_rel}` by `tools/make_lessons.py`: edit the "
                f"source, not this file. Try the exercises in the learner copy first.*",
                id="solved-copy-note"))
        code_number = 0
        for index, cell in enumerate(src_nb.cells):
            where = f"{src_rel} cell {index}"
            new = copy.deepcopy(cell)
            new.id = cell.get("id") or f"cell-{index}"  # an old (4.4) source has none: stay stable
            new.metadata = _clean_metadata(cell.get("metadata", {}))
            if cell.cell_type == "code":
                learner_src, solved_src = split_solution(cell.source, where)
                new.source = learner_src if kind == "learner" else solved_src
                code_number += 1
                new.execution_count = None
                _refuse_old_marker(cell, where)
                if is_checked(cell):
                    # nbval refuses stored outputs of a cell that was never run: give the
                    # checked cells the number they would get in a top-to-bottom run
                    outs = [_strip_output(o) for o in cell.get("outputs", [])]
                    if GRADER_CALL.search(cell.source) and not any(
                            o.get("output_type") == "stream" and o["text"].startswith(CORRECT)
                            for o in outs):
                        raise LessonError(
                            f"{where}: this check cell has no stored '{CORRECT} ...' line. Grade "
                            f"cells must print(grade), and the source must have been run with its "
                            f"solutions: python tools/make_lessons.py --execute")
                    if kind == "solved":
                        new.execution_count, new.outputs = code_number, outs
                    else:  # an exercise release: nothing answered before it is asked
                        new.execution_count, new.outputs = None, []
                elif is_answer_key(cell) and kind == "solved":
                    new.execution_count = code_number
                    new.outputs = _answer_key_outputs(cell.get("outputs", []))
                else:
                    new.outputs = []
            elif BEGIN in cell.source or END in cell.source:
                raise LessonError(f"{where}: solution markers belong in code cells only")
            nb.cells.append(new)
        copies[kind] = nb
    return copies["learner"], copies["solved"]


def _strip_output(o) -> dict:
    o = copy.deepcopy(o)
    if o.get("output_type") == "execute_result":
        o["execution_count"] = None
    if "metadata" in o:
        o["metadata"] = {}
    return o


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def targets(root: Path, only: str | None = None) -> list[tuple[Path, Path, Path]]:
    """(source, learner copy, solved copy) for every source notebook, or for lesson `only` ("05")."""
    lessons = root / "lessons"
    found = [(src, lessons / src.name, lessons / "solutions" / src.name)
             for src in sorted((lessons / "src").glob("[0-9][0-9]_*.ipynb"))]
    if only is None:
        return found
    picked = [t for t in found if t[0].name.startswith(f"{only}_")]
    if not picked:
        raise LessonError(f"--only {only}: no lessons/src/{only}_*.ipynb (there are: "
                          f"{', '.join(t[0].name for t in found) or 'none'})")
    return picked


def render(nb) -> str:
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def _normalised(text: str):
    return json.loads(text)


def expected_files(root: Path, only: str | None = None) -> dict[Path, str]:
    out = {}
    for src, learner_path, solved_path in targets(root, only):
        rel = src.relative_to(root).as_posix()
        learner, solved = make_copies(nbformat.read(src, as_version=4), rel)
        out[learner_path], out[solved_path] = render(learner), render(solved)
    return out


def _first_difference(a: dict, b: dict) -> str:
    if a.get("metadata") != b.get("metadata"):
        return "notebook metadata differs"
    ca, cb = a.get("cells", []), b.get("cells", [])
    for i, (x, y) in enumerate(zip(ca, cb)):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            return f"cell {i} differs in {', '.join(keys)}"
    if len(ca) != len(cb):
        return f"{len(cb)} cells on disk, {len(ca)} expected"
    return "top-level fields differ"


def check(root: Path) -> list[str]:
    """Problems found: stale, missing or orphaned generated copies."""
    problems = []
    expected = expected_files(root)
    if not expected:
        problems.append(f"no source notebooks in {root / 'lessons' / 'src'}")
    for path, text in expected.items():
        rel = path.relative_to(root).as_posix()
        if not path.exists():
            problems.append(f"{rel} is missing")
            continue
        want, have = _normalised(text), _normalised(path.read_text())
        if want != have:
            problems.append(f"{rel} is stale ({_first_difference(want, have)})")
    lessons = root / "lessons"
    generated = set(lessons.glob("[0-9][0-9]_*.ipynb")) | set(
        (lessons / "solutions").glob("[0-9][0-9]_*.ipynb"))
    for orphan in sorted(generated - set(expected)):
        problems.append(f"{orphan.relative_to(root).as_posix()} has no source in lessons/src/")
    return problems


def write(root: Path, only: str | None = None) -> list[Path]:
    changed = []
    for path, text in expected_files(root, only).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or _normalised(path.read_text()) != _normalised(text):
            changed.append(path)
        path.write_text(text)
    return changed


def execute_sources(root: Path, timeout: int = 300, only: str | None = None) -> None:
    """Run every source notebook (or lesson `only`) top to bottom (the solutions are in place) and
    keep, in the source, the outputs of its checked cells only."""
    from nbclient import NotebookClient

    for src, _, _ in targets(root, only):
        nb = nbformat.read(src, as_version=4)
        print(f"executing {src.relative_to(root)} ...", flush=True)
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(src.parent)}}).execute()
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.execution_count = None
                if is_checked(cell):
                    cell.outputs = [_strip_output(o) for o in cell.outputs]
                elif is_answer_key(cell):
                    cell.outputs = _answer_key_outputs(cell.outputs)
                else:
                    cell.outputs = []
                cell.metadata = _clean_metadata(cell.metadata)
        src.write_text(render(nb))


def _lesson_number(text: str) -> str:
    if not re.fullmatch(r"\d{1,2}", text):
        raise argparse.ArgumentTypeError(f"expected a lesson number such as 05, not {text!r}")
    return f"{int(text):02d}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a generated copy is stale")
    ap.add_argument("--execute", action="store_true",
                    help="execute the sources first and store their checked cells' outputs")
    ap.add_argument("--only", metavar="NN", type=_lesson_number,
                    help="execute and regenerate lesson NN only (e.g. 05); --check checks all")
    ap.add_argument("--root", type=Path, default=ROOT, help="project root (default: this repo)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.check:
            problems = check(root)
            if problems:
                print("lessons out of date:\n  " + "\n  ".join(problems)
                      + "\nregenerate with: python tools/make_lessons.py", file=sys.stderr)
                return 1
            print(f"lessons up to date ({len(targets(root))} sources)")
            return 0
        if args.execute:
            execute_sources(root, only=args.only)
        changed = write(root, args.only)
    except LessonError as err:
        print(f"make_lessons: {err}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"wrote {path.relative_to(root)}")
    if not changed:
        print("lessons already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
