"""Lessons: the generator (stubs, solved copies, --check), the %%ranks magic, and every notebook
executed by nbval.

What nbval checks, and why the solved copy is enough. The learner copies (lessons/NN_*.ipynb) hold
no outputs: a stored output under a prediction would answer it before it is asked. Checked cells
carry the cell tag `nbval-check-output`; nbval runs with --nbval-lax, so every cell must run
without error and every tagged cell must reproduce its stored output after
lessons/nbval_sanitize.cfg. It runs on the solved copies (lessons/solutions/NN_*.ipynb), and that
is the same as running "the learner copy with the solutions' answers filled in" and comparing
with the solutions' outputs, because:
- tools/make_lessons.py writes both copies from one source, cell for cell: same ids, tags, order
  and markdown; their code differs only inside the solution blocks (a stub in one, the solution
  in the other). `make_lessons.py --check` (test_generated_copies_are_current) proves the files on
  disk are exactly that, and test_copies_hold_stub_and_solution that only exercise cells differ;
- so the learner copy with each stub replaced by its solution *is* the solved copy (less the
  solved copy's first markdown note), and its tagged cells' stored outputs are the source's,
  produced by `make_lessons.py --execute`, where a grade cell must print "[correct]".
nbval's strictness is unchanged: every tagged cell, every line, the same sanitizer.

The learner copies themselves (stubs in place) run only under `-m slow`
(test_learner_copy_runs_with_its_stubs): every cell runs and each grade cell says
"[not attempted]"; the graders' answer to a stub is tested cheaply in tests/test_grading*.py.
"""
from __future__ import annotations

import importlib.util
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "lessons" / "src").glob("[0-9][0-9]_*.ipynb"))
SANITIZE = ROOT / "lessons" / "nbval_sanitize.cfg"


def _tool():
    spec = importlib.util.spec_from_file_location("make_lessons", ROOT / "tools" / "make_lessons.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_tool(*args, root: Path = ROOT) -> subprocess.CompletedProcess:
    """The real command line (a subprocess: exit code and messages as `make test` sees them)."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / "make_lessons.py"), *args,
                           "--root", str(root)], capture_output=True, text=True, timeout=120)


def _tool_main(capsys, *args, root: Path) -> tuple[int, str]:
    """The same entry point in-process (importing nbformat costs seconds per subprocess)."""
    code = _tool().main([*args, "--root", str(root)])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the generator
# ---------------------------------------------------------------------------------------------
def test_there_are_lessons():
    assert [p.name for p in SOURCES][:2] == ["01_collectives.ipynb", "02_data_parallel.ipynb"]


def test_split_solution_stubs_at_the_block_indentation():
    tool = _tool()
    src = ("def f(x, comm):\n"
           "    n = comm.size('dp')\n"
           "    ### BEGIN SOLUTION\n"
           "    for i in range(n):\n"
           "        x += i\n"
           "    ### END SOLUTION\n"
           "    return x\n"
           "def g():\n"
           "    if True:\n"
           "        ### BEGIN SOLUTION sum the chunks\n"
           "        pass\n"
           "        ### END SOLUTION")
    learner, solved = tool.split_solution(src)
    assert learner == ("def f(x, comm):\n"
                       "    n = comm.size('dp')\n"
                       "    raise NotImplementedError(\"exercise: write f\")\n"
                       "    return x\n"
                       "def g():\n"
                       "    if True:\n"
                       "        raise NotImplementedError(\"exercise: sum the chunks\")")
    assert solved == ("def f(x, comm):\n"
                      "    n = comm.size('dp')\n"
                      "    for i in range(n):\n"
                      "        x += i\n"
                      "    return x\n"
                      "def g():\n"
                      "    if True:\n"
                      "        pass")
    compile(learner, "learner", "exec")
    compile(solved, "solved", "exec")


@pytest.mark.parametrize("bad", [
    "### BEGIN SOLUTION\nx = 1",                                  # never closed
    "x = 1\n### END SOLUTION",                                    # no BEGIN
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",   # nested
])
def test_split_solution_rejects_unbalanced_markers(bad):
    tool = _tool()
    with pytest.raises(tool.LessonError):
        tool.split_solution(bad, "test cell")


def test_a_grade_cell_without_its_correct_line_is_refused():
    tool = _tool()
    nb = nbformat.read(SOURCES[0], as_version=4)
    check_cell = next(c for c in nb.cells if c.cell_type == "code" and "check_" in c.source
                      and tool.is_checked(c))
    tool.make_copies(nb, "src")  # as stored: fine
    check_cell.outputs = []      # e.g. the source was never run with its solutions
    with pytest.raises(tool.LessonError, match="--execute"):
        tool.make_copies(nb, "src")


def test_the_old_comment_marker_is_refused():
    tool = _tool()
    nb = nbformat.read(SOURCES[0], as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and tool.is_checked(c))
    cell.source = "# NBVAL_CHECK_OUTPUT\n" + cell.source
    with pytest.raises(tool.LessonError, match="tag 'nbval-check-output'"):
        tool.make_copies(nb, "src")


def test_generated_copies_are_current():
    res = _run_tool("--check")
    assert res.returncode == 0, res.stderr


def test_check_fails_when_a_source_is_edited(tmp_path, capsys):
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "make_lessons.py", tmp_path / "tools")
    shutil.copytree(ROOT / "lessons", tmp_path / "lessons",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    assert _tool_main(capsys, "--check", root=tmp_path)[0] == 0

    src = tmp_path / "lessons" / "src" / SOURCES[0].name
    nb = nbformat.read(src, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.source += "\nprint('an edit the copies do not have yet')"
    nbformat.write(nb, src)
    res = _run_tool("--check", root=tmp_path)  # once through the real command line
    assert res.returncode == 1
    assert f"lessons/{src.name} is stale" in res.stderr
    assert f"lessons/solutions/{src.name} is stale" in res.stderr
    assert "make_lessons.py" in res.stderr  # says how to fix it

    assert _tool_main(capsys, root=tmp_path)[0] == 0  # regenerate
    assert _tool_main(capsys, "--check", root=tmp_path)[0] == 0
    learner = nbformat.read(tmp_path / "lessons" / src.name, as_version=4)
    assert any("an edit the copies do not have yet" in c.source for c in learner.cells)

    # a generated copy edited by hand (not its source) is stale too, and an orphan is reported
    (tmp_path / "lessons" / "solutions" / src.name).write_text(
        (tmp_path / "lessons" / src.name).read_text())
    shutil.copy(src, tmp_path / "lessons" / "99_orphan.ipynb")
    code, err = _tool_main(capsys, "--check", root=tmp_path)
    assert code == 1
    assert f"lessons/solutions/{src.name} is stale" in err
    assert "lessons/99_orphan.ipynb has no source" in err


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _stored_text(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_copies_hold_stub_and_solution(src):
    learner = nbformat.read(ROOT / "lessons" / src.name, as_version=4)
    solved = nbformat.read(ROOT / "lessons" / "solutions" / src.name, as_version=4)
    source = nbformat.read(src, as_version=4)
    n_blocks = sum(s.count("### BEGIN SOLUTION") for s in _code(source))
    assert n_blocks >= 1, "every lesson has an exercise"
    learner_code, solved_code = "\n".join(_code(learner)), "\n".join(_code(solved))
    assert learner_code.count('raise NotImplementedError("exercise: ') == n_blocks
    assert "NotImplementedError(\"exercise" not in solved_code
    for text in (learner_code, solved_code):
        assert "### BEGIN SOLUTION" not in text and "### END SOLUTION" not in text
    # only the exercise cells differ between the copies
    differing = [(a, b) for a, b in zip(_code(learner), _code(solved)) if a != b]
    assert len(differing) == sum("### BEGIN SOLUTION" in s for s in _code(source))
    # the learner copy is an exercise release: no outputs, no execution counts, no comment markers
    for c in learner.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, c.source[:80]
            assert "NBVAL_CHECK_OUTPUT" not in c.source
    # the solved copy stores outputs only in tagged cells and, as the answer key, what the cells
    # that check a prediction printed (text only); its tags are the learner's
    tool = _tool()
    tags = [c.metadata.get("tags", []) for c in learner.cells]
    assert tags == [c.metadata.get("tags", []) for c in solved.cells[1:]]
    checked = [c for c in solved.cells if tool.is_checked(c)]
    assert checked, "every lesson checks some output"
    for c in solved.cells:
        if c.cell_type == "code" and c.outputs and not tool.is_checked(c):
            assert tool.is_answer_key(c), c.source[:80]
            assert all(o.output_type == "stream" for o in c.outputs)
    assert "[correct]" in _stored_text(solved) and "[not attempted]" not in _stored_text(solved)


WIDGETS = ("ring_player", "memory_explorer", "bubble_explorer", "tiles_explorer")


def test_widget_cells_are_ignored_by_nbval_and_come_after_their_predictions():
    """Lessons 01, 03, 05 and 06 each show one live widget (parallel_mini.course.widgets): its cell
    is tagged nbval-ignore-output and stores nothing (a widget's state is not an output to compare),
    and it comes after every prediction of its lesson whose answer the widget could show: after
    the last check of the section it explores."""
    spec = importlib.util.spec_from_file_location("lesson_spoilers",
                                                  ROOT / "tests" / "test_lesson_spoilers.py")
    spoilers = sys.modules.setdefault("lesson_spoilers", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(spoilers)  # registered first: its dataclass looks its module up
    after_checks = {"01": ("predict_steps", "predict_bytes_per_rank"),
                    "03": ("predict_zero2_n4", "predict_hybrid", "predict_full"),
                    "05": ("predict_gpipe_bubble", "predict_interleaved", "predict_wall"),
                    "06": ("my_imbalance", "my_calls")}
    for src in SOURCES:
        learner = nbformat.read(ROOT / "lessons" / src.name, as_version=4)
        solved = nbformat.read(ROOT / "lessons" / "solutions" / src.name, as_version=4)
        cells = [i for i, c in enumerate(learner.cells) if c.cell_type == "code"
                 and any(f"{w}(" in c.source for w in WIDGETS)]
        assert bool(cells) == (src.name[:2] in after_checks), src.name
        for i in cells:
            assert "nbval-ignore-output" in learner.cells[i].metadata.get("tags", [])
            assert not solved.cells[i + 1].outputs
            checked = {p.name: p.checked for p in spoilers.predictions(learner, solved)}
            for name in after_checks[src.name[:2]]:
                assert checked[name] < i, f"{src.name}: the widget (cell {i}) shows {name} before its check"


def test_sanitizer_keeps_the_grade_status_apart():
    text = SANITIZE.read_text()
    pairs = re.findall(r"^regex: (.*)$\n^replace: (.*)$", text, flags=re.M)
    assert pairs

    def sanitize(s):
        for regex, repl in pairs:
            s = re.sub(regex, repl, s)
        return s

    correct = sanitize("[correct] equal to dist.all_reduce at N = 2, 3\n")
    not_attempted = sanitize("[not attempted] still raises NotImplementedError\n")
    assert correct == "[correct]\n" and not_attempted == "[not attempted]\n"
    # measured facts the checked cells print are not washed out
    assert sanitize("measured 1,310,976 bytes per step") == "measured 1,310,976 bytes per step"
    assert sanitize("steps per rank: measured 6") != sanitize("steps per rank: measured 7")


# ---------------------------------------------------------------------------------------------
# the %%ranks magic
# ---------------------------------------------------------------------------------------------
def _main_namespace(code: str, **extra) -> dict:
    """Functions defined as if in a notebook: their __module__ is __main__."""
    ns = {"__name__": "__main__", **extra}
    exec(code, ns)
    return ns


def test_run_cell_runs_on_every_rank_with_notebook_functions():
    from parallel_mini.course.magic import run_cell

    ns = _main_namespace("import math\n"
                         "def triple(t):\n    return 3 * t\n"
                         "offset = 100\n"
                         "rank = 'the notebook has a variable called rank too'\n")
    outputs = run_cell("x = torch.tensor([float(rank + 1)])\n"
                       "comm.all_reduce(x, 'dp')\n"
                       "print(rank, world_size, triple(x).item() + offset, math.floor(2.5),\n"
                       "      dist.get_world_size(), len(comm.records))\n", 3, user_ns=ns)
    assert outputs == [f"{r} 3 118.0 2 3 1\n" for r in range(3)]


def test_run_cell_reports_the_failing_rank_with_its_own_lines():
    from parallel_mini.runtime.launch import RankError
    from parallel_mini.course.magic import RanksOutput, run_cell

    with pytest.raises(RankError) as info:
        run_cell("print('hello from', rank)\nif rank == 1:\n    raise ValueError('boom')\n", 2)
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom" in err.details and 'File "<%%ranks cell>", line 3' in err.details
    shown = repr(RanksOutput(err.outputs, err.rank, err.details))
    assert "--- rank 1 (failed) ---\nhello from 1\nTraceback" in shown
    assert "raise ValueError('boom')" in shown  # the learner's source line, not just a number
    assert "launch.py" not in shown  # the launcher's own frames are trimmed


def test_unpicklable_or_huge_notebook_objects_are_reported_not_fatal(monkeypatch):
    from parallel_mini.course import magic

    ns = _main_namespace("def uses_lock():\n    return lock\n"
                         "def fine():\n    return 1\n", lock=threading.Lock(), big=b"x" * 4096)
    ok, skipped = magic.shippable("uses_lock(); fine(); print(rank)", ns)
    assert set(ok) == {"fine"} and set(skipped) == {"uses_lock"}
    assert "cannot be pickled" in skipped["uses_lock"] and "lock" in skipped["uses_lock"]
    monkeypatch.setattr(magic, "MAX_SHIP_BYTES", 1024)
    ok, skipped = magic.shippable("print(big, lock, rank, world_size, comm)", ns)
    assert ok == {} and set(skipped) == {"big", "lock"}  # rank etc. come from the ranks


@pytest.fixture
def ipython_shell():
    """A plain IPython shell; it installs its own __main__, which is put back afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    saved_main = sys.modules["__main__"]
    try:
        yield InteractiveShell.instance()
    finally:
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = saved_main


def test_magic_shows_every_rank_and_fails_the_cell_not_the_kernel(ipython_shell, capsys):
    from IPython.core.error import UsageError

    shell = ipython_shell
    shell.run_line_magic("load_ext", "parallel_mini.course.magic")
    assert shell.run_cell("def shout(s):\n    return s.upper()\n").success
    ok = shell.run_cell("%%ranks 2\nprint(shout('hi from'), rank)\n")
    assert ok.success
    assert "--- rank 0 ---\nHI FROM 0\n--- rank 1 ---\nHI FROM 1" in capsys.readouterr().out

    bad = shell.run_cell("%%ranks 2\nprint('before')\nif rank == 1:\n    1 / 0\n")
    assert isinstance(bad.error_in_exec, UsageError)
    assert "rank 1 failed: ZeroDivisionError" in str(bad.error_in_exec)
    out = capsys.readouterr().out
    assert "--- rank 1 (failed) ---\nbefore\nTraceback" in out and "1 / 0" in out
    assert shell.run_cell("%%ranks 2\nprint(rank)\n").success  # the kernel carries on


def test_magic_deadlock_names_the_line_each_rank_waited_on(ipython_shell, capsys):
    """Both ranks receive first: neither sends. The cell stops after half its --timeout with the
    cell line the reported rank waited on and what to check, not gloo's own text."""
    import time

    from IPython.core.error import UsageError

    shell = ipython_shell
    shell.run_line_magic("load_ext", "parallel_mini.course.magic")
    t0 = time.monotonic()
    bad = shell.run_cell("%%ranks 2 --timeout 6\nx = torch.zeros(4)\npeer = 1 - rank\n"
                         "dist.recv(x, src=peer)\ndist.send(x, dst=peer)\n")
    elapsed = time.monotonic() - t0
    message = str(bad.error_in_exec)
    assert isinstance(bad.error_in_exec, UsageError), message
    assert "waited 3 s at line 3 of the cell (dist.recv(x, src=peer))" in message, message
    assert "deadlock" in message and "Timed out" not in message, message
    assert elapsed < 10, f"{elapsed:.1f} s"
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# the notebooks, executed
# ---------------------------------------------------------------------------------------------
# the solved copies only: see the module docstring for why that checks the learner copies too
NOTEBOOKS = [pytest.param(ROOT / "lessons" / "solutions" / src.name, id=f"solutions-{src.stem}")
             for src in SOURCES]
# Notebooks run in separate kernels, two at a time: much of a notebook's time is single-threaded
# (kernel start, imports, the forkserver), so two overlap well on two cores.
NBVAL_JOBS = int(os.environ.get("PARALLEL_MINI_NBVAL_JOBS", "2"))
NBVAL_ARGS = ["-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
              "--nbval-sanitize-with", str(SANITIZE), "--nbval-cell-timeout", "300"]
# One pytest process per job runs nbval on one notebook after another (`pytest.main` per notebook,
# the same arguments as a command line of its own): pytest and nbval are imported once per job, not
# once per notebook (~2 s of CPU each). Each notebook still gets a fresh kernel of its own.
_WORKER = """
import contextlib, sys
import pytest
for line in sys.stdin:
    notebook, log = line.rstrip("\\n").split("\\t")
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        code = pytest.main([*sys.argv[1:], notebook])
    print("nbval-done", int(code), flush=True)
"""


NOTEBOOK_TIMEOUT_S = 900  # hang guard: a notebook's nbval run, past its cells' own 300 s each


def _start_job(err: Path) -> subprocess.Popen:
    with open(err, "a") as errors:
        return subprocess.Popen([sys.executable, "-c", _WORKER, *NBVAL_ARGS], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)


def _stop_job(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _nbval_worker(todo: queue.Queue, futures: dict, logs: Path, job: int) -> None:
    """Takes notebooks from `todo` until it is empty and runs each in this job's pytest process;
    a notebook's future gets what a command line of its own would give (exit code and output).
    A notebook past NOTEBOOK_TIMEOUT_S has its job killed (it fails, saying so); a job that died
    is replaced for the next notebook."""
    err = logs / f"job{job}.stderr"
    proc = None
    try:
        while True:
            try:
                notebook = todo.get_nowait()
            except queue.Empty:
                return
            if proc is None:
                proc = _start_job(err)
            log = logs / f"{notebook.stem}.log"
            fired = threading.Event()
            watchdog = threading.Timer(NOTEBOOK_TIMEOUT_S, lambda p=proc: (fired.set(), p.kill()))
            watchdog.start()
            try:
                proc.stdin.write(f"{notebook}\t{log}\n")
                proc.stdin.flush()
                said, other = "", []  # (a kernel may write to the job's stdout too)
                while not said.startswith("nbval-done "):
                    if not (said := proc.stdout.readline()):
                        break
                    other.append(said)
                watchdog.cancel()
                out = log.read_text() if log.exists() else ""
                if not said:
                    why = (f"killed after {NOTEBOOK_TIMEOUT_S} s" if fired.is_set()
                           else f"exit {proc.wait()}")
                    raise RuntimeError(f"the nbval job ended ({why}):\n{out[-6000:]}"
                                       + "".join(other)[-2000:] + err.read_text()[-2000:])
                futures[notebook].set_result(subprocess.CompletedProcess(
                    [notebook], int(said.split()[1]), out, "".join(other[:-1]) + err.read_text()))
            except BaseException as exc:
                watchdog.cancel()
                futures[notebook].set_exception(exc)
                proc.kill()  # the next notebook gets a job of its own
                proc.wait()
                proc = None
    finally:
        if proc is not None:
            _stop_job(proc)


def _lesson_temp_entries() -> set[str]:
    """What lessons make in the temporary directory (tempfile.mkdtemp(prefix="lessonNN...")."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("lesson*")}


@pytest.fixture(scope="session")
def temp_before_notebooks() -> set[str]:
    return _lesson_temp_entries()


@pytest.fixture(scope="session")
def nbval_results(request, tmp_path_factory, temp_before_notebooks):
    """Starts nbval on every selected notebook at once (NBVAL_JOBS jobs, each taking the next
    notebook when it is done with one); each test waits for its own notebook's result. Under
    pytest-xdist this file must go whole to one worker (`make test`: --dist loadfile), or each
    worker would run every notebook."""
    selected = [item.callspec.params["notebook"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_notebook_runs_and_checks_hold"]
    futures = {nb: Future() for nb in selected}
    todo: queue.Queue = queue.Queue()
    for nb in selected:
        todo.put(nb)
    logs = tmp_path_factory.mktemp("nbval")
    jobs = [threading.Thread(target=_nbval_worker, args=(todo, futures, logs, k), daemon=True)
            for k in range(max(1, min(NBVAL_JOBS, len(selected))))]
    for job in jobs:
        job.start()
    yield futures
    while True:  # a session that stops early (-x, ^C) starts no further notebook
        try:
            todo.get_nowait()
        except queue.Empty:
            break
    for job in jobs:
        job.join()


@pytest.mark.notebooks
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_and_checks_hold(notebook, nbval_results):
    res = nbval_results[notebook].result()
    assert res.returncode == 0, (f"nbval failed on {notebook.relative_to(ROOT)}:\n"
                                 + res.stdout[-6000:] + res.stderr[-2000:])
    assert re.search(r"\d+ passed", res.stdout) and " failed" not in res.stdout


@pytest.mark.notebooks
@pytest.mark.timeout(1200)
def test_the_notebooks_leave_nothing_in_the_temp_directory(nbval_results, temp_before_notebooks):
    """A lesson that writes to a temporary directory (09's checkpoint, 03's offload file) removes
    it: a learner who runs a lesson ten times does not find ten checkpoints in /tmp."""
    for future in nbval_results.values():
        future.exception()  # waits; a notebook that failed is reported by its own test
    left = _lesson_temp_entries() - temp_before_notebooks
    assert not left, f"left in {tempfile.gettempdir()} by the notebooks: {sorted(left)}"


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_learner_copy_runs_with_its_stubs(src):
    """The learner copy as a learner first opens it: every cell runs (a stub does not break the
    cells after it) and every grade cell says "[not attempted]". Slow: a whole lesson's kernel."""
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "lessons" / src.name, as_version=4)
    solved = nbformat.read(ROOT / "lessons" / "solutions" / src.name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "lessons")}}).execute()
    # the grade cells: those whose solved copy says "[correct]" (not the cells that show what the
    # checker says to a wrong answer, which say the same in both copies)
    grades = [c for c, s in zip(nb.cells, solved.cells[1:])
              if c.cell_type == "code" and "[correct]" in "".join(o.get("text", "") for o in s.outputs)]
    assert grades
    for c in grades:
        text = "".join(o.get("text", "") for o in c.outputs)
        assert "[not attempted]" in text and "[correct]" not in text, (c.source[:200], text)
