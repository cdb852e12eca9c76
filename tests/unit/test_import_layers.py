"""The package's shape: declared import layers with no cycles (import-linter), and only the CLI,
errors and the run-layout owner at the top of `src/dllmflow/` beside the stage packages."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "dllmflow"
TOP_MODULES = {"__init__.py", "cli.py", "errors.py", "runs.py", "py.typed"}


def test_import_layers_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    proc = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


def test_top_of_package_holds_only_cli_errors_runs_and_packages():
    loose = {p.name for p in PKG.iterdir() if p.is_file()} - TOP_MODULES
    assert not loose, f"modules at the top of src/dllmflow/ belong in a stage package: {sorted(loose)}"


# One file per mode / sampler is the house rule, so those folders reuse the mode names on purpose.
PER_MODE_DIRS = {"strategies", "samplers", "masks"}


def test_no_two_modules_share_a_name():
    names: dict[str, list[str]] = {}
    for p in PKG.rglob("*.py"):
        if p.name != "__init__.py" and p.parent.name not in PER_MODE_DIRS:
            names.setdefault(p.stem, []).append(str(p.relative_to(PKG)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}


# ---- no import cycle, lazy imports included ---------------------------------------------------------
# import-linter's layers contract only orders the stage packages; a cycle inside one (modes.py <->
# strategies/base.py through a function-level import) passes it. This graph has one node per module
# and an edge for every `import dllmflow...` anywhere in its source: top level, inside functions and in
# `if TYPE_CHECKING:` blocks. Type-only imports count on purpose: a cycle there is the same coupling
# of two modules (each must be read to understand the other), it only hides from the interpreter.
# Not counted: the parent packages Python imports implicitly on the way to a submodule (importing
# `a.b.c` is an edge to `a.b.c`, not to `a.b`), as in import-linter and every other import graph tool.


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Every dllmflow module `module` imports; `from pkg import name` is the submodule `pkg.name`
    when that is a module, else `pkg`."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .base import X`, `from .. import y`
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {name for name in found if name in known and name != module}


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    return {
        name: _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in files.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one closed cycle
    through its modules (the path a reader follows), sorted for a stable message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_one_cycle(graph, c) for c in components if len(c) > 1)


def _describe(graph: dict[str, set[str]], cycle: list[str]) -> str:
    """The cycle, and the rest of its strongly connected component when that holds more modules."""
    component = _component_of(graph, cycle[0])
    rest = sorted(component - set(cycle))
    return " -> ".join(cycle) + (f"  (same component: {', '.join(rest)})" if rest else "")


def _component_of(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that reach `start` and are reached from it."""

    def reach(edges: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    reverse: dict[str, set[str]] = {v: set() for v in graph}
    for v, ws in graph.items():
        for w in ws:
            reverse[w].add(v)
    return reach(graph) & reach(reverse)


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module: start -> ... -> start (breadth first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"not a cycle: {component}")


def test_cycle_finder_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    both = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}  # one component, two shortest cycles
    assert _cycles(both) == [["a", "b", "a"]]
    assert _describe(both, ["a", "b", "a"]) == "a -> b -> a  (same component: c)"
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_relative_imports_are_edges():
    src = (
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "from .base import X\nfrom . import loop\n"
        "if TYPE_CHECKING:\n    from dllmflow.settings import Settings\n"
        "def f():\n    import dllmflow.errors\n    from dllmflow.diffusion import modes\n"
    )
    known = {
        "dllmflow.diffusion.samplers.base", "dllmflow.diffusion.samplers.loop", "dllmflow.settings",
        "dllmflow.errors", "dllmflow.diffusion", "dllmflow.diffusion.modes", "dllmflow.diffusion.samplers",
    }  # fmt: skip
    assert _imports(ast.parse(src), "dllmflow.diffusion.samplers.llada", False, known) == known - {
        "dllmflow.diffusion", "dllmflow.diffusion.samplers",
    }  # fmt: skip


def test_no_import_cycles_lazy_imports_included():
    graph = _import_graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        "  " + _describe(graph, c) for c in cycles
    )
