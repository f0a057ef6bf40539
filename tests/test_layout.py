"""The package's listing: the teaching core at the top, the course tooling in parallel_mini/course,
imported only downward (no core module imports the tooling; the CLI's `plan` verb and the
`python -m parallel_mini.bench` entry are the only doors from the top into it)."""
import ast
import pathlib

import parallel_mini

PKG = pathlib.Path(parallel_mini.__file__).parent
DOORS = {"__main__.py", "bench.py"}  # the command lines


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


def test_tooling_lives_in_course():
    top = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir()}
    for tool in ("planner", "guide", "peers", "grading", "viz", "magic", "experiments", "collectives"):
        assert tool not in top, tool
        assert (PKG / "course" / tool).exists() or (PKG / "course" / f"{tool}.py").exists(), tool
