"""The package's layers, held by its own import graph.

Every ``import`` and ``from ... import`` of every module is read from its syntax tree: at the top, inside functions
and under ``if TYPE_CHECKING:`` alike (an import a type checker follows, or one deferred into a function to dodge a
cycle at load time, is still a dependency). The graph must have no cycle and must keep the rules below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

import lightning_overflow

P = "lightning_overflow"
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric")
LEAVES = (f"{P}._validation", f"{P}.exceptions")
NUMERICS = (f"{P}.numerics",)
WIRING = (
    f"{P}.health",
    f"{P}.distributed",
    f"{P}.events",
    f"{P}._compat",
    f"{P}.skip",
    f"{P}.policy",
    f"{P}.training_state",
    f"{P}.snapshot_store",
    f"{P}.loggers",
    f"{P}.replicas",
    f"{P}.preserve",
    f"{P}.training_step",
    f"{P}.candidate",
    f"{P}.trial",
    f"{P}.trials",
    *LEAVES,
)
ABOVE_WIRING = tuple(f"{P}.{m}" for m in ("callbacks", "diagnosis", "cli", "report", "demo", "composition"))


@dataclass(frozen=True)
class Rule:
    """Modules under ``importers`` (but not under ``exempt``) may import nothing under ``forbidden`` except what
    lies under ``allowed``. Every name is a module prefix: ``a.b`` covers ``a.b`` and ``a.b.*``."""

    name: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()


# fmt: off
RULES = (
    Rule("leaves import nothing of the package",         LEAVES,      (P,)),
    Rule("numerics are pure torch",                      NUMERICS,    (P,), allowed=(*NUMERICS, *LEAVES)),
    Rule("numerics and leaves load no Lightning",        (*NUMERICS, *LEAVES), LIGHTNING),
    Rule("the wiring knows no callback nor tool",        WIRING,      ABOVE_WIRING),
    Rule("diagnosis knows no callback nor the CLI",      (f"{P}.diagnosis",), (f"{P}.callbacks", f"{P}.cli")),
    Rule("callbacks know no CLI, demo nor report",       (f"{P}.callbacks",), (f"{P}.cli", f"{P}.demo", f"{P}.report")),
    Rule("production code knows no test double",         (P,),        (f"{P}.testing",), exempt=(f"{P}.testing",)),
)
# fmt: on


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def under(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def package_modules(root: Path, package: str = P) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package (``__init__`` names its package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[Edge]:
    """Every import in ``source``, wherever it sits in the tree, as edges to dotted module names.

    ``from a import b`` is an edge to ``a.b`` when that is a module of the package, to ``a`` otherwise; relative
    imports are resolved against the importing module's package.
    """
    base = module if is_package else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges += [Edge(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module or ""
            for alias in node.names:
                child = f"{target}.{alias.name}"
                edges.append(Edge(module, child if child in known else target, node.lineno))
    return edges


def import_edges(root: Path, package: str = P) -> list[Edge]:
    modules = package_modules(root, package)
    known = set(modules)
    edges = []
    for name, path in modules.items():
        edges += imports_of(name, path.read_text(), path.name == "__init__.py", known)
    return edges


def find_cycles(edges: Iterable[Edge], package: str = P) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of package modules, found with Tarjan's
    algorithm; a module importing itself is a cycle too."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if under(e.source, (package,)) and under(e.target, (package,)):
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the package's module count
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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(group, graph) for group in sorted(groups)]


def _cycle_through(group: Sequence[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


def layer_violations(edges: Iterable[Edge], rules: Sequence[Rule] = RULES) -> list[str]:
    found = []
    for e in edges:
        for rule in rules:
            if not under(e.source, rule.importers) or under(e.source, rule.exempt):
                continue
            if under(e.target, rule.forbidden) and not under(e.target, rule.allowed):
                found.append(f"{e.source} imports {e.target} (line {e.line}): {rule.name}")
    return sorted(set(found))


ROOT = Path(lightning_overflow.__file__).parent
EDGES = import_edges(ROOT)


# ---- the package ------------------------------------------------------------------------------------------------
def test_the_graph_was_read() -> None:
    sources = {e.source for e in EDGES}
    assert {f"{P}.numerics.norms", f"{P}.callbacks.auto_clip", f"{P}.health"} <= sources
    assert any(e.source == f"{P}.callbacks.auto_clip" and e.target == f"{P}.numerics.agc" for e in EDGES)


def test_no_import_cycle() -> None:
    cycles = find_cycles(EDGES)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_layers_hold() -> None:
    violations = layer_violations(EDGES)
    assert not violations, "layering violations:\n" + "\n".join(violations)


# ---- the checker itself can fail --------------------------------------------------------------------------------
def test_the_checker_reports_a_cycle_and_a_forbidden_edge() -> None:
    edges = [
        Edge(f"{P}.health", f"{P}.callbacks._base", 460),
        Edge(f"{P}.callbacks._base", f"{P}.health", 13),
        Edge(f"{P}.numerics.norms", f"{P}.callbacks.auto_clip", 5),
        Edge(f"{P}.numerics.norms", f"{P}._validation", 6),
        Edge(f"{P}.numerics.agc", f"{P}.numerics.norms", 7),
        Edge(f"{P}.demo.run", f"{P}.testing.faults", 8),
        Edge(f"{P}.testing.faults", f"{P}.testing.models", 9),
        Edge(f"{P}._validation", "pytorch_lightning", 10),
        Edge(f"{P}.exceptions", "lightning_fabric.utilities", 11),
        Edge(f"{P}.report", "lightning_overflow_extras", 12),  # a prefix that is not the package
    ]
    assert find_cycles(edges) == [[f"{P}.callbacks._base", f"{P}.health", f"{P}.callbacks._base"]]
    assert layer_violations(edges) == [
        f"{P}._validation imports pytorch_lightning (line 10): numerics and leaves load no Lightning",
        f"{P}.demo.run imports {P}.testing.faults (line 8): production code knows no test double",
        f"{P}.exceptions imports lightning_fabric.utilities (line 11): numerics and leaves load no Lightning",
        f"{P}.health imports {P}.callbacks._base (line 460): the wiring knows no callback nor tool",
        f"{P}.numerics.norms imports {P}.callbacks.auto_clip (line 5): numerics are pure torch",
    ]


def test_the_checker_finds_longer_cycles_and_self_imports() -> None:
    a, b, c, d = (f"{P}.{x}" for x in "abcd")
    edges = [Edge(a, b, 1), Edge(b, c, 1), Edge(c, a, 1), Edge(c, d, 1), Edge(d, d, 1)]
    assert find_cycles(edges) == [[a, b, c, a], [d, d]]
    assert find_cycles([Edge(a, b, 1), Edge(b, c, 1)]) == []


def test_imports_are_read_everywhere_in_the_tree(tmp_path: Path) -> None:
    pkg = tmp_path / P
    (pkg / "numerics").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "health.py").write_text("")
    (pkg / "numerics" / "__init__.py").write_text("from .norms import x\n")
    (pkg / "numerics" / "norms.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch.nn as nn\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_overflow.callbacks import AutoClip\n"
        "def f():\n"
        "    from .. import health\n"
        "    from ..exceptions import NonFiniteError\n"
        "    import pytorch_lightning\n"
        "class C:\n"
        "    def g(self):\n"
        "        from . import agc\n"
    )
    edges = import_edges(pkg)
    assert {(e.source, e.target, e.line) for e in edges} == {
        (f"{P}.numerics", f"{P}.numerics.norms", 1),
        (f"{P}.numerics.norms", "typing", 1),
        (f"{P}.numerics.norms", "torch.nn", 2),
        (f"{P}.numerics.norms", f"{P}.callbacks", 4),
        (f"{P}.numerics.norms", f"{P}.health", 6),
        (f"{P}.numerics.norms", f"{P}.exceptions", 7),
        (f"{P}.numerics.norms", "pytorch_lightning", 8),
        (f"{P}.numerics.norms", f"{P}.numerics", 11),  # agc is not a module here: the package it was asked of
    }
    assert layer_violations(edges) == [
        f"{P}.numerics.norms imports {P}.callbacks (line 4): numerics are pure torch",
        f"{P}.numerics.norms imports {P}.health (line 6): numerics are pure torch",
        f"{P}.numerics.norms imports pytorch_lightning (line 8): numerics and leaves load no Lightning",
    ]
    assert find_cycles(edges) == [[f"{P}.numerics", f"{P}.numerics.norms", f"{P}.numerics"]]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_every_rule_names_modules_that_exist(rule: Rule) -> None:
    # A rule over a misspelt module would hold for ever; the optional wiring modules may not exist yet.
    modules = set(package_modules(ROOT))
    optional = {f"{P}.skip", f"{P}.policy", f"{P}.training_state", f"{P}.snapshot_store"}
    for prefix in (*rule.importers, *rule.forbidden, *rule.allowed, *rule.exempt):
        if prefix.startswith(P) and prefix not in optional:
            assert any(under(m, (prefix,)) for m in modules), prefix
