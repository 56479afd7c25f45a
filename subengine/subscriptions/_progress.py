"""The progress of a subscription that a reader of its own drives (the Spark data source):
its positions, to start from, and moving them forward as the reader commits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from subengine.db._sql import Db, Query, Row, nothing
from subengine.model._errors import SubscriptionMismatch, SubscriptionNotFound


def subscription_positions(db: Db, name: str, stream: str) -> dict[int, int]:
    """The positions of subscription `name` by partition; it must read `stream`."""
    rows: Sequence[Row] = db.run(Query("spark_subscription", {"name": name}))
    if not rows:
        raise SubscriptionNotFound(
            f"no subscription named {name!r}; create it with "
            f"`subengine subscription create {name} --stream {stream}`"
        )
    if rows[0][0] != stream:
        raise SubscriptionMismatch(
            f"subscription {name!r} reads stream {rows[0][0]!r}, not {stream!r}"
        )
    return {partition: position for _, partition, position in rows if partition is not None}


def advance_positions(name: str, positions: Mapping[int, int]) -> Query[None]:
    """Move subscription `name` forward to `positions` by partition (never back)."""
    params = {"name": name, "partitions": list(positions), "positions": list(positions.values())}
    return Query("spark_advance_subscription", params, nothing)
