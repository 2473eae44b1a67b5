"""No two files of the package import each other, directly or around a circle.

The package is a stack (errors, identity, wire -> net -> dht -> averaging -> training -> node,
integrations, web -> the command line): arrows point down only. A circle of imports means two files
that cannot be read, tested or replaced one without the other, whatever Python lets run.

What counts as an import of file A by file B, read from B's source with ``ast`` (nothing is executed):

- every ``import`` and ``from ... import`` statement anywhere in the file: at the top, inside a function
  (a lazy import that only exists to dodge a circle at load time is still the circle), and inside
  ``if TYPE_CHECKING:`` (a type that names a higher layer is still an arrow pointing up);
- ``from P import name`` is an import of ``P.name`` when that is a module of the package, else of ``P``
  (its ``__init__.py``: the name is defined or re-exported there);
- importing ``P.Q.R`` is an import of that file alone: the parent packages' ``__init__.py`` files that
  Python runs on the way are not counted (a package's ``__init__`` re-exporting its own modules would
  otherwise close a circle with each of them).

Imports of other packages (the standard library, torch, trio) are not counted. ``python
tests/unit/test_imports.py`` prints every circle, one per strongly connected group of files.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGE = "p2ptrain"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# Circles that still exist, each with the reason: {frozenset of module names: why}. None left.
KNOWN: dict[frozenset[str], str] = {}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_package(name: str, known: dict[str, Path]) -> bool:
    return known[name].name == "__init__.py"


def imports_of(name: str, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports (see the module docstring for the rules)."""
    tree = ast.parse(known[name].read_text(), filename=str(known[name]))
    here = name if _is_package(name, known) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_nearest(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in known else _nearest(source, known))
    found.discard("")
    found.discard(name)  # (a package importing its own names is no circle)
    return found


def _nearest(dotted: str, known: dict[str, Path]) -> str:
    """``dotted`` if it is one of the package's modules; "" for another package."""
    return dotted if dotted in known else ""


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, known) for name in known}


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's groups of modules that reach each other (only groups of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    counter = 0

    def visit(v: str) -> None:  # (recursion depth is bounded by the package's size)
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def shortest_circle(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """One shortest circle inside a strongly connected group, as ``[a, b, ..., a]``."""
    best: list[str] = []
    for start in sorted(group):
        parent = {start: start}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if start in edges[v]:  # back to the start: the path to v, closed
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                circle = [*reversed(path), start]
                if not best or len(circle) < len(best):
                    best = circle
                break
            for w in sorted(edges[v] & group):
                if w not in parent:
                    parent[w] = v
                    queue.append(w)
    return best


def circles(edges: dict[str, set[str]] | None = None) -> Iterator[tuple[frozenset[str], list[str]]]:
    """Each strongly connected group of modules, with one shortest circle through it."""
    edges = graph() if edges is None else edges
    for group in strongly_connected(edges):
        yield frozenset(group), shortest_circle(group, edges)


def _describe(groups: Iterable[tuple[frozenset[str], list[str]]]) -> str:
    lines = []
    for group, circle in groups:
        lines.append(f"{' -> '.join(circle)}  (a group of {len(group)}: {', '.join(sorted(group))})")
    return "\n".join(lines)


# ---- tests ------------------------------------------------------------------------------------------


def test_no_file_of_the_package_imports_itself_around_a_circle() -> None:
    found = [(group, circle) for group, circle in circles() if group not in KNOWN]
    assert not found, "import circles between the package's files:\n" + _describe(found)


def test_the_known_exceptions_still_exist() -> None:
    """An exception that no longer exists is taken off the list (so it cannot hide a new circle)."""
    groups = {group for group, _ in circles()}
    assert not set(KNOWN) - groups, sorted(map(sorted, set(KNOWN) - groups))


def test_the_reader_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """A circle closed by an import inside a function or under TYPE_CHECKING is still found."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .errors import E\n")
    (pkg / "errors.py").write_text("class E(Exception): ...\n")
    (pkg / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.high import H\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "high.py").write_text("def f():\n    from .. import low\n")
    (pkg / "sub" / "alone.py").write_text("from ..errors import E\nfrom . import high\nimport torch\n")
    edges = graph(pkg)
    assert edges["p2ptrain.sub.alone"] == {"p2ptrain.errors", "p2ptrain.sub.high"}
    assert edges[PACKAGE] == {"p2ptrain.errors"}
    found = list(circles(edges))
    assert [group for group, _ in found] == [frozenset({"p2ptrain.low", "p2ptrain.sub.high"})]
    assert found[0][1] in (
        ["p2ptrain.low", "p2ptrain.sub.high", "p2ptrain.low"],
        ["p2ptrain.sub.high", "p2ptrain.low", "p2ptrain.sub.high"],
    )


if __name__ == "__main__":
    found = list(circles())
    print(_describe(found) or "no import circles")
    sys.exit(1 if found else 0)
