"""The package's shape, read from its source with `ast` (nothing is imported): the layers import downwards only,
no two files import each other through any path, no file imports another's private names, files stay short, and
the code names no working session or device call.

Every `import` / `from ... import` counts, inside functions and under `TYPE_CHECKING` too; a module found through
an importlib string (`plugserve/core/moved.py`) is not an import. `from plugserve.x import y` is an edge to the
module `plugserve.x.y` when that is a module, else to `plugserve.x` (a package's `__init__` is a node too)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "plugserve"
MAX_LINES = 600
LAB_NOTES = re.compile(r"\bsession \d+|\bcalls? \d+", re.IGNORECASE)
# What plugins may take from the registry, which sits above them: the marker their hooks carry.
PLUGIN_REGISTRY_NAMES = frozenset({"hookimpl"})


@dataclass(frozen=True)
class Import:
    """One imported plugserve module (`target`), with the names taken from it (empty: the module itself)."""

    source: str
    target: str
    names: tuple[str, ...]
    line: int

    def where(self) -> str:
        return f"{self.source}:{self.line}"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, source: str, modules: Iterable[str], is_package: bool = False) -> list[Import]:
    """Every plugserve module `source` (the text of `module`) imports, resolved against `modules`."""
    known = set(modules)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = _absolute(node, module, is_package)
            for alias in node.names:
                child = f"{parent}.{alias.name}"
                if child in known:
                    found.append(Import(module, child, (), node.lineno))
                else:
                    found.append(Import(module, parent, (alias.name,), node.lineno))
    return [imp for imp in found if imp.target == "plugserve" or imp.target.startswith("plugserve.")]


@dataclass
class Graph:
    imports: list[Import]
    modules: dict[str, Path]

    @classmethod
    def read(cls, package: Path = PACKAGE) -> Graph:
        modules = source_files(package)
        imports = []
        for name, path in modules.items():
            imports += imports_of(name, path.read_text(), modules, path.name == "__init__.py")
        return cls(imports, modules)

    def edges(self) -> dict[str, set[str]]:
        edges: dict[str, set[str]] = {name: set() for name in self.modules}
        for imp in self.imports:
            if imp.target in self.modules and imp.target != imp.source:
                edges[imp.source].add(imp.target)
        return edges


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_from_core(graph: Graph) -> list[str]:
    return [f"{imp.where()} imports {imp.target}" for imp in graph.imports
            if _under(imp.source, "plugserve.core") and not _under(imp.target, "plugserve.core")]


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """The groups of more than one module that all reach each other (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group, as a path that ends where it starts."""
    return [_circle_in(group, edges) for group in strongly_connected(edges)]


def _circle_in(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle in the strongly connected group {sorted(group)}")


def private_imports(graph: Graph) -> list[str]:
    """Names with one leading underscore (not dunders) taken from another file: `from m import _x`,
    `import m._x`, or `m._x` on a module bound by an import."""
    found = []
    for imp in graph.imports:
        private = [name for name in imp.names if _private(name)]
        private += [part for part in imp.target.split(".") if _private(part) and not imp.names]
        if private and imp.target != imp.source:
            found.append(f"{imp.where()} imports {', '.join(private)} from {imp.target}")
    for name, path in graph.modules.items():
        found += _private_attributes(name, path, graph.modules)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_attributes(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}  # local name -> the plugserve module it holds
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parent = _absolute(node, module, path.name == "__init__.py")
            for alias in node.names:
                if f"{parent}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{parent}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
    return [f"{module}:{node.lineno} reads {bound[node.value.id]}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
            and _private(node.attr) and bound[node.value.id] != module]


# Layer -> the layers it must not import. Layers, top down: server/ > runtime/ > registry.py > plugins/ and
# conformance/ > core/ (DESIGN.md's layout); plugserve.api is the plugin authors' view of registry and core.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "plugserve.runtime": ("plugserve.server", "plugserve.cli", "plugserve.backends_report"),
    "plugserve.registry": ("plugserve.runtime", "plugserve.server", "plugserve.cli", "plugserve.backends_report",
                           "plugserve.api", "plugserve.conformance"),
    "plugserve.api": ("plugserve.runtime", "plugserve.server", "plugserve.cli", "plugserve.backends_report",
                      "plugserve.plugins", "plugserve.conformance"),
    "plugserve.plugins": ("plugserve.runtime", "plugserve.server", "plugserve.cli", "plugserve.backends_report",
                          "plugserve.conformance"),
    "plugserve.conformance": ("plugserve.runtime", "plugserve.server", "plugserve.cli", "plugserve.backends_report"),
}


def layering(graph: Graph) -> list[str]:
    found = []
    for imp in graph.imports:
        for layer, below in FORBIDDEN.items():
            if _under(imp.source, layer):
                found += [f"{imp.where()} ({layer}) imports {imp.target}" for banned in below
                          if _under(imp.target, banned)]
        if _under(imp.source, "plugserve.plugins") and imp.target == "plugserve.registry":
            taken = set(imp.names) - PLUGIN_REGISTRY_NAMES
            if taken or not imp.names:
                found.append(f"{imp.where()} (plugserve.plugins) imports "
                             f"{', '.join(sorted(taken)) or 'the module'} from plugserve.registry "
                             f"(plugins take only {', '.join(sorted(PLUGIN_REGISTRY_NAMES))} from it)")
    return found


def long_files(package: Path = PACKAGE) -> list[str]:
    lengths = {path: len(path.read_text().splitlines()) for path in sorted(package.rglob("*.py"))}
    return [f"{path.relative_to(package.parent)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]


def lab_notes(package: Path = PACKAGE) -> list[str]:
    return [f"{path.relative_to(package.parent)}:{number}: {line.strip()}"
            for path in sorted(package.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if LAB_NOTES.search(line)]


def _report(what: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {what}:\n  " + "\n  ".join(offenders)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph.read()


def test_the_walker_reads_every_kind_of_import_and_not_importlib_strings():
    modules = {"plugserve.core.a", "plugserve.core.b", "plugserve.runtime", "plugserve.runtime.c"}
    source = """
import importlib
from typing import TYPE_CHECKING
import plugserve.core.b
from plugserve.runtime import c, helper
from . import b as bee
if TYPE_CHECKING:
    from plugserve.runtime.c import Thing
def lazy():
    from plugserve.core.b import _hidden
    return importlib.import_module("plugserve.runtime.engine")
"""
    found = {(imp.target, imp.names) for imp in imports_of("plugserve.core.a", source, modules)}
    assert found == {("plugserve.core.b", ()), ("plugserve.runtime.c", ()), ("plugserve.runtime", ("helper",)),
                     ("plugserve.runtime.c", ("Thing",)), ("plugserve.core.b", ("_hidden",))}, found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_core_imports_nothing_above_it(graph):
    assert graph.imports, "no imports read: wrong package path?"
    offenders = upward_from_core(graph)
    assert not offenders, _report("imports from plugserve/core/ of modules above it", offenders)


def test_no_import_circles(graph):
    edges = graph.edges()
    found = [" -> ".join(_circle_in(group, edges)) + f"  (the group: {', '.join(sorted(group))})"
             for group in strongly_connected(edges)]
    assert not found, _report("import circles", found)


def test_no_private_name_imported_across_files(graph):
    offenders = private_imports(graph)
    assert not offenders, _report("private names taken from another file", offenders)


def test_layers_import_downwards(graph):
    offenders = layering(graph)
    assert not offenders, _report("imports against the layering", offenders)


def test_no_file_over_the_line_limit():
    offenders = long_files()
    assert not offenders, _report(f"files in plugserve/ over {MAX_LINES} lines", offenders)


def test_no_session_or_call_numbers_in_the_code():
    offenders = lab_notes()
    assert not offenders, _report("lines naming a session or a call", offenders)
