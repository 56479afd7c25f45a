"""The layers of DESIGN.md ("Layers"), read from the source: imports point one way, only
the SQL layer executes SQL, and only `_connection` opens connections. No database."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "subengine"

# Lower layers first; a module may import only from its own layer or those below it.
LAYERS: dict[str, int] = {
    # vocabulary: events, declarations, records, errors, settings, names
    **dict.fromkeys(
        [
            "_errors",
            "_names",
            "_events",
            "_declarations",
            "_records",
            "_settings",
            "_logging",
            "_cursor",
            "_gateway_cursor",
        ],
        0,
    ),
    # the SQL layer, and the one owner of connections
    **dict.fromkeys(["_sql", "_connection", "_embedded"], 1),
    # one module per concept
    **dict.fromkeys(
        [
            "_append",
            "_read",
            "_streams",
            "_subscriptions",
            "_operations",
            "_locks",
            "_metrics",
            "_migrate",
            "_reset",
            "_orm",
            "_append_async",
            "_listener",
            "_tail",
            "_retention",
            "_stream_deletion",
            "_gateway_keys",
            "_webhooks",
        ],
        2,
    ),
    **dict.fromkeys(["_engine", "_async_engine"], 3),
    **dict.fromkeys(["_worker", "_app"], 4),
    # entry points: the package's public face and the Spark data source
    "__init__": 5,
    **dict.fromkeys(
        [
            "spark.__init__",
            "spark._source",
            "spark._store",
            "spark._staging",
            "spark._rows",
            "spark._offsets",
            "spark._binary_copy",
            "spark._options",
        ],
        5,
    ),
    # the HTTP gateway and its Python client (both use the cursor of _gateway_cursor)
    **dict.fromkeys(
        [
            "gateway.__init__",
            "gateway._app",
            "gateway._auth",
            "gateway._callbacks",
            "gateway._connections",
            "gateway._delivery",
            "gateway._metrics",
            "gateway._hub",
            "gateway._reading",
            "gateway._serve",
            "gateway._sse",
            "client.__init__",
            "client._async",
            "client._core",
            "client._errors",
            "client._items",
            "client._sync",
            "client._webhooks",
        ],
        5,
    ),
}
SQL_EXECUTORS = frozenset({"execute", "executemany", "copy", "send_query"})


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def modules() -> dict[str, ast.Module]:
    return {
        module_name(path): ast.parse(path.read_text("utf-8"), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _resolve(name: str) -> str | None:
    """The subengine module `name` (dotted, absolute) means, relative to the package."""
    if name == "subengine":
        return "__init__"
    if not name.startswith("subengine."):
        return None
    inner = name.removeprefix("subengine.")
    return f"{inner}.__init__" if inner in {"spark", "gateway", "client"} else inner


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """Every subengine module `tree` imports, at the top or inside functions (under
    TYPE_CHECKING too: an annotation still names the layer it depends on)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from subengine import _read` depends on _read; `from subengine._read import
            # read_after` and `from subengine import Engine` on the module named
            base = node.module
            names = [
                f"{base}.{alias.name}" if _resolve(f"{base}.{alias.name}") in known else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            module = _resolve(name)
            if module in known:
                found.add(module)
    return found


def graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: imports(tree, known) - {name} for name, tree in trees.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def test_there_is_no_import_cycle_inside_subengine() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_has_a_layer() -> None:
    assert sorted(set(modules()) - set(LAYERS)) == []


def test_modules_import_only_from_their_layer_or_below() -> None:
    upward = [
        f"{module} (layer {LAYERS[module]}) imports {target} (layer {LAYERS[target]})"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if LAYERS[target] > LAYERS[module]
    ]
    assert upward == []


@pytest.mark.parametrize("lower", ["_engine", "_subscriptions", "_operations", "_reset"])
def test_the_engine_and_the_data_modules_never_import_the_worker_or_the_registry(
    lower: str,
) -> None:
    assert graph()[lower] & {"_worker", "_app"} == set()


def _calls(tree: ast.Module) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _attribute(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def test_only_the_sql_layer_executes_sql() -> None:
    outside = [
        f"{module}:{call.lineno} .{_attribute(call)}()"
        for module, tree in sorted(modules().items())
        if module != "_sql"
        for call in _calls(tree)
        if _attribute(call) in SQL_EXECUTORS
    ]
    assert outside == []


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def test_only_the_connection_module_opens_connections() -> None:
    opening = {
        "psycopg.connect",
        "psycopg.Connection.connect",
        "psycopg.AsyncConnection.connect",
        "AsyncConnection.connect",
        "Connection.connect",
    }
    outside = [
        f"{module}:{call.lineno} {_dotted(call.func)}()"
        for module, tree in sorted(modules().items())
        if module != "_connection"
        for call in _calls(tree)
        if _dotted(call.func) in opening
    ]
    assert outside == []
