"""The app's modules import each other in one direction: no import cycle (the first version broke a
pages <-> pages_analyses <-> pages_tour cycle with a late import), no late import inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> tuple[set[str], list[int]]:
    """(app modules imported at module level, line numbers of imports of app modules inside functions)."""
    tree = ast.parse(path.read_text())
    top, late = set(), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if isinstance(node, ast.ImportFrom) and node.module:  # `from app.routers import pages_analyses`
            names += [f"{node.module}.{a.name}" for a in node.names]
        found = {n for n in names if n in known}
        if not found:
            continue
        if node.col_offset == 0:
            top |= found
        else:
            late.append(node.lineno)
    return top, late


def test_no_import_cycle_and_no_late_import() -> None:
    files = {module_name(p): p for p in APP.rglob("*.py")}
    known = set(files)
    graph, late = {}, {}
    for name, path in files.items():
        graph[name], lines = imports(path, known)
        if lines:
            late[name] = lines
    assert late == {}
    assert len(graph) > 20 and "app.routers.pages_analyses" in graph["app.routers.pages"]  # the graph is real

    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] - {node}):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
