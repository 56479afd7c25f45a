"""The gateway's catch-up page with each event's JSON made by PostgreSQL (`read_page_json`):
byte for byte what `event_json` writes for the same event, in every session time zone;
the same page as `read_page`; filters that pass events over without leaving them behind;
and a bound in bytes that never splits what follows the cursor."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import subengine
from subengine.db._sql import SQL
from subengine.gateway._hub import event_json
from subengine.model._event_fields import ALL_FIELDS, EVENT_FIELDS, WITHOUT_DATA, fields_of
from subengine.model._events import partition_for
from subengine.streams._read import EncodedPage, read_page, read_page_json

ODD_KEYS = ["plain", 'qu"ote', "back\\slash", "é-ünïcode", "emoji-😀", "tab?", "x" * 200]
ODD_TIMES = [
    None,  # the time of the append: equal to recorded_at
    datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),  # no microseconds
    datetime(2026, 1, 2, 3, 4, 5, 1, tzinfo=UTC),
    datetime(2026, 6, 30, 23, 59, 59, 999999, tzinfo=timezone(timedelta(hours=-3, minutes=-30))),
    datetime(1900, 1, 1, tzinfo=UTC),  # local mean time: offsets with seconds in some zones
    datetime(999, 12, 31, 12, tzinfo=UTC),  # a year of three digits
]
# every field alone (with the place, which every read has), the place alone, all but data,
# and all but the times
SOME_FIELDS = [
    *(fields_of([name]) for name in EVENT_FIELDS),
    fields_of([]),
    WITHOUT_DATA,
    ALL_FIELDS - {"occurred_at", "recorded_at"},
]
ZONES = ["UTC", "Africa/Abidjan", "Europe/Paris", "America/St_Johns", "Asia/Kathmandu"]


def fill(engine: subengine.Engine, sql: psycopg.Connection[Any], stream: str) -> None:
    engine.create_stream(stream, partitions=3)
    events = [
        subengine.NewEvent(
            key,
            f"type-{n % 3}" if n % 5 else 'ty"pe',
            {"n": n, "text": 'a "quoted" \\ line\nand more', "nested": {"list": [1, 2.5, None]}},
            metadata={"by": "test", "n": n} if n % 2 else None,
            occurred_at=ODD_TIMES[n % len(ODD_TIMES)],
        )
        for n, key in enumerate(ODD_KEYS * 6)
    ]
    for first in range(0, len(events), 7):
        engine.append(stream, events[first : first + 7])
    # recorded_at without microseconds, which the engine's clock seldom gives (at the
    # start of each partition: recorded_at still never decreases along one)
    sql.execute(
        psycopg.sql.SQL(
            "UPDATE {}.events SET recorded_at = date_trunc('second', recorded_at)"
            " WHERE stream = %s AND position <= 5"
        ).format(psycopg.sql.Identifier(engine.schema)),
        (stream,),
    )


def whole_page(
    sql: psycopg.Connection[Any], schema: str, stream: str, **options: Any
) -> EncodedPage:
    return SQL(schema).run(sql, read_page_json(stream, [], 10_000, **options))


@pytest.mark.parametrize("zone", ZONES)
def test_each_event_is_the_text_event_json_writes(
    engine: subengine.Engine, sql: psycopg.Connection[Any], zone: str
) -> None:
    fill(engine, sql, "odd")
    sql.execute(psycopg.sql.SQL("SET TimeZone = {}").format(psycopg.sql.Literal(zone)))
    run = SQL(engine.schema).run
    raw = run(sql, read_page("odd", [], 10_000))
    encoded = run(sql, read_page_json("odd", [], 10_000))
    assert len(raw.events) == len(ODD_KEYS) * 6
    assert [(p, q) for p, q, _ in encoded.events] == [(e.partition, e.position) for e in raw.events]
    assert [text for _, _, text in encoded.events] == [event_json(e) for e in raw.events]
    for fields in SOME_FIELDS:
        some = run(sql, read_page_json("odd", [], 10_000, fields=fields))
        made = [text for _, _, text in some.events]
        assert made == [event_json(e, fields) for e in raw.events], sorted(fields)
        assert [list(json.loads(text)) for text in made if text is not None] == [
            [name for name in EVENT_FIELDS if name in fields]
        ] * len(raw.events)
    texts = [json.loads(text) for _, _, text in encoded.events if text is not None]
    times = [e[name] for e in texts for name in ("occurred_at", "recorded_at")]
    assert any("." not in time for time in times)  # the cases the test means to meet
    assert any(time.startswith("0999-") for time in times)
    if zone == "Africa/Abidjan":  # its local mean time until 1912: -00:16:08
        assert any(time.endswith("-00:16:08") for time in times)
    assert (encoded.epoch, encoded.heads, encoded.floors) == (raw.epoch, raw.heads, raw.floors)


def test_filters_pass_events_over_and_the_cursor_still_moves(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, sql, "odd")
    every = whole_page(sql, engine.schema, "odd")
    some = whole_page(sql, engine.schema, "odd", keys=['qu"ote', "emoji-😀"], types=["type-1"])
    assert [(p, q) for p, q, _ in some.events] == [(p, q) for p, q, _ in every.events]
    kept = [json.loads(text) for _, _, text in some.events if text is not None]
    assert kept
    assert all(e["key"] in ('qu"ote', "emoji-😀") and e["type"] == "type-1" for e in kept)
    assert [t for _, _, t in some.events if t is not None] == [
        t
        for _, _, t in every.events
        if t is not None
        and json.loads(t)["key"] in ('qu"ote', "emoji-😀")
        and json.loads(t)["type"] == "type-1"
    ]
    nothing = whole_page(sql, engine.schema, "odd", keys=[])
    assert len(nothing.events) == len(every.events)
    assert all(text is None for _, _, text in nothing.events)
    assert nothing.size == 0


def read_by_pages(
    sql: psycopg.Connection[Any], schema: str, stream: str, max_bytes: int, **options: Any
) -> tuple[list[tuple[int, int, str | None]], list[EncodedPage]]:
    """Every event after the beginning, page by page (7 events at most) until up to date."""
    positions: list[int] = []
    events: list[tuple[int, int, str | None]] = []
    pages: list[EncodedPage] = []
    for _ in range(1000):
        page = SQL(schema).run(
            sql, read_page_json(stream, positions, 7, max_bytes=max_bytes, **options)
        )
        pages.append(page)
        positions = list(positions or [0] * len(page.heads))
        for partition, position, text in page.events:
            assert position == positions[partition] + 1  # nothing skipped, nothing twice
            positions[partition] = position
            events.append((partition, position, text))
        if positions == list(page.heads):
            return events, pages
    raise AssertionError("never up to date")


def joined_size(page: EncodedPage) -> int:
    return len(",".join(t for _, _, t in page.events if t is not None).encode())


@pytest.mark.parametrize("max_bytes", [0, 300, 1000, 2500, 10**9])
def test_a_page_stays_within_its_bytes_and_pages_read_everything_once_in_order(
    engine: subengine.Engine, sql: psycopg.Connection[Any], max_bytes: int
) -> None:
    fill(engine, sql, "odd")
    expected = whole_page(sql, engine.schema, "odd").events
    events, pages = read_by_pages(sql, engine.schema, "odd", max_bytes)
    assert events == expected
    for page in pages:
        kept = [t for _, _, t in page.events if t is not None]
        assert page.size == joined_size(page)
        assert page.size <= max_bytes or len(kept) == 1  # but for one larger event
        assert page.full or len(page.events) == 7 or page is pages[-1]
    if max_bytes == 0:
        assert all(len(page.events) == 1 for page in pages)
    if max_bytes == 10**9:
        assert not any(page.full for page in pages)


def test_a_filtered_page_counts_only_the_events_it_keeps(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, sql, "odd")
    options = {"keys": ["plain"], "fields": WITHOUT_DATA}
    expected = whole_page(sql, engine.schema, "odd", **options).events
    one = max(len(t.encode()) for _, _, t in expected if t is not None)
    events, pages = read_by_pages(sql, engine.schema, "odd", one, **options)
    assert events == expected
    for page in pages:
        assert sum(t is not None for _, _, t in page.events) <= 1
        assert page.size <= one


def test_without_oversize_a_first_event_too_large_ends_the_page_before_it(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, sql, "odd")
    run = SQL(engine.schema).run
    alone = run(sql, read_page_json("odd", [], 7, max_bytes=10))
    assert len(alone.events) == 1 and alone.full and alone.size > 10
    none = run(sql, read_page_json("odd", [], 7, max_bytes=10, oversize=False))
    assert none.events == [] and none.full and none.size == 0
    # the events a filter passes over before it still come: they take no bytes
    filtered = run(
        sql, read_page_json("odd", [], 7, max_bytes=10, oversize=False, keys=["emoji-😀"])
    )
    every = run(sql, read_page_json("odd", [], 7)).events
    assert filtered.full and filtered.events
    assert all(text is None for _, _, text in filtered.events)
    assert [(p, q) for p, q, _ in filtered.events] == [(p, q) for p, q, _ in every][
        : len(filtered.events)
    ]
    following = every[len(filtered.events)][2]
    assert following is not None and json.loads(following)["key"] == "emoji-😀"


def test_a_cursor_of_other_partitions_reads_nothing(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    fill(engine, sql, "odd")
    page = SQL(engine.schema).run(sql, read_page_json("odd", [0, 0], 7))
    assert not page.fits and page.events == [] and len(page.heads) == 3
    with pytest.raises(subengine.StreamNotFound):
        SQL(engine.schema).run(sql, read_page_json("nothing-here", [], 7))


def uneven(engine: subengine.Engine) -> list[int]:
    """A stream whose partitions fill unevenly: bursts of one partition, appends that
    share a time across partitions, an empty partition, and a floor raised by retention.
    Its heads."""
    engine.create_stream("uneven", partitions=5)
    keys: dict[int, str] = {}
    for n in range(200):
        keys.setdefault(partition_for(f"key-{n}", 5), f"key-{n}")
    rng = random.Random(26)
    for round_ in range(40):
        if round_ % 4 == 0:  # a burst of one partition, recorded at one time
            partition = rng.choice([0, 1, 2])
            batch = [keys[partition]] * rng.randint(20, 60)
        else:  # a few of each partition but the empty one, recorded at one time
            batch = [keys[rng.choice([0, 1, 2, 3])] for _ in range(rng.randint(1, 12))]
        engine.append("uneven", [subengine.NewEvent(key, "t", {"r": round_}) for key in batch])
    engine.set_retention("uneven", subengine.Retention(max_events=150))
    engine.run_retention("uneven")
    engine.set_retention("uneven", None)
    return [state.head for state in engine.partitions("uneven")]


def test_the_page_is_read_pages_page_from_any_cursor(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    heads = uneven(engine)
    floors = [state.floor for state in engine.partitions("uneven")]
    assert heads[4] == 0 and max(floors) > 1  # the cases the test means to meet
    run = SQL(engine.schema).run
    rng = random.Random(262)
    cursors: list[list[int]] = [[], [0] * 5, heads, [h // 2 for h in heads]]
    cursors += [[rng.randint(0, h) for h in heads] for _ in range(40)]
    cursors += [[h if p == rng.randrange(5) else 0 for p, h in enumerate(heads)] for _ in range(10)]
    for limit in (1, 2, 5, 17, 64, 250, 5000):
        for cursor in cursors:
            expected = run(sql, read_page("uneven", cursor, limit))
            page = run(sql, read_page_json("uneven", cursor, limit))
            assert [(p, q) for p, q, _ in page.events] == [
                (e.partition, e.position) for e in expected.events
            ], (limit, cursor)
            assert page.tombstones == expected.tombstones


@pytest.mark.parametrize("filtered", [False, True])
def test_a_page_bounded_by_bytes_is_a_prefix_of_the_page_from_any_cursor(
    engine: subengine.Engine, sql: psycopg.Connection[Any], filtered: bool
) -> None:
    """PostgreSQL's estimate and its probes end a page early, never elsewhere: what it
    reads is the start of `read_page`'s page, one event at least, with the same
    tombstones (nothing is skipped silently, DESIGN.md's gateway principle 3)."""
    heads = uneven(engine)
    run = SQL(engine.schema).run
    rng = random.Random(2626)
    cursors: list[list[int]] = [[], heads, [h // 2 for h in heads]]
    cursors += [[rng.randint(0, h) for h in heads] for _ in range(25)]
    first_keys: dict[int, str] = {}  # the keys `uneven` appends, by partition
    for n in range(200):
        first_keys.setdefault(partition_for(f"key-{n}", 5), f"key-{n}")
    keys = [first_keys[0], first_keys[2]]
    for max_bytes in (0, 150, 1500, 6000):
        for limit in (3, 64, 5000):
            for cursor in cursors:
                whole = run(sql, read_page("uneven", cursor, limit))
                expected = [(e.partition, e.position) for e in whole.events]
                page = run(
                    sql,
                    read_page_json(
                        "uneven",
                        cursor,
                        limit,
                        keys=keys if filtered else None,
                        max_bytes=max_bytes,
                    ),
                )
                got = [(p, q) for p, q, _ in page.events]
                assert got == expected[: len(got)] and (got or not expected), (
                    max_bytes,
                    limit,
                    cursor,
                )
                # the gaps the cursor stands before come with the page, however short
                assert page.tombstones == whole.tombstones
                kept = [t for _, _, t in page.events if t is not None]
                assert page.size <= max_bytes or len(kept) == 1


def test_a_page_reads_about_its_own_rows_before_the_table_is_analyzed(
    engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    """Right after a bulk append the planner knows nothing of the new rows; the probes
    must still be index lookups, not a join that reads whole partitions (index entries
    read, counted in the transaction's own statistics)."""
    events = psycopg.sql.Identifier(engine.schema, "events")
    sql.execute(psycopg.sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(events))
    engine.create_stream("bulk", partitions=4)
    for first in range(0, 8000, 1000):
        engine.append(
            "bulk",
            [subengine.NewEvent(f"k{n % 50}", "t", {"n": n}) for n in range(first, first + 1000)],
        )
    index = f"{engine.schema}.events_pkey"
    with sql.transaction():
        page = SQL(engine.schema).run(sql, read_page_json("bulk", [5, 5, 5, 5], 100))
        row = sql.execute(
            "SELECT pg_stat_get_xact_tuples_returned(%s::regclass)", (index,)
        ).fetchone()
    assert len(page.events) == 100
    # about 350; a join that reads a partition's entries per probe: 16,000
    assert row is not None and row[0] < 2000, row


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(length))


@pytest.mark.parametrize("fields", [ALL_FIELDS, fields_of(["data"])])
def test_postgresql_writes_about_a_pages_bytes_of_json_whatever_its_limit(
    engine: subengine.Engine, sql: psycopg.Connection[Any], fields: frozenset[str]
) -> None:
    """Events of 50 KB, a page of at most 120 KB out of a limit of 20: PostgreSQL writes
    the JSON of the three events its estimate lets in, not of twenty, and the page
    keeps the two that fit; read page by page, every event comes once, in order (the
    events have times of their own, so the probes bound the rows by bytes too)."""
    engine.create_stream("large", partitions=2)
    blob = random_text(random.Random(7), 50_000)
    for n in range(20):
        engine.append("large", [subengine.NewEvent(f"k{n}", "t", {"n": n, "blob": blob})])
    query = read_page_json("large", [], 20, fields=fields, max_bytes=120_000)
    rows = sql.execute(SQL(engine.schema).text(query.name), query.params).fetchall()
    assert len(rows) == 3
    page = SQL(engine.schema).run(sql, query)
    assert len(page.events) == 2 and page.full
    assert 100_000 < page.size <= 120_000
    events, _ = read_by_pages(sql, engine.schema, "large", 120_000, fields=fields)
    assert events == whole_page(sql, engine.schema, "large", fields=fields).events


@pytest.mark.parametrize("large", ["metadata", "key"])
def test_the_estimate_counts_large_metadata_and_keys(
    engine: subengine.Engine, sql: psycopg.Connection[Any], large: str
) -> None:
    """A change feed of events with 20 KB of metadata (no data), or with keys of 1,000
    characters: PostgreSQL stops near the page's bytes too."""
    engine.create_stream("wide", partitions=1)
    rng = random.Random(11)
    for n in range(30):
        metadata = {"note": random_text(rng, 20_000)} if large == "metadata" else None
        key = random_text(rng, 1000) if large == "key" else f"k{n}"
        engine.append("wide", [subengine.NewEvent(key, "t", {"n": n}, metadata=metadata)])
    fields = WITHOUT_DATA if large == "metadata" else fields_of(["key"])
    max_bytes = 50_000 if large == "metadata" else 5_000
    query = read_page_json("wide", [], 30, fields=fields, max_bytes=max_bytes)
    rows = sql.execute(SQL(engine.schema).text(query.name), query.params).fetchall()
    page = SQL(engine.schema).run(sql, query)
    assert page.full and len(page.events) < len(rows) <= len(page.events) + 2
