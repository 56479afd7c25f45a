"""The named blocks of subengine/db/sql/*.sql: statements, and the parts they share."""

from __future__ import annotations

import re

from subengine.db._sql import SQL, _blocks, names


def test_a_part_is_no_statement_and_stands_where_a_statement_names_it() -> None:
    sql = SQL("tenant one")
    assert "ds_row" not in names() and "ds_row_from" not in names()
    locking = sql.text("ds_lock_stream").decode()
    # the part's text, its schema quoted as the statement's own
    assert 'FROM "tenant one".durable_streams d' in locking
    assert "inherited.floors" in locking and locking.rstrip().endswith("FOR UPDATE OF d")
    assert "{" not in locking
    # every statement that names the parts reads the same columns from the same rows
    shared = locking[: locking.index(" WHERE d.path")]
    assert shared in sql.text("ds_stream").decode()
    live = sql.text("ds_stream_and_json").decode()
    columns, rows = shared.split("\n  FROM ", 1)
    assert live.startswith(columns + ", messages.positions, messages.texts")
    assert "  FROM " + rows in live


def test_every_part_is_placed_by_some_statement() -> None:
    blocks, parts = _blocks()
    placed = {name for text in blocks.values() for name in re.findall(r"\{(\w+)\}", text)}
    assert set(parts) <= placed, set(parts) - placed
