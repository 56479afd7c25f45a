"""The `streaming_replica` fixture: a PostgreSQL 15 primary and a replica streaming from it.

What the gateway will need of a read replica: events appended on the primary can be read
through an engine on the replica once it has replayed them, and an append through the
replica fails, saying why.
"""

from __future__ import annotations

import psycopg
import pytest
from helpers import Replication, stored_events, wait_replayed

import subengine
from subengine import NewEvent

# One pair of servers for these tests, not one per xdist worker.
pytestmark = pytest.mark.xdist_group("replica")


def test_an_event_appended_on_the_primary_is_read_on_the_replica(
    streaming_replica: Replication,
) -> None:
    primary_dsn, replica_dsn = streaming_replica
    with subengine.Engine(primary_dsn) as primary, subengine.Engine(replica_dsn) as replica:
        primary.create_stream("replicated", partitions=2)
        [appended] = primary.append("replicated", [NewEvent("k1", "Shipped", {"n": 1})])

        wait_replayed(primary_dsn, replica_dsn, timeout=15)

        [event] = stored_events(replica.read("replicated", appended.partition))
    assert (event.id, event.position, event.data) == (appended.id, appended.position, {"n": 1})


def test_an_append_through_the_replica_fails_as_read_only(streaming_replica: Replication) -> None:
    primary_dsn, replica_dsn = streaming_replica
    with subengine.Engine(primary_dsn) as primary, subengine.Engine(replica_dsn) as replica:
        primary.create_stream("refused", partitions=1)
        wait_replayed(primary_dsn, replica_dsn, timeout=15)

        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction, match="read-only transaction"):
            replica.append("refused", [NewEvent("k1", "Shipped", {"n": 1})])

        assert primary.read("refused", 0) == []
