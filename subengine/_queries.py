"""The named queries' text by schema and name (being replaced by `subengine._sql`)."""

from __future__ import annotations

from subengine._sql import SQL


def query(schema: str, name: str) -> bytes:
    """The query `name` for tables in `schema`, ready to execute."""
    return SQL(schema).text(name)
