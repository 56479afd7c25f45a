"""The schema revision this code needs, kept as a constant (db/_migrate.py) so that the
gateway and the schema checks need not load Alembic, is the head of migrations/versions
as Alembic reads it: a revision added without moving the constant fails here."""

from __future__ import annotations

from helpers import fresh_python

from subengine.db import _migrate


def test_the_head_revision_is_the_newest_migration() -> None:
    assert _migrate.head_revision() == _migrate.scripted_head_revision()


def test_knowing_the_head_revision_loads_neither_alembic_nor_sqlalchemy() -> None:
    probe = (
        "import sys; from subengine.db._migrate import head_revision; head_revision(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'alembic', 'sqlalchemy'}))"
    )
    assert fresh_python(probe) == "[]"
