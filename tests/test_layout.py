"""The package's listing: the teaching core at the top (with parallel/), the run infrastructure in
parallel_mini/runtime, the course tooling in parallel_mini/course, imported only downward: course ->
runtime -> core. The command lines (`python -m parallel_mini`, `python -m parallel_mini.bench`) are
the only doors from the top into the course."""
import ast
import functools
import pathlib

import parallel_mini

PKG = pathlib.Path(parallel_mini.__file__).parent
DOORS = {"__main__.py", "bench.py"}  # the command lines
LAYERS = ("course", "runtime")  # above the core, highest first


@functools.cache  # (each file parsed once for all the tests)
def _imports(path: pathlib.Path) -> list[str]:
    """Every module `path` imports, absolute, resolving relative imports against its package."""
    pkg = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_core_never_imports_the_course_tooling():
    core = [p for p in PKG.rglob("*.py") if "course" not in p.relative_to(PKG).parts
            and p.name not in DOORS]
    assert len(core) > 20
    offenders = {str(p.relative_to(PKG)): [m for m in _imports(p) if m.startswith("parallel_mini.course")]
                 for p in core}
    assert not {k: v for k, v in offenders.items() if v}


def _layer(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG).parts
    return parts[0] if parts[0] in LAYERS else "core"


def test_imports_go_only_downward():
    """The core (top level and parallel/) imports nothing from runtime/ or course/, and runtime/
    nothing from course/ (the doors aside): each import is parsed, at any depth of the file."""
    above = {"core": LAYERS, "runtime": ("course",), "course": ()}
    files = [p for p in PKG.rglob("*.py") if p.name not in DOORS or p.parent != PKG]
    assert {_layer(p) for p in files} == {"core", "runtime", "course"}
    offenders = {}
    for p in files:
        bad = [m for m in _imports(p) for layer in above[_layer(p)]
               if m == f"parallel_mini.{layer}" or m.startswith(f"parallel_mini.{layer}.")]
        if bad:
            offenders[str(p.relative_to(PKG))] = bad
    assert not offenders


def test_run_infrastructure_lives_in_runtime():
    top = {p.stem for p in PKG.glob("*.py")}
    for name in ("launch", "preflight", "checkpoint", "cli"):
        assert name not in top and (PKG / "runtime" / f"{name}.py").exists(), name
    assert "trace" not in top and (PKG / "course" / "trace.py").exists()


def test_tooling_lives_in_course():
    top = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir()}
    for tool in ("planner", "guide", "peers", "grading", "viz", "magic", "experiments", "collectives"):
        assert tool not in top, tool
        assert (PKG / "course" / tool).exists() or (PKG / "course" / f"{tool}.py").exists(), tool
