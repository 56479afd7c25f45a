"""The layers of DESIGN.md ("Layers"), read from the source: a module's layer is its
folder, imports point one way, the client speaks only the vocabulary, only the concept
packages build queries, only the SQL layer executes them, and only `db/_connection`
opens connections. No database.

Each rule is a function over a map of module names to parsed sources, so each is shown
failing on a small made-up package as well as passing on the real one."""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from pathlib import Path

import pytest
from helpers import ROOT, fresh_python

PACKAGE = ROOT / "subengine"

# Lower layers first; a module may import only from its own folder's layer or below.
# A new module inherits its folder's layer.
FOLDERS: dict[str, int] = {
    "model": 0,  # vocabulary: events, declarations, errors, settings, names, cursors, secrets
    "db": 1,  # the SQL layer, connections, migrations, the embedded server, locks
    "streams": 2,  # append, read, tail, listen, retention
    "subscriptions": 3,  # lifecycle, reset, batches, inspection, deletion
    "outside": 4,  # what outside subscribers need stored: API keys, webhooks
    "engine": 5,  # Engine, AsyncEngine
    "worker": 6,  # App, Worker
    "gateway": 7,  # entry points
    "spark": 7,
    "client": 7,  # and it may import only model/ (below)
    "": 8,  # subengine/__init__.py: the public face
}
CONCEPTS = frozenset({"streams", "subscriptions", "outside", "db"})  # may build a Query
SQL_EXECUTORS = frozenset({"execute", "executemany", "copy", "send_query"})
CONNECTION_OPENERS = frozenset(
    {
        "psycopg.connect",
        "psycopg.Connection.connect",
        "psycopg.AsyncConnection.connect",
        "AsyncConnection.connect",
        "Connection.connect",
    }
)

Modules = Mapping[str, ast.Module]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def folder(module: str) -> str:
    """`streams._read` → `streams`; `__init__` (the package's own) → ``."""
    return module.split(".")[0] if "." in module else ""


def layer(module: str) -> int:
    return FOLDERS[folder(module)]


@functools.cache
def package_modules() -> Mapping[str, ast.Module]:
    """The package's modules, parsed once per process (each rule reads the same trees)."""
    return {
        module_name(path): ast.parse(path.read_text("utf-8"), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def parse(sources: Mapping[str, str]) -> dict[str, ast.Module]:
    return {name: ast.parse(source) for name, source in sources.items()}


def _resolve(name: str, known: set[str]) -> str | None:
    """The known module `name` (dotted, absolute) means: a module, or a package's
    `__init__`."""
    if name == "subengine":
        return "__init__"
    if not name.startswith("subengine."):
        return None
    inner = name.removeprefix("subengine.")
    if inner in known:
        return inner
    return f"{inner}.__init__" if f"{inner}.__init__" in known else None


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """Every subengine module `tree` imports, at the top or inside functions (under
    TYPE_CHECKING too: an annotation still names the layer it depends on)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from subengine.streams import _read` depends on streams._read;
            # `from subengine.streams._read import read_after` on the module named
            base = node.module
            names = [
                f"{base}.{alias.name}"
                if _resolve(f"{base}.{alias.name}", known) is not None
                else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            module = _resolve(name, known)
            if module is not None:
                found.add(module)
    return found


def graph(trees: Modules) -> dict[str, set[str]]:
    known = set(trees)
    return {name: imports(tree, known) - {name} for name, tree in trees.items()}


def find_cycle(edges: Mapping[str, set[str]]) -> list[str] | None:
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


def modules_outside_the_folders(trees: Modules) -> list[str]:
    return sorted(name for name in trees if folder(name) not in FOLDERS)


def upward_imports(trees: Modules) -> list[str]:
    return [
        f"{module} ({folder(module) or 'subengine'}/) imports {target} ({folder(target)}/)"
        for module, targets in sorted(graph(trees).items())
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]


def client_imports_beyond_the_model(trees: Modules) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in sorted(graph(trees).items())
        if folder(module) == "client"
        for target in sorted(targets)
        if folder(target) not in {"client", "model"}
    ]


def _calls(tree: ast.Module) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def queries_built_outside_the_concepts(trees: Modules) -> list[str]:
    return [
        f"{module}:{call.lineno} Query()"
        for module, tree in sorted(trees.items())
        if folder(module) not in CONCEPTS
        for call in _calls(tree)
        if _dotted(call.func) in {"Query", "_sql.Query"}
    ]


def sql_executed_outside_the_sql_layer(trees: Modules) -> list[str]:
    return [
        f"{module}:{call.lineno} .{call.func.attr}()"
        for module, tree in sorted(trees.items())
        if module != "db._sql"
        for call in _calls(tree)
        if isinstance(call.func, ast.Attribute) and call.func.attr in SQL_EXECUTORS
    ]


def connections_opened_outside_the_connection_module(trees: Modules) -> list[str]:
    return [
        f"{module}:{call.lineno} {_dotted(call.func)}()"
        for module, tree in sorted(trees.items())
        if module != "db._connection"
        for call in _calls(tree)
        if _dotted(call.func) in CONNECTION_OPENERS
    ]


# The real package


def test_every_module_lives_in_a_layer_folder() -> None:
    assert modules_outside_the_folders(package_modules()) == []


def test_there_is_no_import_cycle_inside_subengine() -> None:
    cycle = find_cycle(graph(package_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_modules_import_only_from_their_layer_or_below() -> None:
    assert upward_imports(package_modules()) == []


def test_the_client_imports_only_the_vocabulary() -> None:
    assert client_imports_beyond_the_model(package_modules()) == []


def test_only_the_concept_packages_build_queries() -> None:
    assert queries_built_outside_the_concepts(package_modules()) == []


def test_only_the_sql_layer_executes_sql() -> None:
    assert sql_executed_outside_the_sql_layer(package_modules()) == []


def test_only_the_connection_module_opens_connections() -> None:
    assert connections_opened_outside_the_connection_module(package_modules()) == []


def test_importing_the_client_loads_neither_psycopg_nor_the_engine() -> None:
    probe = (
        "import sys, subengine.client; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'psycopg', 'psycopg_pool'}"
        " or m.startswith(('subengine.engine', 'subengine.db', 'subengine.streams'))))"
    )
    assert fresh_python(probe) == "[]"


def test_the_command_line_loads_sqlalchemy_only_for_what_needs_it() -> None:
    # SQLAlchemy's import was a third of every command's start-up: only the pals lock
    # provider (a worker's slots) and the ORM helpers need it
    probe = (
        "import sys, subengine, subengine.cli.main; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sqlalchemy', 'pals', 'alembic'}))"
    )
    assert fresh_python(probe) == "[]"


# Each rule fails on a deliberate violation


def test_a_module_outside_the_folders_is_found() -> None:
    trees = parse({"model._events": "", "stray._helper": ""})
    assert modules_outside_the_folders(trees) == ["stray._helper"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_an_upward_import_is_found_in_each_import_form() -> None:
    trees = parse(
        {
            "model._events": "from subengine.streams._read import read_after",
            "db._sql": "from subengine.engine import _engine",
            "streams._read": "import subengine.worker._worker",
            "streams._append": "from subengine.db._sql import Query",  # downward: fine
            "engine._engine": "",
            "worker._worker": "",
        }
    )
    assert upward_imports(trees) == [
        "db._sql (db/) imports engine._engine (engine/)",
        "model._events (model/) imports streams._read (streams/)",
        "streams._read (streams/) imports worker._worker (worker/)",
    ]


def test_a_client_import_beyond_the_model_is_found() -> None:
    trees = parse(
        {
            "client._core": "from subengine.outside._webhooks import new_secret\n"
            "from subengine.model._events import Event",
            "outside._webhooks": "",
            "model._events": "",
        }
    )
    assert client_imports_beyond_the_model(trees) == ["client._core imports outside._webhooks"]


def test_a_query_built_by_the_worker_is_found() -> None:
    trees = parse(
        {
            "worker._worker": "q = Query('read_batch', {})",
            "subscriptions._batches": "q = Query('read_batch', {})",
        }
    )
    assert queries_built_outside_the_concepts(trees) == ["worker._worker:1 Query()"]


def test_sql_executed_outside_the_sql_layer_is_found() -> None:
    trees = parse({"worker._worker": "conn.execute('select 1')", "db._sql": "c.execute(q)"})
    assert sql_executed_outside_the_sql_layer(trees) == ["worker._worker:1 .execute()"]


def test_a_connection_opened_outside_the_connection_module_is_found() -> None:
    trees = parse({"gateway._app": "psycopg.connect('')", "db._connection": "psycopg.connect('')"})
    assert connections_opened_outside_the_connection_module(trees) == [
        "gateway._app:1 psycopg.connect()"
    ]


@pytest.mark.parametrize("module", ["engine._engine", "subscriptions._subscriptions"])
def test_the_engine_and_the_data_modules_never_import_the_worker(module: str) -> None:
    assert {
        target for target in graph(package_modules())[module] if folder(target) == "worker"
    } == set()
