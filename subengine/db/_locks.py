"""Partition locks: the advisory lock a worker slot holds on a (subscription, partition)
while it works on it, on a lock connection of the slot's own.

Locks only keep workers from wasting effort on one partition; correctness never rests on
them (DESIGN.md invariant 3). The key is computed here and by the SQL function
`lock_class`, so the status views can tell which worker holds which partition.
"""

from __future__ import annotations

import hashlib

from subengine.db._sql import Query, nothing


def lock_key(schema: str, subscription: str, partition: int) -> int:
    """The advisory lock of (subscription, partition): the SQL function lock_class's
    31 bits of MD5 of "schema.subscription", shifted left 32 bits, or'ed with the partition."""
    digest = hashlib.md5(f"{schema}.{subscription}".encode(), usedforsecurity=False).digest()
    return (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) << 32 | partition


def lock_partition(key: int, held: int | None) -> Query[bool]:
    """Take the lock `key` and, only if it was taken, release `held` (None: none held), in
    one round trip; whether it was taken."""
    return Query(
        "lock_partition",
        {"key": key, "held": held},
        lambda result: bool(result.rows and result.rows[0][0]),
    )


def unlock_partition(key: int) -> Query[None]:
    """Give the lock `key` back."""
    return Query("unlock_partition", {"key": key}, nothing)
