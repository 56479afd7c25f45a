"""PostgreSQL's binary COPY format decoded into Arrow arrays, a column at a time.

`COPY ... TO STDOUT (FORMAT binary)` sends a header, one message per row (the protocol
promises it) and a trailer. A row is a 16-bit field count and, for each field, a 32-bit
length (-1 for NULL) and the value in its type's binary form, all big-endian. Knowing the
size of every message, the decoder knows where every row starts, and reads each field of
all the rows at once with numpy: the fixed-width fields that open a row in one gather of
them all, then each other field with one gather for its lengths, and the next field
starts after them. No Python code runs per row, and every field count, length and row end
is checked, so data of another shape fails instead of being misread.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from subengine.model._errors import SubengineError

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
# The signature, 32 bits of flags and the 32-bit length of a header extension.
_HEADER = len(SIGNATURE) + 8
_OIDS_FLAG = 1 << 16
_TRAILER = b"\xff\xff"
# PostgreSQL counts time in microseconds from 2000-01-01; Arrow from 1970-01-01.
_POSTGRES_EPOCH_MICROS = 946_684_800_000_000
_INFINITIES = (np.iinfo(np.int64).max, np.iinfo(np.int64).min)
# Arrow's binary arrays address their bytes with 32-bit offsets.
_MAX_RUN_BYTES = 2**31 - 1

TIMESTAMP = pa.timestamp("us", tz="UTC")

# A UUID's 32 hex digits, in its groups of 8-4-4-4-12.
_UUID_GROUPS = {"g1": 8, "g2": 4, "g3": 4, "g4": 4, "g5": 12}
_UUID_DIGITS = np.dtype([(name, f"V{width}") for name, width in _UUID_GROUPS.items()])
# Its text: the groups with a dash between each two.
_UUID_TEXT = np.dtype(
    [
        *(("g1", "V8"), ("dash1", "V1"), ("g2", "V4"), ("dash2", "V1"), ("g3", "V4")),
        *(("dash3", "V1"), ("g4", "V4"), ("dash4", "V1"), ("g5", "V12")),
    ]
)
_UUID_DASHES = np.frombuffer(b"-" * 36, np.uint8)

Offsets = npt.NDArray[np.int64]


class Kind(enum.Enum):
    """The PostgreSQL types the decoder reads, and the Arrow array each becomes."""

    INT8 = "bigint"  # int64
    UUID = "uuid"  # its usual text, lowercase with dashes
    TEXT = "text"  # string
    JSONB = "jsonb"  # its text, as jsonb's output function writes it
    TIMESTAMPTZ = "timestamptz"  # timestamp[us, UTC]


# The kinds of fixed width, and how their values are read.
_FIXED = {Kind.INT8: ">i8", Kind.UUID: "V16", Kind.TIMESTAMPTZ: ">i8"}


class CopyFormatError(SubengineError):
    """The binary COPY data is not what the statement should have sent."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"unexpected binary COPY data from PostgreSQL: {problem}")


class Decoder:
    """Decodes the binary COPY of one statement, given in runs of whole messages, into
    arrays of the named columns; `finish` checks that the data ended as it should.

    A statement whose fixed-width columns come first decodes fastest: the field count and
    those fields are then at the same place in every row, and read in one gather."""

    def __init__(self, columns: Sequence[tuple[str, Kind]]) -> None:
        self.columns = tuple(columns)
        opening: list[tuple[str, str]] = [("fields", ">i2")]
        for number, (_, kind) in enumerate(self.columns):
            if kind not in _FIXED:
                break
            opening += [(f"length{number}", ">i4"), (f"value{number}", _FIXED[kind])]
        self.opening = np.dtype(opening)  # packed, as the row is
        self.started = False
        self.ended = False

    def decode(self, data: bytearray, sizes: array[int]) -> list[pa.Array]:
        """The rows of the messages of `sizes` (in bytes), which lie back to back in
        `data`, as one array per column (of arrays that do not refer to `data`)."""
        if len(data) > _MAX_RUN_BYTES:
            raise CopyFormatError(f"a run of {len(data)} bytes is too long to decode at once")
        lengths = np.frombuffer(sizes, np.int64) if sizes else np.zeros(0, np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        if int(ends[-1] if ends.size else 0) != len(data):
            raise CopyFormatError("the messages' sizes do not add up to the data")
        if ends.size and not self.started:
            starts[0] = self._header(data, int(ends[0]))
        if ends.size and self.ended:
            raise CopyFormatError("data after the trailer")
        for message in np.flatnonzero(ends - starts == len(_TRAILER)):  # no row is as short
            if data[starts[message] : ends[message]] == _TRAILER:
                if message != ends.size - 1:
                    raise CopyFormatError("data after the trailer")
                self.ended = True
                starts, ends = starts[:-1], ends[:-1]
        rows = starts < ends  # drops a message that held the header alone
        return _Rows(data, starts[rows], ends[rows]).columns(self.columns, self.opening)

    def _header(self, data: bytearray, first_end: int) -> int:
        """Checks the header at the start of `data`; returns where the first row starts."""
        if first_end < _HEADER or data[: len(SIGNATURE)] != SIGNATURE:
            raise CopyFormatError("no binary COPY signature at the start")
        flags = int.from_bytes(data[len(SIGNATURE) : len(SIGNATURE) + 4], "big")
        if flags & _OIDS_FLAG:
            raise CopyFormatError("rows with OIDs")
        extension = int.from_bytes(data[len(SIGNATURE) + 4 : _HEADER], "big")
        if _HEADER + extension > first_end:
            raise CopyFormatError("a header longer than its message")
        self.started = True
        return _HEADER + extension

    def finish(self) -> None:
        """Raises CopyFormatError unless the trailer came."""
        if not self.ended:
            raise CopyFormatError("the data ended without the trailer")


class _Rows:
    """Rows lying at [starts, ends) of `data`, read a field at a time."""

    def __init__(self, data: bytearray, starts: Offsets, ends: Offsets) -> None:
        self.data = data
        self.buffer = pa.py_buffer(data)
        self.bytes = np.frombuffer(data, np.uint8)
        self.ends = ends
        self.count = len(starts)
        self.cursor = starts  # where the next field of every row starts
        # Row i's value of a text column is element 2i + 1 of an array over all the data
        # whose other elements are the bytes in between; `take` gathers them.
        self.values = pa.array(np.arange(1, 2 * self.count, 2, dtype=np.int32))

    def columns(
        self, columns: Sequence[tuple[str, Kind]], opening: np.dtype[np.void]
    ) -> list[pa.Array]:
        if self.count == 0:
            return [_empty(kind) for _, kind in columns]
        block = self._gather(self.cursor, opening)
        if np.any(block["fields"] != len(columns)):
            raise CopyFormatError(f"rows without exactly {len(columns)} fields")
        fixed = (len(opening.descr) - 1) // 2
        arrays = []
        for number, (name, kind) in enumerate(columns[:fixed]):
            if np.any(block[f"length{number}"] != np.dtype(_FIXED[kind]).itemsize):
                raise CopyFormatError(f"column {name!r} has values of the wrong size or NULL")
            arrays.append(self._fixed(name, kind, block[f"value{number}"]))
        self.cursor = self.cursor + opening.itemsize
        arrays += [self._column(name, kind) for name, kind in columns[fixed:]]
        if np.any(self.cursor != self.ends):
            raise CopyFormatError("rows longer than their fields")
        return arrays

    def _column(self, name: str, kind: Kind) -> pa.Array:
        at, length = self._field(name)
        if kind is Kind.TEXT:
            return self._text(name, at, length)
        if kind is Kind.JSONB:
            # jsonb's binary form is a version byte, 1, and then its text
            if np.any(length < 1) or np.any(self.bytes[at] != 1):
                raise CopyFormatError(f"column {name!r} is not jsonb of version 1")
            return self._text(name, at + 1, length - 1)
        value = np.dtype(_FIXED[kind])
        if np.any(length != value.itemsize):
            raise CopyFormatError(f"column {name!r} has values of the wrong size")
        return self._fixed(name, kind, self._gather(at, value))

    def _field(self, name: str) -> tuple[Offsets, Offsets]:
        """Where the next field of every row has its value, and its length; moves past it."""
        length = self._gather(self.cursor, np.dtype(">i4")).astype(np.int64)
        if np.any(length < 0):
            raise CopyFormatError(f"column {name!r} is NULL in some row")
        at = self.cursor + 4
        self.cursor = at + length
        if np.any(self.cursor > self.ends):
            raise CopyFormatError(f"column {name!r} runs past the end of its row")
        return at, length

    def _gather(self, at: Offsets, kind: np.dtype[Any]) -> npt.NDArray[Any]:
        """The `kind` value at each offset of `at`, every one checked to lie in its row."""
        if np.any(at + kind.itemsize > self.ends):
            raise CopyFormatError("a field runs past the end of its row")
        return _at_every_byte(self.data, kind)[at]

    def _fixed(self, name: str, kind: Kind, values: npt.NDArray[Any]) -> pa.Array:
        if kind is Kind.UUID:
            return self._uuid(values)
        numbers = values.astype(np.int64)
        if kind is Kind.INT8:
            return pa.Array.from_buffers(pa.int64(), self.count, [None, pa.py_buffer(numbers)])
        if np.any(np.isin(numbers, _INFINITIES)):
            raise CopyFormatError(f"column {name!r} holds an infinite time")
        numbers += _POSTGRES_EPOCH_MICROS
        return pa.Array.from_buffers(TIMESTAMP, self.count, [None, pa.py_buffer(numbers)])

    def _text(self, name: str, at: Offsets, length: Offsets) -> pa.Array:
        bounds = np.empty(2 * self.count + 1, np.int32)
        bounds[0] = 0
        bounds[1::2] = at
        bounds[2::2] = at + length
        spans = pa.Array.from_buffers(
            pa.binary(), 2 * self.count, [None, pa.py_buffer(bounds), self.buffer]
        )
        try:
            return spans.take(self.values).cast(pa.string())
        except pa.ArrowInvalid as error:
            raise CopyFormatError(f"column {name!r} is not UTF-8 text ({error})") from None

    def _uuid(self, raw: npt.NDArray[Any]) -> pa.Array:
        digits = np.frombuffer(raw.tobytes().hex().encode("ascii"), _UUID_DIGITS)
        text = np.empty((self.count, 36), np.uint8)
        text[:] = _UUID_DASHES
        groups = text.view(_UUID_TEXT).reshape(self.count)
        for group in _UUID_GROUPS:
            groups[group] = digits[group]
        offsets = np.arange(0, 36 * (self.count + 1), 36, dtype=np.int32)
        return pa.Array.from_buffers(
            pa.string(), self.count, [None, pa.py_buffer(offsets), pa.py_buffer(text)]
        )


def _at_every_byte(data: bytearray, kind: np.dtype[Any]) -> npt.NDArray[Any]:
    """A read-only view of `data` holding a `kind` value at every byte offset, so that
    indexing it with offsets reads unaligned values in one gather."""
    view: npt.NDArray[Any] = np.ndarray(
        shape=(max(len(data) - kind.itemsize + 1, 0),),
        dtype=kind,
        buffer=memoryview(data),
        strides=(1,),
    )
    view.flags.writeable = False
    return view


def _empty(kind: Kind) -> pa.Array:
    if kind is Kind.INT8:
        return pa.array([], pa.int64())
    if kind is Kind.TIMESTAMPTZ:
        return pa.array([], TIMESTAMP)
    return pa.array([], pa.string())
