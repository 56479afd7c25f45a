"""Streaming offsets: `{"<partition>": <position>}`, the last position read per partition.

Spark stores offsets as JSON in its checkpoint and tells two offsets apart by their JSON
text, so every offset this source returns has one canonical form: partition numbers as
string keys in sorted order, positions as integers. Positions are dense and immutable
(DESIGN.md invariant 1), so the events between two offsets are always the same ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from subengine.model._errors import InvalidInput

Positions = dict[int, int]


def to_offset(positions: Mapping[int, int]) -> dict[str, int]:
    """The canonical offset of per-partition positions."""
    return {key: positions[int(key)] for key in sorted(str(p) for p in positions)}


def offset_json(positions: Mapping[int, int]) -> str:
    """The canonical offset's JSON text: sorted keys, compact separators."""
    return json.dumps(to_offset(positions), separators=(",", ":"))


def from_offset(offset: Mapping[str, Any], expected: tuple[int, ...]) -> Positions:
    """Positions of an offset Spark hands back; it must name exactly the `expected`
    partitions (an offset from another query's checkpoint would not)."""
    try:
        positions = {int(key): value for key, value in offset.items()}
    except (TypeError, ValueError, AttributeError):
        positions = {}
    valid = all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in positions.values()
    )
    if not valid or sorted(positions) != list(expected):
        raise InvalidInput(
            f"the offset {json.dumps(offset)} does not fit this query, which reads partitions "
            f"{list(expected)}: was the checkpoint written by a query with other options? "
            "Start with a new checkpoint location"
        )
    return positions


def admit(start: Positions, heads: Positions, max_rows: int) -> Positions:
    """The end positions of a micro-batch of at most `max_rows` events after `start`.

    Each partition with events waiting gets a share of `max_rows` in proportion to what
    it has waiting (rounded down); the rows left over go one each to the partitions that
    lost the most to rounding (ties: lower partition first). At least one event is
    admitted whenever any is waiting, so a stream never stalls.
    """
    waiting = {p: heads[p] - start[p] for p in start if heads[p] > start[p]}
    total = sum(waiting.values())
    if total <= max_rows:
        return {p: max(start[p], heads[p]) for p in start}
    shares = {p: n * max_rows // total for p, n in waiting.items()}
    left = max_rows - sum(shares.values())
    by_loss = sorted(waiting, key=lambda p: (-(waiting[p] * max_rows % total), p))
    for p in by_loss[:left]:
        shares[p] += 1
    return {p: start[p] + shares.get(p, 0) for p in start}
