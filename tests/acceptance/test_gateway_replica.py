"""`subengine serve --read-dsn` reads from a streaming replica: pages and SSE come from the
replica's connections, and an event appended on the primary reaches an SSE client once
the replica has replayed it (the notification comes from the primary)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import psycopg
import pytest
import web
from helpers import GatewayProcess, Replication, sse_frames, wait_replayed

import subengine

pytestmark = pytest.mark.xdist_group("replica")

TIMEOUT = httpx.Timeout(30.0)


def test_reads_are_served_by_the_replica(streaming_replica: Replication, tmp_path: Path) -> None:
    primary_dsn, replica_dsn = streaming_replica
    with subengine.Engine(primary_dsn) as engine:
        engine.create_stream("gateway_replicated", 2)
        engine.append("gateway_replicated", [subengine.NewEvent("a", "t", {"n": 0})])
        wait_replayed(primary_dsn, replica_dsn, 30)
        env = dict(os.environ, SUBENGINE_DSN=primary_dsn, SUBENGINE_HOME=str(tmp_path / "h"))
        env.pop("SUBENGINE_SCHEMA", None)
        with GatewayProcess(env, "--read-dsn", replica_dsn, tmp=tmp_path) as gateway:
            url = f"{gateway.url}/v1/streams/gateway_replicated/events"
            page = web.get(url, timeout=TIMEOUT).json()
            assert [e["data"]["n"] for e in page["events"]] == [0]
            with psycopg.connect(replica_dsn, autocommit=True) as replica:
                names = {
                    name
                    for (name,) in replica.execute(
                        "SELECT application_name FROM pg_stat_activity"
                        " WHERE datname = current_database()"
                    )
                }
            assert "subengine" in names
            with web.stream(
                "GET", url, params={"live": "sse", "after": page["cursor"]}, timeout=TIMEOUT
            ) as response:
                frames = sse_frames(response.iter_lines())
                assert next(f for f in frames if f.kind != ":").kind == "caught-up"
                engine.append("gateway_replicated", [subengine.NewEvent("a", "t", {"n": 1})])
                got = next(f for f in frames if f.kind == "events")
                assert [e["data"]["n"] for e in got.data["events"]] == [1]
