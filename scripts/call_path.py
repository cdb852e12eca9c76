"""Follow a checkpoint through the package: the calls that pass it on, the modules they cross, and how
often the path goes back into a module it had already left (issue #51's measure of the evaluate path).

    python scripts/call_path.py                                  # the two evaluate entries
    python scripts/call_path.py dllmflow.workflow.finetune:evaluate_sampler:run_dir -v

Static (ast), from one entry function and the parameter that holds the checkpoint: in each function
reached, a value carries the checkpoint when it is a parameter bound to it, a name assigned from one,
`Path(...)`/`str(...)` of one, an attribute of one, or the result of a package function annotated to
return a path or a resolved checkpoint (`resolve_checkpoint`, `find_consolidated`, `resolve`). Every
call in the package that receives a carrying argument is followed (each function once per set of
carrying parameters), in source order; the walk is depth first, as the calls run. A call whose callee
sits in another module than its caller, in a module the walk had entered before, goes back into a module
it had left: a back-edge. Dynamic dispatch is followed where it is written as a lookup in a module-level
dict of functions (`OTHER_EVALUATIONS.get(name)`); methods of objects are not followed.

`measure(entry, param)` is what tests/unit/test_call_path.py holds to its ceiling.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "dllmflow"
ENTRIES = (
    "dllmflow.workflow.finetune:evaluate_sampler:run_dir",
    "dllmflow.workflow.grpo:evaluate:run_dir",
)
# A package function whose return annotation names one of these hands back the checkpoint it was given.
CARRYING_RETURNS = ("Path", "ResolvedCheckpoint")
PATH_WRAPPERS = {"Path", "str", "fspath"}  # builtins whose result is still the path
PATH_METHODS = {"resolve", "absolute", "expanduser"}


# ---- the package's modules ------------------------------------------------------------------------


@dataclass
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)  # qualname -> FunctionDef / ClassDef
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (module, attr|None)
    dicts: dict[str, list[ast.expr]] = field(default_factory=dict)  # module-level dict of functions


@cache
def load_module(name: str) -> Module | None:
    rel = Path(*name.split("."))
    for path, is_package in ((SRC / rel / "__init__.py", True), (SRC / rel.with_suffix(".py"), False)):
        if path.is_file():
            mod = Module(name, is_package, ast.parse(path.read_text(), str(path)))
            _index(mod)
            return mod
    return None


def _index(mod: Module) -> None:
    for node in mod.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.defs[node.name] = node
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        mod.defs[f"{node.name}.{item.name}"] = item
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod.imports.update(import_names(node, mod))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            funcs = [v for v in node.value.values if isinstance(v, (ast.Name, ast.Attribute))]
            for target in node.targets:
                if isinstance(target, ast.Name) and funcs:
                    mod.dicts[target.id] = funcs


def import_names(node: ast.Import | ast.ImportFrom, mod: Module) -> dict[str, tuple[str, str | None]]:
    """name bound -> (module, attribute or None for the module itself)."""
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                out[a.asname] = (a.name, None)
        return out
    base = node.module or ""
    if node.level:
        parts = mod.name.split(".")
        parts = parts if mod.is_package else parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    for a in node.names:
        if load_module(f"{base}.{a.name}") is not None:
            out[a.asname or a.name] = (f"{base}.{a.name}", None)
        else:
            out[a.asname or a.name] = (base, a.name)
    return out


def find_def(module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
    """(module, qualname) where `module.name` is defined, through re-exports."""
    mod = load_module(module) if module.startswith(PACKAGE) else None
    if mod is None or depth > 8:
        return None
    if name in mod.defs:
        return module, name
    if name in mod.imports:
        target, attr = mod.imports[name]
        return find_def(target, attr, depth + 1) if attr else None
    return None


# ---- one function's calls -----------------------------------------------------------------------


class Walker:
    """The calls in one function that receive the checkpoint, in source order."""

    def __init__(self, mod: Module, fn: ast.FunctionDef, carrying: set[str]):
        self.mod, self.fn, self.carrying = mod, fn, set(carrying)
        self.local_imports: dict[str, tuple[str, str | None]] = {}
        self.dispatch: dict[str, list[ast.expr]] = {}  # local name -> functions of a module-level dict
        self.types: dict[str, tuple[str, str]] = {}  # local name -> the package class it holds
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.local_imports.update(import_names(node, mod))
        for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            if a.annotation is not None and (cls := self._class_named(a.annotation, mod.name)):
                self.types[a.arg] = cls

    def calls(self) -> list[tuple[str, str, set[str], int]]:
        """(callee module, callee, its parameters that receive the checkpoint, line) per call."""
        out: list[tuple[str, str, set[str], int]] = []
        for stmt in self.fn.body:
            self._stmt(stmt, out)
        return out

    def _stmt(self, stmt: ast.AST, out: list) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        for node in _uses_in(stmt):
            if isinstance(node, ast.Call):
                self._call(node, out)
            else:
                self._property(node, out)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            self._assign(targets, stmt.value)
        if isinstance(stmt, (ast.For, ast.AsyncFor)) and self.carries(stmt.iter):
            self._assign([stmt.target], stmt.iter)
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if item.optional_vars is not None:
                    self._assign([item.optional_vars], item.context_expr)
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, (ast.stmt, ast.excepthandler)):
                self._stmt(child, out)

    def _assign(self, targets: list[ast.expr], value: ast.expr) -> None:
        self._note_dispatch(targets, value)
        for target in targets:
            if isinstance(target, ast.Name):
                if self.carries(value):
                    self.carrying.add(target.id)
                    if (cls := self._type_of(value)) is not None:
                        self.types[target.id] = cls
            elif isinstance(target, ast.Tuple) and self._returns_carrying(value):
                # (export, lineage) = resolve_init_from(...): the path-typed element, the first
                if target.elts and isinstance(target.elts[0], ast.Name):
                    self.carrying.add(target.elts[0].id)

    def _note_dispatch(self, targets: list[ast.expr], value: ast.expr) -> None:
        lookup = (
            value.func.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            else None
        )
        lookup = value.value if isinstance(value, ast.Subscript) else lookup
        if isinstance(lookup, ast.Name) and lookup.id in self.mod.dicts:
            for target in targets:
                if isinstance(target, ast.Name):
                    self.dispatch[target.id] = self.mod.dicts[lookup.id]

    def carries(self, expr: ast.expr | None) -> bool:
        if expr is None:
            return False
        if isinstance(expr, ast.Name):
            return expr.id in self.carrying
        if isinstance(expr, (ast.Attribute, ast.Subscript, ast.Starred)):
            return self.carries(expr.value)
        if isinstance(expr, ast.BoolOp):
            return any(self.carries(v) for v in expr.values)
        if isinstance(expr, ast.IfExp):
            return self.carries(expr.body) or self.carries(expr.orelse)
        if isinstance(expr, ast.NamedExpr):
            return self.carries(expr.value)
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute) and func.attr in PATH_METHODS and self.carries(func.value):
                return True
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in PATH_WRAPPERS and expr.args and self.carries(expr.args[0]):
                return True
            return self._returns_carrying(expr)
        return False

    def _returns_carrying(self, expr: ast.expr) -> bool:
        if not isinstance(expr, ast.Call) or not any(self.carries(a) for a in _arguments(expr)):
            return False
        for module, qual in self.callees(expr):
            node = load_module(module).defs[qual]
            returns = getattr(node, "returns", None)
            text = node.name if isinstance(node, ast.ClassDef) else ast.unparse(returns) if returns else ""
            if any(word in text for word in CARRYING_RETURNS):
                return True
        return False

    def _type_of(self, value: ast.expr) -> tuple[str, str] | None:
        """The package class a carrying value is an instance of, when its producer says so."""
        if isinstance(value, ast.Name):
            return self.types.get(value.id)
        if isinstance(value, ast.BoolOp):
            return next((t for v in value.values if (t := self._type_of(v))), None)
        if isinstance(value, ast.Call):
            for module, qual in self.callees(value):
                node = load_module(module).defs[qual]
                if isinstance(node, ast.ClassDef):
                    return module, qual
                if getattr(node, "returns", None) is not None:
                    return self._class_named(node.returns, module)
        return None

    def _class_named(self, annotation: ast.expr, module: str) -> tuple[str, str] | None:
        """A package class an annotation names (the first)."""
        mod = load_module(module)
        for node in ast.walk(annotation):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.value
                if isinstance(node, ast.Constant)
                else None
            )
            if not isinstance(name, str):
                continue
            bound = mod.imports.get(name) or (self.local_imports.get(name) if mod is self.mod else None)
            found = find_def(*bound) if bound and bound[1] else (module, name) if name in mod.defs else None
            if found and isinstance(load_module(found[0]).defs[found[1]], ast.ClassDef):
                return found
        return None

    def callees(self, call: ast.Call) -> list[tuple[str, str]]:
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in self.dispatch:
                return [d for f in self.dispatch[func.id] for d in self.callees(ast.Call(f, [], []))]
            found = self._name(func.id)
            return [found] if found else []
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in self.types and owner in self.carrying:  # a method of the carrying object
                return self._member(self.types[owner], func.attr)
            bound = self.local_imports.get(owner) or self.mod.imports.get(owner)
            if bound is not None and bound[1] is None:  # module.function
                found = find_def(bound[0], func.attr)
                return [found] if found else []
            cls = self._name(owner)
            if cls is not None:  # Class.classmethod / staticmethod
                return self._member(cls, func.attr)
        return []

    @staticmethod
    def _member(cls: tuple[str, str], attr: str) -> list[tuple[str, str]]:
        qual = f"{cls[1]}.{attr}"
        return [(cls[0], qual)] if qual in load_module(cls[0]).defs else []

    def _name(self, name: str) -> tuple[str, str] | None:
        bound = self.local_imports.get(name) or self.mod.imports.get(name)
        if bound is not None:
            return find_def(*bound) if bound[1] else None
        return (self.mod.name, name) if name in self.mod.defs else None

    def _call(self, call: ast.Call, out: list) -> None:
        on_self = isinstance(call.func, ast.Attribute) and self.carries(call.func.value)
        if not on_self and not any(self.carries(a) for a in _arguments(call)):
            return
        for module, qual in self.callees(call):
            params = self._bound(call, load_module(module), qual)
            if on_self and isinstance(call.func.value, ast.Name) and call.func.value.id in self.types:
                params.add("self")
            out.append((module, qual, params, call.lineno))

    def _property(self, node: ast.Attribute, out: list) -> None:
        """A property of the carrying object read: its getter runs with the object."""
        owner = node.value
        if not (isinstance(owner, ast.Name) and owner.id in self.types and owner.id in self.carrying):
            return
        for module, qual in self._member(self.types[owner.id], node.attr):
            getter = load_module(module).defs[qual]
            decorators = [ast.unparse(d) for d in getattr(getter, "decorator_list", [])]
            if any(d.endswith(("property", "cached_property")) for d in decorators):
                out.append((module, qual, {"self"}, node.lineno))

    def _bound(self, call: ast.Call, mod: Module, qual: str) -> set[str]:
        """The callee's parameters that receive the checkpoint."""
        node = mod.defs[qual]
        if isinstance(node, ast.ClassDef):
            init = mod.defs.get(f"{qual}.__init__")
            if init is None:  # a dataclass: its fields hold it, no body runs
                return set()
            node = init
        args = node.args
        positional = [a.arg for a in args.posonlyargs + args.args]
        if "." in qual and positional and positional[0] in ("self", "cls"):
            positional = positional[1:]
        names = positional + [a.arg for a in args.kwonlyargs]
        bound = set()
        for i, a in enumerate(call.args):
            if isinstance(a, ast.Starred) or not self.carries(a):
                continue
            if i < len(positional):
                bound.add(positional[i])
            elif args.vararg is not None:
                bound.add(args.vararg.arg)
        for k in call.keywords:
            if self.carries(k.value):
                if k.arg in names:
                    bound.add(k.arg)
                elif args.kwarg is not None:
                    bound.add(args.kwarg.arg)
        return bound


def _arguments(call: ast.Call) -> list[ast.expr]:
    return [a.value if isinstance(a, ast.Starred) else a for a in call.args] + [
        k.value for k in call.keywords
    ]


def _uses_in(stmt: ast.AST) -> list[ast.Call | ast.Attribute]:
    """The calls and attribute reads of one statement's own expressions (not its nested statements),
    in source order."""
    found = []
    for child in ast.iter_child_nodes(stmt):
        if isinstance(child, (ast.stmt, ast.excepthandler)):
            continue
        found += [n for n in ast.walk(child) if isinstance(n, (ast.Call, ast.Attribute))]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


# ---- the walk -----------------------------------------------------------------------------------


@dataclass
class Path_:
    """One walk: each step (caller module, callee module, callee, caller line), in the order taken."""

    steps: list[tuple[str, str, str, int]] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # in the order first entered
    back_edges: list[tuple[str, str, str, int]] = field(default_factory=list)


def measure(entry: str, param: str) -> Path_:
    """The walk from `entry` ("package.module:function") with `param` holding the checkpoint."""
    module, qual = entry.split(":")
    path = Path_(modules=[module])
    seen: set[tuple[str, str, frozenset[str]]] = set()
    _walk(module, qual, {param}, path, seen)
    return path


def _walk(module: str, qual: str, carrying: set[str], path: Path_, seen: set) -> None:
    key = (module, qual, frozenset(carrying))
    if key in seen or not carrying:
        return
    seen.add(key)
    mod = load_module(module)
    node = mod.defs[qual]
    if isinstance(node, ast.ClassDef):
        if f"{qual}.__init__" not in mod.defs:
            return
        qual, node = f"{qual}.__init__", mod.defs[f"{qual}.__init__"]
    for callee_module, callee, params, line in Walker(mod, node, carrying).calls():
        step = (module, callee_module, callee, line)
        path.steps.append(step)
        if callee_module != module:
            if callee_module in path.modules:
                path.back_edges.append(step)
            else:
                path.modules.append(callee_module)
        _walk(callee_module, callee, params, path, seen)


def report(entry: str, param: str, verbose: bool = False) -> str:
    path = measure(entry, param)
    lines = [
        f"{entry} ({param}): {len(path.modules)} modules crossed, {len(path.back_edges)} back-edges, "
        f"{len(path.steps)} calls followed"
    ]
    if verbose:
        lines += ["  modules: " + " ".join(m.removeprefix(f"{PACKAGE}.") for m in path.modules)]
        for caller, callee_mod, callee, line in path.steps:
            back = "  <- back" if (caller, callee_mod, callee, line) in path.back_edges else ""
            lines.append(
                f"  {caller.removeprefix(PACKAGE + '.')}:{line} -> {callee_mod.removeprefix(PACKAGE + '.')}.{callee}{back}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entries", nargs="*", help="module:function:param (default: the evaluate entries)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every call followed")
    args = parser.parse_args(argv)
    for spec in args.entries or ENTRIES:
        module, fn, param = spec.split(":")
        print(report(f"{module}:{fn}", param, args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
