"""migrations/schema.sql, today's whole schema in one file to read, is what the migrations
create: a migration added or changed without regenerating it fails here. No database
(`migration_sql` renders the migrations offline)."""

from __future__ import annotations

import difflib
from itertools import islice

import pytest
from helpers import ROOT

import subengine

SCHEMA_FILE = ROOT / "migrations" / "schema.sql"


def without_header(text: str) -> str:
    """schema.sql without its header, the comment lines before the first blank line."""
    header, _, body = text.partition("\n\n")
    assert all(line.startswith("--") for line in header.splitlines()), header
    return body


def test_schema_sql_is_what_the_migrations_create() -> None:
    stored = without_header(SCHEMA_FILE.read_text("utf-8"))
    created = subengine.migration_sql()
    if stored != created:
        diff = difflib.unified_diff(
            stored.splitlines(), created.splitlines(), "schema.sql", "migrations", lineterm=""
        )
        pytest.fail(
            "migrations/schema.sql is not what the migrations create; regenerate it with "
            "scripts/schema and commit it with the migration:\n" + "\n".join(islice(diff, 40))
        )
