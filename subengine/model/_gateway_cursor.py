"""The gateway's cursor: the whole state of an outside reader (DESIGN.md, the gateway's
second principle), for one stream or every stream of a watch. Vocabulary: the gateway
writes it and the Python client reads it, so it needs neither.

Per stream: its epoch (so a cursor of a deleted and re-created stream is noticed) and,
per partition, the last position delivered (or passed over by a filter). Its text is
opaque, URL-safe and versioned: "c1." then the unpadded base64url of a flag byte and
the fields as unsigned LEB128 varints (zlib-compressed when that is shorter):

    count of streams, then per stream: name length, name (UTF-8), epoch, count of
    positions, the positions (no positions: the beginning of every partition)
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from subengine.model._errors import InvalidInput
from subengine.model._names import BIGINT_MAX, MAX_PARTITIONS, validate_stream_name

_PREFIX = "c1."
_RAW, _ZLIB = 0, 1
# Shorter cursors gain little from compression, and it costs a call per frame.
_WORTH_COMPRESSING = 96
# A cursor's text is read from URLs and headers: refuse anything longer unread.
MAX_CURSOR_TEXT = 16_384
_MAX_DECODED = 1 << 20


class InvalidCursor(InvalidInput):
    """A cursor text that is not one this gateway wrote."""


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where a reader stands in one stream: the stream's epoch and the last position
    delivered per partition (empty: the beginning of every partition)."""

    epoch: int
    positions: tuple[int, ...] = ()

    def position(self, partition: int) -> int:
        return self.positions[partition] if partition < len(self.positions) else 0


@dataclass(frozen=True, slots=True)
class GatewayCursor:
    """Where a reader stands in each of its streams."""

    streams: Mapping[str, StreamPosition]

    def encode(self) -> str:
        body = bytearray()
        _varint(body, len(self.streams))
        for name, at in self.streams.items():
            encoded = name.encode()
            _varint(body, len(encoded))
            body += encoded
            _varint(body, at.epoch)
            _varint(body, len(at.positions))
            for position in at.positions:
                _varint(body, position)
        raw = bytes(body)
        packed = zlib.compress(raw, 6) if len(raw) > _WORTH_COMPRESSING else raw
        payload = bytes([_ZLIB]) + packed if len(packed) < len(raw) else bytes([_RAW]) + raw
        return _PREFIX + base64.urlsafe_b64encode(payload).rstrip(b"=").decode()

    def __str__(self) -> str:
        return self.encode()

    @classmethod
    def decode(cls, text: object) -> GatewayCursor:
        """The cursor `encode` wrote; InvalidCursor (one line, never the text itself when
        it is long) for anything else."""
        if not isinstance(text, str) or not text.startswith(_PREFIX):
            raise InvalidCursor("malformed cursor: it does not start with 'c1.'")
        if len(text) > MAX_CURSOR_TEXT:
            raise InvalidCursor(f"malformed cursor: longer than {MAX_CURSOR_TEXT} characters")
        try:
            payload = base64.urlsafe_b64decode(text[len(_PREFIX) :] + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise InvalidCursor("malformed cursor: not base64url") from None
        if not payload:
            raise InvalidCursor("malformed cursor: empty")
        flag, body = payload[0], payload[1:]
        if flag == _ZLIB:
            inflater = zlib.decompressobj()
            try:
                body = inflater.decompress(body, _MAX_DECODED)
            except zlib.error:
                raise InvalidCursor("malformed cursor: bad compression") from None
            if inflater.unconsumed_tail or not inflater.eof:
                raise InvalidCursor("malformed cursor: too long or truncated")
        elif flag != _RAW:
            raise InvalidCursor(f"malformed cursor: unknown flag {flag}")
        return cls(_parse(body))


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class _Reader:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.at = 0

    def number(self) -> int:
        value = shift = 0
        while True:
            if self.at >= len(self.body):
                raise InvalidCursor("malformed cursor: truncated")
            byte = self.body[self.at]
            self.at += 1
            value |= (byte & 0x7F) << shift
            if value > BIGINT_MAX or shift > 63:
                raise InvalidCursor("malformed cursor: a number out of range")
            if not byte & 0x80:
                return value
            shift += 7

    def text(self, length: int) -> str:
        if self.at + length > len(self.body):
            raise InvalidCursor("malformed cursor: truncated")
        raw = self.body[self.at : self.at + length]
        self.at += length
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise InvalidCursor("malformed cursor: a stream name is not UTF-8") from None


def _parse(body: bytes) -> dict[str, StreamPosition]:
    reader = _Reader(body)
    streams: dict[str, StreamPosition] = {}
    count = reader.number()
    if count > 1024:
        raise InvalidCursor("malformed cursor: too many streams")
    for _ in range(count):
        name = reader.text(reader.number())
        try:
            validate_stream_name(name)
        except InvalidInput:
            raise InvalidCursor("malformed cursor: an invalid stream name") from None
        if name in streams:
            raise InvalidCursor("malformed cursor: a stream twice")
        epoch = reader.number()
        length = reader.number()
        if length > MAX_PARTITIONS:
            raise InvalidCursor("malformed cursor: too many positions")
        streams[name] = StreamPosition(epoch, tuple(reader.number() for _ in range(length)))
    if reader.at != len(body):
        raise InvalidCursor("malformed cursor: trailing bytes")
    return streams
