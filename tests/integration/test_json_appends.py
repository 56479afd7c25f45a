"""append_events takes ids made by its caller without looking them up, and looks up the
ids its caller gave (a retry stores nothing again)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg


def test_append_events_stores_the_ids_made_by_its_caller(
    orders: str, sql: psycopg.Connection[Any]
) -> None:
    given, made = uuid.uuid4(), uuid.uuid4()
    call = """
    SELECT ordinal, id, duplicate FROM subengine.append_events(
        'orders', %s::uuid[], ARRAY['a', 'b', 'c'], ARRAY['T', 'T', 'T'],
        ARRAY['1', '2', '3']::jsonb[], generated_ids => %s::uuid[]) ORDER BY ordinal"""
    first = sql.execute(call, ([None, given, None], [made, None, None])).fetchall()
    assert first[0] == (1, made, False) and first[1] == (2, given, False)
    assert first[2][1] not in (given, made) and first[2][1].version == 4  # made by the function
    again = sql.execute(call, ([None, given, None], [uuid.uuid4(), None, None])).fetchall()
    assert [row[2] for row in again] == [False, True, False]
    assert again[1][1] == given
    assert sql.execute("SELECT count(*) FROM subengine.events").fetchone() == (5,)
    bad = [uuid.uuid4()]
    try:
        sql.execute(call, ([None, None, None], bad))
    except psycopg.errors.InvalidParameterValue as error:
        assert "one element per event" in str(error)
    else:
        raise AssertionError("generated_ids of another length were taken")
