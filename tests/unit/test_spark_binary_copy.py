"""The Spark source's decoder of PostgreSQL's binary COPY format, on data built here by
the rules of PostgreSQL's documentation (COPY, "Binary Format"), in messages as the server
sends them (the header with the first row, a message per row, the trailer alone). No
database: tests/integration/test_spark_read_range.py reads what a real server sends."""

from __future__ import annotations

import struct
import uuid
from array import array
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark is not installed: pip install -e '.[spark]'")

from subengine.spark._binary_copy import SIGNATURE, CopyFormatError, Decoder, Kind

# Fixed-width columns open the row and come again after a text one: both ways of reading.
COLUMNS = (
    ("position", Kind.INT8),
    ("at", Kind.TIMESTAMPTZ),
    ("id", Kind.UUID),
    ("key", Kind.TEXT),
    ("version", Kind.INT8),
    ("data", Kind.JSONB),
    ("seen", Kind.TIMESTAMPTZ),
    ("ref", Kind.UUID),
)
POSTGRES_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
HEADER = SIGNATURE + struct.pack(">ii", 0, 0)
TRAILER = struct.pack(">h", -1)
INT64_MAX = 2**63 - 1

Row = tuple[Any, ...]


def field(value: bytes | None) -> bytes:
    return struct.pack(">i", -1) if value is None else struct.pack(">i", len(value)) + value


def int8(value: int) -> bytes:
    return struct.pack(">q", value)


def timestamptz(moment: datetime) -> bytes:
    return int8((moment - POSTGRES_EPOCH) // timedelta(microseconds=1))


def jsonb(text: str) -> bytes:
    return b"\x01" + text.encode()


def encoded(row: Row) -> list[bytes]:
    position, at, id_, key, version, data, seen, ref = row
    return [
        int8(position),
        timestamptz(at),
        id_.bytes,
        key.encode(),
        int8(version),
        jsonb(data),
        timestamptz(seen),
        ref.bytes,
    ]


def message(fields: Sequence[bytes | None]) -> bytes:
    return struct.pack(">h", len(fields)) + b"".join(field(value) for value in fields)


def messages(rows: Sequence[bytes]) -> list[bytes]:
    """A COPY's messages as PostgreSQL sends them: the header goes with the first row."""
    if not rows:
        return [HEADER + TRAILER]
    return [HEADER + rows[0], *rows[1:], TRAILER]


def decoded(runs: Sequence[Sequence[bytes]]) -> list[Row]:
    """The rows of the messages, given to one decoder run after run."""
    decoder = Decoder(COLUMNS)
    rows: list[Row] = []
    for run in runs:
        columns = decoder.decode(bytearray(b"".join(run)), array("q", map(len, run)))
        assert [len(column) for column in columns] == [len(columns[0])] * len(COLUMNS)
        rows += zip(*(column.to_pylist() for column in columns), strict=True)
    decoder.finish()
    return rows


def as_decoded(row: Row) -> Row:
    """What a row decodes to: UUIDs as their text, times as datetimes in UTC."""
    return tuple(str(value) if isinstance(value, uuid.UUID) else value for value in row)


AWKWARD_ROWS: list[Row] = [
    (
        1,
        datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        uuid.UUID("0b7e4c1e-5d0a-4f57-9a65-3f2b1c8e6d42"),
        "order-1",
        1,
        '{"note": "a \\"b\\", c\\nd \\\\ e\\t✓", "n": 1}',
        datetime(1970, 1, 1, tzinfo=UTC),
        uuid.UUID(int=0),
    ),
    (
        2,
        datetime(1, 1, 2, tzinfo=UTC),  # the earliest occurred_at the events table takes
        uuid.UUID(int=2**128 - 1),
        "ключ-✓-😀-\u2028-end",  # multi-byte UTF-8, and a separator JSON allows raw
        INT64_MAX,
        '{"ключ": "значение", "emoji": "😀", "sep": "\u2028\u2029\u0085"}',
        datetime(9999, 12, 30, 23, 59, 59, 999999, tzinfo=UTC),
        uuid.UUID("00000000-0000-0000-0000-000000000001"),
    ),
    (
        -1,
        datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),  # before PostgreSQL's epoch
        uuid.uuid4(),
        "k",
        1,
        "null",
        datetime(2000, 1, 1, tzinfo=UTC),
        uuid.uuid4(),
    ),
    (
        3,
        datetime(2026, 6, 1, tzinfo=UTC),
        uuid.uuid4(),
        "a key exactly twenty",
        2,
        '["x", 1.5, true, null, {"": ""}]',
        datetime(2026, 6, 1, tzinfo=UTC),
        uuid.uuid4(),
    ),
]


def test_every_kind_decodes_to_its_value() -> None:
    rows = [message(encoded(row)) for row in AWKWARD_ROWS]
    assert decoded([messages(rows)]) == [as_decoded(row) for row in AWKWARD_ROWS]


def test_a_uuid_decodes_to_its_lowercase_text_with_dashes() -> None:
    ids = [uuid.UUID(int=(n * 0x0123456789ABCDEF0FEDCBA987654321) % 2**128) for n in range(50)]
    rows = [message(encoded((*AWKWARD_ROWS[0][:2], id_, *AWKWARD_ROWS[0][3:]))) for id_ in ids]
    assert [row[2] for row in decoded([messages(rows)])] == [str(id_) for id_ in ids]


def test_runs_cut_at_any_message_decode_to_the_same_rows() -> None:
    sent = messages([message(encoded(row)) for row in AWKWARD_ROWS])
    expected = [as_decoded(row) for row in AWKWARD_ROWS]
    for first in range(len(sent) + 1):
        for second in range(first, len(sent) + 1):
            runs = [sent[:first], sent[first:second], sent[second:]]
            assert decoded(runs) == expected, (first, second)


def test_a_header_alone_and_no_rows_decode_to_nothing() -> None:
    assert decoded([messages([])]) == []
    assert decoded([[HEADER], [TRAILER]]) == []
    row = message(encoded(AWKWARD_ROWS[0]))
    assert decoded([[HEADER, row, TRAILER]]) == [as_decoded(AWKWARD_ROWS[0])]


def test_a_header_extension_is_skipped() -> None:
    extended = SIGNATURE + struct.pack(">ii", 0, 5) + b"12345"
    row = message(encoded(AWKWARD_ROWS[1]))
    assert decoded([[extended + row, TRAILER]]) == [as_decoded(AWKWARD_ROWS[1])]


def test_a_value_larger_than_the_rest_of_the_run_decodes_whole() -> None:
    payload = '{"big": "' + "é✓" * 400_000 + '"}'
    small = message(encoded(AWKWARD_ROWS[0]))
    big = message(encoded((*AWKWARD_ROWS[0][:5], payload, *AWKWARD_ROWS[0][6:])))
    rows = decoded([[HEADER + small], [big, small], [TRAILER]])
    assert [row[5] for row in rows] == [AWKWARD_ROWS[0][5], payload, AWKWARD_ROWS[0][5]]


def replaced(number: int, value: bytes | None) -> bytes:
    fields: list[bytes | None] = list(encoded(AWKWARD_ROWS[0]))
    fields[number] = value
    return message(fields)


GOOD = message(encoded(AWKWARD_ROWS[0]))


@pytest.mark.parametrize(
    ("sent", "problem"),
    [
        ([HEADER + replaced(5, None), TRAILER], "column 'data' is NULL"),
        ([HEADER + replaced(0, None), TRAILER], "column 'position' has values of the wrong size"),
        ([HEADER + replaced(4, struct.pack(">i", 7)), TRAILER], "column 'version' has values"),
        ([HEADER + replaced(2, b"\x00" * 15), TRAILER], "'id' has values of the wrong size"),
        ([HEADER + replaced(5, b"\x02{}"), TRAILER], "'data' is not jsonb of version 1"),
        ([HEADER + replaced(5, b""), TRAILER], "'data' is not jsonb of version 1"),
        ([HEADER + replaced(3, b"\xff\xfe"), TRAILER], "'key' is not UTF-8 text"),
        ([HEADER + replaced(1, int8(INT64_MAX)), TRAILER], "'at' holds an infinite time"),
        ([HEADER + replaced(6, int8(-(2**63))), TRAILER], "'seen' holds an infinite time"),
        ([HEADER + message(encoded(AWKWARD_ROWS[0])[:7]), TRAILER], "exactly 8 fields"),
        ([HEADER + GOOD + b"\x00", TRAILER], "rows longer than their fields"),
        ([HEADER + GOOD[:-1], TRAILER], "runs past the end of its row"),
        ([HEADER + GOOD[:20], TRAILER], "runs past the end of its row"),
        ([b"PGCOPY\n\xff\r\n\x01" + HEADER[11:] + GOOD, TRAILER], "no binary COPY signature"),
        ([SIGNATURE + struct.pack(">ii", 1 << 16, 0) + GOOD, TRAILER], "rows with OIDs"),
        ([SIGNATURE + struct.pack(">ii", 0, 999) + GOOD, TRAILER], "header longer"),
        ([HEADER + GOOD], "ended without the trailer"),
        ([HEADER + GOOD, TRAILER, GOOD], "data after the trailer"),
    ],
)
def test_data_of_another_shape_fails_saying_what_is_wrong(sent: list[bytes], problem: str) -> None:
    with pytest.raises(CopyFormatError, match=problem):
        decoded([sent])


def test_data_after_a_run_that_ended_with_the_trailer_fails() -> None:
    with pytest.raises(CopyFormatError, match="data after the trailer"):
        decoded([[HEADER + GOOD, TRAILER], [GOOD]])


def test_sizes_that_do_not_add_up_to_the_data_fail() -> None:
    decoder = Decoder(COLUMNS)
    with pytest.raises(CopyFormatError, match="sizes do not add up"):
        decoder.decode(bytearray(HEADER + GOOD + TRAILER), array("q", [len(HEADER + GOOD)]))
