"""The import graph of the repo's packages, read from the source with ``ast`` (every import counts: top-level, in a
function, under ``TYPE_CHECKING``), so nothing is imported: what the layering tests check their rules on."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

Edge = tuple[str, str, int]  # importer, imported module, line


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(*packages: str) -> dict[str, Path]:
    return {module_name(p): p for package in packages for p in sorted((REPO / package).rglob("*.py"))}


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names ``node`` imports: the module imported from and each name imported from it."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: from the importing module's package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [base] + [f"{base}.{a.name}" for a in node.names]


def edges(modules: dict[str, Path], known: dict[str, Path] | None = None) -> list[Edge]:
    """Every import of ``modules``; with ``known``, only the names that are modules of it (a name imported from a
    module that is not itself one, a function or a class, is dropped)."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.extend((module, target, node.lineno) for target in _imported(module, path, node)
                             if target != module and (known is None or target in known))
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def edges_cycle(found: Iterable[Edge]) -> list[str] | None:
    """One import circle among ``found`` edges (importer, target, line), as ``cycle`` gives it, or None."""
    graph: dict[str, set[str]] = {}
    for importer, target, _ in found:
        graph.setdefault(importer, set()).add(target)
    return cycle(graph)
