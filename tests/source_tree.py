"""The import graph of src/zerospeed, read from the source with ``ast`` (nothing is imported).

Used by ``test_import_structure.py`` (no cycles, each package within its layer) and
``test_config_reads.py`` (no raw config read below the facade).

An *edge* is one import statement of one file naming another file of the package:

* every ``import zerospeed.x`` / ``from zerospeed.x import y`` / relative ``from .x import y``, at module
  level *and inside functions* (a function-local import is how a cycle hides: it still runs, only later);
  ``from pkg import name`` is an edge to ``pkg/name.py`` when that file exists, else to ``pkg/__init__.py``;
* ``importlib.import_module("zerospeed.x")`` with a literal name, and the module paths of a package's lazy
  table (``_LAZY = {"Name": "zerospeed.x"}`` / ``("zerospeed.x", "attr")``), which are imports by another name;
* imports under ``if TYPE_CHECKING:`` are kept apart (:attr:`Edge.type_checking`): they never run, so they
  cannot make a runtime cycle, but they still say which way a file depends on another.

Importing ``zerospeed.a.b`` also runs ``zerospeed/a/__init__.py``; that implicit parent import is not an
edge (as in grimp / import-linter), since every file would otherwise depend on every package above it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "zerospeed"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    line: int
    local: bool  # inside a function (runs when the function does)
    type_checking: bool  # under ``if TYPE_CHECKING:`` (never runs)

    def where(self) -> str:
        return f"{module_path(self.source)}:{self.line}"


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def module_path(module: str) -> str:
    return str(modules()[module].relative_to(SRC.parent))


def is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


@lru_cache(maxsize=None)
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(target: str, name: str | None) -> str | None:
    """The file ``from target import name`` (or ``import target``) loads, or None outside the package."""
    if target != PACKAGE and not target.startswith(PACKAGE + "."):
        return None
    known = modules()
    if name is not None and f"{target}.{name}" in known:
        return f"{target}.{name}"
    while target not in known and "." in target:  # ``import zerospeed.x.attr`` or a missing file
        target = target.rsplit(".", 1)[0]
    return target if target in known else None


def _raw_imports(module: str) -> list[tuple[str, str | None, int, bool, bool]]:
    """(target, imported name, line, local, type_checking) for each name of each import statement."""
    found: list[tuple[str, str | None, int, bool, bool]] = []
    package = module.split(".") if is_package(module) else module.split(".")[:-1]

    def visit(node: ast.AST, local: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, None, child.lineno, local, type_checking))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:
                    found.append((target, alias.name, child.lineno, local, type_checking))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local, type_checking)
            elif isinstance(child, ast.Call) and _call_name(child) == "import_module" and child.args and \
                    isinstance(child.args[0], ast.Constant) and isinstance(child.args[0].value, str):
                found.append((child.args[0].value, None, child.lineno, True, type_checking))
                visit(child, local, type_checking)
            else:
                inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner, type_checking)

    visit(tree(module), False, False)
    for stmt in tree(module).body:  # a package's lazy table: {"Name": "zerospeed.x" or ("zerospeed.x", "attr")}
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in stmt.targets) \
                and isinstance(stmt.value, ast.Dict):
            for value in stmt.value.values:
                first = value.elts[0] if isinstance(value, ast.Tuple) and value.elts else value
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.append((first.value, None, value.lineno, True, False))
    return found


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


@lru_cache(maxsize=None)
def edges() -> tuple[Edge, ...]:
    """Every import edge between two files of the package (see the module docstring)."""
    result = []
    for module in modules():
        for target, name, line, local, type_checking in _raw_imports(module):
            resolved = _resolve(target, name)
            if resolved is not None and resolved != module:
                result.append(Edge(module, resolved, line, local, type_checking))
    return tuple(result)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node (each one is a cycle or several)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:  # iterative: the graph is deep enough to matter for recursion
        nonlocal counter
        work = [(node, iter(sorted(graph.get(node, ()))))]
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        while work:
            current, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[current] = min(low[current], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[current])
            if low[current] == index[current]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == current:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the first node of ``component`` (to show in a failure message)."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ()) & members):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    return component
