"""The named queries of `sql/queries.sql`, rendered once per schema.

Reading every query the engine runs means reading that one file. Queries are rendered
with the schema quoted by `psycopg.sql.Identifier`; values are always bound parameters.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

_BLOCK = re.compile(r"^-- name: (\w+)\n", re.MULTILINE)


@functools.cache
def _templates() -> dict[str, str]:
    text = resources.files("subengine").joinpath("sql/queries.sql").read_text("utf-8")
    parts = _BLOCK.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@functools.cache
def query(schema: str, name: str) -> bytes:
    """The query `name` for tables in `schema`, ready to execute."""
    template = _templates()[name]
    return sql.SQL(template).format(schema=sql.Identifier(schema)).as_bytes(None)
