"""`Cursor`: where an outside reader stands in a stream (DESIGN.md, Vocabulary).

Per partition, the last position delivered (or passed over by a filter). It is the whole
state of a tail: store it, in the same transaction as what the events changed, and a new
tail resumes from it without skipping or repeating a position. Its string form is compact
and round-trips, for a URL, a header or a column.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from subengine.model._errors import InvalidInput
from subengine.model._names import (
    BIGINT_MAX,
    MAX_PARTITIONS,
    shown_value,
    validate_stream_name,
    validate_whole_number,
)

# "orders:12,0,7": the stream (no ':' in a stream name), then the position of every
# partition in partition order; "orders:" is the beginning of every partition.
_TEXT = re.compile(r"([^:]+):((?:[0-9]{1,19}(?:,[0-9]{1,19})*)?)")


@dataclass(frozen=True, slots=True)
class Cursor:
    """The last position delivered of every partition of `stream`, in partition order.

    No positions (`Cursor("orders")`) is the beginning of every partition.
    `str(cursor)` is its compact form ("orders:12,0,7"); `Cursor.parse` reads it back.
    """

    stream: str
    positions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        validate_stream_name(self.stream)
        if not isinstance(self.positions, tuple):
            raise InvalidInput(
                f"cursor positions must be a tuple, not {type(self.positions).__name__}"
            )
        if len(self.positions) > MAX_PARTITIONS:
            raise InvalidInput(f"a cursor has at most {MAX_PARTITIONS} positions")
        for partition, position in enumerate(self.positions):
            validate_whole_number(position, f"the position of partition {partition}", 0, BIGINT_MAX)

    @classmethod
    def at(cls, stream: str, heads: Mapping[int, int]) -> Cursor:
        """The cursor standing at `heads` (partition to position, e.g. `engine.heads()`
        read in the caller's transaction): a tail from it starts with the next event."""
        if sorted(heads) != list(range(len(heads))):
            raise InvalidInput("heads must name every partition from 0, once")
        return cls(stream, tuple(heads[partition] for partition in range(len(heads))))

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """The cursor `str(cursor)` wrote."""
        match = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidInput(
                f"invalid cursor {shown_value(text)}: expected 'stream:' or "
                "'stream:position,position,...'"
            )
        stream, positions = match.groups()
        return cls(stream, tuple(int(p) for p in positions.split(",")) if positions else ())

    def __str__(self) -> str:
        return f"{self.stream}:{','.join(map(str, self.positions))}"

    def position(self, partition: int) -> int:
        """The last position delivered of `partition` (0: none yet)."""
        return self.positions[partition] if partition < len(self.positions) else 0
