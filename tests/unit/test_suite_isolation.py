"""The suite's own machinery: a test ends or cancels only its own database's sessions.

With SUBENGINE_TEST_DSN every xdist worker's tests share one server, and pg_stat_activity
lists the sessions of all its databases: a statement that picks the sessions it ends by
name or query alone ends other tests' connections too. One such statement (all of the
server's worker connections) once rolled back the batch of another test's worker that
was finishing its batch after SIGTERM, and that test failed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).parents[1]


def session_picking_statements() -> Iterator[tuple[str, str]]:
    """(where, text) of each string of the tests that passes the pids of the sessions
    pg_stat_activity lists to a function (pg_terminate_backend, pg_cancel_backend); an
    f-string's text has `{}` for what it formats."""
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                 for v in node.values}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in parts:
                    continue
                text = node.value
            else:
                continue
            if "(pid)" in text and "pg_stat_activity" in text:
                yield f"{path.relative_to(TESTS)}:{node.lineno}", text


def test_a_test_ends_only_the_sessions_of_its_own_database() -> None:
    statements = list(session_picking_statements())
    assert len(statements) >= 5  # the scan finds them
    unscoped = [where for where, text in statements if "current_database()" not in text]
    assert unscoped == [], "add `datname = current_database()` to these statements"
