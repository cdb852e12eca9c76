"""Follow a checkpoint through the package: the calls that pass it on, the modules they cross, and how
often the path goes back into a module it had already left (issue #51's measure of the evaluate path).

    python scripts/call_path.py [-v]                             # the two evaluate entries (-v: each call)
    python scripts/call_path.py --src /tmp/old/src               # another tree (`git archive REV src`)

Static (ast), from an entry function and its parameter that holds the checkpoint. A value carries it when
bound to it or built from it: a name assigned one, `Path(..)`, `str(..)`, `p / "x"`, `.resolve()`, a
list or an object holding one, what a package function returns when its return statements carry what it
was handed (`resolve_checkpoint(p)` does; `resolve_prepared_dir(checkpoint, ..)`, naming it only in a
message, does not), an attribute of a package object its class types as a path or checkpoint (`ckpt.path`,
not `ckpt.settings`). Followed, in the order they run, depth first, each function once per set of
carrying parameters: every call of a package function with a carrying argument, a method called on a
carrying package object (attribute reads, properties included, are not calls), and a lookup in a
module-level dict of functions (`OTHER_EVALUATIONS.get(name, default)`: every entry). `isinstance` of a
value whose class is known (a `ResolvedCheckpoint` handed on) takes its branch only. A call into another
module the walk had entered before is a back-edge; each one counts, so a value resolved again, or handed
back and forth, costs one each time. tests/unit/test_call_path.py holds `measure` to its ceiling.
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
ENTRIES = ("dllmflow.workflow.finetune:evaluate_sampler:run_dir", "dllmflow.workflow.grpo:evaluate:run_dir")
CARRYING_TYPES = ("Path", "ResolvedCheckpoint", "PathLike")  # a field typed so holds the checkpoint
PATH_WRAPPERS = {"Path", "str", "fspath"}  # builtins whose result is still the path
PATH_METHODS = {"resolve", "absolute", "expanduser"}
Def = tuple[str, str]  # (module, qualname)
Carrying = dict[str, "Def | None"]  # parameter -> the package class its value is known to be, if any


# ---- the package's modules ------------------------------------------------------------------------


@dataclass
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)  # qualname -> FunctionDef / ClassDef
    fields: dict[str, ast.expr] = field(default_factory=dict)  # "Class.field" -> its annotation
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (module, attr|None)
    dicts: dict[str, list[ast.expr]] = field(default_factory=dict)  # module-level dict of functions


@cache
def load_module(name: str) -> Module | None:
    rel = Path(*name.split("."))
    for path, is_package in ((SRC / rel / "__init__.py", True), (SRC / rel.with_suffix(".py"), False)):
        if path.is_file():
            return _index(Module(name, is_package, ast.parse(path.read_text(), str(path))))
    return None


def _index(mod: Module) -> Module:
    for node in mod.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.defs[node.name] = node
            for item in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    mod.defs[f"{node.name}.{item.name}"] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    mod.fields[f"{node.name}.{item.target.id}"] = item.annotation
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod.imports.update(import_names(node, mod))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            funcs = [v for v in node.value.values if isinstance(v, (ast.Name, ast.Attribute))]
            mod.dicts.update({t.id: funcs for t in node.targets if isinstance(t, ast.Name) and funcs})
    return mod


def import_names(node: ast.Import | ast.ImportFrom, mod: Module) -> dict[str, tuple[str, str | None]]:
    """name bound -> (module, attribute or None for the module itself)."""
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        return {a.asname: (a.name, None) for a in node.names if a.asname}
    base = node.module or ""
    if node.level:  # relative: from the module's package up
        parts = mod.name.split(".")[: len(mod.name.split(".")) - node.level + mod.is_package]
        base = ".".join(parts + ([node.module] if node.module else []))
    for a in node.names:
        is_module = load_module(f"{base}.{a.name}") is not None
        out[a.asname or a.name] = (f"{base}.{a.name}", None) if is_module else (base, a.name)
    return out


def find_def(module: str, name: str, depth: int = 0) -> Def | None:
    """(module, qualname) where `module.name` is defined, through re-exports."""
    mod = load_module(module) if module.startswith(PACKAGE) and depth < 8 else None
    if mod is not None and name in mod.defs:
        return module, name
    target, attr = mod.imports.get(name, (None, None)) if mod is not None else (None, None)
    return find_def(target, attr, depth + 1) if attr else None


def _mentions_carrying_type(annotation: ast.expr | None) -> bool:
    return annotation is not None and any(w in ast.unparse(annotation) for w in CARRYING_TYPES)


# ---- what a function returns --------------------------------------------------------------------

_RETURNS: dict[tuple, bool] = {}


def returns_carrying(module: str, qual: str, bound: Carrying) -> bool:
    """Whether `module.qual`, handed the checkpoint in `bound`, returns a value that carries it."""
    key = (module, qual, frozenset(bound.items()))
    if key not in _RETURNS:
        _RETURNS[key] = False  # a recursive call: not carrying until shown
        node = load_module(module).defs[qual]
        walker = Walker(load_module(module), node, bound)
        walker.calls()
        _RETURNS[key] = walker.returns
    return _RETURNS[key]


# ---- one function's calls -----------------------------------------------------------------------


class Walker:
    """The calls in one function that receive the checkpoint, in the order they run."""

    def __init__(self, mod: Module, fn: ast.FunctionDef, carrying: Carrying):
        self.mod, self.fn, self.carrying = mod, fn, set(carrying)
        self.local_imports: dict[str, tuple[str, str | None]] = {}
        self.dispatch: dict[str, list[ast.expr]] = {}  # local name -> functions of a module-level dict
        self.types: dict[str, Def] = {}  # local name -> the package class it may hold (its annotation)
        self.known: dict[str, Def] = {k: v for k, v in carrying.items() if v}  # ... that it does hold
        self.returns = False  # a return statement hands back a carrying value
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self.local_imports.update(import_names(node, mod))
        for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            if a.annotation is not None and (cls := self._class_named(a.annotation, mod.name)):
                self.types[a.arg] = cls
        qual = next((q for q, n in mod.defs.items() if n is fn), fn.name)
        if "self" in carrying and "." in qual:
            self.known["self"] = (mod.name, qual.split(".")[0])
        self.types.update(self.known)

    def calls(self) -> list[tuple[str, str, Carrying, int]]:
        """(callee module, callee, its parameters that receive the checkpoint, line) per call."""
        out: list[tuple[str, str, Carrying, int]] = []
        self.done = False  # a narrowed branch returned: the statements after it do not run
        for stmt in self.fn.body:
            if self.done:
                break
            self._stmt(stmt, out)
        return out

    def _stmt(self, stmt: ast.AST, out: list) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        if isinstance(stmt, ast.If) and (taken := self._decide(stmt.test)) is not None:
            branch = stmt.body if taken else stmt.orelse  # narrowed by isinstance: one branch runs
            for child in branch:
                self._stmt(child, out)
            self.done = bool(branch) and isinstance(branch[-1], (ast.Return, ast.Raise))
            return
        for node in self._uses_in(stmt):
            self._call(node, out)
        if isinstance(stmt, ast.Return) and self.carries(stmt.value):
            self.returns = True
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
            if isinstance(child, (ast.stmt, ast.excepthandler)) and not self.done:
                self._stmt(child, out)

    def _assign(self, targets: list[ast.expr], value: ast.expr) -> None:
        self._note_dispatch(targets, value)
        for target in targets:
            if isinstance(target, ast.Name):
                if self.carries(value):
                    self.carrying.add(target.id)
                    if (cls := self._type_of(value)) is not None:
                        self.types[target.id] = self.known[target.id] = cls
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                for t, v in zip(target.elts, value.elts):
                    self._assign([t], v)
            elif isinstance(target, ast.Tuple) and self._returns_carrying(value):
                self._unpack(target, value)

    def _unpack(self, target: ast.Tuple, value: ast.Call) -> None:
        """(export, lineage) = resolve_init_from(...): the elements its `tuple[...]` annotation types
        as a path or a checkpoint."""
        for module, qual in self.callees(value):
            returns = getattr(load_module(module).defs[qual], "returns", None)
            if not (isinstance(returns, ast.Subscript) and isinstance(returns.slice, ast.Tuple)):
                continue
            for t, annotation in zip(target.elts, returns.slice.elts):
                if isinstance(t, ast.Name) and _mentions_carrying_type(annotation):
                    self.carrying.add(t.id)
                    if (cls := self._class_named(annotation, module)) is not None:
                        self.types[t.id] = cls

    def _note_dispatch(self, targets: list[ast.expr], value: ast.expr) -> None:
        lookup = getattr(value.func if isinstance(value, ast.Call) else value, "value", None)
        if isinstance(lookup, ast.Name) and lookup.id in self.mod.dicts:
            funcs = list(self.mod.dicts[lookup.id])
            if isinstance(value, ast.Call) and len(value.args) > 1:  # `.get(name, default)`
                funcs.append(value.args[1])
            for target in targets:
                if isinstance(target, ast.Name):
                    self.dispatch[target.id] = funcs

    def carries(self, expr: ast.expr | None) -> bool:
        if expr is None:
            return False
        if isinstance(expr, ast.Name):
            return expr.id in self.carrying
        if isinstance(expr, ast.Attribute):
            return self._attribute_carries(expr)
        if isinstance(expr, (ast.Subscript, ast.Starred)):
            return self.carries(expr.value)
        if isinstance(expr, ast.BinOp):  # `run / "checkpoints"`
            return self.carries(expr.left)
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return any(self.carries(e) for e in expr.elts)
        if isinstance(expr, ast.BoolOp):
            return any(self.carries(v) for v in expr.values)
        if isinstance(expr, ast.IfExp):
            taken = self._decide(expr.test)
            if taken is not None:
                return self.carries(expr.body if taken else expr.orelse)
            return self.carries(expr.body) or self.carries(expr.orelse)
        if isinstance(expr, ast.NamedExpr):
            return self.carries(expr.value)
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute) and func.attr in PATH_METHODS and self.carries(func.value):
                return True
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in PATH_WRAPPERS and expr.args and self.carries(expr.args[0]):
                return True
            return self._returns_carrying(expr)
        return False

    def _attribute_carries(self, expr: ast.Attribute) -> bool:
        if not self.carries(expr.value):
            return False
        owner = expr.value.id if isinstance(expr.value, ast.Name) else None
        if owner not in self.types:
            return True  # an attribute of a path (`.parent`) is still the path
        mod, key = load_module(self.types[owner][0]), f"{self.types[owner][1]}.{expr.attr}"
        return _mentions_carrying_type(mod.fields.get(key, getattr(mod.defs.get(key), "returns", None)))

    def _returns_carrying(self, expr: ast.expr) -> bool:
        if not isinstance(expr, ast.Call) or not any(self.carries(a) for a in _arguments(expr)):
            return False
        for module, qual in self.callees(expr):
            node = load_module(module).defs[qual]
            if isinstance(node, ast.ClassDef):  # an object built with it holds it
                return True
            if returns_carrying(module, qual, self._bound(expr, load_module(module), qual)):
                return True
        return False

    def _decide(self, test: ast.expr) -> bool | None:
        """`isinstance(name, Class)` (or its `not`) of a name whose class is known: which way it goes."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self._decide(test.operand)
            return None if inner is None else not inner
        name = (
            getattr(test.args[0], "id", None) if isinstance(test, ast.Call) and len(test.args) == 2 else None
        )
        if (
            getattr(test, "func", None) is None
            or getattr(test.func, "id", "") != "isinstance"
            or name not in self.known
        ):
            return None
        classes = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
        named = [self._name(c.id) for c in classes if isinstance(c, ast.Name)]
        return self.known[name] in named

    def _type_of(self, value: ast.expr) -> Def | None:
        """The package class a carrying value is an instance of, when its producer says so."""
        if isinstance(value, ast.Name):
            return self.known.get(value.id)
        if isinstance(value, ast.BoolOp):
            return next((t for v in value.values if (t := self._type_of(v))), None)
        if isinstance(value, ast.IfExp):
            taken = self._decide(value.test)
            branches = {True: [value.body], False: [value.orelse]}.get(taken, [value.body, value.orelse])
            return next((t for v in branches if (t := self._type_of(v))), None)
        if (
            isinstance(value, ast.Attribute)
            and isinstance(value.value, ast.Name)
            and value.value.id in self.types
        ):
            module, cls = self.types[value.value.id]
            annotation = load_module(module).fields.get(f"{cls}.{value.attr}")
            return self._class_named(annotation, module) if annotation is not None else None
        if isinstance(value, ast.Call):
            for module, qual in self.callees(value):
                node = load_module(module).defs[qual]
                if isinstance(node, ast.ClassDef):
                    return module, qual
                if getattr(node, "returns", None) is not None:
                    return self._class_named(node.returns, module)
        return None

    def _class_named(self, annotation: ast.expr, module: str) -> Def | None:
        """A package class an annotation names (the first)."""
        mod = load_module(module)
        for node in ast.walk(annotation):
            name = node.id if isinstance(node, ast.Name) else getattr(node, "value", None)
            if not isinstance(name, str):
                continue
            bound = mod.imports.get(name) or (self.local_imports.get(name) if mod is self.mod else None)
            found = find_def(*bound) if bound and bound[1] else (module, name) if name in mod.defs else None
            if found and isinstance(load_module(found[0]).defs[found[1]], ast.ClassDef):
                return found
        return None

    def callees(self, call: ast.Call) -> list[Def]:
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
    def _member(cls: Def, attr: str) -> list[Def]:
        qual = f"{cls[1]}.{attr}"
        return [(cls[0], qual)] if qual in load_module(cls[0]).defs else []

    def _name(self, name: str) -> Def | None:
        bound = self.local_imports.get(name) or self.mod.imports.get(name)
        if bound is not None:
            return find_def(*bound) if bound[1] else None
        return (self.mod.name, name) if name in self.mod.defs else None

    def _call(self, call: ast.Call, out: list) -> None:
        owner = call.func.value if isinstance(call.func, ast.Attribute) else None
        on_object = isinstance(owner, ast.Name) and owner.id in self.types and self.carries(owner)
        if not on_object and not any(self.carries(a) for a in _arguments(call)):
            return
        for module, qual in self.callees(call):
            params = self._bound(call, load_module(module), qual)
            if on_object and "." in qual:
                params["self"] = self.known.get(owner.id)
            out.append((module, qual, params, call.lineno))

    def _uses_in(self, stmt: ast.AST) -> list[ast.Call]:
        """The calls of one statement's own expressions (not its nested statements), in the order they
        run: a call's function and arguments before the call; of a narrowed `a if isinstance(..) else b`,
        the branch taken."""
        found: list[ast.Call] = []

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.IfExp) and (taken := self._decide(node.test)) is not None:
                visit(node.body if taken else node.orelse)
                return
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.stmt, ast.excepthandler)):
                    visit(child)
            if isinstance(node, ast.Call):
                found.append(node)

        for child in ast.iter_child_nodes(stmt):
            if not isinstance(child, (ast.stmt, ast.excepthandler)):
                visit(child)
        return found

    def _bound(self, call: ast.Call, mod: Module, qual: str) -> Carrying:
        """The callee's parameters that receive the checkpoint, with the class each value is known to be."""
        node = (
            mod.defs.get(f"{qual}.__init__") if isinstance(mod.defs[qual], ast.ClassDef) else mod.defs[qual]
        )
        if node is None:  # a dataclass: its fields hold it, no body runs
            return {}
        args = node.args
        positional = [a.arg for a in args.posonlyargs + args.args]
        if "." in qual and positional and positional[0] in ("self", "cls"):
            positional = positional[1:]
        names = positional + [a.arg for a in args.kwonlyargs]
        bound: Carrying = {}
        for i, a in enumerate(call.args):
            if isinstance(a, ast.Starred) or not self.carries(a):
                continue
            if i < len(positional):
                bound[positional[i]] = self._type_of(a)
            elif args.vararg is not None:
                bound[args.vararg.arg] = None
        for k in (k for k in call.keywords if self.carries(k.value)):
            if k.arg in names:
                bound[k.arg] = self._type_of(k.value)
            elif args.kwarg is not None:
                bound[args.kwarg.arg] = None
        return bound


def _arguments(call: ast.Call) -> list[ast.expr]:
    return [a.value if isinstance(a, (ast.Starred, ast.keyword)) else a for a in [*call.args, *call.keywords]]


# ---- the walk -----------------------------------------------------------------------------------


@dataclass
class Walk:
    """One walk: each step (caller module, caller, callee module, callee, line), in the order taken."""

    steps: list[tuple[str, str, str, str, int]] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)  # in the order first entered
    back_edges: list[tuple[str, str, str, str, int]] = field(default_factory=list)


def measure(entry: str, param: str) -> Walk:
    """The walk from `entry` ("package.module:function") with `param` holding the checkpoint."""
    module, qual = entry.split(":")
    walk = Walk(modules=[module])
    _walk(module, qual, {param: None}, walk, set())
    return walk


def _walk(module: str, qual: str, carrying: Carrying, walk: Walk, seen: set) -> None:
    key = (module, qual, frozenset(carrying.items()))
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
        walk.steps.append(step := (module, qual, callee_module, callee, line))
        if callee_module != module and callee_module in walk.modules:
            walk.back_edges.append(step)
        elif callee_module != module:
            walk.modules.append(callee_module)
        _walk(callee_module, callee, params, walk, seen)


def report(entry: str, param: str, verbose: bool = False) -> str:
    walk = measure(entry, param)
    short = lambda m: m.removeprefix(f"{PACKAGE}.")  # noqa: E731
    back = lambda step: "  <- back" if step in walk.back_edges else ""  # noqa: E731
    lines = [f"{entry} ({param}): {len(walk.modules)} modules crossed, {len(walk.back_edges)} back-edges, "
             f"{len(walk.steps)} calls followed"]  # fmt: skip
    if verbose:
        lines.append("  modules: " + " ".join(map(short, walk.modules)))
        lines += [
            f"  {short(a)}.{b}:{n} -> {short(c)}.{d}{back((a, b, c, d, n))}" for a, b, c, d, n in walk.steps
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global SRC
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entries", nargs="*", help="module:function:param (default: the evaluate entries)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every call followed")
    parser.add_argument("--src", type=Path, help="the source tree to measure (default: this checkout's src)")
    args = parser.parse_args(argv)
    if args.src is not None:
        SRC = args.src.resolve()
        load_module.cache_clear()
        _RETURNS.clear()
    for spec in args.entries or ENTRIES:
        module, fn, param = spec.split(":")
        print(report(f"{module}:{fn}", param, args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
